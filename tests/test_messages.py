"""Control-plane messages: round trip, and every corruption rejected with a named reason."""

from __future__ import annotations

import json

import pytest

from falconext.protocol.actions import MicrobatchPlan, Restart, TopologyChange, action_details
from falconext.protocol.base import MessageError
from falconext.protocol.codec import MAX_MESSAGE_BYTES, decode, encode
from falconext.protocol.commands import Command
from falconext.protocol.messages import FailSlowReport, Localized

REPORT = FailSlowReport(rank=3, onset=150, detected_at=164, slowdown=1.4, baseline_s=0.34, time=1795338456.5)


def test_round_trip():
    for msg in (REPORT, Localized([1], [[0, 1]], {"gemm_tflops": {"1": 0.5}, "pause_s": 1.2}), Command("suspend", 5.0, 200)):
        assert decode(encode(msg)) == msg
    assert decode(encode(Command("resume", 1.0))).args == {}  # optional fields default


def body(**changes):
    obj = json.loads(encode(REPORT))
    obj["body"].update(changes)
    return json.dumps(obj)


@pytest.mark.parametrize(
    "data, word",
    [
        ("not json", "malformed"),
        ("[1, 2]", "exactly v, type and body"),
        (json.dumps({"v": 2, "type": "Command", "body": {}}), "version"),
        (json.dumps({"v": 1, "type": "os.system", "body": {}}), "unknown message type"),
        (json.dumps({"v": 1, "type": "FailSlowReport", "body": []}), "body must be"),
        (body(rank="3"), "FailSlowReport.rank"),
        (body(rank=True), "FailSlowReport.rank"),
        (body(slowdown="NaN"), "FailSlowReport.slowdown"),
        (body(extra=1), "unknown field"),
        (body(onset=1.5), "FailSlowReport.onset"),
        ('{"v": 1, "type": "FailSlowReport", "body": {"rank": NaN}}', "NaN"),
        (json.dumps({"v": 1, "type": "FailSlowReport", "body": {"rank": 1}}), "missing field"),
        (json.dumps({"v": 1, "type": "Localized", "body": {"gpus": [1, "x"], "links": []}}), "Localized.gpus[1]"),
        ("x" * (MAX_MESSAGE_BYTES + 1), "exceeds"),
        (b"\xff\xfe", "UTF-8"),
    ],
)
def test_corrupted_messages_are_rejected_by_name(data, word):
    with pytest.raises(MessageError, match=word.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        decode(data)


def test_receiver_limits_types_and_encode_checks():
    with pytest.raises(MessageError, match="not accepted"):
        decode(encode(REPORT), accept={"Command"})
    with pytest.raises(MessageError, match="not a message type"):
        encode({"rank": 1})


# --- mitigation actions, inside a suspend command ---------------------------------------

ACTIONS = [
    MicrobatchPlan("S2", [6, 2, 4, 4], session=7, replica_mb_s=[0.1, 0.3, 0.1, 0.1], measured_mb_s=[0.1, 0.4, 0.1, 0.1]),
    MicrobatchPlan("revert", [4, 4, 4, 4]),
    TopologyChange([0, 2, 1, 3], session=9, predicted_s=[0.5, 0.3], moved=[1, 2], why="swap", model_inputs="fwd_s"),
    TopologyChange([1, 0], reason="forced"),
    Restart([1, 3], reason="operator", session=4),
]


@pytest.mark.parametrize("action", ACTIONS, ids=lambda a: type(a).__name__)
def test_an_action_round_trips_typed(action):
    cmd = Command("suspend", 5.0, 200, {"session": 7}, action=action)
    got = decode(encode(cmd))
    assert got == cmd and type(got.action) is type(action)
    wire = json.loads(encode(cmd))["body"]["action"]
    assert wire["kind"] == type(action).KIND  # tagged by kind on the wire
    assert decode(encode(Command("suspend", 5.0, 200, {"session": 7}))).action is None


def suspend_with(**action_changes):
    obj = json.loads(encode(Command("suspend", 5.0, 200, {"session": 7}, action=ACTIONS[0])))
    obj["body"]["action"].update(action_changes)
    obj["body"]["action"] = {k: v for k, v in obj["body"]["action"].items() if v != "DROP"}
    return json.dumps(obj)


@pytest.mark.parametrize(
    "data, word",
    [
        (suspend_with(kind="reboot"), "Command.action: unknown kind 'reboot'"),
        (suspend_with(kind="DROP"), "Command.action: unknown kind None"),
        (suspend_with(kind="restart"), "Command.action(restart): unknown field(s)"),
        (suspend_with(plan="DROP"), "Command.action(microbatches): missing field plan"),
        (suspend_with(plan=[6, "2", 4, 4]), "Command.action(microbatches).plan[1]: expected an integer"),
        (suspend_with(plan=[6, True, 4, 4]), "Command.action(microbatches).plan[1]: expected an integer"),
        (suspend_with(plan=[6, 2.5, 4, 4]), "Command.action(microbatches).plan[1]: expected an integer"),
        (suspend_with(plan={"0": 6}), "Command.action(microbatches).plan: expected a list"),
        (suspend_with(session=None), "Command.action(microbatches).session: expected an integer"),
        (suspend_with(replica_mb_s=[0.1, "fast"]), "Command.action(microbatches).replica_mb_s"),
        (suspend_with(strategy="S9"), "MicrobatchPlan.strategy: expected one of S2, revert"),
        (suspend_with(exec="rm -rf"), "unknown field(s) exec"),
        (json.dumps({"v": 1, "type": "Command", "body": {"kind": "suspend", "deadline_s": 1.0, "action": [1]}}),
         "Command.action: expected an object"),
        (json.dumps({"v": 1, "type": "Command", "body": {"kind": "suspend", "deadline_s": 1.0, "action": {
            "kind": "restart", "exclude_nodes": [-1]}}}), "node numbers are >= 0"),
        (json.dumps({"v": 1, "type": "Command", "body": {"kind": "suspend", "deadline_s": 1.0, "action": {
            "kind": "topology", "roles": [1, 0], "forced": 1}}}), "Command.action(topology).forced: expected true"),
    ],
)
def test_an_ill_typed_action_is_rejected_in_one_line(data, word):
    with pytest.raises(MessageError) as err:
        decode(data)
    assert word in str(err.value) and "\n" not in str(err.value)


def test_action_details_are_the_fields_the_events_had():
    assert action_details(ACTIONS[1]) == {"plan": [4, 4, 4, 4]}
    assert action_details(ACTIONS[3]) == {"roles": [1, 0], "reason": "forced"}
    assert action_details(ACTIONS[4]) == {"exclude_nodes": [1, 3], "reason": "operator"}
    assert set(action_details(ACTIONS[2])) == {"roles", "predicted_s", "moved", "why", "model_inputs"}


def test_a_verdict_resume_carries_its_action_and_a_plan_its_wait():
    """The verdict's "resume" brings the action to apply from the next iteration; the
    validation plan says how long the ranks wait for it (0 to 300 s, 0 when not given)."""
    from falconext.protocol.commands import ValidationPlan

    cmd = Command("resume", 4.0, args={"session": 7}, action=ACTIONS[0])
    assert decode(encode(cmd)) == cmd
    plan = ValidationPlan("all", ["dp"], 256, 10, 1, 2, 4096, 5, 2, verdict_wait_s=2.0)
    sus = Command("suspend", 4.0, 12, {"session": 7}, validation=plan)
    assert decode(encode(sus)).validation.verdict_wait_s == 2.0
    wire = json.loads(encode(sus))
    del wire["body"]["validation"]["verdict_wait_s"]
    assert decode(json.dumps(wire)).validation.verdict_wait_s == 0.0  # an older controller's plan
    wire["body"]["validation"]["verdict_wait_s"] = -1.0
    with pytest.raises(MessageError, match="verdict_wait_s"):
        decode(json.dumps(wire))
