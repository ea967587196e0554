"""Control-plane messages: JSON of the project's dataclasses, with a schema version.

Everything on the bus comes from the network, so decoding is strict and never
evaluates anything: a size limit, one JSON object ``{"v": version, "type": name,
"body": {...}}``, a known type, exactly the dataclass's fields, and every field of the
declared type (finite numbers, no bool passing for int). A message that fails any of
this raises :class:`MessageError` naming the problem; the agent logs and drops it.
"""

from __future__ import annotations

import functools
import json
import math
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, ClassVar, Union

SCHEMA_VERSION = 1
MAX_MESSAGE_BYTES = 64 * 1024


class MessageError(ValueError):
    """A message that is malformed, of an unknown type or version, or too large."""


@dataclass(frozen=True)
class FailSlowReport:
    """A rank's verified fail-slow, in training-loop iteration numbers.

    ``end`` is set on the report that says the fail-slow is over; ``event_id`` lets the
    controller pair the two.
    """

    rank: int
    onset: int
    detected_at: int
    slowdown: float
    baseline_s: float
    time: float
    event_id: int = 0
    end: int | None = None


@dataclass(frozen=True)
class Heartbeat:
    """Rank -> controller: alive, where its loop is, and how fast it goes.

    The controller picks the iteration at which every rank suspends from these, so
    they carry the loop iteration and the recent iteration time.
    """

    rank: int
    node: int
    iteration: int
    iter_s: float
    time: float
    #: the rank's DP replica, and its recent compute seconds per micro-batch (what S2
    #: balances on; 0: not measured yet)
    replica: int = -1
    mb_s: float = 0.0
    micro: int = 0  # micro-batches the replica runs per global batch now
    #: this rank's measured cost of S4: checkpoint save + load + process start-up
    restart_s: float = 0.0
    #: this rank's measured pause of the last topology switch (S3's cost; 0: none yet)
    switch_s: float = 0.0
    #: the role it plays (torch rank, pipeline stage) in a TP x DP x PP job of these
    #: sizes, and its traffic: gradient bytes all-reduced over its DP group per
    #: iteration, bytes of one pipeline message (what S3 plans with; -1/0: unknown)
    role: int = -1
    stage: int = -1
    tp: int = 0
    pp: int = 0
    grad_bytes: int = 0
    act_bytes: int = 0
    #: medians over its latest iterations estimated from calls (detect/scores.py): the
    #: iteration time, the time outside calls (compute) and inside them (waiting and
    #: transfer), and the loop iteration of the newest of them (-1: none yet)
    score_iteration: int = -1
    est_iter_s: float = 0.0
    compute_s: float = 0.0
    wait_s: float = 0.0
    #: seconds its loop iteration had been running when the heartbeat was made (-1:
    #: unknown, e.g. no loop hooks): with it the controller knows when the rank's next
    #: iteration starts, not only which iteration it is in
    into_s: float = -1.0


