"""Ring and tree validation schedules: disjoint passes, full coverage, constant pass counts."""

from __future__ import annotations

import random
import re

import pytest

from falconext.validate.passes import binary_tree_parent, ring_passes, tree_depths, tree_passes


def check(passes, links):
    for p in passes:
        ranks = [r for pair in p for r in pair]
        assert len(ranks) == len(set(ranks)), "a rank appears twice in one pass"
    covered = [pair for p in passes for pair in p]
    assert sorted(covered) == sorted(links), "every link exactly once"


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 9, 64, 127, 1000, 4096, 4097])
def test_ring(n):
    ranks = random.Random(n).sample(range(10 * n), n)  # arbitrary global ranks, any order
    passes = ring_passes(ranks)
    assert len(passes) == (2 if n % 2 == 0 else 3)
    check(passes, [(ranks[i], ranks[(i + 1) % n]) for i in range(n)])


def test_ring_edges():
    assert ring_passes([]) == [] and ring_passes([7]) == []
    with pytest.raises(ValueError, match="twice"):
        ring_passes([1, 2, 1])


@pytest.mark.parametrize("n", [2, 3, 7, 100, 1023, 5000])
def test_binary_tree_has_four_passes(n):
    parent = binary_tree_parent(n)
    passes = tree_passes(parent)
    # a root with one child needs 1 pass, with two 2; a third level adds the odd passes
    assert len(passes) == {2: 1, 3: 2, 4: 3}.get(n, 4)
    check(passes, [(p, c) for c, p in enumerate(parent) if p is not None])


@pytest.mark.parametrize("seed", range(20))
def test_random_trees(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 3000)
    fan = rng.randint(1, 5)
    parent: list[int | None] = [None]
    kids = [0]
    order = list(range(1, n))
    for c in order:  # attach each node under one with spare fan-out
        p = rng.choice([i for i in range(max(0, c - 50), c) if kids[i] < fan] or [c - 1])
        parent.append(p)
        kids[p] += 1
        kids.append(0)
    perm = list(range(n))
    rng.shuffle(perm)  # node indices need not be in depth order
    shuffled: list[int | None] = [None] * n
    for old, p in enumerate(parent):
        shuffled[perm[old]] = None if p is None else perm[p]
    passes = tree_passes(shuffled)
    assert len(passes) <= 2 * max(kids)
    check(passes, [(p, c) for c, p in enumerate(shuffled) if p is not None])


@pytest.mark.parametrize(
    "parent, word",
    [([None, None], "one root"), ([1, 0], "one root"), ([None, 2, 1], "cycle"), ([None, 5], "parent[1]"), ([None, 1], "parent[1]")],
)
def test_bad_trees_are_named(parent, word):
    with pytest.raises(ValueError, match=re.escape(word)):
        tree_passes(parent)


def test_depths():
    assert tree_depths([None, 0, 0, 1, 3]) == [0, 1, 1, 2, 3]
