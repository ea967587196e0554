"""Tests of the S3 topology planner (falconext.mitigate.topology).

The planner's job is to find the rank permutation with the fastest predicted iteration.
These tests never take its word for what that is:

* For every job small enough, the answer is computed here by exhaustive search over every
  distinguishable layout, scored with the same iteration-time model
  (:mod:`falconext.model.itertime`, tested on its own in ``test_model_itertime.py``). The
  plan must reach that optimum (within the planner's documented ``REL_EPS``); where the
  optimum is no better than the current layout, the test says that staying put *is* the
  right answer and asserts the plan moves nothing.
* For jobs too large to enumerate, the plan must be a local optimum: no exchange of two
  processes' roles, and no exchange of two whole TP groups, predicts a gain beyond that
  threshold.
* Targeted cases check the two ideas by what they must do to the job, computed from the
  problem: a congested link that carried a DP ring carries only pipeline messages after,
  and costs at most those messages; stragglers end up in the fewest stages, interior
  ones when the edge stages are heavier.

Every plan must also be a permutation that keeps each TP group inside one node, report
the model's times honestly, and be deterministic and stable (planning again from the
plan moves nothing).

Where the planner is known to fall short of the optimum, the case is marked
``xfail(strict=True)`` with the shortfall: the test states the requirement, the mark
records that the planner does not meet it yet.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import pytest

from falconext.mitigate.topology import REL_EPS, Layout, TopologyPlan, plan_topology
from falconext.model.itertime import IterationModel, JobCosts, iteration_time

# ---------------------------------------------------------------------------------------
# references, computed without the planner
# ---------------------------------------------------------------------------------------


def ident(layout: Layout) -> list[int]:
    return list(range(layout.world))


def process_of(roles: Sequence[int]) -> dict[int, int]:
    return {r: p for p, r in enumerate(roles)}


def tp_groups_inside_nodes(layout: Layout, roles: Sequence[int]) -> bool:
    """Whether every TP group (roles tp*k .. tp*k + tp - 1) is played on one node."""
    proc = process_of(roles)
    return all(len({layout.node_of(proc[r]) for r in g}) == 1 for g in layout.tp_groups())


def link_traffic(layout: Layout, roles: Sequence[int], a: int, b: int) -> set[str]:
    """What the link between nodes ``a`` and ``b`` carries: "DP" when two neighbours of
    a DP ring (role order, wrapping round) sit on its two ends, "PP" when two adjacent
    stages of a pipeline do."""
    proc = process_of(roles)
    ends = {a, b}
    out = set()
    for g in layout.dp_groups():
        ring = zip(g, g[1:] + g[:1])
        if len(g) > 1 and any({layout.node_of(proc[x]), layout.node_of(proc[y])} == ends for x, y in ring):
            out.add("DP")
    for g in layout.pp_groups():
        if any({layout.node_of(proc[x]), layout.node_of(proc[y])} == ends for x, y in zip(g, g[1:])):
            out.add("PP")
    return out


def stages_of(layout: Layout, roles: Sequence[int], processes) -> set[int]:
    return {layout.role_coords(roles[p])[2] for p in processes}


def moved(current: Sequence[int], roles: Sequence[int]) -> int:
    return sum(1 for c, r in zip(current, roles) if c != r)


def _multiset_permutations(items: Sequence) -> Iterator[tuple]:
    counts = Counter(items)
    keys = sorted(counts)
    out: list = [None] * len(items)

    def rec(i: int) -> Iterator[tuple]:
        if i == len(items):
            yield tuple(out)
            return
        for k in keys:
            if counts[k]:
                counts[k] -= 1
                out[i] = k
                yield from rec(i + 1)
                counts[k] += 1

    return rec(0)


def distinguishable_layouts(
    layout: Layout, gpus: Mapping[int, float], links: Mapping[tuple[int, int], float], limit: int = 12_000
) -> Iterator[list[int]] | None:
    """Every valid layout the problem can tell apart (None if there are more than ``limit``).

    A process enters the problem only through its GPU's factor and its node (which slow
    links it touches, and which TP groups it may join). Processes with the same factor and
    the same node are interchangeable, and so, when ``tp == 1``, are all processes on
    nodes that touch no slow link (their transfers all cost the healthy time and no TP
    group has to fit in their node). Handing these classes to the roles in every distinct
    order, keeping only orders where each TP group's class names one node, covers every
    layout the problem can tell apart; each is yielded as ``roles[process] = role``, the
    processes of a class taken in increasing order.
    """
    world, tp = layout.world, layout.tp
    classes = process_classes(layout, gpus, links)
    n = math.factorial(world)
    for c in Counter(classes).values():
        n //= math.factorial(c)
    if n > limit:
        return None
    pool: dict[tuple[float, int], list[int]] = {}
    for p, c in enumerate(classes):
        pool.setdefault(c, []).append(p)

    def gen() -> Iterator[list[int]]:
        for assign in _multiset_permutations(classes):  # assign[role] = class of its player
            if tp > 1 and any(len({assign[r][1] for r in g}) > 1 for g in layout.tp_groups()):
                continue
            free = {c: iter(ps) for c, ps in pool.items()}
            roles = [0] * world
            for r, c in enumerate(assign):
                roles[next(free[c])] = r
            yield roles

    return gen()


def process_classes(
    layout: Layout, gpus: Mapping[int, float], links: Mapping[tuple[int, int], float]
) -> list[tuple[float, int]]:
    """(factor, node) of every process, the node -1 where it cannot matter (see above)."""
    link_nodes = {n for k, e in links.items() if e > 0 for n in k}

    def cls(p: int) -> tuple[float, int]:
        node = layout.node_of(p)
        return (float(gpus.get(p, 1.0)), node if layout.tp > 1 or node in link_nodes else -1)

    return [cls(p) for p in range(layout.world)]


@dataclass(frozen=True)
class Optimum:
    """The exhaustive answer: the fastest predicted time of any valid layout, and the
    fewest processes that must change role to reach a layout within REL_EPS of it."""

    best_s: float
    fewest_moves: int
    layouts: int
    best_roles: tuple[int, ...]


def exhaustive_optimum(
    layout: Layout,
    costs: JobCosts,
    gpus: Mapping[int, float],
    links: Mapping[tuple[int, int], float],
    current: Sequence[int],
    limit: int = 12_000,
) -> Optimum | None:
    """The best of :func:`distinguishable_layouts` under the model (None if too many).

    The fewest moves to reach a layout keep every role whose current player is of the
    class the layout gives that role (the other processes of each class fill the rest).
    """
    every = distinguishable_layouts(layout, gpus, links, limit)
    if every is None:
        return None
    model = IterationModel(layout, costs, gpus, links)
    classes = process_classes(layout, gpus, links)
    current_class = {r: classes[p] for p, r in enumerate(current)}
    scored = []
    for roles in every:
        keep = sum(1 for p, r in enumerate(roles) if classes[p] == current_class[r])
        scored.append((model.time(roles), layout.world - keep, tuple(roles)))
    best, _, best_roles = min(scored)
    fewest = min(m for t, m, _ in scored if t <= best * (1 + REL_EPS))
    return Optimum(best, fewest, len(scored), best_roles)


def single_exchanges(layout: Layout, roles: Sequence[int]) -> Iterator[list[int]]:
    """Every valid layout one exchange away: two processes swap roles, or two TP groups
    swap their players (tp_r for tp_r)."""
    world, tp = layout.world, layout.tp
    for a in range(world):
        for b in range(a + 1, world):
            rs = list(roles)
            rs[a], rs[b] = rs[b], rs[a]
            if tp == 1 or tp_groups_inside_nodes(layout, rs):
                yield rs
    if tp > 1:
        proc = process_of(roles)
        for g, h in itertools.combinations(layout.tp_groups(), 2):
            rs = list(roles)
            for x, y in zip(g, h):
                rs[proc[x]], rs[proc[y]] = y, x
            yield rs


def check_plan(layout: Layout, current, costs, gpus, links, plan: TopologyPlan) -> None:
    """What every plan must satisfy, whatever the faults: a permutation keeping TP groups
    inside nodes, the model's own times before and after, ``moved_processes`` exactly
    the processes whose role changes, and a change only for a gain above REL_EPS."""
    world = layout.world
    roles = list(plan.roles)
    assert sorted(roles) == list(range(world))
    assert tp_groups_inside_nodes(layout, roles), f"a TP group spans nodes in {roles}"
    assert plan.predicted_before_s == pytest.approx(iteration_time(layout, current, costs, gpus, links))
    assert plan.predicted_after_s == pytest.approx(iteration_time(layout, roles, costs, gpus, links))
    assert list(plan.moved_processes) == [p for p in range(world) if roles[p] != current[p]]
    if plan.moved_processes:
        assert plan.predicted_after_s < plan.predicted_before_s * (1 - REL_EPS)
        assert plan.changed
    else:
        assert roles == list(current)
        assert plan.predicted_after_s == plan.predicted_before_s
        assert not plan.changed
    assert plan.reason


def check_optimal(layout: Layout, current, costs, gpus, links, plan: TopologyPlan) -> str:
    """The plan against the exhaustive optimum when the job is small enough, else against
    every single exchange. Returns which reference was used."""
    opt = exhaustive_optimum(layout, costs, gpus, links, current)
    before = plan.predicted_before_s
    if opt is not None:
        if opt.best_s >= before * (1 - REL_EPS):
            # nothing any layout gains (beyond REL_EPS): staying put IS the right answer
            assert not plan.changed, f"moved for nothing: optimum {opt.best_s} vs current {before}"
        else:
            # the optimum gains: a plan that stays put, or stops short of it, fails here
            assert plan.predicted_after_s <= opt.best_s * (1 + 2 * REL_EPS), (
                f"plan {plan.predicted_after_s} s, optimum {opt.best_s} s, current {before} s"
            )
        return "exhaustive"
    t = plan.predicted_after_s
    model = IterationModel(layout, costs, gpus, links)
    for rs in single_exchanges(layout, plan.roles):
        assert model.time(rs) >= t * (1 - 2 * REL_EPS), f"one exchange away, {rs} predicts {model.time(rs)} < {t}"
    return "local"


# ---------------------------------------------------------------------------------------
# random jobs: valid, honest, optimal, stable
# ---------------------------------------------------------------------------------------


def random_current(layout: Layout, rng: random.Random) -> list[int]:
    """A random valid layout: processes regrouped within nodes, blocks placed anywhere."""
    tp, rpn, world = layout.tp, layout.ranks_per_node, layout.world
    groups = []
    for lo in range(0, world, rpn):
        procs = list(range(lo, min(lo + rpn, world)))
        rng.shuffle(procs)
        groups += [procs[i : i + tp] for i in range(0, len(procs), tp)]
    rng.shuffle(groups)
    roles = [0] * world
    for b, procs in enumerate(groups):
        for t, p in enumerate(procs):
            roles[p] = tp * b + t
    return roles


def random_faults(layout: Layout, rng: random.Random):
    """One to three slow GPUs (so that most jobs have something to gain) and, with
    several nodes, up to two slow links."""
    world, n_nodes = layout.world, layout.n_nodes
    gpus = {p: rng.choice([1.3, 2.0, 3.0]) for p in rng.sample(range(world), rng.randint(1, min(3, world)))}
    links = {}
    if n_nodes > 1:
        for _ in range(rng.randint(0, 2)):
            a, b = sorted(rng.sample(range(n_nodes), 2))
            links[(a, b)] = rng.choice([1e-10, 1e-9, 5e-9])
    return gpus, links


def random_job(layout: Layout, trial: int):
    """Trial 0: a fresh job (identity roles) with random faults; 1, 2: a random current
    layout with random faults; 3: a 3x straggler where it hurts most (see below)."""
    rng = random.Random(1000 * layout.tp + 100 * layout.dp + 10 * layout.pp + layout.ranks_per_node + 10_000 * trial)
    current = ident(layout) if trial == 0 else random_current(layout, rng)
    if trial < 3:
        costs = JobCosts(
            fwd_s=[rng.uniform(0.01, 0.03) for _ in range(layout.pp)],
            plan=[rng.randint(1, 8) for _ in range(layout.dp)],
            act_bytes=rng.choice([1e5, 1e6]),
            p2p_s=0.001,
            grad_bytes=[rng.choice([1e7, 1e8])] * layout.pp,
            allreduce_s=[0.02] * layout.pp,
            other_s=0.01,
        )
        gpus, links = random_faults(layout, rng)
        return current, costs, gpus, links
    # distinct stage costs and distinct micro-batch counts; the straggler plays tp_r 0 of
    # the heaviest stage of the busiest replica
    fwd = sorted(rng.uniform(0.01, 0.03) for _ in range(layout.pp))
    rng.shuffle(fwd)
    plan = rng.sample(range(1, 9), layout.dp)
    costs = JobCosts(fwd_s=fwd, plan=plan, p2p_s=0.001, allreduce_s=[0.02] * layout.pp, other_s=0.01)
    role = layout.role_of(0, plan.index(max(plan)), fwd.index(max(fwd)))
    return current, costs, {process_of(current)[role]: 3.0}, {}


LAYOUTS = [
    Layout(tp, dp, pp, rpn)
    for tp, dp, pp, rpn in itertools.product([1, 2], [1, 2, 4], [1, 2, 4], [1, 2, 4, 8])
    if rpn % tp == 0
]


def _lid(layout: Layout) -> str:
    return f"tp{layout.tp}dp{layout.dp}pp{layout.pp}n{layout.ranks_per_node}"


#: Jobs on which the planner is known to miss the optimum (found by this test; the
#: planner, not the test, is at fault). Strict: fixing the planner turns them into failures
#: that ask for the mark to go.
KNOWN_MISSES = {
    "tp1dp2pp4n2-1": "planner misses the optimum by 1.6%: with an uneven micro-batch plan "
    "(3, 2) the best layout puts both 3x stragglers in the light replica, which no candidate "
    "builds and no single exchange reaches",
}


@pytest.mark.parametrize(
    "layout, trial",
    [
        pytest.param(
            layout, trial, id=f"{_lid(layout)}-{trial}",
            marks=[pytest.mark.xfail(strict=True, reason=KNOWN_MISSES[f"{_lid(layout)}-{trial}"])]
            if f"{_lid(layout)}-{trial}" in KNOWN_MISSES else [],
        )
        for layout in LAYOUTS
        for trial in range(4)
    ],
)
def test_random_jobs_get_the_optimal_valid_plan(layout, trial):
    """Valid, honest, deterministic, stable, and as fast as the exhaustive optimum (or, too
    large to enumerate, not beaten by any single exchange); staying put only where no
    layout gains."""
    current, costs, gpus, links = random_job(layout, trial)
    plan = plan_topology(layout, current, costs, gpus, links)
    check_plan(layout, current, costs, gpus, links, plan)
    assert plan == plan_topology(layout, current, costs, gpus, links)  # deterministic
    check_optimal(layout, current, costs, gpus, links, plan)
    # stable: from its own answer the planner finds nothing more to gain
    assert not plan_topology(layout, plan.roles, costs, gpus, links).changed
    if trial == 3:
        if layout.dp * layout.pp == 1:
            # one TP group plays everything: no permutation changes what any GPU does,
            # so staying put is the right answer
            assert not plan.changed
        else:
            # a 3x straggler in the heaviest stage of the busiest replica can always go
            # to a lighter stage or a lighter replica (both are distinct): the plan must move it
            assert plan.changed and plan.predicted_after_s < plan.predicted_before_s * (1 - REL_EPS)


def test_the_exhaustive_reference_is_exhaustive():
    """The class-based enumeration covers exactly the valid permutations up to
    interchangeable processes: on a small job, its optimum equals the best of all
    ``world!`` permutations filtered only by the TP rule."""
    layout = Layout(tp=2, dp=2, pp=1, ranks_per_node=2)
    costs = JobCosts(fwd_s=[0.01], plan=[3, 5], grad_bytes=[1e8], allreduce_s=[0.02])
    gpus, links = {1: 2.0}, {(0, 1): 1e-9}
    model = IterationModel(layout, costs, gpus, links)
    every = [model.time(p) for p in itertools.permutations(range(layout.world)) if tp_groups_inside_nodes(layout, p)]
    opt = exhaustive_optimum(layout, costs, gpus, links, ident(layout))
    assert opt is not None and opt.best_s == pytest.approx(min(every))
    layout = Layout(tp=1, dp=2, pp=3, ranks_per_node=2)
    costs = JobCosts(fwd_s=[0.02, 0.01, 0.015], plan=[4, 2], act_bytes=1e6, p2p_s=0.001,
                     grad_bytes=[1e8] * 3, allreduce_s=[0.02] * 3)
    gpus, links = {0: 3.0, 4: 1.3}, {(1, 2): 5e-9}
    model = IterationModel(layout, costs, gpus, links)
    opt = exhaustive_optimum(layout, costs, gpus, links, ident(layout))
    assert opt is not None and opt.best_s == pytest.approx(min(model.time(p) for p in itertools.permutations(range(6))))


# ---------------------------------------------------------------------------------------
# nothing to gain: staying put is the answer
# ---------------------------------------------------------------------------------------


def test_healthy_job_stays_put():
    """No slow GPU, and a link named with zero excess: nothing can gain, so the plan is
    the current layout, both for the identity and for a random current layout (a planner
    answering the identity permutation would move the latter)."""
    layout = Layout(2, 2, 2, 4)
    costs = JobCosts.uniform(2, 2, 0.01, 4, grad_bytes=1e8, allreduce_s=0.02)
    for current in (ident(layout), random_current(layout, random.Random(7))):
        plan = plan_topology(layout, current, costs, {}, {(0, 1): 0.0})
        check_plan(layout, current, costs, {}, {(0, 1): 0.0}, plan)
        assert plan.roles == tuple(current) and plan.moved_processes == ()
        assert "nothing" in plan.reason


@pytest.mark.parametrize("tp, rpn", [(1, 1), (2, 2), (2, 4)])
def test_one_tp_group_has_nothing_to_gain(tp, rpn):
    """With dp = pp = 1 the job is one TP group, which runs at its slowest member wherever
    the straggler sits: staying put is the right answer."""
    layout = Layout(tp=tp, dp=1, pp=1, ranks_per_node=rpn)
    costs = JobCosts.uniform(1, 1, 0.01, 4)
    current = ident(layout)[::-1]  # reversed tp_r order, still inside one node
    gpus = {0: 3.0}
    plan = plan_topology(layout, current, costs, gpus, {})
    check_plan(layout, current, costs, gpus, {}, plan)
    assert plan.roles == tuple(current) and not plan.changed


@pytest.mark.parametrize("links", [{}, {(1, 2): 1e-9}])
def test_a_job_already_at_the_optimum_stays(links):
    """DP2 x PP3, one process per node, a 2x straggler and maybe a slow link. The job's
    current layout is the exhaustive optimum (found here), so nothing can gain and the
    plan must move nothing."""
    layout = Layout(tp=1, dp=2, pp=3, ranks_per_node=1)
    costs = JobCosts(fwd_s=[0.012, 0.01, 0.011], plan=[6, 4], act_bytes=1e5, p2p_s=0.0005,
                     grad_bytes=[1e8] * 3, allreduce_s=[0.01] * 3)
    gpus = {2: 2.0}
    opt = exhaustive_optimum(layout, costs, gpus, links, ident(layout))
    assert opt is not None
    current = list(opt.best_roles)
    plan = plan_topology(layout, current, costs, gpus, links)
    check_plan(layout, current, costs, gpus, links, plan)
    assert plan.predicted_before_s == pytest.approx(opt.best_s)
    assert not plan.changed


# ---------------------------------------------------------------------------------------
# link reassignment: a congested DP link ends up carrying only pipeline messages
# ---------------------------------------------------------------------------------------


def test_link_reassignment_moves_congested_dp_link_onto_the_pipeline():
    """4 nodes of one process, DP2 x PP2. Identity puts link (0, 1) in stage 0's DP ring,
    which moves 2 (n-1)/n * grad = grad bytes over it. Afterwards the link must carry
    only pipeline messages (or nothing), cost at most the 2 m messages that cross it, be
    the exhaustive optimum, and move no more processes than that optimum needs."""
    layout = Layout(tp=1, dp=2, pp=2, ranks_per_node=1)
    m, act, gb, e = 4, 1e4, 2e8, 1e-9
    costs = JobCosts.uniform(2, 2, 0.01, m, act_bytes=act, p2p_s=0.0005, grad_bytes=gb, allreduce_s=0.02)
    slow = {(0, 1): e}
    current = ident(layout)
    assert link_traffic(layout, current, 0, 1) == {"DP"}  # the setting
    healthy = iteration_time(layout, current, costs)
    plan = plan_topology(layout, current, costs, {}, slow)
    check_plan(layout, current, costs, {}, slow, plan)
    assert plan.predicted_before_s == pytest.approx(healthy + gb * e)
    assert link_traffic(layout, plan.roles, 0, 1) <= {"PP"}
    assert plan.predicted_after_s <= healthy + 2 * m * act * e + 1e-12
    opt = exhaustive_optimum(layout, costs, {}, slow, current)
    assert opt is not None
    assert plan.predicted_after_s <= opt.best_s * (1 + REL_EPS)
    assert len(plan.moved_processes) == opt.fewest_moves
    assert "link (0, 1)" in plan.reason


@pytest.mark.parametrize("tp, dp, rpn, link", [(1, 2, 1, (2, 3)), (2, 2, 2, (2, 3)), (1, 4, 2, (0, 1))])
def test_figure10_shape_pp4(tp, dp, rpn, link):
    """Falcon's Figure 10: DP rings cross nodes (tp * dp > ranks_per_node) and one
    congested link is in a ring. The ring's bytes make the iteration more than 1.5x
    slower; after the plan no ring crosses the link (it may carry pipeline messages), it
    costs at most those messages, and the plan is the optimum where that can be
    enumerated, else no single exchange beats it."""
    layout = Layout(tp=tp, dp=dp, pp=4, ranks_per_node=rpn)
    m, act, gb, e = 8, 1e5, 4e8, 2e-9
    costs = JobCosts.uniform(4, dp, 0.01, m, act_bytes=act, p2p_s=0.0005, grad_bytes=gb, allreduce_s=0.02)
    a, b = link
    current = ident(layout)
    assert "DP" in link_traffic(layout, current, a, b)  # the setting
    healthy = iteration_time(layout, current, costs)
    plan = plan_topology(layout, current, costs, {}, {link: e})
    check_plan(layout, current, costs, {}, {link: e}, plan)
    assert plan.predicted_before_s > healthy * 1.5
    assert link_traffic(layout, plan.roles, a, b) <= {"PP"}
    assert plan.predicted_after_s <= healthy + 2 * m * act * e + 1e-12
    check_optimal(layout, current, costs, {}, {link: e}, plan)


def test_a_slow_pipeline_link_is_taken_out_of_the_pipeline():
    """PP4 with one process per node: link (1, 2) carries the messages between stages 1
    and 2. Ordering the nodes so that 1 and 2 are not adjacent stages (e.g. 1, 0, 3, 2)
    leaves it carrying nothing, and all healthy links cost the same, so the plan must
    predict the healthy time, the link must carry nothing, and it must move no more
    processes than the exhaustive optimum needs."""
    layout = Layout(tp=1, dp=1, pp=4, ranks_per_node=1)
    m, act, e = 8, 1e6, 5e-9
    costs = JobCosts.uniform(4, 1, 0.01, m, act_bytes=act, p2p_s=0.0005)
    slow = {(1, 2): e}
    current = ident(layout)
    assert link_traffic(layout, current, 1, 2) == {"PP"}
    plan = plan_topology(layout, current, costs, {}, slow)
    check_plan(layout, current, costs, {}, slow, plan)
    assert link_traffic(layout, plan.roles, 1, 2) == set()
    assert plan.predicted_after_s == pytest.approx(iteration_time(layout, current, costs))  # healthy again
    opt = exhaustive_optimum(layout, costs, {}, slow, current)
    assert opt is not None and len(plan.moved_processes) == opt.fewest_moves


def test_dp_rings_across_the_node_boundary_move_off_a_slow_link():
    """Two nodes of 8, TP2 x DP4 x PP2, currently laid out pipeline after pipeline (node 0
    plays replicas 0 and 1, node 1 replicas 2 and 3), so every DP ring crosses the slow
    link (0, 1). Megatron's own order (identity: stage 0 on node 0, stage 1 on node 1)
    leaves the link only the pipeline's messages and is 3x faster here; the plan must be
    at least as fast, and take every DP ring off the link. (Regression: the planner's link
    candidates used to fill nodes pipeline after pipeline only, and it answered "nothing
    to move".)"""
    layout = Layout(tp=2, dp=4, pp=2, ranks_per_node=8)
    costs = JobCosts.uniform(2, 4, 0.01, 8, act_bytes=1e6, p2p_s=0.001, grad_bytes=1e8, allreduce_s=0.02)
    links = {(0, 1): 5e-9}
    current = [0] * layout.world
    for slot, (d, s) in enumerate((d, s) for d in range(layout.dp) for s in range(layout.pp)):
        for t in range(layout.tp):
            current[layout.tp * slot + t] = layout.role_of(t, d, s)
    assert link_traffic(layout, current, 0, 1) == {"DP"}  # the setting
    stage_per_node = iteration_time(layout, ident(layout), costs, {}, links)
    assert link_traffic(layout, ident(layout), 0, 1) == {"PP"}
    plan = plan_topology(layout, current, costs, {}, links)
    check_plan(layout, current, costs, {}, links, plan)
    assert plan.predicted_before_s > 3 * stage_per_node
    assert plan.predicted_after_s <= stage_per_node * (1 + REL_EPS)
    assert link_traffic(layout, plan.roles, 0, 1) == {"PP"}
    assert check_optimal(layout, current, costs, {}, links, plan) == "local"


@pytest.mark.xfail(strict=True, reason="planner misses the optimum by 2.3%: the best layout swaps the two "
                   "nodes' stages (all 8 processes move); no candidate builds it and pairwise exchanges cannot "
                   "get there")
def test_known_miss_swapping_whole_stages_between_nodes():
    """DP4 x PP2 on two nodes of 4, uneven plan, three stragglers and a slow link between
    the nodes: the exhaustive optimum gains 12% over the current layout; the plan must
    reach it."""
    layout = Layout(tp=1, dp=4, pp=2, ranks_per_node=4)
    costs = JobCosts(fwd_s=[0.011, 0.02], plan=[2, 6, 6, 2], act_bytes=1e5, p2p_s=0.001,
                     grad_bytes=[1e8] * 2, allreduce_s=[0.02] * 2, other_s=0.01)
    gpus, links = {7: 3.0, 1: 2.0, 3: 1.3}, {(0, 1): 1e-9}
    current = ident(layout)
    plan = plan_topology(layout, current, costs, gpus, links)
    check_plan(layout, current, costs, gpus, links, plan)
    assert check_optimal(layout, current, costs, gpus, links, plan) == "exhaustive"


def test_stragglers_go_to_the_light_replica_with_links_off_the_rings():
    """DP2 x PP2, one process per node, an uneven micro-batch plan (5, 2) as S2 leaves it,
    two stragglers and two slow links: the exhaustive optimum puts both stragglers in the
    light replica and keeps the slow links off the DP rings; the plan must reach it.
    (Regression: with pipeline-major link candidates only, the planner stopped 16% short.)"""
    layout = Layout(tp=1, dp=2, pp=2, ranks_per_node=1)
    costs = JobCosts(fwd_s=[0.011, 0.018], plan=[5, 2], act_bytes=1e6, p2p_s=0.001,
                     grad_bytes=[1e8] * 2, allreduce_s=[0.02] * 2, other_s=0.01)
    gpus, links = {2: 1.3, 3: 3.0}, {(1, 2): 5e-9, (2, 3): 5e-9}
    current = ident(layout)
    plan = plan_topology(layout, current, costs, gpus, links)
    check_plan(layout, current, costs, gpus, links, plan)
    assert check_optimal(layout, current, costs, gpus, links, plan) == "exhaustive"


# ---------------------------------------------------------------------------------------
# straggler consolidation: fewest stages, interior first
# ---------------------------------------------------------------------------------------


def test_consolidation_puts_stragglers_in_one_interior_stage():
    """DP2 x PP4, edge stages 30% heavier (embedding, loss). Two 2x stragglers in stage 0
    and stage 3 fit in one stage (dp = 2 groups per stage): the plan must put them in
    one stage, an interior one (an edge stage is already the heaviest), and match the
    exhaustive optimum, which is strictly better than any edge-stage consolidation."""
    layout = Layout(tp=1, dp=2, pp=4, ranks_per_node=2)
    costs = JobCosts(fwd_s=[0.013, 0.01, 0.01, 0.013], plan=[8, 8], p2p_s=0.0002, allreduce_s=[0.005] * 4)
    current = ident(layout)
    gpus = {0: 2.0, 7: 2.0}  # roles 0 (replica 0, stage 0) and 7 (replica 1, stage 3)
    plan = plan_topology(layout, current, costs, gpus, {})
    check_plan(layout, current, costs, gpus, {}, plan)
    stages = stages_of(layout, plan.roles, gpus)
    assert len(stages) == math.ceil(len(gpus) / layout.dp) and stages <= {1, 2}
    opt = exhaustive_optimum(layout, costs, gpus, {}, current)
    assert opt is not None and plan.predicted_after_s <= opt.best_s * (1 + REL_EPS)
    model = IterationModel(layout, costs, gpus, {})
    every = distinguishable_layouts(layout, gpus, {})
    assert every is not None
    edge = min(model.time(rs) for rs in every if stages_of(layout, rs, gpus) in ({0}, {3}))
    assert plan.predicted_after_s < edge * (1 - REL_EPS)


def test_consolidation_uses_the_fewest_stages():
    """DP4 x PP4 on one node, edge stages 30% heavier: five 2x stragglers spread over all
    four stages need ceil(5 / 4) = 2 stages, and the two interior stages are the lightest.
    The exhaustive search confirms that every layout with a straggler outside stages 1
    and 2 is slower; the plan must use exactly stages 1 and 2 and reach the optimum.
    (With uniform stages the model ties some 3-stage layouts with the 2-stage ones, so
    "fewest stages" is only required where it is strictly faster.)"""
    layout = Layout(tp=1, dp=4, pp=4, ranks_per_node=16)
    costs = JobCosts(fwd_s=[0.013, 0.01, 0.01, 0.013], plan=[8] * 4, p2p_s=0.0002, allreduce_s=[0.005] * 4)
    current = ident(layout)
    gpus = {layout.role_of(0, d, s): 2.0 for d, s in [(0, 0), (1, 1), (2, 2), (3, 3), (2, 0)]}
    opt = exhaustive_optimum(layout, costs, gpus, {}, current)
    assert opt is not None
    model = IterationModel(layout, costs, gpus, {})
    every = distinguishable_layouts(layout, gpus, {})
    assert every is not None
    elsewhere = min(model.time(rs) for rs in every if stages_of(layout, rs, gpus) != {1, 2})
    assert elsewhere > opt.best_s * (1 + REL_EPS)  # the setting: stages 1 and 2 are strictly best
    plan = plan_topology(layout, current, costs, gpus, {})
    check_plan(layout, current, costs, gpus, {}, plan)
    assert stages_of(layout, plan.roles, gpus) == {1, 2}
    assert plan.predicted_after_s <= opt.best_s * (1 + REL_EPS)


def test_consolidation_regroups_tp_within_a_node():
    """TP2 x PP2 on one node; 2x stragglers 0 and 2 sit in different TP groups, so both
    stages run 2x. Regrouping them into one TP group slows only that stage: the plan
    must put them in one TP group (same stage, same replica) and be the optimum."""
    layout = Layout(tp=2, dp=1, pp=2, ranks_per_node=4)
    costs = JobCosts.uniform(2, 1, 0.01, 4, p2p_s=0.0002)
    gpus = {0: 2.0, 2: 2.0}
    current = ident(layout)
    plan = plan_topology(layout, current, costs, gpus, {})
    check_plan(layout, current, costs, gpus, {}, plan)
    c0, c2 = layout.role_coords(plan.roles[0]), layout.role_coords(plan.roles[2])
    assert c0[2] == c2[2] and c0[1] == c2[1]  # same stage, same TP group
    opt = exhaustive_optimum(layout, costs, gpus, {}, current)
    assert opt is not None and plan.predicted_after_s <= opt.best_s * (1 + REL_EPS)
    assert len(plan.moved_processes) == opt.fewest_moves  # one exchange of two processes


def test_64_process_layout_plans_quickly():
    """TP2 x DP4 x PP8 on 8 nodes of 8, three stragglers in stages 0, 2 and 5 and two
    slow links. The three slow TP groups fit in one stage (4 per stage): the plan must do
    at least as well as simply swapping them into interior stage 1 (computed here), leave
    no DP ring on a slow link, not be beaten by any single exchange, and take under 10 s.
    (It need not use one stage: the model ties some two-stage layouts with it.)"""
    layout = Layout(tp=2, dp=4, pp=8, ranks_per_node=8)
    costs = JobCosts(
        fwd_s=[0.013] + [0.01] * 6 + [0.013], plan=[8] * 4, act_bytes=1e6, p2p_s=0.001,
        grad_bytes=[2e8] * 8, allreduce_s=[0.05] * 8, other_s=0.02,
    )
    gpus = {3: 2.0, 21: 1.5, 40: 2.0}
    links = {(0, 1): 1e-9, (2, 5): 5e-10}
    current = ident(layout)
    start = time.perf_counter()
    plan = plan_topology(layout, current, costs, gpus, links)
    elapsed = time.perf_counter() - start
    print(f"64-process plan in {elapsed:.3f} s: {plan.reason}")
    check_plan(layout, current, costs, gpus, links, plan)
    # the hand-made reference: each straggler's TP group swapped with a healthy group of stage 1
    hand = list(current)
    proc = process_of(current)
    targets = iter(layout.role_of(0, d, 1) for d in range(layout.dp))
    for p in sorted(gpus):
        mine = current[p] - current[p] % layout.tp
        other = next(targets)
        for i in range(layout.tp):
            pa, pb = proc[mine + i], proc[other + i]
            hand[pa], hand[pb] = hand[pb], hand[pa]
    assert stages_of(layout, hand, gpus) == {1}
    assert plan.predicted_after_s <= iteration_time(layout, hand, costs, gpus, links) * (1 + REL_EPS)
    for a, b in links:
        assert "DP" not in link_traffic(layout, plan.roles, a, b)
    assert check_optimal(layout, current, costs, gpus, links, plan) == "local"
    assert elapsed < 10


# ---------------------------------------------------------------------------------------
# layout helpers and validation
# ---------------------------------------------------------------------------------------


def test_layout_helpers_follow_megatron_order():
    lay = Layout(tp=2, dp=3, pp=2, ranks_per_node=4)
    assert lay.world == 12 and lay.n_nodes == 3
    for r in range(lay.world):
        assert lay.role_of(*lay.role_coords(r)) == r
    assert lay.role_coords(7) == (1, 0, 1)
    assert lay.tp_groups()[0] == [0, 1]
    assert lay.dp_groups()[0] == [0, 2, 4]
    assert lay.pp_groups()[0] == [0, 6]
    assert lay.node_of(11) == 2
    assert Layout(1, 1, 3, 2).n_nodes == 2  # a partly filled last node is allowed


@pytest.mark.parametrize(
    "args, match",
    [
        ((0, 1, 1, 1), "Layout.tp"),
        ((1, -1, 1, 1), "Layout.dp"),
        ((1, 1, 1.5, 1), "Layout.pp"),
        ((1, 1, 1, True), "Layout.ranks_per_node"),
        ((2, 1, 1, 3), "not a multiple of tp = 2"),
    ],
)
def test_bad_layout_raises(args, match):
    with pytest.raises(ValueError, match=match):
        Layout(*args)


def test_bad_planner_inputs_raise():
    lay = Layout(tp=2, dp=2, pp=2, ranks_per_node=4)  # 2 nodes
    costs = JobCosts.uniform(2, 2, 0.01, 2)
    roles = ident(lay)
    with pytest.raises(ValueError, match="node 2 is outside range"):
        plan_topology(lay, roles, costs, {}, {(0, 2): 1e-9})
    with pytest.raises(ValueError, match="to itself"):
        plan_topology(lay, roles, costs, {}, {(1, 1): 1e-9})
    with pytest.raises(ValueError, match="slow_gpus names process 8"):
        plan_topology(lay, roles, costs, {8: 2.0}, {})
    for bad in (0.0, -2.0, math.nan):
        with pytest.raises(ValueError, match=r"slow_gpus\[3\]"):
            plan_topology(lay, roles, costs, {3: bad}, {})
    for bad in (-1e-9, math.nan):
        with pytest.raises(ValueError, match=r"slow_links\[\(0, 1\)\]"):
            plan_topology(lay, roles, costs, {}, {(0, 1): bad})
    with pytest.raises(ValueError, match="current_roles is not a permutation"):
        plan_topology(lay, [0] * 8, costs, {}, {})
    with pytest.raises(ValueError, match="TP group"):
        plan_topology(lay, [0, 4, 2, 3, 1, 5, 6, 7], costs, {}, {})  # roles 0, 1 on both nodes
    with pytest.raises(ValueError, match="layout must be a Layout"):
        plan_topology((2, 2, 2, 4), roles, costs, {}, {})
    with pytest.raises(ValueError, match="costs.plan has 2 replicas, layout.dp = 1"):
        plan_topology(Layout(2, 1, 2, 4), [0, 1, 2, 3], costs, {}, {})