@dataclass(frozen=True)
class ProfileData:
    """Rank -> controller: its recent collective calls, for the wait/transfer split.

    ``calls[group]`` holds ``[k, t_issue, t_end, bytes]`` rows, k being the call's index
    among this rank's calls on that group (the same collective has the same k on every
    member). ``members[group]`` lists the group's global ranks in group order; a group
    whose ranks are evenly spaced (Megatron's always are) may come instead as
    ``spans[group] = [first, step, count]``: a DP group of 4096 ranks is then 20 bytes,
    not 25 KB in every member's profile (:meth:`compact` makes them). Read both with
    :meth:`group_members`.

    ``fabric`` (the torch.distributed backend its collectives run on, e.g. ``nccl`` or
    ``gloo``; empty: unknown) and ``nccl_algo`` (its ``NCCL_ALGO``; None: unset) say
    whether its collectives may run as NCCL's trees, which the validation plan then
    covers (:func:`falconext.validate.plan.trees_apply`).
    """

    rank: int
    session: int
    roles: dict[str, str]
    members: dict[str, list[int]]
    calls: dict[str, list[list[float]]]
    spans: dict[str, list[int]] = field(default_factory=dict)
    fabric: str = ""
    nccl_algo: str | None = None

    def check(self) -> None:
        """Each call row is [k, t_issue, t_end, bytes] with k and bytes whole and >= 0;
        each span is [first >= 0, step >= 1, count >= 1], of a group not also in members."""
        for gid, rows in self.calls.items():
            for i, row in enumerate(rows):
                if len(row) != 4 or not (_is_rank(row[0]) and _is_rank(row[3])) or row[2] < row[1]:
                    raise MessageError(f"ProfileData.calls[{gid}][{i}]: expected [k, t_issue, t_end, bytes], got {row!r}")
        for gid, span in self.spans.items():
            if len(span) != 3 or span[0] < 0 or span[1] < 1 or span[2] < 1 or gid in self.members:
                raise MessageError(f"ProfileData.spans[{gid}]: expected [first >= 0, step >= 1, count >= 1] of a "
                                   f"group not in members, got {span!r}")

    def group_members(self) -> dict[str, Sequence[int]]:
        """Every group's members in group order, spans as ``range`` objects (not expanded)."""
        if not self.spans:
            return self.members
        out: dict[str, Sequence[int]] = dict(self.members)
        out.update({g: range(f, f + s * c, s) for g, (f, s, c) in self.spans.items()})
        return out

    @classmethod
    def compact(cls, rank: int, session: int, roles: dict[str, str], members: dict[str, list[int]],
                calls: dict[str, list[list[float]]], fabric: str = "", nccl_algo: str | None = None) -> ProfileData:
        """The profile with every group of three or more evenly spaced, ascending ranks as a span."""
        spans: dict[str, list[int]] = {}
        rest: dict[str, list[int]] = {}
        for gid, ranks in members.items():
            r = list(ranks)
            step = r[1] - r[0] if len(r) >= 3 else 0
            if step >= 1 and r[0] >= 0 and r == list(range(r[0], r[0] + step * len(r), step)):
                spans[gid] = [r[0], step, len(r)]
            else:
                rest[gid] = r
        return cls(rank, session, roles, rest, calls, spans, fabric, nccl_algo)


@dataclass(frozen=True)
class SessionAck:
    """Rank -> controller: where this rank is in a suspension.

    status: ``held`` (trapped at the agreed iteration), ``missed`` (was already past
    it), ``resumed`` (training goes on; ``pause_s`` is how long it was held).
    ``committed``: the session carried an action (a mitigation) and every rank agreed
    to apply it from the next iteration.
    """

    rank: int
    session: int
    status: str
    iteration: int
    time: float
    pause_s: float = 0.0
    expired: bool = False
    committed: bool = False


@dataclass(frozen=True)
class ValidationResult:
    """Rank -> controller: its GEMM FLOP/s (if it ran one) and the links it received on.

    ``links`` rows are ``[src, dst, seconds]`` per message, median of repeats.
    """

    rank: int
    session: int
    gemm_flops: float | None
    links: list[list[float]]
    error: str = ""

    def check(self) -> None:
        """Each links row is [src, dst, seconds]: two ranks and a time >= 0."""
        for i, row in enumerate(self.links):
            if len(row) != 3 or not (_is_rank(row[0]) and _is_rank(row[1])) or row[2] < 0:
                raise MessageError(f"ValidationResult.links[{i}]: expected [src, dst, seconds], got {row!r}")


#: what a RankEvent's type may be: a lower-case name, as the event log's own types are
_EVENT_TYPE = re.compile(r"^[a-z][a-z0-9_]{0,47}$")


