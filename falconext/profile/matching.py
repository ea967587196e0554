"""One profiling window's collectives matched across their members, as arrays.

The k-th call on a group is the same collective on every member. A collective is
*complete* when every member of its group reported it; only complete ones say who arrived
last and how long the transfer took (:mod:`falconext.profile.analysis` explains both).
At 100k ranks a window holds about a million call rows, so the matching, the last and
second-last arrival and the transfer median of every collective are worked out over
numpy arrays, with exactly the results of the per-collective functions of
``analysis.py`` (:func:`~falconext.profile.analysis.last_and_second`,
:func:`~falconext.profile.analysis.transfer_median`,
:func:`~falconext.profile.analysis.last_arrivers`), ties and float rounding included.
Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import Callable, Mapping, Protocol, Sequence

import numpy as np

from falconext.profile.analysis import ArrivalStats


class CallWindow(Protocol):
    """What matching reads of one rank's profile: its rank and its call rows per group."""

    rank: int
    calls: Mapping[str, Sequence[Sequence[float]]]


@dataclass(frozen=True)
class Matched:
    """The complete collectives of a window: how many, per rank how often it took part in
    one of two or more members and arrived last, and per (group, bytes) each one's median
    transfer time (in the order the collectives were first reported)."""

    count: int
    arrivals: dict[int, ArrivalStats]
    transfers: dict[tuple[str, int], list[float]]


def _segments(keys: list[np.ndarray]) -> np.ndarray:
    """The start of each run of equal rows of ``keys`` (arrays of one length, sorted)."""
    n = len(keys[0])
    new = np.zeros(n, dtype=bool)
    if n:
        new[0] = True
    for a in keys:
        new[1:] |= a[1:] != a[:-1]
    return np.flatnonzero(new)


def _table(windows: Sequence[CallWindow]) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str], dict[str, int]]:
    """Every call row as one float array ``(k, t_issue, t_end, bytes)``, with each row's
    group index and rank, the groups' ids, and for each group the index of the first
    window whose calls name it (its members are read there). A window's rows come from
    its ``call_array()`` where it has one (a decoded profile: made when its batch was
    checked)."""
    gids: dict[str, int] = {}
    first_window: dict[str, int] = {}
    parts: list[np.ndarray] = []
    seg_g: list[int] = []
    seg_r: list[int] = []
    seg_n: list[int] = []
    for wi, w in enumerate(windows):
        rows = 0
        for gid, calls in w.calls.items():
            first_window.setdefault(gid, wi)
            if not calls:
                continue
            gi = gids.get(gid)
            if gi is None:
                gi = gids[gid] = len(gids)
            seg_g.append(gi)
            seg_r.append(w.rank)
            seg_n.append(len(calls))
            rows += len(calls)
        try:
            made = getattr(w, "call_array", None)
            part = made() if callable(made) else _rows_array(w)
        except (ValueError, TypeError, OverflowError):
            part = None
        if part is None or part.shape != (rows, 4):
            for gid, calls in w.calls.items():
                for row in calls:
                    if len(row) != 4:
                        raise ValueError(f"rank {w.rank}, group {gid}: a call row needs [k, t_issue, t_end, bytes]")
            raise ValueError("a call row is not four numbers")
        parts.append(part)
    table = np.concatenate(parts) if parts else np.zeros((0, 4))
    counts = np.array(seg_n, dtype=np.int64)
    g = np.repeat(np.array(seg_g, dtype=np.int64), counts)
    r = np.repeat(np.array(seg_r, dtype=np.int64), counts)
    return table, g, r, list(gids), first_window


def _rows_array(w: CallWindow) -> np.ndarray:
    """A window's call rows, group by group, as one ``(n, 4)`` float array."""
    rows = [row for calls in w.calls.values() for row in calls]
    return np.array(rows, dtype=np.float64).reshape(len(rows), 4)


def _is_member(ranks: np.ndarray, members: Sequence[int]) -> tuple[np.ndarray, int]:
    """Which of ``ranks`` are in ``members`` (a ``range`` without expanding it), and how
    many distinct members there are."""
    if isinstance(members, range) and members.step > 0:
        inside = (ranks >= members.start) & (ranks < members.stop)
        return inside & ((ranks - members.start) % members.step == 0), len(members)
    listed = np.unique(np.fromiter(members, dtype=np.int64, count=len(members)))
    return np.isin(ranks, listed), len(listed)


