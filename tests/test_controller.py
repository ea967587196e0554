"""The controller's state machine, driven by scripted messages (no Redis, no clock)."""

from __future__ import annotations

import numpy as np
import pytest

from falconext.config import FalconConfig
from falconext.control.controller import Controller, State
from falconext.validate.plan import join_shares
from falconext.protocol.commands import ValidateRequest
from falconext.protocol.messages import FailSlowReport, Heartbeat, NodeHealth, ProfileData, SessionAck, ValidationResult

#: the fail-slow paths start from tracking; the two-node link baseline has its own tests
CFG = FalconConfig(link_baseline_iteration=0)
NODES = {0: 0, 1: 0, 2: 1, 3: 1}
DP = "dp:0,1,2,3"


def commands(outs, kind=None):
    return [o.message for o in outs if o.kind == "command" and (kind is None or o.message.KIND == kind)]


def shared_plan(outs):
    """The validation plan the suspend in ``outs`` and the shares before it carry, put back
    together: (GEMM ranks, P2P rounds of (src, dst) pairs)."""
    (sus,) = commands(outs, "suspend")
    shares = [c.share for c in commands(outs, "share") if c.session == sus.session]
    plan = join_shares(sus.validation, shares)
    return plan["gemm"], plan["passes"]


def events(outs, type_=None):
    return [o.event for o in outs if o.kind == "event" and (type_ is None or o.event["type"] == type_)]


def beats(ctl, t=100.0, it=50):
    for r, n in NODES.items():
        ctl.handle(Heartbeat(r, n, it, 0.3, t), t)


def profile(rank, session, late_rank=None, n=20):
    rows = []
    for k in range(n):
        t0 = 10.0 + k * 0.3 + (0.03 if rank == late_rank else 0.001 * ((rank + k) % 4))
        t_last = 10.0 + k * 0.3 + (0.03 if late_rank is not None else 0.003)
        rows.append([k, t0, t_last + 0.002, 4096])
    return ProfileData(rank, session, {DP: "dp", "pp:0": "pp"}, {DP: [0, 1, 2, 3]}, {DP: rows})


def report(rank=1, t=101.0, end=None):
    return FailSlowReport(rank, 40, 54, 2.0, 0.3, t, event_id=0, end=end)


def to_profiling(ctl, late_rank=1):
    beats(ctl)
    out = ctl.handle(report(), 101.0)
    assert ctl.state is State.PROFILING
    (cmd,) = commands(out, "profile")
    assert cmd.session == ctl.session and cmd.window_s == CFG.profile_window_s
    outs = []
    for r in NODES:
        outs += ctl.handle(profile(r, ctl.session, late_rank), 101.2)
    return outs


def test_compute_fault_walks_the_states_and_names_the_gpu():
    ctl = Controller(CFG, world=4)
    assert not ctl.defers_reports()  # nothing open: a report starts an episode at once
    outs = to_profiling(ctl)
    assert ctl.defers_reports()  # localizing: a report can only join it, and may wait
    (prof,) = events(outs, "profiled")
    assert prof["compute_suspects"] == [1]
    (sus,) = commands(outs, "suspend")
    assert ctl.state is State.VALIDATING
    assert sus.iteration >= 50 + CFG.suspend_margin_iterations
    assert sus.deadline_s == CFG.suspend_deadline_s
    assert shared_plan(outs)[0] == [0, 1, 2, 3] and sus.validation.scope == "suspects"
    session = sus.session
    outs = []
    for r in NODES:
        assert not commands(outs, "go")  # not before everyone is held
        outs += ctl.handle(SessionAck(r, session, "held", sus.iteration, 102.0), 102.0)
    assert len(commands(outs, "go")) == 1 and events(outs, "suspended")
    ctl.handle(NodeHealth(0, session, [{"index": 0, "sm_clock_mhz": 1980}]), 102.1)
    outs = []
    for r in NODES:
        outs += ctl.handle(ValidationResult(r, session, 5e9 if r == 1 else 1e10, []), 102.5)
    (loc,) = events(outs, "localized")
    assert loc["gpus"] == [1] and loc["links"] == []
    assert loc["after_event_s"] == 1.5
    assert loc["evidence"]["health"]["0"][0]["sm_clock_mhz"] == 1980
    assert ctl.state is State.TRACKING and not ctl.defers_reports()
    outs = []
    for r in NODES:
        outs += ctl.handle(SessionAck(r, session, "resumed", sus.iteration, 103.0, pause_s=0.4 + r / 10), 103.0)
    (res,) = events(outs, "resumed")
    assert res["pause_s"] == 0.7