@dataclass(frozen=True)
class RankEvent:
    """Rank -> controller: one record of the rank's events, for the job's events.jsonl,
    which in a job of several launchers the controller alone writes. ``fields``: the
    record's JSON fields other than ``time`` and ``type``."""

    rank: int
    type: str
    time: float
    fields: dict[str, Any]

    def check(self) -> None:
        """A lower-case event type, and fields that do not override time or type."""
        if not _EVENT_TYPE.match(self.type):
            raise MessageError(f"RankEvent.type: expected a lower-case event name, got {self.type[:60]!r}")
        clash = sorted({"time", "type"} & set(self.fields))
        if clash:
            raise MessageError(f"RankEvent.fields: may not carry {', '.join(clash)}")

    def record(self) -> dict[str, Any]:
        """The events.jsonl record: the rank's time, type and fields."""
        return {"time": self.time, "type": self.type, **self.fields}

    @classmethod
    def of(cls, rank: int, record: dict[str, Any]) -> "RankEvent":
        """The message for a rank's event-log ``record``."""
        fields = {k: v for k, v in record.items() if k not in ("time", "type")}
        return cls(rank, str(record.get("type", "")), float(record.get("time", 0.0)), fields)


#: a Heartbeat's fields as NodeHeartbeats columns (its node is the message's)
HEARTBEAT_COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(Heartbeat) if f.name != "node")
#: the columns every NodeHeartbeats must carry (the others take Heartbeat's defaults)
HEARTBEAT_REQUIRED = ("rank", "iteration", "iter_s", "time")
#: exact integers survive the float columns up to here
_MAX_EXACT = 2**53


@functools.lru_cache(maxsize=64)
def _heartbeat_columns(columns: tuple[str, ...]) -> tuple[tuple[str, bool], ...]:
    """(name, is an integer field) per column, once per column list; MessageError for an
    unknown, repeated or missing column."""
    known = {f.name: f.type in (int, "int") for f in fields(Heartbeat) if f.name != "node"}
    unknown = [c for c in columns if c not in known]
    if unknown or len(set(columns)) != len(columns):
        raise MessageError(f"NodeHeartbeats.columns: unknown or repeated column(s) {unknown or list(columns)}")
    missing = [c for c in HEARTBEAT_REQUIRED if c not in columns]
    if missing:
        raise MessageError(f"NodeHeartbeats.columns: missing {', '.join(missing)}")
    return tuple((c, known[c]) for c in columns)


@dataclass(frozen=True)
class NodeHeartbeats:
    """Agent -> controller: its node's ranks' latest heartbeats in one message per
    heartbeat period (the controller reads one message per node, not one per rank).

    Column-wise: ``columns`` names Heartbeat fields (``node`` is the message's), each row
    holds one rank's values in that order. Integer fields must be whole numbers; ranks
    are unique. Make them with :func:`pack_heartbeats` (which splits a node's beats
    over several messages should they not fit the bus cap: at 250 bytes a row, one
    message holds about 250 ranks), read them with :meth:`beats`.
    """

    node: int
    columns: list[str]
    rows: list[list[float]]

    def check(self) -> None:
        """Known columns, the required ones present, rows of the columns' length, whole
        numbers in integer columns, each rank once."""
        if self.node < 0:
            raise MessageError(f"NodeHeartbeats.node: expected >= 0, got {self.node}")
        cols = _heartbeat_columns(tuple(self.columns))
        ints = [i for i, (_, is_int) in enumerate(cols) if is_int]
        rank_at = self.columns.index("rank")
        seen: set[float] = set()
        for i, row in enumerate(self.rows):
            if len(row) != len(cols):
                raise MessageError(f"NodeHeartbeats.rows[{i}]: expected {len(cols)} values, got {len(row)}")
            for j in ints:
                v = row[j]
                if not (float(v).is_integer() and -_MAX_EXACT <= v <= _MAX_EXACT):
                    raise MessageError(f"NodeHeartbeats.rows[{i}].{cols[j][0]}: expected a whole number, got {v!r}")
            rank = row[rank_at]
            if rank < 0 or rank in seen:
                raise MessageError(f"NodeHeartbeats.rows[{i}].rank: {rank!r} is negative or repeated")
            seen.add(rank)

    def beats(self) -> list[Heartbeat]:
        """The rows as Heartbeats of this node (the message passed :meth:`check`)."""
        names, ints, defaults = _heartbeat_plan(tuple(self.columns))
        out = []
        for row in self.rows:
            vals = [self.node, *row]
            for i in ints:
                vals[i] = int(vals[i])
            # a frozen dataclass's __init__ sets its 22 fields one object.__setattr__ at a
            # time; at thousands of heartbeats a second the controller fills them at once
            # (Heartbeat has no __post_init__ to skip)
            beat = object.__new__(Heartbeat)
            beat.__dict__.update(defaults)
            beat.__dict__.update(zip(names, vals))
            out.append(beat)
        return out


