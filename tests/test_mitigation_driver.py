"""The mitigation driver alone (control/mitigation_driver.py): a real planner in, typed
actions and events out, over plain heartbeats (no Redis, no controller)."""

from __future__ import annotations

import collections

import pytest

from falconext.config import FalconConfig
from falconext.control import mitigation_driver as driver
from falconext.control.episodes import Episode
from falconext.protocol.actions import MicrobatchPlan, Restart
from falconext.protocol.messages import FailSlowReport, Heartbeat, Localized, SessionAck
from falconext.control.stragglers import Suspect
from falconext.control.suspension import ActionEnd
from falconext.mitigate.room import RestartRoom

CFG = FalconConfig(mitigation_settle_iterations=2, mitigation_judge_iterations=3)
NODES = {0: 0, 1: 0, 2: 1, 3: 1}
HEALTHY, SLOW = 0.25, 0.5
ONSET = 58
FAST_MB, SLOW_MB = 0.05, 0.1
GEMM = {"0": 10.0, "1": 5.0, "2": 10.0, "3": 10.0}


def beats(it: int, mb1: float = SLOW_MB, iter_s: float = SLOW, **kw) -> dict[int, Heartbeat]:
    return {r: Heartbeat(r, n, it, iter_s, 100.0 + it, replica=r, mb_s=mb1 if r == 1 else FAST_MB, micro=4, **kw)
            for r, n in NODES.items()}


def history() -> dict[int, collections.deque]:
    kept = {r: collections.deque(maxlen=64) for r in NODES}
    for it in range(40, 62):
        for r, b in beats(it, mb1=FAST_MB if it < ONSET else SLOW_MB).items():
            kept[r].append(b)
    return kept


def episode(baseline_s: float = HEALTHY) -> Episode:
    return Episode.of_report(FailSlowReport(1, ONSET, ONSET + 3, 2.0, baseline_s, 100.0, event_id=7))


def localized(gpus=(1,), links=()) -> Localized:
    return Localized(gpus=list(gpus), links=[list(x) for x in links], evidence={"gemm_gflops": GEMM, "links": {}})


def started(ep: Episode | None = None, loc: Localized | None = None, pause: float = 0.3):
    ep = ep or episode()
    mit = driver.start_mitigation(ep, loc or localized(), [], beats(61), history(), CFG, pause, 4096)
    assert not isinstance(mit, str)
    ep.mitigation = mit
    return ep, mit


def feed(ep: Episode, first: int, last: int, session: int = 1, **kw):
    """The first rank's heartbeats of iterations first..last; (iteration, events, decision) of the first decision."""
    for it in range(first, last + 1):
        bs = beats(it, **kw)
        out, d = driver.observe(ep, bs[0], bs, CFG, 0.3, session)
        if d is not None or out:
            return it, out, d
    return None, [], None


def test_overheads_are_the_measured_costs_of_the_allowed_strategies():
    every = beats(60, restart_s=20.0, switch_s=1.0)
    got = driver.overheads("computation", every, 0.5, CFG)
    assert got["S4"] == 20.0 and got["S3"] == 1.5 and got["S2"] is not None and got["S2"] >= 0.5
    assert "S2" not in driver.overheads("communication", every, 0.5, CFG)
    one_missing = dict(every)
    one_missing[3] = Heartbeat(3, 1, 60, SLOW, 160.0, replica=3, mb_s=FAST_MB, micro=4)
    assert driver.overheads("computation", one_missing, 0.5, CFG)["S4"] is None  # every rank's, or none
    no_s4 = CFG.replace(mitigation_strategies="S2,S3")
    assert driver.overheads("computation", every, 0.5, no_s4)["S4"] is None


