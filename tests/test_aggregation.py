"""Heartbeats combined per node (issue 17's scale): the NodeHeartbeats message, the agents'
aggregator, and the controller reading its control stream before a backlog of them."""

from __future__ import annotations

import json
import random
import statistics
import threading
import time

import pytest

from falconext.config import FalconConfig
from falconext.control.agent import HeartbeatAggregator, NodeAgent
from falconext.control.bus import Bus
from falconext.control.client import BEATS_STREAM, CMD_STREAM, CTL_STREAM, node_stream
from falconext.control.controller import Controller
from falconext.protocol.base import MessageError
from falconext.protocol.codec import MAX_MESSAGE_BYTES, decode, encode, pack_heartbeats
from falconext.protocol.commands import Command
from falconext.protocol.messages import HEARTBEAT_COLUMNS, FailSlowReport, Heartbeat, NodeHeartbeats, ProfileData
from falconext.detect.scores import peer_medians
from falconext.profile.window import analyze_window


def beat(rank: int, node: int, it: int = 100, **kw) -> Heartbeat:
    """A heartbeat with every field away from its default (a lost column would show)."""
    return Heartbeat(rank, node, it, 0.5 + rank / 1e4, 1795000000.123456 + rank, replica=rank % 4, mb_s=0.0625,
                     micro=8, restart_s=12.5, switch_s=0.75, role=rank, stage=rank // 4, tp=2, pp=4,
                     grad_bytes=50_000_000, act_bytes=4_000_000, score_iteration=it - 1, est_iter_s=0.49,
                     compute_s=0.4, wait_s=0.09, **kw)


# --- the message ---------------------------------------------------------------------------------


def test_a_node_s_heartbeats_travel_in_one_message_and_come_out_whole():
    beats = [beat(r, 3) for r in (31, 24, 27, 25, 26, 28, 29, 30)]
    (msg,) = pack_heartbeats(3, beats)
    got = decode(encode(msg))
    assert isinstance(got, NodeHeartbeats) and got.node == 3
    assert got.beats() == sorted(beats, key=lambda b: b.rank)
    assert all(type(b.rank) is int and type(b.iteration) is int for b in got.beats())
    assert len(encode(msg)) < 2500  # 8 ranks: a few KB, far under the cap


def test_columns_left_out_take_the_defaults():
    msg = NodeHeartbeats(2, ["rank", "iteration", "iter_s", "time"], [[17, 40, 0.3, 5.0]])
    assert decode(encode(msg)).beats() == [Heartbeat(17, 2, 40, 0.3, 5.0)]


@pytest.mark.parametrize("ranks", [1, 8, 64, 300, 2000])
def test_packing_stays_under_the_cap_whatever_the_node_size(ranks):
    beats = [beat(r, 0) for r in range(ranks)]
    msgs = pack_heartbeats(0, beats)
    assert all(len(encode(m).encode()) <= MAX_MESSAGE_BYTES for m in msgs)
    assert len(msgs) == (1 if ranks <= 200 else len(msgs)) and len(msgs) <= ranks // 200 + 2
    assert [b for m in msgs for b in decode(encode(m)).beats()] == beats


def test_packing_refuses_another_node_s_beat():
    with pytest.raises(MessageError, match="another node"):
        pack_heartbeats(1, [beat(8, 1), beat(0, 0)])


def _body(**changes):
    obj = json.loads(encode(pack_heartbeats(1, [beat(8, 1), beat(9, 1)])[0]))
    obj["body"].update(changes)
    return json.dumps(obj)


ROW = [getattr(beat(8, 1), c) for c in HEARTBEAT_COLUMNS]


