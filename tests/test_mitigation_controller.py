"""Mitigation in the controller: scripted fail-slows on a 4-rank DP job (no Redis, no clock).

Ranks are the DP replicas (replica r = rank r), node = rank // 2. Rank 1 is the
compute straggler: 0.1 s per micro-batch against 0.05 s for the others. The healthy
iteration time is 0.25 s and the slow one 0.5 s, so every slow iteration adds exactly
0.25 s of impact (binary-exact), and the last validation suspension paused 0.9 s, which
makes S2's measured overhead 0.9 s + the solver's time (microseconds).
"""

from __future__ import annotations

import dataclasses

import pytest

from falconext.config import FalconConfig
from falconext.control.controller import Controller, State
from falconext.protocol.actions import MicrobatchPlan
from falconext.protocol.commands import MitigateRequest, Suspend, ValidateRequest
from falconext.protocol.messages import FailSlowReport, Heartbeat, SessionAck, ValidationResult
from falconext.mitigate.microbatch import plan_microbatches
from falconext.mitigate.mitigation import cap_by_gemm
from test_controller import commands, events, profile

NODES = {0: 0, 1: 0, 2: 1, 3: 1}
HEALTHY = 0.25
SLOW = 0.5
PAUSE = 0.9  # the validation suspension's longest pause: S2's overhead (+ solve)
ONSET = 58  # the first iteration fed to the planner after localization
FAST_MB, SLOW_MB = 0.05, 0.1
EVEN = [4, 4, 4, 4]
TOTAL = 16

# settle 2, judge 3: a strategy applied at iteration E is judged at E + 2 + 3
CFG = FalconConfig(mitigation_settle_iterations=2, mitigation_judge_iterations=3, link_baseline_iteration=0)

#: run first, before any job runs ahead (conftest.py: RUN_FIRST):
#: it times the controller's rounds on the wall clock
RUN_FIRST = True


class Job:
    """Four DP ranks that send heartbeats one iteration at a time, with an explicit clock."""

    def __init__(self, cfg: FalconConfig = CFG, restart_s: float = 0.0, mb: list[float] | None = None) -> None:
        self.ctl = Controller(cfg, world=4)
        self.t = 100.0
        self.it = 50
        self.iter_s = SLOW
        self.mb = list(mb) if mb is not None else [FAST_MB, SLOW_MB, FAST_MB, FAST_MB]
        self.micro = list(EVEN)
        self.restart_s = [restart_s] * 4

    def beat(self, iteration: int | None = None) -> list:
        """Every rank's heartbeat for one iteration; rank 0 (the planner's feed) last."""
        if iteration is not None:
            self.it = iteration
        outs = []
        for r in (3, 2, 1, 0):
            hb = Heartbeat(r, NODES[r], self.it, self.iter_s, self.t, replica=r, mb_s=self.mb[r],
                           micro=self.micro[r], restart_s=self.restart_s[r])
            outs += self.ctl.handle(hb, self.t)
        return outs

    def advance(self, n: int = 1) -> list:
        """n more iterations of heartbeats."""
        outs = []
        for _ in range(n):
            self.it += 1
            self.t += self.iter_s
            outs += self.beat()
        return outs

    def localize(self) -> list:
        """fail_slow report -> profile -> validate -> localized [1]; then the validation
        suspension's resumed acks (pause PAUSE); the next heartbeat is iteration ONSET."""
        ctl = self.ctl
        self.beat()
        outs = ctl.handle(FailSlowReport(1, ONSET, ONSET + 3, 2.0, HEALTHY, self.t, event_id=7), self.t)
        assert ctl.state is State.PROFILING
        for r in NODES:
            outs += ctl.handle(profile(r, ctl.session, late_rank=1), self.t + 0.2)
        (sus,) = commands(outs, "suspend")
        s = sus.session
        for r in NODES:
            outs += ctl.handle(SessionAck(r, s, "held", sus.iteration, self.t + 0.5), self.t + 0.5)
        for r in NODES:
            outs += ctl.handle(ValidationResult(r, s, 5e9 if r == 1 else 1e10, []), self.t + 1.0)
        (loc,) = events(outs, "localized")
        assert loc["gpus"] == [1]
        (started,) = events(outs, "planner_started")
        assert started["root_cause"] == "computation" and started["healthy_s"] == HEALTHY
        assert started["onset"] == ONSET
        for r in NODES:
            outs += ctl.handle(SessionAck(r, s, "resumed", sus.iteration, self.t + 1.5, pause_s=PAUSE - 0.1 * r),
                               self.t + 1.5)
        assert ctl.state is State.TRACKING
        self.t += 2.0
        self.it = ONSET - 1
        return outs

    def run_until(self, type_: str, limit: int = 60) -> tuple[list, int]:
        """Iterate until an event of ``type_`` comes out; returns (outs of that iteration, it)."""
        for _ in range(limit):
            out = self.advance()
            if events(out, type_):
                return out, self.it
        raise AssertionError(f"no {type_} event within {limit} iterations (at {self.it})")

    def hold_all(self, sus: Suspend, ranks=(0, 1, 2, 3)) -> list:
        outs = []
        for r in ranks:
            outs += self.ctl.handle(SessionAck(r, sus.session, "held", sus.iteration, self.t), self.t)
        return outs

    def resume_all(self, sus: Suspend, committed=(True, True, True, True), pause: float = 0.3,
                   ranks=tuple(NODES)) -> list:
        outs = []
        for r in ranks:
            ack = SessionAck(r, sus.session, "resumed", sus.iteration, self.t + pause,
                             pause_s=pause - 0.05 * r, committed=committed[r])
            outs += self.ctl.handle(ack, self.t + pause)
        return outs

    def apply(self, sus: Suspend) -> list:
        """The suspension goes through: everyone held, go, everyone resumed and committed."""
        outs = self.hold_all(sus)
        assert len(commands(outs, "go")) == 1
        outs += self.resume_all(sus)
        self.it = sus.iteration
        return outs


def s2_decided(job: Job) -> tuple[list, Suspend]:
    job.localize()
    out, it = job.run_until("mitigation_decision")
    (sus,) = commands(out, "suspend")
    return out, sus


def decisions(outs):
    return events(outs, "mitigation_decision")


# --- 1. compute straggler: S2 ----------------------------------------------------------


def test_s2_caps_an_inflated_forward_time_by_the_validated_gemm_slowdown():
    """Rank 1 is 2x slow by its GEMM, but its forwards read 2.6x (a shared host stretches
    them twice): S2 plans for 2x, and records what was measured."""
    job = Job(mb=[FAST_MB, 2.6 * FAST_MB, FAST_MB, FAST_MB])
    out, sus = s2_decided(job)
    action = sus.action
    assert action.measured_mb_s == [FAST_MB, 2.6 * FAST_MB, FAST_MB, FAST_MB]
    assert action.replica_mb_s == pytest.approx([FAST_MB, 2 * FAST_MB, FAST_MB, FAST_MB])
    assert action.plan == plan_microbatches([FAST_MB, 2 * FAST_MB, FAST_MB, FAST_MB], TOTAL)
    assert action.plan != plan_microbatches([FAST_MB, 2.6 * FAST_MB, FAST_MB, FAST_MB], TOTAL)


