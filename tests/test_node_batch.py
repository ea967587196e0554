"""The control flow combined per node (issue 33): the NodeBatch message, the agent's runs,
and the controller taking a node's batch as its ranks' messages."""

from __future__ import annotations

import json
import time

from dataclasses import fields

import pytest

from falconext.config import FalconConfig
from falconext.control.agent import NodeAgent, combined, runs
from falconext.control.bus import Bus
from falconext.control.client import CTL_STREAM, node_stream
from falconext.control.controller import Controller
from falconext.protocol.base import MessageError
from falconext.protocol.codec import MAX_MESSAGE_BYTES, decode, encode, pack_batch
from falconext.protocol.messages import (
    FailSlowReport,
    Heartbeat,
    NodeBatch,
    ProfileData,
    RankEvent,
    SessionAck,
    ValidationResult,
    batch_columns,
)


def ack(rank: int, status: str = "held", session: int = 7) -> SessionAck:
    """An ack with every field away from its default (a lost column would show)."""
    return SessionAck(rank, session, status, 120, 1795000000.25 + rank, pause_s=0.5, expired=True, committed=True)


def profile(rank: int, session: int = 7) -> ProfileData:
    return ProfileData(rank, session, {"dp0": "dp", f"pp{rank}": "pp"}, {f"pp{rank}": [rank, rank + 64]},
                       {"dp0": [[0, 10.0 + rank / 1000, 10.5, 5e7], [1, 11.0, 11.5, 5e7]]},
                       spans={"dp0": [0, 1, 64]}, fabric="nvlink", nccl_algo="Ring")


