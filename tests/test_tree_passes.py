"""Tree validation: NCCL's double binary trees, their pass schedules, and when a plan uses them.

Across nodes NCCL runs small and medium all-reduces as two binary trees over the nodes,
so a congested link may carry tree traffic only, between nodes that are neighbours in no
ring. What the schedules must give the validator (falconext.validate.passes, paper
Figure 9 right): every parent -> child edge measured exactly once, no rank in two
transfers of one pass, and a constant number of passes whatever the size (at most 4 per
tree; 3 achieved, 6 for both trees). The expected edges are written here from NCCL's own
parent formula (ncclGetBtree's ``up``, ncclGetDtree's mirror and shift), never read back
from the code under test. Then the decision (validation_trees auto/on/off, the fabric,
NCCL_ALGO, the nodes a group spans), the plan, the verdict on a link only a tree
crosses, and the setting's flag.
"""

from __future__ import annotations

import argparse
import random
import types

import pytest

from falconext.config import ConfigError, FalconConfig, add_config_arguments, config_from_args
from falconext.control.controller import RUNTIME_SETTABLE, Controller
from falconext.protocol.codec import decode, encode
from falconext.protocol.messages import ProfileData
from falconext.validate.passes import (
    binary_tree_edges,
    btree_children,
    double_binary_trees,
    double_tree_passes,
    tree_passes,
)
from falconext.validate.plan import nccl_allows_trees, node_heads, trees_apply, validation_plan
from falconext.validate.verdict import slow_links

SIZES = list(range(1, 65)) + [127, 128, 129, 1000, 4095, 4096, 4097, 16383, 16384]


def nccl_parent(n: int, r: int) -> int | None:
    """ncclGetBtree's parent of position r among n: flip r's lowest set bit into the next
    one up, or (out of range) just clear it; the root 0 has none."""
    if r == 0:
        return None
    bit = r & -r
    up = (r ^ bit) | (bit << 1)
    return up if up < n else r ^ bit


def second_parent(n: int, r: int) -> int | None:
    """ncclGetDtree's second tree: the first mirrored (n even) or shifted by one (n odd)."""
    if n % 2 == 0:
        p = nccl_parent(n, n - 1 - r)
        return None if p is None else n - 1 - p
    p = nccl_parent(n, (r - 1) % n)
    return None if p is None else (p + 1) % n


def edges_of(parent, n: int, ranks) -> list[tuple[int, int]]:
    return sorted((ranks[parent(n, r)], ranks[r]) for r in range(n) if parent(n, r) is not None)


def ranks_for(n: int) -> list[int]:
    """Arbitrary global ranks in arbitrary order: the tree follows the order given."""
    return random.Random(n).sample(range(10 * n + 10), n)


def check(passes, edges) -> None:
    """No empty pass, no rank twice in a pass, every edge exactly once in its direction."""
    for i, p in enumerate(passes):
        assert p, f"pass {i} is empty"
        ranks = [r for pair in p for r in pair]
        assert len(ranks) == len(set(ranks)), f"a rank appears twice in pass {i}: {p}"
    covered = sorted(tuple(pair) for p in passes for pair in p)
    assert covered == sorted(edges), "every tree edge exactly once"


def is_one_tree(edges, ranks) -> bool:
    """len(ranks) - 1 edges, one parent per rank but one root, every rank reached from it."""
    if len(ranks) <= 1:
        return not edges
    children: dict[int, list[int]] = {}
    for p, c in edges:
        children.setdefault(p, []).append(c)
    kids = [c for _, c in edges]
    roots = set(ranks) - set(kids)
    if len(edges) != len(ranks) - 1 or len(set(kids)) != len(kids) or len(roots) != 1:
        return False
    seen, todo = set(roots), list(roots)
    while todo:
        for c in children.get(todo.pop(), []):
            seen.add(c)
            todo.append(c)
    return seen == set(ranks)


# --- the trees ---------------------------------------------------------------------------

@pytest.mark.parametrize("n", SIZES)
def test_the_binary_tree_is_nccls(n):
    """btree_children is ncclGetBtree: each position's children are exactly the positions
    whose NCCL parent it is, at most two, and together they form one tree rooted at 0
    (the root has one child; odd positions are leaves)."""
    children = btree_children(n)
    assert len(children) == n
    assert all(len(c) <= 2 for c in children)
    assert sorted((p, c) for p, kids in enumerate(children) for c in kids) == edges_of(nccl_parent, n, range(n))
    ranks = ranks_for(n)
    assert sorted(binary_tree_edges(ranks)) == edges_of(nccl_parent, n, ranks)
    assert is_one_tree(binary_tree_edges(ranks), ranks)
    assert all(not children[i] for i in range(1, n, 2))
    if n > 1:
        assert len(children[0]) == 1


