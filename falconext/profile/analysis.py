"""Profiling analysis: which groups transfer too slowly, which ranks everyone waits for.

A collective's time on a rank mixes two things: waiting for peers that arrive late,
and the transfer itself, which starts only when the last member arrives. Separating
them is what turns one slow iteration into suspects (Holmes' and FLARE's "last arriver"
idea): the rank that arrives last again and again is the computation suspect, and a
group whose transfer (not wait) is slow next to comparable groups is a communication
suspect. Pure functions over plain timings; the profiler that collects them is I/O.
"""

from __future__ import annotations

import collections
import heapq
import math
from dataclasses import dataclass
from statistics import median
from typing import Mapping, Sequence


@dataclass(frozen=True)
class Split:
    """One rank's time in one collective: waiting for late peers, then the transfer itself."""

    wait_s: float  # issue -> last member's issue: waiting for late peers
    transfer_s: float  # last member's issue -> completion: the transfer itself


def split_wait_transfer(instance: Mapping[int, tuple[float, float]]) -> dict[int, Split]:
    """Per rank, waiting vs transfer for one collective: {rank: (t_issue, t_end)}.

    Clocks must be comparable across ranks (one host, or synchronised hosts).
    """
    if not instance:
        return {}
    for rank, (t_issue, t_end) in instance.items():
        if not t_end >= t_issue:
            raise ValueError(f"rank {rank}: t_end {t_end} precedes t_issue {t_issue}")
    last = max(t for t, _ in instance.values())
    return {r: Split(last - t_issue, max(0.0, t_end - last)) for r, (t_issue, t_end) in instance.items()}


@dataclass(frozen=True)
class ArrivalStats:
    """How often a rank arrived last at its collectives, and the wait that imposed on the others."""

    instances: int  # collectives this rank took part in
    last: int  # how often it arrived last
    lateness_s: float  # median gap to the second-last arrival, when it was last
    caused_s: float = 0.0  # total of those gaps: the waiting this rank imposed on the others

    @property
    def last_share(self) -> float:
        """Share of its collectives at which the rank arrived last; 0.0 when it took part in none."""
        return self.last / self.instances if self.instances else 0.0


def transfer_median(instance: Mapping[int, Sequence[float]]) -> float:
    """The median over members of one collective's transfer time (:func:`split_wait_transfer`'s
    ``transfer_s``), from {rank: (t_issue, t_end, ...)}, without a Split per member (a group
    of 32,768 members is common). Raises ValueError for no members or an end before its issue."""
    if not instance:
        raise ValueError("no members")
    last = -math.inf
    for rank, row in instance.items():
        if not row[1] >= row[0]:
            raise ValueError(f"rank {rank}: t_end {row[1]} precedes t_issue {row[0]}")
        if row[0] > last:
            last = row[0]
    return median([row[1] - last if row[1] > last else 0.0 for row in instance.values()])


def last_and_second(inst: Mapping[int, float]) -> tuple[int, float, float]:
    """(the rank that arrived last, its arrival, the second-last arrival) of one collective of
    at least two members, in one pass; of equal arrivals the one listed later is last (as a
    stable sort of the arrivals puts it)."""
    rank, t_last, t_second = -1, -math.inf, -math.inf
    for r, t in inst.items():
        if t >= t_last:
            rank, t_last, t_second = r, t, t_last
        elif t > t_second:
            t_second = t
    return rank, t_last, t_second


def last_arrivers(instances: Sequence[Mapping[int, float]]) -> dict[int, ArrivalStats]:
    """Who arrives last, over many collectives, each {rank: t_issue} of its members."""
    counts: collections.Counter[int] = collections.Counter()
    lasts: dict[int, list[float]] = {}
    for inst in instances:
        if len(inst) < 2:
            continue
        rank, t_last, t_second = last_and_second(inst)
        counts.update(inst.keys())
        lasts.setdefault(rank, []).append(t_last - t_second)
    return {
        r: ArrivalStats(n, len(lasts.get(r, [])), median(lasts[r]) if r in lasts else 0.0, sum(lasts.get(r, [])))
        for r, n in counts.items()
    }


def wait_causers(stats: Mapping[int, ArrivalStats], min_share: float = 0.5, dominance: float = 3.0) -> list[int]:
    """Ranks that impose most of the waiting: at least ``min_share`` of all imposed wait,
    and ``dominance`` x as much as any other rank.

    Counting how often a rank is last undercounts a straggler: only the first collective
    after its slow compute waits for it, and the collectives right after start together
    in random order. The wait it imposes there is large, so weighing by the wait finds
    it where the share of last arrivals cannot.
    """
    total = sum(s.caused_s for s in stats.values())
    if total <= 0:
        return []
    # the two that imposed most (as a stable sort would rank them), without sorting every rank
    ranked = heapq.nlargest(2, stats.items(), key=lambda kv: kv[1].caused_s)
    (top, s0), rest = ranked[0], ranked[1:]
    second = rest[0][1].caused_s if rest else 0.0
    if s0.caused_s >= min_share * total and s0.caused_s >= dominance * second:
        return [top]
    return []


def compute_suspects(stats: Mapping[int, ArrivalStats], min_share: float = 0.5, min_lateness_s: float = 0.0) -> list[int]:
    """Ranks that arrive last in at least ``min_share`` of their collectives.

    With one straggler in a group the others are last only by chance (share ~1/size);
    the straggler is last almost always, by about its extra compute time.
    """
    return sorted(
        r for r, s in stats.items() if s.instances and s.last_share >= min_share and s.lateness_s > min_lateness_s
    )


@dataclass(frozen=True)
class GroupTiming:
    """One group's typical transfer time over a profiling window, with what makes groups comparable (role,
    size, bytes)."""

    group: str
    role: str | None
    size: int  # members
    bytes: int  # typical message size
    transfer_s: float  # median transfer time (waiting excluded) over the profiling window


def suspicious_groups(timings: Sequence[GroupTiming], factor: float = 1.1) -> list[str]:
    """Groups whose transfer time exceeds ``factor`` x the median of comparable groups.

    Comparable = same role, same number of members, same message size: only such groups
    should take the same time, so only they can show that one of them is slow.
    """
    if factor <= 1.0:
        raise ValueError(f"factor must be > 1, got {factor}")
    by_kind: dict[tuple, list[GroupTiming]] = {}
    for t in timings:
        if not t.transfer_s >= 0:
            raise ValueError(f"group {t.group}: transfer time must be >= 0, got {t.transfer_s}")
        by_kind.setdefault((t.role, t.size, t.bytes), []).append(t)
    out = []
    for peers in by_kind.values():
        if len(peers) < 2:
            continue
        ref = median(p.transfer_s for p in peers)
        out.extend(p.group for p in peers if p.transfer_s > factor * ref)
    return sorted(out)
