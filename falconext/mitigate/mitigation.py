"""What the controller keeps about one mitigated fail-slow, and the pure rules it uses.

The controller (control/) owns the I/O and the suspension protocol; this
module holds the decisions that need no I/O: which replica is how fast (from the
heartbeats' compute time per micro-batch), what each strategy's action is (the S2 plan,
the S3 permutation and the model inputs behind it, the nodes S4 leaves out), and when a
straggler under S2 has recovered.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from falconext.protocol.actions import MicrobatchPlan, MitigationAction, Restart, TopologyChange
from falconext.protocol.messages import Localized
from falconext.mitigate.microbatch import plan_microbatches
from falconext.mitigate.planner import Planner
from falconext.mitigate.topology import Layout, TopologyPlan, plan_topology
from falconext.model.itertime import JobCosts, iteration_time


@dataclass
class Mitigation:
    """One episode's mitigation, as the controller keeps it: the ski-rental planner, the
    root cause and the culprits validation named, the slow replicas, the action being
    applied, what was applied, and the measurements S2 and S3 plan with."""

    planner: Planner
    root_cause: str  # "computation" | "communication"
    gpus: list[int]
    links: list[list[int]]
    slow_replicas: set[int] = field(default_factory=set)
    in_flight: Any = None  # the Decision whose action is being applied
    solve_s: float = 0.0
    recovered_since: int | None = None  # first iteration of the current healthy streak
    #: the localized GPUs whose recovery is read against their own compute before the onset
    #: (see :func:`recovery_references`): {process: (role, seconds per micro-batch before)}
    recovery_refs: dict[int, tuple[int, float]] = field(default_factory=dict)
    #: the latest of their heartbeats' iterations counted, and how many fresh readings in a
    #: row had every one back within the jitter line
    own_seen: int = -1
    own_streak: int = 0
    applied: list[dict[str, Any]] = field(default_factory=list)
    #: what validation measured, for S2's times and S3's model: {process: GEMM slowdown} and
    #: {(node_a, node_b): excess seconds per byte}
    gpu_factors: dict[int, float] = field(default_factory=dict)
    link_excess: dict[tuple[int, int], float] = field(default_factory=dict)
    #: a healthy network link's seconds per byte, as validation measured it (0 unknown)
    net_s_per_byte: float = 0.0
    #: each process's compute seconds per micro-batch before the onset, in the role it
    #: plays now (see :func:`healthy_mb_s`)
    healthy_mb_s: dict[int, float] = field(default_factory=dict)
    model_inputs: str = ""  # what S3's model was given, for the event log


def new_mitigation(planner: Planner, loc: Localized, beats: Mapping[int, Any], history: Mapping[int, Iterable[Any]],
                   *, clean_before: int, lookback: int, line: float, nbytes: int) -> Mitigation:
    """The one way to build a :class:`Mitigation`, complete: for the verdict ``loc`` (its
    GPUs, links and validation evidence) with ``planner`` (whose root cause it takes),
    the slow replicas and every measurement S2 and S3 plan with, read from the latest
    heartbeats ``beats`` and the kept ``history``: each process's compute before
    ``clean_before`` (:func:`healthy_mb_s`, ``lookback`` iterations back), the slow
    links' excess and a healthy link's seconds per byte (from validation messages of
    ``nbytes``), the GPUs' validated slowdowns (:func:`gpu_factors`), and the GPUs whose
    recovery is read against their own compute (:func:`recovery_references`, jitter line
    ``line``)."""
    links = loc.evidence.get("links", {})
    before = healthy_mb_s(history, clean_before, lookback)
    return Mitigation(
        planner, planner.state().root_cause, list(loc.gpus), [list(x) for x in loc.links],
        slow_replicas=replicas_of(loc.gpus, beats),
        recovery_refs=recovery_references(beats, loc.gpus, before, line),
        gpu_factors=gpu_factors(loc),
        link_excess=link_excess(loc.links, links, nbytes),
        net_s_per_byte=network_s_per_byte(links, nbytes),
        healthy_mb_s=before,
    )


def gpu_factors(loc: Localized, gpus: Iterable[int] | None = None) -> dict[int, float]:
    """Each slow GPU's validated slowdown (at least 1): the median GEMM speed of the GPUs
    the verdict ``loc`` did not name slow over its own (``gpus``: only these; none without
    a healthy GPU's or its own figure)."""
    flops = {int(r): float(g) for r, g in loc.evidence.get("gemm_gflops", {}).items()}
    out: dict[int, float] = {}
    others = sorted(g for q, g in flops.items() if q not in loc.gpus)
    if not others:
        return out
    for r in loc.gpus if gpus is None else gpus:
        if flops.get(r):
            out[r] = max(1.0, others[len(others) // 2] / flops[r])
    return out


@dataclass(frozen=True)
class ReplicaView:
    """The job's replicas as the heartbeats describe them."""

    times: list[float]  # compute seconds per micro-batch, per replica (slowest member)
    plan: list[int]  # micro-batches per replica now
    total: int


def replica_view(beats: Iterable[Any]) -> ReplicaView | None:
    """None until every replica has reported a compute time and its micro-batch count.

    A replica is as fast as its slowest member: its TP peers wait for each other on
    every layer, its PP stages pass every micro-batch along.
    """
    found = list(beats)
    return replica_view_of([b.replica for b in found], [b.mb_s for b in found], [b.micro for b in found])


def replica_view_in(beats: Mapping[int, Any]) -> ReplicaView | None:
    """:func:`replica_view` of every heartbeat in ``beats`` (a mapping by rank), read as
    columns where the mapping has them (the controller's table: 131,072 Heartbeats made
    for one decision took half a second), else from its heartbeats."""
    column = getattr(beats, "column", None)
    if column is not None:
        return replica_view_of(column("replica"), column("mb_s"), column("micro"))
    return replica_view(beats.values())


def replica_view_of(replicas: Sequence[int], mb_s: Sequence[float], micros: Sequence[int]) -> ReplicaView | None:
    """:func:`replica_view` of the heartbeats' values given a quantity at a time (the
    i-th of each is one heartbeat's: the controller reads them as columns)."""
    rep = np.asarray(replicas, dtype=np.int64)
    mb = np.asarray(mb_s, dtype=np.float64)
    micro = np.asarray(micros, dtype=np.int64)
    if not len(rep) or (rep < 0).any() or not (mb > 0).all() or (micro <= 0).any():
        return None
    n = int(rep.max()) + 1
    if not (np.bincount(rep, minlength=n) > 0).all():  # the replicas are exactly 0 .. n-1
        return None
    times = np.zeros(n)
    np.maximum.at(times, rep, mb)  # the slowest member's
    last = np.zeros(n, dtype=np.int64)
    np.maximum.at(last, rep, np.arange(len(rep)))  # the micro-batches its last heartbeat says
    per = micro[last]
    return ReplicaView(times.tolist(), per.tolist(), int(per.sum()))


def cap_by_gemm(times: list[float], factors: Mapping[int, float]) -> list[float]:
    """Per-replica compute times with each slow replica's capped at the healthy replicas'
    median times its validated GEMM slowdown.

    A straggler's forward times, taken while the job runs, are inflated on a shared
    host: every preemption of its forward is stretched again by the slowdown itself.
    A 2x straggler read 2.6x on the 2-core test bed in CI, and S2 planned [18, 6] where
    [16, 8] balances. Validation's GEMM ran alone, with the job suspended. The smaller of
    the two is kept, so a workload that suffers less than the GEMM is not over-corrected.
    """
    healthy = [t for r, t in enumerate(times) if r not in factors]
    if not healthy:
        return list(times)
    ref = statistics.median(healthy)
    return [min(t, ref * factors[r]) if r in factors and factors[r] >= 1.0 else t for r, t in enumerate(times)]


def healthy_mb_s(history: Mapping[int, Iterable[Any]], onset: int, lookback: int = 0,
                 ranks: Iterable[int] | None = None) -> dict[int, float]:
    """Each process's compute seconds per micro-batch before the fail-slow's onset
    iteration, in the role its latest heartbeat names: the lowest reading among its
    heartbeats of iterations ``onset - lookback`` .. ``onset``, or, with none there, its
    last heartbeat before that window.

    The onset is the detectors' estimate, and it can come late: for a mild (1.3x) GPU
    table7's detectors placed it 7 iterations after the fault began, so the last
    heartbeat before it already carried the fault (a compute rise of 1.01 instead of
    1.3). ``lookback`` (the controller passes the detectors' confirmation window,
    ``min_duration``: they confirm a fail-slow on that many slow iterations, and the
    onset they estimate lies before the confirmation) reaches back past such a late
    estimate; a heartbeat's median (of ``beat_compute_window`` steps) is still clean
    up to half its window into the fault, so the window holds a clean reading for an
    onset up to about ``lookback`` + half that window iterations late. The lowest reading in it
    is the clean one: a fail-slow only ever adds time to a micro-batch, and a heartbeat's
    figure is already a median over recent iterations, so the lowest of a few carries
    no single fast outlier (at most its own jitter, about 1% low). Processes without a
    heartbeat from before the onset (the job had just started, or switched roles since)
    are left out. ``ranks``: only these processes' (None: every one's).
    """
    at_once = getattr(history, "healthy_mb_s", None)  # the controller's table: every rank at once
    if at_once is not None:
        return at_once(onset, lookback, ranks)
    out: dict[int, float] = {}
    only = None if ranks is None else set(ranks)
    for p, beats in history.items():
        if only is not None and p not in only:
            continue
        beats = list(beats)
        if not beats:
            continue
        role = beats[-1].role
        clean = [b for b in beats if b.iteration <= onset and b.role == role and b.mb_s > 0]
        if not clean:
            continue
        window = [b.mb_s for b in clean if b.iteration >= onset - max(0, lookback)]
        out[p] = float(min(window) if window else clean[-1].mb_s)
    return out


@dataclass(frozen=True)
class TopologyInputs:
    """Everything :func:`falconext.mitigate.topology.plan_topology` takes, as the
    heartbeats describe the job now."""

    layout: Layout
    roles: list[int]
    costs: JobCosts
    gpu_factors: dict[int, float]


def topology_inputs(beats: Mapping[int, Any], healthy_s: float, slow: Iterable[int] = (),
                    gemm_factors: Mapping[int, float] | None = None,
                    before: Mapping[int, float] | None = None, *,
                    net_s_per_byte: float = 0.0) -> TopologyInputs | str:
    """The job's layout, current roles, healthy costs and the stragglers' slowdown, from
    the heartbeats, or why not. ``net_s_per_byte``: a healthy network link's seconds per
    byte (:func:`network_s_per_byte`), priced into the model's transfers between nodes
    before the fit, so that moving traffic onto a network link costs what it costs.

    With ``before`` (each process's forward time per micro-batch before the onset, see
    :func:`healthy_mb_s`) covering every process, a stage's compute per micro-batch is
    the median of its processes' times before the onset, and a straggler's factor is
    its forward time now over its own before: a slowdown relative to itself. Peers'
    times taken during the fail-slow are not a reference: on the 2-core test bed a
    straggler's busy core stretched its stage peer's forward too, and the ratio to the
    peer read 1.12 for a 3x straggler, which hid the consolidation. Without it, a
    stage's compute is the median forward time of its processes that are not slow
    (backward taken as twice that), and a straggler's factor its own forward time over
    that (the validation GEMM ratio where no forward time is known). Traffic is what
    the ranks report (gradient bytes per iteration, one pipeline message's bytes). The
    model is then fitted to the healthy iteration time: forward times measured during
    the fail-slow may be inflated by it (shared hosts), so compute is scaled down when
    the model overshoots, and what it does not see (optimizer, data, loss reduction,
    healthy transfer times) becomes one constant when it undershoots."""
    if not beats:
        return "no heartbeats"
    world = len(beats)
    if sorted(beats) != list(range(world)):
        return f"heartbeats from ranks {sorted(beats)}, not from every rank 0..{world - 1}"
    first = beats[0]
    tp, pp = first.tp, first.pp
    if tp < 1 or pp < 1 or any(b.tp != tp or b.pp != pp for b in beats.values()):
        return "the ranks have not all reported the same TP and PP sizes"
    if world % (tp * pp):
        return f"{world} ranks do not make TP {tp} x PP {pp} replicas"
    roles = [beats[p].role for p in range(world)]
    if sorted(roles) != list(range(world)):
        return f"the reported roles {roles} are not a permutation"
    per_node = Counter(b.node for b in beats.values())
    sizes = set(per_node.values())
    if len(sizes) != 1 or any(beats[p].node != p // next(iter(sizes)) for p in range(world)):
        return "nodes are not blocks of consecutive ranks of one size"
    dp = world // (tp * pp)
    try:
        layout = Layout(tp, dp, pp, next(iter(sizes)))
    except ValueError as exc:
        return str(exc)
    slow = set(slow)
    own = dict(before) if before and all(before.get(p, 0) > 0 for p in beats) else {}
    fwd = []
    for stage in range(pp):
        if own:
            mine = [own[p] for p, b in beats.items() if b.stage == stage]
        else:
            mine = [b.mb_s for p, b in beats.items() if b.stage == stage and p not in slow and b.mb_s > 0]
            mine = mine or [b.mb_s for b in beats.values() if b.stage == stage and b.mb_s > 0]
        if not mine:
            return f"no compute time per micro-batch from pipeline stage {stage}"
        fwd.append(statistics.median(mine))
    factors: dict[int, float] = {}
    for p in sorted(slow):
        b = beats.get(p)
        if own and b is not None and b.mb_s > 0:
            factors[p] = max(1.0, b.mb_s / own[p])
        elif b is not None and b.mb_s > 0 and 0 <= b.stage < pp:
            factors[p] = max(1.0, b.mb_s / fwd[b.stage])
        elif gemm_factors and p in gemm_factors:
            factors[p] = max(1.0, float(gemm_factors[p]))
    grad = []
    for stage in range(pp):
        mine = [b.grad_bytes for b in beats.values() if b.stage == stage]
        grad.append(float(statistics.median(mine)) if mine else 0.0)
    plan = [0] * dp
    for b in beats.values():
        if not 0 <= b.replica < dp or b.micro <= 0:
            return "micro-batches per replica not known yet"
        plan[b.replica] = b.micro
    act = float(max(b.act_bytes for b in beats.values()))
    modelled = iteration_time(layout, roles, JobCosts(fwd_s=fwd, plan=plan, act_bytes=act, grad_bytes=grad,
                                                      net_s_per_byte=net_s_per_byte))
    if modelled > healthy_s > 0:
        fwd, other = [f * healthy_s / modelled for f in fwd], 0.0
    else:
        other = max(0.0, healthy_s - modelled)
    costs = JobCosts(fwd_s=fwd, plan=plan, act_bytes=act, grad_bytes=grad, other_s=other,
                     net_s_per_byte=net_s_per_byte)
    return TopologyInputs(layout, roles, costs, factors)


def link_excess(links: Iterable[Iterable[int]], evidence: Mapping[str, Any], nbytes: int) -> dict[tuple[int, int], float]:
    """Excess seconds per byte of each slow link over its reference, from the validation
    evidence (a link's message time, as if alone on the link, minus the reference, per
    byte). The reference is the peer links' (``reference``) or, for the lone network link
    of a two-node job, that link's own healthy time (``baseline``)."""
    if not isinstance(evidence, Mapping):
        return {}
    measured = evidence.get("links") or {}
    ref = evidence.get("reference")
    own = evidence.get("baseline") or {}
    out: dict[tuple[int, int], float] = {}
    for link in links:
        a, b = sorted(int(x) for x in link)
        t = measured.get(f"{a}-{b}")
        r = ref if isinstance(ref, (int, float)) else own.get(f"{a}-{b}")
        if isinstance(t, (int, float)) and isinstance(r, (int, float)) and nbytes > 0:
            out[(a, b)] = max(0.0, (float(t) - float(r)) / nbytes)
    return out


def network_s_per_byte(evidence: Mapping[str, Any], nbytes: int) -> float:
    """A healthy inter-node link's seconds per byte, from the validation evidence: the
    reference message time (the peer links' or, for a two-node job, the median of the
    links' own healthy baselines) over the message's bytes; 0.0 without a reference."""
    if not isinstance(evidence, Mapping) or nbytes <= 0:
        return 0.0
    ref = evidence.get("reference")
    if isinstance(ref, (int, float)) and ref > 0:
        return float(ref) / nbytes
    own = [float(v) for v in (evidence.get("baseline") or {}).values() if isinstance(v, (int, float)) and v > 0]
    return statistics.median(own) / nbytes if own else 0.0


def replicas_of(ranks: Iterable[int], beats: Mapping[int, Any]) -> set[int]:
    """The DP replicas of ``ranks``, from their latest heartbeats; ranks without one, or not in a replica,
    are left out."""
    return {beats[r].replica for r in ranks if r in beats and beats[r].replica >= 0}


def exclude_nodes(gpus: list[int], links: list[list[int]], node_of: Mapping[int, int]) -> list[int]:
    """Nodes S4 leaves out: every node holding a slow GPU; for a slow link, one of its
    two ends (the higher-numbered: either end cuts the link, and one spare is enough)."""
    nodes = {node_of[r] for r in gpus if r in node_of}
    for link in links:
        if not nodes & set(link):
            nodes.add(max(link))
    return sorted(nodes)


def straggler_recovered(times: list[float], slow: set[int], margin: float) -> bool:
    """The slow replicas compute a micro-batch within ``margin`` of the others' median."""
    others = [t for r, t in enumerate(times) if r not in slow]
    mine = [t for r, t in enumerate(times) if r in slow]
    if not others or not mine:
        return False
    return max(mine) <= (1.0 + margin) * statistics.median(others)


def recovery_references(beats: Mapping[int, Any], gpus: Iterable[int], before: Mapping[int, float],
                        line: float) -> dict[int, tuple[int, float]]:
    """The slow GPUs whose recovery can be read against their own compute per micro-batch
    before the onset: {process: (its role now, that reading)}, for each GPU of ``gpus``
    with a reading before (``before``, :func:`healthy_mb_s`) and one now at least
    ``1 + line`` times it. A GPU whose reading now does not show the fault against that
    reference is left out: the reference may itself carry the fault (an onset placed too
    late), and "back within the line" of it would mean nothing."""
    out: dict[int, tuple[int, float]] = {}
    for g in gpus:
        b = beats.get(g)
        ref = before.get(g, 0.0)
        if b is not None and ref > 0 and b.mb_s >= (1.0 + line) * ref:
            out[g] = (b.role, float(ref))
    return out


def back_to_own_level(beats: Mapping[int, Any], refs: Mapping[int, tuple[int, float]], line: float) -> bool | None:
    """Whether every GPU of ``refs`` (:func:`recovery_references`) computes a micro-batch
    within ``line`` of its own time before the onset again; None when that cannot be read
    (no references, or a GPU without a reading now or in another role than its reference's).

    Its compute per micro-batch is the GPU's own health whatever S2 gives its replica to
    do: the iteration time cannot show a recovery under S2 (the plan hides the straggler),
    the replica's time against the others' needs them unchanged, this needs nothing else."""
    if not refs:
        return None
    back = True
    for g, (role, ref) in refs.items():
        b = beats.get(g)
        if b is None or b.role != role or b.mb_s <= 0:
            return None
        back = back and b.mb_s <= (1.0 + line) * ref
    return back


def action_for(mit: Mitigation, d: Any, beats: Mapping[int, Any], max_per_replica: int | None,
               room: Any = None) -> MitigationAction | str:
    """What every rank must do to apply the planner's decision ``d`` (the suspension's
    action), or why it cannot be done now."""
    if d.action == "revert":
        now = replica_view_in(beats)
        if now is None:
            return "replica layout unknown"
        n = len(now.plan)
        return MicrobatchPlan("revert", [now.total // n] * n)
    if d.strategy == "S2":
        now = replica_view_in(beats)
        if now is None:
            return "no compute time per micro-batch from every replica"
        by_replica: dict[int, float] = {}
        for p, f in mit.gpu_factors.items():
            b = beats.get(p)
            if b is not None and 0 <= b.replica < len(now.times):
                by_replica[b.replica] = max(f, by_replica.get(b.replica, 1.0))
        times = cap_by_gemm(now.times, by_replica)
        try:
            plan = plan_microbatches(times, now.total, max_per_replica)
        except ValueError as exc:
            return f"no plan: {exc}"
        if plan == now.plan:
            return f"the balanced plan {plan} is the plan in effect"
        return MicrobatchPlan("S2", plan, replica_mb_s=times,
                              measured_mb_s=list(now.times) if times != now.times else None)
    if d.strategy == "S3":
        plan_or_why = topology_for(mit, beats)
        if isinstance(plan_or_why, str):
            return plan_or_why
        return TopologyChange(list(plan_or_why.roles),
                              predicted_s=[round(plan_or_why.predicted_before_s, 4),
                                           round(plan_or_why.predicted_after_s, 4)],
                              moved=list(plan_or_why.moved_processes), why=plan_or_why.reason,
                              model_inputs=mit.model_inputs)
    if d.strategy == "S4":
        node_of = {r: b.node for r, b in beats.items()}
        nodes = exclude_nodes(mit.gpus, mit.links, node_of)
        why = None
        if room is not None:  # a multi-node job: what it can absorb (mitigate/room.py)
            level = [b.iter_s for b in beats.values() if getattr(b, "iter_s", 0) > 0]
            # status(): action_for is also handed a stand-in planner with only that (tests/test_elastic.py)
            why = room.refusal(nodes) or room.slower(nodes, mit.planner.status().get("healthy_s"),
                                                     statistics.median(level) if level else None)
        return why if why is not None else Restart(nodes, reason=d.reason)
    return f"{d.strategy} is not available"


def topology_for(mit: Mitigation, beats: Mapping[int, Any]) -> TopologyPlan | str:
    """S3's permutation for the localized faults, or why there is none (with what the
    model was given, so a refusal can be checked)."""
    inputs = topology_inputs(beats, mit.planner.state().healthy_s, mit.gpus, mit.gpu_factors,
                             mit.healthy_mb_s, net_s_per_byte=mit.net_s_per_byte)
    if isinstance(inputs, str):
        return f"no topology model: {inputs}"
    seen = (f"fwd_s {[round(f, 5) for f in inputs.costs.fwd_s]}, other_s {round(inputs.costs.other_s, 4)}, "
            f"network {inputs.costs.net_s_per_byte:.4g} s/byte, "
            f"slow GPUs {({p: round(f, 2) for p, f in inputs.gpu_factors.items()})}, "
            f"slow links {({f'{a}-{b}': e for (a, b), e in mit.link_excess.items()})} s/byte")
    try:
        plan = plan_topology(inputs.layout, inputs.roles, inputs.costs, inputs.gpu_factors, mit.link_excess)
    except ValueError as exc:
        return f"no topology plan: {exc} (model inputs: {seen})"
    if not plan.changed:
        return f"no permutation helps: {plan.reason} (model inputs: {seen})"
    mit.model_inputs = seen
    return plan
