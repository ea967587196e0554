"""Tests of the iteration-time model (falconext.model.itertime).

Besides closed forms for simple cases, the model is checked against a small reference
written independently here: plain loops and a recursive longest path over the 1F1B
dependency graph, instead of the model's event sweep and numpy gathers.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

import pytest

from falconext.model.itertime import (
    IterationModel,
    JobCosts,
    iteration_time,
    one_f_one_b,
)


@dataclass(frozen=True)
class L:
    """A bare layout (the model only needs the four sizes)."""

    tp: int
    dp: int
    pp: int
    ranks_per_node: int


def ident(layout: L) -> list[int]:
    return list(range(layout.tp * layout.dp * layout.pp))


# ---------------------------------------------------------------------------------------
# an independent reference
# ---------------------------------------------------------------------------------------


def reference_time(layout, roles, costs, gpus, links):
    tp, dp, pp, rpn = layout.tp, layout.dp, layout.pp, layout.ranks_per_node
    proc = {r: p for p, r in enumerate(roles)}

    def exc(p, q):
        a, b = p // rpn, q // rpn
        return 0.0 if a == b else links.get((min(a, b), max(a, b)), links.get((max(a, b), min(a, b)), 0.0))

    def role(t, d, s):
        return t + tp * (d + dp * s)

    finish = []
    for d in range(dp):
        m = costs.plan[d]
        fac = [max(gpus.get(proc[role(t, d, s)], 1.0) for t in range(tp)) for s in range(pp)]
        msg = [
            max(costs.p2p_s + costs.act_bytes * exc(proc[role(t, d, s)], proc[role(t, d, s + 1)]) for t in range(tp))
            for s in range(pp - 1)
        ]
        seq = {}
        for s in range(pp):
            w = min(pp - 1 - s, m)
            ops = [("F", i) for i in range(w)]
            for k in range(m - w):
                ops += [("F", w + k), ("B", k)]
            ops += [("B", i) for i in range(m - w, m)]
            seq[s] = ops

        @functools.lru_cache(maxsize=None)
        def end(s, idx):
            kind, i = seq[s][idx]
            prev = end(s, idx - 1) if idx else 0.0
            if kind == "F":
                dep = end(s - 1, seq[s - 1].index(("F", i))) + msg[s - 1] if s else 0.0
                return max(prev, dep) + costs.fwd_s[s] * fac[s]
            dep = end(s + 1, seq[s + 1].index(("B", i))) + msg[s] if s < pp - 1 else 0.0
            return max(prev, dep) + costs.bwd_s[s] * fac[s]

        finish.append([end(s, len(seq[s]) - 1) for s in range(pp)])

    total = 0.0
    for s in range(pp):
        start = max(finish[d][s] for d in range(dp))
        dur = 0.0
        if dp > 1:
            for t in range(tp):
                ring = [proc[role(t, d, s)] for d in range(dp)]
                worst = max(exc(ring[i], ring[(i + 1) % dp]) for i in range(dp))
                dur = max(dur, costs.allreduce_s[s] + 2 * (dp - 1) / dp * costs.grad_bytes[s] * worst)
        total = max(total, start + dur)
    return total + costs.other_s


# ---------------------------------------------------------------------------------------
# closed forms
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 16])
def test_healthy_1f1b_matches_closed_form(pp, m):
    f, b = 0.7, 1.9
    costs = JobCosts.uniform(pp, 1, f, m, bwd_s=b)
    layout = L(1, 1, pp, 1)
    assert iteration_time(layout, ident(layout), costs) == pytest.approx((m + pp - 1) * (f + b))


def test_pp1_is_m_forward_backward_and_default_bwd_is_twice_fwd():
    costs = JobCosts.uniform(1, 1, 0.25, 6)
    assert costs.bwd_s == (0.5,)
    layout = L(1, 1, 1, 1)
    assert iteration_time(layout, [0], costs) == pytest.approx(6 * 0.75)


def test_one_message_delay_costs_two_hops_per_boundary_for_one_microbatch():
    # F goes down pp-1 boundaries, B comes back up: 2 (pp - 1) messages on the path.
    for pp in (2, 3, 5):
        out = one_f_one_b([1.0] * pp, [2.0] * pp, [0.5] * (pp - 1), 1)
        assert out[0] == pytest.approx(pp * 3.0 + 2 * (pp - 1) * 0.5)
        assert out[0] == max(out)  # the first stage finishes last in 1F1B


def test_slow_stage_bounds_throughput():
    f, b, m, pp, k = 1.0, 2.0, 16, 4, 3.0
    layout = L(1, 1, pp, 1)
    costs = JobCosts.uniform(pp, 1, f, m, bwd_s=b)
    for slow_process in range(pp):
        t = iteration_time(layout, ident(layout), costs, {slow_process: k})
        assert m * k * (f + b) <= t <= (m + pp - 1) * k * (f + b) + 1e-9


def test_tp_group_runs_at_its_slowest_member():
    layout = L(2, 1, 2, 4)
    costs = JobCosts.uniform(2, 1, 1.0, 4)
    one = iteration_time(layout, ident(layout), costs, {1: 2.0})
    both = iteration_time(layout, ident(layout), costs, {0: 2.0, 1: 2.0})
    assert one == pytest.approx(both)
    # the same slow GPU in the other stage is a different layout but the same pipeline cost
    assert one > iteration_time(layout, ident(layout), costs)


def test_slow_link_in_dp_ring_adds_ring_bytes_times_excess():
    layout = L(1, 4, 1, 1)  # 4 nodes, one DP group: ring 0 -> 1 -> 2 -> 3 -> 0
    gb, e = 4e8, 2e-9
    costs = JobCosts.uniform(1, 4, 0.1, 2, grad_bytes=gb, allreduce_s=0.05, other_s=0.01)
    healthy = iteration_time(layout, ident(layout), costs)
    assert healthy == pytest.approx(2 * 0.3 + 0.05 + 0.01)
    on_ring = iteration_time(layout, ident(layout), costs, slow_links={(2, 1): e})
    assert on_ring - healthy == pytest.approx(2 * 3 / 4 * gb * e)
    # (0, 2) is no ring link in role order: no penalty ...
    assert iteration_time(layout, ident(layout), costs, slow_links={(0, 2): e}) == pytest.approx(healthy)
    # ... until the roles put 0 and 2 next to each other in the ring
    roles = [0, 2, 1, 3]  # process 2 plays role 1
    assert iteration_time(layout, roles, costs, slow_links={(0, 2): e}) == pytest.approx(on_ring)


def test_ring_is_as_slow_as_its_slowest_link():
    layout = L(1, 4, 1, 1)
    costs = JobCosts.uniform(1, 4, 0.1, 2, grad_bytes=1e8, allreduce_s=0.05)
    healthy = iteration_time(layout, ident(layout), costs)
    t = iteration_time(layout, ident(layout), costs, slow_links={(0, 1): 1e-9, (2, 3): 3e-9})
    assert t - healthy == pytest.approx(1.5 * 1e8 * 3e-9)


def test_dp1_has_no_allreduce():
    layout = L(1, 1, 2, 1)
    costs = JobCosts.uniform(2, 1, 1.0, 3, grad_bytes=1e9, allreduce_s=5.0)
    bd = IterationModel(layout, costs).breakdown(ident(layout))
    assert bd.allreduce_s == (0.0, 0.0)
    assert bd.total_s == pytest.approx(4 * 3.0)


def test_slow_pp_boundary_adds_at_most_two_messages_per_microbatch():
    f, m, act, e = 1.0, 8, 1e6, 1e-7  # 0.1 s extra per message
    delta = act * e
    layout = L(1, 1, 4, 1)
    costs = JobCosts.uniform(4, 1, f, m, act_bytes=act, p2p_s=0.001)
    healthy = iteration_time(layout, ident(layout), costs)
    for a in range(3):
        t = iteration_time(layout, ident(layout), costs, slow_links={(a, a + 1): e})
        assert 0 < t - healthy <= 2 * m * delta + 1e-9
    # a link between non-adjacent stages carries nothing
    assert iteration_time(layout, ident(layout), costs, slow_links={(0, 2): e}) == pytest.approx(healthy)


def test_tp_messages_wait_for_the_slowest_tp_rank():
    # tp=2, pp=2, one TP group per node: both tp messages cross the same slow link
    layout = L(2, 1, 2, 2)
    costs = JobCosts.uniform(2, 1, 1.0, 1, act_bytes=1e6, p2p_s=0.0)
    t = iteration_time(layout, ident(layout), costs, slow_links={(0, 1): 1e-7})
    assert t == pytest.approx(6.0 + 2 * 0.1)


def test_uneven_plan_slowest_replica_sets_the_pace():
    layout = L(1, 2, 2, 2)
    costs = JobCosts(fwd_s=[1.0, 1.0], plan=[3, 6])
    bd = IterationModel(layout, costs).breakdown(ident(layout))
    assert bd.pipeline_s == pytest.approx((4 * 3.0, 7 * 3.0))
    assert bd.total_s == pytest.approx(21.0)


def test_transfers_between_nodes_cost_the_networks_time_per_byte():
    """net_s_per_byte prices every message and ring step between two nodes, and nothing
    within a node: DP2 x PP2, stage per node, moves its pipeline messages over the
    network; the DP rings stay inside the nodes."""
    layout = L(1, 2, 2, 2)
    costs = JobCosts.uniform(2, 2, 0.1, 1, act_bytes=1e6, grad_bytes=1e6)
    plain = iteration_time(layout, ident(layout), costs)
    net = JobCosts(fwd_s=costs.fwd_s, plan=costs.plan, act_bytes=1e6, grad_bytes=costs.grad_bytes, net_s_per_byte=1e-8)
    assert iteration_time(layout, ident(layout), net) - plain == pytest.approx(2 * 1e6 * 1e-8)  # there and back
    # pipelines inside the nodes (roles 0, 2 on node 0): the rings cross instead, 2 (n-1)/n B
    inside = [0, 2, 1, 3]
    assert iteration_time(layout, inside, net) - iteration_time(layout, inside, costs) == pytest.approx(1e6 * 1e-8)


def test_a_congested_link_carries_its_flows_one_after_another():
    """Two replicas' pipelines cross one congested link: priced one message at a time,
    each pipeline alone would wait for its own messages only; the link carries both
    replicas' messages, so the iteration lasts at least their bytes' time on it (plus
    other_s). Without the network's rate there is no such bound (an excess alone is not
    the link's time per byte)."""
    layout = L(1, 2, 2, 2)  # stage 0 on node 0, stage 1 on node 1
    kw = dict(fwd_s=[0.001, 0.001], plan=[8, 8], act_bytes=1e5, other_s=0.05)
    net, e = 1e-7, 9e-7
    model = IterationModel(layout, JobCosts(**kw, net_s_per_byte=net), None, {(0, 1): e})
    bd = model.breakdown(ident(layout))
    carried = 2 * 8 * 1e5 * (net + e)  # both replicas' forward messages, one way
    assert bd.link_busy_s == pytest.approx(carried)
    assert bd.total_s == pytest.approx(max(max(bd.pipeline_s), carried) + 0.05)
    assert bd.total_s > max(bd.pipeline_s) + 0.05  # the bound is what sets the time here
    blind = IterationModel(layout, JobCosts(**kw), None, {(0, 1): e}).breakdown(ident(layout))
    assert blind.link_busy_s == 0.0 and blind.total_s == pytest.approx(max(blind.pipeline_s) + 0.05)


