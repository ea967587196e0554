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
from collections import deque
from dataclasses import dataclass
from statistics import median
from typing import Hashable, Mapping, Sequence

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
    return scores_of(ranks, [samples[r].iter_s for r in ranks], [samples[r].compute_s for r in ranks],
                     [samples[r].wait_s for r in ranks], [roles.get(r) for r in ranks])


def scores_of(ranks: Sequence[int], iter_s: Sequence[float], compute_s: Sequence[float], wait_s: Sequence[float],
              roles: Sequence[Hashable]) -> dict[int, RankScore]:
    """:func:`rank_scores` of the samples given a quantity at a time: ``ranks[i]``'s
    iteration, compute and wait seconds and role are the i-th of each (the controller
    reads them from 100k heartbeats every few seconds, without a sample object per rank)."""
    if not ranks:
        return {}
    its = np.array(iter_s, dtype=float)
    computes = np.array(compute_s, dtype=float)
    waits = np.array(wait_s, dtype=float)
    with np.errstate(invalid="ignore"):
        good = np.isfinite(its) & np.isfinite(computes) & np.isfinite(waits) & (its >= 0) & (computes >= 0) & (waits >= 0)
    out: dict[int, RankScore] = {}
    for idx in _role_groups(roles, good):
        members = [ranks[i] for i in idx.tolist()]
        c, w, it = computes[idx], waits[idx], its[idx]
        if len(members) == 1:
            out[members[0]] = RankScore(float(c[0]), float(w[0]), 1.0, 0.0, 0.0, 0)
            continue
        # each rank's peers are its role less itself: medians left one out, from one sort
        # per quantity (thousands of ranks in a role: not one sort per rank)
        pc, pw, pi = _peer_medians(c), _peer_medians(w), _peer_medians(it)
        late = pw - w
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(pc > 0, c / np.where(pc > 0, pc, 1.0), 1.0)
            score = np.where(pi > 0, late / np.where(pi > 0, pi, 1.0), 0.0)
        peers = len(members) - 1
        for r, cs, ws, ra, la, sc in zip(members, c.tolist(), w.tolist(), ratio.tolist(), late.tolist(),
                                          score.tolist()):
            out[r] = RankScore(cs, ws, ra, la, sc, peers)
    return out


def _role_groups(roles: Sequence[Hashable], good: np.ndarray) -> list[np.ndarray]:
    """The positions where ``good`` holds, grouped by their ``roles`` entry, roles in the
    order first met, each group's positions in order."""
    where = np.flatnonzero(good)
    if not len(where):
        return []
    index: dict[Hashable, int] = {}
    ids = np.array([index.setdefault(roles[i], len(index)) for i in where.tolist()], dtype=np.int64)
    order = np.argsort(ids, kind="stable")
    bounds = np.flatnonzero(np.diff(ids[order])) + 1
    return np.split(where[order], bounds)


def slowest_listed(scores: Mapping[int, RankScore], most: int) -> dict[int, RankScore]:
    """Every score when there are at most ``most``, else the ``most`` highest (ties by
    rank), in rank order."""
    if len(scores) <= most:
        return dict(sorted(scores.items()))
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
        for i, v, peers in zip(idx.tolist(), mine.tolist(), _peer_medians(mine).tolist()):
            if peers > 0 and v / peers >= ratio and scores[ranks[i]].score >= min_score:
                out[ranks[i]] = v / peers
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
    "rank_scores",
    "recent_sample",
    "scores_of",
    "role_key",
    "slowest",
    "split_iteration",
]
