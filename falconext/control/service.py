"""The control plane's processes: ``python -m falconext.control.service controller|agent``.

The launcher starts one controller per job and one agent per node. The Redis URL (it
holds the password) comes from ``$FALCON_REDIS_URL``, never from the command line,
where any user of the machine could read it. Both loops are thin: the logic is in
:mod:`falconext.control.controller` and :mod:`falconext.control.agent`.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from falconext.config import FalconConfig, add_config_arguments, config_from_args
from falconext.control.agent import NodeAgent
from falconext.control.beat_reader import READ_COUNT, BeatReaders, run_reader
from falconext.control.shards import ShardedBus, open_bus
from falconext.control.client import (
    BEATS_STREAM,
    CMD_STREAM,
    CONTROLLER_KEY,
    CTL_STREAM,
    LOCALIZED_STREAM,
    REDIS_URL_ENV,
    STATUS_KEY,
    reply_key,
)
from falconext.control.controller import Controller
from falconext.control.episodes import State
from falconext.control.snapshot import ROW_COLUMNS, TABLE_FILE
from falconext.control.metrics import JobMetrics, MetricsServer
from falconext.protocol.eventlog import EventLog
from falconext.protocol.base import MessageError
from falconext.protocol.codec import encode, looks_like_report
from falconext.protocol.messages import NodeHeartbeats, RankEvent
from falconext.validate.health import gpu_health

#: an operator's reply stays this long in Redis (``falconext ctl`` waits less)
REPLY_TTL_S = 60.0
#: where the controller keeps what operators changed (mute, thresholds), for a restarted
#: controller; the job's Redis lives no longer than the job, so the TTL only bounds a leak
OPERATOR_KEY = "operator"
OPERATOR_TTL_S = 7 * 24 * 3600.0
#: routine events that do not count as the "latest event" of the status and progress line
ROUTINE_EVENTS = {"rank_scores"}
#: control-stream messages read at most in one go (then a batch of heartbeats, then more)
CTL_READ_MAX = 1000
#: the longest a fail-slow report put aside during a localization waits to be read
MAX_REPORT_WAIT_S = 5.0
#: while the control stream holds a backlog, deadlines wait for the controller to read
#: it (a profile that reached Redis in time is in time), but never longer than this
MAX_DEADLINE_DEFER_S = 30.0
#: the controller process's young-generation GC threshold (Python's default: 700). It
#: holds every rank's recent heartbeats (millions of objects at 100k ranks) and makes
#: tens of thousands of short-lived ones a second; at the default the collector ran so
#: often that it took a third of the controller's time at 16,384 ranks
CONTROLLER_GC_YOUNG = 50_000
#: the states in which the controller's cyclic garbage collector is paused: a
#: localization's profiles, plan and results (tens of millions of objects at 131,072
#: ranks) live until its verdict, and collecting over them again and again took 4 s of
#: the 25 s of the controller's own work there; it runs again when the verdict is in
PAUSE_GC_STATES = frozenset({State.PROFILING, State.VALIDATING})


def collect_for(state: State) -> None:
    """Pause the cyclic garbage collector in :data:`PAUSE_GC_STATES`, run it otherwise
    (refcounting frees what holds no cycle either way)."""
    if state in PAUSE_GC_STATES:
        gc.disable()
    else:
        gc.enable()


#: a spare node's launcher keeps a key ``spare:<host>`` alive while it waits
SPARE_PREFIX = "spare:"


def take_node(ctl: Controller, fields: dict) -> None:
    """Note a ``node_joined`` event's node index and host name (ignored when malformed).
    Its ``round_id`` names the rendezvous round (every node of a round has the same): a new
    one opens a new round. TorchElastic's restart count cannot tell rounds apart (a
    restart for a change of members is not counted, and a spare starts at 0)."""
    node, host, world, rid = (fields.get(k) for k in ("node", "host", "world", "round_id"))

    def count(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not (count(node) and isinstance(host, str) and host and count(world) and world > 0 and isinstance(rid, str)):
        return
    if rid != ctl.round_id:
        if ctl.round_id is not None:
            ctl.new_round(world)
        ctl.round_id = rid
    ctl.node_hosts[node] = host


def run_controller(url: str, job: str, world: int | None, events_path: str, cfg, stop: list[bool],
                   plane_host: str | None = None) -> None:
    """The controller's loop: read the ctl stream, then a batch of at most
    ``controller_read_batch`` node heartbeat messages from the beats stream (which it
    trims as it reads), step the Controller, post its commands, write its events, answer
    operators (what they changed is kept in Redis, and a restarted controller takes it
    up), and publish its status snapshot every ``status_interval_s`` and after every step
    that produced something, but never so often that building it takes more than
    ``status_max_share`` of the loop's time (it lists every rank); the key lives three
    intervals, at least 3 s, so a dead controller's status vanishes. Prometheus metrics
    when ``metrics_port`` is set (a port that cannot be bound is an event, and the
    controller goes on without them).

    The control stream first: a report, profile, acknowledgement or result waits at most
    for one batch of heartbeats, however many heartbeats wait behind it. While the
    control stream holds more than one read's worth (16,384 ranks' profiles at once), the
    deadlines wait until it is read (at most ``MAX_DEADLINE_DEFER_S``): a profile that
    reached Redis in time is not late because the controller was busy reading."""
    events = EventLog(events_path)
    lost = False
    metrics = server = None
    last_event: dict | None = None

    def emit(type_: str, **fields) -> None:
        nonlocal last_event
        record = events.emit(type_, **fields)
        if metrics is not None:
            metrics.on_event(record)
        if type_ not in ROUTINE_EVENTS:
            last_event = {k: v for k, v in record.items() if v is None or isinstance(v, (str, int, float, bool))}

    def on_state(ok: bool, why: str) -> None:
        nonlocal lost
        if ok == lost:
            lost = not ok
            emit("controller_redis", connected=ok, reason=why)

    if cfg.metrics_port:
        metrics = JobMetrics()
        try:
            server = MetricsServer(metrics, cfg.metrics_host, cfg.metrics_port)
        except OSError as exc:
            events.emit("metrics_failed", host=cfg.metrics_host, port=cfg.metrics_port, error=str(exc))
            metrics = None
    bus = open_bus(url, job, on_state=on_state)
    # on a cluster, a reader process per shard decodes the heartbeats (control/beat_reader.py)
    readers = (BeatReaders(url, job, len(bus.buses), READ_COUNT, bus.maxlen, emit)
               if isinstance(bus, ShardedBus) and cfg.beat_readers else None)
    streams = [CTL_STREAM] if readers is not None else [CTL_STREAM, BEATS_STREAM]
    # sessions of a restarted controller must not be taken for its predecessor's
    ctl = Controller(cfg, world, first_session=10_000 * (1 + int(time.time()) % 100_000), clock=time.time)
    ctl.plane_host = plane_host
    step = guarded(emit)
    emit("controller_started", pid=os.getpid(), world=world,
         **({"metrics": f"{cfg.metrics_host}:{cfg.metrics_port}"} if server is not None else {}))
    saved = bus.get(OPERATOR_KEY)  # a predecessor's mute and thresholds (this one was restarted)
    if saved is not None:
        try:
            state = json.loads(saved)
        except ValueError:
            state = saved
        for out in step(ctl.restore, state):
            ev = dict(out.event)
            emit(ev.pop("type"), **ev)
    kept = ctl.operator_state()
    next_beat = next_status = status_not_before = 0.0
    last_tick = time.monotonic()
    dropped = (0, 0)  # malformed messages the controller's bus and its beat readers dropped
    try:
        while not stop[0]:
            c = ctl.cfg  # an operator may change it (ctl set)
            if time.monotonic() >= next_beat:
                bus.beat(CONTROLLER_KEY, c.controller_timeout_s)
                next_beat = time.monotonic() + c.heartbeat_s
                if plane_host is not None:  # a job of several launchers: the spare nodes waiting
                    spares = bus.names(SPARE_PREFIX)
                    if spares is not None:
                        ctl.spares = len(spares)
            outputs = []
            before, aside = bus.dropped, bus.deferred
            # while a localization or mitigation runs, reports wait until the stream is quiet
            later = looks_like_report if ctl.defers_reports() else None
            first = bus.read([CTL_STREAM], count=CTL_READ_MAX, later=later)
            came = len(first) + bus.dropped - before + bus.deferred - aside
            backlog = came >= CTL_READ_MAX  # a full read: more is waiting
            got = first + bus.read(streams, block_ms=0 if came else (20 if readers is not None else 100),
                                   count=c.controller_read_batch, later=later)
            since = bus.deferred_since()
            if since is not None and ((not came and all(s != CTL_STREAM for s, _ in got))
                                      or time.monotonic() - since >= MAX_REPORT_WAIT_S):
                got += bus.take_later(CTL_READ_MAX)  # a quiet moment (or waited long enough): a read's worth
            beats = False
            run: list[NodeHeartbeats] = []  # consecutive node heartbeats: taken as one block
            for k, (stream, msg) in enumerate(got):
                beats = beats or stream == BEATS_STREAM
                if isinstance(msg, NodeHeartbeats):
                    run.append(msg)
                    if k + 1 < len(got) and isinstance(got[k + 1][1], NodeHeartbeats):
                        continue
                    outputs += step(ctl.handle_beats, run, time.time())
                    run = []
                    continue
                if isinstance(msg, RankEvent):  # a rank's own event (several launchers): logged as it is
                    record = msg.record()
                    if msg.type == "node_joined":  # which host each node of this round is
                        take_node(ctl, msg.fields)
                    events.write(record)
                    if metrics is not None:
                        metrics.on_event(record)
                    continue
                outputs += step(ctl.handle, msg, time.time())
            if beats:
                bus.trim_read(BEATS_STREAM)  # the controller is its only reader
            if readers is not None:  # what the readers decoded since: one block
                readers.check(time.monotonic())
                blocks = readers.take()
                if blocks:
                    outputs += step(ctl.handle_block, np.concatenate(blocks), time.time())
            if not backlog or time.monotonic() - last_tick >= MAX_DEADLINE_DEFER_S:
                outputs += step(ctl.tick, time.time())
                last_tick = time.monotonic()
            counts = (bus.dropped, readers.dropped if readers is not None else 0)
            if sum(counts) > sum(dropped):  # one event a round, however many: a burst must not flood the log
                error = (readers.last_error if readers is not None and counts[1] > dropped[1]
                         else bus.errors[-1] if bus.errors else "")
                emit("message_dropped", where="controller", count=sum(counts) - sum(dropped), dropped=sum(counts),
                     error=error)
                dropped = counts
            if outputs and ctl.operator_state() != kept:  # saved before any reply says it is done
                kept = ctl.operator_state()
                bus.put(OPERATOR_KEY, json.dumps(kept), OPERATOR_TTL_S)
            replies = [out for out in outputs if out.kind == "reply"]
            commands: list[Any] = []  # consecutive commands: posted in one round trip
            for k, out in enumerate(outputs):
                if out.kind == "reply":
                    continue  # after the snapshot below: a command reported done shows in the status
                if out.kind == "table":  # an operator asked for every rank's row: written before the reply
                    try:
                        write_table(Path(events_path).parent / TABLE_FILE, out.message)
                    except OSError as exc:
                        emit("table_failed", error=str(exc))
                    continue
                if out.kind == "command":
                    commands.append(out.message)
                    if k + 1 < len(outputs) and outputs[k + 1].kind == "command":
                        continue
                    post_in_order(bus, CMD_STREAM, commands, emit)
                    commands = []
                elif out.kind == "localized":
                    post_in_order(bus, LOCALIZED_STREAM, [out.message], emit)
                else:
                    ev = dict(out.event)
                    emit(ev.pop("type"), **ev)
            t_status = time.monotonic()
            # an operator's command is answered with the status it left (never rate-limited:
            # commands are rare, and "ctl mute" then "ctl status" must agree)
            if replies or ((outputs or t_status >= next_status) and t_status >= status_not_before):
                snap = step(lambda: [ctl.snapshot(time.time(), job, last_event)])
                gap = ctl.cfg.status_interval_s
                if snap:
                    data = encode(snap[0])
                    # what it cost bounds how often it is built: at most status_max_share of the time
                    least = (time.monotonic() - t_status) / ctl.cfg.status_max_share
                    gap = max(gap, least)
                    status_not_before = t_status + least
                    bus.put(STATUS_KEY, data, max(3.0, 3 * gap))
                    if metrics is not None:
                        metrics.on_snapshot(snap[0])
                next_status = t_status + gap
            for out in replies:
                bus.put(reply_key(out.message.id), encode(out.message), REPLY_TTL_S)
            # after the outputs are out: the collection a localization deferred (seconds at
            # 100k ranks) must not hold back its verdict
            collect_for(ctl.state)
    finally:
        if readers is not None:
            readers.close()
        if server is not None:
            server.close()
        bus.close()
        events.close()


def write_table(path: Path, rows: list[dict[str, Any]]) -> None:
    """Every rank's status row (``rank`` then :data:`~falconext.control.snapshot.ROW_COLUMNS`)
    to the CSV file ``path``, replaced whole (a reader never sees half of it)."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=("rank",) + ROW_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def post_in_order(bus: Any, stream: str, msgs: list[Any], emit: Callable[..., None]) -> None:
    """Post the controller's ``msgs`` (commands, a verdict) to ``stream`` in order, in one
    round trip; one too large for the bus is said (``post_failed``, never the controller's
    end) and the others still go."""
    try:
        bus.post_many(stream, msgs)
        return
    except MessageError:
        pass
    for msg in msgs:
        try:
            bus.post(stream, msg)
        except MessageError as exc:
            emit("post_failed", what=type(msg).__name__, error=str(exc))


