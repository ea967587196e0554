"""The messages between ranks, node agents, the controller and operators: plain frozen
dataclasses (no I/O), sent as JSON by :mod:`falconext.protocol.codec`, which decodes them
strictly (exactly these fields, each of its declared type, then the class's own ``check``).

Rank -> controller: :class:`Heartbeat` (through its node's agent, as
:class:`NodeHeartbeats`), :class:`FailSlowReport`, :class:`ProfileData`,
:class:`SessionAck`, :class:`ValidationResult` (those four through the agent, several
ranks' in one :class:`NodeBatch`), :class:`RankEvent`; agent -> controller:
:class:`NodeHealth`; controller -> everyone: :class:`Localized` (the verdict); controller
-> operators: :class:`CommandReply`, :class:`StatusSnapshot`. The commands the other way
are in :mod:`falconext.protocol.commands`, the actions they carry in
:mod:`falconext.protocol.actions`.
"""

from __future__ import annotations

import functools
import itertools
import operator
import re
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import numpy as np

from falconext.protocol.base import MessageError, is_rank


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
    #: the fast path's reading (detect/steps.py): the newest loop iteration it judged (-1:
    #: none yet), how many iterations in a row up to it the rank's compute read stepped up
    #: against its own level, and its latest fast_iterations iterations' median compute over
    #: that level, in a run or not (1: warming up)
    step_iteration: int = -1
    step_run: int = 0
    step_ratio: float = 1.0


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
        if _call_array([row for rs in self.calls.values() for row in rs]) is None:
            for gid, rows in self.calls.items():
                for i, row in enumerate(rows):  # which: the slow way
                    if len(row) != 4 or not (is_rank(row[0]) and is_rank(row[3])) or row[2] < row[1]:
                        raise MessageError(f"ProfileData.calls[{gid}][{i}]: expected [k, t_issue, t_end, bytes], "
                                           f"got {row!r}")
        self._check_spans()

    @staticmethod
    def check_all(msgs: Sequence[ProfileData]) -> None:
        """Each of ``msgs``' :meth:`check`, their call rows checked together as one array
        (a node's batch, 100k ranks' at a suspension); raises MessageError naming the
        first bad value, as the messages' own checks do."""
        rows = [row for m in msgs for rs in m.calls.values() for row in rs]
        table = _call_array(rows)
        if table is None:
            for m in msgs:
                m.check()  # names it
        at = 0
        for m in msgs:
            m._check_spans()
            if table is not None:  # each message's rows, for call_array
                n = sum(map(len, m.calls.values()))
                object.__setattr__(m, "_call_array", table[at:at + n])
                at += n

    def call_array(self) -> np.ndarray:
        """Every call row, group by group in the order of ``calls``, as one ``(n, 4)``
        float array (made by :meth:`check_all` for a decoded batch's messages). Raises
        ValueError where the rows are not four numbers each."""
        made = self.__dict__.get("_call_array")
        if made is not None:
            return made
        rows = [row for rs in self.calls.values() for row in rs]
        return np.array(rows, dtype=np.float64).reshape(len(rows), 4)

    def _check_spans(self) -> None:
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
    def compact(cls, rank: int, session: int, roles: dict[str, str], members: dict[str, Sequence[int]],
                calls: dict[str, list[list[float]]], fabric: str = "", nccl_algo: str | None = None) -> ProfileData:
        """The profile with every group of three or more evenly spaced, ascending ranks as a
        span (a ``range`` of members is one without looking at them)."""
        spans: dict[str, list[int]] = {}
        rest: dict[str, list[int]] = {}
        for gid, ranks in members.items():
            if isinstance(ranks, range) and len(ranks) >= 3 and ranks.step >= 1 and ranks.start >= 0:
                spans[gid] = [ranks.start, ranks.step, len(ranks)]
                continue
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
        if _link_rows_right(self.links):
            return
        for i, row in enumerate(self.links):  # which: the slow way
            if len(row) != 3 or not (is_rank(row[0]) and is_rank(row[1])) or row[2] < 0:
                raise MessageError(f"ValidationResult.links[{i}]: expected [src, dst, seconds], got {row!r}")

    @staticmethod
    def check_all(msgs: Sequence[ValidationResult]) -> None:
        """Each of ``msgs``' :meth:`check`, their links rows checked together (a node's
        batch, 100k ranks' at a suspension); raises MessageError naming the first bad row,
        as the messages' own checks do."""
        if not _link_rows_right([row for m in msgs for row in m.links]):
            for m in msgs:
                m.check()  # names it


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
MAX_EXACT = 2**53


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


