"""Fig. 14: S2 in a DP4 job with 0, 1, 2, 3 and 4 slow replicas.

Each job is a real emulated DP4 job (falconext/experiments/s2_effect.py); the first k
replicas' ranks compute 2x slower from iteration 45 (the paper's one-slow-replica case is
1.9x), and falconext detects, localizes and rebalances by itself (only S2 allowed). The
paper reports 1.9x -> 1.2x (79.7% removed) with one slow replica, less room as more are
slow, and none with all four. With no slow replica the job must stay untouched (no event,
no plan); with all four slow there is nothing to rebalance and nothing may be localized
by the 1.1x-of-median rule.
Quick: 1 and 2 slow replicas.
"""

from __future__ import annotations

from falconext.experiments.bars import before_after_bars
from falconext.experiments.result import Comparison, ExperimentResult, Row, pct, times
from falconext.experiments.s2_effect import meets, s2_job, s2_row
from falconext.experiments.training import jobs_folder, run_job

FACTOR = 2.0
PAPER_ONE = 0.797
FULL = (0, 1, 2, 3, 4)
QUICK = (1, 2)


def slow_ranks(k: int) -> list[int]:
    """The ranks made slow when ``k`` of the 4 replicas are: 1, then 2, 3, and 0 last."""
    return [1, 2, 3, 0][:k]


def measure(quick: bool) -> ExperimentResult:
    """Run one DP4 job per number of slow replicas and compare with the paper's."""
    base = jobs_folder("fig14")
    rows: list[Row] = []
    for k in QUICK if quick else FULL:
        result = run_job(s2_job(f"slow{k}", 4, slow_ranks(k), FACTOR), base)
        events = result.summary.get("detection", {}).get("events")
        rows.append({"slow_replicas": k, "factor": FACTOR, **s2_row(result), "fail_slow_events": events})
    return ExperimentResult(rows, comparisons(rows), notes(base))


def comparisons(rows: list[Row]) -> list[Comparison]:
    """One line per number of slow replicas; the paper gives figures for one."""
    out = []
    for r in rows:
        k = r["slow_replicas"]
        if k == 0:
            quiet = not r["plan"] and not r["fail_slow_events"]
            out.append(Comparison("0 slow: untouched", "no change", "no event, no plan" if quiet
                                  else f"{r['fail_slow_events']} events, plan {r['plan'] or '-'}"))
            continue
        paper = "1.9x -> 1.2x (79.7%)" if k == 1 else ("no room" if k == 4 else "less room than 1")
        measured = f"{times(r['slowdown_before'])} -> {times(r['slowdown_after'])} ({pct(r['removed'])})"
        note = f"optimum {pct(r['removed_max'])}"
        if k == 1:
            ok = meets(r["removed"], PAPER_ONE, r["removed_max"])
            note += "; reaches the paper or the optimum" if ok else "; short of the paper and the optimum"
        out.append(Comparison(f"{k} slow replica{'s' if k > 1 else ''}", paper, measured, note))
    return out


def notes(base) -> list[str]:
    """What differs from the paper's set-up."""
    return [
        "Emulated device on a 2-core CPU host (real megatron-core training over gloo); the paper "
        "used 4 GPUs.",
        "Slow replicas compute 2x slower from iteration 45; 8 micro-batches of 1 per replica.",
        "'optimum' is the share the best integer plan on the true device times would remove.",
        f"The jobs' folders: {base}",
    ]



def draw(result: ExperimentResult, path: str) -> None:
    """Bars as in the paper: slowdown with and without S2 against the number of slow
    replicas, with the best plan's slowdown marked."""
    rows = result.rows
    before = [r["slowdown_before"] or 1.0 for r in rows]
    marks = [b - r["removed_max"] * (b - 1) if r["removed_max"] is not None else None for b, r in zip(before, rows)]
    before_after_bars(path, [str(r["slow_replicas"]) for r in rows], before,
                      [r["slowdown_after"] or b for b, r in zip(before, rows)], marks, "after S2",
                      "S2 with several slow replicas (black: best plan)", "slow DP replicas (of 4)")
