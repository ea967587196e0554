"""A discrete-event simulation of a hybrid-parallel job that drives the real controller.

Sixty-four torch ranks do not fit a two-core machine, so the job is simulated and
falconext's own decision code is run on it, in process, on a simulated clock:

* real: :class:`falconext.control.controller.Controller` (profiling analysis, validation
  plan and verdict, the ski-rental planner, S2's micro-batch solver, S3's topology
  planner, S4's node choice), fed the real messages of ``protocol/``; each
  rank's detector is falconext's BOCD + verification (``detect/verify.VerifiedBOCD``, or
  the unverified ``detect/baselines.PlainBOCD`` for an ablation) fed that rank's own
  reading of every iteration's time, after ``tracking_warmup`` iterations, as
  ``detect/tracking.RankTracking`` feeds it once the period is known (a rank whose call
  stream grows, more micro-batches or a new role, starts a fresh detector, as
  RankTracking does on a longer period); the ranks' messages, made by the runtime's own
  builders (``protocol/rank_side.py``: the heartbeat's windows and fields, which detector
  events are reported and how, the profiles, the suspension's acks and results);
* simulated: the iteration times, from ``falconext.model.itertime`` (1F1B per replica, DP
  rings, slow GPUs as compute factors, slow links as excess seconds per byte) under the
  fault trace (``model/faults.Fault``, its start and end in simulated seconds), the
  micro-batch plan and the roles in force, times a shared jitter; the
  ranks' answers to the controller's commands, as ``runtime/runtime.py``,
  ``control/client.py`` and ``validate/suspension.py`` give them: heartbeats (one per
  rank per iteration, at its start), fail-slow reports, ProfileData (each DP
  all-reduce's issue and end times from the model's breakdown), SessionAcks at the
  agreed iteration, ValidationResults (GEMM FLOP/s and P2P message times from the
  faults), and the action every rank commits from the next iteration: an S2 plan, S3
  roles, an S4 restart without the named nodes (whose faults go with them, as the test
  bed's launcher drops them).

Costs charged to the simulated clock: a suspension's pause (two bus hops, the
validation's benchmarks, the agreement barrier); S3's switch (``runtime/switch.py``'s
phases: serialise, transfer, regroup, rebuild, for this job's per-rank state); S4's
restart (``mitigate/restart.RestartCost``: the state saved and loaded at the storage's
rates, plus the job's start-up). The ranks report those same costs in their heartbeats
(``switch_s``, ``restart_s``) as the planner's overheads, as the real ranks report their
measured ones. The controller's own time is not charged (it answers between iterations).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from falconext.config import FalconConfig
from falconext.control.controller import Controller, Output
from falconext.protocol.actions import MicrobatchPlan, MitigationAction, Restart, TopologyChange
from falconext.protocol.commands import Command, Go, ProfileRequest, Release, Resume, Share, Suspend
from falconext.protocol.messages import FailSlowReport, Heartbeat, ProfileData, ValidationResult
from falconext.protocol.rank_side import (
    EventReports,
    beat_fields,
    beat_iter_s,
    beat_mb_s,
    fail_slow_report,
    heartbeat,
    held_ack,
    missed_ack,
    profile_data,
    resumed_ack,
    validation_result,
)
from falconext.detect.baselines import PlainBOCD
from falconext.detect.verify import VerifiedBOCD
from falconext.experiments.scale import job_groups
from falconext.mitigate.restart import RestartCost
from falconext.mitigate.topology import Layout
from falconext.model.faults import Fault
from falconext.model.itertime import IterationBreakdown, IterationModel, JobCosts
from falconext.validate.plan import join_shares

#: one hop on the bus (rank -> node agent -> controller, or back), seconds
BUS_LATENCY_S = 0.05
#: one barrier over the validation group (the action's agreement, a benchmark step)
BARRIER_S = 0.01
#: a healthy GPU's GEMM speed and the fabric's speeds (validation benchmarks)
HEALTHY_FLOPS = 300e12
INTER_NODE_BPS = 25e9
INTRA_NODE_BPS = 300e9
P2P_LATENCY_S = 5e-6
#: iteration-to-iteration jitter every rank sees (log-normal sigma), and each rank's own
#: reading error of an iteration's time
JOB_JITTER = 0.015
READ_JITTER = 0.003
#: a GPU's own compute jitter per micro-batch (what its heartbeat's mb_s carries)
MB_JITTER = 0.01
#: the controller's deadlines are checked this often while the ranks wait in a suspension
TICK_S = 0.1


def link_excess(fault: Fault) -> float:
    """A link fault's excess seconds per byte over the inter-node link: (factor - 1) /
    ``INTER_NODE_BPS``, as ``model/faults.py`` defines a link factor (a transfer over
    the link takes ``factor`` times as long as at the nominal bandwidth)."""
    return (fault.factor - 1.0) / INTER_NODE_BPS


def on_nodes(fault: Fault, nodes: set[int], ranks_per_node: int) -> bool:
    """Whether ``fault`` concerns one of ``nodes`` (an S4 restart replaces them): a
    compute fault's process runs there, or a link fault's link ends there."""
    if fault.kind == "compute":
        return fault.rank is not None and fault.rank // ranks_per_node in nodes
    return bool(set(fault.nodes or ()) & nodes)


@dataclass(frozen=True)
class MitigationCosts:
    """What S3 and S4 cost this job, from its per-rank state (model + optimizer bytes).

    S4 (``restart_s``): ``RestartCost.save_load_s`` (the state written and read back at
    the storage's rates, as falconext's restart probe estimates it) plus the job's
    start-up. S3 (``switch_s``): runtime/switch.py's phases: the state serialised and
    loaded in host memory, sent once over the network, plus regrouping and rebuilding."""

    state_bytes: int
    write_bps: float
    read_bps: float
    startup_s: float
    memory_bps: float
    regroup_s: float

    @property
    def restart_s(self) -> float:
        """Seconds of one S4 checkpoint-restart."""
        return self.startup_s + RestartCost(self.state_bytes, self.write_bps, self.read_bps).save_load_s

    @property
    def switch_s(self) -> float:
        """Seconds of one S3 topology switch (in memory)."""
        return 2 * self.state_bytes / self.memory_bps + self.state_bytes / INTER_NODE_BPS + self.regroup_s


@dataclass(frozen=True)
class Job:
    """The simulated job: its layout, healthy costs (even plan), mitigation costs, and the
    seed of its jitter (the same for every run, so runs differ only in what they do)."""

    layout: Layout
    costs: JobCosts
    mitigation: MitigationCosts
    seed: int = 0

    @property
    def world(self) -> int:
        """Processes (= ranks) of the job."""
        return self.layout.world


@dataclass(frozen=True)
class Variant:
    """How one run treats the trace: falconext on or off, its configuration, the ranks'
    detector (``bocd+v`` or unverified ``bocd``), and whether the ranks tell the planner
    what S3 and S4 really cost (False: they report 1 ms each, so the planner escalates
    as soon as a strategy is judged not enough; the real cost is still charged)."""

    name: str
    falcon: bool = True
    config: FalconConfig = field(default_factory=FalconConfig)
    detector: str = "bocd+v"
    report_costs: bool = True


@dataclass
class JobState:
    """What the ranks run now: micro-batches per replica, the role each process plays, and
    the nodes an S4 restart replaced (their faults are gone)."""

    plan: list[int]
    roles: list[int]
    replaced: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class RunResult:
    """One run: iterations done, when the last ended (the JCT), each iteration's (end
    time, seconds), the pauses falconext charged (time, what, seconds), and the
    controller's events that tell the story (localized, decisions, mitigations)."""

    name: str
    iterations: int
    jct_s: float
    times: list[tuple[float, float]]
    pauses: list[tuple[float, str, float]]
    events: list[dict[str, Any]]


