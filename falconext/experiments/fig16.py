"""Fig. 16: straggler consolidation, 4DP x 4PP, with 1, 2 and 3 congested links.

Each job is a real emulated 16-rank job, TP1 x DP4 x PP4 on 8 virtual nodes of 2 ranks
(falconext/experiments/s3_effect.py): each pipeline stage's 4 ranks sit on 2 nodes, so
its DP all-reduce crosses one node link. From iteration 45 the links of stages 1, 2 and
3 in turn (nodes 2-3, 4-5, 6-7) are congested 16x; falconext must localize them and give
processes new roles, live. The paper: one slow link 1.6x -> 1.3x, two in two stages
1.7x -> 1.3x (consolidated into one stage), three 1.9x -> 1.7x.
Quick: one congested link.
"""

from __future__ import annotations

from falconext.experiments.result import Comparison, ExperimentResult, Row, pct, times
from falconext.experiments.s3_effect import draw_s3, s3_job, s3_row
from falconext.experiments.training import jobs_folder, run_job

FACTOR = 16.0
LINKS: tuple[tuple[int, int], ...] = ((2, 3), (4, 5), (6, 7))
#: 16 ranks on 2 cores: a slow device keeps the real CPU work inside its time
GFLOPS = 0.5
#: congested links -> (slowdown before, after) in the paper
PAPER: dict[int, tuple[float, float]] = {1: (1.6, 1.3), 2: (1.7, 1.3), 3: (1.9, 1.7)}
FULL = (1, 2, 3)
QUICK = (1,)


def measure(quick: bool) -> ExperimentResult:
    """Run one 16-rank job per number of congested links."""
    base = jobs_folder("fig16")
    rows: list[Row] = []
    for k in QUICK if quick else FULL:
        job = s3_job(f"links{k}", 16, 4, 2, LINKS[:k], FACTOR, GFLOPS, 16)
        rows.append({"slow_links": k, "factor": FACTOR, **s3_row(run_job(job, base))})
    return ExperimentResult(rows, comparisons(rows), notes(base))


def paper_removed(k: int) -> float:
    """The share of the slowdown the paper's consolidation removed with ``k`` slow links."""
    before, after = PAPER[k]
    return (before - after) / (before - 1.0)


def comparisons(rows: list[Row]) -> list[Comparison]:
    """One line per number of congested links: slowdown before -> after, and the share
    removed beside the paper's."""
    out = []
    for r in rows:
        k = r["slow_links"]
        before, after = PAPER[k]
        ok = r["removed"] is not None and r["removed"] >= paper_removed(k)
        out.append(Comparison(
            f"{k} congested link{'s' if k > 1 else ''}", f"{before}x -> {after}x ({pct(paper_removed(k))})",
            f"{times(r['slowdown_before'])} -> {times(r['slowdown_after'])} ({pct(r['removed'])})",
            f"planner expected {pct(r['planner_expected'])}; "
            + ("reaches the paper" if ok else "short of the paper")))
    return out


def notes(base) -> list[str]:
    """What differs from the paper's set-up."""
    return [
        "Emulated device (0.5 GFLOP/s) and links (10 MB/s) on a 2-core CPU host, 16 real "
        "megatron-core ranks over gloo; the paper used 16 GPUs on 2 nodes.",
        "A congested link here slows a node pair (2 ranks each side), i.e. one stage's DP ring; "
        "the paper's slow link affected a pair of GPUs.",
        f"The jobs' folders: {base}",
    ]


def draw(result: ExperimentResult, path: str) -> None:
    """Bars per number of congested links, before and after S3."""
    draw_s3(result.rows, [str(r["slow_links"]) for r in result.rows], path, "Consolidation, 4DP x 4PP",
            "congested links")
