"""The control plane at cluster scale: simulated ranks, the real Redis and controller.

For each job size, a private password-protected Redis (``control/redis_server.py``) and
the real controller process (``python -m falconext.control.service controller``) run;
the ranks are simulated in this process, without torch: their iteration times come from
``falconext.model.itertime`` (1F1B per replica, DP all-reduce rings) for a TP1 x DP(N/4) x
PP4 job on nodes of 8, with rank 1's GPU 2x slow. They post real messages of the real
schema (``protocol/``) the way the per-node agents pass them on: heartbeats
through one real :class:`~falconext.control.agent.HeartbeatAggregator` per node, as one
NodeHeartbeats per node and round on the beats stream, and the control flow (reports,
profiles, acks, results) combined by the agents' own code (``agent.combined``), one
NodeBatch per node and kind, on the ctl stream. The agents' processes
are not run (thousands of processes do not fit on two cores); their aggregation code is.
The ranks answer the controller's commands as ranks do: ProfileData with each
collective's issue and end times (groups as spans), a SessionAck when the simulated
clock reaches the suspension's iteration, a ValidationResult (GEMM FLOP/s, P2P link
times) after ``go``.

Measured per size: the controller's CPU load while heartbeats arrive at their real pace
(one per rank every ``heartbeat_s``), the rate at which it drains a burst of heartbeats
(and whether that keeps up with the real pace), the time from the report to the
controller's profile command, to its suspend command, and to the Localized verdict (and
whether it names rank 1), the largest message on the bus against the 64 KiB cap, and
Redis memory. Benchmarks take no time here (on GPUs they take milliseconds), so the
times are the control plane's own, the wait for the suspension's iteration, and this
process's serial work for all the ranks (``ranks_side_busy_s``; on a cluster the ranks
work in parallel).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

import numpy as np
import redis

from falconext.config import FalconConfig
from falconext.control.agent import HeartbeatAggregator, combined
from falconext.control.client import BEATS_STREAM, CMD_STREAM, CTL_STREAM, LOCALIZED_STREAM, node_copy
from falconext.control.redis_cluster import start_redis_cluster
from falconext.control.redis_server import start_redis
from falconext.control.shards import ShardedBus, cluster_url, open_bus, read_shards
from falconext.protocol.codec import MAX_MESSAGE_BYTES, decode, encode
from falconext.protocol.base import MessageError
from falconext.protocol.commands import Go, ProfileRequest, Share, Suspend
from falconext.protocol.messages import Heartbeat, Localized, ProfileData, ValidationResult
from falconext.protocol.rank_side import (
    FAIL_SLOW,
    beat_fields,
    fail_slow_report,
    heartbeat,
    held_ack,
    missed_ack,
    profile_data,
    resumed_ack,
    validation_result,
)
from falconext.experiments.result import Comparison, ExperimentResult, Row
from falconext.mitigate.topology import Layout
from falconext.model.itertime import JobCosts, iteration_time
from falconext.validate.plan import join_shares, split_plan, validation_plan

QUICK_SIZES = (64, 256, 1024)
FULL_SIZES = (64, 128, 256, 512, 1024, 2048, 4096, 16384)
#: the sizes run again on a Redis Cluster of CLUSTER_SHARDS shards (quick: the first)
CLUSTER_SIZES = (16384, 32768, 65536, 131072)
QUICK_CLUSTER_SIZES = (1024,)
CLUSTER_SHARDS = 3
PP = 4
RANKS_PER_NODE = 8
SLOW_RANK = 1
SLOW_FACTOR = 2.0
MICROBATCHES = 8
FWD_S = 0.01  # per micro-batch and stage
GRAD_BYTES = 50_000_000
ACT_BYTES = 4_000_000
#: iterations each rank's profile covers (one DP all-reduce per iteration)
PROFILE_ITERATIONS = 6
HEALTHY_TFLOPS = 400.0
#: heartbeats in the throughput burst (whole rounds, at least one)
BURST = 32768
#: heartbeat rounds at the real pace before the fail-slow is reported (the controller's
#: CPU load at the offered heartbeat rate is measured over them)
STEADY_ROUNDS = 4
#: messages a simulated shard's posting sends per round trip
POST_CHUNK = 256
FIRST_ITERATION = 100
#: how long one size may take to reach its verdict
VERDICT_TIMEOUT_S = 60.0
SEED = 17


# --- the simulated job (pure) -------------------------------------------------------------


def layout_for(ranks: int) -> Layout:
    """TP1 x DP(ranks/4) x PP4, 8 ranks per node. Raises ValueError if 4 does not divide."""
    if ranks % (PP * RANKS_PER_NODE):
        raise ValueError(f"{ranks} ranks: not a multiple of PP {PP} x {RANKS_PER_NODE} ranks per node")
    return Layout(tp=1, dp=ranks // PP, pp=PP, ranks_per_node=RANKS_PER_NODE)


def job_groups(layout: Layout) -> dict[str, tuple[str, range]]:
    """Group id -> (role, members in group order), Megatron's order (role = dp_r + dp * pp_r)."""
    d = layout.dp
    groups = {f"dp{s}": ("dp", range(s * d, (s + 1) * d)) for s in range(layout.pp)}
    groups.update({f"pp{r}": ("pp", range(r, r + d * layout.pp, d)) for r in range(d)})
    return groups


def iteration_seconds(layout: Layout) -> tuple[float, float, float]:
    """(healthy, with rank 1 slow, all-reduce seconds) from the iteration-time model."""
    allreduce_s = 2 * GRAD_BYTES / 25e9  # a ring over 25 GB/s links
    costs = JobCosts.uniform(layout.pp, layout.dp, FWD_S, MICROBATCHES, act_bytes=ACT_BYTES, p2p_s=ACT_BYTES / 25e9,
                             grad_bytes=GRAD_BYTES, allreduce_s=allreduce_s, other_s=0.01)
    roles = list(range(layout.tp * layout.dp * layout.pp))
    healthy = iteration_time(layout, roles, costs)
    slow = iteration_time(layout, roles, costs, slow_gpus={SLOW_RANK: SLOW_FACTOR})
    return healthy, slow, allreduce_s


