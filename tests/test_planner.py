"""Scripted sequences for the ski-rental mitigation planner (pure, no I/O)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from falconext.mitigate.planner import Decision, Planner, slowdown_removed

HEALTHY = 1.0
SLOW = 1.5  # 0.5 s of impact per slow iteration (exact in binary floating point)
OK = 1.05  # within the default 10% margin


def feed(p: Planner, start: int, stop: int, t: float) -> list[Decision]:
    """Observe iterations start..stop-1 at t; return the decisions issued."""
    out = []
    for i in range(start, stop):
        d = p.observe(i, t)
        if d is not None:
            out.append(d)
    return out


def first_decision(p: Planner, start: int, stop: int, t: float) -> Decision | None:
    for i in range(start, stop):
        d = p.observe(i, t)
        if d is not None:
            return d
    return None


def planner(root="computation", **ov) -> Planner:
    overheads = {"S2": 2.0, "S3": None, "S4": 10.0}
    overheads.update(ov)
    return Planner(root, HEALTHY, overheads, onset=100)


def test_no_decision_below_overhead_then_s2_exactly_at_crossing():
    p = planner()
    assert p.current == "S1" and p.impact_s == 0.0 and p.pending() is None
    for i, impact in zip(range(100, 103), (0.5, 1.0, 1.5)):
        assert p.observe(i, SLOW) is None
        assert p.impact_s == impact
    d = p.observe(103, SLOW)
    assert d == Decision("apply", "S2", 103, 2.0, 2.0, d.reason)
    assert "S2" in d.reason and p.pending() == "S2"
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.strategy = "S4"  # type: ignore[misc]


def test_healthy_iterations_add_no_impact():
    p = planner()
    assert feed(p, 100, 200, HEALTHY) == []
    assert feed(p, 200, 210, 0.9) == []  # faster than healthy never counts negative
    assert p.impact_s == 0.0


def test_escalates_s2_then_s4_when_s3_unavailable_counting_impact_since_onset():
    p = planner()
    d = first_decision(p, 100, 200, SLOW)
    assert (d.strategy, d.iteration) == ("S2", 103)
    assert p.applied("S2", 103, 2.0) is None
    assert p.current == "S2" and p.pending() is None
    # 104..108 settle, 109..113 judged -> not enough at 113 with impact 2.0 + 10 * 0.5.
    assert feed(p, 104, 113, SLOW) == []
    assert p.observe(113, SLOW) is None
    judged = [h for h in p.history if h["kind"] == "judgement"]
    assert len(judged) == 1 and judged[0]["enough"] is False and judged[0]["iteration"] == 113
    assert p.impact_s == 7.0
    # S4 (overhead 10) once the impact since onset, pre-S2 part included, reaches 10.
    d = first_decision(p, 114, 200, SLOW)
    assert (d.action, d.strategy, d.iteration, d.impact_s) == ("apply", "S4", 119, 10.0)
    p.applied("S4", 120, 30.0)
    assert p.current == "S4"
    assert feed(p, 121, 400, SLOW) == []  # S4 is terminal
    assert p.status()["candidates"] == [
        {"strategy": "S2", "overhead_s": 2.0, "state": "applied"},
        {"strategy": "S3", "overhead_s": None, "state": "unavailable"},
        {"strategy": "S4", "overhead_s": 30.0, "state": "applied"},
    ]


def test_never_escalates_before_the_previous_strategy_is_judged():
    p = planner(S4=3.0)
    assert first_decision(p, 100, 200, SLOW).strategy == "S2"
    # While pending: impact keeps accumulating, no decision.
    assert feed(p, 104, 110, SLOW) == []
    assert p.impact_s == 5.0 and p.pending() == "S2"
    p.applied("S2", 110)
    # Impact is far above S4's overhead, but S2 is settling (111..115) then judged (116..120).
    assert feed(p, 111, 120, SLOW) == []
    d = p.observe(120, SLOW)
    assert d is not None and d.strategy == "S4" and d.iteration == 120
    assert "not enough" in d.reason


def test_s2_enough_never_escalates_even_if_long_but_resumes_if_it_rises_again():
    p = planner()
    first_decision(p, 100, 200, SLOW)
    p.applied("S2", 103)
    assert feed(p, 104, 109, SLOW) == []  # settling
    assert feed(p, 109, 5000, OK) == []  # judged enough at 113, then held
    assert p.current == "S2" and p.impact_s > 10.0
    judged = p.status()["judged"]
    assert [j["enough"] for j in judged] == [True] and judged[0]["iteration"] == 113
    # A single spike does not break it (rolling median of 5) ...
    assert p.observe(5000, 5.0) is None
    assert feed(p, 5001, 5005, OK) == []
    # ... a sustained rise does: S4 as soon as the median is above the margin.
    assert p.observe(5005, SLOW) is None
    assert p.observe(5006, SLOW) is None
    d = p.observe(5007, SLOW)
    assert d is not None and (d.strategy, d.iteration) == ("S4", 5007)
    assert [j["enough"] for j in p.status()["judged"]] == [True, False]


def test_communication_never_proposes_s2():
    p = Planner("communication", HEALTHY, {"S2": 0.0, "S3": None, "S4": 5.0}, onset=0)
    decisions = feed(p, 0, 100, SLOW)
    assert [(d.strategy, d.iteration) for d in decisions] == [("S4", 9)]
    assert [c["strategy"] for c in p.status()["candidates"]] == ["S3", "S4"]
    p2 = Planner("communication", HEALTHY, {"S2": 0.0, "S3": 1.0, "S4": 5.0}, onset=0)
    assert first_decision(p2, 0, 100, SLOW).strategy == "S3"


def test_recovery_reverts_s2_and_then_nothing_more_happens():
    p = planner()
    first_decision(p, 100, 200, SLOW)
    p.applied("S2", 103)
    feed(p, 104, 120, SLOW)  # not enough, S4 not yet reached
    d = p.recovered(121)
    assert d is not None and (d.action, d.strategy, d.iteration) == ("revert", "S2", 121)
    assert p.finished
    assert feed(p, 122, 10_000, 100.0) == []  # no flapping, however slow
    assert p.recovered(10_001) is None
    assert p.status()["finished"] is True


def test_recovery_with_nothing_applied_or_after_s4_returns_none():
    p = planner()
    feed(p, 100, 102, SLOW)
    assert p.recovered(102) is None and p.finished
    assert feed(p, 103, 200, SLOW) == []

    p = planner(S2=None, S4=1.0)
    first_decision(p, 100, 200, SLOW)
    p.applied("S4", 102)
    assert p.recovered(103) is None  # the bad node is gone: no revert


def test_recovery_while_pending_cancels_and_reverts_if_it_still_lands():
    p = planner()
    assert first_decision(p, 100, 200, SLOW).strategy == "S2"
    assert p.recovered(104) is None  # S1 in effect, S2 only in flight
    assert p.pending() is None
    d = p.applied("S2", 105)
    assert d is not None and (d.action, d.strategy) == ("revert", "S2")
    assert feed(p, 106, 300, SLOW) == []


def test_pending_blocks_new_decisions():
    p = planner(S4=3.0)
    assert first_decision(p, 100, 200, SLOW).strategy == "S2"
    assert feed(p, 104, 1000, SLOW) == []
    assert p.pending() == "S2" and p.impact_s == 2.0 + 896 * 0.5
    with pytest.raises(ValueError, match="not the pending"):
        p.applied("S4", 1000)
    with pytest.raises(ValueError, match="not the pending"):
        p.failed("S3", "nope")


def test_failed_drops_the_strategy_and_moves_on():
    p = planner()
    assert first_decision(p, 100, 200, SLOW).strategy == "S2"
    assert p.failed("S2", "solver error") is None
    assert p.current == "S1" and p.pending() is None
    d = first_decision(p, 104, 200, SLOW)
    assert (d.strategy, d.iteration, d.impact_s) == ("S4", 119, 10.0)
    st = p.status()
    assert st["failed"] == {"S2": "solver error"}
    assert {"kind": "failed", "strategy": "S2", "reason": "solver error",
            "impact_s": 2.0} in p.history
    with pytest.raises(ValueError, match="S2 is not the pending strategy"):
        p.failed("S2", "again")
    p.failed("S4", "no spare node")
    assert p.current == "S1" and p.candidates() == []
    assert feed(p, 120, 500, SLOW) == []
    with pytest.raises(ValueError, match="no decision is pending"):
        p.failed("S4", "again")


def test_set_overhead_resorts_the_remaining_candidates():
    p = planner(S2=5.0, S4=8.0)
    assert p.candidates() == ["S2", "S4"]
    p.set_overhead("S3", 1.0)  # S3 became available and is the cheapest
    assert p.candidates() == ["S3", "S2", "S4"]
    p.set_overhead("S2", 9.0)
    assert p.candidates() == ["S3", "S4", "S2"]
    d = first_decision(p, 100, 200, SLOW)
    assert (d.strategy, d.iteration, d.overhead_s) == ("S3", 101, 1.0)
    p.applied("S3", 101, 40.0)  # the measured overhead replaces the estimate
    assert p.candidates() == ["S4", "S2"]
    assert p.status()["candidates"][1] == {"strategy": "S3", "overhead_s": 40.0,
                                           "state": "applied"}
    p.set_overhead("S4", None)  # e.g. no spare node any more
    feed(p, 102, 112, SLOW)  # judged not enough at 111, impact 6.0
    assert p.candidates() == ["S2"]
    d = first_decision(p, 112, 200, SLOW)
    assert (d.strategy, d.iteration, d.impact_s) == ("S2", 117, 9.0)
    assert any(h["kind"] == "overhead" and h["strategy"] == "S4" for h in p.history)


def test_jumps_in_iteration_numbers():
    p = planner()
    d = p.observe(104, SLOW)  # first observation comes after a detection lag
    assert p.impact_s == 5 * 0.5  # iterations 100..104 all count
    assert d is not None and (d.strategy, d.impact_s) == ("S2", 2.5)
    p = planner()
    assert p.observe(100, SLOW) is None
    d = p.observe(110, SLOW)
    assert d is not None and d.strategy == "S2" and d.impact_s == 0.5 + 10 * 0.5
    p.applied("S2", 110)
    # Settling covers iterations 111..115; later observations (fed sparsely) are judged.
    assert p.observe(115, SLOW) is None
    for i in range(120, 160, 10):
        assert p.observe(i, SLOW) is None
    d = p.observe(160, SLOW)  # fifth judged observation: not enough; impact >= 10
    assert d is not None and d.strategy == "S4" and d.iteration == 160


def test_zero_overhead_applies_at_once():
    p = planner(S2=0.0)
    d = p.observe(100, HEALTHY)
    assert d is not None and d.strategy == "S2" and d.impact_s == 0.0


def test_history_and_status_are_plain_data():
    p = planner()
    first_decision(p, 100, 200, SLOW)
    p.applied("S2", 103)
    feed(p, 104, 114, SLOW)
    kinds = [h["kind"] for h in p.history]
    assert kinds == ["decision", "applied", "judgement"]
    assert p.history[0] == {"kind": "decision", "action": "apply", "strategy": "S2",
                            "iteration": 103, "impact_s": 2.0, "overhead_s": 2.0,
                            "reason": p.history[0]["reason"]}
    p.history.clear()  # a copy
    assert len(p.history) == 3
    st = p.status()
    assert st["root_cause"] == "computation" and st["healthy_s"] == 1.0
    assert st["current"] == "S2" and st["impact_s"] == p.impact_s
    assert st["judged"][0]["strategy"] == "S2" and st["judged"][0]["enough"] is False
    assert st["judged"][0]["threshold_s"] == pytest.approx(1.1)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -0.5, "x", None, True])
def test_bad_iter_s_raises_naming_the_value(bad):
    p = planner()
    with pytest.raises(ValueError, match="iter_s") as e:
        p.observe(100, bad)
    assert repr(bad) in str(e.value)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, 0.0])
def test_bad_healthy_raises(bad):
    with pytest.raises(ValueError, match="healthy_s") as e:
        Planner("computation", bad, {"S2": 1.0}, onset=0)
    assert repr(bad) in str(e.value)


def test_bad_iterations_raise():
    p = planner()
    p.observe(105, SLOW)
    with pytest.raises(ValueError, match="backwards: 104 after 105"):
        p.observe(104, SLOW)
    with pytest.raises(ValueError, match="backwards"):
        p.observe(105, SLOW)
    with pytest.raises(ValueError, match="before the onset"):
        planner().observe(99, SLOW)
    with pytest.raises(ValueError, match="iteration"):
        p.observe(1.5, SLOW)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="iteration"):
        p.observe(True, SLOW)  # type: ignore[arg-type]


def test_bad_overheads_and_arguments_raise():
    for bad in (math.nan, math.inf, -1.0):
        with pytest.raises(ValueError, match="overhead of S2"):
            Planner("computation", 1.0, {"S2": bad}, onset=0)
        with pytest.raises(ValueError, match="overhead of S4"):
            planner().set_overhead("S4", bad)
    with pytest.raises(ValueError, match="unknown strategy 'S9'"):
        Planner("computation", 1.0, {"S9": 1.0}, onset=0)
    with pytest.raises(ValueError, match="unknown strategy"):
        planner().set_overhead("S5", 1.0)
    with pytest.raises(ValueError, match="unknown root_cause 'disk'"):
        Planner("disk", 1.0, {}, onset=0)
    with pytest.raises(ValueError, match="judge_iterations"):
        Planner("computation", 1.0, {}, onset=0, judge_iterations=0)
    with pytest.raises(ValueError, match="settle_iterations"):
        Planner("computation", 1.0, {}, onset=0, settle_iterations=-1)
    with pytest.raises(ValueError, match="enough_margin"):
        Planner("computation", 1.0, {}, onset=0, enough_margin=math.nan)
    p = planner()
    with pytest.raises(ValueError, match="no decision is pending"):
        p.applied("S2", 100)
    first_decision(p, 100, 200, SLOW)
    with pytest.raises(ValueError, match="before it was decided"):
        p.applied("S2", 102)
    with pytest.raises(ValueError, match="overhead of S2"):
        p.applied("S2", 103, -1.0)


def test_no_available_candidate_means_no_decision():
    p = Planner("computation", 1.0, {"S1": 0.0}, onset=0)
    assert feed(p, 0, 1000, 10.0) == []
    assert p.candidates() == [] and p.status()["next"] is None


def test_slowdown_removed():
    assert slowdown_removed(1.0, 2.0, 1.0) == 1.0
    assert slowdown_removed(1.0, 2.0, 2.0) == 0.0
    assert slowdown_removed(1.0, 2.0, 1.5) == 0.5
    assert slowdown_removed(1.0, 2.0, 3.0) == -1.0  # made it worse: not clamped
    assert slowdown_removed(1.0, 2.0, 0.5) == 1.5  # faster than healthy: not clamped
    assert slowdown_removed(1.0, 1.0, 0.5) is None
    assert slowdown_removed(1.0, 0.8, 0.9) is None
    for args in ((math.nan, 2.0, 1.0), (1.0, math.inf, 1.0), (1.0, 2.0, -1.0)):
        with pytest.raises(ValueError):
            slowdown_removed(*args)


# --- a rise inside the fail-slow is localized again before any escalation ----------------


def test_a_strategy_that_was_enough_and_no_longer_is_asks_to_relocalize_not_to_escalate():
    """S2 was enough; then the level rises (a second fault): the planner asks for a
    re-localization instead of buying S4 for the first fault, and holds every decision
    until told what was found, whatever the rent meanwhile."""
    p = Planner("computation", HEALTHY, {"S2": 2.0, "S3": None, "S4": 10.0}, onset=100, rise_margin=0.1)
    assert first_decision(p, 100, 200, SLOW).strategy == "S2"
    p.applied("S2", 103, 2.0)
    assert feed(p, 104, 130, OK) == []  # settled, judged enough
    d = first_decision(p, 130, 160, 2.1)
    assert (d.action, d.strategy, d.iteration, d.overhead_s) == ("relocalize", "S2", 132, None)
    info = p.status()["relocalizing"]
    assert info["was_enough"] is True and info["reference_s"] == OK and info["rise_iteration"] == 130
    assert feed(p, 133, 160, 2.1) == [] and p.impact_s > 10.0  # S4's price passed: still held
    p.relocalized(False)
    d = p.observe(160, 2.1)
    assert (d.action, d.strategy) == ("apply", "S4")  # the same culprits: the ladder goes on
    assert [h["kind"] for h in p.history].count("relocalized") == 1


def test_a_rise_while_nothing_helped_widens_to_s2_when_a_gpu_joins_a_link_fault():
    """A congested link (S3 failed, S4 not yet worth it), then a GPU slows: the rise over the
    lowest level asks for a re-localization; the GPU found makes S2 a candidate, and the
    rent so far buys it at once: the paper's S3 -> S2 -> S4 path."""
    p = Planner("communication", HEALTHY, {"S3": 3.0, "S4": 50.0}, onset=100, rise_margin=0.1)
    d = first_decision(p, 100, 200, 1.3)
    assert d.strategy == "S3"
    p.failed("S3", "nothing to move")
    assert feed(p, d.iteration + 1, 130, 1.3) == []
    d = first_decision(p, 130, 150, 2.0)
    assert d.action == "relocalize" and p.status()["relocalizing"]["was_enough"] is False
    assert p.widen("communication") == []
    assert p.widen("computation") == ["S2"] and p.status()["root_cause"] == "computation"
    p.set_overhead("S2", 0.5)
    assert p.observe(d.iteration + 1, 2.0) is None  # held until relocalized
    p.relocalized(True)
    d = p.observe(d.iteration + 2, 2.0)
    assert (d.action, d.strategy) == ("apply", "S2")
    assert [c["strategy"] for c in p.status()["candidates"]] == ["S2", "S3", "S4"]


