"""Ring validation schedules: disjoint passes, every ring link exactly once, 2 or 3 passes.

What a schedule must give the validator (falconext.validate.passes, paper Figure 9):
every directed ring link ranks[i] -> ranks[i + 1 (mod n)] measured exactly once (a
missing link is a fault never found, a repeated one wasted time), no rank in two
transfers of one pass (a shared rank would make a slow rank look like slow links), and
a constant number of passes: 2 for an even ring, 3 for an odd one, whatever its size.
The expected links are written here from the ring's definition, never read back from
the schedule.
"""

from __future__ import annotations

import random

import pytest

from falconext.validate.passes import one_per_link, ring_passes
from falconext.validate.plan import validation_plan


def ring_links(ranks):
    """The directed links of the ring through ``ranks`` in order, closing link included."""
    n = len(ranks)
    return [(ranks[i], ranks[(i + 1) % n]) for i in range(n)] if n >= 2 else []


def check(passes, links):
    """No rank twice in one pass; every link exactly once, in its direction; no empty pass."""
    for i, p in enumerate(passes):
        assert p, f"pass {i} is empty"
        ranks = [r for pair in p for r in pair]
        assert len(ranks) == len(set(ranks)), f"a rank appears twice in pass {i}: {p}"
    covered = [tuple(pair) for p in passes for pair in p]
    assert sorted(covered) == sorted(links), "every ring link exactly once"


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 9, 64, 127, 1000, 4096, 4097])
def test_ring(n):
    """Arbitrary global ranks in arbitrary order (the ring follows the given order, not
    the rank numbers): 2 passes when n is even, 3 when odd, each a matching, together
    every directed link once."""
    ranks = random.Random(n).sample(range(10 * n), n)
    passes = ring_passes(ranks)
    assert len(passes) == (2 if n % 2 == 0 else 3)
    check(passes, ring_links(ranks))


def test_two_rank_ring_measures_both_directions():
    """A ring of two is one cable used both ways: both directions are links of the ring
    and must be measured, in different passes (each pass uses both ranks)."""
    passes = ring_passes(["a", "b"])
    assert sorted(map(tuple, (pair for p in passes for pair in p))) == [("a", "b"), ("b", "a")]
    assert all(len(p) == 1 for p in passes) and len(passes) == 2


def test_odd_ring_cannot_do_with_two_passes():
    """Why 3 for odd rings: a pass is a matching, and a matching of an odd cycle has at
    most (n - 1) / 2 links, so two passes cover at most n - 1 of the n links."""
    for n in (3, 5, 7):
        passes = ring_passes(list(range(n)))
        assert max(len(p) for p in passes) <= (n - 1) // 2
        assert sum(len(p) for p in passes) == n


def test_ring_edges():
    assert ring_passes([]) == [] and ring_passes([7]) == []
    with pytest.raises(ValueError, match="twice"):
        ring_passes([1, 2, 1])


def test_the_validation_plan_covers_every_ring_of_a_role_in_three_passes_at_most():
    """What the product does with the schedules (falconext.validate.plan): every group of
    a role is validated as the ring through its members, all groups of the role side by
    side. TP2 x DP3 x PP2, 12 ranks: per role, at most 3 passes (DP rings of 3 are odd),
    no rank twice in a pass, and every ring link of every group of that role exactly once."""
    tp, dp, pp = 2, 3, 2
    world = list(range(tp * dp * pp))

    def role(t, d, s):
        return t + tp * (d + dp * s)

    groups = {}
    for s in range(pp):
        for d in range(dp):
            groups[f"tp-{s}-{d}"] = ("tp", [role(t, d, s) for t in range(tp)])
        for t in range(tp):
            groups[f"dp-{s}-{t}"] = ("dp", [role(t, d, s) for d in range(dp)])
    for d in range(dp):
        for t in range(tp):
            groups[f"pp-{d}-{t}"] = ("pp", [role(t, d, s) for s in range(pp)])
    plan = validation_plan(groups, world)
    assert plan["roles"] == ["dp", "pp", "tp"] and plan["scope"] == "all"
    expected_passes = {"dp": 3, "pp": 2, "tp": 2}
    assert len(plan["passes"]) == sum(expected_passes.values())
    start = 0
    for name in plan["roles"]:
        mine = plan["passes"][start : start + expected_passes[name]]
        start += expected_passes[name]
        links = [link for _, (r, members) in sorted(groups.items()) if r == name for link in ring_links(members)]
        check(mine, links)
    # a suspicious DP group narrows validation to the DP role, still every DP ring
    plan = validation_plan(groups, world, suspicious=["dp-1-0"])
    assert plan["roles"] == ["dp"] and plan["scope"] == "suspects"
    check(plan["passes"], [link for _, (r, m) in sorted(groups.items()) if r == "dp" for link in ring_links(m)])


def test_one_transfer_per_node_link_and_direction_at_a_time():
    """Two one-rank-per-stage pipelines across two nodes: both PP pairs of a pass cross
    the one node link the same way, so each gets a pass of its own (a lone message's time
    is what the link's excess per byte is read from); pairs within a node, the two ways of
    one link, and links between other nodes stay together."""
    node_of = {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2}
    passes = [[(0, 2), (1, 3)], [(2, 0), (3, 1)]]
    assert one_per_link(passes, node_of) == [[(0, 2)], [(1, 3)], [(2, 0)], [(3, 1)]]
    assert one_per_link([[(0, 1), (2, 4), (4, 2), (3, 0)]], node_of) == [[(0, 1), (2, 4), (4, 2), (3, 0)]]
    assert one_per_link([[(0, 2), (1, 3), (4, 5)]], node_of) == [[(0, 2), (4, 5)], [(1, 3)]]
    assert one_per_link([[]], node_of) == [[]]
    # a rank without a node is never held back
    assert one_per_link([[(0, 2), (1, 9)]], node_of) == [[(0, 2), (1, 9)]]


def test_the_validation_plan_keeps_one_transfer_per_node_link_when_it_knows_the_nodes():
    """DP2 x PP2 on two nodes of two ranks, stage by node: the PP rings both cross the
    link, and with the nodes given no pass holds two transfers one way over it, while
    every ring link is still measured exactly once."""
    groups = {"dp-0": ("dp", [0, 1]), "dp-1": ("dp", [2, 3]), "pp-0": ("pp", [0, 2]), "pp-1": ("pp", [1, 3])}
    node_of = {0: 0, 1: 0, 2: 1, 3: 1}
    plain = validation_plan(groups, [0, 1, 2, 3])
    split = validation_plan(groups, [0, 1, 2, 3], node_of=node_of)
    for p in split["passes"]:
        ways = [(node_of[a], node_of[b]) for a, b in p if node_of[a] != node_of[b]]
        assert len(ways) == len(set(ways)), p
    assert sorted(tuple(x) for p in split["passes"] for x in p) == sorted(tuple(x) for p in plain["passes"] for x in p)
    assert len(split["passes"]) > len(plain["passes"])
