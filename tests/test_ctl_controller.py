"""Operator commands in the controller (``falconext ctl``), without Redis or a clock:
mute and unmute, set, the command record and reply, refusals, and the status snapshot."""

from __future__ import annotations

import json

from falconext.config import FalconConfig
from falconext.control.controller import RUNTIME_SETTABLE, Controller, State
from falconext.protocol.codec import decode, encode
from falconext.protocol.commands import COMMAND_KINDS, MuteRequest
from falconext.protocol.messages import CommandReply, FailSlowReport, StatusSnapshot
from test_controller import commands, events
from test_mitigation_controller import EVEN, HEALTHY, Job, _operator_job


def op(job: Job, kind: str, **args) -> list:
    return job.ctl.handle(COMMAND_KINDS[kind](**args, id=f"id-{kind}"), job.t)


def reply(out: list) -> CommandReply:
    (r,) = [o.message for o in out if o.kind == "reply"]
    return r


def record(out: list) -> dict:
    (ev,) = events(out, "operator_command")
    return ev


def report(rank: int, t: float, end: int | None = None, event_id: int = 7) -> FailSlowReport:
    return FailSlowReport(rank, 60, 63, 2.0, HEALTHY, t, event_id=event_id, end=end)


# --- the record and the reply ------------------------------------------------------------


def test_every_command_is_recorded_with_its_time_and_answered():
    job = _operator_job()
    out = op(job, "mitigate", strategy="S2", plan=[6, 2, 4, 4])
    ev = record(out)
    assert ev["command"] == "mitigate" and ev["accepted"] is True and ev["at"] == round(job.t, 3)
    assert ev["args"] == {"strategy": "S2", "plan": [6, 2, 4, 4]} and ev["id"] == "id-mitigate"
    r = reply(out)
    (sus,) = commands(out, "suspend")
    assert r.ok and r.id == "id-mitigate" and r.session == sus.session
    assert f"iteration {sus.iteration}" in r.text
    # the reply survives the wire
    assert decode(encode(r)) == r


def test_refused_commands_say_why():
    job = _operator_job()
    for args, why in [
        ({"strategy": "S2", "plan": [4, 4, 4]}, "4 replicas"),  # wrong length
        ({"strategy": "S2", "plan": [5, 4, 4, 4]}, "16 in all"),  # wrong sum
        ({"strategy": "S2", "plan": [-1, 9, 4, 4]}, ">= 1"),  # a negative count
        ({"strategy": "S5"}, "unknown strategy"),
    ]:
        out = op(job, "mitigate", **args)
        r = reply(out)
        assert not r.ok and why in r.text, (args, r.text)
        ev = record(out)
        assert ev["accepted"] is False and why in ev["reason"]
        assert not commands(out, "suspend") and job.ctl.state is State.TRACKING
    # busy: one action at a time
    op(job, "mitigate", strategy="S2", plan=[6, 2, 4, 4])
    r = reply(op(job, "validate"))
    assert not r.ok and r.text == "busy (mitigating)"


def test_a_command_without_an_id_gets_no_reply_but_is_recorded():
    job = _operator_job()
    out = job.ctl.handle(MuteRequest(), job.t)
    assert not [o for o in out if o.kind == "reply"]
    assert record(out)["command"] == "mute" and job.ctl.muted


# --- mute / unmute --------------------------------------------------------------------------


def test_muted_controller_holds_a_fail_slow_and_takes_it_up_at_unmute():
    job = _operator_job()
    ctl = job.ctl
    assert reply(op(job, "mute")).ok
    out = ctl.handle(report(1, job.t), job.t)
    (held,) = events(out, "fail_slow_muted")
    assert held["rank"] == 1 and ctl.state is State.TRACKING and ctl.episode is None
    assert not commands(out, "profile")
    assert ctl.handle(report(1, job.t), job.t) == []  # the same fail-slow again (a ladder update): held once
    job.advance(5)  # tracking goes on: heartbeats are taken
    assert ctl.beats[0].iteration == job.it
    out = op(job, "unmute")
    assert "ranks [1]" in reply(out).text
    assert ctl.state is State.PROFILING and commands(out, "profile")
    # the deadline runs from the unmute, not from the report's old time
    assert not events(ctl.tick(job.t + 0.5), "localization_failed")


def test_a_fail_slow_that_ends_while_muted_is_dropped():
    job = _operator_job()
    ctl = job.ctl
    op(job, "mute")
    ctl.handle(report(1, job.t), job.t)
    ctl.handle(report(1, job.t + 1, end=70), job.t + 1)
    out = op(job, "unmute")
    assert reply(out).text == "unmuted"
    assert ctl.state is State.TRACKING and ctl.episode is None and not commands(out, "profile")
    # and a new one after unmute starts an episode at once
    out = ctl.handle(report(2, job.t + 2, event_id=8), job.t + 2)
    assert ctl.state is State.PROFILING and commands(out, "profile")


def test_muted_planner_neither_observes_nor_decides():
    job = Job()
    job.localize()
    planner = job.ctl.episode.mitigation.planner
    op(job, "mute")
    last = planner.status()["last_iteration"]
    out = job.advance(40)  # long enough for the unmuted planner to decide S2 (test_mitigation_controller)
    assert not events(out, "mitigation_decision") and planner.status()["last_iteration"] == last
    op(job, "unmute")
    out, _ = job.run_until("mitigation_decision")
    assert events(out, "mitigation_decision")[0]["strategy"] == "S2"