def _call_array(rows: list[list[float]]) -> np.ndarray | None:
    """``rows`` as one ``(n, 4)`` float array when every row is [k, t_issue, t_end,
    bytes] of finite numbers, k and bytes whole and >= 0 and the end not before the issue
    (one message's rows or a whole batch's, checked at once), else None, also where they
    do not make one array of numbers (the caller then looks row by row)."""
    if not rows:
        return np.zeros((0, 4))
    if set(map(len, rows)) != {4}:
        return None
    try:
        a = np.array(rows, dtype=np.float64)
    except (ValueError, TypeError, OverflowError):
        return None
    whole = a[:, ::3]  # k and bytes
    right = np.isfinite(a).all() and whole.min() >= 0 and not (whole % 1).any() and (a[:, 2] >= a[:, 1]).all()
    return a if right else None


def _link_rows_right(rows: list[list[float]]) -> bool:
    """Whether every row is [src, dst, seconds] with src and dst whole and >= 0 and the
    time >= 0, checked a column at a time (many ranks' rows at once)."""
    if not rows:
        return True
    if not set(map(len, rows)) <= {3}:
        return False
    src, dst, secs = zip(*rows)
    ranks = src + dst
    try:
        return min(ranks) >= 0 and min(secs) >= 0 and all(map(float.is_integer, map(float, ranks)))
    except (TypeError, ValueError, OverflowError):  # not numbers: the caller looks row by row
        return False


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
        width = len(cols)
        for i, row in enumerate(self.rows) if not set(map(len, self.rows)) <= {width} else ():
            if len(row) != width:
                raise MessageError(f"NodeHeartbeats.rows[{i}]: expected {width} values, got {len(row)}")
        take = _int_taker(tuple(self.columns))
        # every integer column's values in one pass (the controller checks thousands of
        # rows a second); the slow walk below only names the first bad one
        vals = list(itertools.chain.from_iterable(map(take, self.rows)))
        if vals and not (all(map(float.is_integer, map(float, vals))) and -MAX_EXACT <= min(vals)
                         and max(vals) <= MAX_EXACT):
            ints = [j for j, (_, is_int) in enumerate(cols) if is_int]
            i, j = next((i, j) for i, row in enumerate(self.rows) for j in ints
                        if not (float(row[j]).is_integer() and -MAX_EXACT <= row[j] <= MAX_EXACT))
            raise MessageError(f"NodeHeartbeats.rows[{i}].{cols[j][0]}: expected a whole number, got {self.rows[i][j]!r}")
        rank_at = self.columns.index("rank")
        ranks = [row[rank_at] for row in self.rows]
        if min(ranks, default=0) < 0 or len(set(ranks)) != len(ranks):
            seen: set[float] = set()
            i, rank = next((i, r) for i, r in enumerate(ranks) if r < 0 or r in seen or seen.add(r))
            raise MessageError(f"NodeHeartbeats.rows[{i}].rank: {rank!r} is negative or repeated")

    def beats(self) -> list[Heartbeat]:
        """The rows as Heartbeats of this node (the message passed :meth:`check`)."""
        names, ints, defaults = _heartbeat_plan(tuple(self.columns))
        if not self.rows:
            return []
        # a column at a time: each made int or float in one pass (a number sent as an
        # integer is a float here), then one Heartbeat per row
        cols: list[Any] = [[self.node] * len(self.rows)]
        cols += [list(map(float, col)) for col in zip(*self.rows)]
        for i in ints:
            cols[i] = list(map(int, cols[i]))
        out = []
        make = object.__new__
        for vals in zip(*cols):
            # a frozen dataclass's __init__ sets its 22 fields one object.__setattr__ at a
            # time; at thousands of heartbeats a second the controller fills them at once
            # (Heartbeat has no __post_init__ to skip)
            beat = make(Heartbeat)
            fill = beat.__dict__
            fill.update(defaults)
            fill.update(zip(names, vals))
            out.append(beat)
        return out


    def block(self) -> np.ndarray:
        """The rows as one float array, a row per rank and a column per Heartbeat field in
        order (:data:`HEARTBEAT_FIELDS`): this node in ``node``, each field's default where
        the message has no column for it. The message passed :meth:`check`, so integer
        fields hold whole numbers exact as floats. What the controller keeps
        (control/beat_table.py) without a Heartbeat per row."""
        positions, template = block_plan(tuple(self.columns))
        out = np.repeat(template[None, :], len(self.rows), axis=0)
        out[:, 1] = self.node  # HEARTBEAT_FIELDS[1]
        if self.rows:
            out[:, positions] = np.asarray(self.rows, dtype=np.float64)
        return out