def test_one_episode_per_fail_slow_and_it_ends_with_every_reporter():
    ctl = Controller(CFG, world=4)
    to_profiling(ctl)
    session = ctl.session
    assert not commands(ctl.handle(report(rank=3), 101.3))  # joins the episode
    s = ctl.session
    iteration = ctl.suspension.iteration
    for r in NODES:
        ctl.handle(SessionAck(r, s, "held", iteration, 102.0), 102.0)
    for r in NODES:
        ctl.handle(ValidationResult(r, s, 1e10, []), 102.5)
    assert ctl.state is State.TRACKING and ctl.session == session
    assert not commands(ctl.handle(report(rank=1, t=110.0), 110.0))  # still the same fail-slow
    assert not events(ctl.handle(report(rank=1, t=120.0, end=90), 120.0), "episode_end")
    assert events(ctl.handle(report(rank=3, t=120.5, end=90), 120.5), "episode_end")
    out = ctl.handle(report(rank=2, t=130.0), 130.0)  # a new fail-slow: a new episode
    assert commands(out, "profile") and ctl.session == session + 1


def test_a_rank_that_missed_the_iteration_gets_a_later_retry_then_an_abort():
    ctl = Controller(CFG, world=4)
    to_profiling(ctl)
    for attempt in range(1, FalconConfig().suspend_tries + 1):
        s, it = ctl.session, ctl.suspension.iteration
        ctl.handle(SessionAck(0, s, "held", it, 102.0), 102.0)
        out = ctl.handle(SessionAck(2, s, "missed", it + 1, 102.0), 102.0)
        (rel,) = commands(out, "release")
        assert rel.session == s
        if attempt < FalconConfig().suspend_tries:
            (again,) = commands(out, "suspend")
            assert again.session == s + 1 and again.iteration > it
            assert not commands(ctl.handle(SessionAck(1, s, "held", it, 102.0), 102.0))  # stale session
        else:
            assert events(out, "localization_failed") and ctl.state is State.TRACKING


def test_deadlines_release_everyone_and_give_up():
    ctl = Controller(CFG, world=4)
    to_profiling(ctl)
    s = ctl.session
    ctl.handle(SessionAck(0, s, "held", ctl.suspension.iteration, 102.0), 102.0)
    assert ctl.tick(102.5) == []
    out = ctl.tick(1e6)
    assert commands(out, "release")[0].session == s
    assert events(out, "localization_failed") and ctl.state is State.TRACKING

    ctl = Controller(CFG, world=4)
    beats(ctl)
    ctl.handle(report(), 101.0)
    assert ctl.tick(101.0 + CFG.profile_timeout_s / 2) == []
    out = ctl.tick(101.0 + CFG.profile_timeout_s)
    assert "no rank sent its profile" in events(out, "localization_failed")[0]["reason"]


def test_a_report_read_late_still_gets_its_whole_profiling_time():
    """A report that waited 5 s behind other messages (thousands of ranks' heartbeats):
    the ranks get profile_timeout_s from when the controller asked, not from the event."""
    ctl = Controller(CFG, world=4)
    beats(ctl)
    late = 101.0 + 5.0
    assert commands(ctl.handle(report(t=101.0), late), "profile")
    assert ctl.tick(late + CFG.profile_timeout_s / 2) == [] and ctl.state is State.PROFILING
    assert events(ctl.tick(late + CFG.profile_timeout_s), "localization_failed")


def test_operator_validation_of_a_healthy_job_localizes_nothing_and_tests_every_link():
    ctl = Controller(CFG, world=4)
    beats(ctl)
    out = ctl.handle(ValidateRequest(), 101.0)
    assert commands(out, "profile")
    outs = []
    for r in NODES:
        p = profile(r, ctl.session, None)
        p = ProfileData(r, p.session, {DP: "dp", "pp:0,2": "pp", "pp:1,3": "pp"},
                        {DP: [0, 1, 2, 3], "pp:0,2": [0, 2], "pp:1,3": [1, 3]}, p.calls)
        outs += ctl.handle(p, 101.2)
    (sus,) = commands(outs, "suspend")
    gemm, passes = shared_plan(outs)
    assert sus.validation.scope == "all" and gemm == [0, 1, 2, 3]
    assert sus.validation.roles == ["dp", "pp"]
    links = {tuple(p) for ps in passes for p in ps}
    assert {(0, 1), (1, 2), (2, 3), (3, 0), (0, 2), (2, 0), (1, 3), (3, 1)} == links
    for ps in passes:
        ranks = [r for p in ps for r in p]
        assert len(ranks) == len(set(ranks))
    s = sus.session
    for r in NODES:
        ctl.handle(SessionAck(r, s, "held", sus.iteration, 102.0), 102.0)
    outs = []
    for r in NODES:
        received = [[src, dst, 0.010 + 0.001 * r] for ps in passes for src, dst in ps if dst == r]
        outs += ctl.handle(ValidationResult(r, s, 1e10 * (1 + 0.05 * r), received), 102.5)
    (loc,) = events(outs, "localized")
    assert loc["gpus"] == [] and loc["links"] == []
    assert ctl.episode is None  # an operator episode ends with its verdict