def test_cap_by_gemm_keeps_the_smaller_reading():
    assert cap_by_gemm([1.0, 3.0, 1.2], {1: 2.0}) == [1.0, 2.2, 1.2]  # healthy median 1.1
    assert cap_by_gemm([1.0, 1.5, 1.0], {1: 2.0}) == [1.0, 1.5, 1.0]  # suffers less than the GEMM
    assert cap_by_gemm([2.0, 3.0], {0: 2.0, 1: 2.0}) == [2.0, 3.0]  # no healthy replica to scale


def test_s2_is_decided_when_impact_crosses_the_overhead_and_applied_at_the_next_iteration():
    job = Job()
    job.localize()
    ctl = job.ctl
    # impact: 0.25 per slow iteration from ONSET on; S2 costs 0.9 s + solve: 4 iterations
    for _ in range(3):
        out = job.advance()
        assert not decisions(out) and not commands(out), f"decided too early at {job.it}"
    assert ctl.episode.mitigation.planner.impact_s == pytest.approx(0.75)
    out = job.advance()
    (dec,) = decisions(out)
    assert job.it == ONSET + 3 and dec["iteration"] == ONSET + 3
    assert dec["strategy"] == "S2" and dec["action"] == "apply" and dec["trigger"] == "planner"
    assert dec["impact_s"] == pytest.approx(1.0)
    assert PAUSE <= dec["overhead_s"] < 1.0  # the measured pause (+ a solve of microseconds)
    assert ctl.state is State.MITIGATING
    (sus,) = commands(out, "suspend")
    k = sus.iteration
    assert k > job.it  # an iteration no rank has started yet
    action = sus.action
    assert action.KIND == "microbatches" and action.strategy == "S2"
    assert action.session == sus.session == ctl.session
    assert action.replica_mb_s == [FAST_MB, SLOW_MB, FAST_MB, FAST_MB]
    plan = action.plan
    assert sum(plan) == TOTAL and len(plan) == 4 and all(m >= 1 for m in plan)
    assert plan[1] < 4 and min(plan) == plan[1]  # the straggler gets the fewest
    assert plan == plan_microbatches([FAST_MB, SLOW_MB, FAST_MB, FAST_MB], TOTAL)

    # heartbeats while the suspension is pending decide nothing more
    out = job.advance(2)
    assert not decisions(out) and not commands(out)

    # go only once every rank holds
    out = job.hold_all(sus, ranks=(0, 1, 2))
    assert not commands(out, "go")
    out = job.hold_all(sus, ranks=(3,))
    (go,) = commands(out, "go")
    assert go.session == sus.session
    assert events(out, "suspended")
    assert ctl.state is State.MITIGATING

    out = job.resume_all(sus, pause=0.3)
    (mit,) = events(out, "mitigation")
    assert mit["strategy"] == "S2" and mit["trigger"] == "planner"
    assert mit["iteration"] == k + 1
    assert mit["plan"] == plan and mit["replica_mb_s"] == [FAST_MB, SLOW_MB, FAST_MB, FAST_MB]
    assert mit["pause_s"] == 0.3  # the longest pause of the ranks
    solve_s = ctl.episode.mitigation.solve_s  # the real QP's time, on the wall clock
    assert 0 < solve_s and mit["overhead_s"] == pytest.approx(0.3 + solve_s, abs=1e-4)  # pause + solve
    assert ctl.state is State.TRACKING
    planner = ctl.episode.mitigation.planner
    assert planner.current == "S2" and planner.pending() is None
    assert ctl.episode.mitigation.applied == [{"strategy": "S2", "iteration": k + 1}]
    assert not events(out, "mitigation_failed") and not events(out, "episode_end")


# --- 2. escalation to S4 ---------------------------------------------------------------


def _s2_applied(job: Job) -> int:
    """Localize, decide and apply S2; returns the iteration it took effect."""
    _, sus = s2_decided(job)
    out = job.apply(sus)
    (mit,) = events(out, "mitigation")
    job.micro = mit["plan"]
    return mit["iteration"]


def _validate_held(job: Job, it: int = 70) -> tuple[list, Suspend]:
    """A report (onset ONSET) while the ranks are at iteration ``it``, profiling, and the
    validation up to the verdict: every rank held, GEMMs reported, no resumed ack yet (the
    ranks wait for the verdict)."""
    ctl = job.ctl
    job.beat(it)
    outs = ctl.handle(FailSlowReport(1, ONSET, ONSET + 3, 2.0, HEALTHY, job.t, event_id=7), job.t)
    for r in NODES:
        outs += ctl.handle(profile(r, ctl.session, late_rank=1), job.t + 0.2)
    (sus,) = commands(outs, "suspend")
    outs += job.hold_all(sus)
    for r in NODES:
        outs += ctl.handle(ValidationResult(r, sus.session, 5e9 if r == 1 else 1e10, []), job.t + 1.0)
    return outs, sus


def test_s2_decided_with_the_verdict_travels_with_the_resume_and_applies_after_the_hold():
    """Twelve slow iterations since the onset when GPU 1 is named: the planner decides S2 at
    once, while the ranks are held for the verdict, and the plan goes with the "resume":
    every rank applies it from the iteration after the validation's, no second suspension
    (which would have cost table7 two more slow iterations per fault)."""
    job = Job()
    out, sus = _validate_held(job)
    assert sus.validation.verdict_wait_s == CFG.suspend_verdict_wait_s > 0
    (loc,) = events(out, "localized")
    (dec,) = decisions(out)
    assert loc["gpus"] == [1] and (dec["action"], dec["strategy"]) == ("apply", "S2")
    (resume,) = commands(out, "resume")
    assert resume.session == sus.session and resume.action.KIND == "microbatches"
    assert resume.action.plan == plan_microbatches([FAST_MB, SLOW_MB, FAST_MB, FAST_MB], TOTAL)
    assert resume.action.session == sus.session
    assert len(commands(out, "suspend")) == 1 and job.ctl.state is State.MITIGATING
    out = job.resume_all(sus, pause=1.2)
    (mit,) = events(out, "mitigation")
    assert mit["strategy"] == "S2" and mit["iteration"] == sus.iteration + 1 and mit["session"] == sus.session
    assert job.ctl.state is State.TRACKING and not commands(out)
    planner = job.ctl.episode.mitigation.planner
    assert planner.current == "S2" and planner.pending() is None