def test_a_localized_gpu_gets_a_complete_mitigation_with_the_healthy_time_of_the_job():
    ep, mit = started()
    st = mit.planner.state()
    assert st.root_cause == mit.root_cause == "computation" and st.healthy_s == HEALTHY and st.onset == ONSET
    assert mit.gpus == [1] and mit.slow_replicas == {1} and mit.gpu_factors == {1: 2.0}
    assert mit.healthy_mb_s[1] == FAST_MB and mit.recovery_refs == {1: (-1, FAST_MB)}
    # the job's own clean iteration times before the onset read lower than the reports' baseline
    lower = driver.start_mitigation(episode(0.3), localized(), [0.24] * CFG.min_baseline, beats(61), history(),
                                    CFG, 0.3, 4096)
    assert lower.planner.state().healthy_s == 0.24
    few = driver.start_mitigation(episode(0.3), localized(), [0.24], beats(61), history(), CFG, 0.3, 4096)
    assert few.planner.state().healthy_s == 0.3
    assert driver.start_mitigation(Episode("fail_slow", 1.0), localized(), [], beats(61), history(), CFG, 0.3,
                                   4096) == "no healthy baseline in the reports"
    link = driver.start_mitigation(episode(), localized(gpus=(), links=[(0, 1)]), [], beats(61), history(), CFG,
                                   0.3, 4096)
    assert link.root_cause == "communication" and [c.strategy for c in link.planner.state().candidates] == ["S3", "S4"]


def test_the_planner_buys_s2_once_the_rent_reaches_its_cost_and_the_action_is_a_plan():
    ep, mit = started()
    it, out, d = feed(ep, ONSET, ONSET + 10)
    assert d is not None and (d.action, d.strategy) == ("apply", "S2") and not out
    assert mit.planner.state().impact_s >= d.overhead_s  # the rent paid covers the buy
    assert mit.planner.state().impact_s - (SLOW - HEALTHY) < d.overhead_s  # and not an iteration later
    # an iteration already seen, or before the onset, is no observation
    assert driver.observe(ep, beats(it)[0], beats(it), CFG, 0.3, 1) == ([], None)
    action = driver.prepare_action(mit, d, beats(it), CFG, RestartRoom(2, 1, 0, ()))
    assert isinstance(action, MicrobatchPlan) and action.strategy == "S2" and sum(action.plan) == 16
    assert action.plan[1] < 4 and mit.in_flight is d
    none_known = {r: Heartbeat(r, n, it, SLOW, 1.0) for r, n in NODES.items()}
    mit.in_flight = None
    assert driver.prepare_action(mit, d, none_known, CFG, RestartRoom(2, 1, 0, ())) == \
        "no compute time per micro-batch from every replica"
    assert mit.in_flight is None
    assert driver.decision_event(d, 3, "planner").event["strategy"] == "S2"


def applied_s2(ep, mit):
    it, _, d = feed(ep, ONSET, ONSET + 10)
    action = driver.prepare_action(mit, d, beats(it), CFG, RestartRoom(2, 1, 0, ()))
    mit.in_flight = None  # landed (the controller takes it when the suspension ends)
    acks = {r: SessionAck(r, 2, "resumed", it + 3, 1.0, pause_s=0.4, committed=True) for r in NODES}
    ev, again = driver.applied(ActionEnd(action, False, acks, True, []), mit, d, it + 4, beats(it), 2)
    return it + 4, ev, again