def _validate_links(nodes, slow):
    """A validation session on a job whose ranks sit on ``nodes``; each rank reports the
    DP-ring link into it, 50 ms on the ``slow`` rank pairs and 10 ms elsewhere."""
    ctl = Controller(CFG, world=4)
    for r, n in nodes.items():
        ctl.handle(Heartbeat(r, n, 50, 0.3, 100.0), 100.0)
    ctl.handle(ValidateRequest(), 101.0)
    for r in nodes:
        ctl.handle(profile(r, ctl.session, None), 101.2)
    s, it = ctl.session, ctl.suspension.iteration
    for r in nodes:
        ctl.handle(SessionAck(r, s, "held", it, 102.0), 102.0)
    outs = []
    for r in nodes:
        links = [[(r - 1) % 4, r, 0.05 if ((r - 1) % 4, r) in slow else 0.01]]  # the DP ring
        outs += ctl.handle(ValidationResult(r, s, 1e10, links), 102.5)
    (loc,) = events(outs, "localized")
    return loc


def test_a_slow_link_is_named_by_its_nodes():
    loc = _validate_links({0: 0, 1: 1, 2: 2, 3: 3}, slow={(1, 2)})  # one rank per node
    assert loc["links"] == [[1, 2]] and loc["gpus"] == []


def _baseline_session(ctl, link_s, t=100.0):
    """Drive the two-node baseline session: every rank reports its DP-ring link, the
    node-crossing ones taking ``link_s``."""
    outs = []
    for r in NODES:
        outs += ctl.handle(profile(r, ctl.session, None), t + 0.2)
    s, it = ctl.session, ctl.suspension.iteration
    for r in NODES:
        outs += ctl.handle(SessionAck(r, s, "held", it, t + 1), t + 1)
    for r in NODES:
        src = (r - 1) % 4
        outs += ctl.handle(ValidationResult(r, s, 1e10, [[src, r, link_s if NODES[src] != NODES[r] else 1e-4]]), t + 1.5)
    return outs


def test_a_two_node_job_measures_its_link_once_healthy_then_judges_it_against_that():
    ctl = Controller(FalconConfig(link_baseline_iteration=10), world=4)
    for r, n in NODES.items():
        assert ctl.handle(Heartbeat(r, n, 9, 0.3, 99.0), 99.0) == []  # not yet at iteration 10
    out = []
    for r, n in NODES.items():
        out += ctl.handle(Heartbeat(r, n, 10, 0.3, 100.0), 100.0)
    assert ctl.state is State.PROFILING and ctl.episode.trigger == "baseline"
    assert len(commands(out, "profile")) == 1
    outs = _baseline_session(ctl, 0.01)
    (sus,) = commands(outs, "suspend")
    assert shared_plan(outs)[0] == [] and sus.validation.gemm_rounds == 0 and shared_plan(outs)[1]  # links only
    (base,) = events(outs, "link_baseline")
    assert base["links"] == {"0-1": 0.01} and base["kept"] and ctl.link_baseline == {(0, 1): 0.01}
    assert events(outs, "localized") == [] and ctl.localizations == []  # nothing was wrong
    assert ctl.state is State.TRACKING and ctl.episode is None
    # once only
    assert ctl.handle(Heartbeat(0, 0, 30, 0.3, 110.0), 110.0) == []
    # a fail-slow later: the same link 4x slower is named, against its own baseline
    ctl.handle(report(t=120.0), 120.0)
    outs = _baseline_session(ctl, 0.04, t=120.0)
    (loc,) = events(outs, "localized")
    assert loc["links"] == [[0, 1]] and loc["evidence"]["links"]["reference_from"] == "baseline"


def test_the_link_baseline_is_for_two_node_jobs_and_a_report_meanwhile_is_not_lost():
    four = Controller(FalconConfig(link_baseline_iteration=10), world=4)
    for r in range(4):
        assert four.handle(Heartbeat(r, r, 20, 0.3, 100.0), 100.0) == []  # 4 nodes: peers exist
    assert four.state is State.TRACKING
    ctl = Controller(FalconConfig(link_baseline_iteration=10), world=4)
    for r, n in NODES.items():
        ctl.handle(Heartbeat(r, n, 10, 0.3, 100.0), 100.0)
    assert ctl.handle(report(t=100.1), 100.1) == []  # joins the baseline session
    outs = _baseline_session(ctl, 0.01)
    assert events(outs, "link_baseline") and ctl.state is State.PROFILING
    assert ctl.episode.trigger == "fail_slow" and ctl.episode.reporters == {1: 0}
    assert len(commands(outs, "profile")) == 1
    # a controller restarted mid-job (the ranks long past iteration 10) measures no baseline
    late = Controller(FalconConfig(link_baseline_iteration=10), world=4)
    for r, n in NODES.items():
        assert late.handle(Heartbeat(r, n, 46, 0.3, 100.0), 100.0) == []
    assert late.state is State.TRACKING and late.episode is None


