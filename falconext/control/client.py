"""A rank's link to the control plane: one background thread, never the training thread.

It posts what the rank has to say (heartbeats, fail-slow reports, profiles, suspension
acks, validation results) to its node's stream, where the node agent picks them up, and
reads the controller's commands. Everything on the network side is fail-open: when
Redis or the controller is gone the rank logs ``control_lost`` once, keeps training at
full speed, and logs ``control_restored`` when they are back. Commands are decoded
strictly by the bus; a command that makes no sense here is logged and dropped.

The thread reads its own CPU clock after each round (:meth:`RankClient.cpu_seconds`): what
the control link costs the rank.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

from falconext.config import FalconConfig
from falconext.control.bus import FIELD
from falconext.control.shards import AnyBus, open_bus
from falconext.protocol.base import MessageError
from falconext.protocol.codec import MAX_MESSAGE_BYTES, encode
from falconext.protocol.commands import Command, Go, ProfileRequest, Release, Resume, Share, Suspend
from falconext.protocol.messages import Heartbeat, ProfileData
from falconext.protocol.rank_side import heartbeat, missed_ack, profile_data

#: how a job's processes learn the bus: the URL (it holds the password) and the job id
REDIS_URL_ENV = "FALCON_REDIS_URL"
JOB_ENV = "FALCON_JOB"
CMD_STREAM = "cmd"
CTL_STREAM = "ctl"
#: the node agents' aggregated heartbeats (NodeHeartbeats), read by the controller after
#: the ctl stream and trimmed by it as it reads: a backlog here never delays a report,
#: profile, acknowledgement or result
BEATS_STREAM = "beats"
LOCALIZED_STREAM = "localized"
CONTROLLER_KEY = "controller"
#: the controller's latest StatusSnapshot (``falconext ctl status``, the progress line)
STATUS_KEY = "status"


def redis_url_from_file(path: str, flag: str = "--falcon-redis-url-file") -> str:
    """The control-plane Redis URL on the first line of ``path`` (a file, so that its
    password never shows on a command line); ValueError naming ``flag`` and the problem."""
    try:
        with open(path) as f:
            url = f.readline().strip()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"{flag} {path}: expected a redis:// URL on its first line")
    return url


def reply_key(command_id: str) -> str:
    """Where the controller leaves its CommandReply to the operator command ``command_id``."""
    return f"reply:{command_id}"


def node_copy(stream: str, node: int) -> str:
    """Node ``node``'s copy of ``stream`` (``cmd``, ``ctl``, ``beats``): on one Redis server
    the stream itself, on a cluster the copy on the node's shard (control/shards.py)."""
    return f"{stream}@{node}"


def node_stream(node: int) -> str:
    """The name of the stream on which ranks of node ``node`` post to that node's agent."""
    return f"node:{node}"