def apply_action(job: Job, state: JobState, action: MitigationAction) -> tuple[JobState, float, str, set[int]]:
    """A committed mitigation action applied by every rank: (the state from the next
    iteration, the pause it costs, what it is, the processes whose call stream starts
    over). The one place that reads an action."""
    world = job.world
    if isinstance(action, MicrobatchPlan):
        plan = [int(m) for m in action.plan]
        grew = {r for r, (a, b) in enumerate(zip(state.plan, plan)) if b > a}
        fresh = {p for p in range(world) if replica_of(job.layout, state.roles[p]) in grew}
        return replace(state, plan=plan), 0.0, action.strategy, fresh
    if isinstance(action, TopologyChange):
        roles = [int(r) for r in action.roles]
        moved = {p for p in range(world) if roles[p] != state.roles[p]}
        return replace(state, roles=roles), job.mitigation.switch_s, "S3", moved
    if isinstance(action, Restart):
        nodes = set(state.replaced) | {int(n) for n in action.exclude_nodes}
        even = [sum(state.plan) // len(state.plan)] * len(state.plan)
        return JobState(even, list(range(world)), nodes), job.mitigation.restart_s, "S4", set(range(world))
    raise ValueError(f"unknown action {action!r}")


def replica_of(layout: Layout, role: int) -> int:
    """The DP replica a role belongs to (Megatron's order)."""
    return layout.role_coords(role)[1]


def stage_of(layout: Layout, role: int) -> int:
    """The pipeline stage a role belongs to (Megatron's order)."""
    return layout.role_coords(role)[2]


def active_faults(faults: list[Fault], t: float, replaced: set[int], ranks_per_node: int) -> tuple[Fault, ...]:
    """The faults in force at simulated time ``t`` on the nodes the job still runs on."""
    return tuple(f for f in faults if f.active(t) and not on_nodes(f, replaced, ranks_per_node))


def fault_maps(faults: tuple[Fault, ...]) -> tuple[dict[int, float], dict[tuple[int, int], float]]:
    """({process: compute factor}, {(node_a, node_b): excess s/byte}) of the faults (worst
    of overlapping ones)."""
    gpus: dict[int, float] = {}
    links: dict[tuple[int, int], float] = {}
    for f in faults:
        if f.kind == "compute" and f.rank is not None:
            gpus[f.rank] = max(gpus.get(f.rank, 1.0), f.factor)
        elif f.kind == "link" and f.nodes is not None:
            key = (min(f.nodes), max(f.nodes))
            links[key] = max(links.get(key, 0.0), link_excess(f))
    return gpus, links


class _Models:
    """Iteration models per (plan, faults) and breakdowns per roles, memoised."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self._models: dict[tuple, IterationModel] = {}
        self._breakdowns: dict[tuple, IterationBreakdown] = {}

    def breakdown(self, plan: list[int], faults: tuple[Fault, ...], roles: list[int]) -> IterationBreakdown:
        key = (tuple(plan), faults)
        model = self._models.get(key)
        if model is None:
            gpus, links = fault_maps(faults)
            model = IterationModel(self.job.layout, replace(self.job.costs, plan=tuple(plan)), gpus, links)
            self._models[key] = model
        bkey = (key, tuple(roles))
        hit = self._breakdowns.get(bkey)
        if hit is None:
            hit = model.breakdown(roles)
            self._breakdowns[bkey] = hit
        return hit


class _Rank:
    """One simulated rank's own state: its detector and what its heartbeat reports."""

    def __init__(self, detector: str, cfg: FalconConfig) -> None:
        self.kind = detector
        self.cfg = cfg
        #: the heartbeat's compute per micro-batch is the upper median of these (runtime.after_step)
        self.mb: deque[float] = deque(maxlen=cfg.beat_compute_window)
        self.generation = -1
        #: which of its detectors' event changes it reports, under run-wide ids (as runtime/monitor.py)
        self.reports = EventReports()
        self.restart()

    def restart(self) -> None:
        """A fresh call stream: a new detector, warm-up again (tracking_warmup)."""
        self.detector = VerifiedBOCD(self.cfg) if self.kind == "bocd+v" else PlainBOCD(self.cfg)
        self.seen = 0
        self.series: list[int] = []  # detector index -> loop iteration
        self.generation += 1


class _Sim:
    """One run of the job under the trace with falconext as ``variant`` says."""

    def __init__(self, job: Job, faults: list[Fault], variant: Variant) -> None:
        self.job = job
        self.faults = faults
        self.v = variant
        self.cfg = variant.config
        lay = job.layout
        self.state = JobState(list(job.costs.plan), list(range(job.world)))
        self.models = _Models(job)
        self.ctl = Controller(self.cfg, world=job.world) if variant.falcon else None
        self.ranks = [_Rank(variant.detector, self.cfg) for _ in range(job.world)]
        self.rng_job = np.random.default_rng(job.seed)
        self.rng_rank = np.random.default_rng(job.seed + 1)
        self.rng_bench = np.random.default_rng(job.seed + 2)
        self.inbox: list[tuple[float, int, Any]] = []  # (arrival, seq, message) for the controller
        self._seq = 0
        self.t = 0.0
        self.it = 0
        #: the heartbeat's iteration time is the median of these starts' gaps (runtime.iter_s)
        self.starts: deque[float] = deque(maxlen=self.cfg.beat_iter_window + 1)
        #: the latest iterations: (loop iteration, start, end, breakdown, roles)
        self.recent: deque[tuple[int, float, float, IterationBreakdown, list[int]]] = deque(maxlen=8)
        self.suspension: dict[str, Any] | None = None  # pending or held: session, iteration, plan, go, release
        #: share commands of the validation sessions not suspended yet, by session
        self.shares: dict[int, list[Any]] = {}
        self.committed: tuple[int, MitigationAction] | None = None
        self.times: list[tuple[float, float]] = []
        self.pauses: list[tuple[float, str, float]] = []
        self.events: list[dict[str, Any]] = []
        self.node_of = [p // lay.ranks_per_node for p in range(job.world)]
        self.groups = job_groups(lay)

    # --- the controller side ----------------------------------------------------------

    def post(self, msgs: list[Any], at: float) -> None:
        """Messages from the ranks, reaching the controller one bus hop after ``at``."""
        for m in msgs:
            self._seq += 1
            heapq.heappush(self.inbox, (at + BUS_LATENCY_S, self._seq, m))

    def deliver(self, until: float) -> None:
        """The controller handles every message that has arrived by ``until``, in order."""
        if self.ctl is None:
            self.inbox.clear()
            return
        while self.inbox and self.inbox[0][0] <= until:
            at, _, msg = heapq.heappop(self.inbox)
            self.follow(self.ctl.tick(at), at)
            self.follow(self.ctl.handle(msg, at), at)
        self.follow(self.ctl.tick(until), until)

    def follow(self, outs: list[Output], now: float) -> None:
        """Carry out the controller's outputs: commands reach the ranks one hop later."""
        for o in outs:
            if o.kind == "event":
                if o.event.get("type") not in ("rank_scores", "controller_state"):
                    self.events.append(dict(o.event, t=round(now, 3), loop_iteration=self.it))
            elif o.kind == "command":
                self.command(o.message, now + BUS_LATENCY_S)

    def command(self, cmd: Command, at: float) -> None:
        """What the ranks do with one command (control/client.py, runtime.schedule/signal)."""
        match cmd:
            case ProfileRequest(session=session, window_s=window_s):
                self.post(self.profiles(session, window_s, at), at)
            case Share(session=session, share=share):
                self.shares.setdefault(session, []).append(share)
            case Suspend(session=session):
                shares = self.shares.pop(session, [])
                if self.it >= cmd.iteration:  # already past it: every rank missed it
                    self.post([missed_ack(r, session, self.it, at) for r in range(self.job.world)], at)
                    return
                plan = join_shares(cmd.validation, shares) if cmd.validation is not None else {}
                wait = cmd.validation.verdict_wait_s if cmd.validation is not None else 0.0
                self.suspension = {"session": session, "iteration": cmd.iteration, "plan": plan,
                                   "action": cmd.action, "go": None, "release": None, "deadline_s": cmd.deadline_s,
                                   "verdict_wait_s": wait, "resume": None, "resume_action": None}
            case Go() | Release() | Resume():
                sus = self.suspension
                # when each signal came, under its kind
                if sus is not None and sus["session"] == cmd.session and sus[cmd.KIND] is None:
                    sus[cmd.KIND] = at
                    if isinstance(cmd, Resume):
                        sus["resume_action"] = cmd.action
                    if isinstance(cmd, Release) and "held_at" not in sus:
                        self.suspension = None  # dropped before it trapped

    # --- what the ranks send ----------------------------------------------------------

    def heartbeats(self, at: float) -> list[Heartbeat]:
        """Every rank's heartbeat at the start of loop iteration ``self.it`` (rank 0 last),
        none before the ranks have an iteration time."""
        iter_s = beat_iter_s(list(self.starts), self.cfg.beat_iter_window)
        lay, st = self.job.layout, self.state
        m = self.job.mitigation
        strategies = self.cfg.strategies()
        restart_s = (m.restart_s if self.v.report_costs else 0.001) if "S4" in strategies else 0.0
        switch_s = (m.switch_s if self.v.report_costs else 0.001) if "S3" in strategies else 0.0
        out = []
        for p in reversed(range(self.job.world)):
            role = st.roles[p]
            d, s = replica_of(lay, role), stage_of(lay, role)
            mb = beat_mb_s(self.ranks[p].mb)
            compute = mb * 3 * st.plan[d]
            fields = beat_fields(
                replica=d, mb_s=mb, micro=st.plan[d], restart_s=restart_s, switch_s=switch_s,
                role={"role": role, "stage": s, "tp": lay.tp, "pp": lay.pp,
                      "grad_bytes": int(self.job.costs.grad_bytes[s]), "act_bytes": int(self.job.costs.act_bytes)},
                score_iteration=self.it - 1, est_iter_s=iter_s, compute_s=compute, wait_s=max(0.0, iter_s - compute),
                into_s=0.0)
            beat = heartbeat(p, self.node_of[p], self.it, iter_s, at, fields)
            if beat is not None:
                out.append(beat)
        return out

    def profiles(self, session: int, window_s: float, at: float) -> list[ProfileData]:
        """Every rank's DP all-reduces, as of time ``at``, of the iterations that ended by
        then and began in the last ``window_s`` (at least the latest that ended): issued
        when the rank's stage finished its last backward, ended when the slowest member's
        transfer did."""
        lay = self.job.layout
        done = [r for r in self.recent if r[2] <= at]
        recent = [r for r in done if r[1] >= at - window_s] or done[-1:]
        calls: dict[int, dict[str, list[list[float]]]] = {}
        for it, t0, _, bd, roles in recent:
            proc = [0] * self.job.world
            for p, r in enumerate(roles):
                proc[r] = p
            for gid, (kind, members) in self.groups.items():
                if kind != "dp":
                    continue
                s = stage_of(lay, members[0])
                end = t0 + bd.allreduce_start_s[s] + bd.allreduce_s[s]
                for role in members:
                    issue = t0 + bd.stage_finish_s[replica_of(lay, role)][s] + abs(self.rng_bench.normal(0, 1e-3))
                    calls.setdefault(proc[role], {}).setdefault(gid, []).append(
                        [it, round(issue, 6), round(max(issue, end), 6),
                         int(self.job.costs.grad_bytes[s])])
        out = []
        roles_now = self.state.roles
        proc_now = [0] * self.job.world
        for p, r in enumerate(roles_now):
            proc_now[r] = p
        for p in range(self.job.world):
            mine = {g: (kind, [proc_now[r] for r in m]) for g, (kind, m) in self.groups.items() if roles_now[p] in m}
            out.append(profile_data(p, session, {g: k for g, (k, _) in mine.items()},
                                    {g: m for g, (_, m) in mine.items()}, calls.get(p, {})))
        return out

    def validation(self, session: int, plan: dict[str, Any], faults: tuple[Fault, ...]) -> tuple[list[ValidationResult], float]:
        """Every rank's ValidationResult for ``plan`` under ``faults``, and how long the
        benchmarks take (validate/suspension.py's steps: GEMM rounds, then P2P passes,
        ``validation_sweeps`` times, a barrier each)."""
        gpus, links = fault_maps(faults)
        gemm = [int(r) for r in plan.get("gemm", [])]
        n, reps = int(plan.get("gemm_n", 256)), int(plan.get("gemm_repeats", 10))
        nbytes, p2p_reps = int(plan.get("nbytes", 262144)), int(plan.get("repeats", 5))
        sweeps = int(plan.get("validation_sweeps", 1))
        flops = {r: HEALTHY_FLOPS / gpus.get(r, 1.0) * (1 + self.rng_bench.normal(0, 0.01)) for r in gemm}
        gemm_s = max((2 * n**3 * reps / f for f in flops.values()), default=0.0)
        got: dict[int, list[list[float]]] = {}
        pass_s = 0.0
        for pas in plan.get("passes", []):
            longest = 0.0
            # a node link carries the pass's transfers across it one after another
            ways = Counter((self.node_of[int(src)], self.node_of[int(dst)]) for src, dst in pas)
            for src, dst in pas:
                a, b = self.node_of[int(src)], self.node_of[int(dst)]
                if a == b:
                    sec = nbytes / INTRA_NODE_BPS + P2P_LATENCY_S
                else:
                    per_byte = 1 / INTER_NODE_BPS + links.get((min(a, b), max(a, b)), 0.0)
                    sec = ways[(a, b)] * nbytes * per_byte + P2P_LATENCY_S
                sec *= 1 + abs(self.rng_bench.normal(0, 0.02))
                got.setdefault(int(dst), []).append([int(src), int(dst), sec])
                longest = max(longest, sec)
            pass_s += p2p_reps * longest + BARRIER_S
        rounds = int(plan.get("gemm_rounds", 1)) if gemm else 0
        took = sweeps * (rounds * (gemm_s + BARRIER_S) + pass_s)
        return [validation_result(r, session, flops.get(r), got.get(r, [])) for r in range(self.job.world)], took

    # --- the loop ---------------------------------------------------------------------

    def suspend_here(self, faults: tuple[Fault, ...]) -> None:
        """Every rank is trapped at this iteration: held, wait for go (or release, or the
        deadline), validate, wait for the verdict (a validation whose plan says so: until
        "resume", "release" or ``verdict_wait_s``), agree on the action (the suspension's,
        or the one the resume brought), resume. The clock moves by the pause."""
        sus = self.suspension
        assert sus is not None
        world, session, t0 = self.job.world, sus["session"], self.t
        sus["held_at"] = t0
        self.post([held_ack(r, session, self.it, t0) for r in range(world)], t0)
        deadline = t0 + self.cfg.suspend_deadline_s
        now = t0
        while sus["go"] is None and sus["release"] is None and now < deadline:
            now = min(deadline, now + TICK_S, self.inbox[0][0] if self.inbox else math.inf)
            self.deliver(now)
        expired = sus["go"] is None and sus["release"] is None
        committed = False
        end = deadline if expired else (sus["release"] or sus["go"])
        if sus["go"] is not None and sus["release"] is None:
            plan = sus["plan"]
            if plan.get("gemm") or plan.get("passes"):
                results, took = self.validation(session, plan, faults)
                end = sus["go"] + took
                self.post(results, end)
                if sus["verdict_wait_s"] > 0 and sus["action"] is None:
                    until = end + sus["verdict_wait_s"]
                    now = end
                    while sus["resume"] is None and sus["release"] is None and now < until:
                        now = min(until, now + TICK_S, self.inbox[0][0] if self.inbox else math.inf)
                        self.deliver(now)
                    got = sus["resume"] if sus["release"] is None else None
                    end = (got or sus["release"] or until) + BARRIER_S  # the ranks' vote on the action
                    if got is not None and sus["resume_action"] is not None:
                        sus["action"] = sus["resume_action"]
                        committed = True
                        self.committed = (self.it + 1, sus["action"])
                    sus["voted"] = True
            if sus["action"] is not None and not sus.get("voted"):
                end += BARRIER_S
                committed = True
                self.committed = (self.it + 1, sus["action"])
        pause = end - t0
        self.post([resumed_ack(r, session, self.it, end, pause, expired, committed) for r in range(world)], end)
        validated = bool(sus["plan"].get("gemm") or sus["plan"].get("passes"))
        self.pauses.append((t0, "suspension" if validated or sus["action"] is None else "agreement", pause))
        self.suspension = None
        self.t = end
        self.deliver(self.t)

    def step(self) -> None:
        """One loop iteration of every rank."""
        lay = self.job.layout
        self.deliver(self.t)
        if self.committed is not None and self.committed[0] <= self.it:
            action = self.committed[1]
            self.committed = None
            self.state, cost, what, fresh = apply_action(self.job, self.state, action)
            if cost > 0:
                self.pauses.append((self.t, what, cost))
                self.t += cost
                self.starts.clear()  # the loop starts over after a restart or switch
                self.recent.clear()
            for p in fresh:
                self.ranks[p].restart()
                self.ranks[p].mb.clear()
            self.deliver(self.t)
        faults = active_faults(self.faults, self.t, self.state.replaced, lay.ranks_per_node)
        sus = self.suspension
        t_begin = self.t
        if sus is not None and self.ctl is not None and sus["iteration"] == self.it:
            self.suspend_here(faults)
        elif sus is not None and sus["iteration"] < self.it:
            self.post([missed_ack(r, sus["session"], self.it, self.t) for r in range(self.job.world)], self.t)
            self.suspension = None
        self.starts.append(t_begin)
        if self.ctl is not None:
            self.post(self.heartbeats(self.t), self.t)
        bd = self.models.breakdown(self.state.plan, faults, self.state.roles)
        dur = bd.total_s * math.exp(JOB_JITTER * self.rng_job.standard_normal())
        gpus, _ = fault_maps(faults)
        reads = np.exp(READ_JITTER * self.rng_rank.standard_normal(self.job.world))
        mbs = np.exp(MB_JITTER * self.rng_rank.standard_normal(self.job.world))
        t_end = self.t + dur
        whole = t_end - t_begin  # a pause in this iteration is part of its span
        self.times.append((t_end, whole))
        self.recent.append((len(self.times) - 1, self.t, t_end, bd, list(self.state.roles)))
        if self.ctl is not None:
            reports: list[FailSlowReport] = []
            for p, rk in enumerate(self.ranks):
                s = stage_of(lay, self.state.roles[p])
                rk.mb.append(self.job.costs.fwd_s[s] * gpus.get(p, 1.0) * float(mbs[p]))
                reports += self.detect(p, rk, whole * float(reads[p]), t_end)
            self.post(reports, t_end)
            # the controller is an event loop: it handles what arrives while the ranks
            # compute (heartbeats, profiles), not only at iteration boundaries
            self.deliver(t_end)
        self.t = t_end
        self.it += 1

    def detect(self, p: int, rk: _Rank, value: float, at: float) -> list[FailSlowReport]:
        """Feed rank ``p``'s reading of this iteration to its detector; the reports it
        sends (as runtime/monitor.py and runtime._on_event: the first sighting and the end
        of each event, not ladder steps), its detector's indices mapped to loop iterations."""
        rk.seen += 1
        if rk.seen <= self.cfg.tracking_warmup:
            return []
        rk.series.append(self.it)
        out = []
        for ev in rk.detector.feed(value):
            onset = rk.series[ev.onset] if ev.onset < len(rk.series) else self.it
            detected = rk.series[min(ev.detected_at, len(rk.series) - 1)]
            end = None if ev.end is None else rk.series[ev.end] if ev.end < len(rk.series) else self.it
            eid = rk.reports.event_id(rk.generation, ev.id)
            report = fail_slow_report(p, rk.reports.kind(eid, ev.end is not None), eid, onset, detected, ev.slowdown,
                                      ev.baseline, at, end)
            if report is not None:
                out.append(report)
        return out


def run(job: Job, faults: list[Fault], variant: Variant, iterations: int) -> RunResult:
    """Run ``iterations`` loop iterations of ``job`` under ``faults`` as ``variant`` says."""
    sim = _Sim(job, faults, variant)
    while sim.it < iterations:
        sim.step()
    return RunResult(variant.name, iterations, sim.t, sim.times, sim.pauses, sim.events)


def throughput(times: list[tuple[float, float]], bin_s: float, until: float) -> list[tuple[float, float]]:
    """Iterations per minute in the whole bins of ``bin_s`` seconds before ``until``:
    (bin centre, rate)."""
    bins = max(1, int(until // bin_s))
    counts = [0] * bins
    for t_end, _ in times:
        b = int(t_end // bin_s)
        if b < bins:
            counts[b] += 1
    return [((b + 0.5) * bin_s, counts[b] * 60.0 / bin_s) for b in range(bins)]


def fault_outcomes(faults: list[Fault], events: list[dict[str, Any]]) -> list[str]:
    """Per fault, whether the controller localized it while it lasted (and when), one line each."""
    out = []
    for f in faults:
        if f.kind == "compute":
            what, named, where = f"GPU {f.rank} x{f.factor:g}", f.rank, "gpus"
        else:
            a, b = f.nodes or (-1, -1)
            what, named, where = f"link {a}-{b}", [min(a, b), max(a, b)], "links"
        hit = next((e["t"] for e in events if e.get("type") == "localized" and f.active(e["t"]) and named in e[where]),
                   None)
        when = f"{f.start:.0f}-{f.end:.0f} s" if f.end is not None else f"from {f.start:.0f} s"
        out.append(f"{what} ({when}): " + (f"localized at t={hit:.0f} s" if hit is not None else "never localized"))
    return out


def story(events: list[dict[str, Any]]) -> list[str]:
    """The controller's events that tell what it did, one short line each."""
    out = []
    for e in events:
        kind = e.get("type")
        if kind == "localized":
            out.append(f"t={e['t']:.0f}s it={e['loop_iteration']}: localized gpus {e['gpus']} links {e['links']}")
        elif kind == "mitigation":
            out.append(f"t={e['t']:.0f}s: {e['strategy']} applied from iteration {e['iteration']}")
        elif kind in ("mitigation_failed", "localization_failed"):
            out.append(f"t={e['t']:.0f}s: {kind} {e.get('strategy', '')} ({e.get('reason', '')})")
        elif kind == "episode_end":
            out.append(f"t={e['t']:.0f}s: episode ended" + (f" ({e['reason']})" if e.get("reason") else ""))
    return out
