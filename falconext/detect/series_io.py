"""Reading iteration-time series from files, strictly.

Three shapes are accepted, chosen by extension and, failing that, by the first
character: a CSV with an ``iter_time`` (or ``iter_time_s``) column, optionally a ``rank``
column that splits it into one series per rank; a JSON list of numbers; JSONL with one
object per line carrying ``id`` and ``iter_times`` (and, for evaluation, ``events``
labels). Every problem is reported as one :class:`InputError` naming the file, the line
and the field, because these files come from other tools and other people.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from falconext.detect.events import InvalidSample, check_sample
from falconext.inputs import InputError, loads_strict, read_text


@dataclass(frozen=True)
class Series:
    """One iteration-time series: an id (rank, job, or None), its times in seconds, and
    for evaluation its labels (onset, end or None, slowdown) and kind."""

    id: Any
    iter_times: list[float]
    labels: list[tuple[int, int | None, float]] | None = None
    kind: str | None = None


@dataclass(frozen=True)
class SeriesFile:
    """What a file held: its format (csv, json or jsonl) and its series in file order."""

    format: str  # "csv", "json" or "jsonl"
    series: list[Series]


TIME_COLUMNS = ("iter_time", "iter_time_s")


def read_series(path: str | Path) -> SeriesFile:
    """Read the series of ``path`` (format from the extension, else the first character).
    Raises InputError naming the file, line and field for anything that is not a valid
    series: a missing file, bad JSON, a missing column, a value that is not a finite
    positive number."""
    text = read_text(path)
    fmt = _format_of(Path(path), text)
    if fmt == "csv":
        return SeriesFile("csv", _read_csv(str(path), text))
    if fmt == "json":
        return SeriesFile("json", [Series(None, _read_json_list(str(path), text))])
    return SeriesFile("jsonl", _read_jsonl(str(path), text))


def _format_of(path: Path, text: str) -> str:
    suffix = path.suffix.lower()
    if suffix in (".csv", ".json", ".jsonl"):
        return suffix[1:]
    head = text.lstrip()[:1]
    return {"[": "json", "{": "jsonl"}.get(head, "csv")


def _times(values: Any, where: str, name: str = "iter_times") -> list[float]:
    if not isinstance(values, list):
        raise InputError(f"{where}: {name} must be a list of numbers")
    if not values:
        raise InputError(f"{where}: {name} is empty")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InputError(f"{where}: iteration {i}: not a number ({v!r})")
        try:
            out.append(check_sample(v, i))
        except InvalidSample as exc:
            raise InputError(f"{where}: {exc}") from None
    return out


def _read_json_list(path: str, text: str) -> list[float]:
    data = loads_strict(text, path)
    if not isinstance(data, list):
        raise InputError(f"{path}: expected a JSON list of iteration times, got {type(data).__name__}")
    return _times(data, path, "the list of iteration times")


def _read_jsonl(path: str, text: str) -> list[Series]:
    out: list[Series] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        obj = loads_strict(line, where)
        if not isinstance(obj, dict):
            raise InputError(f"{where}: expected a JSON object with 'id' and 'iter_times'")
        if "iter_times" not in obj:
            raise InputError(f"{where}: missing field 'iter_times'")
        if "id" not in obj:
            raise InputError(f"{where}: missing field 'id'")
        times = _times(obj["iter_times"], where)
        labels = _labels(obj["events"], len(times), where) if "events" in obj else None
        kind = obj.get("kind")
        out.append(Series(obj["id"], times, labels, kind if isinstance(kind, str) else None))
    if not out:
        raise InputError(f"{path}: no series found")
    return out


def _labels(raw: Any, n: int, where: str) -> list[tuple[int, int | None, float]]:
    if not isinstance(raw, list):
        raise InputError(f"{where}: events must be a list of [onset, end, slowdown]")
    out = []
    for k, ev in enumerate(raw):
        if not (isinstance(ev, list) and len(ev) == 3):
            raise InputError(f"{where}: events[{k}] must be [onset, end, slowdown]")
        onset, end, slow = ev
        if isinstance(onset, bool) or not isinstance(onset, int) or not 0 <= onset < n:
            raise InputError(f"{where}: events[{k}]: onset must be an iteration index in [0, {n})")
        if end is not None and (isinstance(end, bool) or not isinstance(end, int) or not onset < end <= n):
            raise InputError(f"{where}: events[{k}]: end must be null or an index in ({onset}, {n}]")
        if isinstance(slow, bool) or not isinstance(slow, (int, float)) or not math.isfinite(slow):
            raise InputError(f"{where}: events[{k}]: slowdown must be a finite number")
        out.append((onset, end, float(slow)))
    return out


def _read_csv(path: str, text: str) -> list[Series]:
    reader = csv.reader(io.StringIO(text))
    try:
        header = [h.strip() for h in next(reader)]
    except (StopIteration, csv.Error) as exc:
        raise InputError(f"{path}: cannot read the CSV header ({exc})") from None
    col = next((header.index(c) for c in TIME_COLUMNS if c in header), None)
    if col is None:
        raise InputError(
            f"{path}: no 'iter_time' column (columns: {', '.join(header) or 'none'})"
        )
    rank_col = header.index("rank") if "rank" in header else None
    by_rank: dict[Any, list[float]] = {}
    try:
        for row in reader:
            if not row or all(not c.strip() for c in row):
                continue
            where = f"{path}:{reader.line_num}"
            if len(row) != len(header):
                raise InputError(f"{where}: {len(row)} fields, header has {len(header)}")
            key = row[rank_col].strip() if rank_col is not None else None
            series = by_rank.setdefault(key, [])
            cell = row[col].strip()
            try:
                value = float(cell)
            except ValueError:
                raise InputError(f"{where}: {header[col]} {cell!r} is not a number") from None
            try:
                series.append(check_sample(value, len(series)))
            except InvalidSample as exc:
                raise InputError(f"{where}: {exc}") from None
    except csv.Error as exc:
        raise InputError(f"{path}: malformed CSV ({exc})") from None
    if not by_rank:
        raise InputError(f"{path}: no iteration times (header only)")
    return [Series(_rank_id(k), v) for k, v in by_rank.items()]


def _rank_id(key: str | None) -> Any:
    if key is None:
        return None
    return int(key) if key.isdigit() else key
