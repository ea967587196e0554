"""S3 in the controller, scripted (no Redis, no clock), and the pure inputs it plans with.

A TP1 x DP2 x PP2 job on four virtual nodes (process p on node p). Heartbeats carry each
process's role, stage, traffic and the measured pause of a topology switch; a link
fault between nodes 0 and 1 (stage 0's DP all-reduce) is localized from validation
passes, and the planner's S3 must move it off the DP path.
"""

from __future__ import annotations

import pytest

from falconext.config import FalconConfig
from falconext.control.controller import Controller, State
from falconext.protocol.actions import TopologyChange
from falconext.protocol.commands import MitigateRequest
from falconext.protocol.messages import FailSlowReport, Heartbeat, ProfileData, SessionAck, ValidationResult
from falconext.mitigate.mitigation import healthy_mb_s, link_excess, network_s_per_byte, topology_inputs
from test_controller import commands, events

# suspend_verdict_wait_s 0: these tests follow S3's ski-rental decision on the heartbeats after
# the validation (the decision with the verdict, while the ranks are held, has its own test)
CFG = FalconConfig(mitigation_settle_iterations=2, mitigation_judge_iterations=3, mitigation_strategies="S3",
                   link_baseline_iteration=0, suspend_verdict_wait_s=0.0)
HEALTHY, SLOW = 0.2, 0.3
SWITCH_S, PAUSE = 0.4, 0.3
GRAD, ACT = 480_000, 32_768


def beat(p: int, it: int, iter_s: float = SLOW, roles=(0, 1, 2, 3), switch_s: float = SWITCH_S, **kw) -> Heartbeat:
    role = roles[p]
    fields = dict(replica=role % 2, mb_s=0.015, micro=4, role=role, stage=role // 2, tp=1, pp=2,
                  grad_bytes=GRAD, act_bytes=ACT, switch_s=switch_s)
    fields.update(kw)
    return Heartbeat(p, p, it, iter_s, 100.0 + it, **fields)


def beats(ctl: Controller, it: int, **kw) -> list:
    out = []
    for p in (3, 2, 1, 0):  # process 0, the planner's feed, last
        out += ctl.handle(beat(p, it, **kw), 100.0 + it)
    return out


def localized_job(slow_link: bool = True, slow_gpus: tuple[int, ...] = (), healthy_beat: int | None = None,
                  cfg: FalconConfig = CFG, **beat_fields) -> tuple[Controller, list]:
    """Fail-slow report -> profile -> validation (the x4 link 0-1 if ``slow_link``; GEMMs
    at half speed on ``slow_gpus``) -> localized; then the suspension's resumed acks.
    ``healthy_beat``: an iteration before the onset (45) at which every process first
    reports the default compute time."""
    ctl = Controller(cfg, world=4)
    if healthy_beat is not None:
        beats(ctl, healthy_beat)
    beats(ctl, 50, **beat_fields)
    t = 151.0
    out = ctl.handle(FailSlowReport(0, 45, 50, 1.5, HEALTHY, t, event_id=1), t)
    assert ctl.state is State.PROFILING
    for p in range(4):
        out += ctl.handle(ProfileData(p, ctl.session, {}, {}, {}), t + 0.2)
    (sus,) = commands(out, "suspend")
    s = sus.session
    for p in range(4):
        out += ctl.handle(SessionAck(p, s, "held", sus.iteration, t + 0.5), t + 0.5)
    return ctl, out + validated(ctl, out, t, slow_link, slow_gpus)


def validated(ctl: Controller, out: list, t: float, slow_link: bool = True, slow_gpus: tuple[int, ...] = (),
              resumed: bool = True) -> list:
    """The validation the suspend in ``out`` asked for (see :func:`localized_job`), then
    the resumed acks (``resumed``)."""
    (sus,) = commands(out, "suspend")
    s = sus.session
    out = []
    nbytes = sus.validation.nbytes
    slow_s = 0.001 + 3 * nbytes / 20e6 if slow_link else 0.001  # x4: 3 x bytes / 20 MB/s more per message
    links = {(0, 1): slow_s, (1, 0): slow_s, (2, 3): 0.001, (3, 2): 0.001, (0, 2): 0.001, (2, 0): 0.001,
             (1, 3): 0.001, (3, 1): 0.001}
    for p in range(4):
        mine = [[a, b, sec] for (a, b), sec in links.items() if b == p]
        out += ctl.handle(ValidationResult(p, s, 5e9 if p in slow_gpus else 1e10, mine), t + 1.0)
    for p in range(4 if resumed else 0):
        out += ctl.handle(SessionAck(p, s, "resumed", sus.iteration, t + 1.5, pause_s=PAUSE), t + 1.5)
    return out