def test_a_lone_inter_node_link_has_no_peer_to_be_compared_with():
    """Two nodes: the ring links that cross them are one node link, and intra-node links
    (NVLink-class) are no reference for it, so it is not named."""
    loc = _validate_links(NODES, slow={(1, 2), (3, 0)})
    assert loc["links"] == [] and loc["gpus"] == []


def test_messages_of_other_sessions_and_states_are_ignored():
    ctl = Controller(CFG, world=4)
    beats(ctl)
    assert ctl.handle(ProfileData(0, 7, {}, {}, {}), 101.0) == []
    assert ctl.handle(ValidationResult(0, 0, 1e9, []), 101.0) == []
    assert ctl.handle(SessionAck(0, 3, "held", 1, 101.0), 101.0) == []
    assert ctl.state is State.TRACKING


def test_the_control_services_do_not_import_torch():
    """The controller and node agents start beside the ranks at every launch: they must not
    pay torch's import (seconds of CPU on a 2-core host) for code they never run."""
    import subprocess
    import sys

    code = "import sys, falconext.control.service; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_verdict_too_large_for_the_bus_travels_cut_and_whole_in_the_event():
    """At thousands of ranks the evidence (GEMM rates per rank) outgrows the bus's cap:
    posting it whole raised in the controller's loop."""
    from falconext.control.controller import for_bus
    from falconext.protocol.codec import MAX_MESSAGE_BYTES, decode, encode
    from falconext.protocol.messages import Localized

    evidence = {"session": 7, "trigger": "fail_slow", "scope": "suspects",
                "gemm_gflops": {str(r): 123.456 for r in range(8192)}}
    loc = Localized(gpus=[5], links=[[0, 1]], evidence=evidence)
    assert len(encode(loc)) > MAX_MESSAGE_BYTES
    small = for_bus(loc)
    data = encode(small)
    assert len(data.encode()) <= MAX_MESSAGE_BYTES
    back = decode(data)
    assert back.gpus == [5] and back.links == [[0, 1]]
    assert back.evidence["truncated"] is True and back.evidence["session"] == 7
    fits = Localized(gpus=[5], links=[], evidence={"session": 7})
    assert for_bus(fits) is fits
    many = Localized(gpus=list(range(20000)), links=[], evidence=evidence)
    assert len(encode(for_bus(many)).encode()) <= MAX_MESSAGE_BYTES


def test_three_slow_gpus_of_four_are_named_by_their_own_compute_rise():
    """fig14's three slow replicas: the GEMMs (2, 1, 1, 1 GFLOP/s) alone name nobody, since
    their median is a slow one; the heartbeats show ranks 1-3's compute per micro-batch
    doubled since before the onset (iteration 40), rank 0's unchanged."""
    ctl = Controller(CFG, world=4)
    for it, t in ((30, 95.0), (54, 100.0)):
        for r, n in NODES.items():
            mb = 0.05 * (2.0 if r and it > 40 else 1.0)
            ctl.handle(Heartbeat(r, n, it, 0.8, t, replica=r, mb_s=mb, micro=8, role=r), t)
    ctl.handle(report(), 101.0)
    for r in NODES:
        ctl.handle(profile(r, ctl.session), 101.2)
    assert ctl.state is State.VALIDATING
    session = ctl.session
    it = max(b.iteration for b in ctl.beats.values()) + CFG.suspend_margin_iterations
    for r in NODES:
        ctl.handle(SessionAck(r, session, "held", it, 102.0), 102.0)
    outs = []
    for r in NODES:
        outs += ctl.handle(ValidationResult(r, session, 1e9 if r else 2e9, []), 102.5)
    (loc,) = events(outs, "localized")
    assert loc["gpus"] == [1, 2, 3], loc["evidence"]


def test_a_mild_gpu_is_named_although_the_detectors_placed_its_onset_late():
    """table7's GPU 41 (1.3x): its replica's detectors placed the onset 7 iterations after
    the fault began, so the last heartbeat before that onset already carried the fault
    (a rise of 1.01 read against it). The pre-fault reference is the lowest reading of the
    detectors' confirmation window before the onset: the rise reads 1.3 and, with its GEMM
    below the fastest / 1.25, rank 1 is named; healthy ranks are not."""
    ctl = Controller(CFG, world=4)
    t = 60.0
    for it in range(20, 54):  # the fault begins at iteration 33; each beat a median of recent iterations
        t += 1.0
        for r, n in NODES.items():
            mb = 0.05 * (1.3 if r == 1 and it >= 37 else 1.0) * (1.0 + 0.005 * ((r + it) % 3))
            ctl.handle(Heartbeat(r, n, it, 1.3, t, replica=r, mb_s=mb, micro=8, role=r), t)
    outs = _validated(ctl, FailSlowReport(1, 40, 52, 1.3, 1.0, t, event_id=0), t)  # onset 40: 7 iterations late
    (loc,) = events(outs, "localized")
    assert loc["gpus"] == [1], loc["evidence"]