def test_a_gpu_that_joins_under_an_unjudged_s3_gets_s2_without_waiting_for_s3s_judgement():
    """S3 was just applied for a link, and a GPU slows before S3 has been judged: the S2 a
    widening adds treats the GPU, not the link, so the rent so far buys it at once instead
    of after S3's settle and judge windows. Without a widening the ladder still waits for
    the judgement."""
    def s3_applied() -> tuple[Planner, int]:
        p = Planner("communication", HEALTHY, {"S3": 3.0, "S4": 50.0}, onset=100, rise_margin=0.1)
        d = first_decision(p, 100, 200, 1.3)
        p.applied("S3", d.iteration + 1, 3.0)
        return p, d.iteration + 2

    p, it = s3_applied()
    d = p.observe(it, 2.0)
    assert d is None or d.action != "apply"
    p, it = s3_applied()
    d = p.relocalize(it, it, "a rank computes 2x its peers")  # the caller's scores saw a GPU
    assert d is not None and d.action == "relocalize"
    assert p.widen("computation") == ["S2"]
    p.set_overhead("S2", 0.5)
    p.relocalized(True)
    d = p.observe(it + 1, 2.0)
    assert d is not None and (d.action, d.strategy) == ("apply", "S2") and "not judged yet" in d.reason
    # S2 is no longer a complement once decided: the next step is judged as usual
    p.applied("S2", it + 2, 0.5)
    assert feed(p, it + 3, it + 6, 2.0) == []