def heartbeats(layout: Layout, iteration: int, iter_s: float, healthy_s: float, now: float) -> list[Heartbeat]:
    """One heartbeat per rank at ``iteration``, as RankClient sends them (made by the
    ranks' own builders, protocol/rank_side.py), at the start of the iteration (each
    says it is 0 s into it, as a hooked rank says how far it is)."""
    d = layout.dp
    out = []
    for r in range(d * layout.pp):
        compute = healthy_s * 0.8 * (SLOW_FACTOR if r == SLOW_RANK else 1.0)
        fields = beat_fields(
            into_s=0.0, replica=r % d, mb_s=compute / MICROBATCHES, micro=MICROBATCHES, restart_s=0.0, switch_s=0.0,
            role={"role": r, "stage": r // d, "tp": 1, "pp": layout.pp, "grad_bytes": GRAD_BYTES,
                  "act_bytes": ACT_BYTES},
            score_iteration=iteration, est_iter_s=iter_s, compute_s=compute, wait_s=max(0.0, iter_s - compute))
        beat = heartbeat(r, r // layout.ranks_per_node, iteration, iter_s, now, fields)
        if beat is not None:
            out.append(beat)
    return out


def profiles(layout: Layout, session: int, iter_s: float, healthy_s: float, allreduce_s: float,
             now: float, rng: np.random.Generator) -> list[ProfileData]:
    """Every rank's profile: its DP all-reduces of the last PROFILE_ITERATIONS iterations.

    A member issues an all-reduce when its compute is done (rank 1 later by its extra
    compute), and all members end together, one transfer after the last arrival."""
    groups = job_groups(layout)
    d = layout.dp
    extra = healthy_s * 0.5 * (SLOW_FACTOR - 1.0)
    t0 = now - PROFILE_ITERATIONS * iter_s
    calls: dict[int, dict[str, list[list[float]]]] = {}
    for gid, (role, members) in groups.items():
        if role != "dp":
            continue
        for k in range(PROFILE_ITERATIONS):
            start = t0 + k * iter_s + healthy_s * 0.5
            issue = start + rng.normal(0.0, 0.001, len(members)).clip(-0.003, 0.003)
            if SLOW_RANK in members:
                issue[members.index(SLOW_RANK)] += extra
            end = float(issue.max()) + allreduce_s * (1.0 + abs(rng.normal(0.0, 0.01)))
            for r, t in zip(members, issue):
                calls.setdefault(r, {}).setdefault(gid, []).append([k, round(float(t), 6), round(end, 6), GRAD_BYTES])
    out = []
    for r in range(layout.dp * layout.pp):
        mine = {g: groups[g] for g in (f"dp{r // d}", f"pp{r % d}")}  # its DP and PP groups
        out.append(profile_data(r, session, {g: role for g, (role, _) in mine.items()},
                                {g: m for g, (_, m) in mine.items()}, calls.get(r, {})))
    return out


def validation_results(world: int, session: int, plan: dict[str, Any],
                       rng: np.random.Generator) -> list[ValidationResult]:
    """Each rank's results for the plan: GEMM FLOP/s where it runs one (rank 1 at half
    speed), and the P2P passes it received on (healthy links)."""
    gemm = set(plan.get("gemm", []))
    nbytes = float(plan.get("nbytes", 262144))
    links: dict[int, list[list[float]]] = {}
    for pas in plan.get("passes", []):
        for src, dst in pas:
            links.setdefault(int(dst), []).append([int(src), int(dst), nbytes / 20e9 * (1 + abs(rng.normal(0, 0.02)))])
    out = []
    for r in range(world):
        flops = None
        if r in gemm:
            flops = HEALTHY_TFLOPS * 1e12 * (1 + rng.normal(0, 0.01)) / (SLOW_FACTOR if r == SLOW_RANK else 1.0)
        out.append(validation_result(r, session, flops, links.get(r, [])))
    return out


def sender_ctl(rank: int) -> str:
    """The ctl stream a rank's agent forwards its control flow to: its node's copy."""
    return node_copy(CTL_STREAM, rank // RANKS_PER_NODE)


# --- the I/O: Redis, the controller process, the simulated ranks ------------------------------


class _Ranks:
    """All simulated ranks' side of the bus, and their nodes' agents: heartbeats go through
    one real HeartbeatAggregator per node (control/agent.py, in this process: thousands of
    agent processes do not fit on two cores) to the beats stream as NodeHeartbeats; the
    control flow goes to the ctl stream one NodeBatch per node and kind, as the agents
    combine it.
    Posts are pipelined (the ranks post in parallel); commands and verdicts are read
    through the real Bus (strict decoding). ``busy_s`` is the time this process spent
    making and posting the ranks' messages (on a cluster they do it in parallel)."""

    def __init__(self, url: str, job: str, layout: Layout, cfg: FalconConfig) -> None:
        self.bus = open_bus(url, job, maxlen=cfg.stream_maxlen)
        #: one plain client per shard (one for a single server): the simulated nodes post to
        #: their own shard, every shard's pipeline at once
        buses = self.bus.buses if isinstance(self.bus, ShardedBus) else [self.bus]
        self.raws = [redis.Redis.from_url(b.url) for b in buses]
        self.raw = self.raws[0]
        n = layout.ranks_per_node
        self.agents = [HeartbeatAggregator(node, cfg.heartbeat_s, set(range(node * n, (node + 1) * n)))
                       for node in range(layout.tp * layout.dp * layout.pp // n)]
        self.largest = ("", 0)
        self.posted = 0
        self.busy_s = 0.0
        self._queue: deque[tuple[str, Any, float]] = deque()
        self._keys: dict[str, tuple[int, str]] = {}

    def placed(self, stream: str, post: bool = False) -> list[tuple[int, str]]:
        """(shard, Redis key) of each copy of ``stream`` the ranks read (``post``: post to);
        one on a single server."""
        if isinstance(self.bus, ShardedBus):
            return self.bus.keys(stream, post)
        return [(0, self.bus.key(stream))]

    def where(self, stream: str) -> tuple[int, str]:
        """(shard, Redis key) a rank's or node's post to ``stream`` goes to (``ctl@N``: its
        node's shard)."""
        found = self._keys.get(stream)
        if found is None:
            found = self._keys[stream] = self.placed(stream, post=True)[0]
        return found

    def backlog(self) -> int:
        """Node messages on the beats streams, all shards."""
        return sum(int(self.raws[k].xlen(key)) for k, key in self.placed(BEATS_STREAM))

    def post(self, msgs: list[Any]) -> float:
        """Post ``msgs``, every shard's share as post_encoded posts it, the shards' at once:
        heartbeats combined by their nodes' aggregators (each node's go when all its
        ranks' beats are in) to the node's copy of beats, the rest combined per node and kind
        (``agent.combined``) to the
        sender's node's copy of ctl; returns seconds."""
        t0 = time.perf_counter()
        now = time.monotonic()
        for m in msgs:
            if isinstance(m, Heartbeat):
                self.agents[m.node].add(m, now)
        data = self.encoded([m for m in msgs if not isinstance(m, Heartbeat)])
        data += [(node_copy(BEATS_STREAM, agent.node), "NodeHeartbeats", encode(agg))
                 for agent in self.agents if agent.due(now) for agg in agent.flush()]
        return self.post_encoded(data, t0)

    @staticmethod
    def encoded(msgs: list[Any]) -> list[tuple[str, str, str]]:
        """The ranks' control-flow ``msgs`` combined per node and kind as their agents
        combine them, encoded, for :meth:`post_encoded`."""
        flow: dict[int, list[Any]] = {}
        for m in msgs:
            flow.setdefault(m.rank // RANKS_PER_NODE, []).append(m)
        return [(sender_ctl(node * RANKS_PER_NODE), type(m).__name__, encode(m))
                for node, mine in flow.items() for m in combined(node, mine)]

    def node_beats(self, beats: list[Heartbeat]) -> list[tuple[str, str, str]]:
        """One round of ``beats`` (every rank's) as their nodes' agents send them, encoded:
        (stream, type, text) per NodeHeartbeats, for :meth:`post_encoded`."""
        for b in beats:
            self.agents[b.node].add(b, 0.0)
        return [(node_copy(BEATS_STREAM, agent.node), "NodeHeartbeats", encode(agg))
                for agent in self.agents for agg in agent.flush()]

    def post_encoded(self, data: list[tuple[str, str, str]], t0: float | None = None) -> float:
        """Post messages made and encoded already, ``(stream, type name, text)``, every
        shard's share in pipelines of :data:`POST_CHUNK`, the shards' at once; returns
        the seconds posting took (``t0``: when the making began, for ``busy_s``)."""
        t0 = time.perf_counter() if t0 is None else t0
        for _, name, text in data:
            if len(text) > self.largest[1]:
                self.largest = (name, len(text))
        t1 = time.perf_counter()
        per_shard: list[list[tuple[str, str]]] = [[] for _ in self.raws]
        for stream, _, text in data:
            k, key = self.where(stream)
            per_shard[k].append((key, text))
        # a few hundred a shard per round trip: the first nodes' messages are in Redis while
        # the rest are still being sent, as when every node posts on its own (one pipeline
        # of 16,384 messages reached Redis only once the whole of it was packed)
        for lo in range(0, max(map(len, per_shard)), POST_CHUNK):
            pipes = [r.pipeline(transaction=False) for r in self.raws]
            for pipe, mine in zip(pipes, per_shard):
                for key, text in mine[lo:lo + POST_CHUNK]:
                    pipe.xadd(key, {"m": text}, maxlen=self.bus.maxlen, approximate=True)
            busy = [p for p in pipes if len(p)]
            if len(busy) == 1:
                busy[0].execute()
            else:
                threads = [threading.Thread(target=p.execute) for p in busy]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
        self.posted += len(data)
        done = time.perf_counter()
        self.busy_s += done - t0
        return done - t1

    def next_message(self, streams: list[str], until: float) -> tuple[str, Any, float] | None:
        """The next command or verdict, with when the controller posted it (its stream
        entry's time: a rank blocked on its node's commands has it then, where this
        process reads and decodes every rank's one after another), or None at ``until``
        (monotonic). ``streams``: the controller's streams to the ranks (commands,
        verdicts), on shard 0 of a cluster (shards.route)."""
        reader = self.bus.buses[0] if isinstance(self.bus, ShardedBus) else self.bus
        while not self._queue and time.monotonic() < until:
            for stream, entry, text in reader.read_raw(streams, block_ms=50):
                try:
                    self._queue.append((stream, decode(text), int(entry.split("-")[0]) / 1000))
                except (MessageError, ValueError):
                    continue  # the controller posts only what decodes: never here
        return self._queue.popleft() if self._queue else None

    def close(self) -> None:
        self.bus.close()
        for raw in self.raws:
            raw.close()


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` and its live children (the controller's
    beat readers) have used (Linux /proc)."""
    total = 0.0
    for p in [pid] + _children(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone since it was listed
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (Linux /proc)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _largest_on(raw: Any, key: str) -> tuple[str, int]:
    """The type and size of the largest message still on the stream ``key``."""
    sizes = [(len(f[b"m"]), f[b"m"]) for _, f in raw.xrange(key)]
    if not sizes:
        return "", 0
    size, data = max(sizes, key=lambda x: x[0])
    return str(json.loads(data).get("type", "?")), size


def _events(path: Path) -> list[dict[str, Any]]:
    """The controller's events written so far: whole lines only (the line it is writing
    now, a 2 MB ``localized`` at 131,072 ranks, is read on the next look)."""
    if not path.exists():
        return []
    whole = path.read_text().split("\n")[:-1]  # the last: empty, or a line not finished yet
    return [json.loads(line) for line in whole if line.strip()]


#: the values premade messages carry until the real ones are known (no real message has them)
MARKS = {"session": -7777777, "iteration": -7777778, "time": -7777779.25, "pause_s": -7777780.25}


class Premade:
    """Every rank's messages of one kind, made and encoded before they are due (each
    node's combined as its agent does), with :data:`MARKS` where the values known only
    later go: posting them costs this process a text substitution per node. On a cluster
    each rank makes its own in parallel; the simulator's serial making would otherwise be
    what is measured."""

    def __init__(self, made: list[Any], plan: tuple[Any, ...] | None = None) -> None:
        self.texts = _Ranks.encoded(made)
        #: what they answer (validation results: the plan's :func:`plan_key`; None: anything)
        self.plan = plan

    def filled(self, **values: float) -> list[tuple[str, str, str]]:
        """The messages as posted with ``values`` (by :data:`MARKS` name) in place of the
        marks: (stream, type, text)."""
        subs = [(f",{MARKS[k]},", f",{int(v)},") if isinstance(MARKS[k], int) else (json.dumps(MARKS[k]), json.dumps(v))
                for k, v in values.items()]
        out = []
        for stream, name, text in self.texts:
            for mark, real in subs:
                text = text.replace(mark, real)
            out.append((stream, name, text))
        return out


def premade(layout: Layout, iter_s: float, healthy_s: float, allreduce_s: float,
            rng: np.random.Generator, cfg: FalconConfig | None = None) -> dict[str, Premade]:
    """The ranks' profiles (the calls of the iterations before the report), held acks and
    resumed acks, premade (:class:`Premade`); with ``cfg``, their validation results too,
    for the plan the controller is expected to send (:func:`expected_plan`; the ranks
    answer the plan that comes: :func:`plan_key` tells whether it is that one)."""
    ranks = layout.dp * layout.pp
    s, i, t, p = MARKS["session"], MARKS["iteration"], MARKS["time"], MARKS["pause_s"]
    out = {"profiles": Premade(profiles(layout, s, iter_s, healthy_s, allreduce_s, time.time(), rng)),
           "held": Premade([held_ack(r, s, i, t) for r in range(ranks)]),
           "missed": Premade([missed_ack(r, s, i, t) for r in range(ranks)]),
           "resumed": Premade([resumed_ack(r, s, i, t, p, False, False) for r in range(ranks)])}
    if cfg is not None:
        plan = expected_plan(layout, cfg)
        out["results"] = Premade(validation_results(ranks, s, plan, rng), plan_key(plan))
    return out


def expected_plan(layout: Layout, cfg: FalconConfig) -> dict[str, Any]:
    """The validation plan the controller makes from the ranks' profiles (rank 1 the compute
    suspect, no suspicious group), as the ranks put it back together from its shares."""
    ranks = layout.dp * layout.pp
    groups = {g: (role, list(m)) for g, (role, m) in job_groups(layout).items()}
    plan = validation_plan(groups, list(range(ranks)), [SLOW_RANK], [], p2p_concurrency=cfg.p2p_concurrency,
                           p2p_bytes=cfg.p2p_bytes, node_of={r: r // layout.ranks_per_node for r in range(ranks)},
                           trees=cfg.validation_trees, fabric="", nccl_algo=None)
    common, shares = split_plan(plan, list(range(ranks)))
    return join_shares(common, shares)


def plan_key(plan: dict[str, Any]) -> tuple[Any, ...]:
    """What a rank's validation results depend on in ``plan``: the GEMM ranks, the passes
    and the message size."""
    return (tuple(plan.get("gemm", [])), tuple(tuple(map(tuple, p)) for p in plan.get("passes", [])),
            plan.get("nbytes"))


def _localize(sim: _Ranks, layout: Layout, iteration: int, slow_s: float, healthy_s: float, allreduce_s: float,
              t_report: float, rng: np.random.Generator, gave_up: Callable[[], str | None],
              made: dict[str, Premade] | None = None, started: float | None = None) -> Row:
    """Answer the controller as the ranks would, from the reports to the verdict; the
    times are seconds after the reports were posted. ``iteration`` started at ``started``
    (monotonic; None: now), as the heartbeats said. ``gave_up()`` says why the controller
    abandoned the localization (None: it did not); ``made``: the profiles and acks, made
    before the report (:func:`premade`; None: made when due)."""
    ranks = layout.dp * layout.pp
    clock0 = time.monotonic() if started is None else started
    deadline = time.monotonic() + VERDICT_TIMEOUT_S  # from the reports, posted just before
    session, suspend_at, held = -1, 0, 0.0
    results: list[tuple[str, str, str]] = []  # the ranks' validation results, encoded
    plan: dict[str, Any] = {}
    shares: dict[int, list[Any]] = {}  # share commands by session, until their suspend
    row: Row = {}
    while True:
        got = sim.next_message([CMD_STREAM, LOCALIZED_STREAM], min(deadline, time.monotonic() + 1.0))
        if got is None:
            reason = gave_up()
            if reason is not None or time.monotonic() >= deadline:
                row["error"] = f"localization failed: {reason}" if reason else "no verdict in time"
                break
            continue
        msg = got[1]
        now = time.perf_counter()
        if isinstance(msg, Localized):
            row["report_to_localized_s"] = round(now - t_report, 3)
            row["localized_gpus"] = json.dumps(msg.gpus)
            row["localized_right"] = msg.gpus == [SLOW_RANK] and not msg.links
            break
        if isinstance(msg, ProfileRequest):
            session = msg.session
            row["report_to_profile_cmd_s"] = round(now - t_report, 3)
            if made is not None:
                sim.post_encoded(made["profiles"].filled(session=session))
            else:
                t0 = time.perf_counter()
                answers = profiles(layout, session, slow_s, healthy_s, allreduce_s, time.time(), rng)
                sim.busy_s += time.perf_counter() - t0
                sim.post(answers)
        elif isinstance(msg, Share):
            shares.setdefault(msg.session, []).append(msg.share)
        elif isinstance(msg, Suspend):
            session = msg.session
            plan = join_shares(msg.validation, shares.pop(session, [])) if msg.validation is not None else {}
            suspend_at = msg.iteration
            row["report_to_suspend_cmd_s"] = round(now - t_report, 3)
            row["suspend_command_bytes"] = len(encode(msg))
            # where the ranks were when the command was posted (this process's own serial
            # reading of every rank's shares is not the ranks')
            lag = max(0.0, time.time() - got[2])
            if iteration + (time.monotonic() - lag - clock0) / slow_s > suspend_at:
                # the ranks began it before the command came: they say so
                row["suspend_misses"] = row.get("suspend_misses", 0) + 1
                if made is not None:
                    sim.post_encoded(made["missed"].filled(session=session, iteration=suspend_at, time=time.time()))
                else:
                    sim.post([missed_ack(r, session, suspend_at, time.time()) for r in range(ranks)])
                continue  # the controller releases them and suspends again further ahead
            reached = iteration + (time.monotonic() - clock0) / slow_s
            time.sleep(max(0.0, (suspend_at - reached) * slow_s))  # the ranks reach the agreed iteration
            held = time.time()
            if made is not None:
                sim.post_encoded(made["held"].filled(session=session, iteration=suspend_at, time=held))
            else:
                sim.post([held_ack(r, session, suspend_at, held) for r in range(ranks)])
            # the ranks' results: premade for the plan expected, or made now for another
            # (each rank makes its own in parallel on a cluster), posted at the go
            t0 = time.perf_counter()
            ready = made.get("results") if made is not None else None
            if ready is not None and ready.plan == plan_key(plan):
                results = ready.filled(session=session)
            else:
                results = sim.encoded(validation_results(ranks, session, plan, rng))
            sim.busy_s += time.perf_counter() - t0
        elif isinstance(msg, Go) and msg.session == session:
            row["report_to_go_s"] = round(now - t_report, 3)
            sim.post_encoded(results)
            now_t = time.time()
            if made is not None:
                sim.post_encoded(made["resumed"].filled(session=session, iteration=suspend_at, time=now_t,
                                                        pause_s=now_t - held))
            else:
                sim.post([resumed_ack(r, session, suspend_at, now_t, now_t - held, False, False)
                          for r in range(ranks)])
    return row


def _drain(sim: _Ranks, layout: Layout, iteration: int, slow_s: float, healthy_s: float, burst: int = BURST,
           pid: int | None = None) -> Row:
    """How fast the controller handles a burst of heartbeats (at least ``burst`` of them,
    whole rounds, in its nodes' NodeHeartbeats): the controller (or its beat readers)
    trims the beats streams as it reads, so the burst is handled when they are empty.

    With ``pid`` (the controller's), the controller and its children are stopped
    (SIGSTOP) while the burst is posted and the clock starts when they go on (SIGCONT):
    the drain is then the controller's own rate, not shared with this process's posting
    (on a cluster 16,384 other machines post). The rate with the posting inside the
    clock, as before, is kept too."""
    ranks = layout.dp * layout.pp
    rounds = max(1, -(-burst // ranks))
    # each node's agent combines and encodes its own (in parallel on a cluster): made before
    # the clock starts, so that what is timed is the posting and the controller's reading
    made = [sim.node_beats(heartbeats(layout, iteration + k, slow_s, healthy_s, time.time())) for k in range(rounds)]
    held = [pid] + _children(pid) if pid is not None else []
    for p in held:
        os.kill(p, signal.SIGSTOP)
    try:
        t0 = time.perf_counter()
        for texts in made:  # round by round: each node's aggregator sends one message a round
            sim.post_encoded(texts)
        post_s = time.perf_counter() - t0
    finally:
        for p in held:
            os.kill(p, signal.SIGCONT)
    t_go = time.perf_counter()
    deadline = time.monotonic() + VERDICT_TIMEOUT_S
    while sim.backlog() > 0:
        if time.monotonic() > deadline:
            return {"burst_heartbeats": rounds * ranks, "burst_post_s": round(post_s, 3)}
        time.sleep(0.005)
    done = time.perf_counter()
    drain = done - (t_go if held else t0)
    nodes = len(sim.agents)
    out: Row = {"burst_heartbeats": rounds * ranks, "burst_node_messages": rounds * nodes,
                "burst_post_s": round(post_s, 3), "drain_s": round(drain, 3),
                "controller_heartbeats_per_s": round(rounds * ranks / drain),
                "controller_node_msgs_per_s": round(rounds * nodes / drain)}
    if held:  # the old figure: posting and reading on the same two cores, one clock
        out["drain_with_posting_heartbeats_per_s"] = round(rounds * ranks / (done - t0))
    else:  # done within 10% of the posting: the simulator's posting bounded the rate, not the controller
        out["drain_bounded_by_posting"] = drain <= 1.1 * post_s
    return out


def run_size(ranks: int, cfg: FalconConfig | None = None, workdir: str | None = None, burst: int = BURST,
             shards: int = 0) -> Row:
    """One job size end to end; returns its measurements (and 'error' if it went wrong).
    ``burst``: heartbeats in the throughput burst (at least one round); ``shards``: a
    Redis Cluster of that many shards (0: one server).

    The controller's events.jsonl and stderr go to a temporary folder, removed at the
    end, or to ``workdir``, kept."""
    cfg = cfg or FalconConfig()
    layout = layout_for(ranks)
    healthy_s, slow_s, allreduce_s = iteration_seconds(layout)
    rng = np.random.default_rng(SEED)
    row: Row = {"ranks": ranks, "layout": f"1T{layout.dp}D{layout.pp}P", "nodes": ranks // RANKS_PER_NODE,
                "healthy_iter_s": round(healthy_s, 4), "slow_iter_s": round(slow_s, 4)}
    job = f"scale{ranks}"
    row["redis"] = f"cluster of {shards}" if shards else "one server"
    server = start_redis_cluster(shards) if shards else start_redis()
    url = cluster_url(server.url, read_shards(server.url)) if shards else server.url
    tmp = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="falconext-scale-"))
    tmp.mkdir(parents=True, exist_ok=True)
    events_path = tmp / "events.jsonl"
    events_path.unlink(missing_ok=True)  # a kept workdir's earlier run: its verdicts are not this one's
    stderr = (tmp / "controller.err").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "falconext.control.service", "controller", "--job", job, "--world", str(ranks),
         "--events", str(events_path), "--falcon-mitigation", "false"],
        env={**os.environ, "FALCON_REDIS_URL": url}, stdout=subprocess.DEVNULL, stderr=stderr)
    sim: _Ranks | None = None
    try:
        until = time.monotonic() + 30
        while not any(e["type"] == "controller_started" for e in _events(events_path)):
            if proc.poll() is not None or time.monotonic() > until:
                raise RuntimeError("the controller did not start")
            time.sleep(0.05)
        time.sleep(0.3)  # its bus fixed its start point at first contact
        sim = _Ranks(url, job, layout, cfg)
        # 1. steady state: heartbeats at their real pace (one per rank every heartbeat_s),
        # and the controller's CPU time meanwhile: its load at the offered rate
        iteration = FIRST_ITERATION
        cpu0, wall0 = _cpu_s(proc.pid), time.monotonic()
        beat_at = time.monotonic()
        for _ in range(STEADY_ROUNDS):
            t_round = beat_at = time.monotonic()
            sim.post(heartbeats(layout, iteration, slow_s, healthy_s, time.time()))
            iteration += 1
            time.sleep(max(0.0, cfg.heartbeat_s - (time.monotonic() - t_round)))
        # the ranks are where their last heartbeats said: that iteration began when they
        # were made (the ranks' clock from here on). Counting it from after the last
        # round's posting (seconds at 131,072 ranks) put the ranks iterations behind
        # their own heartbeats, and they waited that much longer for the suspension
        iteration, started = iteration - 1, beat_at
        row["controller_cpu_share"] = round((_cpu_s(proc.pid) - cpu0) / (time.monotonic() - wall0), 3)
        row["steady_backlog_node_msgs"] = sim.backlog()
        sim.busy_s = 0.0
        # 2. every rank reports the fail-slow; the simulated ranks answer the controller
        # until it posts its verdict
        made = premade(layout, slow_s, healthy_s, allreduce_s, rng, cfg)
        # the reports too: each rank makes and its agent combines its own, in parallel on a
        # cluster (made here, 131,072 of them took seconds of the time to the profile command)
        reports = [fail_slow_report(r, FAIL_SLOW, 1, iteration - 12, iteration, round(slow_s / healthy_s, 4), healthy_s,
                                    MARKS["time"]) for r in range(ranks)]
        made_reports = Premade([rep for rep in reports if rep is not None])
        def gave_up() -> str | None:
            if proc.poll() is not None:
                return "the controller died"
            failed = [e for e in _events(events_path) if e["type"] == "localization_failed"]
            return str(failed[0].get("reason")) if failed else None

        # this process stands in for 16,384 hosts: its own garbage collection (0.6 s of
        # pauses at 131,072 ranks, more after the earlier sizes' runs) is not the ranks'
        collecting = gc.isenabled()
        gc.disable()
        try:
            t_report = time.perf_counter()
            sim.post_encoded(made_reports.filled(time=time.time()))
            row.update(_localize(sim, layout, iteration, slow_s, healthy_s, allreduce_s, t_report, rng, gave_up,
                                  made, started))
        finally:
            if collecting:
                gc.enable()
        row["ranks_side_busy_s"] = round(sim.busy_s, 3)
        # 3. throughput: a burst of heartbeats once the controller has taken the ranks'
        # resumption (the localization's tail is not the heartbeats' load); the
        # controller trims the beats stream as it reads, so an empty one is drained
        until = time.monotonic() + VERDICT_TIMEOUT_S
        while ("report_to_localized_s" in row and proc.poll() is None and time.monotonic() < until
               and not any(e["type"] == "resumed" for e in _events(events_path))):
            time.sleep(0.1)
        if proc.poll() is None:
            row.update(_drain(sim, layout, iteration + 50, slow_s, healthy_s, burst, proc.pid))
        row["offered_heartbeats_per_s"] = round(ranks / cfg.heartbeat_s)
        if "controller_heartbeats_per_s" in row:
            row["keeps_up"] = row["controller_heartbeats_per_s"] >= row["offered_heartbeats_per_s"]
        posted = [_largest_on(sim.raws[k], key) for k, key in sim.placed(CMD_STREAM, post=True)]
        posted.append(_largest_on(sim.raw, sim.bus.key(LOCALIZED_STREAM)))
        name, size = max([sim.largest] + posted, key=lambda x: x[1])
        row["largest_message"] = name
        row["largest_message_bytes"] = size
        row["cap_bytes"] = MAX_MESSAGE_BYTES
        peaks = [round(int(raw.info("memory")["used_memory_peak"]) / 2**20, 1) for raw in sim.raws]
        row["redis_peak_mib"] = max(peaks)
        if shards:
            row["redis_peak_mib_per_shard"] = json.dumps(peaks)
        for e in _events(events_path):
            if e["type"] == "localized" and "controller_localized_after_s" not in row:
                row["controller_localized_after_s"] = e.get("after_event_s")
            if e["type"] == "controller_error":
                row.setdefault("error", e.get("error", "")[:200])
        if proc.poll() is not None:
            stderr.flush()
            tail = (tmp / "controller.err").read_text(errors="replace").strip().splitlines()
            row["error"] = f"controller exited {proc.returncode}: {tail[-1] if tail else ''}"[:300]
    finally:
        if sim is not None:
            sim.close()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        stderr.close()
        server.stop()
        if not workdir:
            shutil.rmtree(tmp, ignore_errors=True)
    return row


def measure(quick: bool) -> ExperimentResult:
    """Quick: 64, 256, 1024 ranks on one Redis server, 1024 on a 3-shard Redis Cluster;
    full: up to 16,384 on one server, 16,384 to 131,072 on the cluster."""
    rows = []
    runs = [(n, 0) for n in (QUICK_SIZES if quick else FULL_SIZES)]
    runs += [(n, CLUSTER_SHARDS) for n in (QUICK_CLUSTER_SIZES if quick else CLUSTER_SIZES)]
    for n, shards in runs:
        try:
            rows.append(run_size(n, shards=shards))
        except RuntimeError as exc:  # the controller did not start: say so, go on
            rows.append({"ranks": n, "redis": f"cluster of {shards}" if shards else "one server", "error": str(exc),
                         "offered_heartbeats_per_s": round(n / FalconConfig().heartbeat_s)})
    comparisons = []
    for r in rows:
        r_name = f"{r['ranks']} ranks ({r.get('redis', 'one server')})"
        named = f"rank {SLOW_RANK}" if r.get("localized_right") else f"named {r.get('localized_gpus')}, not {SLOW_RANK}"
        verdict = (f"{r['report_to_localized_s']:.2f} s, {named}"
                   if "report_to_localized_s" in r else f"none ({r.get('error', '')})")
        comparisons.append(Comparison(f"{r_name}: report to localized", "-", verdict,
                                      "Holmes: 30.3 s at 8192 GPUs" if r["ranks"] >= 8192 else ""))
        if "controller_heartbeats_per_s" in r:
            comparisons.append(Comparison(
                f"{r_name}: controller drains heartbeats/s (offered {r['offered_heartbeats_per_s']}/s)", "-",
                f"{'>= ' if r.get('drain_bounded_by_posting') else ''}{r['controller_heartbeats_per_s']} "
                f"({r['controller_node_msgs_per_s']} node messages/s)",
                ("keeps up" if r.get("keeps_up") else "falls behind")
                + ("; bounded by the simulator's posting" if r.get("drain_bounded_by_posting") else "")))
        if "controller_cpu_share" in r:
            comparisons.append(Comparison(
                f"{r_name}: controller CPU at the offered heartbeats", "-",
                f"{100 * r['controller_cpu_share']:.0f}% of a core"))
        if "largest_message_bytes" in r:
            comparisons.append(Comparison(
                f"{r_name}: largest message (cap {MAX_MESSAGE_BYTES})", "-",
                f"{r['largest_message_bytes']} B ({r['largest_message']})",
                "over the cap" if r["largest_message_bytes"] > MAX_MESSAGE_BYTES else ""))
    single = [r for r in rows if r.get("redis", "one server") == "one server"]
    behind = [r["ranks"] for r in single if r.get("keeps_up") is False]
    failed = [r["ranks"] for r in single if "report_to_localized_s" not in r]
    over = [r["ranks"] for r in rows if r.get("largest_message_bytes", 0) > MAX_MESSAGE_BYTES]
    for what, sizes in (("controller falls behind the heartbeats", behind), ("no localization", failed),
                        ("a message over the bus cap", over)):
        comparisons.append(Comparison(f"smallest size with {what} (one server)", "-",
                                      f"{min(sizes)} ranks" if sizes else f"none up to {single[-1]['ranks']} ranks"))
    notes = [
        f"Layout TP1 x DP(N/{PP}) x PP{PP}, {RANKS_PER_NODE} ranks per node, rank {SLOW_RANK} {SLOW_FACTOR:g}x slow; "
        "iteration times from falconext.model.itertime.",
        f"Rows marked 'cluster of {CLUSTER_SHARDS}' run the control plane on a real Redis Cluster of "
        f"{CLUSTER_SHARDS} shards (--falcon-redis-shards): each simulated node posts to its own shard, every "
        "shard's pipeline at once, and the controller reads every shard.",
        "The ranks' profiles and acks are made and encoded before the report, each node's combined as its agent "
        "does, and posted with the session, iteration and times put in (each rank makes its own in parallel on "
        "a cluster); their validation results are made when the go comes.",
        "One real Redis and the real controller process per size; ranks simulated in one process. Their "
        "heartbeats go through one real HeartbeatAggregator per node (control/agent.py, run in this process: "
        "thousands of agent processes do not fit on two cores) to the beats stream, one NodeHeartbeats per "
        "node per round; reports, profiles, acks and results go one NodeBatch per node and kind to the ctl "
        "stream, combined by the agents' own code. Posts are pipelined.",
        f"Throughput: after the verdict and the ranks' resumption (the controller's 'resumed' event), a burst "
        f"of at least {BURST} heartbeats (whole rounds, in node "
        "messages, combined and encoded by their nodes' aggregators before the clock starts), posted while "
        "the controller and its beat readers are stopped (SIGSTOP); the clock runs from when they go on "
        "(SIGCONT) until the beats streams are empty (the controller, or on a cluster its readers, trim "
        "them as they read). 'Drains' is the burst over that time, against one heartbeat per rank every "
        "heartbeat_s; on a cluster thousands of other machines post, and this process's posting would "
        "otherwise take the same two cores (the rate with the posting inside the clock is given too). "
        "'Controller CPU' is the CPU time of its process and its beat readers over the wall time of the "
        f"{STEADY_ROUNDS} rounds at the real pace before the report.",
        "Report to localized includes the simulator's own serial work for every rank (posting the "
        "profiles and acks, making and posting the results: ranks_side_busy_s), which on a cluster the "
        "ranks do in parallel; the results are made while the controller reads the held acks.",
        "The largest message counts what the ranks posted and what the controller posted (commands, the "
        "Localized verdict); the bus refuses anything over the cap.",
        "GEMM and P2P benchmarks take no time here; the wait for the suspension's iteration is real "
        f"(about {FalconConfig().suspend_margin_iterations} slow iterations).",
    ]
    return ExperimentResult(rows, comparisons, notes)


def draw(result: ExperimentResult, path: str) -> None:
    """Controller load (heartbeats drained against offered; CPU at the offered rate) and
    time to localize against job size."""
    import matplotlib.pyplot as plt  # lazy: run-time order (after the runner's matplotlib.use("Agg"))

    rows = [r for r in result.rows if r.get("redis", "one server") == "one server"]
    cluster = [r for r in result.rows if r.get("redis", "one server") != "one server"]
    fig, (a, c, b) = plt.subplots(1, 3, figsize=(14, 3.9))
    ok = [r for r in rows if "controller_heartbeats_per_s" in r]
    a.plot([r["ranks"] for r in ok], [r["controller_heartbeats_per_s"] for r in ok], "o-",
           label="controller drains (heartbeats/s)")
    bound = [r for r in ok if r.get("drain_bounded_by_posting")]
    if bound:
        a.plot([r["ranks"] for r in bound], [r["controller_heartbeats_per_s"] for r in bound], "o", mfc="white",
               color="tab:blue", label="... at least (the simulator's posting bounded it)")
    a.plot([r["ranks"] for r in ok], [r["controller_node_msgs_per_s"] for r in ok], "s:",
           label="... in node messages/s")
    offered = [(r["ranks"], r["offered_heartbeats_per_s"]) for r in rows if "offered_heartbeats_per_s" in r]
    if offered:
        a.plot(*zip(*offered), "k--", label=f"heartbeats offered (one per rank every {FalconConfig().heartbeat_s:g} s)")
    a.set_yscale("log")
    a.set_ylabel("per second")
    a.set_title("controller throughput")
    cpu = [(r["ranks"], 100 * r["controller_cpu_share"]) for r in rows if "controller_cpu_share" in r]
    if cpu:
        c.plot(*zip(*cpu), "o-", color="tab:purple", label="controller process")
    c.set_ylabel("% of one core")
    c.set_title("controller load at the offered heartbeats")
    failed = [r["ranks"] for r in rows if "report_to_localized_s" not in r]
    for n in failed:
        b.axvline(n, color="tab:red", alpha=0.4)
    if failed:
        b.plot([], [], color="tab:red", alpha=0.4, label="no localization")
    loc = [r for r in rows if "report_to_localized_s" in r]
    for key, label in (("report_to_profile_cmd_s", "profile command"), ("report_to_suspend_cmd_s", "suspend command"),
                       ("report_to_localized_s", "localized"), ("ranks_side_busy_s", "simulator's own work")):
        pts = [(r["ranks"], r[key]) for r in loc if key in r]
        if pts:
            b.plot(*zip(*pts), "o-" if key != "ranks_side_busy_s" else "x:", label=label)
    kind = cluster[0]["redis"] if cluster else ""
    drained = [(r["ranks"], r["controller_heartbeats_per_s"]) for r in cluster if "controller_heartbeats_per_s" in r]
    if drained:
        a.plot(*zip(*drained), "D-", color="tab:green", label=f"controller drains, Redis {kind}")
        a.plot([r["ranks"] for r in cluster], [r["offered_heartbeats_per_s"] for r in cluster], "k--")
    cpu = [(r["ranks"], 100 * r["controller_cpu_share"]) for r in cluster if "controller_cpu_share" in r]
    if cpu:
        c.plot(*zip(*cpu), "D-", color="tab:green", label=f"controller process, Redis {kind}")
    found = [(r["ranks"], r["report_to_localized_s"]) for r in cluster if "report_to_localized_s" in r]
    if found:
        b.plot(*zip(*found), "D-", color="tab:green", label=f"localized, Redis {kind}")
    for r in cluster:
        if "report_to_localized_s" not in r:
            b.axvline(r["ranks"], color="tab:green", alpha=0.4, ls=":")
    if any("report_to_localized_s" not in r for r in cluster):
        b.plot([], [], color="tab:green", alpha=0.4, ls=":", label=f"no localization, Redis {kind}")
    b.axhline(10.0, color="grey", lw=0.8, ls="--", label="issue 17's target (10 s)")
    b.set_ylabel("seconds after the report")
    b.set_title("time to localize")
    for ax in (a, c, b):
        ax.set_xscale("log", base=2)
        sizes = sorted({r["ranks"] for r in result.rows})
        ax.set_xticks(sizes)
        ax.set_xticklabels([str(n) for n in sizes], fontsize=7)
        ax.set_xlabel("ranks")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