def _validated(ctl: Controller, rep: FailSlowReport, t: float) -> list:
    """``rep`` handled, every rank profiled, held and validated (rank 1's GEMM 1.3x slow);
    the verdict's outputs."""
    ctl.handle(rep, t)
    for r in NODES:
        ctl.handle(profile(r, ctl.session), t)
    assert ctl.state is State.VALIDATING
    session, it = ctl.session, max(b.iteration for b in ctl.beats.values()) + 1
    for r in NODES:
        ctl.handle(SessionAck(r, session, "held", it, t), t)
    outs = []
    for r in NODES:
        outs += ctl.handle(ValidationResult(r, session, 1e10 / (1.3 if r == 1 else 1.0), []), t + 0.5)
    return outs


def _planned_healthy(reported_baseline: float, before: list[float]) -> float:
    """The planner's healthy time for rank 1's 1.3x GPU (onset 40, reported against
    ``reported_baseline``) after heartbeats at ``before``'s times up to iteration 39."""
    ctl = Controller(CFG, world=4)
    t = 60.0
    for it, x in enumerate(before + [1.3] * 14, start=40 - len(before)):
        t += 1.0
        for r, n in NODES.items():
            mb = 0.05 * (1.3 if r == 1 and it >= 40 else 1.0)
            ctl.handle(Heartbeat(r, n, it, x, t, replica=r, mb_s=mb, micro=8, role=r), t)
    outs = _validated(ctl, FailSlowReport(1, 40, 52, 1.3, reported_baseline, t, event_id=0), t)
    (started,) = events(outs, "planner_started")
    return started["healthy_s"]


def test_the_healthy_time_is_the_jobs_own_when_the_detectors_baseline_held_a_mitigated_stretch():
    """The detectors' baseline may hold iterations an earlier S2 plan ran (table7's first
    link fault came 7 iterations after GPU 5's S2 was reverted: baseline 3.74 s for a
    3.50 s job), which underprices the rent. The controller takes its own clean readings
    (no episode, no mitigation in force) when they read lower; with too few of them
    (fewer than min_baseline) it keeps the detectors'."""
    clean = [1.0 + 0.002 * (k % 3) for k in range(20)]
    assert _planned_healthy(1.1, clean) == pytest.approx(1.002)
    assert _planned_healthy(0.95, clean) == 0.95  # never raised over the detectors'
    assert _planned_healthy(1.1, [1.0] * (CFG.min_baseline - 1) + [1.0]) == pytest.approx(1.0)
    assert _planned_healthy(1.1, [1.0] * (CFG.min_baseline - 2)) == 1.1


def test_heartbeats_of_a_slow_loop_keep_one_reading_per_iteration():
    """A job of long iterations sends several heartbeats per iteration (every heartbeat_s):
    the history keeps the latest of each iteration, so it reaches as many iterations back
    as it holds, and a pre-fault reading is still there when the fault is localized."""
    ctl = Controller(CFG, world=4)
    t = 60.0
    for it in range(20, 54):
        for k in range(7):  # 3.5 s iterations, a heartbeat every 0.5 s
            t += 0.5
            for r, n in NODES.items():
                mb = 0.05 * (1.3 if r == 1 and it >= 37 else 1.0) * (1.0 + 0.001 * k)
                ctl.handle(Heartbeat(r, n, it, 3.5, t, replica=r, mb_s=mb, micro=8, role=r), t)
    kept = ctl.history[1]
    assert [b.iteration for b in kept] == list(range(20, 54))
    assert all(b.mb_s == 0.05 * (1.3 if b.iteration >= 37 else 1.0) * 1.006 for b in kept)  # the latest of each
    from falconext.mitigate.mitigation import healthy_mb_s

    before = healthy_mb_s(ctl.history, 40, CFG.min_duration)  # onset 40, 3 iterations late
    assert before[1] == 0.05 * 1.006 and before[0] == 0.05 * 1.006