@functools.lru_cache(maxsize=64)
def _heartbeat_plan(columns: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[int, ...], dict[str, Any]]:
    """For rows of ``columns`` led by the node: the field names, the positions to make
    int, and the defaults of the fields not among the columns."""
    cols = _heartbeat_columns(columns)
    names = ("node",) + columns
    ints = tuple(i + 1 for i, (_, is_int) in enumerate(cols) if is_int)
    defaults = {f.name: f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
                for f in fields(Heartbeat) if f.name not in names}
    return names, ints, defaults


def pack_heartbeats(node: int, beats: Sequence[Heartbeat], max_bytes: int = MAX_MESSAGE_BYTES) -> list[NodeHeartbeats]:
    """``beats`` (of ranks of node ``node``, one per rank) as few NodeHeartbeats as fit
    ``max_bytes`` each, in rank order; [] for none. Raises MessageError for a beat that
    names another node."""
    if any(b.node != node for b in beats):
        raise MessageError(f"pack_heartbeats: a heartbeat of another node than {node}")
    rows = [[getattr(b, c) for c in HEARTBEAT_COLUMNS] for b in sorted(beats, key=lambda b: b.rank)]
    out: list[NodeHeartbeats] = []
    todo = [rows] if rows else []
    while todo:
        part = todo.pop(0)
        msg = NodeHeartbeats(node, list(HEARTBEAT_COLUMNS), part)
        if len(part) > 1 and len(encode(msg).encode("utf-8")) > max_bytes:
            half = len(part) // 2
            todo[:0] = [part[:half], part[half:]]
            continue
        out.append(msg)
    return out


@dataclass(frozen=True)
class NodeHealth:
    """Agent -> controller: the node's GPU health readings (pynvml), empty on CPU."""

    node: int
    session: int
    gpus: list[dict[str, Any]]


@dataclass(frozen=True)
class Localized:
    """What validation found: slow GPUs (ranks) and slow links (virtual node pairs)."""

    gpus: list[int]
    links: list[list[int]]
    evidence: dict[str, Any] = field(default_factory=dict)


# --- mitigation actions: what every rank applies from the iteration after a suspension ------
#
# They travel inside a suspend :class:`Command` (its ``action`` field), tagged on the wire by
# ``"kind"`` (each class's ``KIND``), and are decoded as strictly as the messages: exactly
# the class's fields, each of its declared type. ``session`` is the suspension that
# committed the action (0: none, e.g. an override from the command line).


@dataclass(frozen=True)
class MicrobatchPlan:
    """S2 (or its revert to the even plan): micro-batches per DP replica.

    ``replica_mb_s`` is the compute seconds per micro-batch per replica the plan balanced
    (after the GEMM cap), ``measured_mb_s`` the heartbeats' figures where the cap changed
    them (None: not given, e.g. an operator's plan).
    """

    KIND: ClassVar[str] = "microbatches"
    STRATEGIES: ClassVar[tuple[str, ...]] = ("S2", "revert")

    strategy: str
    plan: list[int]
    session: int = 0
    replica_mb_s: list[float] | None = None
    measured_mb_s: list[float] | None = None

    def check(self) -> None:
        """The strategy is S2 or revert."""
        _check_strategy(self)


@dataclass(frozen=True)
class TopologyChange:
    """S3: the role (torch rank) each process plays from the next iteration.

    ``roles[p]`` is process p's role. The planner adds what its model predicted
    (``predicted_s``: iteration seconds before and after), the processes it ``moved``,
    ``why`` and the ``model_inputs``; an override from the command line is ``forced`` or
    has ``reason`` "forced"; a ``probe`` switches to the same roles to measure the
    switch's cost (its ``roles`` are ignored).
    """

    KIND: ClassVar[str] = "topology"
    STRATEGIES: ClassVar[tuple[str, ...]] = ("S3",)

    roles: list[int]
    strategy: str = "S3"
    session: int = 0
    predicted_s: list[float] | None = None
    moved: list[int] | None = None
    why: str | None = None
    model_inputs: str | None = None
    reason: str | None = None
    forced: bool = False
    probe: bool = False

    def check(self) -> None:
        """The strategy is S3."""
        _check_strategy(self)


