"""Every rank's latest heartbeat and its recent readings, kept as columns
(:class:`BeatTable`), read as mappings (:class:`LatestBeats`, :class:`KeptReadings`).

At 131,072 ranks the heartbeats come 262,144 a second: a Heartbeat object and a deque
entry per heartbeat took the controller's loop most of its time. The table takes a
node's heartbeats as one float block (:meth:`NodeHeartbeats.block
<falconext.protocol.messages.NodeHeartbeats.block>`) in a few array operations. A
Heartbeat is made only when a decision reads that rank's (and kept until its next
heartbeat); the history keeps only what decisions read back of each iteration
(:class:`Reading`), 28 bytes a reading where a Heartbeat took about 600.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

from falconext.protocol.messages import HEARTBEAT_FIELDS, HEARTBEAT_INTS, Heartbeat

RANK, NODE, ITERATION, ITER_S = (HEARTBEAT_FIELDS.index(f) for f in ("rank", "node", "iteration", "iter_s"))
ROLE, MB_S = HEARTBEAT_FIELDS.index("role"), HEARTBEAT_FIELDS.index("mb_s")
STEP_IT, STEP_RATIO = HEARTBEAT_FIELDS.index("step_iteration"), HEARTBEAT_FIELDS.index("step_ratio")
_WIDTH = len(HEARTBEAT_FIELDS)
_INT_AT = [j for j, is_int in enumerate(HEARTBEAT_INTS) if is_int]


class Reading(NamedTuple):
    """What the decisions read back of a kept heartbeat: its loop iteration, the role its
    rank played, its compute seconds per micro-batch and its iteration time."""

    iteration: int
    role: int
    mb_s: float
    iter_s: float


def heartbeats_of(rows: np.ndarray) -> list[Heartbeat]:
    """One Heartbeat per row of a block (integer fields made int), as decoding makes them."""
    if not len(rows):
        return []
    cols: list[Any] = rows.T.tolist()
    for j in _INT_AT:
        cols[j] = list(map(int, cols[j]))
    out = []
    make = object.__new__
    for vals in zip(*cols):
        beat = make(Heartbeat)  # its fields at once: a frozen dataclass sets them one at a time
        beat.__dict__.update(zip(HEARTBEAT_FIELDS, vals))
        out.append(beat)
    return out


class BeatTable:
    """The ranks heard from, each with its latest heartbeat (a row) and its readings of
    the last ``keep`` loop iterations (a ring per rank: a later heartbeat of the same
    iteration and role replaces the reading). Ranks are kept in the order first heard."""

    def __init__(self, keep: int) -> None:
        """An empty table; ``keep``: readings kept per rank (>= 1)."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self.clear()

    def clear(self) -> None:
        """Forget every rank."""
        self._slot: dict[int, int] = {}
        self._ranks: list[int] = []  # by slot
        self._rows = np.zeros((0, _WIDTH))
        self._version = np.zeros(0, dtype=np.int64)  # bumped at every heartbeat of the slot
        self._made: dict[int, tuple[int, Heartbeat]] = {}  # slot -> (version, its Heartbeat)
        self._kept: dict[int, tuple[int, tuple[Reading, ...]]] = {}  # slot -> (version, its readings)
        self._it = np.zeros((0, self.keep), dtype=np.int64)
        self._role = np.zeros((0, self.keep), dtype=np.int64)
        self._mb = np.zeros((0, self.keep))
        self._iter_s = np.zeros((0, self.keep))
        self._step_it = np.zeros((0, self.keep), dtype=np.int64)  # the fast path's reading of each
        self._step_ratio = np.zeros((0, self.keep))
        self._head = np.zeros(0, dtype=np.int64)  # where the slot's next reading goes
        self._n = np.zeros(0, dtype=np.int64)  # readings the slot keeps

    def __len__(self) -> int:
        return len(self._ranks)

    def ranks(self) -> list[int]:
        """The ranks heard from, in the order first heard."""
        return list(self._ranks)

    def has(self, rank: object) -> bool:
        """Whether ``rank`` was heard from."""
        return rank in self._slot

    def record(self, block: np.ndarray, made: Heartbeat | None = None) -> list[int]:
        """Keep a block of heartbeats (rows of :data:`HEARTBEAT_FIELDS`, each as if it came
        alone, in order: a rank twice in the block keeps the later); ``made``: the
        Heartbeat of a one-row block, kept as that rank's. Returns the ranks not heard
        from before, in the order of the block."""
        ranks = block[:, RANK].astype(np.int64).tolist()
        if len(set(ranks)) != len(ranks):  # a rank twice (a node's two rounds): each rank's in turn
            new: list[int] = []
            for part in _rounds(block[:, RANK]):
                new += self.record(block[part])
            return new
        fresh = [r for r in ranks if r not in self._slot]
        if fresh:
            self._add(fresh)
        slots = np.fromiter(map(self._slot.__getitem__, ranks), dtype=np.int64, count=len(ranks))
        self._rows[slots] = block
        self._version[slots] += 1
        if made is not None and len(ranks) == 1:
            self._made[int(slots[0])] = (int(self._version[slots[0]]), made)
        it, role = block[:, ITERATION].astype(np.int64), block[:, ROLE].astype(np.int64)
        n, head = self._n[slots], self._head[slots]
        last = (head - 1) % self.keep
        same = (n > 0) & (self._it[slots, last] == it) & (self._role[slots, last] == role)
        at = np.where(same, last, head)
        self._it[slots, at] = it
        self._role[slots, at] = role
        self._mb[slots, at] = block[:, MB_S]
        self._iter_s[slots, at] = block[:, ITER_S]
        self._step_it[slots, at] = block[:, STEP_IT].astype(np.int64)
        self._step_ratio[slots, at] = block[:, STEP_RATIO]
        grow = slots[~same]
        self._head[grow] = (self._head[grow] + 1) % self.keep
        self._n[grow] = np.minimum(self._n[grow] + 1, self.keep)
        return fresh

    def _add(self, ranks: list[int]) -> None:
        """Slots for ``ranks`` (not heard from before), growing the arrays by doubling."""
        start = len(self._ranks)
        for i, r in enumerate(ranks):
            self._slot[r] = start + i
        self._ranks += ranks
        need, cap = len(self._ranks), len(self._version)
        if need <= cap:
            return
        cap = max(need, 2 * cap, 8)
        self._rows = _grown(self._rows, cap)
        self._version = _grown(self._version, cap)
        self._it, self._role = _grown(self._it, cap), _grown(self._role, cap)
        self._mb, self._iter_s = _grown(self._mb, cap), _grown(self._iter_s, cap)
        self._step_it, self._step_ratio = _grown(self._step_it, cap), _grown(self._step_ratio, cap)
        self._head, self._n = _grown(self._head, cap), _grown(self._n, cap)

    def beat(self, rank: int) -> Heartbeat:
        """``rank``'s latest heartbeat (KeyError: not heard from); the same object until
        its next heartbeat."""
        slot = self._slot[rank]
        version = int(self._version[slot])
        made = self._made.get(slot)
        if made is None or made[0] != version:
            made = self._made[slot] = (version, heartbeats_of(self._rows[slot:slot + 1])[0])
        return made[1]

    def beats(self) -> list[Heartbeat]:
        """Every rank's latest heartbeat, in the order first heard (made where not yet)."""
        versions = self._version[:len(self._ranks)].tolist()
        stale = [s for s, v in enumerate(versions) if self._made.get(s, (None,))[0] != v]
        for s, beat in zip(stale, heartbeats_of(self._rows[stale])):
            self._made[s] = (versions[s], beat)
        return [self._made[s][1] for s in range(len(versions))]

    def column(self, name: str) -> np.ndarray:
        """Every rank's value of the field ``name`` in its latest heartbeat, in the order
        first heard (floats)."""
        return self._rows[:len(self._ranks), HEARTBEAT_FIELDS.index(name)].copy()

    def readings(self, rank: int) -> tuple[Reading, ...]:
        """``rank``'s kept readings, oldest first (KeyError: not heard from); the same
        tuple until its next heartbeat (every fail-slow report reads the first rank's: at
        131,072 ranks' reports, remaking them took 2 s of the 3 s the reports took)."""
        slot = self._slot[rank]
        version = int(self._version[slot])
        kept = self._kept.get(slot)
        if kept is not None and kept[0] == version:
            return kept[1]
        n, head = int(self._n[slot]), int(self._head[slot])
        order = [(head - n + k) % self.keep for k in range(n)]
        made = tuple(Reading(int(i), int(r), float(m), float(t)) for i, r, m, t in
                     zip(self._it[slot, order].tolist(), self._role[slot, order].tolist(),
                         self._mb[slot, order].tolist(), self._iter_s[slot, order].tolist()))
        self._kept[slot] = (version, made)
        return made

    def step_ratios(self, iteration: int) -> tuple[np.ndarray, np.ndarray]:
        """Every rank's fast-path ratio (``step_ratio``) as of ``iteration``: from its kept
        reading with the lowest ``step_iteration`` at or after it (the newest of equals), in
        the order first heard; and whether the rank has one (False: its readings have not
        reached ``iteration``, or have none). O(ranks x keep), vectorized."""
        used = len(self._ranks)
        n, head = self._n[:used, None], self._head[:used, None]
        age = (np.arange(self.keep)[None, :] - (head - n)) % self.keep  # 0: the oldest kept
        step_it = self._step_it[:used]
        never = np.iinfo(np.int64).max
        key = np.where((age < n) & (step_it >= iteration), step_it * (self.keep + 1) + (self.keep - age), never)
        pick = key.argmin(axis=1)
        rows = np.arange(used)
        return self._step_ratio[rows, pick], key[rows, pick] < never

    def healthy_mb_s(self, onset: int, lookback: int = 0, ranks: Iterable[int] | None = None) -> dict[int, float]:
        """:func:`~falconext.mitigate.mitigation.healthy_mb_s` over every rank's kept
        readings at once (``ranks``: only these, those not heard from left out): exactly
        its figures, by rank in the order first heard."""
        used = len(self._ranks)
        slots = np.arange(used) if ranks is None else np.array(sorted(self._slot[r] for r in set(ranks) if r in self._slot),
                                                              dtype=np.int64)
        if not len(slots):
            return {}
        n, head = self._n[slots, None], self._head[slots, None]
        age = (np.arange(self.keep)[None, :] - (head - n)) % self.keep  # 0: the oldest kept
        kept = age < n
        newest = (head - 1) % self.keep
        rows = np.arange(len(slots))
        role = self._role[slots, newest[:, 0]][:, None]
        it, mb = self._it[slots], self._mb[slots]
        clean = kept & (it <= onset) & (self._role[slots] == role) & (mb > 0)
        window = clean & (it >= onset - max(0, lookback))
        lowest = np.where(window, mb, np.inf).min(axis=1)
        latest = mb[rows, np.where(clean, age, -1).argmax(axis=1)]
        value = np.where(window.any(axis=1), lowest, latest)
        values = value.tolist()
        ranks_in = self._ranks
        return {ranks_in[s]: values[k] for k, s in zip(np.flatnonzero(clean.any(axis=1)).tolist(),
                                                       slots[clean.any(axis=1)].tolist())}