def guarded(events):
    """A caller of controller steps (``handle``, ``tick``) that turns an exception into a
    ``controller_error`` event and no output, never the end of the controller; the
    caller's ``errors`` counts them. ``events``: an EventLog, or an ``emit(type, **fields)``."""
    say = getattr(events, "emit", events)

    def call(step, *args):
        try:
            return step(*args)
        except Exception as exc:  # a message or a state the controller cannot handle
            call.errors += 1
            say("controller_error", error=repr(exc), errors=call.errors)
            return []

    call.errors = 0
    return call


def run_agent(url: str, job: str, node: int, stop: list[bool], ranks: set[int] | None = None,
              cfg: FalconConfig | None = None, since_ms: int | None = None) -> None:
    """Run node ``node``'s agent on the bus at ``url`` until ``stop[0]`` turns True,
    printing each change of its dropped and refused counts. ``ranks``: the ranks of this
    node (None: accept every rank); ``cfg``: the heartbeat period it combines heartbeats
    over, and the streams' length; ``since_ms``: forward what the ranks posted from that
    time on (an agent started after its ranks), else from now."""
    cfg = cfg or FalconConfig()
    agent = NodeAgent(open_bus(url, job, maxlen=cfg.stream_maxlen, since_ms=since_ms), node, gpu_health, ranks,
                      cfg.heartbeat_s)
    said = (0, 0)
    while not stop[0]:
        agent.step()
        counts = (agent.bus.dropped, agent.refused)
        if counts != said:  # its log (agent<N>.log) says what it refused, as it happens
            errors = agent.bus.errors
            print(f"agent {node}: dropped {counts[0]} malformed message(s), refused {counts[1]} from other "
                  f"nodes' ranks; latest: {errors[-1] if errors else ''}", flush=True)
            said = counts
    agent.bus.close()