@pytest.mark.parametrize("n", SIZES)
def test_double_binary_trees_are_nccls_and_complementary(n):
    """The second tree is ncclGetDtree's (mirror for an even count, shift by one for odd),
    both are trees over every rank, and no rank is an inner node of both, but for an odd
    count the first rank (the first tree's root, which has one child there)."""
    ranks = ranks_for(n)
    first, second = double_binary_trees(ranks)
    assert sorted(first) == edges_of(nccl_parent, n, ranks)
    assert sorted(second) == edges_of(second_parent, n, ranks)
    assert is_one_tree(first, ranks) and is_one_tree(second, ranks)
    both = {p for p, _ in first} & {p for p, _ in second}
    if n % 2 == 0 or n < 3:
        assert not both
    else:
        assert both == {ranks[0]}
        assert sum(1 for p, _ in first if p == ranks[0]) == 1


def test_nccl_pictures():
    """The trees drawn in NCCL's trees.cc: 14 ranks, 0 -> 8 -> (4, 12), 12 -> (10, 13);
    the mirrored second tree is rooted at 13."""
    assert btree_children(14)[:13:4] == [[8], [2, 6], [4, 12], [10, 13]]
    first, second = double_binary_trees(list(range(14)))
    assert (13, 5) in second and not any(c == 13 for _, c in second)
    # odd: shifted by one, rooted at 1
    _, second = double_binary_trees(list(range(13)))
    assert (1, 9) in second and not any(c == 1 for _, c in second)


def test_tree_inputs():
    assert binary_tree_edges([]) == [] and binary_tree_edges(["a"]) == []
    assert tree_passes([]) == [] and tree_passes([7]) == [] and double_tree_passes([7]) == []
    for f in (binary_tree_edges, double_binary_trees, tree_passes, double_tree_passes):
        with pytest.raises(ValueError, match="twice"):
            f([1, 2, 1])


# --- the schedules -----------------------------------------------------------------------

@pytest.mark.parametrize("n", SIZES)
def test_tree_passes_cover_every_edge_in_three_passes(n):
    """Every parent -> child edge once, no rank twice in a pass, at most 3 passes (the
    paper's bound is 4); exactly 3 once a rank has three edges (its three edges need
    three passes: no fewer is possible), which every tree of 4 or more ranks has."""
    ranks = ranks_for(n)
    passes = tree_passes(ranks)
    check(passes, edges_of(nccl_parent, n, ranks))
    assert len(passes) <= 3
    assert len(passes) == {1: 0, 2: 1, 3: 2}.get(n, 3)


@pytest.mark.parametrize("n", SIZES)
def test_double_tree_passes_cover_both_trees_in_six_passes(n):
    """Both trees' edges, each distinct directed edge once (an edge both trees have is
    measured once), no rank twice in a pass, at most 6 passes: at most 3 per tree."""
    ranks = ranks_for(n)
    passes = double_tree_passes(ranks)
    edges = set(edges_of(nccl_parent, n, ranks)) | set(edges_of(second_parent, n, ranks))
    check(passes, edges)
    assert len(passes) <= 6
    if n >= 8:
        assert len(passes) == 6


def test_an_edge_both_trees_have_is_measured_once():
    """Three ranks: the first tree is 0 -> 2 -> 1, the shifted second 1 -> 0 -> 2; 0 -> 2
    is in both."""
    first, second = double_binary_trees([0, 1, 2])
    assert sorted(first) == [(0, 2), (2, 1)] and sorted(second) == [(0, 2), (1, 0)]
    check(double_tree_passes([0, 1, 2]), [(0, 2), (1, 0), (2, 1)])


# --- the decision ------------------------------------------------------------------------

@pytest.mark.parametrize("algo, trees", [
    (None, True), ("", True), ("  ", True),
    ("Tree", True), ("tree,ring", True), ("RING,TREE", True), ("NVLSTree", True), ("ring, nvlstree", True),
    ("Ring", False), ("ring,collnetdirect", False), ("NVLS", False), ("PAT", False),
    ("^Ring", True), ("^ring,collnetchain", True), ("^", True),
    ("^tree", True),  # NVLSTree stays allowed, and is a tree between nodes
    ("^Tree,NVLSTree", False), ("^ring,tree,nvlstree", False),
    # NCCL 2.24: per-function lists; the one without a function applies to the others
    ("ring;allreduce:tree,ring", True), ("tree,ring;allreduce:ring", False),
    ("allreduce:^tree,nvlstree", False), ("AllReduce:^ring", True), ("broadcast:ring", True),
    ("ring;broadcast:tree", False), ("ring,collnetdirect;allreduce:tree,collnetdirect;broadcast:ring", True),
])
def test_nccl_algo(algo, trees):
    assert nccl_allows_trees(algo) is trees