def test_an_action_with_the_verdict_that_no_rank_committed_is_agreed_on_in_its_own_suspension():
    """A rank's wait for the verdict ran out before the resume came: the ranks' vote applied
    it nowhere. S2 did not fail (the hold was over): the same plan gets a suspension of its
    own, and is applied from there."""
    job = Job()
    out, sus = _validate_held(job)
    (resume,) = commands(out, "resume")
    out = job.resume_all(sus, committed=(False,) * 4)
    (retry,) = events(out, "mitigation_retry")
    assert retry["strategy"] == "S2" and not events(out, "mitigation_failed")
    (again,) = commands(out, "suspend")
    assert again.action.plan == resume.action.plan and again.session > sus.session
    assert job.ctl.episode.mitigation.planner.pending() == "S2"
    out = job.apply(again)
    (mit,) = events(out, "mitigation")
    assert mit["strategy"] == "S2" and mit["iteration"] == again.iteration + 1


def test_ranks_that_resumed_before_the_verdict_get_the_action_in_a_suspension_of_its_own():
    """The resumed acks came before the verdict (the ranks' wait ran out): nothing can travel
    with a resume any more; the planner decides at the next heartbeat and the action takes
    the agreement path."""
    job = Job()
    job.beat(70)
    ctl = job.ctl
    out = ctl.handle(FailSlowReport(1, ONSET, ONSET + 3, 2.0, HEALTHY, job.t, event_id=7), job.t)
    for r in NODES:
        out += ctl.handle(profile(r, ctl.session, late_rank=1), job.t + 0.2)
    (sus,) = commands(out, "suspend")
    job.hold_all(sus)
    for r in NODES:  # the results of rank 0 are late
        if r:
            ctl.handle(ValidationResult(r, sus.session, 5e9 if r == 1 else 1e10, []), job.t + 1.0)
    job.resume_all(sus)
    out = ctl.handle(ValidationResult(0, sus.session, 1e10, []), job.t + 3.0)
    assert events(out, "localized") and not commands(out, "resume") and not decisions(out)
    job.it = 70
    out = job.advance()  # the next heartbeat: the planner decides, as before the hold path
    (dec,) = decisions(out)
    (again,) = commands(out, "suspend")
    assert dec["strategy"] == "S2" and again.action.KIND == "microbatches" and again.session > sus.session


def test_without_a_verdict_wait_the_ranks_resume_after_validating():
    """suspend_verdict_wait_s 0, and an operator's validation (nothing to mitigate): the
    ranks are not held for the verdict and no resume is sent."""
    job = Job(cfg=CFG.replace(suspend_verdict_wait_s=0.0))
    out, sus = _validate_held(job)
    assert sus.validation.verdict_wait_s == 0.0 and not commands(out, "resume")
    ctl = Controller(CFG, world=4)
    for r in NODES:
        ctl.handle(Heartbeat(r, NODES[r], 50, SLOW, 100.0, replica=r, mb_s=FAST_MB, micro=4), 100.0)
    out = ctl.handle(ValidateRequest(), 100.0)
    for r in NODES:
        out += ctl.handle(profile(r, ctl.session, late_rank=1), 100.2)
    (sus,) = commands(out, "suspend")
    assert sus.validation.verdict_wait_s == 0.0


def test_s2_not_enough_escalates_to_s4_only_after_s2_was_judged():
    # a restart costs 2 s: impact passes that while S2 is still settling
    job = Job(restart_s=2.0)
    effective = _s2_applied(job)
    seen = job.advance()  # the first iteration under S2 (it makes up for the suspended ones)
    assert job.it == effective
    planner = job.ctl.episode.mitigation.planner
    assert planner.impact_s >= 2.0  # S4 would already be due by impact alone
    judged_at = effective + CFG.mitigation_settle_iterations + CFG.mitigation_judge_iterations
    while job.it < judged_at - 1:
        seen += job.advance()
    assert not decisions(seen) and not commands(seen), "escalated before S2 was judged"
    out = job.advance()
    assert job.it == judged_at
    (dec,) = decisions(out)
    assert dec["strategy"] == "S4" and dec["iteration"] == judged_at
    assert "S2 judged not enough" in dec["reason"]
    assert dec["overhead_s"] == 2.0
    (sus,) = commands(out, "suspend")
    action = sus.action
    assert action.KIND == "restart" and action.strategy == "S4"
    assert action.exclude_nodes == [0]  # rank 1 lives on node 0
    assert job.ctl.state is State.MITIGATING

    out = job.apply(sus)
    (mit,) = events(out, "mitigation")
    assert mit["strategy"] == "S4" and mit["exclude_nodes"] == [0] and mit["iteration"] == sus.iteration + 1
    (end,) = events(out, "episode_end")
    assert end["reason"] == "restart"
    assert job.ctl.episode is None and job.ctl.state is State.TRACKING
    assert events(out, "controller_state")[-1]["new"] == "tracking"
    # the restart is the mitigation in force now: the status (ctl status, the metrics) keeps
    # serving its share of the slowdown (issue 52: it went blank with the episode), and counts it
    healthy = job.ctl.snapshot(job.t).planner["healthy_s"]
    job.iter_s = healthy  # the ranks back at the healthy speed after the restart
    job.advance(3)
    planner = job.ctl.snapshot(job.t).planner
    assert planner["current"] == "S4" and planner["restarts"] == 1, planner
    assert planner["slowdown_removed"] == pytest.approx(1.0, abs=1e-3), planner


def test_s4_waits_for_the_impact_to_reach_the_restart_cost():
    job = Job(restart_s=6.0)
    effective = _s2_applied(job)
    judged_at = effective + CFG.mitigation_settle_iterations + CFG.mitigation_judge_iterations
    out, it = job.run_until("mitigation_decision")
    planner = job.ctl.episode.mitigation.planner
    (dec,) = decisions(out)
    assert dec["strategy"] == "S4" and it > judged_at
    assert dec["impact_s"] >= 6.0 > dec["impact_s"] - (SLOW - HEALTHY)  # the first iteration past it
    assert planner.status()["judged"][0]["enough"] is False


def test_s4_needs_a_restart_cost_from_every_rank():
    job = Job(restart_s=2.0)
    job.restart_s[3] = 0.0  # one rank has not measured its restart yet
    effective = _s2_applied(job)
    out = job.advance(40)
    assert not decisions(out)
    assert job.ctl.episode.mitigation.planner.status()["candidates"][-1] == {
        "strategy": "S4", "overhead_s": None, "state": "unavailable"}
    job.restart_s[3] = 3.0  # now it has: the cost is the largest of the ranks'
    out = job.advance()
    (dec,) = decisions(out)
    assert dec["strategy"] == "S4" and dec["overhead_s"] == 3.0
    assert job.it > effective


