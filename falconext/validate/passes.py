"""Pass schedules that validate every link of a ring or a tree in a constant number of passes.

Benchmarking links one at a time costs O(links); running them all at once makes them
share ranks, so a slow rank would look like slow links. A pass is a set of
(src, dst) transfers in which no rank appears twice: all of them run concurrently
without interfering, and a link's time can be compared with the pass median.

- Ring (paper, Figure 9 left): alternate links form two perfect matchings when the ring
  is even (2 passes); an odd ring leaves one link over, which gets a third pass.
- Binary tree (paper, Figure 9 right): a pass is a set of parent -> child edges in which
  no rank is twice. The paper sends to left, then right children at even, then odd
  depths (4 passes). :func:`tree_passes` needs 3, the fewest any tree with a rank of
  three edges allows: each edge takes one of three colours, the ones a rank's children
  get being the two its own parent edge did not (a proper edge colouring, built from the
  root down; a colour is a pass).
- Double binary tree (:func:`double_binary_trees`): NCCL's all-reduce across nodes for
  small and medium messages, two binary trees over the same ranks in which a rank is an
  inner node of at most one (of an odd count, the first rank is of both). Both trees'
  edges in at most 6 passes (:func:`double_tree_passes`: 3 per tree; a rank has edges
  in both trees, so the two trees' passes cannot simply be run together). A rank has up
  to 4 edges in the two trees, so no schedule does with fewer than 4; the union is not
  bipartite, and 6 is the bound proved here, not shown to be the least.
- Groups of one role are disjoint, so their schedules run side by side
  (:func:`merge_passes`): a whole role costs as many passes as its longest schedule.

The trees are NCCL's own (``ncclGetBtree``/``ncclGetDtree``: an in-order tree, rank i's
parent and children found from the lowest set bit of i; the second tree mirrored when
the tree has an even number of ranks, shifted by one when odd), not a heap-ordered tree:
validation must measure the edges NCCL's traffic takes, and a heap order would pair
other nodes. NCCL builds them over the nodes of a communicator (one rank per node, the
ranks inside a node chained); :func:`falconext.validate.plan.validation_plan` calls
:func:`double_tree_passes` with the first rank of a group on each node, for groups that
span nodes when their collectives may run as trees
(:func:`falconext.validate.plan.trees_apply`).
"""

from __future__ import annotations

from typing import Hashable, Iterable, Mapping, Sequence, TypeVar

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


def btree_children(n: int) -> list[list[int]]:
    """NCCL's binary tree over positions 0..n-1 (``ncclGetBtree``): each position's
    children, lower first. In-order: position i's lowest set bit b says its level; a
    position with b > 1 has children i - b/2 and (the first in range of) i + b/2, i + b/4,
    ...; odd positions are leaves; the root 0 has one child, the largest power of two
    below n (none when n == 1)."""
    if n < 0:
        raise ValueError(f"btree_children: n must be >= 0, got {n}")
    out: list[list[int]] = [[] for _ in range(n)]
    if n > 1:
        bit = 1
        while bit < n:
            bit <<= 1
        out[0].append(bit >> 1)
    for i in range(2, n, 2):
        low = (i & -i) >> 1
        out[i].append(i - low)
        while low and i + low >= n:
            low >>= 1
        if low:
            out[i].append(i + low)
    return out


def _btree_edge_colours(n: int) -> list[list[tuple[int, int]]]:
    """The edges of :func:`btree_children`'s tree over n positions in 3 matchings (fewer
    when the tree has no rank of three edges): from the root down, a node's children get
    the colours in (0, 1, 2) that its own parent edge does not have, so the at most three
    edges of a node all differ."""
    children = btree_children(n)
    colours: list[list[tuple[int, int]]] = [[], [], []]
    up: list[int] = [-1] * n  # colour of each position's parent edge (-1: the root)
    order = [0] if n else []
    for node in order:  # grows as it goes: breadth first from the root
        free = [c for c in (0, 1, 2) if c != up[node]]
        for child, c in zip(children[node], free):
            colours[c].append((node, child))
            up[child] = c
            order.append(child)
    return [p for p in colours if p]


def _check_distinct(ranks: Sequence[R], who: str) -> None:
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{who}: a rank appears twice in the tree")


def binary_tree_edges(ranks: Sequence[R]) -> list[tuple[R, R]]:
    """The parent -> child edges of NCCL's binary tree over ``ranks`` (in their order)."""
    _check_distinct(ranks, "binary_tree_edges")
    return [(ranks[p], ranks[c]) for p, kids in enumerate(btree_children(len(ranks))) for c in kids]


def _second_tree(n: int) -> list[int]:
    """Position of each position of the first tree in the second (``ncclGetDtree``):
    mirrored (n - 1 - i) when n is even, shifted by one ((i + 1) mod n) when odd."""
    return [n - 1 - i for i in range(n)] if n % 2 == 0 else [(i + 1) % n for i in range(n)]


def double_binary_trees(ranks: Sequence[R]) -> tuple[list[tuple[R, R]], list[tuple[R, R]]]:
    """The parent -> child edges of NCCL's two complementary trees over ``ranks``: the
    first is :func:`binary_tree_edges`, the second the same tree with positions mirrored
    (even count) or shifted by one (odd). With an even count no rank is an inner node of
    both; with an odd count only ``ranks[0]`` is (the first tree's root, one child)."""
    _check_distinct(ranks, "double_binary_trees")
    n = len(ranks)
    move = _second_tree(n)
    first = [(p, c) for p, kids in enumerate(btree_children(n)) for c in kids]
    return ([(ranks[p], ranks[c]) for p, c in first], [(ranks[move[p]], ranks[move[c]]) for p, c in first])


def tree_passes(ranks: Sequence[R]) -> list[Pass]:
    """Passes covering each edge of NCCL's binary tree over ``ranks`` exactly once, parent
    to child, no rank twice in a pass: at most 3 (none for fewer than 2 ranks)."""
    _check_distinct(ranks, "tree_passes")
    return [[(ranks[p], ranks[c]) for p, c in colour] for colour in _btree_edge_colours(len(ranks))]


def double_tree_passes(ranks: Sequence[R]) -> list[Pass]:
    """Passes covering each edge of both of :func:`double_binary_trees` exactly once
    (an edge both trees have, once), no rank twice in a pass: at most 6, the first
    tree's 3 then the second's (the second tree is the first with its positions moved,
    so the first tree's colouring, moved, is the second's)."""
    _check_distinct(ranks, "double_tree_passes")
    n = len(ranks)
    move = _second_tree(n)
    colours = _btree_edge_colours(n)
    first = [[(ranks[p], ranks[c]) for p, c in colour] for colour in colours]
    second = [[(ranks[move[p]], ranks[move[c]]) for p, c in colour] for colour in colours]
    return without(first + second, ())


def without(passes: Sequence[Sequence[tuple[R, R]]], covered: Iterable[tuple[R, R]]) -> list[Pass]:
    """``passes`` less the pairs in ``covered`` and less any pair an earlier pass already
    has (a pass loses pairs, so it stays one in which no rank is twice), empty passes
    dropped."""
    seen = set(covered)
    out: list[Pass] = []
    for p in passes:
        kept = []
        for pair in p:
            pair = (pair[0], pair[1])
            if pair not in seen:
                seen.add(pair)
                kept.append(pair)
        if kept:
            out.append(kept)
    return out


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
