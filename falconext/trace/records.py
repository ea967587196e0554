"""Collective call records: the one data type that flows from interception to detection.

A record is plain data so the detector can be fed from a live hook, a JSONL log or a
generator alike. Parsing is strict because logs cross process and machine boundaries:
a record with a missing or mistyped field is rejected with its field named, never guessed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _json_str
from typing import Any, Mapping


class RecordError(ValueError):
    """A call record is malformed; the message names the field."""


@dataclass(frozen=True, slots=True)
class CallRecord:
    """One intercepted torch.distributed call of one rank: op, group, bytes, issue time,
    start and end (None where unknown), the rank's sequence number, the group's members
    and the peer of a point-to-point call."""

    rank: int
    op: str
    group: str
    bytes: int
    t_issue: float
    t_start: float | None = None
    t_end: float | None = None
    seq: int | None = None
    #: global ranks of the group's members in group-rank order (index = group rank), so a
    #: consumer can tell ring neighbours apart; ``group`` holds them sorted
    group_ranks: tuple[int, ...] | None = None
    #: parallelism role of the group ("dp", "tp", "pp", "world", ...) when known
    role: str | None = None
    #: global rank of the other side of a point-to-point call
    peer: int | None = None

    def to_json(self) -> str:
        """:meth:`to_dict` as one compact JSON object, written by hand: every call of a job
        is logged, and ``json.dumps`` of the dict cost two thirds of the monitor's time per
        call. ``json.loads`` of it equals :meth:`to_dict`; a non-finite time raises
        RecordError."""
        parts = [f'{{"rank":{int(self.rank)},"op":{_json_str(self.op)},"group":{_json_str(self.group)},'
                 f'"bytes":{int(self.bytes)},"t_issue":{_json_number(self.t_issue)}']
        if self.t_start is not None:
            parts.append(f',"t_start":{_json_number(self.t_start)}')
        if self.t_end is not None:
            parts.append(f',"t_end":{_json_number(self.t_end)}')
        if self.seq is not None:
            parts.append(f',"seq":{int(self.seq)}')
        if self.group_ranks is not None:
            parts.append(',"group_ranks":[' + ",".join(str(int(r)) for r in self.group_ranks) + "]")
        if self.role is not None:
            parts.append(f',"role":{_json_str(self.role)}')
        if self.peer is not None:
            parts.append(f',"peer":{int(self.peer)}')
        parts.append("}")
        return "".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON-able values, fields that are None left out (what :func:`parse_record` reads
        back)."""
        # field by field, not dataclasses.asdict (which deep-copies): every call of a job
        # goes through here on its way to the call log
        out: dict[str, Any] = {"rank": self.rank, "op": self.op, "group": self.group, "bytes": self.bytes,
                               "t_issue": self.t_issue}
        for name in _OPTIONAL_FIELDS:
            value = getattr(self, name)
            if value is not None:
                out[name] = list(value) if name == "group_ranks" else value  # JSON has no tuples
        return out


def _json_number(value: float | int) -> str:
    """``value`` as JSON writes it (a float's repr), refusing what JSON has no form for."""
    if isinstance(value, float) and not math.isfinite(value):
        raise RecordError(f"a call record's time must be finite, got {value}")
    return repr(value)


_REQUIRED = ("rank", "op", "group", "bytes", "t_issue")
#: the fields after the required ones, in declaration order
_OPTIONAL_FIELDS = ("t_start", "t_end", "seq", "group_ranks", "role", "peer")
_OPTIONAL_TIMES = ("t_start", "t_end")


def parse_record(obj: Any, where: str = "record") -> CallRecord:
    """Build a CallRecord from a decoded JSON object, rejecting anything ambiguous."""
    if not isinstance(obj, Mapping):
        raise RecordError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in _REQUIRED if k not in obj]
    if missing:
        raise RecordError(f"{where}: missing field(s) {', '.join(missing)}")
    rank = _int(obj["rank"], "rank", where)
    if rank < 0:
        raise RecordError(f"{where}: rank must be >= 0, got {rank}")
    op = obj["op"]
    if not isinstance(op, str) or not op:
        raise RecordError(f"{where}: op must be a non-empty string")
    group = obj["group"]
    if isinstance(group, (int, str)) and not isinstance(group, bool):
        group = str(group)
    else:
        raise RecordError(f"{where}: group must be a string or integer id")
    nbytes = _int(obj["bytes"], "bytes", where)
    if nbytes < 0:
        raise RecordError(f"{where}: bytes must be >= 0, got {nbytes}")
    t_issue = _time(obj["t_issue"], "t_issue", where)
    times: dict[str, float | None] = {}
    for key in _OPTIONAL_TIMES:
        value = obj.get(key)
        times[key] = None if value is None else _time(value, key, where)
    seq = obj.get("seq")
    seq = None if seq is None else _int(seq, "seq", where)
    return CallRecord(
        rank, op, group, nbytes, t_issue, times["t_start"], times["t_end"], seq,
        _group_ranks(obj.get("group_ranks"), where),
        _role(obj.get("role"), where),
        _peer(obj.get("peer"), where),
    )


def _group_ranks(value: Any, where: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise RecordError(f"{where}: group_ranks must be a list of ranks")
    ranks = tuple(_int(r, "group_ranks", where) for r in value)
    if any(r < 0 for r in ranks) or len(set(ranks)) != len(ranks):
        raise RecordError(f"{where}: group_ranks must be distinct ranks >= 0")
    return ranks


def _role(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise RecordError(f"{where}: role must be a non-empty string")
    return value


def _peer(value: Any, where: str) -> int | None:
    if value is None:
        return None
    peer = _int(value, "peer", where)
    if peer < 0:
        raise RecordError(f"{where}: peer must be >= 0, got {peer}")
    return peer


def _int(value: Any, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RecordError(f"{where}: {name} must be an integer, got {value!r}")
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise RecordError(f"{where}: {name} must be an integer, got {value!r}")
        value = int(value)
    return value


def _time(value: Any, name: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RecordError(f"{where}: {name} must be a number of seconds, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise RecordError(f"{where}: {name} is not finite ({value!r})")
    if value < 0:
        raise RecordError(f"{where}: {name} must be >= 0, got {value!r}")
    return value