@pytest.mark.parametrize("data, word", [
    (_body(columns=list(HEARTBEAT_COLUMNS[:-1]) + ["evil"]), "unknown or repeated column"),
    (_body(columns=["rank", "rank", "iter_s", "time"], rows=[[1, 1, 0.5, 1.0]]), "unknown or repeated column"),
    (_body(columns=["rank", "iter_s", "time"], rows=[[1, 0.5, 1.0]]), "missing iteration"),
    (_body(rows=[ROW[:-1]]), f"expected {len(HEARTBEAT_COLUMNS)} values"),
    (_body(rows=[[8.5] + ROW[1:]]), "rows[0].rank: expected a whole number"),
    (_body(rows=[ROW, ROW]), "rows[1].rank"),
    (_body(rows=[["8"] + ROW[1:]]), "NodeHeartbeats.rows[0][0]"),
    (_body(rows=[[True] + ROW[1:]]), "NodeHeartbeats.rows[0][0]"),
    (_body(rows=[[10**400] + ROW[1:]]), "NodeHeartbeats.rows[0][0]"),
    (_body(node=-1), "NodeHeartbeats.node"),
    (_body(extra=1), "unknown field"),
])
def test_a_malformed_aggregate_is_refused_by_name(data, word):
    with pytest.raises(MessageError, match=word.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        decode(data)


def test_profiles_carry_evenly_spaced_groups_as_spans():
    members = {"dp0": list(range(0, 4096)), "pp1": [1, 1025, 2049, 3073], "odd": [0, 5, 6], "p2p": [3, 4]}
    calls = {"dp0": [[0, 1.0, 1.5, 1000]]}
    p = ProfileData.compact(1, 7, {g: "dp" for g in members}, members, calls)
    assert p.spans == {"dp0": [0, 1, 4096], "pp1": [1, 1024, 4]} and p.members == {"odd": [0, 5, 6], "p2p": [3, 4]}
    got = decode(encode(p))
    assert {g: list(m) for g, m in got.group_members().items()} == members
    assert len(encode(p)) < 400
    bad = json.loads(encode(p))
    bad["body"]["spans"]["odd"] = [0, 1, 2]  # a group in both
    with pytest.raises(MessageError, match="ProfileData.spans"):
        decode(json.dumps(bad))


def test_analysis_reads_spans_as_members():
    """Two DP groups of 4 (spans), rank 1 late in every all-reduce: the same suspect as
    with the members listed."""
    def windows(compact):
        out = []
        for r in range(8):
            g = f"dp{r // 4}"
            rows = [[k, k + (0.3 if r == 1 else 0.0), k + 0.35, 1 << 20] for k in range(6)]
            make = ProfileData.compact if compact else ProfileData
            out.append(make(r, 1, {g: "dp"}, {g: list(range(r // 4 * 4, r // 4 * 4 + 4))}, {g: rows}))
        return out
    assert analyze_window(windows(True)) == analyze_window(windows(False))
    assert analyze_window(windows(True)).compute_suspects == [1]


def test_peer_medians_are_the_medians_of_the_others():
    rng = random.Random(17)
    for n in range(2, 30):
        values = [rng.choice([0.1, 0.2, rng.random()]) for _ in range(n)]
        assert peer_medians(values) == [statistics.median(values[:i] + values[i + 1:]) for i in range(n)]


# --- the aggregator ------------------------------------------------------------------------------


def test_the_aggregator_sends_when_every_rank_of_the_node_beat_or_the_period_passed():
    agg = HeartbeatAggregator(1, 0.5, ranks={8, 9, 10})
    assert not agg.due(0.0) and agg.wait_s(0.0) is None and agg.flush() == []
    agg.add(beat(8, 1, 100), 10.0)
    agg.add(beat(8, 1, 101), 10.1)  # the newer beat of the same rank replaces the older
    agg.add(beat(9, 1, 100), 10.2)
    assert not agg.due(10.3) and agg.wait_s(10.3) == pytest.approx(0.2)
    assert agg.due(10.5)  # the period since the first beat
    agg.add(beat(10, 1, 100), 10.31)
    assert agg.due(10.31)  # every rank of the node is in
    (msg,) = agg.flush()
    assert [(b.rank, b.iteration) for b in msg.beats()] == [(8, 101), (9, 100), (10, 100)]
    assert agg.superseded == 1 and not agg.due(99.0)


def test_the_agent_combines_its_ranks_heartbeats_and_forwards_the_rest_at_once(redis_server):
    rank_bus, agent_bus, ctl_bus = (Bus(redis_server.url, "agg") for _ in range(3))
    agent = NodeAgent(agent_bus, node=1, health=lambda: [], ranks={2, 3}, heartbeat_s=5.0)
    rank_bus.post(node_stream(1), beat(2, 1))
    rank_bus.post(node_stream(1), FailSlowReport(3, 40, 54, 2.0, 0.3, 1.0))
    rank_bus.post(node_stream(1), beat(3, 1))
    deadline = time.monotonic() + 5
    while agent.forwarded < 3 and time.monotonic() < deadline:
        agent.step(block_ms=100)
    ctl = [m for _, m in ctl_bus.read([CTL_STREAM])]
    beats = [m for _, m in ctl_bus.read([BEATS_STREAM])]
    assert [type(m).__name__ for m in ctl] == ["FailSlowReport"]
    assert len(beats) == 1 and [b.rank for b in beats[0].beats()] == [2, 3]  # both in, before the period
    assert agent.forwarded == 3


# --- the controller ------------------------------------------------------------------------------


def test_the_controller_takes_a_node_message_as_its_ranks_heartbeats():
    ctl = Controller(FalconConfig(), world=8)
    for node in (0, 1):
        (msg,) = pack_heartbeats(node, [beat(r, node) for r in range(node * 4, node * 4 + 4)])
        ctl.handle(decode(encode(msg)), 1.0)
    assert sorted(ctl.beats) == list(range(8)) and ctl.beats[5] == beat(5, 1)


def test_a_report_is_handled_before_a_backlog_of_heartbeats(redis_server, tmp_path):
    """The real controller loop: 1500 node messages (12,000 heartbeats) wait on the beats
    stream, then a report comes: the profile command goes out while most of them still
    wait; a malformed aggregate among them is dropped and counted, and the loop goes on."""
    from falconext.control.service import run_controller

    stop = [False]
    events = tmp_path / "events.jsonl"
    cfg = FalconConfig(link_baseline_iteration=0)
    thread = threading.Thread(target=run_controller, args=(redis_server.url, "prio", 12_000, str(events), cfg, stop),
                              daemon=True)
    thread.start()
    bus = Bus(redis_server.url, "prio", maxlen=100_000)
    try:
        deadline = time.monotonic() + 20
        while "controller_started" not in (events.read_text() if events.exists() else ""):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.2)
        bus.post_raw(BEATS_STREAM, {"m": _body(rows=[[8.5] + ROW[1:]])})
        data = [encode(m) for node in range(1500) for m in pack_heartbeats(node, [beat(node * 8 + i, node)
                                                                                   for i in range(8)])]
        pipe = bus._client.pipeline(transaction=False)
        for d in data:
            pipe.xadd(bus.key(BEATS_STREAM), {"m": d})
        pipe.execute()
        bus.post(CTL_STREAM, FailSlowReport(5, 40, 54, 2.0, 0.3, time.time(), 1))
        got = None
        while got is None and time.monotonic() < deadline:
            got = next((m for _, m in bus.read([CMD_STREAM], block_ms=50) if isinstance(m, Command)), None)
        waiting = bus._client.xlen(bus.key(BEATS_STREAM))
        assert got is not None and got.KIND == "profile"
        assert waiting > 500, f"only {waiting} node messages were still waiting"
        while bus._client.xlen(bus.key(BEATS_STREAM)) and time.monotonic() < deadline:
            time.sleep(0.05)  # the backlog drains, and the controller trims what it read
        assert bus._client.xlen(bus.key(BEATS_STREAM)) == 0
        time.sleep(0.3)
        dropped = [json.loads(line) for line in events.read_text().splitlines() if '"message_dropped"' in line]
        assert dropped and "NodeHeartbeats.rows[0].rank" in dropped[0]["error"]
        assert "controller_error" not in events.read_text()
    finally:
        stop[0] = True
        thread.join(10)
        bus.close()


def test_a_read_takes_at_most_count_and_trim_read_removes_what_was_read(redis_server):
    bus = Bus(redis_server.url, "trim")
    for r in range(10):
        assert bus.post(BEATS_STREAM, pack_heartbeats(0, [beat(r, 0)])[0])
    assert bus.trim_read(BEATS_STREAM) is False  # nothing read yet: nothing removed
    got = bus.read([BEATS_STREAM], count=3)
    assert [m.beats()[0].rank for _, m in got] == [0, 1, 2]
    assert bus.trim_read(BEATS_STREAM) and bus._client.xlen(bus.key(BEATS_STREAM)) == 7
    assert [m.beats()[0].rank for _, m in bus.read([BEATS_STREAM])] == list(range(3, 10))
    with pytest.raises(ValueError, match="count"):
        bus.read([BEATS_STREAM], count=0)