def _scored_beats(ctl, it, t, slow=None, factor=1.0):
    """Every rank's heartbeat with its scores: ``slow`` computes ``factor`` x per micro-batch."""
    out = []
    for r, n in NODES.items():
        f = factor if r == slow else 1.0
        compute, it_s = 0.2 * f, 0.2 * (factor if slow is not None else 1.0) + 0.05
        out += ctl.handle(Heartbeat(r, n, it, it_s, t, replica=r, mb_s=0.025 * f, micro=8, role=r, stage=0, tp=1,
                                    pp=1, score_iteration=it - 1, est_iter_s=it_s, compute_s=compute,
                                    wait_s=it_s - compute), t)
    return out + ctl.tick(t)


def test_a_straggler_the_scores_show_is_localized_before_any_report():
    """Rank 1 computes 2x per micro-batch from iteration 30 and its peers wait for it: after
    score_trigger_readings fresh scores the controller opens the episode itself (profile
    command, onset where rank 1's readings rose, baseline before it); one episode per
    outlier, and none while it stays slow."""
    ctl = Controller(CFG, world=4)
    outs, t = [], 100.0
    for it in range(20, 40):
        t += CFG.score_interval_s
        outs += _scored_beats(ctl, it, t, slow=1 if it >= 30 else None, factor=2.0)
        if ctl.state is not State.TRACKING:
            break
    (sus,) = events(outs, "straggler_suspected")
    assert sus["rank"] == 1 and sus["onset"] == 30 and sus["action"] == "localize"
    assert sus["iteration"] == 30 + CFG.score_trigger_readings - 1
    assert ctl.state is State.PROFILING and commands(outs, "profile")
    assert ctl.episode.onsets == [30] and ctl.episode.baselines == [0.25]
    # a healthy job, or the trigger off, opens nothing
    for cfg, slow in ((CFG, None), (FalconConfig(link_baseline_iteration=0, score_trigger_ratio=0.0), 1)):
        quiet, t = Controller(cfg, world=4), 100.0
        got = []
        for it in range(20, 40):
            t += CFG.score_interval_s
            got += _scored_beats(quiet, it, t, slow=slow if it >= 30 else None, factor=2.0)
        assert not events(got, "straggler_suspected") and quiet.state is State.TRACKING


def test_a_suspected_straggler_that_validation_clears_ends_its_episode():
    ctl = Controller(CFG, world=4)
    t = 100.0
    for it in range(20, 40):
        t += CFG.score_interval_s
        _scored_beats(ctl, it, t, slow=1 if it >= 30 else None, factor=2.0)
        if ctl.state is not State.TRACKING:
            break
    for r in NODES:
        ctl.handle(profile(r, ctl.session), t)
    session, it = ctl.session, max(b.iteration for b in ctl.beats.values()) + 1
    for r in NODES:
        ctl.handle(SessionAck(r, session, "held", it, t), t)
    outs = []
    for r in NODES:  # every GEMM alike: a slow host, not a slow GPU
        outs += ctl.handle(ValidationResult(r, session, 1e10, []), t + 0.5)
    (loc,) = events(outs, "localized")
    assert loc["gpus"] == [] and events(outs, "episode_end") and ctl.episode is None
    # it is not suspected again while it stays slow
    more = []
    for k in range(5):
        t += CFG.score_interval_s
        more += _scored_beats(ctl, it + 1 + k, t, slow=1, factor=2.0)
    assert not events(more, "straggler_suspected")


def test_heartbeats_that_say_how_far_into_the_iteration_place_the_suspension_at_the_next_one():
    """Each heartbeat says how long its iteration had been running (into_s): the
    controller then knows when the next iteration starts, and suspends the ranks there
    when the command has suspend_margin_s to reach them (one iteration sooner than the
    whole-iteration margin), else at the one after; a rank that does not say keeps the
    whole-iteration margin for everyone."""
    def suspend_at(into: list[float], now: float = 100.0) -> int:
        ctl = Controller(CFG, world=4)
        for (r, n), x in zip(NODES.items(), into):
            ctl.handle(Heartbeat(r, n, 50, 3.5, 100.0, into_s=x), 100.0)
        outs = ctl.handle(report(t=now), now)
        for r in NODES:
            outs += ctl.handle(profile(r, ctl.session, 1), now)
        (sus,) = commands(outs, "suspend")
        return sus.iteration

    assert suspend_at([0.2] * 4) == 51  # 51 starts 3.3 s from now
    assert suspend_at([0.2, 0.2, 0.2, 3.0]) == 52  # rank 3's 51 starts in 0.5 s: too soon
    assert suspend_at([0.2, 0.2, 0.2, -1.0]) == 51 + 1  # one rank unplaced: the old margin
    assert suspend_at([0.2] * 4, now=103.0) == 52  # 3 s later, 51 starts in 0.3 s