def _rounds(ranks: np.ndarray) -> list[np.ndarray]:
    """Row indices of a block split so that each part holds a rank once: the first row of
    every rank, then the second, ... (each rank's rows in their order)."""
    order = np.argsort(ranks, kind="stable")
    ordered = ranks[order]
    starts = np.r_[0, np.flatnonzero(ordered[1:] != ordered[:-1]) + 1]
    nth = np.arange(len(ordered)) - np.repeat(starts, np.diff(np.r_[starts, len(ordered)]))
    return [np.sort(order[nth == k]) for k in range(int(nth.max()) + 1)]


def _grown(a: np.ndarray, cap: int) -> np.ndarray:
    """``a`` with its first axis ``cap`` long, the new rows zero."""
    out = np.zeros((cap,) + a.shape[1:], dtype=a.dtype)
    out[:len(a)] = a
    return out


def columns(beats: Mapping[int, Heartbeat] | Iterable[Heartbeat], *names: str) -> list[np.ndarray]:
    """The fields ``names`` of every heartbeat in ``beats`` (a mapping by rank or the
    heartbeats themselves), one float array per name in the same order: read from the
    table without making a Heartbeat when ``beats`` is a :class:`LatestBeats`."""
    if isinstance(beats, LatestBeats):
        return [beats.column(n) for n in names]
    found = list(beats.values()) if isinstance(beats, Mapping) else list(beats)
    return [np.array([float(getattr(b, n)) for b in found]) for n in names]


