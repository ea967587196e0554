"""S2 micro-batch planner: exact greedy vs a cvxpy MILP, solve time and slowest replica.

Times per micro-batch are 1.0 s with 2% noise, and about 10% of the replicas are slowed
1.5-4x (fail-slows); every replica starts with 8 micro-batches' worth of the global batch.
The greedy is timed as the best of a few runs; the MILP (HiGHS, zero MIP gap) once, with
its solver time limited to --budget-s (HiGHS checks the limit only between phases, so a
stopped solve can run past it). Once one MILP solve exceeds the budget, larger sizes are
skipped, since the MILP only gets slower with more replicas.
Exit code 1 if a size solved by both disagrees on the slowest replica's time.
Run: python examples/bench_microbatch.py [--sizes 16,32,...] [--budget-s 60]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import numpy as np

from falconext.experiments.table6 import best_of, draw_times  # the same draw and timing as the table6 experiment
from falconext.mitigate.microbatch import plan_microbatches, plan_microbatches_cvxpy, slowest_time

PER_REPLICA = 8
TARGET_S = 0.1  # planner budget on the reconfiguration path
PAPER_S = 35.93  # Falcon paper, solver time at 512 replicas
REL_TOL = 1e-6  # the MILP's feasibility tolerances are ~1e-7


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16,32,64,128,256,512,1024,2048,4096,8192",
                    help="comma-separated numbers of DP replicas")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cvxpy-max", type=int, default=8192,
                    help="largest size to also solve with cvxpy")
    ap.add_argument("--budget-s", type=float, default=60.0,
                    help="time limit per cvxpy solve; sizes above the first one to hit it are skipped")
    ap.add_argument("--repeats", type=int, default=5, help="greedy runs per size (best is shown)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]

    if any(d <= args.cvxpy_max for d in sizes):
        import cvxpy  # noqa: F401  -- pay the ~2 s import outside the timed solves

        # A solve stopped by the time limit is reported in the table; cvxpy's
        # "may be inaccurate" warning about it would only clutter the output.
        warnings.filterwarnings("ignore", message="Solution may be inaccurate")
    rng = np.random.default_rng(args.seed)
    print(f"{'replicas':>8} {'M':>7} {'fast (ms)':>10} {'cvxpy (s)':>10} "
          f"{'slowest fast':>13} {'slowest cvxpy':>14} {'agree':>6}")
    disagree = 0
    over_budget_at: int | None = None
    skipped: list[int] = []
    fast_at: dict[int, float] = {}
    cvx_at: dict[int, float] = {}
    for d in sizes:
        times = draw_times(rng, d)
        total = PER_REPLICA * d
        fast_s, fast_plan = best_of(lambda: plan_microbatches(times, total), args.repeats)
        fast_slowest = slowest_time(times, fast_plan)
        fast_at[d] = fast_s
        cvx_col, cvx_slowest_col, agree_col = "-", "-", "-"
        if d > args.cvxpy_max:
            cvx_col = "not run"
        elif over_budget_at is not None:
            cvx_col = "skipped"
            skipped.append(d)
        else:
            t0 = time.perf_counter()
            try:
                plan = plan_microbatches_cvxpy(times, total, time_limit_s=args.budget_s)
            except ValueError as exc:
                elapsed = time.perf_counter() - t0
                over_budget_at = d
                cvx_col = f">{elapsed:.0f}" if elapsed >= args.budget_s else "failed"
                print(f"  (cvxpy at {d} replicas: {exc})", file=sys.stderr)
            else:
                elapsed = time.perf_counter() - t0
                cvx_at[d] = elapsed
                cvx_slowest = slowest_time(times, plan)
                ok = (abs(cvx_slowest - fast_slowest) <= REL_TOL * max(cvx_slowest, fast_slowest)
                      and fast_slowest <= cvx_slowest)
                disagree += not ok
                cvx_col = f"{elapsed:.2f}"
                cvx_slowest_col = f"{cvx_slowest:.6f}"
                agree_col = "yes" if ok else "NO"
                if elapsed > args.budget_s:
                    over_budget_at = d
        print(f"{d:>8} {total:>7} {fast_s * 1e3:>10.2f} {cvx_col:>10} "
              f"{fast_slowest:>13.6f} {cvx_slowest_col:>14} {agree_col:>6}", flush=True)

    if over_budget_at is not None:
        print(f"cvxpy exceeded the {args.budget_s:g} s budget at {over_budget_at} replicas"
              + (f"; skipped at {', '.join(map(str, skipped))}" if skipped else ""))
    if 512 in fast_at:
        line = (f"512 replicas: greedy {fast_at[512] * 1e3:.2f} ms "
                f"(target {TARGET_S * 1e3:.0f} ms: {'met' if fast_at[512] < TARGET_S else 'MISSED'}; "
                f"paper {PAPER_S} s")
        if 512 in cvx_at:
            line += f"; cvxpy MILP here {cvx_at[512]:.2f} s"
        print(line + ")")
    if disagree:
        print(f"{disagree} size(s) where the greedy and cvxpy disagree", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
