"""The wire: the protocol's dataclasses as JSON, with a schema version and a size cap.

Everything on the bus comes from the network, so decoding is strict and never
evaluates anything: a size limit, one JSON object ``{"v": version, "type": name,
"body": {...}}``, a known type, exactly the dataclass's fields, and every field of the
declared type (finite numbers, no bool passing for int). A message that fails any of
this raises :class:`MessageError` naming the problem; the agent logs and drops it.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Callable, Union

import numpy as np
import orjson

from falconext.protocol.actions import MitigationAction
from falconext.protocol.base import MessageError
from falconext.protocol.commands import COMMAND_KINDS, ENVELOPE, Command, ValidationPlan, ValidationShare
from falconext.protocol.messages import (
    HEARTBEAT_COLUMNS,
    CommandReply,
    FailSlowReport,
    Heartbeat,
    BATCH_KINDS,
    Localized,
    NodeBatch,
    NodeHealth,
    NodeHeartbeats,
    ProfileData,
    RankEvent,
    SessionAck,
    HEARTBEAT_FIELDS,
    HEARTBEAT_INTS,
    StatusSnapshot,
    ValidationResult,
    MAX_EXACT,
    block_plan,
    batch_columns,
    heartbeat_block,
)

SCHEMA_VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024
#: a status snapshot lists every rank: it is stored in a key, not a stream, and may be larger
MAX_STATUS_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class CommandWire:
    """The body of every command on the wire (message type ``Command``), whatever its kind:
    ``kind`` names the class (:data:`~falconext.protocol.commands.COMMAND_KINDS`), the
    command's fields of :data:`~falconext.protocol.commands.ENVELOPE` are at the top, its
    others in ``args``. Decoded strictly like any message, then into the command by
    :func:`_command`."""

    kind: str
    deadline_s: float
    iteration: int | None = None
    args: dict[str, Any] = field(default_factory=dict)
    action: MitigationAction | None = None
    validation: ValidationPlan | None = None
    share: ValidationShare | None = None


#: the message types by their name on the wire (every command travels as "Command")
MESSAGE_TYPES: dict[str, type] = {
    "Command" if cls is CommandWire else cls.__name__: cls
    for cls in (FailSlowReport, Heartbeat, NodeHeartbeats, NodeBatch, ProfileData, SessionAck, ValidationResult, RankEvent, NodeHealth,
                Localized, CommandWire, CommandReply, StatusSnapshot)
}
_COMMAND_CLASSES = frozenset(COMMAND_KINDS.values())


def encode(msg: Any) -> str:
    """The JSON text of ``msg`` with the schema version and type name, as :func:`decode`
    reads it. Raises MessageError for an object that is not one of the message types,
    and ValueError for a NaN or infinite number in it."""
    if type(msg) in _COMMAND_CLASSES:
        name, msg = "Command", command_wire(msg)
    else:
        name = type(msg).__name__
        if MESSAGE_TYPES.get(name) is not type(msg):
            raise MessageError(f"not a message type: {name}")
    return json.dumps({"v": SCHEMA_VERSION, "type": name, "body": _data(msg)}, separators=(",", ":"), allow_nan=False)


def command_args(cmd: Command) -> dict[str, Any]:
    """A command's ``args`` as the wire has them: its fields outside the envelope, in their
    order, an optional one left out while None."""
    declared, _ = _schema(type(cmd))
    out = {}
    for name, f in declared.items():
        value = getattr(cmd, name)
        if name not in ENVELOPE and not (value is None and f.default is None):
            out[name] = value
    return out


def command_wire(cmd: Command) -> CommandWire:
    """``cmd`` in the one shape every command has on the wire."""
    declared, _ = _schema(type(cmd))
    envelope = {name: getattr(cmd, name) if name in declared else default for name, default in ENVELOPE.items()}
    return CommandWire(type(cmd).KIND, args=command_args(cmd), **envelope)


def _command(wire: CommandWire) -> Any:
    """The command ``wire`` holds: its kind's class, with the envelope fields that class has
    (the others must be as :data:`ENVELOPE` sends them) and exactly its other fields in
    ``args``, each of its declared type, then the class's own ``check``."""
    cls = COMMAND_KINDS.get(wire.kind)
    if cls is None:
        raise MessageError(f"Command: unknown kind {wire.kind!r} (expected one of {', '.join(sorted(COMMAND_KINDS))})")
    where = f"Command({wire.kind})"
    declared, hints = _schema(cls)
    values: dict[str, Any] = {}
    for name, default in ENVELOPE.items():
        value = getattr(wire, name)
        f = declared.get(name)
        if f is None:
            if value != default:
                raise MessageError(f"{where}.{name}: a {wire.kind} command has none, got {value!r}")
        elif value is None and f.default is MISSING:
            raise MessageError(f"{where}: missing field {name}")
        else:
            values[name] = value
    unknown = sorted(set(wire.args) - {name for name in declared if name not in ENVELOPE})
    if unknown:
        raise MessageError(f"{where}.args: unknown field(s) {', '.join(map(str, unknown))}")
    for name, f in declared.items():
        if name in ENVELOPE:
            continue
        if name not in wire.args:
            if f.default is not MISSING or f.default_factory is not MISSING:
                continue
            raise MessageError(f"{where}.args: missing field {name}")
        values[name] = _check(wire.args[name], hints[name], f"{where}.args.{name}")
    cmd = cls(**values)
    check = getattr(cmd, "check", None)
    if check is not None:
        check()
    return cmd