@dataclass(frozen=True)
class Restart:
    """S4: every rank saves a checkpoint and the job restarts without ``exclude_nodes``."""

    KIND: ClassVar[str] = "restart"
    STRATEGIES: ClassVar[tuple[str, ...]] = ("S4",)

    exclude_nodes: list[int]
    reason: str = ""
    strategy: str = "S4"
    session: int = 0

    def check(self) -> None:
        """The strategy is S4 and the nodes are node numbers (>= 0)."""
        _check_strategy(self)
        bad = [n for n in self.exclude_nodes if n < 0]
        if bad:
            raise MessageError(f"Restart.exclude_nodes: node numbers are >= 0, got {bad}")


#: what a suspension may carry for every rank to apply
MitigationAction = Union[MicrobatchPlan, TopologyChange, Restart]


def action_details(action: MitigationAction) -> dict[str, Any]:
    """An action's fields for an event, as the untyped actions had them: all but the
    strategy and the session, leaving out those not given (None) and flags not set."""
    return {f.name: getattr(action, f.name) for f in fields(action)
            if f.name not in ("strategy", "session") and getattr(action, f.name) not in (None, False)}


def _check_strategy(action: Any) -> None:
    if action.strategy not in action.STRATEGIES:
        raise MessageError(f"{type(action).__name__}.strategy: expected one of {', '.join(action.STRATEGIES)}, "
                           f"got {action.strategy!r}")


# --- a validation session's plan: one small part for every rank, one share per block of ranks --


@dataclass(frozen=True)
class ValidationPlan:
    """What every rank of a validation suspension needs alike (a suspend Command's
    ``validation``): the benchmarks' sizes and how many GEMM and P2P rounds there are
    (every rank takes part in each round's barrier). Which rank runs a GEMM in which
    round, and its P2P pairs, come in :class:`ValidationShare` commands posted just
    before: the plan's size does not grow with the world.
    """

    scope: str
    roles: list[str]
    gemm_n: int
    gemm_repeats: int
    gemm_rounds: int
    validation_sweeps: int
    nbytes: int
    repeats: int
    p2p_rounds: int
    #: after reporting, the ranks stay held up to this long for the controller's verdict,
    #: a "resume" that may carry the mitigation to apply from the next iteration (0: they
    #: resume as soon as they have reported)
    verdict_wait_s: float = 0.0

    def check(self) -> None:
        """Round counts >= 0, at least one sweep, sizes >= 1 where there is work, a wait
        for the verdict of 0 to 300 s."""
        if not 0.0 <= self.verdict_wait_s <= 300.0:
            raise MessageError(f"ValidationPlan: verdict_wait_s must be in [0, 300], got {self.verdict_wait_s}")
        if self.gemm_rounds < 0 or self.p2p_rounds < 0 or self.validation_sweeps < 1:
            raise MessageError(f"ValidationPlan: rounds must be >= 0 and sweeps >= 1, got gemm_rounds "
                               f"{self.gemm_rounds}, p2p_rounds {self.p2p_rounds}, sweeps {self.validation_sweeps}")
        if (self.gemm_rounds and (self.gemm_n < 1 or self.gemm_repeats < 1)) or (
                self.p2p_rounds and (self.nbytes < 1 or self.repeats < 1)):
            raise MessageError("ValidationPlan: gemm_n, gemm_repeats, nbytes and repeats must be >= 1")


