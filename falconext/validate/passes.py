"""Pass schedules that validate every link of a ring or a tree in a constant number of passes.

Benchmarking links one at a time costs O(links); running them all at once makes them
share ranks, so a slow rank would look like slow links. A pass is a set of
(src, dst) transfers in which no rank appears twice: all of them run concurrently
without interfering, and a link's time can be compared with the pass median.

- Ring (paper, Figure 9): alternate links form two perfect matchings when the ring is
  even (2 passes); an odd ring leaves one link over, which gets a third pass.
- Tree: every parent sends to its j-th child in pass (parity of its depth, j). A pass
  then touches each parent once (as src) and each child once (as dst), and a node is
  never both, because parents and children of one pass sit at depths of different
  parity. A binary tree needs 4 passes (left/right children at even, then odd levels),
  whatever its size; a tree of fan-out k needs 2k.
"""

from __future__ import annotations

from typing import Hashable, Sequence, TypeVar

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


def tree_depths(parent: Sequence[int | None]) -> list[int]:
    """Depth of every node; a clear error for anything that is not one rooted tree."""
    n = len(parent)
    roots = [i for i, p in enumerate(parent) if p is None]
    if len(roots) != 1:
        raise ValueError(f"tree_passes: expected exactly one root (parent None), found {len(roots)}")
    for i, p in enumerate(parent):
        if p is not None and (isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < n or p == i):
            raise ValueError(f"tree_passes: parent[{i}] = {p!r} is not another node index in [0, {n})")
    depth: list[int | None] = [None] * n
    depth[roots[0]] = 0
    for start in range(n):
        path = []
        node = start
        while depth[node] is None:
            path.append(node)
            node = parent[node]  # type: ignore[assignment]
            if node in path:
                raise ValueError(f"tree_passes: parent links form a cycle through node {node}")
        d = depth[node]
        for v in reversed(path):
            d += 1  # type: ignore[operator]
            depth[v] = d
    return depth  # type: ignore[return-value]


def tree_passes(parent: Sequence[int | None]) -> list[Pass]:
    """Passes covering each tree edge parent -> child exactly once (node indices)."""
    depth = tree_depths(parent)
    children: dict[int, list[int]] = {}
    for child, p in enumerate(parent):
        if p is not None:
            children.setdefault(p, []).append(child)
    fan_out = max((len(c) for c in children.values()), default=0)
    passes: list[Pass] = []
    for parity in (0, 1):
        for j in range(fan_out):
            edges = [
                (p, kids[j])
                for p, kids in sorted(children.items())
                if depth[p] % 2 == parity and j < len(kids)
            ]
            if edges:
                passes.append(edges)
    return passes


def binary_tree_parent(n: int) -> list[int | None]:
    """The heap-ordered binary tree over n nodes (node i's parent is (i - 1) // 2)."""
    return [None] + [(i - 1) // 2 for i in range(1, n)]


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