# --- set ------------------------------------------------------------------------------------


def test_set_changes_the_threshold_the_next_decision_uses():
    job = _operator_job()
    ctl = job.ctl
    out = op(job, "set", name="suspend_margin_iterations", value=9)
    assert reply(out).ok and ctl.cfg.suspend_margin_iterations == 9
    (ev,) = events(out, "threshold_set")
    assert ev == {"type": "threshold_set", "name": "suspend_margin_iterations", "old": 3, "new": 9}
    (sus,) = commands(op(job, "mitigate", strategy="S2", plan=[6, 2, 4, 4]), "suspend")
    assert sus.iteration == job.it + 9


def test_set_accepts_strings_like_the_command_line_and_checks_type_and_range():
    job = _operator_job()
    assert reply(op(job, "set", name="min_slowdown", value="0.2")).ok and job.ctl.cfg.min_slowdown == 0.2
    assert reply(op(job, "set", name="mitigation", value="false")).ok and job.ctl.cfg.mitigation is False
    assert reply(op(job, "set", name="suspend_tries", value=2)).ok
    for name, value, why in [
        ("no_such_threshold", 1, "unknown threshold"),
        ("suspend_tries", 2.5, "takes a int"),
        ("suspend_tries", True, "takes a int"),
        ("min_slowdown", "fast", "takes a float"),
        ("min_slowdown", "nan", "finite"),
        ("suspend_tries", 0, "suspend_tries must be >= 1"),  # the config's own range check
        ("mitigation_strategies", "S2,S9", "mitigation_strategies"),
        ("bocd_threshold", 0.5, "read by the ranks"),  # the ranks' detector: not the controller's
    ]:
        r = reply(op(job, "set", name=name, value=value))
        assert not r.ok and why in r.text, (name, value, r.text)
    assert job.ctl.cfg.suspend_tries == 2 and job.ctl.cfg.bocd_threshold == FalconConfig().bocd_threshold


def test_runtime_settable_names_are_config_fields():
    assert RUNTIME_SETTABLE <= set(FalconConfig().to_dict())


# --- status snapshot ------------------------------------------------------------------------


def test_snapshot_shows_ranks_plan_state_and_planner():
    job = Job()
    snap = job.ctl.snapshot(job.t, job="j1")
    assert snap.ranks == {} and snap.plan["microbatches"] is None
    job.beat()
    snap = job.ctl.snapshot(job.t + 0.25, job="j1", last_event={"type": "x"})
    assert isinstance(snap, StatusSnapshot) and snap.job == "j1" and snap.world == 4
    assert snap.state == "tracking" and not snap.muted and snap.episode is None and snap.planner is None
    assert sorted(snap.ranks) == ["0", "1", "2", "3"]
    assert snap.ranks["1"]["iteration"] == job.it and snap.ranks["1"]["micro"] == 4
    assert snap.ranks["1"]["age_s"] == 0.25
    assert snap.plan["microbatches"] == EVEN and snap.plan["even"] is True and snap.plan["nodes"] == 2
    assert snap.last_event == {"type": "x"}
    job.localize()
    job.advance(3)
    snap = job.ctl.snapshot(job.t, job="j1")
    assert snap.episode["reporters"] == [1] and snap.episode["localized"]
    assert snap.planner["gpus"] == [1] and snap.planner["impact_s"] > 0 and snap.planner["next"] == "S2"
    job.ctl.cfg = job.ctl.cfg.replace(min_slowdown=0.3)
    snap = job.ctl.snapshot(job.t, job="j1")
    assert snap.config["min_slowdown"] == 0.3
    back = decode(encode(snap), max_bytes=1 << 20)
    assert back == snap
    json.dumps(back.ranks)


def test_a_restarted_controller_takes_up_the_operators_state():
    job = _operator_job()
    op(job, "mute")
    op(job, "set", name="suspend_margin_iterations", value=6)
    op(job, "set", name="bocd_threshold", value=0.5)  # refused: not kept
    state = job.ctl.operator_state()
    assert state == {"muted": True, "set": {"suspend_margin_iterations": 6}}
    again = Controller(job.ctl.cfg.replace(suspend_margin_iterations=3), world=4)
    (ev,) = events(again.restore(json.loads(json.dumps(state))), "operator_state_restored")
    assert again.muted and again.cfg.suspend_margin_iterations == 6 and again.operator_state() == state
    assert ev == {"type": "operator_state_restored", "muted": True, "set": {"suspend_margin_iterations": 6}}
    # what does not check out is left out, and said
    third = Controller(FalconConfig(), world=4)
    (ev,) = events(third.restore({"muted": "yes", "set": {"suspend_tries": 0, "nope": 1, "min_slowdown": 0.2}}),
                   "operator_state_restored")
    assert not third.muted and third.cfg.min_slowdown == 0.2 and sorted(ev["skipped"]) == ["nope", "suspend_tries"]
    (bad,) = events(third.restore([1, 2]), "operator_state_refused")
    assert "not an operator state" in bad["reason"]