def test_rings_that_cross_one_congested_link_share_it_as_the_pipeline_drains():
    """Pipelines inside the nodes, both stages' DP rings over the congested link: stage
    1's ring starts first, and stage 0's cannot end before all of both rings' bytes have
    crossed after that start."""
    layout = L(1, 2, 2, 2)
    grad = [4e5, 3e5]
    costs = JobCosts(fwd_s=[0.01, 0.01], plan=[4, 4], grad_bytes=grad, net_s_per_byte=1e-7)
    roles = [0, 2, 1, 3]  # node 0 plays replica 0 of both stages
    model = IterationModel(layout, costs, None, {(0, 1): 9e-7})
    bd = model.breakdown(roles)
    first = min(bd.allreduce_start_s)
    shared = first + sum(grad) * 1e-6  # 2 (n-1)/n B = B each way, at net + excess
    assert bd.total_s == pytest.approx(max(shared, max(a + d for a, d in zip(bd.allreduce_start_s, bd.allreduce_s))))
    assert bd.total_s == pytest.approx(shared)  # later than either ring alone


def test_breakdown_is_consistent():
    layout = L(2, 2, 3, 4)
    costs = JobCosts(
        fwd_s=[1.0, 0.8, 1.2], plan=[4, 5], act_bytes=1e6, p2p_s=0.01,
        grad_bytes=[1e8] * 3, allreduce_s=[0.2, 0.3, 0.1], other_s=0.5,
    )
    model = IterationModel(layout, costs, {5: 1.5}, {(0, 2): 1e-9})
    roles = [4, 5, 0, 1, 2, 3, 6, 7, 8, 9, 10, 11]
    bd = model.breakdown(roles)
    assert len(bd.stage_finish_s) == 2 and all(len(r) == 3 for r in bd.stage_finish_s)
    for s in range(3):
        assert bd.allreduce_start_s[s] == max(r[s] for r in bd.stage_finish_s)
    total = max(a + b for a, b in zip(bd.allreduce_start_s, bd.allreduce_s)) + 0.5
    assert bd.total_s == pytest.approx(total)
    assert model.time(roles) == bd.total_s


