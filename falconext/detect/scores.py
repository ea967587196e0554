"""Per-rank straggler scores: which rank is slow, and how slow, before any fail-slow.

In synchronous training every rank's iteration takes as long as the slowest rank's,
because every collective waits for its last member: iteration times cannot tell a
straggler from its victims. What differs is how a rank's iteration splits into
*compute* (time outside collective calls) and *waiting* (time inside them: the
transfer, which its peers share, plus the wait for late members). A straggler computes
longer and waits less; its peers compute as usual and wait for it. So, per rank, over
its recent iterations:

- ``compute_ratio``: its compute time over the median of its peers' (how slow: a GPU
  running at 1/1.5 of the speed reads 1.5);
- ``late_s``: the median of its peers' waiting time minus its own, the time per
  iteration it keeps the others waiting (late arrival; ~0 for a healthy rank);
- ``score``: ``late_s`` over the peers' median iteration time, the share of every
  iteration the job loses to this rank (0 healthy; 1/3 for a 1.5x straggler whose
  iteration is all compute).

Peers are the ranks in the same role, which do the same work: the same pipeline stage
and tensor-parallel index, in other data-parallel replicas. Only a rank's own clock is
used (no cross-host clock comparison), so the scores hold across nodes.

:class:`BusyClock` measures a rank's time inside its calls, one call at a time;
:func:`rank_scores` compares ranks. Pure: no clock, no I/O.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from statistics import median
from typing import Hashable, Iterator, Mapping, Sequence

import numpy as np


class BusyClock:
    """The union of a rank's call intervals ([issue, completion]), and its measure
    over any recent span.

    Calls must be fed in issue order (the tracer's drain order); overlapping calls
    (asynchronous collectives, a send beside a receive) count once. Only the latest
    ``capacity`` merged intervals are kept, so memory is bounded and a span older than
    those reads as partly idle: ask about the last few iterations only.
    """

    def __init__(self, capacity: int = 8192) -> None:
        if capacity < 2:
            raise ValueError(f"capacity must be >= 2, got {capacity}")
        self._starts: deque[float] = deque(maxlen=capacity)
        self._ends: deque[float] = deque(maxlen=capacity)

    def feed(self, t_issue: float, t_end: float | None) -> None:
        """Add one call; a call whose completion is unknown (None) or precedes its issue
        adds nothing (its time cannot be told apart from compute)."""
        if t_end is None or not t_end >= t_issue:
            return
        if self._ends and t_issue <= self._ends[-1]:
            if t_end > self._ends[-1]:
                self._ends[-1] = t_end
            return
        self._starts.append(t_issue)
        self._ends.append(t_end)

    def busy(self, t0: float, t1: float) -> float:
        """Seconds of [t0, t1) covered by calls (0 for an empty or reversed span).

        Costs O(intervals that end after t0): the intervals of one iteration, when
        asked about the latest one.
        """
        if not t1 > t0:
            return 0.0
        total = 0.0
        for k in range(len(self._ends) - 1, -1, -1):
            a, b = self._starts[k], self._ends[k]
            if b <= t0:
                break
            lo, hi = max(a, t0), min(b, t1)
            if hi > lo:
                total += hi - lo
        return total


@dataclass(frozen=True)
class RankSample:
    """One rank's recent iterations, medians over the same few iterations: iteration
    time, time outside calls (compute) and time inside them (waiting and transfer)."""

    iter_s: float
    compute_s: float
    wait_s: float


@dataclass(frozen=True)
class RankScore:
    """How much one rank holds its peers up, over a window: its compute and wait seconds per
    iteration, compute over the peers' median, the wait it imposes (``late_s``) and that
    as a share of the iteration (``score``, the straggler score)."""

    compute_s: float
    wait_s: float
    compute_ratio: float  # compute over the peers' median compute
    late_s: float  # peers' median wait minus this rank's: the wait it imposes per iteration
    score: float  # late_s over the peers' median iteration time
    peers: int  # ranks it was compared with (0: no peer in its role; ratio 1, score 0)

    def to_dict(self) -> dict[str, float | int]:
        """The score as JSON-able values, rounded (seconds to 6 decimals, ratios to 4)."""
        return {
            "compute_s": round(self.compute_s, 6),
            "wait_s": round(self.wait_s, 6),
            "compute_ratio": round(self.compute_ratio, 4),
            "late_s": round(self.late_s, 6),
            "score": round(self.score, 4),
            "peers": self.peers,
        }


def split_iteration(duration_s: float, busy_s: float) -> tuple[float, float]:
    """(compute, waiting) seconds of one iteration that spent ``busy_s`` inside calls."""
    wait = min(max(busy_s, 0.0), max(duration_s, 0.0))
    return max(duration_s - wait, 0.0), wait


def recent_sample(rows: list[tuple[float, float, float]]) -> RankSample | None:
    """The median of each of (iteration, compute, waiting) over recent iterations."""
    if not rows:
        return None
    return RankSample(median(r[0] for r in rows), median(r[1] for r in rows), median(r[2] for r in rows))


def rank_scores(samples: Mapping[int, RankSample], roles: Mapping[int, Hashable] | None = None) -> dict[int, RankScore]:
    """Every rank's score against the median of its peers (the other ranks of its role).

    ``roles[rank]`` names what a rank does (ranks without an entry share one role).
    Samples that are not finite and non-negative are left out, with the rank they
    belong to: one bad reading must not make every other rank look slow. Ranks come out
    role by role (in the order each role is first met), each role's in the order given.
    """
    ranks = list(samples)
    roles = roles or {}
    return dict(scores_of(ranks, [samples[r].iter_s for r in ranks], [samples[r].compute_s for r in ranks],
                          [samples[r].wait_s for r in ranks], [roles.get(r) for r in ranks]).items())


#: the quantities of a :class:`RankScore` a :class:`ScoreTable` keeps as columns, in order
SCORE_FIELDS = ("compute_s", "wait_s", "compute_ratio", "late_s", "score")


class ScoreTable(Mapping[int, RankScore]):
    """Scores by rank, kept as columns (``values``: one row per rank in the order of
    ``ranks``, the :data:`SCORE_FIELDS`; ``peers``: each rank's peer count): a
    :class:`RankScore` is made when a rank's is asked for. The controller scores 100k
    ranks every few seconds and reads a few of them; making one object per rank each
    time held its loop up for a quarter of a second. Iterates in the order of ``ranks``;
    equal to a dict with the same scores."""

    def __init__(self, ranks: list[int], values: np.ndarray, peers: np.ndarray) -> None:
        self._ranks = ranks
        self._values = values
        self._peers = peers
        self._at = dict(zip(ranks, range(len(ranks))))

    def __getitem__(self, rank: int) -> RankScore:
        i = self._at[rank]
        compute, wait, ratio, late, score = self._values[i].tolist()
        return RankScore(compute, wait, ratio, late, score, int(self._peers[i]))

    def __contains__(self, rank: object) -> bool:
        return rank in self._at

    def __iter__(self) -> Iterator[int]:
        return iter(self._ranks)

    def __len__(self) -> int:
        return len(self._ranks)

    def column(self, name: str, ranks: Sequence[int] | None = None, missing: float = math.nan) -> np.ndarray:
        """The field ``name`` (one of :data:`SCORE_FIELDS`) of every rank in table order,
        or of ``ranks`` in their order (``missing`` for a rank without a score)."""
        col = self._values[:, SCORE_FIELDS.index(name)]
        if ranks is None:
            return col.copy()
        at = np.fromiter((self._at.get(r, -1) for r in ranks), dtype=np.int64, count=len(ranks))
        return np.where(at >= 0, col[np.maximum(at, 0)] if len(col) else missing, missing)


def score_column(scores: Mapping[int, RankScore], ranks: Sequence[int], missing: float = math.nan) -> np.ndarray:
    """Each of ``ranks``' score (``missing`` where it has none), read as a column from a
    :class:`ScoreTable` without making a RankScore per rank."""
    if isinstance(scores, ScoreTable):
        return scores.column("score", ranks, missing)
    return np.fromiter((scores[r].score if r in scores else missing for r in ranks), dtype=np.float64,
                       count=len(ranks))


def score_values(scores: Mapping[int, RankScore]) -> np.ndarray:
    """Every rank's score, in the mapping's order."""
    if isinstance(scores, ScoreTable):
        return scores.column("score")
    return np.fromiter((s.score for s in scores.values()), dtype=np.float64, count=len(scores))


def scores_of(ranks: Sequence[int], iter_s: Sequence[float], compute_s: Sequence[float], wait_s: Sequence[float],
              roles: Sequence[Hashable]) -> ScoreTable:
    """:func:`rank_scores` of the samples given a quantity at a time: ``ranks[i]``'s
    iteration, compute and wait seconds and role are the i-th of each (the controller
    reads them from 100k heartbeats every few seconds, without a sample object per rank),
    as a :class:`ScoreTable`."""
    its = np.array(iter_s, dtype=float)
    computes = np.array(compute_s, dtype=float)
    waits = np.array(wait_s, dtype=float)
    with np.errstate(invalid="ignore"):
        good = np.isfinite(its) & np.isfinite(computes) & np.isfinite(waits) & (its >= 0) & (computes >= 0) & (waits >= 0)
    groups = _role_groups(roles, good) if len(ranks) else []
    order = np.concatenate(groups) if groups else np.zeros(0, dtype=np.int64)
    values = np.zeros((len(order), len(SCORE_FIELDS)))
    peers = np.zeros(len(order), dtype=np.int64)
    at = 0
    for idx in groups:
        c, w, it = computes[idx], waits[idx], its[idx]
        block = values[at:at + len(idx)]
        block[:, 0], block[:, 1] = c, w
        if len(idx) == 1:
            block[:, 2] = 1.0  # no peer: ratio 1, late 0, score 0
        else:
            # each rank's peers are its role less itself: medians left one out, from one sort
            # per quantity (thousands of ranks in a role: not one sort per rank)
            pc, pw, pi = _peer_medians(c), _peer_medians(w), _peer_medians(it)
            late = pw - w
            with np.errstate(divide="ignore", invalid="ignore"):
                block[:, 2] = np.where(pc > 0, c / np.where(pc > 0, pc, 1.0), 1.0)
                block[:, 4] = np.where(pi > 0, late / np.where(pi > 0, pi, 1.0), 0.0)
            block[:, 3] = late
            peers[at:at + len(idx)] = len(idx) - 1
        at += len(idx)
    return ScoreTable([ranks[i] for i in order.tolist()], values, peers)


def _role_groups(roles: Sequence[Hashable], good: np.ndarray) -> list[np.ndarray]:
    """The positions where ``good`` holds, grouped by their ``roles`` entry, roles in the
    order first met, each group's positions in order."""
    where = np.flatnonzero(good)
    if not len(where):
        return []
    met = [roles[i] for i in where.tolist()]
    index = {role: k for k, role in enumerate(dict.fromkeys(met))}  # roles in the order first met
    ids = np.fromiter(map(index.__getitem__, met), dtype=np.int64, count=len(met))
    order = np.argsort(ids, kind="stable")
    bounds = np.flatnonzero(np.diff(ids[order])) + 1
    return np.split(where[order], bounds)


def slowest_listed(scores: Mapping[int, RankScore], most: int) -> dict[int, RankScore]:
    """Every score when there are at most ``most``, else the ``most`` highest (ties by
    rank), in rank order."""
    if len(scores) <= most:
        return dict(sorted(scores.items()))
    if isinstance(scores, ScoreTable):  # one sort of two columns, RankScores made for the listed only
        ranks = np.fromiter(scores, dtype=np.int64, count=len(scores))
        top = ranks[np.lexsort((ranks, -scores.column("score")))[:most]]
        return {r: scores[r] for r in sorted(top.tolist())}
    top = heapq.nsmallest(most, scores.items(), key=lambda kv: (-kv[1].score, kv[0]))
    return dict(sorted(top))


def compute_outliers(scores: Mapping[int, RankScore], mb_s: Mapping[int, float],
                     roles: Mapping[int, Hashable], ratio: float, min_score: float) -> dict[int, float]:
    """The stragglers the ranks' own compute shows: {rank: its compute per micro-batch over
    the median of its role peers'}, for the ranks at ``ratio`` or more whose lateness costs
    the job at least ``min_score`` of every iteration (``scores``: :func:`rank_scores`).

    Per micro-batch, so a replica that S2 gave more micro-batches is not an outlier; and
    only when it costs the job, so a slow GPU whose replica S2 already lightened is not
    one either. Ranks without a positive reading, or without a peer, are never outliers.
    """
    ranks = [r for r in mb_s if r in scores]
    vals = np.array([mb_s[r] for r in ranks], dtype=float)
    with np.errstate(invalid="ignore"):
        good = np.isfinite(vals) & (vals > 0)
    out: dict[int, float] = {}
    for idx in _role_groups([roles.get(r) for r in ranks], good):
        if len(idx) < 2:
            continue
        mine = vals[idx]
        peers = _peer_medians(mine)
        with np.errstate(divide="ignore", invalid="ignore"):
            over = (peers > 0) & (mine / np.where(peers > 0, peers, 1.0) >= ratio)
        for i, v, p in zip(idx[over].tolist(), mine[over].tolist(), peers[over].tolist()):
            if v / p >= ratio and scores[ranks[i]].score >= min_score:
                out[ranks[i]] = v / p
    return out


def peer_medians(values: Sequence[float]) -> list[float]:
    """For each value, the median of all the others (``statistics.median`` of the list
    without it), in O(n log n): the list is sorted once, and leaving out any copy of a
    value leaves the same others. Needs at least two values."""
    if len(values) < 2:
        raise ValueError(f"peer_medians needs at least two values, got {len(values)}")
    return _peer_medians(np.asarray(values, dtype=float)).tolist()


def _peer_medians(x: np.ndarray) -> np.ndarray:
    """:func:`peer_medians` of an array of at least two values, as an array: the same
    arithmetic (the mean of the two middle others for an even count), on every value at once."""
    v = np.sort(x)
    m = len(v) - 1  # the peers' count
    i = np.searchsorted(v, x, side="left")  # the left-out copy; others at j < i are v[j], at j >= i v[j + 1]

    def other(j: int) -> np.ndarray:  # the j-th of each value's others (j < m)
        return np.where(j < i, v[j], v[j + 1])

    j = m // 2
    return other(j) if m % 2 else (other(j - 1) + other(j)) / 2


def slowest(scores: Mapping[int, RankScore]) -> int | None:
    """The rank with the highest score (ties: the lower rank); None without scores."""
    if not scores:
        return None
    return min(scores, key=lambda r: (-scores[r].score, r))


def role_key(stage: int, role: int, tp: int) -> tuple[int, int] | None:
    """Peers share a pipeline stage and a tensor-parallel index (Megatron's rank order is
    tp fastest, so the index is ``role % tp``); None when the role is not known."""
    if stage < 0 or role < 0:
        return None
    return stage, role % tp if tp > 0 else 0


__all__ = [
    "BusyClock",
    "RankSample",
    "RankScore",
    "SCORE_FIELDS",
    "ScoreTable",
    "rank_scores",
    "recent_sample",
    "scores_of",
    "role_key",
    "score_column",
    "score_values",
    "slowest",
    "split_iteration",
]
