"""Tables 4 and 5: the detection methods scored on labelled iteration-time traces.

The traces come from ``falconext.sim.traces`` (the set ``falconext gen-traces`` writes:
compute, comm and healthy traces drawn in turn, 2000 iterations each), the scoring from
``falconext.detect.evaluate`` (the rules of ``falconext eval-detect``). A table for one
fail-slow kind scores that kind's traces together with the healthy ones: accuracy over
all of them, FPR over the healthy ones, FNR over the labelled fail-slows.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from functools import lru_cache
from typing import Sequence

from falconext.config import FalconConfig
from falconext.detect import detect
from falconext.detect.evaluate import Summary, TraceScore, score_trace, summarize
from falconext.experiments.result import Comparison, ExperimentResult, Row
from falconext.sim.traces import generate_traces

#: scored methods; persistence is the baseline added here (not in the paper)
METHODS = ("slide-window", "bocd", "bocd+v", "persistence")
#: held out from tuning BOCD+V (tuned on 7..23)
FULL_SEEDS = (2026, 4242)
FULL_COUNT = 600
QUICK_SEEDS = (2026,)
QUICK_COUNT = 90
#: iterations a detected onset may precede its label
TOLERANCE = 10

#: the paper's Tables 4 and 5: method -> (accuracy, FPR, FNR), each "percent (n/m)"
PAPER: dict[str, dict[str, tuple[str, str, str]]] = {
    "compute": {
        "slide-window": ("99.5 (390/392)", "0.0 (0/386)", "25.0 (2/8)"),
        "bocd": ("77.8 (305/392)", "18.39 (87/473)", "0.0 (0/6)"),
        "bocd+v": ("100.0 (392/392)", "0.0 (0/386)", "0.0 (0/6)"),
    },
    "comm": {
        "slide-window": ("93.5 (100/107)", "1.5 (1/65)", "12.2 (6/49)"),
        "bocd": ("69.2 (74/107)", "34.0 (33/97)", "0.00 (0/43)"),
        "bocd+v": ("99.1 (106/107)", "0.00 (0/64)", "2.3 (1/44)"),
    },
}


def _score_one(job: tuple[list[float], str, list, int]) -> TraceScore:
    times, method, labels, tolerance = job
    return score_trace(detect(times, method, FalconConfig()), labels, tolerance)


@lru_cache(maxsize=None)
def kind_scores(seed: int, count: int, kind: str) -> dict[str, tuple[TraceScore, ...]]:
    """Every method's score on each ``kind`` trace of the set (``count`` traces, ``seed``).

    Deterministic; cached, so Tables 4 and 5 in one process score the healthy traces once.
    Scoring runs on every core (the detectors are pure functions of the series).
    """
    traces = [t for t in generate_traces(count, "mixed", seed) if t.kind == kind]
    jobs = [(t.iter_times, m, [tuple(e) for e in t.events], TOLERANCE) for m in METHODS for t in traces]
    with ProcessPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        scores = list(pool.map(_score_one, jobs, chunksize=4))
    n = len(traces)
    return {m: tuple(scores[k * n:(k + 1) * n]) for k, m in enumerate(METHODS)}


def _row(seed: int | str, method: str, group: str, s: Summary) -> Row:
    return {
        "seed": seed, "method": method, "set": group,
        "accuracy_pct": round(100 * s.accuracy, 2), "correct": s.correct, "traces": s.traces,
        "fpr_pct": round(100 * s.fpr, 2), "healthy_alarmed": s.healthy_alarmed, "healthy": s.healthy,
        "fnr_pct": round(100 * s.fnr, 2), "missed": s.missed, "labels": s.labels,
        "false_alarms": s.false_alarms, "median_delay_iters": s.median_delay,
    }


def accuracy_rows(kind: str, seeds: Sequence[int], count: int) -> tuple[list[Row], dict[str, Summary]]:
    """Rows per seed, method and set (``kind``, healthy, all), plus the summaries pooled
    over the seeds per method (the 'all' set: ``kind`` and healthy traces together)."""
    rows: list[Row] = []
    pooled: dict[str, list[TraceScore]] = {m: [] for m in METHODS}
    for seed in seeds:
        faulty, healthy = kind_scores(seed, count, kind), kind_scores(seed, count, "healthy")
        for m in METHODS:
            for group, scores in ((kind, faulty[m]), ("healthy", healthy[m]), ("all", faulty[m] + healthy[m])):
                rows.append(_row(seed, m, group, summarize(scores)))
            pooled[m] += faulty[m] + healthy[m]
    summaries = {m: summarize(pooled[m]) for m in METHODS}
    rows += [_row("pooled", m, "all", s) for m, s in summaries.items()]
    return rows, summaries


def measure_kind(kind: str, quick: bool) -> ExperimentResult:
    """Table 4 (``kind`` 'compute') or Table 5 ('comm'): paper vs measured per method."""
    seeds, count = (QUICK_SEEDS, QUICK_COUNT) if quick else (FULL_SEEDS, FULL_COUNT)
    rows, summaries = accuracy_rows(kind, seeds, count)
    comparisons = []
    for m in METHODS:
        s = summaries[m]
        paper = PAPER[kind].get(m, ("-", "-", "-"))
        note = "baseline added here, not in the paper" if m not in PAPER[kind] else ""
        measured = (f"{100 * s.accuracy:.1f} ({s.correct}/{s.traces})",
                    f"{100 * s.fpr:.1f} ({s.healthy_alarmed}/{s.healthy})",
                    f"{100 * s.fnr:.1f} ({s.missed}/{s.labels})")
        for what, p, got in zip(("accuracy %", "FPR %", "FNR %"), paper, measured):
            comparisons.append(Comparison(f"{m} {what}", p, got, note))
        if s.median_delay is not None:
            comparisons.append(Comparison(f"{m} median delay (iterations)", "-", f"{s.median_delay:.0f}", note))
    per_kind = count // 3
    notes = [
        f"Traces: `falconext gen-traces --count {count} --seed S` for S in {', '.join(map(str, seeds))} "
        f"(about {per_kind} {kind} and {per_kind} healthy traces per seed, 2000 iterations each, "
        "synthetic, modelled on the paper's characterization study, with healthy spikes and "
        "bursts of up to 1.8x); the paper used its own labelled traces, on which its baselines "
        "scored far better than here (slide-window 93.5-99.5%), so they were quieter.",
        "Accuracy: traces judged entirely right (every label found, no false alarm) over the "
        f"{kind} and healthy traces; FPR: healthy traces with an alarm; FNR: labelled fail-slows "
        f"missed; a detection matches a label when its onset is at most {TOLERANCE} iterations "
        "before the label's onset and before its end (falconext/detect/evaluate.py).",
        "Seeds 2026 and 4242 were not used to tune BOCD+V (tuned on 7..23). Per-seed rows in results.csv.",
    ]
    return ExperimentResult(rows, comparisons, notes, {"kind": kind, "summaries": summaries})


def _paper_pct(cell: str) -> float | None:
    return None if cell == "-" else float(cell.split()[0])


def draw_kind(result: ExperimentResult, path: str, title: str) -> None:
    """Three panels (accuracy, FPR, FNR): a bar per method, the paper's value as a marker."""
    import matplotlib.pyplot as plt  # lazy: run-time order (after the runner's matplotlib.use("Agg"))

    kind = result.data["kind"]
    summaries: dict[str, Summary] = result.data["summaries"]
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.4))
    metrics = (("accuracy %", lambda s: 100 * s.accuracy), ("FPR %", lambda s: 100 * s.fpr),
               ("FNR %", lambda s: 100 * s.fnr))
    x = range(len(METHODS))
    for k, (ax, (label, value)) in enumerate(zip(axes, metrics)):
        ax.bar(x, [value(summaries[m]) for m in METHODS], color="tab:blue", label="measured")
        paper = [(i, _paper_pct(PAPER[kind][m][k])) for i, m in enumerate(METHODS) if m in PAPER[kind]]
        ax.plot([i for i, _ in paper], [v for _, v in paper], "k_", ms=22, mew=3, label="paper")
        ax.set_xticks(list(x))
        ax.set_xticklabels(METHODS, rotation=20, fontsize=8)
        ax.set_ylim(0, 105)
        ax.set_title(label)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
