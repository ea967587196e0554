"""A private Redis Cluster for a job that outgrows one Redis server (``--falcon-redis-shards N``).

The same ``redis-server`` as :mod:`falconext.control.redis_server`, N of them in cluster
mode, each a master owning an even share of the 16,384 hash slots: the keys of one hash
tag (``{...}``) stay on one shard, so one node's streams stay together while the
controller reads shards in parallel. Each shard is password-protected (fed on stdin, never
on a command line; the shards authenticate to each other with the same password), has no
persistence of data, and is bound as a single server is (loopback unless the caller names
the cluster interface). A shard keeps its cluster identity in its own folder, so a shard
that is lost and restarted (:meth:`RedisCluster.restart_shard`) rejoins as itself with its
slots. No replicas: like the single server, the control plane survives a lost shard by
failing open, not by failover.

:func:`cluster_problem` is the check for an existing cluster named by a URL file: it says
in one line why the URL is not a usable cluster (unreachable, refused, not in cluster
mode, slots not all served), or None.
"""

from __future__ import annotations

import time
from types import TracebackType

import redis

from falconext.control.redis_client import redis_client, where
from falconext.control.redis_server import RedisServer, RedisUnavailable, start_redis

#: Redis Cluster's hash slots, and the fewest masters it runs with
SLOTS = 16384
MIN_SHARDS = 3


def slot_ranges(shards: int) -> list[tuple[int, int]]:
    """The hash slots of each of ``shards`` masters: contiguous, inclusive ranges as even
    as they go, covering 0..16383 once (pure)."""
    if shards < 1:
        raise ValueError(f"a cluster needs at least one shard, got {shards}")
    out, start = [], 0
    for k in range(shards):
        size = SLOTS // shards + (1 if k < SLOTS % shards else 0)
        out.append((start, start + size - 1))
        start += size
    return out


def check_shard_count(shards: int) -> None:
    """Raise ValueError in one line unless ``shards`` is an integer of at least MIN_SHARDS."""
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < MIN_SHARDS:
        raise ValueError(f"--falcon-redis-shards must be an integer >= {MIN_SHARDS} (Redis Cluster runs with "
                         f"at least {MIN_SHARDS} masters), got {shards!r}")


class RedisCluster:
    """N running cluster-mode ``redis-server`` processes that this Python process owns,
    joined into one cluster; :attr:`url` names the first (a cluster client finds the rest)."""

    def __init__(self, shards: list[RedisServer], ready_timeout_s: float) -> None:
        self.shards = shards
        self.password = shards[0].password
        self.url = shards[0].url
        self.ready_timeout_s = ready_timeout_s

    @property
    def urls(self) -> list[str]:
        """Every shard's own URL (a plain client for one shard)."""
        return [s.url for s in self.shards]

    def join(self) -> None:
        """Give each shard its slots, make them meet, and return once every shard says
        ``cluster_state:ok`` (a RedisUnavailable naming the first that does not, after
        ``ready_timeout_s``)."""
        clients = [redis_client(s.url, 2.0) for s in self.shards]
        try:
            for client, (lo, hi) in zip(clients, slot_ranges(len(self.shards))):
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
            first = self.shards[0]
            for client in clients[1:]:
                client.execute_command("CLUSTER", "MEET", first.host, first.port, first.bus_port)
        finally:
            for client in clients:
                client.close()
        self.wait_ok()

    def wait_ok(self) -> None:
        """Return once every shard reports ``cluster_state:ok`` and knows every other."""
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            problem = self._problem()
            if problem is None:
                return
            if time.monotonic() > deadline:
                raise RedisUnavailable(f"Redis Cluster of {len(self.shards)} shards not ready within "
                                       f"{self.ready_timeout_s:g} s: {problem}")
            time.sleep(0.05)

    def _problem(self) -> str | None:
        for k, shard in enumerate(self.shards):
            client = redis_client(shard.url, 1.0)
            try:
                info = _cluster_info(client)
            except redis.RedisError as exc:
                return f"shard {k} (port {shard.port}): {type(exc).__name__}: {exc}"
            finally:
                client.close()
            if info.get("cluster_state") != "ok" or int(info.get("cluster_known_nodes", 0)) != len(self.shards):
                return (f"shard {k} (port {shard.port}): cluster_state {info.get('cluster_state')}, "
                        f"{info.get('cluster_known_nodes')} known nodes")
        return None

    def kill_shard(self, k: int) -> None:
        """SIGKILL shard ``k``, as a crash would (its cluster identity stays on disk)."""
        self.shards[k].kill()

    def restart_shard(self, k: int) -> None:
        """Start shard ``k`` again on its ports and folder: it rejoins as itself, with its
        slots and no data; returns once the cluster is ok again."""
        self.shards[k].start()
        self.wait_ok()

    def stop(self) -> None:
        """Stop every shard and delete their folders; safe to call twice."""
        for shard in self.shards:
            shard.stop()

    def __enter__(self) -> RedisCluster:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"RedisCluster(shards={[s.port for s in self.shards]})"


def start_redis_cluster(shards: int, password: str | None = None, bind: str = "127.0.0.1",
                        ready_timeout_s: float = 20.0) -> RedisCluster:
    """Start ``shards`` (>= MIN_SHARDS) password-protected cluster-mode redis-servers bound
    to ``bind``, one password for all, and join them into one cluster; a ValueError for a
    bad count, a RedisUnavailable (everything started is stopped) when it cannot start."""
    check_shard_count(shards)
    started: list[RedisServer] = []
    try:
        for _ in range(shards):
            node = start_redis(password=password, bind=bind, ready_timeout_s=ready_timeout_s, cluster=True)
            password = node.password
            started.append(node)
        cluster = RedisCluster(started, ready_timeout_s)
        cluster.join()
        return cluster
    except BaseException:
        for node in started:
            node.stop()
        raise


def _cluster_info(client: redis.Redis) -> dict[str, str]:
    """``CLUSTER INFO`` as a dict of strings (raises redis.RedisError as the client does)."""
    raw = client.execute_command("CLUSTER", "INFO")
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def cluster_problem(url: str, timeout_s: float = 2.0) -> str | None:
    """Why ``url`` does not name a usable Redis Cluster, in one line, or None: not
    reachable, refused (password), not in cluster mode, or not every slot served."""
    client = redis_client(url, timeout_s)
    try:
        info = _cluster_info(client)
    except redis.AuthenticationError as exc:
        return f"Redis at {where(url)} refused the password: {exc}"
    except redis.ResponseError as exc:
        if "cluster support disabled" in str(exc).lower():
            return f"Redis at {where(url)} is not in cluster mode (cluster support disabled)"
        return f"Redis at {where(url)} refused CLUSTER INFO: {exc}"
    except redis.RedisError as exc:
        return f"Redis Cluster at {where(url)} is not reachable: {type(exc).__name__}: {exc}"
    finally:
        client.close()
    if info.get("cluster_state") != "ok" or info.get("cluster_slots_ok") != str(SLOTS):
        return (f"Redis Cluster at {where(url)} is not serving every slot (cluster_state "
                f"{info.get('cluster_state')}, {info.get('cluster_slots_ok')} of {SLOTS} slots ok)")
    return None


__all__ = ["MIN_SHARDS", "RedisCluster", "check_shard_count", "cluster_problem", "slot_ranges",
           "start_redis_cluster"]