@dataclass(frozen=True)
class ValidationShare:
    """The part of a validation plan for the ranks ``first`` .. ``last`` (a "share"
    Command's ``share``): ``gemm`` rows ``[first, last, round]`` (the ranks first..last run
    their GEMM in that round; a rank in no row runs none) and ``pairs`` rows
    ``[round, src, dst]`` (the P2P transfers they send or receive). A rank in the range with no row has nothing to run but the
    barriers.
    """

    first: int
    last: int
    gemm: list[list[int]]
    pairs: list[list[int]]

    def check(self) -> None:
        """first <= last; rows of the right length, ranks and rounds >= 0, no self-transfer."""
        if not 0 <= self.first <= self.last:
            raise MessageError(f"ValidationShare: expected 0 <= first <= last, got {self.first}..{self.last}")
        for i, row in enumerate(self.gemm):
            if len(row) != 3 or min(row) < 0 or row[0] > row[1]:
                raise MessageError(f"ValidationShare.gemm[{i}]: expected [first, last, round], got {row!r}")
        for i, row in enumerate(self.pairs):
            if len(row) != 3 or min(row) < 0 or row[1] == row[2]:
                raise MessageError(f"ValidationShare.pairs[{i}]: expected [round, src, dst], got {row!r}")


@dataclass(frozen=True)
class Command:
    """Controller -> ranks (and operator -> controller).

    kinds: ``profile`` (send ProfileData; args: session, window_s), ``share`` (args:
    session; ``share``: some ranks' part of that session's validation, posted before its
    suspend), ``suspend`` (trap at loop iteration ``iteration``, at most ``deadline_s``;
    args: session; ``validation``: what to validate, or ``action``: the mitigation to
    apply from the next iteration once every rank agrees), ``go`` and ``release``
    (args: session), ``resume`` (args: session; ends a validation's wait for its verdict,
    with the ``action`` to apply from the next iteration, or none), and from an operator
    (``falconext ctl``): ``validate``, ``mitigate`` (args: strategy S2|S3|S4|revert,
    optional plan, roles or exclude_nodes), ``mute``, ``unmute`` and ``set`` (args: name,
    value). An operator's command may carry ``args["id"]``: the controller then answers
    with a :class:`CommandReply` of that id.
    """

    kind: str
    deadline_s: float
    iteration: int | None = None
    args: dict[str, Any] = field(default_factory=dict)
    action: MitigationAction | None = None
    validation: ValidationPlan | None = None
    share: ValidationShare | None = None


@dataclass(frozen=True)
class CommandReply:
    """Controller -> operator: what became of the operator command ``id``.

    ``ok`` false means refused, and ``text`` says why; true means accepted (an action
    then runs through the usual suspension: its outcome is a later event). ``session``
    is the controller's session after the command (an action's suspension has it).
    """

    id: str
    command: str
    ok: bool
    text: str
    time: float
    session: int = 0


@dataclass(frozen=True)
class StatusSnapshot:
    """Controller -> operators, tools and the launcher's progress line: the job as the
    controller sees it, published every ``status_interval_s`` (``falconext ctl status``).

    ``ranks[str(rank)]``: node, iteration, iter_s (loop), est_iter_s (from calls),
    score, late_s, compute_ratio, replica, micro, role, stage, age_s (of its heartbeat).
    ``plan``: micro-batches per DP replica and roles per process in force. ``episode``
    and ``planner``: the fail-slow in hand and what the planner has done and would do
    next (None: none). ``config``: the thresholds changed at run time or on the command
    line (name -> value). ``last_event``: the latest event the controller wrote.
    """

    time: float
    job: str
    world: int
    state: str
    session: int
    muted: bool
    ranks: dict[str, dict[str, Any]]
    plan: dict[str, Any]
    episode: dict[str, Any] | None = None
    planner: dict[str, Any] | None = None
    config: dict[str, Any] = field(default_factory=dict)
    last_event: dict[str, Any] | None = None


MESSAGE_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (FailSlowReport, Heartbeat, NodeHeartbeats, ProfileData, SessionAck, ValidationResult, RankEvent, NodeHealth,
                Localized, Command, CommandReply, StatusSnapshot)
}


