"""How fast ``falconext ctl status`` answers: in the caller's process, and as its own process.

A controller runs on a private, password-protected Redis with four ranks' heartbeats posted
every 0.1 s (no training job: the command reads the controller's published snapshot, which
does not depend on what the ranks do). Each way is timed over ``--runs`` calls, and the
minimum, median and maximum are printed. The README's "well within a second" is the
in-process figure; the own-process one adds Python's start-up.
Run: python3 examples/bench_ctl.py [--runs 20]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from falconext.cli import main as cli_main
from falconext.config import FalconConfig
from falconext.control.bus import Bus
from falconext.control.client import CTL_STREAM
from falconext.protocol.messages import Heartbeat
from falconext.control.plane import ACCESS_FILE, write_private_json
from falconext.control.redis_server import start_redis
from falconext.control.service import run_controller

JOB = "benchctl"


def status_here(run: Path) -> float:
    """One ``ctl status`` in this process; its seconds (raises on a failed answer)."""
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = cli_main(["ctl", "--run", str(run), "status"])
    took = time.perf_counter() - t0
    if code != 0:
        raise RuntimeError(f"ctl status failed with exit code {code}")
    return took


def status_process(run: Path) -> float:
    """One ``falconext ctl status`` as its own process; its seconds."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "falconext.cli", "ctl", "--run", str(run), "status"],
                          capture_output=True, text=True, timeout=60)
    took = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"ctl status failed: {proc.stderr.strip()[:300]}")
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20, help="calls per way (default 20)")
    args = ap.parse_args()
    if args.runs < 1:
        print("bench_ctl: --runs must be >= 1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        redis = start_redis()
        stop = [False]
        write_private_json(str(run / ACCESS_FILE), {"job": JOB, "url": redis.url, "world": 4, "ended": None})
        cfg = FalconConfig(link_baseline_iteration=0)
        controller = threading.Thread(target=run_controller, daemon=True,
                                      args=(redis.url, JOB, 4, str(run / "events.jsonl"), cfg, stop))
        controller.start()
        bus = Bus(redis.url, JOB)

        def beats() -> None:
            it = 0
            while not stop[0]:
                it += 1
                for r in range(4):
                    bus.post(CTL_STREAM, Heartbeat(r, r // 2, it, 0.4, time.time(), replica=r, mb_s=0.05, micro=4,
                                                   role=r, stage=0, tp=1, pp=1))
                time.sleep(0.1)

        feeder = threading.Thread(target=beats, daemon=True)
        feeder.start()
        try:
            deadline = time.monotonic() + 20
            while True:  # the first snapshot
                try:
                    status_here(run)
                    break
                except RuntimeError:
                    if time.monotonic() > deadline:
                        print("bench_ctl: the controller published no status within 20 s", file=sys.stderr)
                        return 1
                    time.sleep(0.2)
            for name, call in (("in process", status_here), ("own process", status_process)):
                times = [call(run) for _ in range(args.runs)]
                print(f"ctl status, {name}: min {min(times):.3f} s, median {statistics.median(times):.3f} s, "
                      f"max {max(times):.3f} s ({args.runs} calls)")
        finally:
            stop[0] = True
            feeder.join(5)
            controller.join(5)
            bus.close()
            redis.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