class RankClient:
    """``runtime`` supplies: ``iteration()``, ``iter_s()``, ``beat_fields()`` (the
    heartbeat's optional fields), ``profile(window_s)`` (the
    fields of ProfileData) and ``share(session, share)`` (this rank's part of a validation
    plan, before its suspend), ``schedule(suspend) -> int | None`` / ``signal(go_release_or_resume)``
    for suspensions; ``emit(type, **fields)`` writes events.jsonl."""

    def __init__(
        self,
        url: str,
        job: str,
        rank: int,
        node: int,
        config: FalconConfig,
        runtime: Any,
        emit: Callable[..., Any],
        chaos: Any = None,
    ) -> None:
        self.rank = rank
        self.node = node
        self.cfg = config
        self.runtime = runtime
        self.emit = emit
        self._url, self._job = url, job
        #: chaos mode (falconext/testbed/chaos.py BusChaos): what befalls each post
        self.chaos = chaos
        self._out: queue.Queue = queue.Queue(maxsize=10000)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"falcon-control-{rank}", daemon=True)
        self._lost: set[str] = set()
        self.commands = 0
        self._dropped_seen = 0
        self.dropped_out = 0
        #: exceptions caught in the thread's rounds (the thread goes on after each)
        self.errors = 0
        self._cpu_s = 0.0  # the thread's CPU clock, as it last read it

    def start(self) -> None:
        """Start the client's background thread (once); returns at once."""
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to stop and wait for it, at most 5 s: a thread stuck in Redis is
        left behind (it is a daemon) rather than holding up the caller."""
        self._stop.set()
        self._thread.join(timeout=5)

    def cpu_seconds(self) -> float:
        """Thread CPU seconds the client's thread has used, up to its latest round."""
        return self._cpu_s

    def post(self, msg: Any) -> None:
        """Queue a message for the controller; never blocks the caller."""
        try:
            self._out.put_nowait(msg)
        except queue.Full:
            self.dropped_out += 1

    # --- the thread ---------------------------------------------------------------------

    def _state(self, what: str, ok: bool, reason: str) -> None:
        if ok and what in self._lost:
            self._lost.discard(what)
            self.emit("control_restored", rank=self.rank, what=what)
        elif not ok and what not in self._lost:
            self._lost.add(what)
            self.emit("control_lost", rank=self.rank, what=what, reason=reason)

    def _run(self) -> None:
        bus = open_bus(self._url, self._job, on_state=lambda ok, why: self._state("redis", ok, why))
        self._next_beat = 0.0  # next heartbeat and controller check (monotonic)
        self._since = time.monotonic()  # the controller's absence counts from here
        self._busy_until = 0.0  # wait briefly for commands until then (monotonic)
        self._seen_controller = False
        try:
            while not self._stop.is_set():
                try:
                    self._round(bus)
                except Exception as exc:  # nothing may end this thread: heartbeats must go on
                    self.errors += 1
                    self.emit("control_error", rank=self.rank, error=f"client round failed: {exc!r}",
                              errors=self.errors)
                    self._stop.wait(0.1)
                self._cpu_s = time.thread_time()
        finally:
            self._flush(bus)
            bus.close()
            self._cpu_s = time.thread_time()

    def _flush(self, bus: AnyBus, most: int = 200) -> None:
        """Post what is still queued when the client stops (a rank's last events: it is
        leaving), at most ``most`` messages, heartbeats left out; never raises."""
        stream = node_stream(self.node)
        for _ in range(most):
            try:
                msg = self._out.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, Heartbeat):
                continue
            try:
                if not self._post(bus, stream, msg):
                    return
            except Exception:  # noqa: BLE001 - best effort at exit
                return

    def _round(self, bus: AnyBus) -> None:
        """One pass: heartbeat and controller check when due, queued posts, commands."""
        stream = node_stream(self.node)
        now = time.monotonic()
        if now >= self._next_beat:
            it, iter_s = self.runtime.iteration(), self.runtime.iter_s()
            # every heartbeat_s, or once per iteration where iterations are longer, but at
            # least three times per controller_timeout_s: each beat is a Redis round trip,
            # and a wake-up of this thread costs more than the message (issue 29)
            self._next_beat = now + min(max(self.cfg.heartbeat_s, iter_s), self.cfg.controller_timeout_s / 3)
            beat = heartbeat(self.rank, self.node, it, iter_s, time.time(), self.runtime.beat_fields())
            if beat is not None:
                self.post(beat)
            # the controller is looked at in the same round (one wake-up for both): at
            # least three looks per controller_timeout_s tell a lost one in time
            alive = bus.alive(CONTROLLER_KEY)
            self._seen_controller = self._seen_controller or bool(alive)
            # None: Redis itself is down, logged as such. A controller not seen yet is not
            # lost before controller_timeout_s: ranks forked from a warm process can start
            # before the controller's own interpreter has (0.3 s, seen in the test suite)
            if alive is not None and (alive or self._seen_controller
                                      or now - self._since >= self.cfg.controller_timeout_s):
                self._state("controller", alive, "no controller heartbeat" if self._seen_controller
                            else f"no controller heartbeat since the rank started {now - self._since:.1f} s ago")
        while True:
            try:
                msg = self._out.get_nowait()
            except queue.Empty:
                break
            if not isinstance(msg, Heartbeat):
                self._busy_until = now + self.cfg.control_busy_s
            try:
                posted = self._post(bus, stream, msg)
            except MessageError as exc:  # too large for any reader: dropped, said
                self.dropped_out += 1
                self.emit("message_dropped", rank=self.rank, error=str(exc), dropped_out=self.dropped_out)
                continue
            if not posted:
                break  # Redis is down: this message is lost, like the rest will be
        # wait for commands: briefly while something is going on (a command came, this
        # rank posted more than its heartbeat), else up to control_idle_s, so that an idle
        # rank's client wakes a few times per second rather than ten
        busy = now < self._busy_until
        idle_ms = int(1000 * max(0.1, min(self.cfg.control_idle_s, self._next_beat - time.monotonic())))
        for _, cmd in bus.read([node_copy(CMD_STREAM, self.node)], block_ms=100 if busy else idle_ms, accept={"Command"}):
            self._busy_until = time.monotonic() + self.cfg.control_busy_s
            self._command(cmd)
        self._report_drops(bus)
        if not bus.connected:
            self._stop.wait(0.1)

    def _post(self, bus: AnyBus, stream: str, msg: Any) -> bool:
        """``bus.post``, unless chaos mode drops, delays or damages the message first."""
        chaos = self.chaos
        if chaos is None:
            return bus.post(stream, msg)
        if chaos.spec.delay_ms:
            time.sleep(chaos.spec.delay_ms / 1000.0)
        fate = chaos.fate(type(msg).__name__)
        if fate == "drop":
            return True  # lost on the way, as far as this rank can tell
        if fate == "corrupt":
            return bus.post_raw(stream, {FIELD: chaos.damage(encode(msg))}) is not None
        return bus.post(stream, msg)

    def _report_drops(self, bus: AnyBus) -> None:
        """Malformed or unexpected messages were dropped by the bus: say so, once each."""
        while bus.dropped > self._dropped_seen:
            self._dropped_seen += 1
            self.emit("message_dropped", rank=self.rank, error=bus.errors[-1] if bus.errors else "")

    def _profile(self, session: int, window_s: float) -> ProfileData:
        """This rank's profile, the newest calls only as many as fit in one message (a
        rank with many calls would otherwise send more than any reader accepts)."""
        limit = 1500
        while True:
            snap = self.runtime.profile(window_s, limit)
            msg = profile_data(self.rank, session, snap["roles"], snap["members"], snap["calls"],
                               snap.get("fabric", ""), snap.get("nccl_algo"))
            if limit <= 1 or len(encode(msg).encode("utf-8")) <= MAX_MESSAGE_BYTES:
                return msg
            limit //= 2

    def _command(self, cmd: Command) -> None:
        self.commands += 1
        match cmd:
            case ProfileRequest(session=session, window_s=window):
                if not 0 < window <= 600:
                    self.emit("control_error", rank=self.rank, error=f"profile window {window!r} out of range")
                    return
                self.post(self._profile(session, float(window)))
            case Share(session=session, share=share):
                if share.first <= self.rank <= share.last:
                    self.runtime.share(session, share)
            case Suspend(session=session):
                missed = self.runtime.schedule(cmd)
                if missed is not None:
                    self.post(missed_ack(self.rank, session, missed, time.time()))
            case Go() | Release() | Resume():  # a resume: a validation's verdict, with the action to apply or none
                self.runtime.signal(cmd)
            case _:
                pass  # operators' commands are for the controller
