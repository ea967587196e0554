"""What S3 (topology adjustment) removes in real emulated jobs: shared by fig15 and fig16.

A job is TP1 x DP x PP on the emulated device and emulated links, with only S3 allowed.
Inter-node links are congested (a link fault multiplies a node pair's transfer time) from
iteration ``FAULT_START``; falconext must detect, localize the links and give processes
new roles, live. The job's summary gives the healthy, slow and mitigated iteration times
and the share of the slowdown removed; the mitigation event gives what the planner's
iteration-time model predicted before and after, and the switch its pause.
"""

from __future__ import annotations

from typing import Any, Sequence

from falconext.experiments.bars import before_after_bars
from falconext.experiments.result import Row
from falconext.experiments.training import Job, JobResult, first_localized, phases_row

FAULT_START = 45
#: S3 applies about 20 iterations after the onset; 30 more measure the mitigated speed
ITERS = 105
#: a link slow enough that gradients weigh (10 MB/s between nodes)
LINK_BANDWIDTH = "10e6"


def s3_job(name: str, nproc: int, pp: int, ranks_per_node: int, links: Sequence[tuple[int, int]],
           factor: float, gflops: float, global_batch: int) -> Job:
    """A TP1 x DP x PP job on ``nproc`` ranks whose node ``links`` are ``factor``x slow
    from FAULT_START, with only S3 allowed."""
    faults = tuple({"kind": "link", "nodes": [a, b], "factor": factor, "start": FAULT_START} for a, b in links)
    args = ("--pp", str(pp), "--ranks-per-node", str(ranks_per_node), "--iters", str(ITERS),
            "--global-batch-size", str(global_batch), "--micro-batch-size", "1",
            "--device-gflops", str(gflops), "--link-bandwidth", LINK_BANDWIDTH,
            "--falcon-mitigation-strategies", "S3")
    return Job(name, args, nproc=nproc, faults=faults)


def _mitigation_event(result: JobResult) -> dict[str, Any] | None:
    found = [e for e in result.events_of("mitigation") if e.get("strategy") == "S3"]
    return found[0] if found else None


def s3_row(result: JobResult) -> Row:
    """One CSV row from a finished S3 job: the phases (training.py ``phases_row``), what
    the planner predicted (and so the share it expected to remove), the switch's pause,
    and what the loop did (localized links, roles, iteration applied)."""
    s = result.summary
    healthy = s.get("healthy_iter_s")
    event = _mitigation_event(result) or {}
    predicted = event.get("predicted_s") or [None, None]
    expected = None
    if predicted[0] and predicted[1] is not None and healthy and predicted[0] > healthy:
        expected = round((predicted[0] - predicted[1]) / (predicted[0] - healthy), 4)
    switches = [w for w in (s.get("mitigation") or {}).get("switches") or [] if not w.get("probe")]
    return {
        **phases_row(result),
        "predicted_before_s": predicted[0],
        "predicted_after_s": predicted[1],
        "planner_expected": expected,
        "localized_links": " ".join(f"{a}-{b}" for a, b in first_localized(result).get("links") or []),
        "roles": " ".join(map(str, event.get("roles") or [])),
        "applied_at": event.get("iteration"),
        "switch_pause_s": switches[-1].get("pause_s") if switches else None,
    }


def draw_s3(rows: list[Row], labels: list[str], path: str, title: str, xlabel: str = "") -> None:
    """The paper's S3 bars (falconext/experiments/bars.py), with the planner's predicted
    time after S3 marked."""
    marks = [r["predicted_after_s"] / r["healthy_s"] if r["predicted_after_s"] and r["healthy_s"] else None
             for r in rows]
    before_after_bars(path, labels, [r["slowdown_before"] or 0 for r in rows],
                      [r["slowdown_after"] or 0 for r in rows], marks, "after S3",
                      title + " (black: planner's prediction)", xlabel)