# ---------------------------------------------------------------------------------------
# against the reference, on random layouts, permutations and faults
# ---------------------------------------------------------------------------------------


def test_matches_reference_on_random_cases():
    rng = random.Random(20261105)
    for _ in range(150):
        tp, dp, pp = rng.choice([1, 2, 3]), rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 3, 4])
        rpn = tp * rng.choice([1, 2, 3])
        layout = L(tp, dp, pp, rpn)
        world = tp * dp * pp
        n_nodes = -(-world // rpn)
        roles = list(range(world))
        rng.shuffle(roles)  # any permutation, even with TP groups across nodes
        costs = JobCosts(
            fwd_s=[rng.uniform(0.1, 1.0) for _ in range(pp)],
            bwd_s=[rng.uniform(0.1, 2.0) for _ in range(pp)],
            plan=[rng.randint(1, 6) for _ in range(dp)],
            act_bytes=rng.choice([0.0, 1e6]),
            p2p_s=rng.uniform(0, 0.05),
            grad_bytes=[rng.choice([0.0, 1e8]) for _ in range(pp)],
            allreduce_s=[rng.uniform(0, 0.5) for _ in range(pp)],
            other_s=rng.uniform(0, 0.3),
        )
        gpus = {p: rng.uniform(0.5, 4.0) for p in rng.sample(range(world), rng.randint(0, min(3, world)))}
        links = {}
        for _ in range(rng.randint(0, 3) if n_nodes > 1 else 0):
            a, b = rng.sample(range(n_nodes), 2)
            if (a, b) not in links and (b, a) not in links:
                links[(a, b)] = rng.uniform(0, 1e-8)
        got = iteration_time(layout, roles, costs, gpus, links)
        assert got == pytest.approx(reference_time(layout, roles, costs, gpus, links), rel=1e-12)


def test_model_is_deterministic_and_cache_transparent():
    layout = L(1, 2, 4, 2)
    costs = JobCosts.uniform(4, 2, 1.0, 4, act_bytes=1e6, grad_bytes=1e8, allreduce_s=0.1)
    model = IterationModel(layout, costs, {3: 2.0}, {(0, 1): 1e-8})
    rng = random.Random(3)
    perms = []
    for _ in range(20):
        r = list(range(8))
        rng.shuffle(r)
        perms.append(r)
    first = [model.time(r) for r in perms]
    again = [model.time(r) for r in reversed(perms)][::-1]
    fresh = [iteration_time(layout, r, costs, {3: 2.0}, {(0, 1): 1e-8}) for r in perms]
    assert first == again == fresh


# ---------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(fwd_s=[1.0, math.nan], plan=[1]), r"fwd_s\[1\]"),
        (dict(fwd_s=[1.0, -1.0], plan=[1]), r"fwd_s\[1\]"),
        (dict(fwd_s=[], plan=[1]), "fwd_s is empty"),
        (dict(fwd_s=[1.0], bwd_s=[1.0, 2.0], plan=[1]), "bwd_s has 2 entries"),
        (dict(fwd_s=[1.0], plan=[0]), r"plan\[0\]"),
        (dict(fwd_s=[1.0], plan=[1.5]), r"plan\[0\]"),
        (dict(fwd_s=[1.0], plan=[]), "plan is empty"),
        (dict(fwd_s=[1.0], plan=[1], act_bytes=-1), "act_bytes"),
        (dict(fwd_s=[1.0], plan=[1], p2p_s=math.inf), "p2p_s"),
        (dict(fwd_s=[1.0], plan=[1], other_s=math.nan), "other_s"),
        (dict(fwd_s=[1.0], plan=[1], grad_bytes=[1.0, 2.0]), "grad_bytes has 2"),
        (dict(fwd_s=[1.0], plan=[1], allreduce_s=[-0.1]), r"allreduce_s\[0\]"),
    ],
)
def test_bad_costs_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        JobCosts(**kwargs)


