"""Ablations: each falconext component off in turn on the paper's Fig. 17 compound trace.

The trace follows the paper's Fig. 17: a 4DP x 4PP job on two nodes of 8 GPUs (1.7
iterations/s healthy); the inter-node link slows at t=30 s (to about 1.0 iterations/s),
then a GPU (process 12, on node 1, the node S4 leaves out for that link) slows 4x at
t=200 s, both to the end. The paper escalated S3, then S2, then checkpoint-restart S4.

Every row is the discrete-event simulation of ``falconext/experiments/des.py`` driving
the real controller and planner (and each rank's detector) on that trace, with one
thing changed: falconext off; verification off (the ranks run plain BOCD,
``detect/baselines.PlainBOCD``); profiling's 1.1x rule changed (``suspicious_factor``
1.5, and effectively off at 1000: no group is ever suspicious, validation then tests every
role's links); immediate escalation instead of ski-rental (the ranks report S3 and S4
as costing 1 ms, so the planner escalates as soon as a strategy is judged not enough;
the real costs are still charged); only S2, only S3, only S4
(``mitigation_strategies``); detection and localization without mitigation
(``mitigation`` false). Measured: the job completion time of the iterations a healthy
job does in 600 s, its slowdown over healthy, and the share of the unmitigated
slowdown each variant removes. Not in the paper (which has no ablation study).
"""

from __future__ import annotations

from typing import Any

from falconext.config import FalconConfig
from falconext.experiments.des import Job, MitigationCosts, Variant, run, story
from falconext.mitigate.planner import slowdown_removed
from falconext.experiments.result import Comparison, ExperimentResult, Row
from falconext.mitigate.topology import Layout
from falconext.model.faults import Fault
from falconext.model.itertime import JobCosts

DP, PP, RANKS_PER_NODE = 4, 4, 8
ACT_BYTES = 1024 * 5120 * 2
DURATION_S = 600.0
SEEDS_FULL = (17, 18, 19)
SEEDS_QUICK = (17,)


def job(seed: int) -> Job:
    """The two-node 4DP x 4PP job (0.59 s per iteration healthy): stages 0-1 on node 0,
    2-3 on node 1, so the one inter-node link carries the pipeline's stage 1 -> 2
    messages. S4: 13 GB per rank saved at 1 GB/s and read at 2 GB/s after a 60 s start-up."""
    layout = Layout(tp=1, dp=DP, pp=PP, ranks_per_node=RANKS_PER_NODE)
    costs = JobCosts.uniform(PP, DP, 0.015, 8, act_bytes=ACT_BYTES, p2p_s=ACT_BYTES / 25e9 + 5e-6,
                             grad_bytes=1.6e9, allreduce_s=0.05, other_s=0.04)
    mit = MitigationCosts(state_bytes=13_000_000_000, write_bps=1e9, read_bps=2e9, startup_s=60.0,
                          memory_bps=10e9, regroup_s=5.0)
    return Job(layout, costs, mit, seed)


def trace() -> list[Fault]:
    """Fig. 17's compound fail-slow (module docstring), from its start (simulated
    seconds) to the end: the link 126x slow (5e-9 s/byte over 25 GB/s, des.link_excess)."""
    return [Fault("link", 126.0, 30.0, None, nodes=(0, 1)), Fault("compute", 4.0, 200.0, None, rank=12)]


def variants() -> list[Variant]:
    """All on, falconext off, and each component off or changed in turn."""
    cfg = FalconConfig()
    return [
        Variant("all on", config=cfg),
        Variant("falconext off", falcon=False),
        Variant("verification off (plain BOCD)", config=cfg, detector="bocd"),
        Variant("1.1x rule -> 1.5x", config=cfg.replace(suspicious_factor=1.5)),
        Variant("1.1x rule off (1000x)", config=cfg.replace(suspicious_factor=1000.0)),
        Variant("immediate escalation", config=cfg, report_costs=False),
        Variant("S2 only", config=cfg.replace(mitigation_strategies="S2")),
        Variant("S3 only", config=cfg.replace(mitigation_strategies="S3")),
        Variant("S4 only", config=cfg.replace(mitigation_strategies="S4")),
        Variant("no mitigation (detect + localize)", config=cfg.replace(mitigation=False)),
    ]


def measure(quick: bool) -> ExperimentResult:
    """Quick: one seed of the jitter; full: three, averaged."""
    seeds = SEEDS_QUICK if quick else SEEDS_FULL
    per: dict[str, list[float]] = {}
    healthy: list[float] = []
    stories: dict[str, list[str]] = {}
    n = 0
    for seed in seeds:
        j = job(seed)
        base = run(j, [], Variant("healthy", falcon=False), 50)
        n = int(DURATION_S / (base.jct_s / 50))
        healthy.append(run(j, [], Variant("healthy", falcon=False), n).jct_s)
        for v in variants():
            r = run(j, trace(), v, n)
            per.setdefault(v.name, []).append(r.jct_s)
            if seed == seeds[0]:
                stories[v.name] = story(r.events) + [f"{what} pause {sec:.1f} s at t={t:.0f}"
                                                     for t, what, sec in r.pauses if what in ("S3", "S4")]
    h = sum(healthy) / len(healthy)
    slow = sum(per["falconext off"]) / len(seeds)
    rows: list[Row] = [{"variant": "healthy", "jct_s": round(h, 1), "slowdown": 1.0, "slowdown_reduced": ""}]
    for name, jcts in per.items():
        jct = sum(jcts) / len(jcts)
        red = slowdown_removed(h, slow, jct)
        rows.append({"variant": name, "jct_s": round(jct, 1), "slowdown": round(jct / h, 4),
                     "slowdown_reduced": "" if red is None else round(red, 4)})
    comparisons = [Comparison(r["variant"], "-", f"JCT {r['jct_s']} s, {r['slowdown']:.3f}x"
                              + (f", removes {r['slowdown_reduced']:.1%}" if r["slowdown_reduced"] != "" else ""))
                   for r in rows]
    notes = [
        "Discrete-event simulation (falconext/experiments/des.py) driving the real controller, planner and "
        "per-rank detectors; not the emulated test bed.",
        f"Job: TP1 x DP{DP} x PP{PP} on 2 nodes, {n} iterations (a healthy job's {DURATION_S:.0f} s); "
        f"seeds {list(seeds)}; S3 switch {job(0).mitigation.switch_s:.1f} s, S4 restart "
        f"{job(0).mitigation.restart_s:.0f} s charged.",
        "slowdown_reduced = (JCT falconext off - JCT variant) / (JCT falconext off - JCT healthy).",
    ] + [f"{name}: {line}" for name, lines in stories.items() for line in lines]
    data: dict[str, Any] = {"healthy_s": h}
    return ExperimentResult(rows, comparisons, notes, data)


def draw(result: ExperimentResult, path: str) -> None:
    """One bar per variant: its JCT over healthy."""
    import matplotlib.pyplot as plt  # lazy: run-time order (after the runner's matplotlib.use("Agg"))

    rows = result.rows
    fig, ax = plt.subplots(figsize=(8, 4.2))
    names = [r["variant"] for r in rows]
    vals = [r["slowdown"] for r in rows]
    colors = ["tab:gray" if n in ("healthy", "falconext off") else "tab:blue" for n in names]
    ax.barh(range(len(rows)), vals, color=colors)
    for i, v in enumerate(vals):
        ax.text(v + 0.01, i, f"{v:.2f}x", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("JCT / healthy JCT")
    ax.set_title("Ablations on the Fig. 17 trace (DES driving the real controller)")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