def heartbeat_row(beat: Heartbeat) -> list[float]:
    """``beat``'s fields in :data:`HEARTBEAT_FIELDS` order, as floats (a block's row)."""
    return [float(getattr(beat, f)) for f in HEARTBEAT_FIELDS]


def heartbeat_block(msgs: Sequence[NodeHeartbeats | Heartbeat]) -> np.ndarray:
    """The rows of several nodes' messages (each passed its check; a lone Heartbeat is a
    row of its own) as one block, as :meth:`NodeHeartbeats.block` gives one message's,
    in order: what the controller takes of a read's heartbeats in one go."""
    if not msgs:
        return np.zeros((0, len(HEARTBEAT_FIELDS)))
    columns = msgs[0].columns if isinstance(msgs[0], NodeHeartbeats) else None
    if columns is None or any(not isinstance(m, NodeHeartbeats) or m.columns != columns for m in msgs):
        # lone heartbeats, or agents of different versions: one message at a time
        return np.concatenate([m.block() if isinstance(m, NodeHeartbeats) else np.array([heartbeat_row(m)])
                               for m in msgs])
    positions, template = block_plan(tuple(columns))
    rows = list(itertools.chain.from_iterable(m.rows for m in msgs))
    out = np.repeat(template[None, :], len(rows), axis=0)
    out[:, 1] = np.repeat([m.node for m in msgs], [len(m.rows) for m in msgs])
    if rows:
        out[:, positions] = np.asarray(rows, dtype=np.float64)
    return out


@functools.lru_cache(maxsize=64)
def _int_taker(columns: tuple[str, ...]) -> Any:
    """A function of a row of ``columns`` giving its integer columns' values, as a tuple."""
    ints = [j for j, (_, is_int) in enumerate(_heartbeat_columns(columns)) if is_int]
    if not ints:
        return lambda row: ()
    if len(ints) == 1:
        return lambda row, j=ints[0]: (row[j],)
    return operator.itemgetter(*ints)


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



#: every Heartbeat field in order: the columns of :meth:`NodeHeartbeats.block`
HEARTBEAT_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Heartbeat))
#: whether each of HEARTBEAT_FIELDS is an integer field
HEARTBEAT_INTS: tuple[bool, ...] = tuple(f.type in (int, "int") for f in fields(Heartbeat))


@functools.lru_cache(maxsize=64)
def block_plan(columns: tuple[str, ...]) -> tuple[list[int], np.ndarray]:
    """For rows of ``columns``: each column's place among HEARTBEAT_FIELDS, and a row of
    every field's default (a required field's is 0: the rows always carry it)."""
    _heartbeat_columns(columns)  # MessageError for unknown, repeated or missing columns
    template = np.array([0.0 if f.default is MISSING else float(f.default) for f in fields(Heartbeat)])
    return [HEARTBEAT_FIELDS.index(c) for c in columns], template


#: the rank messages a node agent combines into a NodeBatch: the control flow, which at a
#: suspension every rank sends at once (a heartbeat goes in a NodeHeartbeats)
BATCH_KINDS: dict[str, type] = {cls.__name__: cls for cls in (FailSlowReport, ProfileData, SessionAck, ValidationResult)}


