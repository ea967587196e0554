"""The operator desk alone (control/operator.py): mute and the reports it holds,
thresholds set and restored, what ``mitigate`` asks for, and the record of every command
(no Redis, no controller)."""

from __future__ import annotations

from falconext.config import FalconConfig
from falconext.protocol.actions import MicrobatchPlan, Restart, TopologyChange
from falconext.protocol.commands import MitigateRequest, MuteRequest, SetRequest, UnmuteRequest, ValidateRequest
from falconext.protocol.messages import FailSlowReport, Heartbeat
from falconext.control.operator import OperatorDesk, operator_action

SETTABLE = frozenset({"suspend_tries", "min_slowdown"})
CFG = FalconConfig()


def report(rank=1, event_id=0, t=10.0, end=None):
    return FailSlowReport(rank, 40, 54, 2.0, 0.3, t, event_id=event_id, end=end)


def beats(mb=(0.05, 0.1)) -> dict[int, Heartbeat]:
    """Two DP replicas of one rank each, 8 micro-batches each."""
    return {r: Heartbeat(r, r, 50, 0.3, 1.0, replica=r, mb_s=mb[r], micro=8) for r in range(2)}


def test_while_muted_a_report_is_held_once_and_its_end_drops_it():
    desk = OperatorDesk(SETTABLE)
    assert desk.hold(report(), episode_open=False) is None  # not muted: not the desk's
    out, text = desk.mute()
    assert [o.event["type"] for o in out] == ["muted"] and text.startswith("muted")
    assert desk.mute() == ([], "already muted")
    (held,) = desk.hold(report(), episode_open=False)
    assert held.event["type"] == "fail_slow_muted" and desk.held[1] == report()
    assert desk.hold(report(t=11.0), episode_open=False) == []  # a ladder update of the one held
    assert desk.hold(report(rank=2), episode_open=True) is None  # an open episode takes it
    assert desk.hold(report(end=60), episode_open=False) == [] and not desk.held
    desk.hold(report(rank=3, t=12.0), episode_open=False)
    desk.hold(report(rank=2, t=11.0), episode_open=False)
    assert [r.rank for r in desk.unmute()] == [2, 3]  # oldest first
    assert desk.unmute() is None and not desk.held


def test_set_changes_only_the_settable_thresholds_to_values_of_their_type():
    desk = OperatorDesk(SETTABLE)
    cfg, out, text = desk.set_threshold(CFG, {"name": "suspend_tries", "value": 7})
    assert cfg.suspend_tries == 7 and CFG.suspend_tries != 7 and text == f"suspend_tries: {CFG.suspend_tries} -> 7"
    assert out[0].event == {"type": "threshold_set", "name": "suspend_tries", "old": CFG.suspend_tries, "new": 7}
    same, out, _ = desk.set_threshold(cfg, {"name": "min_duration", "value": 3})  # read by the ranks
    assert same is cfg and out[0].event["type"] == "operator_ignored" and "--falcon-min-duration" in out[0].event["reason"]
    same, out, _ = desk.set_threshold(cfg, {"name": "suspend_tries", "value": "many"})
    assert same is cfg and out[0].event["type"] == "operator_ignored"
    assert desk.set_threshold(cfg, {"value": 1})[1][0].event["reason"].startswith("set needs a threshold name")
    assert desk.state() == {"muted": False, "set": {"suspend_tries": 7}}


def test_a_restarted_controller_takes_up_what_operators_changed_and_names_what_it_left_out():
    desk = OperatorDesk(SETTABLE)
    desk.mute()
    desk.set_threshold(CFG, {"name": "min_slowdown", "value": 0.2})
    again = OperatorDesk(SETTABLE)
    state = dict(desk.state(), set=dict(desk.state()["set"], min_duration=3))
    cfg, (ev,) = again.restore(CFG, state)
    assert cfg.min_slowdown == 0.2 and again.muted and again.state() == desk.state()
    assert ev.event["type"] == "operator_state_restored" and list(ev.event["skipped"]) == ["min_duration"]
    cfg, (ev,) = OperatorDesk(SETTABLE).restore(CFG, "garbage")
    assert cfg is CFG and ev.event["type"] == "operator_state_refused"


def test_mitigate_asks_for_an_action_only_while_idle_and_only_a_valid_one():
    desk = OperatorDesk(SETTABLE)
    cmd = MitigateRequest("S2")
    busy = desk.take(cmd, CFG, "busy (validating)", beats())
    assert busy.action is None and busy.outputs[0].event == {"type": "operator_ignored", "reason": "busy (validating)"}
    taken = desk.take(cmd, CFG, None, beats())
    assert isinstance(taken.action, MicrobatchPlan) and sum(taken.action.plan) == 16
    assert taken.action.plan[0] > taken.action.plan[1]  # the slow replica gets fewer
    assert taken.outputs[0].event == {"type": "operator_mitigate", "strategy": "S2"}
    assert operator_action({"strategy": "revert"}, beats(), None) == MicrobatchPlan("revert", [8, 8])
    assert operator_action({"strategy": "S2", "plan": [10, 6]}, beats(), None) == MicrobatchPlan("S2", [10, 6])
    assert "must give 2 replicas" in operator_action({"strategy": "S2", "plan": [10, 5]}, beats(), None)
    assert operator_action({"strategy": "S2"}, {}, None) == "replica layout not known yet (no heartbeats)"
    assert operator_action({"strategy": "S3", "roles": [1, 0]}, beats(), None) == TopologyChange([1, 0])
    assert "permutation" in operator_action({"strategy": "S3", "roles": [0, 0]}, beats(), None)
    assert operator_action({"strategy": "S4", "exclude_nodes": [1]}, beats(), None) == Restart([1], reason="operator")
    assert "node numbers" in operator_action({"strategy": "S4", "exclude_nodes": [True]}, beats(), None)
    assert "unknown strategy" in operator_action({"strategy": "S9"}, beats(), None)
    assert desk.take(ValidateRequest(), CFG, None, {}).validate
    unmuted = desk.take(UnmuteRequest(), CFG, None, {})
    assert unmuted.unmuted is None and unmuted.text == "not muted"


def test_every_command_is_recorded_and_one_with_an_id_is_answered():
    desk = OperatorDesk(SETTABLE)
    cmd = SetRequest("suspend_tries", 5, id="c1")
    taken = desk.take(cmd, CFG, None, {})
    out = desk.record(cmd, 12.3456, taken.outputs, taken.text, 9)
    record, changed, reply = out
    assert record.event == {"type": "operator_command", "command": "set", "args": {"name": "suspend_tries", "value": 5},
                            "at": 12.346, "accepted": True, "id": "c1"}
    assert changed.event["type"] == "threshold_set" and taken.cfg.suspend_tries == 5
    assert reply.kind == "reply" and reply.message.ok and reply.message.text == taken.text and reply.message.session == 9
    bad = SetRequest("min_duration", 5, id="c2")
    taken = desk.take(bad, CFG, None, {})
    record, _, reply = desk.record(bad, 1.0, taken.outputs, taken.text, 9)
    assert not record.event["accepted"] and record.event["reason"] == reply.message.text and not reply.message.ok
    quiet = desk.record(MuteRequest(), 1.0, [], "muted", 9)
    assert len(quiet) == 1  # no id: no reply