def match(windows: Sequence[CallWindow],
          members_in: Callable[[CallWindow], Mapping[str, Sequence[int]]]) -> Matched:
    """The complete collectives of ``windows`` (each rank's profile) and what they say.

    ``members_in(window)`` gives a window's groups and their members; a group's members
    are read from the first window that reports calls on it. A rank reporting the same
    collective twice counts once, with its later row. Raises ValueError for a row that
    is not ``[k, t_issue, t_end, bytes]`` or, in a collective of two or more members, a
    member's end before its issue.
    """
    table, g, r, names, first_window = _table(windows)
    if not len(table):
        return Matched(0, {}, {})
    k = table[:, 0].astype(np.int64)
    idx = np.arange(len(table))
    order = np.lexsort((idx, r, k, g))
    starts = _segments([g[order], k[order], r[order]])
    ends = np.r_[starts[1:], len(order)] - 1
    first, last = order[starts], order[ends]  # a repeated row: its place from the first, values from the last
    ug, uk, ur = g[first], k[first], r[first]
    t0, t1, nbytes = table[last, 1], table[last, 2], table[last, 3]
    # membership, a group at a time (its rows are contiguous: sorted by group first)
    member = np.zeros(len(ug), dtype=bool)
    need = np.zeros(len(names), dtype=np.int64)
    cache: dict[int, Mapping[str, Sequence[int]]] = {}
    bounds = _segments([ug])
    for s, e in zip(bounds, np.r_[bounds[1:], len(ug)]):
        gi = int(ug[s])
        wi = first_window[names[gi]]
        if wi not in cache:
            cache[wi] = members_in(windows[wi])
        mem = cache[wi].get(names[gi], ())
        member[s:e], need[gi] = _is_member(ur[s:e], mem)
    inst = _segments([ug, uk])
    size = np.diff(np.r_[inst, len(ug)])
    have = np.add.reduceat(member.astype(np.int64), inst)
    gi_of = ug[inst]
    complete = (need[gi_of] > 0) & (have == need[gi_of])
    count = int(complete.sum())
    valid = complete & (size >= 2)
    inst_id = np.repeat(np.arange(len(inst)), size)
    keep = valid[inst_id]
    if not keep.any():
        return Matched(count, {}, {})
    # the instances in the order they were first reported (as a dict filled row by row)
    seen_at = np.minimum.reduceat(first, inst)
    rank_of_inst = np.empty(len(inst), dtype=np.int64)
    rank_of_inst[np.argsort(seen_at, kind="stable")] = np.arange(len(inst))
    rows = np.flatnonzero(keep)
    i_row, t0v, t1v, rv, pos = inst_id[rows], t0[rows], t1[rows], ur[rows], first[rows]
    bad = np.flatnonzero(~(t1v >= t0v))
    if len(bad):
        b = bad[0]
        raise ValueError(f"rank {int(rv[b])}: t_end {float(t1v[b])} precedes t_issue {float(t0v[b])}")
    # last and second-last arrival: by issue time, ties to the member reported later
    by_arrival = np.lexsort((pos, t0v, i_row))
    seg = _segments([i_row[by_arrival]])
    seg_end = np.r_[seg[1:], len(by_arrival)] - 1
    last_row = by_arrival[seg_end]
    t_last = t0v[last_row]
    t_second = t0v[by_arrival[seg_end - 1]]
    last_rank = rv[last_row]
    insts = i_row[by_arrival][seg]  # the instance of each segment
    # transfer medians: each member's end after the last arrival (0 when before it)
    local = np.repeat(np.arange(len(seg)), np.diff(np.r_[seg, len(by_arrival)]))
    per_row_last = np.empty(len(rows))
    per_row_last[by_arrival] = t_last[local]
    spent = np.where(t1v > per_row_last, t1v - per_row_last, 0.0)
    by_spent = np.lexsort((spent, i_row))
    n = np.diff(np.r_[seg, len(by_spent)])
    lo, hi = spent[by_spent[seg + (n - 1) // 2]], spent[by_spent[seg + n // 2]]
    medians = np.where(n % 2 == 1, lo, (lo + hi) / 2)
    most = np.maximum.reduceat(nbytes[rows][by_arrival], seg)
    in_order = np.argsort(rank_of_inst[insts], kind="stable")
    # per (group, bytes) the transfer medians, per rank the gaps it left when it was last (in order)
    transfers: dict[tuple[str, int], list[float]] = {}
    gaps: dict[int, list[float]] = {}
    for j in in_order.tolist():
        transfers.setdefault((names[int(gi_of[insts[j]])], int(most[j])), []).append(float(medians[j]))
        gaps.setdefault(int(last_rank[j]), []).append(float(t_last[j] - t_second[j]))
    # per rank: the collectives it took part in, ranks in the order they first appear
    taken = np.bincount(rv, minlength=int(rv.max()) + 1)
    appear = np.lexsort((pos, rank_of_inst[i_row]))
    ranks_seen, at = np.unique(rv[appear], return_index=True)
    ranks_in_order = ranks_seen[np.argsort(at, kind="stable")].tolist()
    taken_of = taken.tolist()
    never_last: dict[int, ArrivalStats] = {}  # a rank never last: one (immutable) record per count
    arrivals: dict[int, ArrivalStats] = {}
    for rank in ranks_in_order:
        g = gaps.get(rank)
        if g is not None:
            arrivals[rank] = ArrivalStats(taken_of[rank], len(g), median(g), sum(g))
            continue
        n = taken_of[rank]
        made = never_last.get(n)
        if made is None:
            made = never_last[n] = ArrivalStats(n, 0, 0.0, 0)
        arrivals[rank] = made
    return Matched(count, arrivals, transfers)