def test_link_on_the_dp_path_is_moved_by_s3():
    ctl, out = localized_job()
    (loc,) = events(out, "localized")
    assert loc["links"] == [[0, 1]], loc["evidence"]
    (started,) = events(out, "planner_started")
    assert {c["strategy"]: c["state"] for c in started["candidates"]}["S3"] == "remaining"
    decided = None
    for it in range(51, 80):
        got = beats(ctl, it)
        if commands(got, "suspend"):
            decided = got
            break
    assert decided is not None, "S3 was never decided"
    (d,) = events(decided, "mitigation_decision")
    assert d["strategy"] == "S3" and d["impact_s"] >= d["overhead_s"]
    assert d["overhead_s"] == pytest.approx(SWITCH_S + PAUSE)  # the probe's pause + the last suspension
    (sus,) = commands(decided, "suspend")
    action = sus.action
    assert action.KIND == "topology" and sorted(action.roles) == [0, 1, 2, 3]
    roles = action.roles
    process_of = {r: p for p, r in enumerate(roles)}
    dp_groups = [{process_of[0], process_of[1]}, {process_of[2], process_of[3]}]
    assert {0, 1} not in dp_groups, roles
    before, after = action.predicted_s
    assert after < before


def test_s3_decided_with_the_verdict_travels_with_the_resume():
    """The rent since the onset (40: 10 iterations 0.1 s slow) already exceeds S3's cost
    (the switch and the validation's pause so far, 0.9 s) when the link is named: with
    the ranks held for the verdict, the TopologyChange goes with the "resume" and every rank
    applies it from the iteration after the hold: no second suspension."""
    ctl = Controller(CFG.replace(suspend_verdict_wait_s=2.0), world=4)
    beats(ctl, 50)
    t = 151.0
    out = ctl.handle(FailSlowReport(0, 40, 50, 1.5, HEALTHY, t, event_id=1), t)
    for p in range(4):
        out += ctl.handle(ProfileData(p, ctl.session, {}, {}, {}), t + 0.2)
    (sus,) = commands(out, "suspend")
    assert sus.validation.verdict_wait_s == 2.0
    for p in range(4):
        out += ctl.handle(SessionAck(p, sus.session, "held", sus.iteration, t + 0.5), t + 0.5)
    out = validated(ctl, out, t, resumed=False)
    (d,) = events(out, "mitigation_decision")
    assert d["strategy"] == "S3" and d["action"] == "apply"
    # priced at the switch plus this suspension's pause so far (held at t + 0.5, verdict at
    # t + 1.0): the job's first suspension, so no earlier pause was measured
    assert abs(d["overhead_s"] - (SWITCH_S + 0.5)) < 1e-6
    (resume,) = commands(out, "resume")
    assert resume.session == sus.session and resume.action.KIND == "topology"
    assert not commands(out, "suspend") and ctl.state is State.MITIGATING
    for p in range(4):
        out += ctl.handle(SessionAck(p, sus.session, "resumed", sus.iteration, t + 1.6, pause_s=PAUSE,
                                     committed=True), t + 1.6)
    (mit,) = events(out, "mitigation")
    assert mit["strategy"] == "S3" and mit["iteration"] == sus.iteration + 1 and mit["roles"] == resume.action.roles
    assert ctl.state is State.TRACKING and ctl.episode.mitigation.applied == [{"strategy": "S3",
                                                                              "iteration": sus.iteration + 1}]


def test_s3_without_role_reports_fails_and_names_why():
    ctl, out = localized_job()
    failed = []
    for it in range(51, 80):
        got = beats(ctl, it, role=-1)
        failed += events(got, "mitigation_failed")
        if failed:
            break
    assert failed and "no topology model" in failed[0]["reason"], failed


@pytest.mark.parametrize("case", ["peers healthy", "peer stretched"])
def test_two_stragglers_in_different_stages_are_consolidated_by_s3(case):
    # processes 0 (stage 0) and 3 (stage 1) 2x slow; "peer stretched": as on the 2-core
    # test bed, the straggler's busy core also stretched its stage peer's forward, so
    # only the processes' own times from before the onset show the 2x
    mb = {0: 0.03, 1: 0.015, 2: 0.015, 3: 0.03}
    if case == "peer stretched":
        mb[2] = 0.028
    ctl, out = localized_job(slow_link=False, slow_gpus=(0, 3), healthy_beat=40 if case == "peer stretched" else None)
    (loc,) = events(out, "localized")
    assert loc["gpus"] == [0, 3] and loc["links"] == [], loc["evidence"]
    decided = None
    for it in range(51, 80):
        got = []
        for p in (3, 2, 1, 0):
            got += ctl.handle(beat(p, it, mb_s=mb[p]), 100.0 + it)
        if commands(got, "suspend"):
            decided = got
            break
    assert decided is not None, "S3 was never decided"
    (sus,) = commands(decided, "suspend")
    action = sus.action
    roles = action.roles
    assert roles[0] // 2 == roles[3] // 2, roles  # one stage (TP1 x DP2: ranks 2s, 2s+1)
    assert "slow GPUs {0: 2.0, 3: 2.0}" in action.model_inputs
    before, after = action.predicted_s
    assert after < before