def test_an_applied_action_is_recorded_with_its_overhead_and_the_planner_judges_it():
    ep, mit = started()
    effective, ev, again = applied_s2(ep, mit)
    assert again is None and mit.planner.state().current == "S2"
    assert mit.applied == [{"strategy": "S2", "iteration": effective}]
    assert ev.event["type"] == "mitigation" and ev.event["overhead_s"] == round(0.4 + mit.solve_s, 4)
    assert ev.event["trigger"] == "planner" and ev.event["plan"][1] < 4
    # S4 ends the planner: the ranks restart and their detectors start over
    link = localized(gpus=(), links=[(0, 1)])
    ep4 = episode()
    mit4 = driver.start_mitigation(ep4, link, [], beats(61, restart_s=1.0), history(), CFG, 0.3, 4096)
    ep4.mitigation = mit4
    it, _, d4 = feed(ep4, ONSET, ONSET + 20, restart_s=1.0)
    assert d4 is not None and d4.strategy == "S4"  # S3 has no measured cost (no switch yet)
    action = driver.prepare_action(mit4, d4, beats(it, restart_s=1.0), CFG, RestartRoom(2, 1, 1, ()))
    assert action == Restart([1], reason=d4.reason)
    mit4.in_flight = None
    end = ActionEnd(action, False, {0: SessionAck(0, 1, "resumed", 1, 1.0, pause_s=0.5, committed=True)},
                    True, [1, 2, 3])
    ev4, _ = driver.applied(end, mit4, d4, it + 2, beats(it), 1)
    assert mit4.planner.finished and ev4.event["acks_lost"] == [1, 2, 3]
    assert ev4.event["overhead_s"] == 0.5 + d4.overhead_s and ev4.event["exclude_nodes"] == [1]


def test_an_action_not_committed_is_retried_alone_after_a_verdict_or_fails():
    ep, mit = started()
    it, _, d = feed(ep, ONSET, ONSET + 10)
    action = driver.prepare_action(mit, d, beats(it), CFG, RestartRoom(2, 1, 0, ()))
    mit.in_flight = None
    out, retry = driver.not_committed(ActionEnd(action, True, {}, False, []), mit, d, True, 4)
    assert retry == MicrobatchPlan("S2", action.plan, session=0, replica_mb_s=action.replica_mb_s,
                                   measured_mb_s=action.measured_mb_s)
    assert mit.in_flight is d and out[0].event["type"] == "mitigation_retry" and "timed out" in out[0].event["reason"]
    mit.in_flight = None
    out, retry = driver.not_committed(ActionEnd(action, False, {}, False, []), mit, d, False, 4)
    assert retry is None and out[0].event["type"] == "mitigation_failed"
    assert mit.planner.state().failed == {"S2": "not every rank committed the action"}


def test_under_s2_the_slow_gpu_back_at_its_own_level_reverts_after_fresh_readings_in_a_row():
    ep, mit = started()
    effective, _, _ = applied_s2(ep, mit)
    line = CFG.mitigation_recovered_beats
    first = effective + 1
    # healthy again, but one reading over the line in between starts the count again
    for k in range(line - 1):
        bs = beats(first + k, mb1=FAST_MB)
        assert driver.observe(ep, bs[0], bs, CFG, 0.3, 2) == ([], None)
    assert mit.own_streak == line - 1
    bs = beats(first + line - 1, mb1=SLOW_MB)
    driver.observe(ep, bs[0], bs, CFG, 0.3, 2)
    assert mit.own_streak == 0 and not mit.planner.finished
    it, out, d = feed(ep, first + line, first + 3 * line, session=2, mb1=FAST_MB, iter_s=HEALTHY)
    assert it == first + 2 * line - 1  # line fresh readings after the reset
    (rec,) = [o.event for o in out]
    assert rec["type"] == "fail_slow_recovered" and rec["rule"] == "own compute" and rec["readings"] == line
    assert d is not None and (d.action, d.strategy) == ("revert", "S2") and mit.planner.finished


def rising(ep, mit, it: int = ONSET + 5):
    """The planner asked to localize a rise again."""
    d = mit.planner.relocalize(it, it - 1, "test")
    assert d is not None and d.action == "relocalize"
    ep.relocalizing, ep.relocalizing_t = mit.planner.state().relocalizing, 200.0
    return d


