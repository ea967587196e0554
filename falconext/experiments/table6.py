"""Table 6: time to find the S2 micro-batch plan, 16..8192 data-parallel replicas.

The paper solved its S2 program with a generic solver (35.93 s at 512 replicas). Here two
solvers of the same min-max problem are timed on the same draws: falconext's exact greedy
(``plan_microbatches``, the one the controller uses) and the mixed-integer program
(``plan_microbatches_cvxpy``, cvxpy + HiGHS, proven optimal), which is the closer analogue
of the paper's solver. Each replica starts with 8 micro-batches' worth of the global batch;
per-micro-batch times are 1 s with 2% noise and about 10% of replicas are 1.5-4x slow.
The MILP runs under a time budget; after the first size over it, larger ones are skipped.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from typing import Callable, Iterator

import cvxpy  # noqa: F401  -- imported at load, so the first timed solve does not pay for it
import numpy as np

from falconext.experiments.result import Comparison, ExperimentResult, Row
from falconext.mitigate.microbatch import plan_microbatches, plan_microbatches_cvxpy, slowest_time

PAPER_S: dict[int, float] = {16: 0.01, 32: 0.01, 64: 0.01, 128: 0.11, 256: 6.78, 512: 35.93}
FULL_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
QUICK_SIZES = (16, 32, 64, 128, 256, 512)
FULL_BUDGET_S = 60.0
QUICK_BUDGET_S = 2.0
PER_REPLICA = 8
SLOW_SHARE = 0.10
GREEDY_REPEATS = 3
SEED = 0
#: the MILP's feasibility tolerances are ~1e-7; slowest times within this agree
REL_TOL = 1e-6


def draw_times(rng: np.random.Generator, replicas: int) -> np.ndarray:
    """Seconds per micro-batch per replica: 1 s +- 2%, about 10% of replicas 1.5-4x slow."""
    t = np.clip(1.0 + 0.02 * rng.standard_normal(replicas), 0.5, None)
    slow = rng.random(replicas) < SLOW_SHARE
    t[slow] *= rng.uniform(1.5, 4.0, int(slow.sum()))
    return t


def best_of(fn: Callable[[], list[int]], repeats: int) -> tuple[float, list[int]]:
    """(the fastest of ``repeats`` runs of ``fn`` in seconds, the plan it returned last)."""
    best, out = float("inf"), []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """HiGHS prints a licence banner on the process's stdout (fd 1) at its first solve;
    keep it out of the command's output."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def solve_times(sizes: tuple[int, ...], budget_s: float, seed: int = SEED) -> list[Row]:
    """One row per size: both solvers' wall time and the slowest replica's time under
    each plan. ``milp_status`` is 'optimal', 'over budget' (stopped at ``budget_s``) or
    'skipped' (a smaller size was already over budget)."""
    warnings.filterwarnings("ignore", message="Solution may be inaccurate")
    rng = np.random.default_rng(seed)
    rows: list[Row] = []
    over = False
    for d in sizes:
        times = draw_times(rng, d)
        total = PER_REPLICA * d
        greedy_s, plan = best_of(lambda: plan_microbatches(times, total), GREEDY_REPEATS)
        row: Row = {"replicas": d, "microbatches": total, "paper_s": PAPER_S.get(d, ""),
                    "greedy_s": round(greedy_s, 6), "greedy_slowest_s": round(slowest_time(times, plan), 6),
                    "milp_s": "", "milp_status": "skipped", "milp_slowest_s": "", "agree": ""}
        if not over:
            t0 = time.perf_counter()
            try:
                with _quiet_stdout():
                    milp = plan_microbatches_cvxpy(times, total, time_limit_s=budget_s)
            except ValueError:
                row.update(milp_s=round(time.perf_counter() - t0, 3), milp_status="over budget")
                over = True
            else:
                elapsed = time.perf_counter() - t0
                a, b = slowest_time(times, plan), slowest_time(times, milp)
                row.update(milp_s=round(elapsed, 3), milp_status="optimal", milp_slowest_s=round(b, 6),
                           agree=abs(a - b) <= REL_TOL * max(a, b) and a <= b * (1 + REL_TOL))
                over = elapsed > budget_s
        rows.append(row)
    return rows


def measure(quick: bool) -> ExperimentResult:
    """Solve times for 16..512 replicas (quick, MILP budget 2 s) or 16..8192 (budget 60 s)."""
    budget = QUICK_BUDGET_S if quick else FULL_BUDGET_S
    rows = solve_times(QUICK_SIZES if quick else FULL_SIZES, budget)
    comparisons = []
    for r in rows:
        if r["milp_status"] == "optimal":
            milp = f"MILP {r['milp_s']:.2f} s"
        elif r["milp_status"] == "over budget":
            milp = f"MILP > {budget:g} s budget"
        else:
            milp = "MILP skipped"
        paper = f"{r['paper_s']} s" if r["paper_s"] != "" else "-"
        note = "" if r["agree"] in ("", True) else "greedy and MILP disagree on the slowest replica"
        comparisons.append(Comparison(f"{r['replicas']} replicas", paper,
                                      f"greedy {r['greedy_s'] * 1e3:.2f} ms; {milp}", note))
    disagree = sum(r["agree"] is False for r in rows)
    notes = [
        f"{PER_REPLICA} micro-batches per replica; {SLOW_SHARE:.0%} of replicas 1.5-4x slow; seed {SEED}.",
        f"greedy: `plan_microbatches`, exact, best of {GREEDY_REPEATS}; MILP: `plan_microbatches_cvxpy` "
        f"(cvxpy + HiGHS, zero MIP gap) once, budget {budget:g} s (HiGHS checks it between phases, "
        "so a stopped solve may run past it).",
        "The paper's times come from its own solver on its cluster's CPUs; the MILP here is the "
        "comparable generic solver, the greedy is what falconext uses.",
        f"greedy and MILP agree on the slowest replica wherever both solved"
        if not disagree else f"{disagree} size(s) where greedy and MILP disagree: a bug",
    ]
    return ExperimentResult(rows, comparisons, notes, {"budget_s": budget})


def draw(result: ExperimentResult, path: str) -> None:
    """Solve time against replicas, log-log: the paper, the MILP and the greedy."""
    import matplotlib.pyplot as plt  # lazy: run-time order (after the runner's matplotlib.use("Agg"))

    rows = result.rows
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot(list(PAPER_S), list(PAPER_S.values()), "ks--", label="paper (its solver)")
    milp = [(r["replicas"], r["milp_s"]) for r in rows if r["milp_status"] == "optimal"]
    if milp:
        ax.plot(*zip(*milp), "o-", color="tab:orange", label="MILP (cvxpy + HiGHS)")
    over = [(r["replicas"], r["milp_s"]) for r in rows if r["milp_status"] == "over budget"]
    if over:
        ax.plot(*zip(*over), "x", color="tab:orange", ms=10, label="MILP stopped at budget")
    ax.plot([r["replicas"] for r in rows], [r["greedy_s"] for r in rows], "o-", color="tab:blue",
            label="greedy (falconext)")
    ax.set_xscale("log", base=2)
    ax.set_xticks([r["replicas"] for r in rows] + [d for d in PAPER_S if d not in {r["replicas"] for r in rows}])
    ax.get_xaxis().set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
    ax.set_yscale("log")
    ax.set_xlabel("DP replicas")
    ax.set_ylabel("time to plan (s)")
    ax.set_title("Table 6: S2 solve time")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