def test_with_only_s2_allowed_s4_never_comes():
    job = Job(cfg=CFG.replace(mitigation_strategies="S2"), restart_s=2.0)
    _s2_applied(job)
    out = job.advance(80)
    assert not decisions(out) and not commands(out)
    planner = job.ctl.episode.mitigation.planner
    assert planner.impact_s > 20.0  # ten times what a restart costs
    assert planner.current == "S2" and not planner.finished
    states = {c["strategy"]: c["state"] for c in planner.status()["candidates"]}
    assert states == {"S2": "applied", "S3": "unavailable", "S4": "unavailable"}


# --- 3. recovery under S2 --------------------------------------------------------------


def test_recovery_under_s2_reverts_to_the_even_plan_once_and_closes_the_episode():
    job = Job()
    effective = _s2_applied(job)
    ctl = job.ctl
    job.iter_s = HEALTHY  # S2 hides the straggler in the iteration time
    job.it = effective - 1
    out = job.advance(3)
    assert not events(out, "fail_slow_recovered")  # still slow per micro-batch
    # recovered for two iterations, slow again: the streak starts over
    job.mb[1] = FAST_MB * 1.05
    out = job.advance(2)
    job.mb[1] = SLOW_MB
    out += job.advance()
    assert not events(out, "fail_slow_recovered") and not decisions(out)
    # recovered for good: judged over judge_iterations iterations after the first
    job.mb[1] = FAST_MB * 1.05
    first = job.it + 1
    out = job.advance(CFG.mitigation_judge_iterations)
    assert not events(out, "fail_slow_recovered"), "recovered before judge_iterations iterations"
    out = job.advance()
    (rec,) = events(out, "fail_slow_recovered")
    assert rec["iteration"] == first + CFG.mitigation_judge_iterations == job.it
    assert rec["replica_mb_s"] == [FAST_MB, FAST_MB * 1.05, FAST_MB, FAST_MB]
    (dec,) = decisions(out)
    assert dec["action"] == "revert" and dec["strategy"] == "S2"
    (sus,) = commands(out, "suspend")
    action = sus.action
    assert action.KIND == "microbatches" and action.strategy == "revert"
    assert action.plan == EVEN
    assert ctl.state is State.MITIGATING and ctl.episode is not None  # open until it is applied

    out = job.apply(sus)
    (mit,) = events(out, "mitigation")
    assert mit["strategy"] == "revert" and mit["plan"] == EVEN and mit["iteration"] == sus.iteration + 1
    assert events(out, "episode_end")
    assert ctl.episode is None and ctl.state is State.TRACKING
    job.micro = list(EVEN)

    # the straggler is back: no new decision from the old episode (no flapping)
    job.mb[1], job.iter_s = SLOW_MB, SLOW
    out = job.advance(40)
    assert not decisions(out) and not commands(out) and not events(out, "mitigation")
    # a new fail-slow is a new episode
    out = ctl.handle(FailSlowReport(1, job.it - 3, job.it, 2.0, HEALTHY, job.t, event_id=8), job.t)
    assert commands(out, "profile") and ctl.state is State.PROFILING


# judged over 8 iterations, but 2 fresh readings of the GPU's own compute are enough
OWN = CFG.replace(mitigation_judge_iterations=8, mitigation_recovered_beats=2)


def _clean_before(job: Job) -> None:
    """Iteration 48: rank 1 still computed as fast as the others (the fault came after):
    its own reference, in the detectors' confirmation window before the onset (58)."""
    job.mb[1] = FAST_MB
    job.beat(48)
    job.mb[1] = SLOW_MB
    job.it = 50


def test_s2_reverts_once_the_gpu_computes_as_before_the_onset_in_a_few_fresh_readings():
    """The slow GPU's compute per micro-batch back within 10% of its own before the onset
    in mitigation_recovered_beats readings in a row reverts S2, well before the replicas
    would have been judged (judge_iterations); a heartbeat that repeats an iteration is
    not a fresh reading."""
    job = Job(cfg=OWN)
    _clean_before(job)
    effective = _s2_applied(job)
    job.iter_s = HEALTHY
    job.it = effective - 1
    out = job.advance(3)
    assert not events(out, "fail_slow_recovered")  # still twice as slow per micro-batch
    job.mb[1] = FAST_MB * 1.08  # back within the jitter line of its own 0.05 s
    out = job.advance()
    first = job.it
    # rank 1's heartbeat stalls at that iteration while rank 0 goes on: one reading, not two
    r1 = job.ctl.beats[1]
    job.it += 1
    job.t += HEALTHY
    for r in (3, 2, 0):
        b = job.ctl.beats[r]
        out += job.ctl.handle(dataclasses.replace(b, iteration=job.it, time=job.t), job.t)
    assert job.ctl.beats[1] is r1 and not events(out, "fail_slow_recovered")
    out = job.advance()
    (rec,) = events(out, "fail_slow_recovered")
    assert rec["rule"] == "own compute" and rec["readings"] == OWN.mitigation_recovered_beats
    assert rec["iteration"] == job.it == first + 2 < first + OWN.mitigation_judge_iterations
    assert rec["before_mb_s"] == {"1": FAST_MB}
    (dec,) = decisions(out)
    assert dec["action"] == "revert" and dec["strategy"] == "S2"
    (sus,) = commands(out, "suspend")
    assert sus.action.plan == EVEN


def test_own_compute_recovery_needs_consecutive_readings_under_the_line():
    """No revert on noise: readings that dip under the line one at a time, or sit just over
    it (1.15x its own), never make the count; the replicas' rule (judge_iterations) is not
    used while the GPU has its own reference."""
    job = Job(cfg=OWN)
    _clean_before(job)
    effective = _s2_applied(job)
    job.iter_s = HEALTHY
    job.it = effective - 1
    out = []
    for k in range(12):
        job.mb[1] = FAST_MB * (1.02 if k % 2 else 1.6)
        out += job.advance()
    job.mb[1] = FAST_MB * 1.15  # within mitigation_enough_margin of nobody, over the 10% line
    out += job.advance(OWN.mitigation_judge_iterations + 4)
    assert not events(out, "fail_slow_recovered") and not decisions(out)
    job.mb[1] = FAST_MB
    out = job.advance(OWN.mitigation_recovered_beats)
    (rec,) = events(out, "fail_slow_recovered")
    assert rec["rule"] == "own compute"


def test_without_its_own_clean_reading_the_replicas_are_judged():
    """The reference read before the onset already carried the fault (no rise against it):
    it is not a reference, and recovery is judged on the replicas over judge_iterations."""
    job = Job(cfg=OWN)  # rank 1 slow in every heartbeat the controller has
    effective = _s2_applied(job)
    assert job.ctl.episode.mitigation.recovery_refs == {}
    job.iter_s = HEALTHY
    job.it = effective - 1
    job.mb[1] = FAST_MB
    first = job.it + 1
    out = job.advance(OWN.mitigation_judge_iterations)
    assert not events(out, "fail_slow_recovered")
    out = job.advance()
    (rec,) = events(out, "fail_slow_recovered")
    assert rec["rule"] == "replicas" and rec["iteration"] == first + OWN.mitigation_judge_iterations


