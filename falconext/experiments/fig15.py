"""Fig. 15: S3 link reassignment under weak, medium and severe congestion.

Each job is a real emulated job (falconext/experiments/s3_effect.py) with one rank per
virtual node, so every DP group and every pipeline crosses a node link, and one link,
between nodes 0 and 1, carrying stage 0's DP gradient all-reduce, congested 3x, 6x or
12x from iteration 45. falconext must localize the link and move the roles so that it
carries only pipeline messages, live. The paper ran PP 4 and PP 8 on 2 nodes of 8 GPUs
(slowdown removed 53.7% and 24.8% on average, up to 61.5%); the 2-core host runs at most
8 ranks in time, so ours are PP 2 (4 ranks) and PP 4 (8 ranks), DP 2, on 4 and 8 nodes.
Quick: PP 2, medium only.
"""

from __future__ import annotations

from statistics import mean

from falconext.experiments.result import Comparison, ExperimentResult, Row, pct
from falconext.experiments.s3_effect import draw_s3, s3_job, s3_row
from falconext.experiments.training import jobs_folder, run_job

#: congestion factors on the DP link (a 47 ms ring at healthy speed on a 0.21 s iteration)
FACTORS: dict[str, float] = {"weak": 3.0, "medium": 6.0, "severe": 12.0}
#: pp -> (ranks, device GFLOP/s): 8 ranks need a slower device to keep up on 2 cores
LAYOUTS: dict[int, tuple[int, float]] = {2: (4, 4.0), 4: (8, 2.0)}
PAPER_MEAN: dict[int, float] = {4: 0.537, 8: 0.248}
PAPER_MAX = 0.615
FULL = tuple((pp, sev) for pp in LAYOUTS for sev in FACTORS)
QUICK = ((2, "medium"),)


def measure(quick: bool) -> ExperimentResult:
    """Run one job per (pipeline depth, severity) and compare the shares removed."""
    base = jobs_folder("fig15")
    rows: list[Row] = []
    for pp, sev in QUICK if quick else FULL:
        nproc, gflops = LAYOUTS[pp]
        job = s3_job(f"pp{pp}-{sev}", nproc, pp, 1, [(0, 1)], FACTORS[sev], gflops, 16)
        rows.append({"pp": pp, "severity": sev, "factor": FACTORS[sev], **s3_row(run_job(job, base))})
    return ExperimentResult(rows, comparisons(rows), notes(base))


def comparisons(rows: list[Row]) -> list[Comparison]:
    """Per pipeline depth: the mean share removed over the severities run, beside the
    paper's figure for a pipeline twice as deep on 2 nodes; then the largest share."""
    out = []
    for pp in sorted({r["pp"] for r in rows}):
        mine = [r for r in rows if r["pp"] == pp]
        got = [r["removed"] for r in mine if r["removed"] is not None]
        expected = [r["planner_expected"] for r in mine if r["planner_expected"] is not None]
        paper_pp = 2 * pp
        out.append(Comparison(
            f"PP{pp}: slowdown removed (mean)", f"{pct(PAPER_MEAN[paper_pp])} (PP{paper_pp})" if paper_pp in PAPER_MEAN
            else "-", pct(mean(got)) if got else "no mitigation measured",
            f"planner expected {pct(mean(expected)) if expected else '-'}; "
            + ", ".join(f"{r['severity']} {pct(r['removed'])}" for r in mine)))
    got = [r for r in rows if r["removed"] is not None]
    if got:
        top = max(got, key=lambda r: r["removed"])
        out.append(Comparison("largest share removed", pct(PAPER_MAX), pct(top["removed"]),
                              f"PP{top['pp']} {top['severity']}"))
    return out


def notes(base) -> list[str]:
    """What differs from the paper's set-up."""
    return [
        "Emulated device and links on a 2-core CPU host (real megatron-core training over gloo); "
        "the paper used 16 GPUs on 2 nodes with PP 4 and PP 8.",
        "One rank per virtual node (DP 2): PP 2 on 4 nodes and PP 4 on 8 nodes; links at 10 MB/s, "
        "the node 0-1 link congested 3x, 6x or 12x from iteration 45.",
        "'planner expected' is the share the planner's iteration-time model predicted its roles "
        "would remove, measured against the job's healthy time.",
        f"The jobs' folders: {base}",
    ]


def draw(result: ExperimentResult, path: str) -> None:
    """Bars per pipeline depth and severity, before and after S3."""
    draw_s3(result.rows, [f"PP{r['pp']}\n{r['severity'][0].upper()}" for r in result.rows], path,
            "S3 under link congestion")
