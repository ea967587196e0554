"""Call logs on disk: JSONL, one :class:`CallRecord` per line, ranks interleaved.

The writer and the reader live together so the format has one definition; the reader
is strict (a malformed line is an error naming the line), since a log that is silently
half-read would give silently wrong iteration times.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Iterable

from falconext.inputs import InputError, loads_strict, read_text
from falconext.trace.records import CallRecord, RecordError, parse_record


def write_call_log(records: Iterable[CallRecord], out: IO[str]) -> int:
    """Write ``records`` to ``out`` as JSON lines (what :func:`parse_call_log` reads); returns how many."""
    n = 0
    for r in records:
        out.write(json.dumps(r.to_dict(), separators=(",", ":")) + "\n")
        n += 1
    return n


def parse_call_log(text: str, source: str = "log") -> list[CallRecord]:
    """The records of a JSONL call log, strictly: a malformed line, a rank whose calls go
    back in time without a ``seq`` to order them (an unordered merge), or a rank whose
    ``seq`` repeats is a :class:`RecordError` naming the line."""
    return parse_call_log_lines(text, source)[0]


def parse_call_log_lines(text: str, source: str = "log") -> tuple[list[CallRecord], list[int]]:
    """:func:`parse_call_log`, with the line number (from 1) of each record, so a check
    made later on the records (too few calls for a rank) can name a line too.

    A last line that is not valid JSON and has no newline after it is reported as a
    log cut mid-record (a copy or a writer interrupted), not as some JSON syntax error."""
    records: list[CallRecord] = []
    lines: list[int] = []
    last: dict[int, tuple[CallRecord, int]] = {}  # rank -> its previous record and line
    seen_seq: dict[int, dict[int, int]] = {}  # rank -> seq -> line
    # JSON Lines end a line at "\n" only ("\r\n" leaves a "\r", which JSON reads as
    # whitespace): str.splitlines would also split at a raw U+2028 inside a string
    physical = text.split("\n")
    cut = bool(physical[-1].strip())  # no newline after the last line
    for lineno, line in enumerate(physical, 1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            obj = loads_strict(line, where)
        except InputError as exc:
            if cut and lineno == len(physical):
                raise RecordError(f"{where}: malformed JSON and no newline after it: the log was cut "
                                  f"mid-record (truncated)") from None
            raise RecordError(str(exc)) from None
        record = parse_record(obj, where)
        if record.seq is not None:
            earlier = seen_seq.setdefault(record.rank, {}).setdefault(record.seq, lineno)
            if earlier != lineno:
                raise RecordError(f"{where}: rank {record.rank} seq {record.seq} again (first on line {earlier})")
        prev = last.get(record.rank)
        if prev is not None and (record.seq is None or prev[0].seq is None) and record.t_issue < prev[0].t_issue:
            raise RecordError(
                f"{where}: rank {record.rank}'s call was issued {prev[0].t_issue - record.t_issue:.6g} s before its "
                f"previous one (line {prev[1]}); sort the log by t_issue or give every record a seq"
            )
        last[record.rank] = (record, lineno)
        records.append(record)
        lines.append(lineno)
    if not records:
        raise RecordError(f"{source}: no call records")
    return records, lines


def read_call_log(path: str | Path) -> list[CallRecord]:
    """The records of the call log at ``path`` (see :func:`parse_call_log`)."""
    return parse_call_log(read_text(path), str(path))


def read_call_log_lines(path: str | Path) -> tuple[list[CallRecord], list[int]]:
    """The records of the call log at ``path`` and their line numbers."""
    return parse_call_log_lines(read_text(path), str(path))
