"""The progress line of ``falconext train``: iteration, s/iter, controller state, latest event.

A thread of the launcher reads the controller's status snapshot (the Redis key that
``falconext ctl status`` reads) once a second. On a terminal it rewrites one line in
place (``\\r``); otherwise (a log file, a pipe, the tests) it prints a plain line every
:data:`EVERY_ITERATIONS` iterations or :data:`EVERY_S` seconds, whichever comes first,
and when the controller's state or latest event changes (at most every
:data:`CHANGE_S` seconds), so a log is not flooded. Every
line starts with ``falconext: progress``: readers of the run's own summary (printed
by rank 0 at the end) skip them. The line never stops training: a Redis that does not
answer is a line not printed.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, TextIO

import redis

from falconext.control.shards import home
from falconext.control.client import STATUS_KEY
from falconext.protocol.codec import MAX_STATUS_BYTES, decode
from falconext.protocol.messages import StatusSnapshot

#: plain lines (not a terminal): one per this many iterations ...
EVERY_ITERATIONS = 10
#: ... or per this many seconds, whichever comes first
EVERY_S = 5.0
#: ... and a change of state or latest event at most once per this many seconds
CHANGE_S = 2.0
#: how often the snapshot is read
POLL_S = 1.0
PREFIX = "falconext: progress"


def progress_line(snap: StatusSnapshot, iters: int | None = None) -> str:
    """One line: the iteration of the rank furthest behind (of ``iters``), the slowest
    rank's recent s/iter (the job's pace), the controller's state and its latest event."""
    where = snap.position()
    if where is not None:
        it, pace = where
        head = f"iteration {it}" + (f"/{iters}" if iters else "") + f", {pace:.3f} s/iter"
    else:
        head = "waiting for the ranks"
    state = snap.state + (" (muted)" if snap.muted else "")
    ev = snap.last_event
    latest = "-"
    if ev:
        latest = str(ev.get("type", "?"))
        detail = ev.get("strategy") or ev.get("command") or ev.get("new")
        if detail is not None:
            latest += f" {detail}"
        if isinstance(ev.get("time"), (int, float)):
            latest += time.strftime(" (%H:%M:%S)", time.localtime(ev["time"]))
    return f"{PREFIX}: {head}, controller {state}, latest event: {latest}"


class Progress:
    """The launcher's progress thread for one job (:meth:`start`, :meth:`stop`)."""

    def __init__(self, url: str, job: str, iters: int | None = None, stream: TextIO | None = None,
                 tty: bool | None = None) -> None:
        self.url, self.job, self.iters = url, job, iters
        self._home, self._prefix = home(url, job)  # where the job's status is (a cluster: shard 0)
        self.stream = stream if stream is not None else sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="falcon-progress", daemon=True)
        self._last: tuple[int, float, Any] = (-EVERY_ITERATIONS, 0.0, None)
        self._width = 0
        self._done = False  # a terminal's line was ended at the last iteration
        self.printed = 0

    def start(self) -> "Progress":
        """Start the reporting thread; returns this object."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread (within 5 s) and end an in-place line, so what follows starts on its own line."""
        self._stop.set()
        self._thread.join(timeout=5)
        if self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()

    def _read(self, client: Any) -> StatusSnapshot | None:
        try:
            raw = client.get(self._prefix + STATUS_KEY)
            return None if raw is None else decode(raw, accept={"StatusSnapshot"}, max_bytes=MAX_STATUS_BYTES)
        except Exception:  # noqa: BLE001 - Redis gone, a bad snapshot: progress must never stop training
            return None

    def _run(self) -> None:
        client = redis.Redis.from_url(self._home, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            while not self._stop.wait(POLL_S):
                snap = self._read(client)
                if snap is not None:
                    self.show(snap, time.monotonic())
        finally:
            client.close()

    def show(self, snap: StatusSnapshot, now: float) -> bool:
        """Print the line for ``snap`` if it is due (always on a terminal); True if printed."""
        line = progress_line(snap, self.iters)
        it, pace = snap.position() or (-1, 0.0)
        if self.tty:
            if self._done:
                return False
            pad = max(0, self._width - len(line))
            self.stream.write("\r" + line + " " * pad)
            self._width = len(line)
            if self.iters and it >= 0 and it + (POLL_S / pace if pace > 0 else 0.0) >= self.iters - 1:
                # the last iteration before the next poll: end the line before rank 0 prints
                # the run's summary
                self.stream.write("\n")
                self._done, self._width = True, 0
        else:
            key = (snap.state, snap.muted, (snap.last_event or {}).get("time"))
            last_it, last_t, last_key = self._last
            due = it >= last_it + EVERY_ITERATIONS or now - last_t >= EVERY_S or (
                key != last_key and now - last_t >= CHANGE_S)
            if it < 0 or not due:
                return False
            self.stream.write(line + "\n")
            self._last = (it, now, key)
        self.stream.flush()
        self.printed += 1
        return True
