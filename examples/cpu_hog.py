"""Load generator: CPU-bound processes beside a training job, to check that the emulated
test bed keeps its figures on a loaded host.

    python3 examples/cpu_hog.py --procs 2 --seconds 600 &

Each process spins on pure-Python arithmetic (one core's worth of demand each) until
``--seconds`` have passed, then exits by itself; Ctrl-C or SIGTERM stops all of them.
At the end it prints one line with the CPU time its processes took and the wall time,
``cpu_hog: N processes took C CPU s in W s``, so that a test can tell that they ran.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import signal
import sys
import time


def spin(seconds: float) -> None:
    """Keep one core busy for ``seconds`` (wall clock), then return."""
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        for i in range(10_000):
            x = (x * 31 + i) % 1_000_003


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=2, help="CPU-bound processes (default 2)")
    p.add_argument("--seconds", type=float, default=600.0, help="how long they run (default 600)")
    args = p.parse_args(argv)
    if args.procs < 1 or not 0 < args.seconds <= 24 * 3600:
        print("cpu_hog: --procs must be >= 1 and --seconds in (0, 86400]", file=sys.stderr)
        return 2
    procs = [mp.Process(target=spin, args=(args.seconds,), daemon=True) for _ in range(args.procs)]
    began = time.monotonic()
    for proc in procs:
        proc.start()

    def report() -> None:
        """The processes' CPU time (all of them reaped) and the wall time, in one line."""
        used = resource.getrusage(resource.RUSAGE_CHILDREN)
        print(f"cpu_hog: {args.procs} processes took {used.ru_utime + used.ru_stime:.2f} CPU s "
              f"in {time.monotonic() - began:.2f} s", flush=True)

    def stop(*_: object) -> None:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.join()
        report()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for proc in procs:
        proc.join()
    report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