def test_a_recovery_during_the_s2_suspension_is_judged_once_s2_is_in_effect():
    job = Job()
    _, sus = s2_decided(job)
    job.mb[1] = FAST_MB  # recovers during the suspension: no recovery check while in flight
    out = job.advance(CFG.mitigation_judge_iterations + 2)
    assert not events(out, "fail_slow_recovered")
    out = job.apply(sus)
    (mit,) = events(out, "mitigation")
    assert mit["strategy"] == "S2"
    job.micro = mit["plan"]
    job.it = mit["iteration"] - 1
    out, _ = job.run_until("fail_slow_recovered")
    (sus2,) = commands(out, "suspend")
    assert sus2.action.strategy == "revert"
    assert sus2.action.plan == EVEN


# --- 4. suspensions that do not go through ---------------------------------------------


def test_a_rank_that_does_not_commit_fails_the_mitigation():
    job = Job()
    _, sus = s2_decided(job)
    ctl = job.ctl
    out = job.hold_all(sus)
    assert commands(out, "go")
    out = job.resume_all(sus, committed=(True, True, False, True))
    assert not events(out, "mitigation")
    (fail,) = events(out, "mitigation_failed")
    assert fail["strategy"] == "S2" and fail["reason"] == "not every rank committed the action"
    assert ctl.state is State.TRACKING
    planner = ctl.episode.mitigation.planner
    assert planner.current == "S1" and planner.pending() is None
    assert "S2" in planner.status()["failed"]
    # S2 is not asked for again
    out = job.advance(30)
    assert not decisions(out) and not commands(out)


def test_a_lost_resumed_ack_does_not_fail_an_action_every_rank_committed():
    """Commits are all or nothing (a barrier every rank enters), so the ranks that were
    heard committing speak for the one whose "resumed" was lost (chaos mode lost one and
    the controller called an applied S2 a failure)."""
    job = Job()
    _, sus = s2_decided(job)
    ctl = job.ctl
    job.hold_all(sus)
    out = job.resume_all(sus, ranks=(0, 1, 3))
    assert not events(out, "mitigation") and ctl.state is State.MITIGATING
    out = ctl.tick(job.t + 1e4)
    assert not events(out, "mitigation_failed")
    (mit,) = events(out, "mitigation")
    assert mit["strategy"] == "S2" and mit["acks_lost"] == [2]
    assert ctl.state is State.TRACKING


def test_a_suspension_past_its_deadline_releases_everyone_and_fails():
    job = Job()
    _, sus = s2_decided(job)
    ctl = job.ctl
    job.hold_all(sus, ranks=(0, 1))
    assert ctl.tick(job.t + 0.1) == []
    out = ctl.tick(job.t + 1e4)
    (rel,) = commands(out, "release")
    assert rel.session == sus.session
    (fail,) = events(out, "mitigation_failed")
    assert fail["reason"] == "timed out" and fail["strategy"] == "S2"
    assert not events(out, "mitigation") and ctl.state is State.TRACKING
    assert "S2" in ctl.episode.mitigation.planner.status()["failed"]
    # acks of the dead session change nothing
    assert not events(job.resume_all(sus), "mitigation")


def test_a_rank_that_missed_the_iteration_gets_a_retry_with_a_new_session():
    job = Job()
    _, sus = s2_decided(job)
    ctl = job.ctl
    s, k = sus.session, sus.iteration
    ctl.handle(SessionAck(0, s, "held", k, job.t), job.t)
    out = ctl.handle(SessionAck(2, s, "missed", k + 1, job.t), job.t)
    (rel,) = commands(out, "release")
    assert rel.session == s
    (missed,) = events(out, "suspend_missed")
    assert missed["rank"] == 2 and missed["at"] == k + 1
    (again,) = commands(out, "suspend")
    assert again.session == s + 1 and again.iteration > k
    assert again.action.plan == sus.action.plan
    assert ctl.state is State.MITIGATING and not events(out, "mitigation_failed")
    # a stale ack of the old session is ignored
    assert ctl.handle(SessionAck(1, s, "held", k, job.t), job.t) == []
    out = job.apply(again)
    (mit,) = events(out, "mitigation")
    assert mit["session"] == s + 1 and mit["iteration"] == again.iteration + 1


def test_the_retried_action_carries_the_retry_session():
    job = Job()
    _, sus = s2_decided(job)
    s, k = sus.session, sus.iteration
    out = job.ctl.handle(SessionAck(2, s, "missed", k + 1, job.t), job.t)
    (again,) = commands(out, "suspend")
    assert again.action.session == again.session


def test_a_rank_that_keeps_missing_fails_the_mitigation():
    job = Job()
    _, sus = s2_decided(job)
    ctl = job.ctl
    for attempt in range(1, FalconConfig().suspend_tries + 1):
        s, k = ctl.session, ctl.suspension.iteration
        out = ctl.handle(SessionAck(3, s, "missed", k + 1, job.t), job.t)
        assert commands(out, "release")
        if attempt < FalconConfig().suspend_tries:
            assert commands(out, "suspend") and ctl.state is State.MITIGATING
        else:
            assert not commands(out, "suspend")
            (fail,) = events(out, "mitigation_failed")
            assert fail["reason"] == "timed out"
            assert ctl.state is State.TRACKING
            assert not events(out, "mitigation")


# --- 5. operator "mitigate" -------------------------------------------------------------


def _operator_job() -> Job:
    job = Job()
    job.beat()
    return job


def mitigate(job: Job, **args) -> list:
    return job.ctl.handle(MitigateRequest(**args), job.t)


def test_operator_s2_with_an_explicit_plan_suspends_with_that_plan():
    job = _operator_job()
    ctl = job.ctl
    out = mitigate(job, strategy="S2", plan=[6, 2, 4, 4])
    (ev,) = events(out, "operator_mitigate")
    assert ev["strategy"] == "S2"
    (sus,) = commands(out, "suspend")
    assert sus.action == MicrobatchPlan("S2", [6, 2, 4, 4], session=sus.session)
    assert ctl.state is State.MITIGATING
    # busy: a second request is ignored
    (ign,) = events(mitigate(job, strategy="S2", plan=[4, 4, 4, 4]), "operator_ignored")
    assert ign["reason"] == "busy (mitigating)"
    (ign,) = events(ctl.handle(ValidateRequest(), job.t), "operator_ignored")
    assert "busy" in ign["reason"]
    out = job.apply(sus)
    (mit,) = events(out, "mitigation")
    assert mit["trigger"] == "operator" and mit["plan"] == [6, 2, 4, 4] and mit["strategy"] == "S2"
    assert mit["impact_s"] is None and mit["iteration"] == sus.iteration + 1
    assert ctl.state is State.TRACKING and ctl.episode is None