@functools.lru_cache(maxsize=None)
def batch_columns(kind: str) -> tuple[str, ...]:
    """The columns of a NodeBatch of ``kind``: every field of that message, in order."""
    return tuple(f.name for f in fields(BATCH_KINDS[kind]))


@dataclass(frozen=True)
class NodeBatch:
    """Agent -> controller: several of its node's ranks' messages of one kind (a
    FailSlowReport, ProfileData, SessionAck or ValidationResult) in one message, one per
    rank: what the node's ranks sent together (at a suspension, all of them at once),
    so that the controller reads one message per node rather than one per rank.

    Column-wise like NodeHeartbeats: ``columns`` are every field of ``kind`` in order,
    each row one message's values. The codec checks each value against its field's type
    column by column; :meth:`messages` makes the messages, each passing its own check.
    Make them with :func:`~falconext.protocol.codec.pack_batch`.
    """

    node: int
    kind: str
    columns: list[str]
    rows: list[list[Any]]

    def check(self) -> None:
        """A known kind, its columns exactly, rows of their length, each rank once."""
        if self.node < 0:
            raise MessageError(f"NodeBatch.node: expected >= 0, got {self.node}")
        if self.kind not in BATCH_KINDS:
            raise MessageError(f"NodeBatch.kind: {self.kind!r} is not one of {', '.join(sorted(BATCH_KINDS))}")
        if tuple(self.columns) != batch_columns(self.kind):
            raise MessageError(f"NodeBatch.columns: expected the fields of {self.kind} in order, got {self.columns}")
        if not self.rows:
            raise MessageError("NodeBatch.rows: empty")
        width = len(self.columns)
        if set(map(len, self.rows)) != {width}:
            for i, row in enumerate(self.rows):
                if len(row) != width:
                    raise MessageError(f"NodeBatch.rows[{i}]: expected {width} values, got {len(row)}")
        ranks = [row[0] for row in self.rows]  # every batch kind leads with its rank, an int
        if not set(map(type, ranks)) <= {int} or min(ranks) < 0 or len(set(ranks)) != len(ranks):
            raise MessageError(f"NodeBatch.rows: ranks must be distinct integers >= 0, got {ranks}"[:300])

    def messages(self) -> list[Any]:
        """The rows as messages of ``kind``, each passing its class's own check (raises
        MessageError naming the first that does not). A decoded batch was made into its
        messages by the codec, which checked every value's type first; they are kept and
        given here."""
        made = self.__dict__.get("_made")
        if made is not None:
            return list(made)
        cls = BATCH_KINDS[self.kind]
        own_check = getattr(cls, "check", None)
        # a class may check many of its messages at once (each passes its own check
        # exactly when they all pass), as the profiles' call rows are
        all_check = getattr(cls, "check_all", None)
        out = []
        for row in self.rows:
            # a frozen dataclass's __init__ sets its fields one object.__setattr__ at a time;
            # the values are checked already, so they are filled at once (no __post_init__)
            msg = object.__new__(cls)
            msg.__dict__.update(zip(self.columns, row))
            if own_check is not None and all_check is None:
                msg.check()
            out.append(msg)
        if all_check is not None:
            all_check(out)
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
    ``summary``: all ranks heard from (``ranks``), of which the table lists ``listed``
    (every one up to the controller's ``listed_ranks``, else the slowest), with the
    loop iterations (``iteration_min``/``_max``), iteration times
    (``iter_s_max``/``_median``) and highest score over all of them.
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
    summary: dict[str, Any] | None = None

    def position(self) -> tuple[int, float] | None:
        """(loop iteration of the rank furthest behind, the slowest rank's s/iter) over
        every rank (the summary; the rank table when there is none); None before any."""
        if self.summary is not None:
            return int(self.summary["iteration_min"]), float(self.summary["iter_s_max"])
        rows = list(self.ranks.values())
        if not rows:
            return None
        return min(int(r["iteration"]) for r in rows), max(float(r["iter_s"]) for r in rows)