def test_long_iterations_suspend_one_iteration_ahead():
    """The margin is time for the command to reach every rank: with 3.5 s iterations one
    iteration gives it (three kept table7's fail-slows unvalidated 7 s longer, twice per
    mitigation); short iterations keep suspend_margin_iterations."""
    for iter_s, margin in ((3.5, 1), (CFG.suspend_margin_s, 1), (0.3, CFG.suspend_margin_iterations)):
        ctl = Controller(CFG, world=4)
        for r, n in NODES.items():
            ctl.handle(Heartbeat(r, n, 50, iter_s, 100.0), 100.0)
        outs = ctl.handle(report(t=100.0), 100.0)
        for r in NODES:
            outs += ctl.handle(profile(r, ctl.session, 1), 100.0)
        (sus,) = commands(outs, "suspend")
        assert sus.iteration == 50 + margin, (iter_s, sus.iteration)
    ctl = Controller(CFG.replace(suspend_margin_s=0.0), world=4)
    for r, n in NODES.items():
        ctl.handle(Heartbeat(r, n, 50, 3.5, 100.0), 100.0)
    outs = ctl.handle(report(t=100.0), 100.0)
    for r in NODES:
        outs += ctl.handle(profile(r, ctl.session, 1), 100.0)
    assert commands(outs, "suspend")[0].iteration == 50 + CFG.suspend_margin_iterations


def test_results_lost_on_the_bus_are_validated_again_not_judged_as_nothing_found():
    """Under chaos three of four ValidationResults were dropped at once: rank 1's slow GEMM
    alone, with no peer to judge it against, named nothing. The controller validates again
    in a new session (the held ranks released first), and names the GPU once the results
    come; after suspend_tries suspensions it gives the verdict with what came."""
    ctl = Controller(CFG, world=4)
    to_profiling(ctl)
    first = ctl.session
    for r in NODES:
        ctl.handle(SessionAck(r, first, "held", ctl.suspension.iteration, 102.0), 102.0)
    ctl.handle(ValidationResult(1, first, 5e9, []), 102.5)
    outs = ctl._deadline_passed(110.0)
    (inc,) = events(outs, "validation_incomplete")
    assert inc["missing"] == [0, 2, 3] and inc["session"] == first
    assert not events(outs, "localized") and ctl.state is State.VALIDATING
    assert [c.session for c in commands(outs, "resume")] == [first]  # the held ranks go on
    (sus,) = commands(outs, "suspend")
    assert sus.session == ctl.session == first + 1
    outs = []
    for r in NODES:
        outs += ctl.handle(SessionAck(r, ctl.session, "held", sus.iteration, 111.0), 111.0)
    assert ctl.handle(ValidationResult(0, first, 1e10, []), 111.2) == []  # the old session's: ignored
    for r in NODES:
        outs += ctl.handle(ValidationResult(r, ctl.session, 5e9 if r == 1 else 1e10, []), 111.5)
    (loc,) = events(outs, "localized")
    assert loc["gpus"] == [1] and loc["evidence"]["missing"] == []


def test_after_the_last_try_the_verdict_is_given_with_what_came():
    ctl = Controller(CFG, world=4)
    to_profiling(ctl)
    t = 110.0
    for k in range(CFG.suspend_tries):
        for r in NODES:
            ctl.handle(SessionAck(r, ctl.session, "held", ctl.suspension.iteration, t), t)
        ctl.handle(ValidationResult(1, ctl.session, 5e9, []), t + 0.5)
        outs = ctl._deadline_passed(t + 5.0)
        t += 10.0
        if k < CFG.suspend_tries - 1:
            assert events(outs, "validation_incomplete") and not events(outs, "localized")
    (loc,) = events(outs, "localized")
    assert loc["gpus"] == [] and loc["evidence"]["missing"] == [0, 2, 3]
    assert not events(outs, "validation_incomplete")


def _step_beats(ctl, it, t, runs: dict[int, tuple[int, float]], role=None):
    """Every rank's heartbeat at loop iteration ``it`` with its fast-path reading: ``runs``
    gives a rank's (run, ratio) up to iteration it - 1 (the others read level)."""
    out = []
    for r, n in NODES.items():
        run, ratio = runs.get(r, (0, 1.0))
        out += ctl.handle(Heartbeat(r, n, it, 0.3, t, replica=r, micro=8, role=r if role is None else role,
                                    stage=0, tp=1, pp=1, step_iteration=it - 1, step_run=run, step_ratio=ratio), t)
    return out + ctl.tick(t)