def test_bad_model_inputs_raise():
    layout = L(1, 2, 2, 1)
    costs = JobCosts.uniform(2, 2, 1.0, 2)
    roles = ident(layout)
    with pytest.raises(ValueError, match="costs.fwd_s has 2 stages, layout.pp = 3"):
        iteration_time(L(1, 2, 3, 1), list(range(6)), costs)
    with pytest.raises(ValueError, match="costs.plan has 2 replicas, layout.dp = 1"):
        iteration_time(L(1, 1, 2, 1), [0, 1], costs)
    with pytest.raises(ValueError, match="layout.tp"):
        iteration_time(L(0, 2, 2, 1), roles, costs)
    with pytest.raises(ValueError, match="role 1 is played twice"):
        iteration_time(layout, [0, 1, 1, 3], costs)
    with pytest.raises(ValueError, match="expected world = 4"):
        iteration_time(layout, [0, 1, 2], costs)
    with pytest.raises(ValueError, match=r"roles\[3\] = 4"):
        iteration_time(layout, [0, 1, 2, 4], costs)
    with pytest.raises(ValueError, match="slow_gpus names process 4"):
        iteration_time(layout, roles, costs, {4: 2.0})
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match=r"slow_gpus\[1\]"):
            iteration_time(layout, roles, costs, {1: bad})
    with pytest.raises(ValueError, match="node 4 is outside range"):
        iteration_time(layout, roles, costs, slow_links={(0, 4): 1e-9})
    with pytest.raises(ValueError, match="links node 2 to itself"):
        iteration_time(layout, roles, costs, slow_links={(2, 2): 1e-9})
    for bad in (-1e-9, math.nan):
        with pytest.raises(ValueError, match="slow_links"):
            iteration_time(layout, roles, costs, slow_links={(0, 1): bad})
    with pytest.raises(ValueError, match="twice"):
        iteration_time(layout, roles, costs, slow_links={(0, 1): 1e-9, (1, 0): 2e-9})
    with pytest.raises(ValueError, match="pair of node ints"):
        iteration_time(layout, roles, costs, slow_links={(0, 1, 2): 1e-9})
    with pytest.raises(ValueError, match="JobCosts"):
        iteration_time(layout, roles, {"fwd_s": [1.0]})
