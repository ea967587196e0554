"""A job's control plane on a Redis Cluster (falconext/control/shards.py), against real
cluster-mode ``redis-server`` processes: each node's streams on one shard, the controller
reading every shard and posting commands to every shard, node agents forwarding over their
shard, a lost shard failing open and said once, and the launcher's one-line refusals of a
URL that names no usable cluster."""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import pytest

from falconext.control.agent import NodeAgent
from falconext.control.client import BEATS_STREAM, CMD_STREAM, CTL_STREAM, node_copy, node_stream
from falconext.control.plane import ControlPlane, start_plane
from falconext.control.redis_client import redis_client
from falconext.control.redis_server import start_redis
from falconext.control.shards import (
    Shard,
    ShardedBus,
    cluster_url,
    home,
    open_bus,
    read_shards,
    route,
    shard_url,
    split_url,
    tag_for,
)
from falconext.control.bus import Bus
from falconext.protocol.commands import Suspend
from falconext.protocol.messages import FailSlowReport, Heartbeat, NodeHealth, NodeHeartbeats
from redis.crc import key_slot

JOB = "shardjob"


def report(rank: int) -> FailSlowReport:
    return FailSlowReport(rank=rank, onset=150, detected_at=164, slowdown=1.4, baseline_s=0.34, time=time.time())