def encode(msg: Any) -> str:
    """The JSON text of ``msg`` with the schema version and type name, as :func:`decode`
    reads it. Raises MessageError for an object that is not one of the message types,
    and ValueError for a NaN or infinite number in it."""
    name = type(msg).__name__
    if MESSAGE_TYPES.get(name) is not type(msg):
        raise MessageError(f"not a message type: {name}")
    return json.dumps({"v": SCHEMA_VERSION, "type": name, "body": _data(msg)}, separators=(",", ":"), allow_nan=False)


def _data(obj: Any) -> Any:
    """``obj`` as plain JSON data: a dataclass as the object of its fields (a tagged one,
    such as an action, led by its ``kind``), lists and objects item by item."""
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


#: a status snapshot lists every rank: it is stored in a key, not a stream, and may be larger
MAX_STATUS_BYTES = 8 * 1024 * 1024


def decode(data: str | bytes, accept: set[str] | None = None, max_bytes: int = MAX_MESSAGE_BYTES) -> Any:
    """Parse one message; ``accept`` limits the types this receiver handles; ``max_bytes``
    bounds its size (only a status snapshot's reader raises it)."""
    if isinstance(data, bytes):
        if len(data) > max_bytes:
            raise MessageError(f"message of {len(data)} bytes exceeds {max_bytes}")
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError:
            raise MessageError("message is not UTF-8") from None
    if len(data) > max_bytes:
        raise MessageError(f"message of {len(data)} characters exceeds {max_bytes}")
    try:
        obj = json.loads(data, parse_constant=_no_constant)
    except (json.JSONDecodeError, MessageError) as exc:
        raise MessageError(f"malformed JSON: {exc}") from None
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
    return _build(cls, body, name)


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
        values[fname] = _check(body[fname], hints[fname], f"{where}.{fname}")
    try:
        msg = cls(**values)
    except TypeError as exc:
        raise MessageError(f"{where}: {exc}") from None
    check = getattr(msg, "check", None)
    if check is not None:
        check()  # MessageError naming the problem
    return msg


def _is_rank(value: float) -> bool:
    """A whole number >= 0 (JSON lists of numbers decode as floats here)."""
    return value >= 0 and float(value).is_integer()


def _finite(value: int | float) -> bool:
    """A finite number, also for an integer too large for a float (which is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _no_constant(name: str) -> float:
    raise MessageError(f"{name} is not allowed")


@functools.lru_cache(maxsize=None)
def _union_parts(hint: Any) -> tuple[dict[str, type], type | None]:
    """A union hint's tagged classes by ``kind`` (the actions), and its one dataclass when
    it is an optional part (``X | None``); resolved once per hint, not per message."""
    options = typing.get_args(hint)
    tagged = {getattr(o, "KIND"): o for o in options if is_dataclass(o) and hasattr(o, "KIND")}
    rest = [o for o in options if o is not type(None)]
    return tagged, rest[0] if len(rest) == 1 and is_dataclass(rest[0]) else None


@functools.lru_cache(maxsize=None)
def _hint(hint: Any) -> tuple[Any, tuple[Any, ...]]:
    """A type hint's origin and arguments, worked out once per hint."""
    return typing.get_origin(hint), typing.get_args(hint)


def _check(value: Any, hint: Any, where: str) -> Any:
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
    if is_dataclass(hint):
        if not isinstance(value, dict):
            raise MessageError(f"{where}: expected an object")
        return _build(hint, value, where)
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
    if origin is list:
        if not isinstance(value, list):
            raise MessageError(f"{where}: expected a list")
        (item,) = args
        # fast paths for the long lists (group members, call rows, heartbeat rows); any
        # doubt goes the slow way, which names the bad item
        if item is int and all(type(v) is int for v in value):
            return value
        if item is float and all(type(v) is float or type(v) is int for v in value):
            try:
                out = [float(v) for v in value]
            except OverflowError:
                out = None
            if out is not None and all(map(math.isfinite, out)):
                return out
        return [_check(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise MessageError(f"{where}: expected an object")
        _, item = args
        return {k: _check(v, item, f"{where}.{k}") for k, v in value.items()}
    raise MessageError(f"{where}: unsupported field type {hint}")  # pragma: no cover


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
