"""Stopping the process groups a launcher started."""

from __future__ import annotations

import os
import signal
import subprocess
import time

#: how long a stopped process group gets between SIGTERM and SIGKILL, seconds
STOP_GRACE_S = 10.0


def stop_groups(procs: list[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM each still-running process's group (each started in a session of its own),
    SIGKILL what is left after ``grace_s``; returns once all have been reaped (or after the
    kill's own 5 s)."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + grace_s
    for p in live:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
