"""Fig. 17: a compound fail-slow, a congested link and then a slow GPU, with escalation.

One real emulated job, TP1 x DP2 x PP2 on four one-rank nodes (links at 10 MB/s, a
4 GFLOP/s device), with S2, S3 and S4 allowed. From iteration 45 the node 0-1 link,
which carries stage 0's DP all-reduce, is congested 4x; from iteration 110 process 3's GPU
computes 4x slower. falconext must find each, and its ski-rental planner must choose
what to do: the paper's timeline is S3 for the link, then S2 for the GPU, then, since S2
cannot absorb a 4x GPU in DP 2, checkpoint-restart (S4) without the node. On the test bed
a restart replaces the excluded virtual node by a healthy one (its faults go away).
The experiment has no reduced version: quick and full run the same job.
"""

from __future__ import annotations

import csv
from statistics import median
from typing import Any

from falconext.experiments.result import Comparison, ExperimentResult, Row
from falconext.experiments.training import Job, JobResult, jobs_folder, run_job

LINK_START = 45
GPU_START = 110
ITERS = 230
FAULTS: tuple[dict[str, Any], ...] = (
    {"kind": "link", "nodes": [0, 1], "factor": 4.0, "start": LINK_START},
    {"kind": "compute", "rank": 3, "factor": 4.0, "start": GPU_START},
)
PAPER_ORDER = ("S3", "S2", "S4")


def job() -> Job:
    """The compound job: two faults, every strategy allowed."""
    args = ("--pp", "2", "--ranks-per-node", "1", "--global-batch-size", "16", "--micro-batch-size", "1",
            "--iters", str(ITERS), "--link-bandwidth", "10e6", "--device-gflops", "4",
            "--falcon-mitigation-strategies", "S2,S3,S4")
    return Job("compound", args, nproc=4, faults=FAULTS, timeout_s=1200.0)


def iteration_times(result: JobResult) -> dict[int, float]:
    """Iteration -> the slowest rank's time for it (what the job waited), from iterations.csv."""
    out: dict[int, float] = {}
    with open(result.out / "iterations.csv", newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            it, secs = int(row["iteration"]), float(row["iter_time_s"])
            out[it] = max(out.get(it, 0.0), secs)
    return out


def timeline(result: JobResult) -> list[Row]:
    """The job's story as rows, in iteration order: fault onsets, detections, localizations
    and mitigations (with their cost), then the median iteration time of each phase
    between them."""
    marks: list[Row] = [{"iteration": f["start"], "what": f"onset: {f['kind']} x{f['factor']}"} for f in FAULTS]
    for f in (result.summary.get("detection") or {}).get("faults") or []:
        if f.get("detected") and f.get("first_detection_delay") is not None:
            fault = f["fault"]
            marks.append({"iteration": fault["start"] + f["first_detection_delay"],
                          "what": f"detected: {fault['kind']}"})
    for e in result.events_of("mitigation"):
        if e.get("strategy") in ("S2", "S3", "S4"):
            marks.append({"iteration": e.get("iteration"), "what": f"mitigation {e['strategy']}",
                          "cost_s": e.get("overhead_s"), "plan": " ".join(map(str, e.get("plan") or e.get("roles") or
                                                                               e.get("exclude_nodes") or []))})
    marks.sort(key=lambda r: (r["iteration"] is None, r["iteration"] or 0))
    times = iteration_times(result)
    bounds = sorted({0, ITERS, *[int(r["iteration"]) for r in marks if r["iteration"] is not None
                                  and str(r["what"]).startswith(("onset", "mitigation"))]})
    phases = []
    for a, b in zip(bounds, bounds[1:]):
        vals = [t for it, t in times.items() if a + 2 <= it < b]  # skip the switch itself
        if vals:
            phases.append({"iteration": a, "what": f"phase {a}-{b - 1}", "median_iter_s": round(median(vals), 4)})
    return marks + phases


def measure(quick: bool) -> ExperimentResult:
    """Run the compound job once (quick or not) and tell its story."""
    base = jobs_folder("fig17")
    result = run_job(job(), base)
    rows = timeline(result)
    return ExperimentResult(rows, comparisons(result, rows), notes(base),
                            data={"times": iteration_times(result)})


def strategies(result: JobResult) -> list[str]:
    """The strategies applied, in order."""
    return [e["strategy"] for e in result.events_of("mitigation") if e.get("strategy") in ("S2", "S3", "S4")]


def comparisons(result: JobResult, rows: list[Row]) -> list[Comparison]:
    """The order of the strategies beside the paper's, and where the job ended."""
    s = result.summary
    order = strategies(result)
    phases = [r for r in rows if "median_iter_s" in r]
    healthy = phases[0]["median_iter_s"] if phases else None
    last = phases[-1]["median_iter_s"] if phases else None
    worst = max((r["median_iter_s"] for r in phases), default=None)
    out = [
        Comparison("strategies, in order", ", then ".join(PAPER_ORDER), ", then ".join(order) or "none",
                   "same order" if tuple(order) == PAPER_ORDER else "differs"),
        Comparison("time from the event to localization (median)", "-",
                   f"{median([x['after_event_s'] for x in result.events_of('localized') if x.get('after_event_s')]):.1f} s"
                   if result.events_of("localized") else "-"),
    ]
    if healthy and last and worst:
        out.append(Comparison("iteration time at the end / healthy", "back near healthy after the restart",
                              f"{last / healthy:.2f}x (worst phase {worst / healthy:.2f}x)"))
    out.append(Comparison("restarts", "1", str(len((s.get("mitigation") or {}).get("restarts") or []))))
    return out


def notes(base) -> list[str]:
    """What differs from the paper's set-up."""
    return [
        "Emulated device and links on a 2-core CPU host, 4 real megatron-core ranks over gloo; "
        "the paper's job is larger and its faults last minutes.",
        "Faults: node 0-1 link 4x from iteration 45; process 3's GPU 4x from iteration 110. "
        "A restart replaces the excluded node by a healthy one (the test bed's spare node).",
        "Phase medians skip the first two iterations after each boundary (a switch's pause).",
        f"The job's folder: {base}",
    ]


def draw(result: ExperimentResult, path: str) -> None:
    """Iteration time over iterations, as the paper's timeline, with onsets (red) and
    mitigations (green) marked."""
    import matplotlib.pyplot as plt  # lazy: run-time order (after the runner's matplotlib.use("Agg"))

    times = result.data["times"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    its = sorted(times)
    ax.plot(its, [times[i] for i in its], lw=0.9, color="#1f77b4")
    for r in result.rows:
        what = str(r["what"])
        if r["iteration"] is None or not what.startswith(("onset", "mitigation")):
            continue
        color = "#d62728" if what.startswith("onset") else "#2ca02c"
        ax.axvline(r["iteration"], color=color, lw=0.8, ls="--")
        ax.text(r["iteration"], ax.get_ylim()[1] * 0.95, what.split(":")[0].replace("mitigation ", ""),
                rotation=90, fontsize=7, va="top", color=color)
    ax.set_xlabel("iteration")
    ax.set_ylabel("iteration time (s)")
    ax.set_title("Compound fail-slow: link 4x at 45, GPU 4x at 110")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