class _TableView:
    """What both views of a :class:`BeatTable` share: the ranks heard from, in the order
    first heard, as the keys."""

    def __init__(self, table: BeatTable) -> None:
        self._table = table

    def __contains__(self, rank: object) -> bool:
        return self._table.has(rank)

    def __iter__(self) -> Iterator[int]:
        return iter(self._table.ranks())

    def __len__(self) -> int:
        return len(self._table)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} ranks)"


class LatestBeats(_TableView, Mapping[int, Heartbeat]):
    """Rank -> its latest Heartbeat, read from a :class:`BeatTable` (read-only; ranks in
    the order first heard). ``values()`` and ``items()`` make the Heartbeats not made yet
    in one go; :meth:`column` gives one field of every rank without making any."""

    def __getitem__(self, rank: int) -> Heartbeat:
        return self._table.beat(rank)

    def values(self) -> list[Heartbeat]:  # type: ignore[override]
        """Every rank's latest Heartbeat, those not made yet made in one go."""
        return self._table.beats()

    def items(self) -> list[tuple[int, Heartbeat]]:  # type: ignore[override]
        """(rank, its latest Heartbeat) for every rank, as :meth:`values` makes them."""
        return list(zip(self._table.ranks(), self._table.beats()))

    def column(self, name: str) -> np.ndarray:
        """Every rank's ``name`` field (see :meth:`BeatTable.column`)."""
        return self._table.column(name)


class KeptReadings(_TableView, Mapping[int, tuple[Reading, ...]]):
    """Rank -> its kept readings, oldest first, read from a :class:`BeatTable`
    (read-only); :meth:`healthy_mb_s` works over every rank at once."""

    def __getitem__(self, rank: int) -> tuple[Reading, ...]:
        return self._table.readings(rank)

    def healthy_mb_s(self, onset: int, lookback: int = 0, ranks: Iterable[int] | None = None) -> dict[int, float]:
        """Every rank's (``ranks``': only theirs) compute before ``onset``
        (:meth:`BeatTable.healthy_mb_s`)."""
        return self._table.healthy_mb_s(onset, lookback, ranks)

    def step_ratios(self, iteration: int) -> tuple[np.ndarray, np.ndarray]:
        """Every rank's fast-path ratio as of ``iteration``, and whether it has one
        (:meth:`BeatTable.step_ratios`)."""
        return self._table.step_ratios(iteration)
