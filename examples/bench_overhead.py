"""What falconext costs a training job: iteration time with it on and off, in one run.

One ``falconext train`` job runs with ``--bench-falcon-toggle N``: falconext is off for N
iterations, on for N, and so on (``FalconRuntime.set_enabled`` at iteration boundaries:
tracer removed, monitor paused, heartbeats stopped). Alternating inside one run means
both states share the same processes, warm caches and host load, so drift and a busy
neighbour hit both alike. Fault-free; the detector sees the calls of the "on" phases
only, and may be confused by the gaps (it must not crash or hang).

Printed:

* median and mean iteration time (median over ranks of each iteration) with falconext
  on and off, after ``--warmup`` iterations, leaving out the first ``--skip`` of each
  phase (installing the tracer scans loaded modules; that is the toggle's cost, not
  falconext's), and their ratio;
* falconext's own CPU per iteration from summary.json (``overhead``: thread CPU clocks of
  the monitor and control client, the sampled hook estimate on the training thread) and
  its share of the iteration time (the paper reports 0.39% mean, 1.1% max).

On a shared 2-core host the on/off difference is within noise: the CPU figure is the
one to read, the ratio bounds it.

    python examples/bench_overhead.py --iters 120 --toggle 10
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile

from falconext.report.summary import toggle_split


def job_command(args: argparse.Namespace, out: str) -> list[str]:
    """The ``falconext train`` command line of the benchmark job."""
    cmd = [sys.executable, "-c", "import sys; from falconext.cli import main; sys.exit(main())", "train",
           "--nproc", str(args.nproc), "--iters", str(args.iters),
           "--global-batch-size", str(args.global_batch_size), "--micro-batch-size", str(args.micro_batch_size),
           "--bench-falcon-toggle", str(args.toggle), "--out", out]
    if args.device:
        cmd += ["--device", args.device]
    return cmd + args.extra


def iteration_times(out: str) -> dict[int, float]:
    """Median over ranks of each loop iteration's measured seconds (iterations.csv)."""
    by_iter: dict[int, list[float]] = {}
    with open(os.path.join(out, "iterations.csv"), newline="") as f:
        for row in csv.DictReader(f):
            by_iter.setdefault(int(row["iteration"]), []).append(float(row["iter_time_s"]))
    return {it: statistics.median(v) for it, v in by_iter.items()}


def toggles_of(out: str) -> list:
    """The on/off toggles one rank recorded (every rank toggles at the same iterations)."""
    with open(os.path.join(out, "ranks", "overhead-0.json")) as f:
        return json.load(f)["toggles"]


def describe(name: str, times: list[float]) -> str:
    if not times:
        return f"  falcon {name:<3}: no iterations"
    return (f"  falcon {name:<3}: median {statistics.median(times):.6f} s, mean {statistics.mean(times):.6f} s "
            f"over {len(times)} iterations")


def report(out: str, warmup: int, skip: int) -> None:
    """Print the on/off split and falconext's CPU figures of a finished job in ``out``."""
    on, off = toggle_split(iteration_times(out), toggles_of(out), skip=skip, first=warmup)
    print(f"iteration time (after {warmup} warm-up iterations, first {skip} of each phase left out):")
    print(describe("on", on))
    print(describe("off", off))
    if on and off:
        med = statistics.median(on) / statistics.median(off)
        mean = statistics.mean(on) / statistics.mean(off)
        print(f"  on/off: median {med:.4f} ({100 * (med - 1):+.2f}%), mean {mean:.4f} ({100 * (mean - 1):+.2f}%)")
    with open(os.path.join(out, "summary.json")) as f:
        o = json.load(f).get("overhead")
    if not o:
        print("no overhead figures in summary.json")
        return
    per = o["per_iteration_s"]
    print("falconext CPU per iteration with it on (ms, mean / max over ranks):")
    for k in ("hooks", "monitor", "client", "suspension", "total"):
        print(f"  {k:<10} {1e3 * per[k]['mean']:8.3f} {1e3 * per[k]['max']:8.3f}")
    for r, fig in sorted(o["ranks"].items(), key=lambda kv: int(kv[0])):
        calls = fig["hook_calls"] / max(fig["iterations"], 1)
        print(f"  rank {r}: {1e3 * fig['total']:.3f} ms/iter, {calls:.0f} intercepted calls/iter "
              f"({fig['hook_samples']} timed), {fig.get('off_total_s', 0.0):.3f} s CPU while off")
    share = o.get("cpu_share")
    if share:
        print(f"cpu_share: {100 * share['mean']:.3f}% mean, {100 * share['max']:.3f}% max of a {o['iter_s']} s "
              f"iteration (paper: 0.39% mean, 1.1% max)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--iters", type=int, default=120)
    ap.add_argument("--global-batch-size", type=int, default=16)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--toggle", type=int, default=10, help="iterations per on or off phase")
    ap.add_argument("--device", default=None, help="the job's --device (default: falconext train's default)")
    ap.add_argument("--warmup", type=int, default=20, help="first iterations left out of the on/off figures")
    ap.add_argument("--skip", type=int, default=1, help="iterations left out at the start of each phase")
    ap.add_argument("--out", default=None, help="job directory (default: a temporary one, removed after)")
    ap.add_argument("--report-only", action="store_true", help="only print the figures of a finished --out")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more falconext train options")
    args = ap.parse_args()
    args.extra = [a for a in args.extra if a != "--"]
    if args.report_only:
        if not args.out:
            ap.error("--report-only needs --out")
        report(args.out, args.warmup, args.skip)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        out = args.out or tmp
        cmd = job_command(args, out)
        print("running:", " ".join(cmd[3:]), flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stdout[-4000:], done.stderr[-4000:], sep="\n")
            print(f"the job failed (exit {done.returncode})")
            return 1
        for line in done.stdout.splitlines():  # the job's own summary lines worth seeing here
            if line.startswith(("iterations ", "fail-slow events", "falconext CPU", "WARNING")):
                print(" ", line)
        report(out, args.warmup, args.skip)
    return 0


if __name__ == "__main__":
    sys.exit(main())