def test_trees_apply():
    """auto: trees across nodes on NCCL where NCCL_ALGO allows them; on: across nodes
    whatever the fabric (the CPU bed); off: never; never within one node."""
    for fabric in ("nccl", "cuda", "NCCL", "cpu:gloo,cuda:nccl"):
        assert trees_apply("auto", fabric, None, 2)
        assert trees_apply("auto", fabric, "Tree", 5)
        assert not trees_apply("auto", fabric, "Ring", 2)
        assert trees_apply("auto", fabric, "^Ring", 2)
        assert not trees_apply("auto", fabric, None, 1)
    for fabric in ("gloo", "cpu", "", "emulated"):
        assert not trees_apply("auto", fabric, None, 4)
        assert not trees_apply("auto", fabric, "Tree", 4)
        assert trees_apply("on", fabric, None, 2)
        assert trees_apply("on", fabric, "Ring", 2)
    for setting in ("auto", "on", "off"):
        assert not trees_apply(setting, "nccl", "tree", 1)
        assert not trees_apply(setting, "nccl", "tree", 0)
    assert not trees_apply("off", "nccl", "tree", 8)
    with pytest.raises(ValueError, match="validation_trees"):
        trees_apply("yes", "nccl", None, 2)


def test_node_heads_are_first_members_per_node_in_group_order():
    node_of = {5: 2, 1: 0, 7: 2, 3: 1, 9: 0}
    assert node_heads([5, 1, 7, 3, 9], node_of) == [5, 1, 3]
    assert node_heads([5, 1, 42], node_of) == [5, 1]  # a rank without a node is left out


# --- the plan ----------------------------------------------------------------------------