def test_a_relocalization_finds_nothing_new_a_fault_that_joins_or_one_of_its_own():
    ep, mit = started()
    rising(ep, mit)
    r = driver.relocalized(ep, localized(), False, beats(63), history(), CFG, 5, 201.0, 4096)
    assert r.new_episode is None and r.outputs[0].event["outcome"] == "nothing new"
    assert mit.planner.state().relocalizing is None and ep.relocalizing is None and ep.relocalized_at == ONSET + 5
    # a slow link under a computation fail-slow nothing has helped yet: it joins
    rising(ep, mit, ONSET + 8)
    links = {"links": {"0-1": 0.2}, "reference": 0.1}
    loc = Localized(gpus=[1], links=[[0, 1]], evidence={"gemm_gflops": GEMM, "links": links})
    level = ep.relocalizing.level_s
    r = driver.relocalized(ep, loc, False, beats(66), history(), CFG, 6, 202.0, 1000)
    assert r.new_episode is None and r.outputs[0].event["outcome"] == "joined the episode"
    assert mit.links == [[0, 1]] and mit.link_excess == {(0, 1): pytest.approx(0.0001)}
    assert ep.slow_levels == [HEALTHY * 2.0, level]  # the report's level, then the joined rise's
    # muted: nothing is taken up
    rising(ep, mit, ONSET + 12)
    r = driver.relocalized(ep, localized(gpus=(1, 3)), True, beats(70), history(), CFG, 7, 203.0, 4096)
    assert r.outputs[0].event["outcome"] == "muted" and mit.gpus == [1]


def test_a_new_fault_under_a_strategy_that_was_enough_gets_an_episode_of_its_own():
    ep, mit = started()
    effective, _, _ = applied_s2(ep, mit)
    # S2 holds the job at its healthy time (the GPU itself still slow): judged enough
    it, out, d = feed(ep, effective + 1, effective + CFG.mitigation_settle_iterations + CFG.mitigation_judge_iterations,
                      session=2, iter_s=HEALTHY)
    assert (it, out, d) == (None, [], None) and mit.planner.state().judged[-1]["enough"]
    rise = effective + 7
    rising(ep, mit, rise + 1)
    assert ep.relocalizing.was_enough
    r = driver.relocalized(ep, localized(gpus=(1, 3)), False, beats(rise + 2), history(), CFG, 5, 201.0, 4096)
    assert [o.event["outcome"] if o.event["type"] == "relocalized" else o.event["type"] for o in r.outputs] == \
        ["new episode", "episode_end"]
    new = r.new_episode
    assert r.part.gpus == [3] and new.localized and new.onsets == [rise] and new.t_event == 201.0
    # the level S2 held is the rise's reference: the new fault's compute is read before it
    assert new.baselines == [HEALTHY] and new.slow_levels == [HEALTHY]
    assert r.clean_before == effective + CFG.mitigation_settle_iterations + CFG.mitigation_judge_iterations
    assert mit.gpus == [1]  # the first episode stays as it was


def test_a_report_or_a_straggler_under_a_mitigation_in_force_asks_to_localize_again():
    ep, mit = started()
    s = Suspect(rank=3, ratio=1.5, onset=ONSET + 4, iteration=ONSET + 6, level_s=SLOW, baseline_s=HEALTHY)
    assert driver.suspect_rise(ep, s) is None  # nothing applied yet: the episode's own mitigation comes first
    applied_s2(ep, mit)
    d = driver.suspect_rise(ep, s)
    assert d is not None and d.action == "relocalize" and mit.planner.state().relocalizing.rise_iteration == ONSET + 4
    ep2, mit2 = started()
    applied_s2(ep2, mit2)
    ep2.ended.add(2)
    joined, d2 = driver.report_rise(ep2, FailSlowReport(2, ONSET + 20, ONSET + 23, 1.5, HEALTHY, 300.0, event_id=9),
                                    8)
    assert ep2.reporters[2] == 9 and 2 not in ep2.ended and d2 is not None and d2.action == "relocalize"
    assert joined.event["reason"] == "localized again"
    again, busy = driver.report_rise(ep2, FailSlowReport(3, ONSET + 21, ONSET + 24, 1.5, HEALTHY, 300.0), 8)
    assert busy is None and again.event["reason"] == "the planner is busy"
