"""A heartbeat reader per Redis Cluster shard: a process that reads its shard's heartbeat
stream, decodes the node heartbeats strictly, and hands the controller their rows as one
float block per read over a pipe (:func:`run_reader`, :class:`BeatReaders`).

At 131,072 ranks the heartbeats come 32,768 node messages a second. Decoding one (JSON,
then the schema) takes about 45 microseconds, so the decoding alone would fill the
controller's one core. On a cluster of N shards, N readers decode in parallel. The
controller, the one decision maker, takes each block in a few array operations
(control/beat_table.py). A block is raw float64 rows behind a fixed header
(:func:`frame`); nothing is pickled. The receiving side checks every frame
(:func:`read_frame`) before it trusts it.

A reader that exits is started again, and an event says so. A lost shard costs only its
nodes' heartbeats until it is back: the reader's Bus fails open, as the controller's does.
"""

from __future__ import annotations

import os
import queue
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, Callable

import numpy as np

from falconext.control.client import BEATS_STREAM, REDIS_URL_ENV
from falconext.control.shards import ShardedBus
from falconext.protocol.codec import decode_heartbeats
from falconext.protocol.messages import HEARTBEAT_FIELDS

#: a frame's header: magic, kind, rows (a block) or bytes of text (a note), dropped so far
HEADER = struct.Struct("<4sIII")
MAGIC = b"FXBR"
BLOCK, NOTE = 1, 2
WIDTH = len(HEARTBEAT_FIELDS)
#: the most rows one frame may carry (a read of 1,000 node messages of 8 ranks is 8,000)
MAX_ROWS = 1 << 20
#: the most bytes of a note's text
MAX_NOTE = 4096
#: node messages a reader reads at most at once (each read is one block)
READ_COUNT = 1000
#: how long a reader waits on its stream in one read, milliseconds
READ_BLOCK_MS = 100
#: a reader that exited is started again after this many seconds, doubled for each exit in a
#: row within STEADY_S of its start, up to MAX_RESTART_S
RESTART_S = 1.0
STEADY_S = 10.0
MAX_RESTART_S = 30.0


class FrameError(ValueError):
    """A frame from a reader that is not one: what is wrong, in one line."""


@dataclass(frozen=True)
class Frame:
    """One frame from a reader: a ``block`` of heartbeat rows or a ``note`` (the latest
    error it dropped a message for), and the messages it dropped so far."""

    block: np.ndarray | None
    note: str
    dropped: int


def frame(block: np.ndarray | None, dropped: int, note: str = "") -> bytes:
    """The bytes of a frame: a block of heartbeat rows (float64, :data:`WIDTH` columns),
    or, with ``block`` None, a ``note``."""
    if block is None:
        text = note.encode("utf-8")[:MAX_NOTE]
        return HEADER.pack(MAGIC, NOTE, len(text), dropped) + text
    rows = np.ascontiguousarray(block, dtype="<f8")
    if rows.ndim != 2 or rows.shape[1] != WIDTH or len(rows) > MAX_ROWS:
        raise ValueError(f"a block is up to {MAX_ROWS} rows of {WIDTH} values, got shape {rows.shape}")
    return HEADER.pack(MAGIC, BLOCK, len(rows), dropped) + rows.tobytes()


def read_frame(stream: IO[bytes]) -> Frame | None:
    """The next frame on ``stream``; None at its end. FrameError names what is wrong with
    one that is not a frame: a wrong magic or kind, too many rows, a cut-off body, rows
    with a value that is not finite or a rank that is not a whole number >= 0."""
    head = _exactly(stream, HEADER.size)
    if head is None:
        return None
    magic, kind, size, dropped = HEADER.unpack(head)
    if magic != MAGIC:
        raise FrameError(f"beat reader frame: bad magic {magic!r}")
    if kind == NOTE:
        if size > MAX_NOTE:
            raise FrameError(f"beat reader frame: a note of {size} bytes (at most {MAX_NOTE})")
        text = _exactly(stream, size)
        if text is None:
            raise FrameError("beat reader frame: the note is cut off")
        return Frame(None, text.decode("utf-8", errors="replace"), dropped)
    if kind != BLOCK:
        raise FrameError(f"beat reader frame: unknown kind {kind}")
    if size > MAX_ROWS:
        raise FrameError(f"beat reader frame: {size} rows (at most {MAX_ROWS})")
    body = _exactly(stream, size * WIDTH * 8)
    if body is None:
        raise FrameError(f"beat reader frame: the block of {size} rows is cut off")
    block = np.frombuffer(body, dtype="<f8").reshape(size, WIDTH).astype(np.float64)
    if not np.isfinite(block).all():
        raise FrameError("beat reader frame: a value that is not finite")
    ranks = block[:, 0]
    if len(ranks) and (ranks.min() < 0 or not (ranks == np.floor(ranks)).all()):
        raise FrameError("beat reader frame: a rank that is not a whole number >= 0")
    return Frame(block, "", dropped)


def _exactly(stream: IO[bytes], n: int) -> bytes | None:
    """``n`` bytes from ``stream``; None when it ends before the first, FrameError when it
    ends inside them."""
    parts, got = [], 0
    while got < n:
        part = stream.read(n - got)
        if not part:
            if got:
                raise FrameError(f"beat reader frame: {n - got} of {n} bytes missing at the end")
            return None
        parts.append(part)
        got += len(part)
    return b"".join(parts) if n else b""