KINDS = {
    "SessionAck": lambda r: ack(r),
    "FailSlowReport": lambda r: FailSlowReport(r, 40, 54, 2.0, 0.3, 1.5 + r, event_id=3, end=None if r % 2 else 60),
    "ValidationResult": lambda r: ValidationResult(r, 7, 4e14 if r % 2 else None, [[r - 1, r, 0.001]] if r else [],
                                                   error="" if r else "no GPU"),
    "ProfileData": profile,
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_node_s_messages_of_one_kind_travel_in_one_batch_and_come_out_whole(kind):
    msgs = [KINDS[kind](r) for r in (8, 9, 10, 11, 12, 13, 14, 15)]
    (batch,) = pack_batch(1, msgs)
    got = decode(encode(batch))
    assert isinstance(got, NodeBatch) and got.node == 1 and got.kind == kind
    assert got.messages() == msgs
    # every field keeps its type (what a decoder caches beside the fields is not one)
    assert [type(getattr(got.messages()[0], f.name)) for f in fields(msgs[0])] == [type(getattr(msgs[0], f.name)) for f in fields(msgs[0])]


def test_a_batch_is_split_to_fit_the_cap_in_order():
    msgs = [profile(r) for r in range(64)]
    out = pack_batch(0, msgs, max_bytes=4000)
    assert len(out) > 1 and all(len(encode(b).encode()) <= 4000 for b in out)
    assert [m for b in out for m in decode(encode(b)).messages()] == msgs
    assert all(len(encode(b).encode()) <= MAX_MESSAGE_BYTES for b in pack_batch(0, [profile(r) for r in range(500)]))


def test_packing_refuses_mixed_kinds_a_repeated_rank_and_other_messages():
    with pytest.raises(MessageError, match="one kind"):
        pack_batch(0, [ack(1), profile(2)])
    with pytest.raises(MessageError, match="one kind"):
        pack_batch(0, [RankEvent(1, "x", 1.0, {}), RankEvent(2, "x", 1.0, {})])
    with pytest.raises(MessageError, match="distinct"):
        pack_batch(0, [ack(1), ack(1, "resumed")])


def _body(of: str = "SessionAck", **changes) -> str:
    obj = json.loads(encode(pack_batch(2, [KINDS[of](r) for r in (16, 17)])[0]))
    obj["body"].update(changes)
    return json.dumps(obj)


ACK_ROW = [getattr(ack(16), c) for c in batch_columns("SessionAck")]
PROFILE_ROW = json.loads(_body("ProfileData"))["body"]["rows"][0]


def _row(base: list, i: int, value) -> list:
    row = list(base)
    row[i] = value
    return row


@pytest.mark.parametrize("data, word", [
    (_body(kind="Heartbeat"), "NodeBatch.kind: 'Heartbeat' is not one of"),
    (_body(kind="NodeBatch"), "NodeBatch.kind"),
    (_body(columns=list(batch_columns("SessionAck"))[::-1]), "NodeBatch.columns: expected the fields of SessionAck"),
    (_body(rows=[]), "NodeBatch.rows: empty"),
    (_body(rows=[ACK_ROW[:-1]]), f"rows[0]: expected {len(ACK_ROW)} values"),
    (_body(rows=[ACK_ROW, ACK_ROW]), "ranks must be distinct"),
    (_body(rows=[_row(ACK_ROW, 0, -3)]), "ranks must be distinct integers >= 0"),
    (_body(rows=[_row(ACK_ROW, 0, "16")]), "ranks must be distinct integers >= 0"),
    (_body(rows=[_row(ACK_ROW, 0, None)]), "ranks must be distinct integers >= 0"),
    (_body(rows=[_row(ACK_ROW, 0, [16])]), "ranks must be distinct integers >= 0"),
    (_body(rows=[_row(ACK_ROW, 0, True)]), "ranks must be distinct integers >= 0"),
    (_body(rows=[_row(ACK_ROW, 0, 16.0)]), "ranks must be distinct integers >= 0"),
    (_body(rows=[_row(ACK_ROW, 1, True)]), "NodeBatch(SessionAck).rows[0].session: expected an integer"),
    (_body(rows=[_row(ACK_ROW, 2, 5)]), "NodeBatch(SessionAck).rows[0].status: expected a string"),
    (_body(rows=[ACK_ROW, _row(_row(ACK_ROW, 0, 17), 4, "NaN")]), "rows[1].time: expected a finite number"),
    (_body(rows=[_row(ACK_ROW, 6, 1)]), "rows[0].expired: expected true or false"),
    (_body(rows="x"), "NodeBatch.rows: expected a list of lists"),
    (_body(node=-1), "NodeBatch.node"),
    (_body(node="1"), "node must be an integer"),
    (_body(extra=1), "expected exactly node, kind, columns and rows"),
    (_body("ProfileData", rows=[_row(PROFILE_ROW, 4, {"dp0": [[0, 11.0, 10.0, 5e7]]})]), "ProfileData.calls[dp0][0]"),
    (_body("ProfileData", rows=[_row(PROFILE_ROW, 4, {"dp0": [[0, "t", 10.0, 5e7]]})]),
     "NodeBatch(ProfileData).rows[0].calls.dp0[0]"),
    (_body("ProfileData", rows=[_row(PROFILE_ROW, 3, {"pp16": [1, "2"]})]), "rows[0].members.pp16[1]"),
    (_body("ValidationResult", rows=[[16, 7, None, [[1, 2]], ""]]), "ValidationResult.links[0]"),
    # the rows of every rank are checked at once; the one at fault is still named
    (_body("ProfileData", rows=[PROFILE_ROW, _row(_row(PROFILE_ROW, 0, 17), 4, {"dp0": [[0, 1.0, True, 5e7]]})]),
     "NodeBatch(ProfileData).rows[1].calls.dp0[0][2]"),
    (_body("ProfileData", rows=[PROFILE_ROW, _row(_row(PROFILE_ROW, 0, 17), 4, {"dp0": [0, 1.0, 2.0, 5e7]})]),
     "NodeBatch(ProfileData).rows[1].calls.dp0[0]"),
    (_body("ProfileData", rows=[_row(PROFILE_ROW, 4, {"dp0": [[0.5, 1.0, 2.0, 5e7]]})]), "ProfileData.calls[dp0][0]"),
    (_body("ValidationResult", rows=[[16, 7, None, [[1, 16, 0.1]], ""], [17, 7, None, [[1, 17, "0.1"]], ""]]),
     "NodeBatch(ValidationResult).rows[1].links[0][2]"),
    (_body("ValidationResult", rows=[[16, 7, None, [[1, 16, 0.1]], ""], [17, 7, None, [[1, 17, 10**400]], ""]]),
     "NodeBatch(ValidationResult).rows[1].links[0][2]"),
    # a batch's links rows are checked together: the bad one is still named
    (_body("ValidationResult", rows=[[16, 7, None, [[1, 16, 0.1]], ""], [17, 7, None, [[1, 17, 0.1], [2, 17, -0.5]], ""]]),
     "ValidationResult.links[1]: expected [src, dst, seconds]"),
    (_body("ValidationResult", rows=[[16, 7, None, [[1, 16, 0.1]], ""], [17, 7, None, [[1.5, 17, 0.1]], ""]]),
     "ValidationResult.links[0]: expected [src, dst, seconds]"),
    # hundreds of numbers are checked as one array: an integer too large for a float is still named
    (_body("ProfileData", rows=[_row(PROFILE_ROW, 4, {"dp0": [[k, 1.0, 2.0, 5e7] for k in range(80)]}),
                                _row(_row(PROFILE_ROW, 0, 17), 4, {"dp0": [[0, 1.0, 2.0, 10**400]]})]),
     "NodeBatch(ProfileData).rows[1].calls.dp0[0][3]"),
    (_body("ProfileData", rows=[_row(PROFILE_ROW, 4, {"dp0": [[k, 1.0, 2.0, 5e7] for k in range(80)]}),
                                _row(_row(PROFILE_ROW, 0, 17), 4, {"dp0": [[0, 1.0, 2.0, 5e7], [1, 1.0, 2.0, -8]]})]),
     "ProfileData.calls[dp0][1]"),
])
def test_a_malformed_batch_is_refused_by_name(data, word):
    with pytest.raises(MessageError, match=word.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")
                       .replace("(", r"\(").replace(")", r"\)")):
        decode(data)


def test_runs_keep_the_order_and_each_rank_once():
    a0, a1, a1r, p2 = ack(0), ack(1), ack(1, "resumed"), profile(2)
    ev = RankEvent(3, "x", 1.0, {})
    assert runs([a0, a1, a1r, p2, ev, ack(4), ack(5)]) == [[a0, a1], [a1r], [p2], [ev], [ack(4), ack(5)]]
    assert runs([ev, RankEvent(4, "y", 1.0, {})]) == [[ev], [RankEvent(4, "y", 1.0, {})]]  # never batched
    assert runs([]) == []
    out = combined(0, [a0, a1, a1r, ev])
    assert [type(m).__name__ for m in out] == ["NodeBatch", "SessionAck", "RankEvent"]  # a lone one goes as it is


def test_the_agent_forwards_what_its_ranks_sent_together_as_one_batch(redis_server):
    rank_bus, agent_bus, ctl_bus = (Bus(redis_server.url, "batch") for _ in range(3))
    agent = NodeAgent(agent_bus, node=1, health=lambda: [], ranks={8, 9, 10, 11})
    acks = [ack(r) for r in (8, 9, 10, 11)]
    for m in acks:
        rank_bus.post(node_stream(1), m)
    rank_bus.post(node_stream(1), ack(3))  # another node's rank: refused, not batched
    deadline = time.monotonic() + 5
    while agent.forwarded < 4 and time.monotonic() < deadline:
        agent.step(block_ms=100)
    got = [m for _, m in ctl_bus.read([CTL_STREAM])]
    assert len(got) == 1 and isinstance(got[0], NodeBatch) and got[0].messages() == acks
    assert agent.forwarded == 4 and agent.refused == 1


def test_the_controller_takes_a_node_s_batch_as_its_ranks_messages():
    """Reports, profiles, acks and results in their nodes' batches (decoded from the wire)
    take the controller where one by one does: the same plan, the "go", the same verdict."""
    world = 8
    by_one, by_node = Controller(FalconConfig(), world=world), Controller(FalconConfig(), world=world)

    def both(make, now):
        """``make(session)``'s messages to by_one one at a time, to by_node in two batches:
        the kinds of what each put out."""
        one = [o for m in make(by_one.session) for o in by_one.handle(m, now)]
        node = [o for k in (0, 1) for b in pack_batch(k, make(by_node.session)[k * 4:k * 4 + 4])
                for o in by_node.handle(decode(encode(b)), now)]
        assert by_node.state == by_one.state
        return one, node

    for ctl in (by_one, by_node):
        for r in range(world):
            ctl.handle(Heartbeat(r, r // 4, 100, 0.5, 1.0), 1.0)
    both(lambda s: [FailSlowReport(r, 90, 100, 2.0, 0.3, 1.0) for r in range(world)], 1.0)
    assert by_node.state.value == "profiling"
    outs_one, outs_node = both(lambda s: late_profiles(world, s), 2.0)
    assert by_node.state.value == "validating"
    assert by_node.localizer.findings == by_one.localizer.findings and by_node.localizer.findings.compute_suspects == [1]
    assert [o.kind for o in outs_node] == [o.kind for o in outs_one]
    at = by_one.suspension.iteration
    outs_one, outs_node = both(lambda s: [SessionAck(r, s, "held", at, 3.0) for r in range(world)], 3.0)
    assert [type(o.message).__name__ for o in outs_node if o.kind == "command"] == ["Go"]
    assert [o.kind for o in outs_node] == [o.kind for o in outs_one]
    outs_one, outs_node = both(lambda s: [ValidationResult(r, s, 2e14 if r == 1 else 4e14, []) for r in range(world)],
                               4.0)
    assert by_node.suspension.acks["held"].keys() == by_one.suspension.acks["held"].keys() == set(range(world))
    (one,), (node,) = ([o.message for o in outs if o.kind == "localized"] for outs in (outs_one, outs_node))
    assert node.gpus == one.gpus == [1]


def test_a_node_s_acks_of_several_statuses_are_taken_one_by_one():
    """A batch whose ranks held and missed: the "missed" releases the ranks and retries in
    a new session, as one by one; the "held" before it does not start the validation."""
    world = 8
    ctl = Controller(FalconConfig(), world=world)
    to_validating(ctl, world)
    session, at = ctl.session, ctl.suspension.iteration
    acks = [SessionAck(r, session, "held", at, 2.0) for r in range(4)] + [SessionAck(4, session, "missed", at + 1, 2.0)]
    (batch,) = pack_batch(1, acks)
    outs = ctl.handle(decode(encode(batch)), 2.0)
    kinds = [type(o.message).__name__ for o in outs if o.kind == "command"]
    assert "Release" in kinds and "Go" not in kinds and ctl.session == session + 1


def test_a_suspension_is_placed_from_the_clock_after_a_long_analysis():
    """The analysis of a large job's profiles takes seconds: the suspension's iteration and
    deadline count from when it is posted (the controller's clock), not from when the last
    profile came."""
    world, late = 4, 30.0

    def localize(clock):
        ctl = Controller(FalconConfig(), world=world, clock=clock)
        to_validating(ctl, world)
        return ctl.suspension

    fixed, clocked = localize(None), localize(lambda: 1.0 + late)
    assert clocked.deadline - fixed.deadline == pytest.approx(late, abs=0.5 * 3)
    assert clocked.iteration - fixed.iteration == pytest.approx(late / 0.5, abs=2)  # 60 iterations further on


def test_a_suspension_is_placed_after_the_plan_is_cut_into_shares():
    """Cutting a 131,072-rank plan into shares takes seconds after the analysis: the
    suspension counts from the clock after that, or the ranks are past its iteration when
    the commands come."""
    world, late = 4, 30.0

    def localize(clock):
        ctl = Controller(FalconConfig(), world=world, clock=clock)
        to_validating(ctl, world)
        return ctl.suspension

    times = iter([1.0])  # the clock after the analysis; then (after the split) 1.0 + late
    fixed, split_late = localize(lambda: 1.0), localize(lambda: next(times, 1.0 + late))
    assert split_late.deadline - fixed.deadline == pytest.approx(late, abs=0.5 * 3)
    assert split_late.iteration - fixed.iteration == pytest.approx(late / 0.5, abs=2)


def test_the_go_gives_the_ranks_their_validation_time_whenever_the_last_ack_came():
    """At 65,536 ranks the last held ack came after the deadline placed for it (the acks
    take seconds to arrive and be read); the verdict must then wait for the results the
    "go" asks for, not be due at once."""
    world, cfg = 4, FalconConfig()
    ctl = Controller(cfg, world=world)
    to_validating(ctl, world)
    placed = ctl.suspension.deadline
    late = placed + 1.0  # every held ack handled after the placement's deadline
    outs = [o for r in range(world) for o in ctl.handle(ack_held(r, ctl), late)]
    assert any(o.kind == "command" and o.message.KIND == "go" for o in outs)
    assert ctl.suspension.deadline >= late + cfg.suspend_deadline_s + cfg.control_slack_s
    assert not [o for o in ctl.tick(late + 0.5) if o.kind == "event" and o.event["type"] == "validation_incomplete"]
    assert ctl.state.value == "validating"


def test_a_passed_deadline_waits_while_the_sessions_acks_are_still_being_taken():
    """At 131,072 ranks the controller reads the held acks for seconds after the ranks sent
    them in time: the session fails only once they stop coming (a rank that never
    answers still fails it), never while they are being taken."""
    world, cfg = 4, FalconConfig()
    ctl = Controller(cfg, world=world)
    to_validating(ctl, world)
    d = ctl.suspension.deadline

    def failed(outs):
        return any(o.kind == "event" and o.event["type"] == "localization_failed" for o in outs)

    ctl.handle(ack_held(0, ctl), d - 0.1)
    ctl.handle(ack_held(1, ctl), d + 1.0)  # taken late: the controller is busy with 100k of them
    assert not failed(ctl.tick(d + 1.5))
    ctl.handle(ack_held(2, ctl), d + 2.5)
    assert not failed(ctl.tick(d + 3.0)) and ctl.state.value == "validating"
    assert failed(ctl.tick(d + 2.5 + cfg.control_slack_s + 0.1))  # rank 3 never answered: they stopped


def ack_held(rank: int, ctl: Controller) -> SessionAck:
    return SessionAck(rank, ctl.session, "held", ctl.suspension.iteration, 2.0)


def late_profiles(world: int, session: int) -> list[ProfileData]:
    """Every rank's profile of one DP group's four all-reduces, rank 1 arriving late."""
    return [ProfileData(r, session, {"dp0": "dp"}, {}, {"dp0": [[k, 10.0 * k + (0.2 if r == 1 else 0.0),
                                                                 10.0 * k + 0.4, 5e7] for k in range(4)]},
                        spans={"dp0": [0, 1, world]}) for r in range(world)]


def to_validating(ctl: Controller, world: int) -> None:
    """Heartbeats, rank 1's report and every rank's profile at t=1: the controller has
    placed its suspension."""
    for r in range(world):
        ctl.handle(Heartbeat(r, 0, 100, 0.5, 1.0), 1.0)
    ctl.handle(FailSlowReport(1, 90, 100, 2.0, 0.3, 1.0), 1.0)
    for p in late_profiles(world, ctl.session):
        ctl.handle(p, 1.0)
    assert ctl.state.value == "validating"


def test_no_mutation_of_a_batch_or_a_node_s_heartbeats_raises_anything_but_a_message_error():
    """Whatever a sender puts in a value's place (another type, a nested list, a huge
    number), decoding says so with a MessageError or decodes: never another exception,
    which the bus would not catch."""
    import random

    from falconext.protocol.codec import pack_heartbeats

    rng = random.Random(5)
    odd = [None, True, "x", -1, 2**70, 1.5, [], [1, "a"], {}, {"a": 1}, [[1.0, "b"]], 10**400]
    bodies = [json.loads(encode(pack_batch(0, [KINDS[k](r) for r in (0, 1, 2)])[0]))["body"] for k in sorted(KINDS)]
    bodies.append(json.loads(encode(pack_heartbeats(0, [Heartbeat(r, 0, 5, 0.5, 1.0) for r in range(3)])[0]))["body"])
    kinds = ["NodeBatch"] * len(KINDS) + ["NodeHeartbeats"]
    tried = 0
    for kind, body in zip(kinds, bodies):
        for _ in range(300):
            b = json.loads(json.dumps(body))
            row = rng.choice(b["rows"])
            row[rng.randrange(len(row))] = rng.choice(odd)
            if rng.random() < 0.2:
                b[rng.choice(list(b))] = rng.choice(odd)
            text = json.dumps({"v": 1, "type": kind, "body": b})
            try:
                decode(text)
            except MessageError:
                pass
            tried += 1
    assert tried == 300 * len(bodies)
