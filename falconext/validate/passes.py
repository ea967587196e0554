"""Pass schedules that validate every link of a ring in a constant number of passes.

Benchmarking links one at a time costs O(links); running them all at once makes them
share ranks, so a slow rank would look like slow links. A pass is a set of
(src, dst) transfers in which no rank appears twice: all of them run concurrently
without interfering, and a link's time can be compared with the pass median.

- Ring (paper, Figure 9): alternate links form two perfect matchings when the ring is
  even (2 passes); an odd ring leaves one link over, which gets a third pass.
- Groups of one role are disjoint, so their schedules run side by side
  (:func:`merge_passes`): a whole role costs as many passes as its longest ring.

Only rings. The paper also schedules trees (4 passes: left then right children at
even, then odd depths), for collectives that NCCL runs as trees. Nothing in falconext
knows a tree to validate: the tracer sees a collective call, not the algorithm NCCL
picked for it, gloo (the CPU test bed) runs rings, the validation plan
(:mod:`falconext.validate.plan`) is built from group member lists and validates each
group as the ring through them, and the iteration-time model prices all-reduces as
rings. A tree schedule was written and tested here but had no caller, so it was removed;
it belongs back with whatever first learns the shape of a tree the job uses.
"""

from __future__ import annotations

from typing import Hashable, Mapping, Sequence, TypeVar

R = TypeVar("R", bound=Hashable)
Pass = list[tuple[R, R]]


def ring_passes(ranks: Sequence[R]) -> list[Pass]:
    """Passes covering each ring link ranks[i] -> ranks[i + 1 (mod n)] exactly once."""
    n = len(ranks)
    if len(set(ranks)) != n:
        raise ValueError("ring_passes: a rank appears twice in the ring")
    if n < 2:
        return []
    links = [(ranks[i], ranks[(i + 1) % n]) for i in range(n)]
    if n % 2 == 0:
        return [links[0::2], links[1::2]]
    # odd: links 0, 2, .., n-3 and 1, 3, .., n-2 are matchings; the closing link is left
    return [links[0 : n - 1 : 2], links[1 : n - 1 : 2], [links[n - 1]]]


def merge_passes(schedules: list[list[list[tuple[int, int]]]]) -> list[list[tuple[int, int]]]:
    """Run the schedules of disjoint groups side by side: pass i of all groups together.

    Validating every DP group (say) then takes as many passes as the longest schedule
    rather than their sum. Groups that share a rank would put it in two transfers at once,
    so that is an error naming the rank.
    """
    merged: list[list[tuple[int, int]]] = []
    for schedule in schedules:
        for i, p in enumerate(schedule):
            if i == len(merged):
                merged.append([])
            merged[i].extend((src, dst) for src, dst in p)
    for i, p in enumerate(merged):
        seen: set[int] = set()
        for pair in p:
            for r in pair:
                if r in seen:
                    raise ValueError(
                        f"merge_passes: rank {r} appears twice in merged pass {i} (groups are not disjoint)"
                    )
                seen.add(r)
    return merged


def split_rounds(passes: Sequence[Sequence[tuple[R, R]]], concurrency: int) -> list[list[tuple[R, R]]]:
    """Each pass cut into rounds of at most ``concurrency`` pairs (0: one round per pass).

    An empty pass stays one (empty) round, so every rank sees the same barriers.
    """
    out: list[list[tuple[R, R]]] = []
    for p in passes:
        pairs = list(p)
        step = concurrency or len(pairs) or 1
        out.extend(pairs[i : i + step] for i in range(0, len(pairs) or 1, step))
    return out



def one_per_link(passes: Sequence[Sequence[tuple[int, int]]], node_of: Mapping[int, int]) -> list[list[tuple[int, int]]]:
    """Each pass cut into as few passes as keep every inter-node link to one transfer each
    way at a time (pairs within a node, or of ranks without a node, stay in the first).

    A node link carries concurrent transfers one after another: two pairs crossing it at
    once each take twice a lone message's time (measured over rate-limited TCP links:
    2.4 MB/s per pair on a 5 MB/s link), which made a congested link's excess per byte
    twice what the job's messages meet. Measured alone, a link's message time is the same
    on any network, and comparable between links however many pairs a pass gives them.
    A pass with no two pairs on one link stays as it is; an empty pass stays one pass."""
    out: list[list[tuple[int, int]]] = []
    for p in passes:
        parts: list[list[tuple[int, int]]] = [[]]
        busy: list[set[tuple[int, int]]] = [set()]
        for src, dst in p:
            way = (node_of.get(src), node_of.get(dst))
            crosses = None not in way and way[0] != way[1]
            k = 0
            while crosses and way in busy[k]:
                k += 1
                if k == len(parts):
                    parts.append([])
                    busy.append(set())
            parts[k].append((src, dst))
            if crosses:
                busy[k].add(way)
        out.extend(parts)
    return out
