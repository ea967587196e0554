"""The suspension point of the validation phase.

A :class:`Trap`, armed from another thread, holds the next intercepted call in a wait
loop until released or until its deadline, so training pauses at a collective with no
checkpoint and no restart. The tracer's wrappers check ``armed`` on every call.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Callable

#: the trap's wait loop wakes up this often (keeps signals and Ctrl-C responsive)
TRAP_SLICE_S = 0.05


class Trap:
    """Holds the next intercepted call until :meth:`release` or the deadline.

    The training thread checks ``armed`` (one attribute read) on every call; everything
    else happens only while a call is held. The deadline is mandatory and counts from
    the moment the call is caught, so a validation phase that dies cannot leave
    training suspended for longer than it asked for. Any thread's next intercepted call
    is caught, so the arming thread must not issue one before ``held`` turns True.

    ``at_seq`` (a job without loop hooks): the trap lets calls pass until the one whose
    sequence number (the tracer's ``seq``) reaches it, so every rank can hold at the
    first call of the same iteration as its own call stream counts them. The tracer
    keeps ``seen``, the last ``seq`` it gave out, up to date for that.
    """

    def __init__(self) -> None:
        self.armed = False
        #: hold no call numbered below this (None: the next call)
        self.at_seq: int | None = None
        #: the last sequence number the tracer gave a call (-1: none yet)
        self.seen = -1
        #: a call is being held right now
        self.held = False
        #: calls held so far
        self.holds = 0
        #: seconds the last held call waited
        self.last_pause_s = 0.0
        #: holds that ended by the deadline rather than by release()
        self.expired = 0
        self._deadline_s = 0.0
        self._on_hold: Callable[[float], None] | None = None
        #: exceptions raised by an on_hold callback (swallowed)
        self.errors = 0
        #: thread CPU seconds the held threads spent in holds (validation work included)
        self.cpu_s = 0.0
        self._released = threading.Event()
        self._claim = threading.Lock()

    def arm(self, deadline_s: float, on_hold: Callable[[float], None] | None = None,
            at_seq: int | None = None) -> None:
        """Catch the next intercepted call (``at_seq``: the first numbered at least that);
        hold it at most ``deadline_s`` seconds.

        ``on_hold(end)`` runs on the held thread, given the deadline as a
        ``time.monotonic()`` value; the call goes on as soon as it returns (a suspension
        does its work there, on the thread that owns the training's process groups).
        Whatever it raises is counted in ``errors``, never passed to training.
        """
        if deadline_s is None:
            raise ValueError("a trap needs a deadline: a lost release must not hang training")
        deadline_s = float(deadline_s)
        if not math.isfinite(deadline_s) or deadline_s <= 0:
            raise ValueError(f"deadline_s must be a positive finite number, got {deadline_s!r}")
        if self.held:
            raise RuntimeError("the trap is holding a call; release it before arming again")
        self._deadline_s = deadline_s
        self._on_hold = on_hold
        self.at_seq = at_seq
        self._released.clear()
        self.armed = True

    def release(self) -> None:
        """Let the held call go, or cancel the arming if no call was caught yet."""
        self.armed = False
        self.at_seq = None
        self._released.set()

    def _hold(self) -> None:
        """Called by a wrapper that saw ``armed``; waits on the calling thread."""
        at = self.at_seq
        if at is not None and self.seen + 1 < at:
            return  # not yet: this call comes before the agreed one
        if not self._claim.acquire(blocking=False):
            return  # another thread's call is the one being held
        try:
            if not self.armed:
                return
            self.armed = False  # one call per arming
            self.at_seq = None
            cpu0 = time.thread_time()
            start = time.monotonic()
            end = start + self._deadline_s
            self.held = True
            try:
                if self._on_hold is not None:
                    try:
                        self._on_hold(end)
                    except Exception:
                        self.errors += 1
                    return
                while not self._released.is_set():
                    left = end - time.monotonic()
                    if left <= 0:
                        self.expired += 1
                        break
                    self._released.wait(min(left, TRAP_SLICE_S))
            finally:
                self.last_pause_s = time.monotonic() - start
                self.cpu_s += time.thread_time() - cpu0
                self.holds += 1
                self.held = False
        finally:
            self._claim.release()