def two_per_node(world: int) -> dict[int, int]:
    return {r: r // 2 for r in range(world)}


def dp_groups(world: int):
    """Two DP groups of a TP2 job: [0, 2, 4, ..] and [1, 3, 5, ..], two ranks per node, so
    each group has one rank on every node."""
    return {"tp-%d" % i: ("tp", [2 * i, 2 * i + 1]) for i in range(world // 2)} | {
        "dp-0": ("dp", list(range(0, world, 2))), "dp-1": ("dp", list(range(1, world, 2)))}


def ring_links(m):
    return [(m[i], m[(i + 1) % len(m)]) for i in range(len(m))] if len(m) >= 2 else []


@pytest.mark.parametrize("world", [4, 6, 16, 22])
def test_the_plan_adds_tree_edges_across_nodes_when_trees_apply(world):
    """trees on: every DP group (spanning world / 2 nodes) gets its ring's links and its
    two trees' edges over its first rank per node, each once; a TP group (inside a node)
    only its ring; no rank twice in a pass, and no pass with two transfers one way over
    one node link."""
    groups = dp_groups(world)
    node_of = two_per_node(world)
    plan = validation_plan(groups, list(range(world)), node_of=node_of, trees="on")
    assert plan["trees"] == ["dp-0", "dp-1"]
    want = set()
    for _, (role, m) in groups.items():
        want |= set(ring_links(m))
        if role == "dp":
            first, second = double_binary_trees(node_heads(m, node_of))
            want |= set(first) | set(second)
    check(plan["passes"], want)
    for p in plan["passes"]:
        ways = [(node_of[a], node_of[b]) for a, b in p if node_of[a] != node_of[b]]
        assert len(ways) == len(set(ways)), p
    # rings only: fewer passes, and no edge between nodes that are not ring neighbours
    rings = validation_plan(groups, list(range(world)), node_of=node_of, trees="off")
    assert rings["trees"] == []
    check(rings["passes"], {x for _, (_, m) in groups.items() for x in ring_links(m)})
    if world >= 6:
        assert len(rings["passes"]) < len(plan["passes"])


def test_trees_only_where_they_apply():
    """auto: on NCCL with NCCL_ALGO unset or naming trees, across nodes; not on gloo, not
    with NCCL_ALGO=Ring, not for a job on one node, not without knowing the nodes."""
    world = 8
    groups, node_of = dp_groups(world), two_per_node(world)

    def treed(**kw):
        return validation_plan(groups, list(range(world)), **kw)["trees"]

    assert treed(node_of=node_of, trees="auto", fabric="nccl") == ["dp-0", "dp-1"]
    assert treed(node_of=node_of, trees="auto", fabric="nccl", nccl_algo="^ring") == ["dp-0", "dp-1"]
    assert treed(node_of=node_of, trees="auto", fabric="nccl", nccl_algo="Ring") == []
    assert treed(node_of=node_of, trees="auto", fabric="gloo") == []
    assert treed(node_of=node_of, trees="on", fabric="gloo") == ["dp-0", "dp-1"]
    assert treed(node_of=node_of, trees="off", fabric="nccl") == []
    assert treed(node_of={r: 0 for r in range(world)}, trees="on") == []
    assert treed(trees="on") == []
    assert treed(node_of=node_of) == []  # the default: rings only
    # suspects narrow the roles: a suspicious TP group (inside a node) gets no tree at all
    narrow = validation_plan(groups, list(range(world)), suspicious=["tp-0"], node_of=node_of, trees="on")
    assert narrow["roles"] == ["tp"] and narrow["trees"] == []


def measure(passes, node_of, slow_pair, slow_s=0.01, healthy_s=0.001):
    """Every pair of the plan's passes measured: ``slow_pair`` of nodes (either way) is
    congested."""
    out = []
    for p in passes:
        for a, b in p:
            pair = tuple(sorted((node_of[a], node_of[b])))
            out.append((a, b, slow_s if pair == slow_pair else healthy_s))
    return out


def test_a_link_only_a_tree_crosses_is_named():
    """Four nodes, two ranks each, one DP group per TP rank: the rings join nodes 0-1-2-3-0,
    so a congested link between nodes 0 and 2 carries tree traffic only (NCCL's trees over
    four nodes join 0 and 2). Rings alone never measure it and name nothing; with trees
    it is measured, compared with the other node links' reference and named, alone."""
    world = 8
    groups, node_of = dp_groups(world), two_per_node(world)
    rings = validation_plan(groups, list(range(world)), node_of=node_of, trees="off")
    links, evidence = slow_links(measure(rings["passes"], node_of, (0, 2)), node_of)
    assert links == [] and "0-2" not in evidence["links"]
    trees = validation_plan(groups, list(range(world)), node_of=node_of, trees="on")
    links, evidence = slow_links(measure(trees["passes"], node_of, (0, 2)), node_of)
    assert links == [(0, 2)], evidence
    # a congested ring link is still named, and only it
    links, _ = slow_links(measure(trees["passes"], node_of, (1, 2)), node_of)
    assert links == [(1, 2)]


# --- the setting and where its inputs come from ---------------------------------------------

def test_the_setting_and_its_flag():
    assert FalconConfig().validation_trees == "auto"
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    for value in ("auto", "on", "off"):
        assert config_from_args(parser.parse_args(["--falcon-validation-trees", value])).validation_trees == value
    for bad in ("yes", "ON", "", "tree"):
        with pytest.raises(ConfigError) as exc:
            config_from_args(parser.parse_args(["--falcon-validation-trees", bad]))
        message = str(exc.value)
        assert "\n" not in message and "validation_trees" in message and repr(bad) in message
    assert "validation_trees" in RUNTIME_SETTABLE  # the controller reads it at every plan


def profile(rank, fabric="", nccl_algo=None):
    return ProfileData(rank, 1, {}, {}, {}, fabric=fabric, nccl_algo=nccl_algo)


def test_profiles_carry_the_fabric_and_nccl_algo_to_the_controller():
    """The ranks know their fabric and NCCL_ALGO, the controller builds the plan: the
    profile carries them (strictly decoded), and the controller decides with a rank whose
    collectives may run as trees, else the first rank's."""
    msg = ProfileData.compact(3, 7, {}, {"g": [0, 1, 2]}, {}, "nccl", "^ring")
    assert decode(encode(msg)) == msg and (msg.fabric, msg.nccl_algo) == ("nccl", "^ring")
    assert decode(encode(profile(1))) == profile(1)
    ctl = Controller(FalconConfig(), world=4)
    assert ctl.localizer.tree_inputs() == {"fabric": "", "nccl_algo": None}
    ctl.localizer.profiles = {r: profile(r, "gloo") for r in range(4)}
    assert ctl.localizer.tree_inputs() == {"fabric": "gloo", "nccl_algo": None}
    ctl.localizer.profiles = {0: profile(0, "nccl", "Ring"), 1: profile(1, "nccl", "Tree"), 2: profile(2, "nccl", None)}
    assert ctl.localizer.tree_inputs() == {"fabric": "nccl", "nccl_algo": "Tree"}
    ctl.localizer.profiles = {0: profile(0, "nccl", "Ring"), 1: profile(1, "nccl", "ring")}
    assert ctl.localizer.tree_inputs() == {"fabric": "nccl", "nccl_algo": "Ring"}


def test_a_rank_reports_its_backend_and_nccl_algo(monkeypatch):
    """Runtime.profile adds this process's NCCL_ALGO (None: unset) and the backend its
    collectives run on (the device where torch.distributed has no group)."""
    from falconext.runtime.runtime import FalconRuntime as Runtime

    fake = types.SimpleNamespace(monitor=types.SimpleNamespace(profile_snapshot=lambda w, n: {"roles": {}}),
                                 _fabric=lambda: "nccl")
    monkeypatch.setenv("NCCL_ALGO", "Tree,Ring")
    assert Runtime.profile(fake, 1.0) == {"roles": {}, "fabric": "nccl", "nccl_algo": "Tree,Ring"}
    monkeypatch.delenv("NCCL_ALGO")
    assert Runtime.profile(fake, 1.0)["nccl_algo"] is None
    import torch.distributed as dist

    if not dist.is_initialized():
        assert Runtime._fabric(types.SimpleNamespace(_device="cuda")) == "cuda"


def _controller_session(setting, fabric, nccl_algo=None, slow=(0, 2)):
    """A validation session the controller runs on a DP4 job with one rank per node: the
    profiles carry ``fabric``/``nccl_algo``, every pair of the plan is reported (the
    ``slow`` node pair at 50 ms, the rest at 10 ms). The plan's pairs and the verdict."""
    from falconext.protocol.commands import Share, Suspend, ValidateRequest
    from falconext.protocol.messages import Heartbeat, SessionAck, ValidationResult
    from falconext.validate.plan import join_shares

    dp = "dp:0,1,2,3"
    ctl = Controller(FalconConfig(link_baseline_iteration=0, validation_trees=setting), world=4)
    for r in range(4):
        ctl.handle(Heartbeat(r, r, 50, 0.3, 100.0), 100.0)
    ctl.handle(ValidateRequest(), 101.0)
    outs = []
    for r in range(4):
        rows = [[k, 10.0 + 0.3 * k + 0.001 * r, 10.0 + 0.3 * k + 0.005, 4096] for k in range(20)]
        p = ProfileData(r, ctl.session, {dp: "dp"}, {dp: [0, 1, 2, 3]}, {dp: rows}, fabric=fabric,
                        nccl_algo=nccl_algo)
        outs += ctl.handle(p, 101.2)
    (sus,) = [o.message for o in outs if o.kind == "command" and isinstance(o.message, Suspend)]
    shares = [o.message.share for o in outs if o.kind == "command" and isinstance(o.message, Share)]
    passes = join_shares(sus.validation, shares)["passes"]
    s = sus.session
    for r in range(4):
        ctl.handle(SessionAck(r, s, "held", sus.iteration, 102.0), 102.0)
    outs = []
    for r in range(4):
        got = [[a, b, 0.05 if tuple(sorted((a, b))) == slow else 0.01] for p in passes for a, b in p if b == r]
        outs += ctl.handle(ValidationResult(r, s, 1e10, got), 102.5)
    (loc,) = [o.event for o in outs if o.kind == "event" and o.event["type"] == "localized"]
    return {tuple(x) for p in passes for x in p}, loc


def test_the_controller_validates_trees_as_the_setting_and_the_profiles_say():
    """End to end through the controller: with trees (on; auto on NCCL) the plan measures
    nodes 0 and 2, which only the trees join, and the verdict names their congested link;
    with rings only (off; auto on gloo or with NCCL_ALGO=Ring) it is not measured."""
    ring = {(0, 1), (1, 2), (2, 3), (3, 0)}
    for setting, fabric, algo in (("on", "gloo", None), ("auto", "nccl", None), ("auto", "nccl", "^ring")):
        pairs, loc = _controller_session(setting, fabric, algo)
        assert pairs == ring | {(0, 2), (2, 1), (3, 1), (1, 0)}, (setting, fabric, algo)
        assert loc["links"] == [[0, 2]] and loc["evidence"]["tree_groups"] == 1
    for setting, fabric, algo in (("off", "nccl", None), ("auto", "gloo", None), ("auto", "nccl", "Ring")):
        pairs, loc = _controller_session(setting, fabric, algo)
        assert pairs == ring, (setting, fabric, algo)
        assert loc["links"] == [] and loc["evidence"]["tree_groups"] == 0
