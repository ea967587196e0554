"""The Redis Cluster a large job's control plane can run on (falconext/control/redis_cluster.py):
real ``redis-server`` processes in cluster mode, no mock. Started, joined and checked; keys
of one hash tag on one shard and tags spread over the shards; password and bind as a
single server's; a shard killed and restarted rejoins; a URL that names no usable cluster
and a shard count below 3 get one line each."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import redis

from falconext.control.redis_client import redis_client
from falconext.control.redis_cluster import (
    MIN_SHARDS,
    SLOTS,
    check_shard_count,
    cluster_problem,
    slot_ranges,
    start_redis_cluster,
)



def cluster_client(url: str) -> redis.RedisCluster:
    return redis.RedisCluster.from_url(url, socket_timeout=2.0)


def test_slots_are_shared_evenly_and_all_covered():
    for n in (1, 3, 7, 16):
        ranges = slot_ranges(n)
        assert ranges[0][0] == 0 and ranges[-1][1] == SLOTS - 1
        assert all(b[0] == a[1] + 1 for a, b in zip(ranges, ranges[1:]))
        sizes = [hi - lo + 1 for lo, hi in ranges]
        assert max(sizes) - min(sizes) <= 1 and sum(sizes) == SLOTS


@pytest.mark.parametrize("bad", [2, 0, -1, True, "3", 2.5])
def test_a_shard_count_below_three_is_one_line(bad):
    with pytest.raises(ValueError) as err:
        check_shard_count(bad)
    assert "--falcon-redis-shards" in str(err.value) and f">= {MIN_SHARDS}" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError):
        start_redis_cluster(bad)


def test_three_shards_serve_every_slot_and_spread_the_nodes_tags(cluster):
    assert cluster_problem(cluster.url) is None
    client = cluster_client(cluster.url)
    try:
        # one node's streams share a hash tag: one slot, one shard; 64 nodes' tags spread
        for node in range(64):
            for name in ("beat", "ack", "cmd"):
                client.xadd(f"falcon:{{job:n{node}}}:{name}", {"v": str(node)})
        assert len({client.keyslot(f"falcon:{{job:n7}}:{name}") for name in ("beat", "ack", "cmd")}) == 1
        got = client.xrange("falcon:{job:n7}:beat")
        assert [fields[b"v"] for _, fields in got] == [b"7"]
    finally:
        client.close()
    per_shard = Counter()
    for k, url in enumerate(cluster.urls):
        shard = redis_client(url, 2.0)
        try:
            per_shard[k] = shard.dbsize()
            assert shard.config_get("bind")["bind"] == "127.0.0.1"
        finally:
            shard.close()
    assert sum(per_shard.values()) == 64 * 3 and all(per_shard[k] > 0 for k in range(3)), per_shard


def test_shards_want_the_password_and_keep_it_off_the_command_line(cluster):
    for shard in cluster.shards:
        anonymous = redis.Redis(host=shard.host, port=shard.port, socket_timeout=2.0)
        try:
            with pytest.raises(redis.AuthenticationError):
                anonymous.ping()
        finally:
            anonymous.close()
        cmdline = Path(f"/proc/{shard.pid}/cmdline").read_bytes().decode(errors="replace")
        assert cluster.password not in cmdline and "[cluster]" in cmdline  # redis-server retitles itself


def test_a_shard_lost_and_back_rejoins_with_its_slots(cluster):
    client = cluster_client(cluster.url)
    try:
        keys = [f"falcon:{{job:n{node}}}:beat" for node in range(32)]
        lost = cluster.shards[1]
        on_lost = [k for k in keys if client.get_node_from_key(k).port == lost.port]
        assert on_lost
        cluster.kill_shard(1)
        cluster.restart_shard(1)
        assert cluster_problem(cluster.url) is None
        for k in on_lost:  # its data is gone (no persistence), its slots are served again
            client.xadd(k, {"v": "again"})
            assert [f[b"v"] for _, f in client.xrange(k)][-1] == b"again"
    finally:
        client.close()


def test_a_url_that_names_no_usable_cluster_says_why_in_one_line(cluster, redis_server):
    plain = cluster_problem(redis_server.url)
    assert plain is not None and "not in cluster mode" in plain
    wrong = cluster.url.replace(cluster.password, "not-the-password")
    refused = cluster_problem(wrong)
    assert refused is not None and "refused" in refused
    dead = cluster_problem("redis://:pw@127.0.0.1:1/0", timeout_s=0.5)
    assert dead is not None and "not reachable" in dead
    for line in (plain, refused, dead):
        assert "\n" not in line and cluster.password not in line