#: values JSON takes as they are (checked by exact type: the encoder's hot path)
_PLAIN = frozenset({int, float, str, bool, type(None)})


def _data(obj: Any) -> Any:
    """``obj`` as plain JSON data: a dataclass as the object of its fields (a tagged one,
    such as an action, led by its ``kind``), lists and objects item by item."""
    t = type(obj)
    if t in _PLAIN:
        return obj
    if t is list and set(map(type, obj)) <= _LIST and set(map(type, itertools.chain.from_iterable(obj))) <= _PLAIN:
        return obj  # rows of plain values (a validation share's pairs): as they are
    if t is list or t is tuple:  # the long ones (call rows, heartbeat rows): plain items as they are
        return [v if type(v) in _PLAIN else _data(v) for v in obj]
    if t is dict:
        return {k: v if type(v) in _PLAIN else _data(v) for k, v in obj.items()}
    if is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: _data(getattr(obj, f.name)) for f in fields(obj)}
        kind = getattr(type(obj), "KIND", None)
        return {"kind": kind, **out} if kind is not None else out
    if isinstance(obj, (list, tuple)):
        return [_data(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _data(v) for k, v in obj.items()}
    return obj


@functools.lru_cache(maxsize=None)
def _schema(cls: type) -> tuple[dict[str, Any], dict[str, Any]]:
    """A message class's fields by name and their resolved type hints, worked out once per
    class (resolving hints took three quarters of decoding a message: at thousands of
    ranks' heartbeats a second, the controller's main cost)."""
    return {f.name: f for f in fields(cls)}, typing.get_type_hints(cls)



#: how a fail-slow report (a rank's, or a node's batch of them) begins as :func:`encode` writes it
_REPORT_START = re.compile(r'\{"v":\d+,"type":"(?:FailSlowReport"|NodeBatch","body":\{"node":\d+,"kind":"FailSlowReport")')
_REPORT_START_BYTES = re.compile(_REPORT_START.pattern.encode())


def looks_like_report(data: str | bytes) -> bool:
    """Whether ``data`` begins as an encoded fail-slow report or a node's batch of them:
    a look at its first bytes, for scheduling only (a reader that puts reports aside
    decodes them strictly later; a text that only looks like one is dropped then)."""
    head = data[:120]
    pattern = _REPORT_START_BYTES if isinstance(head, bytes) else _REPORT_START
    return pattern.match(head) is not None  # type: ignore[arg-type]


def decode(data: str | bytes, accept: set[str] | None = None, max_bytes: int = MAX_MESSAGE_BYTES) -> Any:
    """Parse one message; ``accept`` limits the types this receiver handles; ``max_bytes``
    bounds its size (only a status snapshot's reader raises it)."""
    if len(data) > max_bytes:
        unit = "bytes" if isinstance(data, bytes) else "characters"
        raise MessageError(f"message of {len(data)} {unit} exceeds {max_bytes}")
    try:
        # orjson: strict RFC 8259 (no NaN or Infinity, no lone surrogate, UTF-8 only) and
        # several times faster than json, which took most of a node's heartbeats' decoding
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        obj = _slow_parse(data)
    if not isinstance(obj, dict) or set(obj) != {"v", "type", "body"}:
        raise MessageError("expected an object with exactly v, type and body")
    if obj["v"] != SCHEMA_VERSION or isinstance(obj["v"], bool):
        raise MessageError(f"unsupported schema version {obj['v']!r} (this side speaks {SCHEMA_VERSION})")
    name = obj["type"]
    cls = MESSAGE_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise MessageError(f"unknown message type {name!r}")
    if accept is not None and name not in accept:
        raise MessageError(f"message type {name} is not accepted here")
    body = obj["body"]
    if not isinstance(body, dict):
        raise MessageError(f"{name}: body must be an object")
    if cls is NodeBatch:
        return _build_batch(body)
    if cls is NodeHeartbeats:
        fast = _heartbeats_fast(body)
        if fast is not None:
            return fast
    msg = _build(cls, body, name)
    return _command(msg) if cls is CommandWire else msg


def _heartbeats_fast(body: dict[str, Any]) -> NodeHeartbeats | None:
    """A NodeHeartbeats whose body is right, checked with a few passes in C over all its
    values (exactly node, columns and rows; every value a finite int or float, no bool),
    then its own check; None when anything is in doubt (the caller then takes the way that
    names the bad value). The controller reads thousands of these a second."""
    if body.keys() != {"node", "columns", "rows"}:
        return None
    node, columns, rows = body["node"], body["columns"], body["rows"]
    if type(node) is not int or type(columns) is not list or type(rows) is not list:
        return None
    if not set(map(type, columns)) <= {str} or not set(map(type, rows)) <= {list}:
        return None
    if not _finite_numbers(list(itertools.chain.from_iterable(rows))):
        return None
    msg = NodeHeartbeats(node, columns, rows)
    msg.check()  # MessageError naming the row and column
    return msg


#: the types a heartbeat row's values may have (exactly: a bool is not a number here)
_NUMBERS = frozenset({int, float})


def _build_batch(body: dict[str, Any]) -> NodeBatch:
    """A NodeBatch from its JSON body: its own shape (NodeBatch.check), then every value
    of its rows of the declared type of its column's field, a column at a time (the
    fast way for plain columns; any doubt goes the way that names the bad value), then
    each message's own check."""
    if set(body) != {"node", "kind", "columns", "rows"}:
        raise MessageError(f"NodeBatch: expected exactly node, kind, columns and rows, got {sorted(body)}")
    node, kind, columns, rows = body["node"], body["kind"], body["columns"], body["rows"]
    if type(node) is not int or type(kind) is not str:
        raise MessageError("NodeBatch: node must be an integer and kind a string")
    if type(columns) is not list or not set(map(type, columns)) <= {str}:
        raise MessageError("NodeBatch.columns: expected a list of strings")
    if type(rows) is not list or not set(map(type, rows)) <= _LIST:
        raise MessageError("NodeBatch.rows: expected a list of lists")
    outer = NodeBatch(node, kind, columns, rows)
    outer.check()
    _, hints = _schema(BATCH_KINDS[outer.kind])
    cols = []
    same = True  # every column's values kept as sent: the rows stand as they are
    for j, (name, col) in enumerate(zip(outer.columns, map(list, zip(*rows)))):
        hint = hints[name]
        fast = _column(col, hint)
        if fast is None:
            fast = [_check(v, hint, f"NodeBatch({outer.kind}).rows[{i}].{name}") for i, v in enumerate(col)]
        same = same and fast is col
        cols.append(fast)
    batch = outer if same else NodeBatch(outer.node, outer.kind, outer.columns, [list(r) for r in zip(*cols)])
    # each message's own check, as a message decoded alone gets; the messages are kept
    # for NodeBatch.messages (not a field: never encoded, never compared)
    object.__setattr__(batch, "_made", batch.messages())
    return batch


def _column(col: list[Any], hint: Any) -> list[Any] | None:
    """A batch's column of values, each checked against ``hint`` as :func:`_check` would
    (a float field's numbers made floats; numbers inside rows, groups' roles and members
    kept as sent, the column itself returned), without a call or a path string per
    value; None when in doubt or for a hint it has no fast way for (the caller then takes
    the way that names the bad value)."""
    if hint is int or hint is str or hint is bool:
        return col if set(map(type, col)) <= {hint} else None
    if hint is float:
        return _finite_floats(col)
    origin, args = _hint(hint)
    if origin in (Union, types.UnionType) and len(args) == 2 and type(None) in args:  # X | None
        present = _column([v for v in col if v is not None], args[0] if args[1] is type(None) else args[1])
        if present is None:
            return None
        it = iter(present)
        return [None if v is None else next(it) for v in col]
    if origin is dict:  # the profiles' groups: string keys (JSON's), values of a fast kind
        item = _fast_check(args[1])
        if item is None or not set(map(type, col)) <= _DICT:
            return None
        # the values kept as sent, checked over every rank's at once: the profiles' call
        # rows, groups' roles and members
        at_once = _AT_ONCE.get(item)
        if at_once is not None:
            return col if at_once([v for d in col for v in d.values()]) else None
        out = [{k: item(v) for k, v in d.items()} for d in col]
        return None if any(None in d.values() for d in out) else out
    fast = _fast_check(hint)
    if fast is None:
        return None
    if fast is _float_rows:  # rows of numbers (validation results' links): every rank's at once
        return _many_float_rows(col)
    out = [fast(v) for v in col]
    return None if any(v is None for v in out) else out


def _build(cls: type, body: dict[str, Any], where: str) -> Any:
    """An instance of the dataclass ``cls`` from the JSON object ``body``: exactly its
    fields (and, for a tagged class, its ``kind``), each of its declared type, then its
    own ``check`` (the shape of rows inside lists, allowed values)."""
    declared, hints = _schema(cls)
    kind = getattr(cls, "KIND", None)
    if kind is not None:
        if body.get("kind") != kind:
            raise MessageError(f"{where}: kind {body.get('kind')!r} is not {kind!r}")
        body = {k: v for k, v in body.items() if k != "kind"}
    unknown = sorted(set(body) - set(declared))
    if unknown:
        raise MessageError(f"{where}: unknown field(s) {', '.join(map(str, unknown))}")
    values = {}
    for fname, f in declared.items():
        if fname not in body:
            if f.default is not MISSING or f.default_factory is not MISSING:
                continue  # optional: the dataclass default applies
            raise MessageError(f"{where}: missing field {fname}")
        value, hint = body[fname], hints[fname]
        kind_of = type(value)
        # the plain fields that are right, without _check's call and its path's string
        if kind_of is hint and (hint is int or hint is str or hint is bool):
            values[fname] = value
        elif hint is float and kind_of is float and math.isfinite(value):
            values[fname] = value
        else:
            values[fname] = _check(value, hint, f"{where}.{fname}")
    try:
        msg = cls(**values)
    except TypeError as exc:
        raise MessageError(f"{where}: {exc}") from None
    check = getattr(msg, "check", None)
    if check is not None:
        check()  # MessageError naming the problem
    return msg


def _finite(value: int | float) -> bool:
    """A finite number, also for an integer too large for a float (which is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _slow_parse(data: str | bytes) -> Any:
    """``data``, refused by the fast parser, parsed by json, whose errors name the value
    (NaN, Infinity) where orjson gives a position, and which reads what orjson refuses
    but the schema may name better (a lone surrogate, an integer of 400 digits): only bad
    input takes this way. MessageError (one line) for what is not JSON."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError:
            raise MessageError("message is not UTF-8") from None
    try:
        return _JSON.decode(data)
    except (json.JSONDecodeError, MessageError) as exc:
        raise MessageError(f"malformed JSON: {exc}") from None
    except RecursionError:
        raise MessageError("malformed JSON: nested too deeply") from None


def _no_constant(name: str) -> float:
    raise MessageError(f"{name} is not allowed")


#: the slow parser that names what is wrong (json.loads with an option builds a new one per call)
_JSON = json.JSONDecoder(parse_constant=_no_constant)


@functools.lru_cache(maxsize=None)
def _union_parts(hint: Any) -> tuple[dict[str, type], type | None]:
    """A union hint's tagged classes by ``kind`` (the actions), and its one dataclass when
    it is an optional part (``X | None``); resolved once per hint, not per message."""
    options = typing.get_args(hint)
    tagged = {getattr(o, "KIND"): o for o in options if is_dataclass(o) and hasattr(o, "KIND")}
    rest = [o for o in options if o is not type(None)]
    return tagged, rest[0] if len(rest) == 1 and is_dataclass(rest[0]) else None


@functools.lru_cache(maxsize=None)
def _is_class(hint: Any) -> bool:
    """Whether a type hint is a message class (a dataclass), worked out once per hint."""
    return is_dataclass(hint)


@functools.lru_cache(maxsize=None)
def _hint(hint: Any) -> tuple[Any, tuple[Any, ...]]:
    """A type hint's origin and arguments, worked out once per hint."""
    return typing.get_origin(hint), typing.get_args(hint)


def _check(value: Any, hint: Any, where: str) -> Any:
    # the plain types first: they are most of the values of a message
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise MessageError(f"{where}: expected true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise MessageError(f"{where}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and _finite(value):
            return float(value)
        raise MessageError(f"{where}: expected a finite number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise MessageError(f"{where}: expected a string")
    origin, args = _hint(hint)
    if origin in (Union, types.UnionType):
        options = args
        if value is None and type(None) in options:
            return None
        tagged, part = _union_parts(hint)
        if tagged:  # a tagged union (the actions): "kind" names the class, whose errors are kept
            if not isinstance(value, dict):
                raise MessageError(f"{where}: expected an object")
            kind = value.get("kind")
            cls = tagged.get(kind) if isinstance(kind, str) else None
            if cls is None:
                raise MessageError(f"{where}: unknown kind {kind!r} (expected one of {', '.join(sorted(tagged))})")
            return _build(cls, value, f"{where}({kind})")
        if part is not None:  # an optional part: its own errors are kept
            return _check(value, part, where)
        for opt in options:
            if opt is type(None):
                continue
            try:
                return _check(value, opt, where)
            except MessageError:
                continue
        raise MessageError(f"{where}: {value!r} is not a {hint}")
    if hint is Any:
        return _check_json_value(value, where)
    if _is_class(hint):
        if not isinstance(value, dict):
            raise MessageError(f"{where}: expected an object")
        return _build(hint, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise MessageError(f"{where}: expected a list")
        (item,) = args
        # fast paths for the long lists (group members, call rows, heartbeat rows); any
        # doubt goes the slow way, which names the bad item
        fast = _fast_check(hint)
        if fast is not None:
            out = fast(value)
            if out is not None:
                return out
        return [_check(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise MessageError(f"{where}: expected an object")
        _, item = args
        fast = _fast_check(item)
        if fast is not None:  # the profiles' groups: no call and no path string per value
            out = {k: fast(v) for k, v in value.items()}
            if None not in out.values():
                return out
        return {k: _check(v, item, f"{where}.{k}") for k, v in value.items()}
    raise MessageError(f"{where}: unsupported field type {hint}")  # pragma: no cover


def _plain_str(value: Any) -> str | None:
    return value if type(value) is str else None


def _int_list(value: Any) -> list[int] | None:
    return value if type(value) is list and all(type(v) is int for v in value) else None


def _int_rows(value: Any) -> list[list[int]] | None:
    """``value`` when it is a list of lists of integers (no bools), else None (a validation
    share's pair rows: thousands in each of the hundreds of shares of a 100k-rank plan)."""
    if type(value) is not list or not set(map(type, value)) <= _LIST:
        return None
    return value if set(map(type, itertools.chain.from_iterable(value))) <= {int} else None


def _float_rows(value: Any) -> list[list[float]] | None:
    """``value`` when it is a list of lists of finite numbers (no bools; kept as sent, as
    :func:`_many_float_rows` keeps them), else None."""
    made = _many_float_rows([value])
    return None if made is None else made[0]


def _many_float_rows(values: list[Any]) -> list[list[list[float]]] | None:
    """``values`` when each is rows of finite numbers (no bools), checked over all their
    numbers at once (a batch's every rank's rows), else None. The numbers stay as sent:
    an integer is a float's value (typing's numeric tower), and making a float of each of
    the million numbers of a 100k-rank job's profiles took a second."""
    if not set(map(type, values)) <= _LIST:
        return None
    rows = list(itertools.chain.from_iterable(values))
    if not set(map(type, rows)) <= _LIST or not _finite_numbers(list(itertools.chain.from_iterable(rows))):
        return None
    return values


@functools.lru_cache(maxsize=None)
def _fast_check(hint: Any) -> Any:
    """For the value types of the long objects (a string, a list of integers, of finite
    numbers, rows of them): a check that returns the value as its field holds it, or None
    when in doubt (the caller then takes the way that names the bad item); None for other
    hints."""
    if hint is str:
        return _plain_str
    shape = _hint(hint)
    if shape == (list, (int,)):
        return _int_list
    if shape[0] is list and _hint(shape[1][0]) == (list, (int,)):
        return _int_rows
    if shape == (list, (float,)):
        return _finite_floats
    if shape[0] is list and _hint(shape[1][0]) == (list, (float,)):
        return _float_rows
    return None


def _finite_floats(value: Any) -> list[float] | None:
    """``value`` as a list of finite floats when it is a list of finite numbers (no
    bools), else None (the caller then takes the way that names the bad item)."""
    if type(value) is not list or not _finite_numbers(value):
        return None
    return value if set(map(type, value)) <= {float} else list(map(float, value))


def _finite_numbers(values: list[Any]) -> bool:
    """Whether every one of ``values`` is a finite number (no bools; an integer too large
    for a float is not)."""
    if not set(map(type, values)) <= _NUMBERS:
        return False
    try:
        if len(values) < _MANY:
            return all(map(math.isfinite, values))
        return bool(np.isfinite(np.array(values, dtype=np.float64)).all())
    except OverflowError:  # an integer too large for a float
        return False


#: from this many numbers on, :func:`_finite_numbers` checks them as one array
_MANY = 256


#: a fast check -> the check of many values at once, for those that keep values as sent
_AT_ONCE: dict[Any, Callable[[list[Any]], bool]] = {
    _float_rows: lambda values: _many_float_rows(values) is not None,
    _int_list: lambda values: _int_rows(values) is not None,
    _plain_str: lambda values: set(map(type, values)) <= {str},
}
_LIST = frozenset({list})
_DICT = frozenset({dict})


def _check_json_value(value: Any, where: str, depth: int = 0) -> Any:
    """Plain JSON data (evidence, command args), bounded in depth; numbers finite."""
    if depth > 8:
        raise MessageError(f"{where}: nested too deeply")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise MessageError(f"{where}: numbers must be finite")
        return value
    if isinstance(value, list):
        return [_check_json_value(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {str(k): _check_json_value(v, f"{where}.{k}", depth + 1) for k, v in value.items()}
    raise MessageError(f"{where}: not JSON data")  # pragma: no cover


def decode_heartbeats(raws: Sequence[str | bytes]) -> tuple[np.ndarray, list[tuple[int, str]]]:
    """The heartbeats in ``raws`` (each a NodeHeartbeats or a Heartbeat message) as one
    block: exactly the rows :func:`decode` then
    :func:`~falconext.protocol.messages.heartbeat_block` give for them, in order; and the
    index and one-line reason of each that does not decode as one (left out).

    A beat reader's read of a thousand node messages is checked at once: the JSON of
    each, then every value of all of them in a few passes over arrays. Anything in doubt
    (another message type, a float where the fast way wants an int, any value wrong) takes
    :func:`decode`'s way one message at a time, which names the problem."""
    fast = _heartbeats_at_once(raws)
    if fast is not None:
        return fast, []
    msgs: list[NodeHeartbeats | Heartbeat] = []
    errors: list[tuple[int, str]] = []
    for i, raw in enumerate(raws):
        try:
            msgs.append(decode(raw, accept=_BEAT_TYPES))
        except MessageError as exc:
            errors.append((i, str(exc)))
    return heartbeat_block(msgs), errors


#: the messages a heartbeat stream carries
_BEAT_TYPES = {"NodeHeartbeats", "Heartbeat"}
_ENVELOPE = {"v", "type", "body"}
_NODE_BEATS_BODY = {"node", "columns", "rows"}


def _heartbeats_at_once(raws: Sequence[str | bytes]) -> np.ndarray | None:
    """The block of ``raws`` when every one is a right NodeHeartbeats of the same columns
    (checked as :func:`decode` and NodeHeartbeats.check would, with integers held below
    2**53 and integer fields' values of any number type); None when anything is in doubt."""
    columns: Any = None
    nodes: list[int] = []
    rows: list[Any] = []
    counts: list[int] = []
    for raw in raws:
        if len(raw) > MAX_MESSAGE_BYTES:
            return None
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None
        if type(obj) is not dict or obj.keys() != _ENVELOPE or obj["type"] != "NodeHeartbeats":
            return None
        v, body = obj["v"], obj["body"]
        if type(v) is not int or v != SCHEMA_VERSION or type(body) is not dict or body.keys() != _NODE_BEATS_BODY:
            return None
        node, cols, mine = body["node"], body["columns"], body["rows"]
        if type(node) is not int or node < 0 or type(cols) is not list or type(mine) is not list:
            return None
        if columns is None:
            columns = cols
        elif cols != columns:
            return None
        nodes.append(node)
        counts.append(len(mine))
        rows += mine
    if columns is None:
        return np.zeros((0, len(HEARTBEAT_FIELDS)))
    if not set(map(type, columns)) <= {str}:
        return None
    try:
        positions, template = block_plan(tuple(columns))
    except MessageError:
        return None
    if rows and (not set(map(type, rows)) <= {list} or set(map(len, rows)) != {len(columns)}):
        return None
    if not set(map(type, itertools.chain.from_iterable(rows))) <= _NUMBERS:
        return None
    try:
        values = np.asarray(rows, dtype=np.float64).reshape(len(rows), len(columns))
    except (OverflowError, ValueError):
        return None
    if not np.isfinite(values).all():
        return None
    ints = [j for j, c in enumerate(columns) if HEARTBEAT_INTS[HEARTBEAT_FIELDS.index(c)]]
    whole = values[:, ints]
    if not ((whole == np.floor(whole)).all() and (np.abs(whole) < MAX_EXACT).all()):
        return None
    ranks = values[:, columns.index("rank")]
    owner = np.repeat(np.arange(len(nodes)), counts)
    order = np.lexsort((ranks, owner))
    if (ranks < 0).any() or ((np.diff(owner[order]) == 0) & (np.diff(ranks[order]) == 0)).any():
        return None
    out = np.repeat(template[None, :], len(rows), axis=0)
    out[:, 1] = np.repeat(nodes, counts)
    out[:, positions] = values
    return out


def pack_heartbeats(node: int, beats: Sequence[Heartbeat], max_bytes: int = MAX_MESSAGE_BYTES) -> list[NodeHeartbeats]:
    """``beats`` (of ranks of node ``node``, one per rank) as few NodeHeartbeats as fit
    ``max_bytes`` each, in rank order; [] for none. Raises MessageError for a beat that
    names another node."""
    if any(b.node != node for b in beats):
        raise MessageError(f"pack_heartbeats: a heartbeat of another node than {node}")
    rows = [[getattr(b, c) for c in HEARTBEAT_COLUMNS] for b in sorted(beats, key=lambda b: b.rank)]
    return _fitted(lambda part: NodeHeartbeats(node, list(HEARTBEAT_COLUMNS), part), rows, max_bytes)


def pack_batch(node: int, msgs: Sequence[Any], max_bytes: int = MAX_MESSAGE_BYTES) -> list[NodeBatch]:
    """``msgs`` (of one kind of :data:`~falconext.protocol.messages.BATCH_KINDS`, one per
    rank, of node ``node``'s ranks) as few NodeBatches as fit ``max_bytes`` each, in their
    order; [] for none. Raises MessageError for mixed or unknown kinds or a repeated rank."""
    if not msgs:
        return []
    kind = type(msgs[0]).__name__
    if BATCH_KINDS.get(kind) is not type(msgs[0]) or any(type(m) is not type(msgs[0]) for m in msgs):
        raise MessageError(f"pack_batch: expected messages of one kind of {', '.join(BATCH_KINDS)}")
    columns = batch_columns(kind)
    rows = [[getattr(m, c) for c in columns] for m in msgs]
    out = _fitted(lambda part: NodeBatch(node, kind, list(columns), part), rows, max_bytes)
    for batch in out:
        batch.check()
    return out


def _fitted(make: Any, rows: list[list[Any]], max_bytes: int) -> list[Any]:
    """``make(part)`` for consecutive parts of ``rows``, halved until each message's text
    fits ``max_bytes`` (a single row goes as it is: the bus refuses it if too large)."""
    out: list[Any] = []
    todo = [rows] if rows else []
    while todo:
        part = todo.pop(0)
        msg = make(part)
        if len(part) > 1 and len(encode(msg).encode("utf-8")) > max_bytes:
            half = len(part) // 2
            todo[:0] = [part[:half], part[half:]]
            continue
        out.append(msg)
    return out