def test_operator_s2_without_a_plan_balances_and_revert_evens():
    job = _operator_job()
    out = mitigate(job, strategy="S2")
    (sus,) = commands(out, "suspend")
    assert sus.action.plan == [5, 2, 5, 4]
    job.apply(sus)
    job.micro = [5, 2, 5, 4]
    job.advance()
    out = mitigate(job, strategy="revert")
    (sus,) = commands(out, "suspend")
    assert sus.action.strategy == "revert"
    assert sus.action.plan == EVEN


@pytest.mark.parametrize("plan", [
    [4, 4, 4],          # wrong length
    [4, 4, 4, 4, 0],    # wrong length
    [5, 5, 5, 5],       # wrong sum
    [0, 6, 5, 5],       # a replica with none
    [-1, 7, 5, 5],      # negative
    [True, 5, 5, 5],    # bool is not a count (True + 15 == 16)
    [4.0, 4, 4, 4],     # not an int
    "4,4,4,4",          # not a list
    {"0": 4},           # not a list
])
def test_operator_invalid_plans_are_ignored_naming_the_problem(plan):
    job = _operator_job()
    ctl = job.ctl
    session = ctl.session
    out = mitigate(job, strategy="S2", plan=plan)
    assert not commands(out)
    (ign,) = events(out, "operator_ignored")
    assert repr(plan) in ign["reason"]
    assert "4 replicas >= 1 each" in ign["reason"] and f"{TOTAL} in all" in ign["reason"]
    assert ctl.state is State.TRACKING and ctl.session == session


@pytest.mark.parametrize("strategy", ["S5", "S1", "s2", None, 2])
def test_operator_unknown_strategy_is_ignored(strategy):
    job = _operator_job()
    out = mitigate(job, strategy=strategy)
    assert not commands(out)
    (ign,) = events(out, "operator_ignored")
    assert ign["reason"] == f"unknown strategy {strategy!r} (S2, S3, S4 or revert)"
    assert job.ctl.state is State.TRACKING


def test_operator_s2_before_any_heartbeat_is_ignored():
    ctl = Controller(CFG, world=4)
    (ign,) = events(ctl.handle(MitigateRequest("S2"), 1.0), "operator_ignored")
    assert "replica layout" in ign["reason"]
    assert ctl.state is State.TRACKING


def test_operator_mitigate_while_localizing_is_ignored():
    job = Job()
    job.beat()
    job.ctl.handle(FailSlowReport(1, ONSET, ONSET + 3, 2.0, HEALTHY, job.t, event_id=7), job.t)
    (ign,) = events(mitigate(job, strategy="S4", exclude_nodes=[0]), "operator_ignored")
    assert ign["reason"] == "busy (profiling)"


def test_operator_s4_restarts_without_the_given_nodes():
    job = _operator_job()
    out = mitigate(job, strategy="S4", exclude_nodes=[1])
    (sus,) = commands(out, "suspend")
    action = sus.action
    assert action.KIND == "restart" and action.exclude_nodes == [1] and action.reason == "operator"
    out = job.apply(sus)
    (mit,) = events(out, "mitigation")
    assert mit["strategy"] == "S4" and mit["exclude_nodes"] == [1] and mit["trigger"] == "operator"
    assert job.ctl.state is State.TRACKING
    # a report sent just before the restart (its onset before the restart's iteration) is
    # of processes that are gone: dropped, not a session that would hold restarting ranks
    restart = mit["iteration"]
    out = job.ctl.handle(FailSlowReport(2, restart - 1, restart, 1.5, 0.3, job.t, event_id=3), job.t)
    (drop,) = events(out, "report_dropped")
    assert drop["rank"] == 2 and "before the restart" in drop["reason"]
    assert not commands(out) and job.ctl.state is State.TRACKING and job.ctl.episode is None
    # nor do the gone processes' heartbeats place anything: after the restart's pause the
    # suspension for a new fail-slow is placed from the restarted ranks' own heartbeats
    assert job.ctl.beats == {} and job.ctl.history == {}
    job.t += 80.0
    job.beat(restart + 6)
    out = job.ctl.handle(FailSlowReport(2, restart + 5, restart + 12, 1.5, 0.3, job.t, event_id=4), job.t)
    assert commands(out, "profile") and job.ctl.state is State.PROFILING
    for r in NODES:
        out += job.ctl.handle(profile(r, job.ctl.session), job.t)
    (sus,) = commands(out, "suspend")
    assert restart + 6 < sus.iteration <= restart + 7 + CFG.suspend_margin_iterations, sus.iteration


@pytest.mark.parametrize("nodes", [[True], [-1], ["1"], [1.0], "1", 1])
def test_operator_s4_with_bad_nodes_is_ignored(nodes):
    job = _operator_job()
    out = mitigate(job, strategy="S4", exclude_nodes=nodes)
    assert not commands(out)
    (ign,) = events(out, "operator_ignored")
    assert repr(nodes) in ign["reason"] and "node numbers" in ign["reason"]


# --- 6. no compute time per micro-batch ---------------------------------------------------


def test_s2_without_compute_times_fails_and_the_planner_moves_on_to_s4():
    job = Job(restart_s=2.0)
    job.localize()
    job.mb[2] = 0.0  # rank 2 stops reporting its compute time per micro-batch
    out, it = job.run_until("mitigation_decision")
    (dec,) = decisions(out)
    assert dec["strategy"] == "S2"
    (fail,) = events(out, "mitigation_failed")
    assert fail["strategy"] == "S2" and fail["reason"].startswith("no compute time per micro-batch")
    assert not commands(out, "suspend") and job.ctl.state is State.TRACKING
    planner = job.ctl.episode.mitigation.planner
    assert "S2" in planner.status()["failed"] and planner.pending() is None
    # the next candidate once the impact reaches a restart's cost (2 s = 8 slow iterations)
    out, it2 = job.run_until("mitigation_decision")
    (dec,) = decisions(out)
    assert dec["strategy"] == "S4" and it2 == ONSET + 7
    assert commands(out, "suspend")[0].action.exclude_nodes == [0]


def test_without_compute_times_s2_is_unavailable_and_never_decided():
    job = Job(restart_s=2.0, mb=[0.0, 0.0, 0.0, 0.0])
    job.localize()
    states = {c["strategy"]: c["state"] for c in job.ctl.episode.mitigation.planner.status()["candidates"]}
    assert states["S2"] == "unavailable"
    out, it = job.run_until("mitigation_decision")
    (dec,) = decisions(out)
    assert dec["strategy"] == "S4" and it == ONSET + 7
    assert not events(out, "mitigation_failed")