def test_after_a_relocalization_the_level_settles_before_it_is_the_reference_again():
    """Heartbeats are medians of recent iterations, so the level goes on rising for a while
    after the re-localization: that is the same rise, not a further one."""
    p = Planner("computation", HEALTHY, {"S2": None, "S3": None, "S4": 1e6}, onset=100, rise_margin=0.1)
    assert feed(p, 100, 120, 1.2) == []
    d = first_decision(p, 120, 130, 1.4)
    assert d.action == "relocalize"
    p.relocalized(False)
    ramp = [1.45, 1.5, 1.55, 1.6, 1.65] + [1.7] * 20
    assert [p.observe(d.iteration + 1 + k, t) for k, t in enumerate(ramp)] == [None] * len(ramp)
    d = first_decision(p, d.iteration + 1 + len(ramp), 200, 1.9)  # a further rise: asked again
    assert d.action == "relocalize" and p.status()["relocalizing"]["reference_s"] == 1.7


def test_without_a_rise_margin_the_planner_escalates_on_a_rise():
    p = planner()
    assert first_decision(p, 100, 200, SLOW).strategy == "S2"
    p.applied("S2", 103, 2.0)
    assert feed(p, 104, 130, OK) == []
    d = first_decision(p, 130, 200, 2.1)
    assert (d.action, d.strategy) == ("apply", "S4")
    with pytest.raises(ValueError):
        p.relocalized(False)


def test_the_caller_may_ask_to_relocalize_a_fault_the_level_does_not_show_yet():
    """A rank computing far slower than its peers under a strategy that was enough: the
    caller asks (Planner.relocalize) before the level has risen; the re-localization
    carries the fault's onset and holds decisions as a rise's would, once at a time."""
    p = Planner("computation", HEALTHY, {"S2": 2.0, "S3": None, "S4": 10.0}, onset=100, rise_margin=0.1)
    assert first_decision(p, 100, 200, SLOW).strategy == "S2"
    assert p.relocalize(101, 99, "rank 5 computes 2x its peers") is None  # S2 pending
    p.applied("S2", 103, 2.0)
    assert feed(p, 104, 130, OK) == []  # settled, judged enough
    d = p.relocalize(130, 128, "rank 5 computes 2x its peers")
    assert (d.action, d.strategy, d.iteration) == ("relocalize", "S2", 130) and "rank 5" in d.reason
    info = p.status()["relocalizing"]
    assert info["was_enough"] is True and info["rise_iteration"] == 128 and info["reference_iteration"] <= 128
    assert p.relocalize(131, 128, "again") is None  # one at a time
    assert feed(p, 131, 160, OK) == []  # held until told what was found
    p.relocalized(True)
