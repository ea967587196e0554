"""The profiling window: recent collective calls on a rank, and what they say together.

Each rank keeps its last few thousand collective calls (:class:`RecentCollectives`, fed by
the monitor thread from the records it already drains, so profiling adds nothing to the
training thread). When the controller asks, every rank sends the calls of the last few
seconds; :func:`analyze_window` matches the same collective across its members (the k-th
call on a group is the same collective on every member, because members issue a group's
collectives in the same order) and turns them into the inputs of
:mod:`falconext.profile.analysis`: per-collective arrival times and per-group transfer
times. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median
from typing import Any, Mapping, Protocol, Sequence

from falconext.profile.analysis import ArrivalStats, GroupTiming, suspicious_groups, wait_causers
from falconext.profile.matching import match
from falconext.trace.records import CallRecord

#: ops whose members all take part in every call (P2P is matched pairwise, not here)
COLLECTIVE_OPS = frozenset({"all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "barrier"})


class RecentCollectives:
    """A bounded memory of one rank's latest collective calls, indexed per group."""

    def __init__(self, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._rows: deque[tuple[str, int, float, float, int]] = deque(maxlen=capacity)
        self._count: dict[str, int] = {}
        self.roles: dict[str, str] = {}
        self.members: dict[str, list[int]] = {}
        #: group -> issue time of its latest call (any op): which groups are still in use
        self._last_issue: dict[str, float] = {}

    def feed(self, rec: CallRecord) -> None:
        """Records must come in ``seq`` order (as the tracer's drain returns them)."""
        if rec.group not in self.members:  # P2P groups too: validation tests their links
            self.members[rec.group] = list(rec.group_ranks) if rec.group_ranks else []
            self.roles[rec.group] = rec.role or ""
        self._last_issue[rec.group] = rec.t_issue
        if rec.op not in COLLECTIVE_OPS:
            return
        k = self._count.get(rec.group, 0)
        self._count[rec.group] = k + 1
        if rec.t_end is not None:  # completion unknown: useless for the split
            self._rows.append((rec.group, k, rec.t_issue, rec.t_end, rec.bytes))

    def snapshot(self, window_s: float, limit: int = 1500) -> dict[str, Any]:
        """The calls issued in the last ``window_s`` seconds before the newest one.

        ``limit`` keeps the message under the bus's size limit on ranks with many calls
        (the newest are kept). Only groups called in that window are named (roles and
        members): after a topology switch the old groups are gone, and naming them beside
        the new ones gave validation groups that overlap. Returns the fields of a
        ProfileData message.
        """
        rows = list(self._rows)
        calls: dict[str, list[list[float]]] = {}
        if rows:
            newest = max(r[2] for r in rows)
            for gid, k, t0, t1, nbytes in [r for r in rows if r[2] >= newest - window_s][-limit:]:
                calls.setdefault(gid, []).append([k, round(t0, 6), round(t1, 6), nbytes])
        latest = max(self._last_issue.values(), default=0.0)
        live = [g for g, t in self._last_issue.items() if t >= latest - window_s]
        return {"roles": {g: self.roles[g] for g in live}, "members": {g: list(self.members[g]) for g in live},
                "calls": calls}


class RankWindow(Protocol):
    """One rank's profile as received: a ProfileData message has exactly these fields."""

    rank: int
    roles: Mapping[str, str]
    members: Mapping[str, Sequence[int]]
    calls: Mapping[str, Sequence[Sequence[float]]]


def group_members(w: RankWindow) -> Mapping[str, Sequence[int]]:
    """The window's groups and their members: ``members``, plus the evenly spaced groups a
    ProfileData carries as spans (``group_members()``), unexpanded."""
    get = getattr(w, "group_members", None)
    return get() if callable(get) else w.members


def _groups_known(known: Mapping[str, Any], w: RankWindow) -> bool:
    """Whether every group of the window (those of :func:`group_members`) is in
    ``known``, without making their member lists or a set of their ids."""
    spans = getattr(w, "spans", None)
    return known.keys() >= w.members.keys() and (not spans or known.keys() >= spans.keys())


@dataclass(frozen=True)
class Findings:
    """What a profiling window points at: compute suspects (ranks that arrive late), groups
    whose transfers are slow, and the timings and arrival statistics behind them."""

    compute_suspects: list[int]
    suspicious_groups: list[str]
    timings: list[GroupTiming]
    arrivals: dict[int, ArrivalStats]
    #: group -> (role, members in group order) for every group seen
    groups: dict[str, tuple[str, list[int]]] = field(default_factory=dict)
    instances: int = 0

    def evidence(self) -> dict[str, Any]:
        """The findings as JSON-able values for the event log (shares and times rounded):
        the arrival shares and imposed waits of the ranks that arrived last at least once
        (at most one per collective; every other rank's are 0)."""
        last = sorted((r, s) for r, s in self.arrivals.items() if s.last)
        return {
            "compute_suspects": self.compute_suspects,
            "suspicious_groups": self.suspicious_groups,
            "instances": self.instances,
            "last_share": {str(r): round(s.last_share, 3) for r, s in last},
            "caused_wait_s": {str(r): round(s.caused_s, 4) for r, s in last},
            "transfer_ms": {
                f"{t.group}@{t.bytes}": round(t.transfer_s * 1e3, 3) for t in sorted(self.timings, key=lambda t: t.group)
            },
        }


def analyze_window(
    windows: Sequence[RankWindow],
    suspicious_factor: float = 1.1,
    min_bytes: int = 0,
    causer_share: float = 0.5,
    causer_dominance: float = 3.0,
) -> Findings:
    """Compute suspects (ranks the others wait for) and suspicious groups (slow transfers).

    Only collectives of at least ``min_bytes`` judge groups: a few-byte all-reduce takes
    latency plus scheduling noise, which says nothing about a link's bandwidth.
    """
    groups: dict[str, tuple[str, list[int]]] = {}
    for w in windows:
        if _groups_known(groups, w):  # its groups known already (from another member)
            continue
        for gid, ranks in group_members(w).items():
            if gid not in groups:
                groups[gid] = (w.roles.get(gid, ""), list(ranks))
    matched = match(windows, group_members)
    timings = [
        GroupTiming(gid, groups[gid][0] or None, len(groups[gid][1]), nbytes, median(ts))
        for (gid, nbytes), ts in sorted(matched.transfers.items())
    ]
    arrivals = matched.arrivals
    return Findings(
        compute_suspects=wait_causers(arrivals, causer_share, causer_dominance),
        suspicious_groups=sorted(set(suspicious_groups([t for t in timings if t.bytes >= min_bytes], suspicious_factor))),
        timings=timings,
        arrivals=arrivals,
        groups=groups,
        instances=matched.count,
    )