def test_mitigation_off_starts_no_planner():
    job = Job(cfg=CFG.replace(mitigation=False))
    ctl = job.ctl
    job.beat()
    outs = ctl.handle(FailSlowReport(1, ONSET, ONSET + 3, 2.0, HEALTHY, job.t, event_id=7), job.t)
    for r in NODES:
        outs += ctl.handle(profile(r, ctl.session, late_rank=1), job.t)
    (sus,) = commands(outs, "suspend")
    job.hold_all(sus)
    for r in NODES:
        outs += ctl.handle(ValidationResult(r, sus.session, 5e9 if r == 1 else 1e10, []), job.t)
    assert events(outs, "localized") and not events(outs, "planner_started")
    out = job.advance(30)
    assert not decisions(out) and not commands(out)


# --- episodes with a planner must still end -------------------------------------------------


def test_a_fail_slow_that_ends_before_any_mitigation_closes_its_episode():
    job = Job(restart_s=30.0)
    job.localize()
    job.advance(2)  # impact 0.5 s: below S2's 0.9 s, nothing decided
    ctl = job.ctl
    out = ctl.handle(FailSlowReport(1, ONSET, ONSET + 3, 2.0, HEALTHY, job.t, event_id=7, end=job.it), job.t)
    assert events(out, "episode_end")
    assert ctl.episode is None
    out = ctl.handle(FailSlowReport(2, job.it + 5, job.it + 8, 2.0, HEALTHY, job.t + 5, event_id=9), job.t + 5)
    assert commands(out, "profile")


def test_a_failed_revert_still_closes_the_episode():
    job = Job()
    effective = _s2_applied(job)
    job.iter_s = HEALTHY
    job.it = effective - 1
    job.advance()
    ctl = job.ctl
    # S2 hides the straggler: rank 1's detector ends its fail-slow; the planner keeps the episode
    out = ctl.handle(FailSlowReport(1, ONSET, ONSET + 3, 2.0, HEALTHY, job.t, event_id=7, end=job.it), job.t)
    assert not events(out, "episode_end") and ctl.episode is not None
    job.mb[1] = FAST_MB
    out, _ = job.run_until("fail_slow_recovered")
    (sus,) = commands(out, "suspend")
    job.hold_all(sus)
    out = job.resume_all(sus, committed=(True, False, True, True))
    assert events(out, "mitigation_failed")
    assert ctl.episode is None and events(out, "episode_end")
    out = ctl.handle(FailSlowReport(1, job.it + 5, job.it + 8, 2.0, HEALTHY, job.t + 5, event_id=9), job.t + 5)
    assert commands(out, "profile")


def test_a_new_fail_slow_under_a_mitigation_in_force_is_localized_again():
    """fig17's compound trace: a GPU slowed after S3 had moved a congested link's traffic,
    and the controller read it as "S3 not enough" and restarted without the link's node.
    A new event whose onset is after the strategy settled, on a level risen over the one
    the strategy held, is localized again (as a rise the planner sees), and a new fault
    found under a strategy judged enough gets its own episode; a ladder update of the
    episode's own event, or an onset before the strategy settled, starts nothing."""
    job = Job(restart_s=2.0)
    effective = _s2_applied(job)
    ctl = job.ctl
    job.iter_s = HEALTHY
    job.it = effective - 1
    job.advance(CFG.mitigation_settle_iterations + CFG.mitigation_judge_iterations + 3)
    first = ctl.episode
    assert first.mitigation.planner.status()["judged"][-1]["enough"] is True
    session = ctl.session
    # the old event again (a ladder update), and a new one from before S2 had settled
    out = ctl.handle(FailSlowReport(1, ONSET, job.it, 2.2, HEALTHY, job.t, event_id=7), job.t)
    out += ctl.handle(FailSlowReport(2, effective + 1, job.it, 1.3, HEALTHY, job.t, event_id=3), job.t)
    assert not events(out, "episode_end") and not commands(out) and ctl.session == session
    assert ctl.state is State.TRACKING
    # a new fail-slow on rank 3, well after S2 settled, reported before the heartbeats' level shows it
    job.mb[3] = SLOW_MB
    out = ctl.handle(FailSlowReport(3, job.it - 1, job.it, 1.8, HEALTHY, job.t, event_id=9), job.t)
    (dec,) = decisions(out)
    assert dec["action"] == "relocalize" and dec["trigger"] == "report"
    out = _revalidate(job, out, slow=(1, 3))
    (loc,) = events(out, "localized")
    assert loc["evidence"]["trigger"] == "relocalize"
    (rel,) = events(out, "relocalized")
    assert rel["outcome"] == "new episode" and rel["gpus"] == [3]
    (end,) = events(out, "episode_end")
    assert end["reason"] == "superseded by a new fail-slow"
    assert ctl.episode is not first and ctl.episode.mitigation.gpus == [3]  # its own planner


def test_a_new_event_on_the_level_the_mitigation_holds_is_not_a_new_fail_slow():
    """The shared S3 job (issue 36): S3 left a x3 link on pipeline traffic, 1.1x the
    healthy time; a detector's event ended on the step down and one on the same level
    opened against the old baseline. It is the residual of the fault the episode
    mitigates: no new episode, no localization. A report on a level risen over the one the
    strategy held (by mitigation_relocalize_rise) is localized again; one whose onset came
    before that re-localization is not (it saw the rise)."""
    job = Job()
    effective = _s2_applied(job)
    job.iter_s = HEALTHY * 1.1  # what S2 holds: a residual over healthy
    job.advance(CFG.mitigation_settle_iterations + 4)
    ctl = job.ctl
    session = ctl.session
    out = ctl.handle(FailSlowReport(1, ONSET, job.it, 2.0, HEALTHY, job.t, event_id=7, end=effective + 1), job.t)
    new_onset = effective + CFG.mitigation_settle_iterations + 2
    out += ctl.handle(FailSlowReport(1, new_onset, job.it, 1.12, HEALTHY, job.t, event_id=8), job.t)
    assert not events(out, "episode_end") and not commands(out) and not decisions(out), out
    (joined,) = events(out, "report_joined")
    assert joined["rank"] == 1 and joined["event_id"] == 8
    assert ctl.session == session and ctl.state is State.TRACKING and ctl.episode.mitigation is not None
    # the same rank's next event on a level 20% over the held one is localized again
    out = ctl.handle(FailSlowReport(1, new_onset + 1, job.it, 1.1 * 1.2, HEALTHY, job.t, event_id=9), job.t)
    (dec,) = decisions(out)
    assert dec["action"] == "relocalize" and commands(out, "profile")
    out = _revalidate(job, out, slow=(1,))
    (rel,) = events(out, "relocalized")
    assert rel["outcome"] == "nothing new" and ctl.episode.mitigation is not None
    # a report of a rise from before that re-localization: it saw the rise already
    out = ctl.handle(FailSlowReport(2, new_onset + 1, job.it, 1.5, HEALTHY, job.t, event_id=4), job.t)
    assert not commands(out) and not decisions(out) and ctl.state is State.TRACKING, out