def test_operator_s3_checks_the_roles():
    ctl = Controller(CFG, world=4)
    beats(ctl, 10)
    (ign,) = events(ctl.handle(MitigateRequest("S3", roles=[0, 1, 1, 3]), 111.0),
                    "operator_ignored")
    assert "must be a permutation of the 4 ranks" in ign["reason"]
    out = ctl.handle(MitigateRequest("S3", roles=[0, 2, 1, 3]), 111.0)
    (sus,) = commands(out, "suspend")
    assert sus.action == TopologyChange([0, 2, 1, 3], session=sus.session)


# --- pure inputs ------------------------------------------------------------------------

def _beats(**kw):
    return {p: beat(p, 60, **kw) for p in range(4)}


def test_topology_inputs_fit_the_healthy_time_and_read_factors_from_training():
    bs = _beats()
    bs[3] = beat(3, 60, mb_s=0.045)  # a 3x straggler, as its own forward times show
    got = topology_inputs(bs, 0.5, slow=[3], gemm_factors={3: 2.0})
    assert not isinstance(got, str)
    assert got.roles == [0, 1, 2, 3] and got.layout.dp == 2 and got.layout.pp == 2
    assert got.gpu_factors == {3: pytest.approx(3.0)}
    assert got.costs.grad_bytes == (GRAD, GRAD) and got.costs.act_bytes == ACT
    from falconext.model.itertime import iteration_time

    assert iteration_time(got.layout, got.roles, got.costs) == pytest.approx(0.5)
    # the model overshooting the healthy time scales compute down instead
    small = topology_inputs(_beats(), 0.05)
    assert iteration_time(small.layout, small.roles, small.costs) == pytest.approx(0.05)
    assert small.costs.other_s == 0.0


@pytest.mark.parametrize("change, word", [
    ({"tp": 0}, "TP and PP sizes"),
    ({"role": 7}, "not a permutation"),
    ({"micro": 0}, "micro-batches per replica"),
    ({"mb_s": 0.0}, "no compute time"),
])
def test_topology_inputs_say_what_is_missing(change, word):
    bs = {p: beat(p, 60, **(change if p == 0 or word == "no compute time" else {})) for p in range(4)}
    got = topology_inputs(bs, 0.3)
    assert isinstance(got, str) and word in got, got


def test_topology_inputs_read_a_straggler_against_its_own_time_before_the_onset():
    bs = _beats()
    bs[2] = beat(2, 60, mb_s=0.042)  # the healthy peer, stretched by the straggler's host
    bs[3] = beat(3, 60, mb_s=0.045)  # 3x its own 0.015 before the onset
    peers = topology_inputs(bs, 0.5, slow=[3])
    assert peers.gpu_factors == {3: pytest.approx(0.045 / 0.042)}  # what the peer hides
    before = {p: 0.015 for p in range(4)}
    own = topology_inputs(bs, 0.5, slow=[3], before=before)
    assert own.gpu_factors == {3: pytest.approx(3.0)}
    # a process without a time before the onset: fall back to the peers
    assert topology_inputs(bs, 0.5, slow=[3], before={0: 0.015}).gpu_factors == peers.gpu_factors


def test_healthy_mb_s_is_the_last_beat_before_the_onset_in_the_current_role():
    history = {
        0: [beat(0, 30, mb_s=0.010), beat(0, 44, mb_s=0.012), beat(0, 46, mb_s=0.030)],
        1: [beat(1, 46, mb_s=0.030)],  # nothing from before the onset
        2: [beat(2, 40, mb_s=0.015), beat(2, 50, roles=(0, 1, 3, 2), mb_s=0.02)],  # switched role since
        3: [beat(3, 40, mb_s=0.0), beat(3, 45, mb_s=0.014)],  # 0: not measured yet
    }
    assert healthy_mb_s(history, onset=45) == {0: 0.012, 3: 0.014}


def test_healthy_mb_s_reaches_back_past_a_late_onset_to_the_lowest_clean_reading():
    """The detectors' onset can come late: the last beat before it already carries the
    fault. With a look-back window, the lowest reading in it is the reference (a fault only
    adds time); a beat before the window is used only when none is in it."""
    history = {
        0: [beat(0, 30, mb_s=0.009), beat(0, 38, mb_s=0.0101), beat(0, 40, mb_s=0.010),
            beat(0, 43, mb_s=0.013), beat(0, 45, mb_s=0.013)],  # the fault from about 42
        1: [beat(1, 20, mb_s=0.011), beat(1, 46, mb_s=0.02)],  # nothing in the window
    }
    assert healthy_mb_s(history, onset=45, lookback=11) == {0: 0.010, 1: 0.011}
    assert healthy_mb_s(history, onset=45) == {0: 0.013, 1: 0.011}  # no look-back: the last before