def test_the_fast_path_names_a_rank_whose_compute_stepped_up_alone():
    """Rank 2's compute reads 2x its own level from iteration 30 while its peers read level:
    once its run is fast_iterations long the controller opens the episode itself (by the
    fast path, onset where the run began, before any score is due); a burst that lifts every
    rank (evenly or not), a run shorter than fast_iterations, or ranks without a known role
    open nothing;
    one suspicion per run."""
    n_fast = CFG.fast_iterations

    def play(slow_runs, role=None, steps=20):
        ctl, outs, t = Controller(CFG, world=4), [], 100.0
        for it in range(20, 20 + steps):
            t += 0.3
            outs += _step_beats(ctl, it, t, slow_runs(it), role)
        return ctl, outs

    def one_slow(it):
        return {2: (it - 30, 2.0)} if it > 30 else {}

    ctl, outs = play(one_slow)
    (sus,) = events(outs, "straggler_suspected")
    assert sus["rank"] == 2 and sus["by"] == "fast" and sus["onset"] == 30 and sus["action"] == "localize"
    assert sus["iteration"] == 30 + n_fast and ctl.state is State.PROFILING
    assert not events(outs, "rank_scores")  # no score sample: the fast path alone
    # a burst: every rank's compute stepped up alike
    _, outs = play(lambda it: {r: (it - 30, 1.6) for r in NODES} if it > 30 else {})
    assert not events(outs, "straggler_suspected")
    # a burst that lifts the ranks unevenly: rank 2's run holds, the others' break (run 0)
    # but their recent compute reads 1.2x too
    _, outs = play(lambda it: {r: ((it - 30, 1.35) if r == 2 else (0, 1.2)) for r in NODES} if it > 30 else {})
    assert not events(outs, "straggler_suspected")
    # stalls of fast_iterations - 1 iterations, again and again
    _, outs = play(lambda it: {2: ((it - 30) % n_fast, 3.0)} if it > 30 else {}, steps=30)
    assert not events(outs, "straggler_suspected")
    # no role known: no peers to tell a burst from
    _, outs = play(one_slow, role=-1)
    assert not events(outs, "straggler_suspected")
    # the fast path off
    ctl = Controller(FalconConfig(link_baseline_iteration=0, fast_ratio=0.0), world=4)
    outs, t = [], 100.0
    for it in range(20, 40):
        t += 0.3
        outs += _step_beats(ctl, it, t, one_slow(it))
    assert not events(outs, "straggler_suspected")


def test_the_fast_path_compares_a_rank_with_the_others_at_the_same_iteration():
    """Heartbeats arrive out of step: rank 2's reading is one iteration newer than the
    others'. A burst reaches rank 2 at iteration 30 and the rest at 31: when rank 2's run is
    four long (iteration 33) the others' latest readings (32) show only half their lift,
    which a comparison of latest readings misreads as a step on rank 2 alone; read at
    iteration 33 they share it, and nothing is named. A slow GPU on rank 2 alone is named
    once the others' readings reach its fourth iteration."""
    n_fast = CFG.fast_iterations

    def reading(r, s, start):
        lifted = [1.6 if x >= start.get(r, 10**9) else 1.0 for x in range(s - n_fast + 1, s + 1)]
        return max(0, s - start.get(r, 10**9) + 1), float(np.median(lifted))

    def play(start):
        ctl, outs, t = Controller(CFG, world=4), [], 100.0
        for it in range(20, 45):
            t += 0.3
            for r, n in NODES.items():
                s = it - 1 if r == 2 else it - 2
                run, ratio = reading(r, s, start)
                outs += ctl.handle(Heartbeat(r, n, it, 0.3, t, replica=r, micro=8, role=r, stage=0, tp=1, pp=1,
                                             step_iteration=s, step_run=run, step_ratio=ratio), t)
            outs += ctl.tick(t)
        return outs

    assert not events(play({2: 30, 0: 31, 1: 31, 3: 31}), "straggler_suspected")
    (sus,) = events(play({2: 30}), "straggler_suspected")
    assert sus["rank"] == 2 and sus["onset"] == 30 and sus["compute_ratio"] == pytest.approx(1.6)


def test_a_rank_the_fast_path_named_is_not_named_again_by_the_score_trigger():
    """One suspicion per slow rank: the score trigger leaves alone a rank the fast path is
    already localizing (mitigation off, compare_nvrx's 2x case had a second suspension
    seven iterations later), and names it when the fast path has not."""
    from falconext.control.stragglers import StragglerWatch

    def beats(it):
        return {r: Heartbeat(r, n, it, 0.45, 100.0 + it, replica=r, mb_s=0.025 * (2.0 if r == 1 else 1.0), micro=8,
                             role=r, stage=0, tp=1, pp=1, score_iteration=it - 1, est_iter_s=0.45,
                             compute_s=0.4 if r == 1 else 0.2, wait_s=0.05 if r == 1 else 0.25)
                for r, n in NODES.items()}

    for fast_named, expect in ((True, None), (False, 1)):
        watch, got = StragglerWatch(), None
        if fast_named:
            watch.fast_acted.add(1)
        for it in range(30, 30 + 2 * CFG.score_trigger_readings):
            _, s = watch.scores(beats(it), {}, 100.0 + it * CFG.score_interval_s, CFG, True)
            got = got or s
        assert (got.rank if got else None) == expect