# --- the reader process -------------------------------------------------------------------


def run_reader(url: str, job: str, shard: int, out: IO[bytes], stop: list[bool], count: int,
               maxlen: int = 10000) -> None:
    """Read shard ``shard``'s heartbeat stream of the cluster at ``url`` until ``stop[0]``
    (or ``out`` is closed), at most ``count`` node messages a read; write each read's
    heartbeats to ``out`` as one block, and a note whenever it dropped a malformed
    message. It reads from the stream's start: what is there waited while no reader read
    (the controller starting, a reader started again), since each trims what it read (it
    is the stream's only reader)."""
    bus = ShardedBus(url, job, maxlen=maxlen)
    own = bus.buses[shard]
    own.seek(BEATS_STREAM, "0-0")
    said = 0
    try:
        while not stop[0]:
            got = own.read_raw([BEATS_STREAM], block_ms=READ_BLOCK_MS, count=count)
            if got:
                own.trim_read(BEATS_STREAM)
            block, errors = decode_heartbeats([raw for _, _, raw in got])
            for i, why in errors:
                own.drop(f"dropped {BEATS_STREAM} entry {got[i][1]}: {why}")
            if own.dropped != said:
                said = own.dropped
                out.write(frame(None, said, own.errors[-1] if own.errors else ""))
            if len(block):
                out.write(frame(block, said))
            if got or errors:
                out.flush()
    except (BrokenPipeError, OSError):
        pass  # the controller is gone
    finally:
        bus.close()


# --- the controller's side -------------------------------------------------------------


class BeatReaders:
    """The controller's readers, one process per shard (``python -m
    falconext.control.service beat-reader``), each with a thread that takes its frames
    into one queue. ``emit(type, **fields)`` says when a reader exited or sent what is
    not a frame; :meth:`check` starts an exited one again."""

    def __init__(self, url: str, job: str, shards: int, count: int, maxlen: int,
                 emit: Callable[..., None]) -> None:
        self.url, self.job, self.count, self.maxlen, self.emit = url, job, count, maxlen, emit
        self.frames: queue.Queue[tuple[int, Frame]] = queue.Queue()
        #: messages the readers dropped as malformed, all of them since the start
        self.dropped = 0
        self.last_error = ""
        self._seen = [0] * shards  # each reader process's own count, as it said last
        self.procs: list[subprocess.Popen | None] = [None] * shards
        self.restart_at = [0.0] * shards
        self.started = [0.0] * shards
        self.quick_exits = [0] * shards  # exits in a row within STEADY_S of the start
        self.restarts = 0
        for k in range(shards):
            self._start(k)

    def _start(self, k: int) -> None:
        env = {**os.environ, "FALCONEXT_PARENT_PID": str(os.getpid()), REDIS_URL_ENV: self.url}  # never on argv
        proc = subprocess.Popen(
            [sys.executable, "-m", "falconext.control.service", "beat-reader", "--job", self.job, "--shard", str(k),
             "--count", str(self.count), "--maxlen", str(self.maxlen)],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=None)
        self.procs[k] = proc
        self.started[k] = time.monotonic()
        threading.Thread(target=self._pump, args=(k, proc), name=f"falconext-beat-reader-{k}", daemon=True).start()

    def _pump(self, k: int, proc: subprocess.Popen) -> None:
        """Reader ``k``'s frames into the queue, until its pipe ends or carries what is not
        a frame (then the reader is stopped: :meth:`check` starts it again)."""
        assert proc.stdout is not None
        try:
            while True:
                got = read_frame(proc.stdout)
                if got is None:
                    return
                self.frames.put((k, got))
        except FrameError as exc:
            self.frames.put((k, Frame(None, f"{exc}", -1)))
            proc.kill()

    def take(self) -> list[np.ndarray]:
        """The blocks received since the last call, in the order they came (the notes'
        drops added to :attr:`dropped`, their error kept in :attr:`last_error`; a bad
        frame said as an event)."""
        blocks = []
        while True:
            try:
                k, got = self.frames.get_nowait()
            except queue.Empty:
                return blocks
            if got.block is not None:
                blocks.append(got.block)
            elif got.dropped < 0:
                self.emit("beat_reader_error", shard=k, error=got.note)
            else:
                self.dropped += max(0, got.dropped - self._seen[k])
                self._seen[k] = got.dropped
                self.last_error = got.note

    def check(self, now: float) -> None:
        """Start again a reader that exited (an event each), :data:`RESTART_S` after it
        exited, longer after quick exits in a row (``now``: monotonic)."""
        for k, proc in enumerate(self.procs):
            if proc is None or proc.poll() is None:
                continue
            if not self.restart_at[k]:
                quick = now - self.started[k] < STEADY_S
                self.quick_exits[k] = self.quick_exits[k] + 1 if quick else 0
                wait = min(MAX_RESTART_S, RESTART_S * 2 ** self.quick_exits[k])
                self.restart_at[k] = now + wait
                self.emit("beat_reader_exited", shard=k, code=proc.returncode, restart_in_s=wait)
            elif now >= self.restart_at[k]:
                self.restart_at[k] = 0.0
                self.restarts += 1
                self._seen[k] = 0  # a new process counts from zero
                self._start(k)

    def close(self) -> None:
        """Stop every reader (terminate, then kill after 3 s); never raises."""
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 3.0
        for proc in self.procs:
            if proc is None:
                continue
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