def read_until(bus, streams: list[str], n: int, timeout_s: float = 5.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got += bus.read(streams, block_ms=100)
    return got




# --- pure ---------------------------------------------------------------------------------


def test_a_nodes_streams_go_to_its_shard_and_the_controllers_to_every_shard():
    assert route("node:7", 3) == route("ctl@7", 3) == route("beats@7", 3) == route("cmd@7", 3) == 1
    assert route("node:9", 3) == 0
    assert route("ctl", 3) is None and route("beats", 3) is None  # the controller reads every shard
    assert route("ctl", 3, post=True) == 0  # an operator's command: one copy, on shard 0
    assert route("cmd", 3, post=True) is None and route("cmd", 3) == 0  # commands go to every shard
    for name in ("status", "controller", "reply:ab12", "localized", "spare:host-a"):
        assert route(name, 3) == route(name, 3, post=True) == 0


def test_the_cluster_url_carries_the_shards_and_keeps_the_password():
    shards = [Shard("127.0.0.1", 7001, "s0"), Shard("10.0.0.2", 7002, "s5")]
    url = cluster_url("redis://:pw@127.0.0.1:7001/0", shards)
    base, back = split_url(url)
    assert base == "redis://:pw@127.0.0.1:7001/0" and back == shards
    assert shard_url(base, shards[1]) == "redis://:pw@10.0.0.2:7002/0"
    assert home(url, "j") == ("redis://:pw@127.0.0.1:7001/0", "falcon:{s0}:j:")
    assert home("redis://:pw@h:1/0", "j") == ("redis://:pw@h:1/0", "falcon:j:")
    assert split_url("redis://:pw@h:1/0") == ("redis://:pw@h:1/0", [])
    for bad in ("redis://h:1/0#x=1", "redis://h:1/0#shards=h:1", "redis://h:1/0#shards=h:x/s0"):
        with pytest.raises(ValueError) as err:
            split_url(bad)
        assert "\n" not in str(err.value) and "control-plane URL" in str(err.value)


def test_each_tag_hashes_into_its_range():
    for lo, hi in ((0, 5460), (5461, 10922), (10923, 16383), (100, 100)):
        assert lo <= key_slot(tag_for(lo, hi).encode()) <= hi


# --- real cluster ---------------------------------------------------------------------------


def test_the_slot_map_gives_one_tag_per_master_that_the_master_serves(cluster):
    shards = read_shards(cluster.url)
    assert [s.port for s in shards] == [s.port for s in cluster.shards]  # slot order: as started
    for shard in shards:
        client = redis_client(shard_url(cluster.url, shard), 2.0)
        try:  # a plain client on that master: its own slot, no MOVED
            client.set(f"falcon:{{{shard.tag}}}:probe", "1")
            assert client.get(f"falcon:{{{shard.tag}}}:probe") == b"1"
        finally:
            client.close()


def test_node_traffic_stays_on_its_shard_and_the_controller_reads_every_shard(cluster, url):
    ctl = open_bus(url, JOB)
    assert isinstance(ctl, ShardedBus) and len(ctl.buses) == 3
    nodes = [open_bus(url, JOB) for _ in range(6)]
    try:
        for n, bus in enumerate(nodes):
            assert bus.post(node_copy(CTL_STREAM, n), report(n))
        got = read_until(ctl, [CTL_STREAM], 6)
        assert sorted(m.rank for _, m in got) == list(range(6)) and {s for s, _ in got} == {CTL_STREAM}
        # each node's copy is on its own shard: node n's report is on shard n % 3 only
        per_shard = Counter()
        for k, shard in enumerate(read_shards(cluster.url)):
            client = redis_client(shard_url(cluster.url, shard), 2.0)
            per_shard[k] = client.xlen(f"falcon:{{{shard.tag}}}:{JOB}:ctl")
            client.close()
        assert per_shard == Counter({0: 2, 1: 2, 2: 2})
        # a command reaches every node once, from its own shard's copy
        assert ctl.post(CMD_STREAM, Suspend(7, 200, 5.0))
        for n, bus in enumerate(nodes):
            cmds = read_until(bus, [node_copy(CMD_STREAM, n)], 1)
            assert [type(m).__name__ for _, m in cmds] == ["Suspend"], n
            assert bus.read([node_copy(CMD_STREAM, n)]) == []
        # several in one round trip per shard, encoded once: every node gets them in order
        assert ctl.post_many(CMD_STREAM, [Suspend(8, 201, 5.0), Suspend(9, 202, 5.0)])
        for n, bus in enumerate(nodes):
            assert [m.session for _, m in read_until(bus, [node_copy(CMD_STREAM, n)], 2)] == [8, 9], n
        # an operator's command (posted without a node) is read once
        assert nodes[4].post(CTL_STREAM, report(99))
        assert [m.rank for _, m in read_until(ctl, [CTL_STREAM], 1)] == [99]
        assert ctl.read([CTL_STREAM], block_ms=200) == []
        assert ctl.put("status", "x", 5.0) and ctl.get("status") == "x"
        assert ctl.read([], block_ms=50) == []
    finally:
        ctl.close()
        for bus in nodes:
            bus.close()


def test_a_node_agent_forwards_over_its_shard(cluster, url):
    ctl = open_bus(url, JOB + "a")
    agent_bus, rank_bus = open_bus(url, JOB + "a"), open_bus(url, JOB + "a")
    agent = NodeAgent(agent_bus, 5, lambda: [{"gpu": 0}], ranks={10, 11}, heartbeat_s=0.1)
    try:
        now = time.time()
        for r in (10, 11):
            rank_bus.post(node_stream(5), Heartbeat(r, 5, 40, 0.3, now))
        rank_bus.post(node_stream(5), report(11))
        ctl.post(CMD_STREAM, Suspend(3, 60, 5.0))
        got: list = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(got) < 3:
            agent.step(block_ms=50)
            got += ctl.read([CTL_STREAM, BEATS_STREAM])
        kinds = Counter(type(m).__name__ for _, m in got)
        assert kinds == Counter({"NodeHeartbeats": 1, "FailSlowReport": 1, "NodeHealth": 1}), got
        beats = next(m for _, m in got if isinstance(m, NodeHeartbeats))
        assert sorted(b.rank for b in beats.beats()) == [10, 11]
        assert next(m for _, m in got if isinstance(m, NodeHealth)).session == 3
    finally:
        for bus in (ctl, agent_bus, rank_bus):
            bus.close()


def test_a_lost_shard_fails_open_is_said_once_and_is_read_again_when_back(cluster, url):
    states: list[tuple[bool, str]] = []
    ctl = open_bus(url, JOB + "k", on_state=lambda ok, why: states.append((ok, why)))
    nodes = [open_bus(url, JOB + "k") for _ in range(3)]
    lost = cluster.shards[1]
    try:
        cluster.kill_shard(1)
        t0 = time.monotonic()
        assert not nodes[1].post(node_copy(CTL_STREAM, 1), report(1))  # node 1's shard: fails at once
        assert nodes[0].post(node_copy(CTL_STREAM, 0), report(0)) and nodes[2].post(node_copy(CTL_STREAM, 2), report(2))
        got = read_until(ctl, [CTL_STREAM], 2)
        assert sorted(m.rank for _, m in got) == [0, 2]  # the other shards still serve
        assert time.monotonic() - t0 < 5.0
        assert [ok for ok, _ in states] == [False] and f"shard 1 (127.0.0.1:{lost.port})" in states[0][1]
        cluster.restart_shard(1)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not nodes[1].post(node_copy(CTL_STREAM, 1), report(11)):
            time.sleep(0.2)
        got = read_until(ctl, [CTL_STREAM], 1, timeout_s=10)
        assert [m.rank for _, m in got] == [11]  # the restarted shard's empty stream is read from its start
        assert [ok for ok, _ in states] == [False, True] and "shard 1" in states[1][1]
    finally:
        ctl.close()
        for bus in nodes:
            bus.close()


def test_a_plain_url_opens_a_plain_bus(cluster):
    bus = open_bus(cluster.url, JOB)
    try:
        assert type(bus) is Bus
    finally:
        bus.close()


# --- the launcher's refusals ----------------------------------------------------------------


def _args(tmp_path: Path, url: str | None) -> argparse.Namespace:
    return argparse.Namespace(falcon=True, out=str(tmp_path), nproc=4, ranks_per_node=2, falcon_redis_url=url,
                              falcon_redis_shards=3)


def test_a_url_that_is_no_cluster_is_one_line_and_the_job_trains_on_without_the_plane(tmp_path, capsys):
    with start_redis() as single:  # a server, not in cluster mode
        env: dict[str, str] = {}
        assert start_plane(_args(tmp_path, single.url), env) is None
        assert env["FALCON_REDIS_URL"] == ""
        out = capsys.readouterr().out.strip().splitlines()
        assert len(out) == 1 and "not in cluster mode" in out[0]
        assert "training goes on without falconext's control plane" in out[0] and single.password not in out[0]
    dead = "redis://:secret@127.0.0.1:9/0"  # nothing listens on the discard port
    env = {}
    assert start_plane(_args(tmp_path, dead), env) is None
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and "not reachable" in line and "secret" not in line


def test_the_launcher_starts_a_cluster_and_names_it_in_control_json(tmp_path):
    plane = ControlPlane(str(tmp_path), 4, 2, ["--falcon-redis-shards", "3"], shards=3, agents=False)
    try:
        plane.start()
        base, shards = split_url(plane.url)
        assert len(shards) == 3 and plane.cluster is not None
        info = json.loads((tmp_path / "control.json").read_text())
        assert [s["port"] for s in info["redis_shards"]] == [s.port for s in shards]
        assert "#shards=" in json.loads((tmp_path / "access.json").read_text())["url"]
    finally:
        plane.stop()
    assert all(not s.alive() for s in plane.cluster.shards)
