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
    n = 0
    for r in records:
        out.write(json.dumps(r.to_dict(), separators=(",", ":")) + "\n")
        n += 1
    return n


def parse_call_log(text: str, source: str = "log") -> list[CallRecord]:
    records: list[CallRecord] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            obj = loads_strict(line, where)
        except InputError as exc:
            raise RecordError(str(exc)) from None
        records.append(parse_record(obj, where))
    if not records:
        raise RecordError(f"{source}: no call records")
    return records


def read_call_log(path: str | Path) -> list[CallRecord]:
    return parse_call_log(read_text(path), str(path))