#: the launcher's pid, set by the launcher that starts a service (its parent)
PARENT_ENV = "FALCONEXT_PARENT_PID"


def watch_parent(stop: list[bool], every_s: float = 0.5) -> threading.Thread:
    """Set ``stop[0]`` once this process's parent (the launcher that supervises it) is
    gone, so a launcher killed with SIGKILL leaves no controller or agent behind; checked
    every ``every_s`` by a daemon thread, which it returns. The parent is the pid the
    launcher named in :data:`PARENT_ENV` (else the parent seen now): a launcher killed
    while this process was still importing (1.5 s on a loaded 2-core host) is then seen
    gone at the first check, where the parent seen after the imports was already init."""
    named = os.environ.get(PARENT_ENV, "")
    parent = int(named) if named.isdigit() else os.getppid()

    def watch() -> None:
        while not stop[0]:
            if os.getppid() != parent:
                stop[0] = True
                return
            time.sleep(every_s)

    thread = threading.Thread(target=watch, name="falconext-parent-watch", daemon=True)
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> int:
    """Run a controller, an agent or a controller's beat reader (control/beat_reader.py)
    as its own process (the launcher's or the controller's child) until SIGTERM
    or SIGINT; returns 0. The Redis URL comes from the environment, never argv; without
    it, prints one line and returns 2."""
    p = argparse.ArgumentParser(prog="falconext.control.service", description=__doc__.splitlines()[0])
    p.add_argument("role", choices=["controller", "agent", "beat-reader"])
    p.add_argument("--job", required=True)
    p.add_argument("--world", type=int, default=None, help="ranks in the job (controller)")
    p.add_argument("--events", default=None, help="events.jsonl to append to (controller)")
    p.add_argument("--node", type=int, default=0, help="this agent's node")
    p.add_argument("--ranks", default=None, help="the ranks on this agent's node, comma-separated (agent)")
    p.add_argument("--plane-host", default=None,
                   help="a job of several launchers: the host this plane (and the rendezvous store) runs on (controller)")
    p.add_argument("--since-ms", type=int, default=None,
                   help="forward what the ranks posted from this time on, ms since the epoch (agent; default: now)")
    p.add_argument("--shard", type=int, default=0, help="the shard whose heartbeats this reader reads (beat-reader)")
    p.add_argument("--count", type=int, default=64, help="node messages read at most at once (beat-reader)")
    p.add_argument("--maxlen", type=int, default=10000, help="the length streams are trimmed to (beat-reader)")
    add_config_arguments(p)
    args = p.parse_args(argv)
    url = os.environ.get(REDIS_URL_ENV)
    if not url:
        print(f"falconext.control.service: error: ${REDIS_URL_ENV} is not set", file=sys.stderr)
        return 2
    stop = [False]

    def _stop(*_):
        stop[0] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    watch_parent(stop)
    if args.role == "beat-reader":
        run_reader(url, args.job, args.shard, sys.stdout.buffer, stop, max(1, args.count), max(1, args.maxlen))
        return 0
    if args.role == "controller":
        if not args.events:
            print("falconext.control.service: error: the controller needs --events", file=sys.stderr)
            return 2
        gc.set_threshold(CONTROLLER_GC_YOUNG, *gc.get_threshold()[1:])  # this process only
        run_controller(url, args.job, args.world, args.events, config_from_args(args), stop, args.plane_host)
    else:
        try:
            ranks = None if args.ranks is None else {int(r) for r in args.ranks.split(",") if r.strip()}
        except ValueError:
            print(f"falconext.control.service: error: --ranks {args.ranks!r} is not a list of ranks", file=sys.stderr)
            return 2
        run_agent(url, args.job, args.node, stop, ranks, config_from_args(args), args.since_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
