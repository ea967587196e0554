"""Start and supervise a job's control plane: Redis, the controller, one agent per node.

Used by the launcher (``falconext train``). Redis is private to the job unless a URL is
given: a fresh password, nothing persisted, and bound to loopback only; with ``--net
netns`` also to the node bridge's address (``redis_bind``: its first address is the one
the URL names, so ranks inside the node namespaces reach it). The controller and agents
are child processes that get the URL through the environment; a supervisor thread
restarts whichever dies (the ranks log the loss and keep training meanwhile), so a
crash costs seconds of control, never the job. ``control.json`` in the run directory
lists the processes (not the password) for operators and tests.

``access.json`` (:data:`ACCESS_FILE`), readable by its owner only (mode 0600), is how
``falconext ctl`` finds the running job: the job's name and the Redis URL with its
password. It is written when the plane starts and, when it stops, rewritten without
the URL and with ``ended`` set.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterable

from falconext.config import config_from_args
from falconext.control.redis_cluster import RedisCluster, cluster_problem, start_redis_cluster
from falconext.control.redis_server import RedisServer, RedisUnavailable, start_redis
from falconext.control.shards import cluster_url, read_shards
from falconext.inputs import InputError
from falconext.control.client import JOB_ENV, REDIS_URL_ENV

#: restarts per process before the supervisor gives up on it
MAX_RESTARTS = 5
#: the run directory's file for operators (``falconext ctl``): job, Redis URL, mode 0600
ACCESS_FILE = "access.json"


def write_private_json(path: str, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` readable and writable by the owner only (0600), whatever
    the umask, replacing any older file atomically."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, json.dumps(data, indent=2).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


#: the control plane's processes (:mod:`falconext.control.service`)
SERVICE = [sys.executable, "-m", "falconext.control.service"]


def agent_argv(job: str, node: int, ranks: "Iterable[int]", falcon_argv: list[str],
               since_ms: int | None = None) -> list[str]:
    """The command line of node ``node``'s agent, forwarding for ``ranks`` (the falcon flags
    too: it combines heartbeats over ``--falcon-heartbeat-s``) what they post from
    ``since_ms`` on (None: from the agent's start)."""
    return [*SERVICE, "agent", "--job", job, "--node", str(node), *falcon_argv,
            "--ranks", ",".join(str(r) for r in ranks),
            *(["--since-ms", str(since_ms)] if since_ms is not None else [])]


class ControlPlane:
    """The control plane of one job, owned by its launcher: a private Redis (unless
    ``redis_url`` names one), the controller and one agent per node as child processes,
    restarted when they die; ``control.json`` in ``out`` says where to find them."""

    def __init__(
        self,
        out: str,
        world: int,
        nodes: int,
        falcon_argv: list[str],
        redis_url: str | None = None,
        job: str | None = None,
        redis_bind: str = "127.0.0.1",
        agents: bool = True,
        access: dict[str, Any] | None = None,
        shards: int = 0,
    ) -> None:
        self.out = out
        self.world = world
        self.nodes = nodes
        self.falcon_argv = falcon_argv
        self.job = job or os.environ.get(JOB_ENV) or secrets.token_hex(4)
        self.redis: RedisServer | None = None
        #: a Redis Cluster of ``shards`` (>= 3) masters rather than one server (0)
        self.shards = shards
        self.cluster: RedisCluster | None = None
        self.url = redis_url
        self.redis_bind = redis_bind
        #: start the nodes' agents here (False: each node's launcher runs its own)
        self.agents = agents
        #: more for access.json (a job of several launchers: its rendezvous id, flags digest)
        self.access = dict(access or {})
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._supervise, name="falcon-supervisor", daemon=True)
        self._lock = threading.Lock()
        self._started = time.time()

    def env(self) -> dict[str, str]:
        """What the ranks need to join (the URL stays out of their command lines)."""
        return {REDIS_URL_ENV: self.url or "", JOB_ENV: self.job}

    def start(self) -> "ControlPlane":
        """Start Redis (if none was given), the controller and the agents, write control.json
        and start the supervising thread; returns self. Raises RedisUnavailable when Redis
        does not start (or, with ``shards``, when the given URL names no usable cluster)."""
        if self.url is None and self.shards:
            self.cluster = start_redis_cluster(self.shards, bind=self.redis_bind)
            self.url = cluster_url(self.cluster.url, read_shards(self.cluster.url))
        elif self.url is None:
            self.redis = start_redis(bind=self.redis_bind)
            self.url = self.redis.url
        elif self.shards and "#" not in self.url:  # an existing cluster, named by one of its masters
            problem = cluster_problem(self.url)
            if problem is not None:
                raise RedisUnavailable(problem)
            self.url = cluster_url(self.url, read_shards(self.url))
        self._spawn("controller")
        for n in range(self.nodes if self.agents else 0):
            self._spawn(f"agent{n}")
        self._write()
        self._write_access(ended=None)
        self._thread.start()
        return self

    def _write_access(self, ended: float | None) -> None:
        """``access.json``: what ``falconext ctl`` needs (the URL only while running)."""
        info: dict[str, Any] = {"job": self.job, "world": self.world, "nodes": self.nodes,
                                "launcher_pid": os.getpid(), "started": self._started, "ended": ended,
                                **self.access}
        if ended is None:
            info["url"] = self.url
        write_private_json(os.path.join(self.out, ACCESS_FILE), info)

    def _argv(self, name: str) -> list[str]:
        if name == "controller":
            host = self.access.get("host")
            return [*SERVICE, "controller", "--job", self.job, "--world", str(self.world),
                    "--events", os.path.join(self.out, "events.jsonl"), *self.falcon_argv,
                    *(["--plane-host", str(host)] if host else [])]
        node = int(name[len("agent"):])
        per_node = self.world // self.nodes if self.nodes else self.world
        return agent_argv(self.job, node, range(node * per_node, (node + 1) * per_node), self.falcon_argv)

    def _spawn(self, name: str) -> None:
        env = dict(os.environ, **self.env(), FALCONEXT_PARENT_PID=str(os.getpid()))  # service.PARENT_ENV
        log = open(os.path.join(self.out, f"{name}.log"), "ab")
        self.procs[name] = subprocess.Popen(self._argv(name), env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def _write(self) -> None:
        info: dict[str, Any] = {
            "job": self.job,
            "redis_pid": self.redis.pid if self.redis else None,
            "redis_port": self.redis.port if self.redis else None,
            "redis_shards": [{"pid": r.pid, "port": r.port} for r in self.cluster.shards] if self.cluster else None,
            "pids": {n: p.pid for n, p in self.procs.items()},
            "restarts": dict(self.restarts),
        }
        tmp = os.path.join(self.out, "control.json.tmp")
        with open(tmp, "w") as f:
            json.dump(info, f, indent=2)
        os.replace(tmp, os.path.join(self.out, "control.json"))

    def _stores(self) -> list[tuple[str, RedisServer, Callable[[], None]]]:
        """The Redis processes this plane owns: each one's name in ``restarts``, the
        process, and how to start it again as itself."""
        if self.redis is not None:
            return [("redis", self.redis, self.redis.restart)]
        if self.cluster is not None:
            return [(f"redis{k}", shard, functools.partial(self.cluster.restart_shard, k))
                    for k, shard in enumerate(self.cluster.shards)]
        return []

    def _supervise(self) -> None:
        while not self._stop.wait(0.5):
            with self._lock:
                for name, server, restart in self._stores():
                    if server.alive() or self._stop.is_set() or self.restarts.get(name, 0) >= MAX_RESTARTS:
                        continue
                    # as itself: the same port and password (a shard: its slots too), so every
                    # client's reconnection finds it; its streams start empty
                    self.restarts[name] = self.restarts.get(name, 0) + 1
                    try:
                        restart()
                    except Exception:  # noqa: BLE001 - counted; the next round tries again
                        pass
                    self._write()
                for name, proc in list(self.procs.items()):
                    if proc.poll() is None or self._stop.is_set():
                        continue
                    if self.restarts.get(name, 0) >= MAX_RESTARTS:
                        continue
                    self.restarts[name] = self.restarts.get(name, 0) + 1
                    self._spawn(name)
                    self._write()

    def stop(self) -> None:
        """Stop supervising, terminate the child processes (killed after 5 s) and the private
        Redis. Safe to call twice."""
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.terminate()
            deadline = time.monotonic() + 5
            for proc in self.procs.values():
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
        if self.redis is not None:
            self.redis.stop()
        if self.cluster is not None:
            self.cluster.stop()
        if os.path.exists(os.path.join(self.out, ACCESS_FILE)):
            self._write_access(ended=time.time())

    def __enter__(self) -> "ControlPlane":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def falcon_argv(args: argparse.Namespace) -> list[str]:
    """The ``--falcon-*`` threshold options, for the controller's command line."""
    out: list[str] = []
    for key, value in vars(args).items():
        if key.startswith("falcon_") and key not in ("falcon_redis_url", "falcon_redis_url_file") and value is not None:
            out += ["--" + key.replace("_", "-"), str(value)]
    return out


def start_plane(args: argparse.Namespace, env: dict[str, str], redis_bind: str = "127.0.0.1",
                 agents: bool = True, access: dict | None = None):
    """Start the control plane when the job runs falconext with one (its variables go into
    ``env``); None otherwise. ``redis_bind``: the private Redis's addresses, first in the URL."""
    plane = None
    cfg = config_from_args(args) if args.falcon else None
    if cfg is not None and cfg.control_plane:
        events = os.path.join(args.out, "events.jsonl")
        if os.path.exists(events):  # the controller appends from the start
            os.remove(events)
        nodes = -(-args.nproc // args.ranks_per_node)
        plane = ControlPlane(args.out, args.nproc, nodes, falcon_argv(args),
                             redis_url=args.falcon_redis_url or env.get(REDIS_URL_ENV), redis_bind=redis_bind,
                             agents=agents, access=access, shards=cfg.redis_shards)
        try:
            plane.start()
        except RedisUnavailable as exc:
            if plane.url is None or not cfg.redis_shards:
                raise InputError(str(exc)) from None
            # a given cluster that cannot serve: the job trains on, without the control plane
            print(f"falconext: {exc}; training goes on without falconext's control plane", flush=True)
            env[REDIS_URL_ENV] = ""
            return None
        env.update(plane.env())
    return plane