# --- a rise inside the episode is localized again ------------------------------------------


def _revalidate(job: Job, out: list, slow: tuple[int, ...]) -> list:
    """The re-localization session ``out`` started: every rank's profile, the suspension, GEMMs
    at half speed on ``slow``, and the resumed acks."""
    ctl = job.ctl
    assert ctl.state is State.PROFILING and commands(out, "profile")
    for r in NODES:
        out += ctl.handle(profile(r, ctl.session), job.t + 0.2)
    (sus,) = commands(out, "suspend")
    out += job.hold_all(sus)
    for r in NODES:
        out += ctl.handle(ValidationResult(r, sus.session, 5e9 if r in slow else 1e10, []), job.t + 0.4)
    out += job.resume_all(sus, pause=0.2)
    assert ctl.state is State.TRACKING
    return out


def test_a_second_straggler_under_an_s2_that_was_enough_gets_its_own_episode():
    """table7's GPU 58: a fault that begins under a strategy judged enough reaches no
    detector (their open event takes it as a ladder step, S3's moved ranks as their new
    baseline). The planner sees the level rise and asks for a re-localization instead of
    escalating; the new straggler gets an episode and a planner of its own, and the first
    one's plan stays in force (no revert)."""
    job = Job(restart_s=2.0)  # S4 would be due on the rent alone
    effective = _s2_applied(job)
    ctl = job.ctl
    job.iter_s = HEALTHY
    job.it = effective - 1
    job.advance(CFG.mitigation_settle_iterations + CFG.mitigation_judge_iterations + 3)
    first = ctl.episode
    assert first.mitigation.planner.status()["judged"][-1]["enough"] is True
    job.iter_s, job.mb[3] = SLOW, SLOW_MB  # rank 3 slows too
    out, it = job.run_until("mitigation_decision")
    (dec,) = decisions(out)
    assert dec["action"] == "relocalize" and dec["strategy"] == "S2"
    out = _revalidate(job, out, slow=(1, 3))
    (loc,) = events(out, "localized")
    assert loc["gpus"] == [1, 3]
    (rel,) = events(out, "relocalized")
    assert rel["outcome"] == "new episode" and rel["gpus"] == [3]
    (end,) = events(out, "episode_end")
    assert end["reason"] == "superseded by a new fail-slow" and end["gpus"] == [3]
    ep = ctl.episode
    assert ep is not first and ep.mitigation.gpus == [3] and ep.mitigation.slow_replicas == {3}
    assert ep.mitigation.planner.status()["healthy_s"] == HEALTHY
    assert not [d for d in decisions(out) if d["action"] == "revert"]
    # decided while the ranks were held for the verdict: it travelled with the resume
    (dec,) = [d for d in decisions(out) if d["action"] == "apply"]
    assert dec["strategy"] == "S2"  # not S4: the rise was not the first fault's
    (mit,) = events(out, "mitigation")
    assert mit["strategy"] == "S2" and mit["session"] == rel["session"]


def test_a_second_straggler_while_nothing_helped_joins_the_episode():
    """Only S4 allowed and not worth it yet: a second straggler's rise is localized and joins
    the episode (one planner, the rent so far kept); S4 would leave out both nodes."""
    job = Job(CFG.replace(mitigation_strategies="S4"), restart_s=1000.0)
    job.localize()
    job.advance(10)
    ctl = job.ctl
    ep, session = ctl.episode, ctl.session
    job.iter_s, job.mb[3] = 2 * SLOW, SLOW_MB
    out, _ = job.run_until("mitigation_decision")
    assert decisions(out)[0]["action"] == "relocalize"
    out = _revalidate(job, out, slow=(1, 3))
    (rel,) = events(out, "relocalized")
    assert rel["outcome"] == "joined the episode" and rel["gpus"] == [3]
    assert ctl.episode is ep and not events(out, "episode_end") and ctl.session > session
    assert ep.mitigation.gpus == [1, 3] and ep.mitigation.slow_replicas == {1, 3}
    assert ep.mitigation.planner.status()["relocalizing"] is None


def test_a_relocalization_that_finds_nothing_new_lets_the_planner_go_on():
    job = Job(restart_s=2.0)
    effective = _s2_applied(job)
    job.iter_s = HEALTHY
    job.it = effective - 1
    job.advance(CFG.mitigation_settle_iterations + CFG.mitigation_judge_iterations + 3)
    ep = job.ctl.episode
    job.iter_s = SLOW  # the same straggler got worse
    out, _ = job.run_until("mitigation_decision")
    out = _revalidate(job, out, slow=(1,))
    (rel,) = events(out, "relocalized")
    assert rel["outcome"] == "nothing new" and job.ctl.episode is ep
    out, _ = job.run_until("mitigation_decision")
    (dec,) = decisions(out)
    assert (dec["action"], dec["strategy"]) == ("apply", "S4")


def test_a_planner_that_applied_nothing_does_not_hold_a_healthy_episode_open():
    """An episode whose fail-slow is over before any strategy was bought closes once every
    rank reads healthy for episode_timeout_s, even without the end reports (an episode a
    re-localization opened has none)."""
    job = Job(CFG.replace(mitigation_strategies="S4"), restart_s=1000.0)
    job.localize()
    job.advance(3)
    ctl = job.ctl
    job.iter_s = HEALTHY
    job.advance(2)
    assert ctl.tick(job.t) == [] and ctl.episode is not None
    out = ctl.tick(job.t + CFG.episode_timeout_s)
    (ev,) = events(out, "episode_timeout")
    assert ev["reason"].startswith("every rank is healthy") and ctl.episode is None


def test_the_first_rank_s_heartbeats_read_together_each_feed_the_planner():
    """Three iterations' node heartbeats taken as one block (a read that waited) feed the
    planner as the same heartbeats one at a time do: each of the first rank's is observed
    (the middle iteration is the slowest: its impact counts only if it is seen)."""
    from falconext.protocol.codec import pack_heartbeats

    one, together = Job(), Job()
    one.localize()
    together.localize()
    msgs = []
    for iter_s in (SLOW, 2 * SLOW, SLOW):
        one.iter_s = iter_s
        one.advance()
        together.it += 1
        together.t += iter_s
        for node in (1, 0):
            msgs += pack_heartbeats(node, [
                Heartbeat(r, node, together.it, iter_s, together.t, replica=r, mb_s=together.mb[r],
                          micro=together.micro[r], restart_s=together.restart_s[r]) for r in (2 * node, 2 * node + 1)])
    together.ctl.handle_beats(msgs, together.t)
    impact = one.ctl.episode.mitigation.planner.impact_s
    assert impact == pytest.approx(1.25) and together.ctl.episode.mitigation.planner.impact_s == impact
