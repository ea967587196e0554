"""Control-plane messages: round trip, and every corruption rejected with a named reason."""

from __future__ import annotations

import json

import pytest

from falconext.protocol.actions import MicrobatchPlan, Restart, TopologyChange, action_details
from falconext.protocol.base import MessageError
from falconext.protocol.codec import MAX_MESSAGE_BYTES, decode, encode
from falconext.protocol.commands import (
    COMMAND_KINDS,
    Go,
    MitigateRequest,
    MuteRequest,
    ProfileRequest,
    Release,
    Resume,
    SetRequest,
    TableRequest,
    Share,
    Suspend,
    UnmuteRequest,
    ValidateRequest,
    ValidationShare,
)
from falconext.protocol.messages import FailSlowReport, Localized

REPORT = FailSlowReport(rank=3, onset=150, detected_at=164, slowdown=1.4, baseline_s=0.34, time=1795338456.5)


def test_round_trip():
    for msg in (REPORT, Localized([1], [[0, 1]], {"gemm_tflops": {"1": 0.5}, "pause_s": 1.2}), Suspend(1, 200, 5.0)):
        assert decode(encode(msg)) == msg
    assert decode(encode(Resume(1, 1.0))).action is None  # optional fields default


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
    cmd = Suspend(7, 200, 5.0, action=action)
    got = decode(encode(cmd))
    assert got == cmd and type(got.action) is type(action)
    wire = json.loads(encode(cmd))["body"]["action"]
    assert wire["kind"] == type(action).KIND  # tagged by kind on the wire
    assert decode(encode(Suspend(7, 200, 5.0))).action is None


def suspend_with(**action_changes):
    obj = json.loads(encode(Suspend(7, 200, 5.0, action=ACTIONS[0])))
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

    cmd = Resume(7, 4.0, action=ACTIONS[0])
    assert decode(encode(cmd)) == cmd
    plan = ValidationPlan("all", ["dp"], 256, 10, 1, 2, 4096, 5, 2, verdict_wait_s=2.0)
    sus = Suspend(7, 12, 4.0, validation=plan)
    assert decode(encode(sus)).validation.verdict_wait_s == 2.0
    wire = json.loads(encode(sus))
    del wire["body"]["validation"]["verdict_wait_s"]
    assert decode(json.dumps(wire)).validation.verdict_wait_s == 0.0  # an older controller's plan
    wire["body"]["validation"]["verdict_wait_s"] = -1.0
    with pytest.raises(MessageError, match="verdict_wait_s"):
        decode(json.dumps(wire))


# --- commands: one class per kind, on the wire in the one shape every command had ----------

SHARE = ValidationShare(0, 3, [[0, 3, 0]], [[0, 1, 2]])
COMMANDS = [
    ProfileRequest(4, 3.0, 10.0),
    Share(4, SHARE),
    Suspend(4, 120, 5.0, validation=None, action=ACTIONS[0]),
    Go(4, 5.0),
    Release(4),
    Resume(4, 5.0, action=ACTIONS[4]),
    ValidateRequest(),
    MitigateRequest("S2", plan=[6, 2, 4, 4], id="c1"),
    MitigateRequest("S4", exclude_nodes=[1]),
    MuteRequest(id="c2"),
    UnmuteRequest(),
    SetRequest("suspicious_factor", 1.5, id="c3"),
    TableRequest(id="c4"),
]


def test_every_kind_of_command_has_a_class_and_round_trips_typed():
    assert sorted(COMMAND_KINDS) == sorted({type(c).KIND for c in COMMANDS})
    for cmd in COMMANDS:
        got = decode(encode(cmd), accept={"Command"})
        assert got == cmd and type(got) is type(cmd)


def test_a_command_keeps_the_wire_shape_of_kind_and_args():
    """What the ranks and operators of a build before the typed commands sent and read."""
    assert json.loads(encode(ProfileRequest(4, 3.0, 10.0))) == {"v": 1, "type": "Command", "body": {
        "kind": "profile", "deadline_s": 10.0, "iteration": None, "args": {"session": 4, "window_s": 3.0},
        "action": None, "validation": None, "share": None}}
    assert encode(MitigateRequest("S2", plan=[6, 2, 4, 4], id="c1")) == (
        '{"v":1,"type":"Command","body":{"kind":"mitigate","deadline_s":0.0,"iteration":null,'
        '"args":{"strategy":"S2","plan":[6,2,4,4],"id":"c1"},"action":null,"validation":null,"share":null}}')
    wire = json.loads(encode(Suspend(4, 120, 5.0)))["body"]
    assert (wire["kind"], wire["iteration"], wire["deadline_s"], wire["args"]) == ("suspend", 120, 5.0, {"session": 4})
    assert json.loads(encode(Share(4, SHARE)))["body"]["share"]["first"] == 0


def command(kind="suspend", **body):
    obj = {"kind": kind, "deadline_s": 5.0, "iteration": 120, "args": {"session": 4}}
    obj.update(body)
    return json.dumps({"v": 1, "type": "Command", "body": {k: v for k, v in obj.items() if v != "DROP"}})


@pytest.mark.parametrize(
    "data, word",
    [
        (command(kind="reboot"), "Command: unknown kind 'reboot' (expected one of go, mitigate,"),
        (command(kind="DROP"), "Command: missing field kind"),
        (command(args={"session": 4, "plan": [1]}), "Command(suspend).args: unknown field(s) plan"),
        (command(args={}), "Command(suspend).args: missing field session"),
        (command(args={"session": True}), "Command(suspend).args.session: expected an integer"),
        (command(args={"session": "4"}), "Command(suspend).args.session: expected an integer"),
        (command(iteration=None), "Command(suspend): missing field iteration"),
        (command(iteration=1.5), "Command.iteration"),
        (command(kind="profile", iteration=None, args={"session": 4, "window_s": "3"}),
         "Command(profile).args.window_s: expected a finite number"),
        (command(kind="profile", args={"session": 4, "window_s": 3.0}), "Command(profile).iteration: a profile command has none"),
        (command(kind="release", iteration=None), "Command(release).deadline_s: a release command has none"),
        (command(kind="share", iteration=None, deadline_s=0.0), "Command(share): missing field share"),
        (command(kind="validate", iteration=None, deadline_s=0.0, args={"id": 7}), "Command(validate).args.id"),
        (command(kind="mitigate", iteration=None, deadline_s=0.0, args={"plan": [1]}),
         "Command(mitigate).args: missing field strategy"),
        (command(kind="mitigate", iteration=None, deadline_s=0.0, args={"strategy": "S2", "plan": [1, True]}),
         "Command(mitigate).args.plan: [1, True] is not a list[int] | None"),
        (command(args="session"), "Command.args: expected an object"),
        (command(exec="rm -rf"), "Command: unknown field(s) exec"),
    ],
)
def test_an_ill_formed_command_is_rejected_in_one_line(data, word):
    with pytest.raises(MessageError) as err:
        decode(data)
    assert word in str(err.value) and "\n" not in str(err.value)