def test_link_excess_per_byte_over_the_reference():
    ev = {"links": {"0-1": 0.0112, "2-3": 0.001}, "reference": 0.0012}
    assert link_excess([[1, 0]], ev, 1000) == {(0, 1): pytest.approx(1e-5)}
    assert link_excess([[2, 3]], {"links": {}, "reference": None}, 1000) == {}


def test_link_excess_of_a_lone_network_link_is_over_its_own_baseline():
    ev = {"links": {"0-1": 0.04}, "reference": None, "reference_from": "baseline", "baseline": {"0-1": 0.01}}
    assert link_excess([[1, 0]], ev, 1000) == {(0, 1): pytest.approx(3e-5)}
    assert link_excess([[1, 0]], dict(ev, baseline={}), 1000) == {}


def test_the_networks_time_per_byte_is_the_reference_message_over_its_bytes():
    assert network_s_per_byte({"links": {"0-1": 0.0112, "2-3": 0.001}, "reference": 0.0012}, 1000) == pytest.approx(1.2e-6)
    lone = {"links": {"0-1": 0.04}, "reference": None, "baseline": {"0-1": 0.01}}
    assert network_s_per_byte(lone, 1000) == pytest.approx(1e-5)
    assert network_s_per_byte({"links": {"0-1": 0.04}, "reference": None}, 1000) == 0.0
    assert network_s_per_byte(lone, 0) == 0.0


def test_topology_inputs_price_the_network_before_the_fit():
    """With the network's time per byte, the model's transfers between nodes cost it and
    the fit still meets the healthy time: what moves onto the network costs there."""
    from falconext.model.itertime import iteration_time

    bare = topology_inputs(_beats(), 0.5)
    priced = topology_inputs(_beats(), 0.5, net_s_per_byte=1e-7)
    assert priced.costs.net_s_per_byte == 1e-7 and bare.costs.net_s_per_byte == 0.0
    assert iteration_time(priced.layout, priced.roles, priced.costs) == pytest.approx(0.5)
    assert priced.costs.other_s < bare.costs.other_s


def test_a_slow_gpu_under_a_link_nothing_helped_joins_its_episode_and_s2_is_tried():
    """The ablations' (Fig. 17) compound trace: S3 could not move the congested link, then
    a GPU slows. Its rise is localized again and joins the link's episode; the planner,
    widened to a computation fail-slow, tries S2 on the rent so far (S3 -> S2 -> S4)."""
    cfg = CFG.replace(mitigation_strategies="S2,S3")
    ctl, out = localized_job(cfg=cfg, role=-1)  # no roles: S3 has no model and fails
    failed = []
    it = 51
    while not failed and it < 80:
        failed += events(beats(ctl, it, role=-1), "mitigation_failed")
        it += 1
    assert failed and failed[0]["strategy"] == "S3"
    ep = ctl.episode
    decided = []
    while not decided and it < 120:
        for p in (3, 2, 1, 0):  # process 3's GPU at half speed: the iteration doubles
            got = ctl.handle(beat(p, it, iter_s=2 * SLOW, role=-1, mb_s=0.03 if p == 3 else 0.015), 100.0 + it)
            decided += events(got, "mitigation_decision")
        it += 1
    assert decided and decided[0]["action"] == "relocalize", decided
    for p in range(4):
        got += ctl.handle(ProfileData(p, ctl.session, {}, {}, {}), 100.0 + it)
    for p in range(4):
        got += ctl.handle(SessionAck(p, ctl.session, "held", commands(got, "suspend")[0].iteration, 100.0 + it),
                          100.0 + it)
    got = validated(ctl, got, 100.0 + it, slow_gpus=(3,))
    (rel,) = events(got, "relocalized")
    assert rel["outcome"] == "joined the episode" and rel["root_cause"] == "computation"
    assert ctl.episode is ep and ep.mitigation.gpus == [3] and ep.mitigation.links == [[0, 1]]
    decided = []
    while not decided and it < 140:
        for p in (3, 2, 1, 0):
            decided += events(ctl.handle(beat(p, it, iter_s=2 * SLOW, role=-1, mb_s=0.03 if p == 3 else 0.015),
                                         100.0 + it), "mitigation_decision")
        it += 1
    assert decided and (decided[0]["action"], decided[0]["strategy"]) == ("apply", "S2"), decided
