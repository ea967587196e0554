"""S3 consolidating two compute stragglers into one pipeline stage, end to end (long).

TP1 x DP2 x PP2 on four virtual nodes (one rank each), on the emulated device, only S3
allowed: from iteration 45 processes 0 (stage 0) and 3 (stage 1) compute 3x slower.
Both must be localized, S3 must put them into one pipeline stage, and the job must then
run at the iteration times the planner predicted before and after (within 10%): on
devices that keep their speed the model is exact. The vocabulary is 4096
(``vocab_reference`` is its undisturbed run), so the last stage, with the output layer,
computes about 3.3x what stage 0 does: consolidation's gain is that both stragglers slow
the lighter stage (with equal stages, moving a straggler gains nothing).

On the CPU bed the host's two cores made a 3x straggler read 4.89x and the model's
times 61% high, hence the emulated device. Long (``python3 -m pytest -m long``): with its
reference, about 75 s of the main suite's job lane on a 2-core host (2026-11-28), where
tests/test_topology_e2e.py's S3 over congested links keeps S3 in the main suite.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs import PP2_JOB, PP2_REFERENCE_ITERS, S3_LINK_FAULT_START, JobCache, assert_same_trajectory, events, losses

pytestmark = pytest.mark.long

FAULT_START = S3_LINK_FAULT_START
ITERS = PP2_REFERENCE_ITERS
#: a heavier last stage (see above), two micro-batches of 2 per replica (its reference
#: has the same shape)
VOCAB = ["--vocab", "4096", "--global-batch-size", "8"]


def consolidate_job(jobs: JobCache) -> Path:
    """GPUs 0 and 3 3x slow from the fault's start, a heavier last stage; only S3."""
    slow_gpus = [{"kind": "compute", "rank": r, "factor": 3.0, "start": FAULT_START} for r in (0, 3)]
    return jobs.train(*PP2_JOB, "--iters", str(ITERS), *VOCAB, "--device-gflops", "4",
                      "--falcon-mitigation-strategies", "S3", faults=slow_gpus, device="emulated")


def vocab_reference(jobs: JobCache) -> Path:
    """What the consolidation run learns undisturbed."""
    return jobs.train(*PP2_JOB, "--iters", str(ITERS), *VOCAB, "--no-falcon")


#: the jobs this module reads, run ahead by the session (conftest.py)
AHEAD = (consolidate_job, vocab_reference)


def test_two_stragglers_are_consolidated_into_one_stage(jobs):
    out = consolidate_job(jobs)
    (loc,) = [e for e in events(out, "localized") if e["evidence"]["trigger"] == "fail_slow"]
    assert loc["gpus"] == [0, 3] and loc["links"] == [], loc["evidence"]
    applied = [e for e in events(out, "mitigation") if e["strategy"] in ("S2", "S3", "S4")]
    assert [e["strategy"] for e in applied] == ["S3"], applied
    roles = applied[0]["roles"]
    stage = {p: roles[p] // 2 for p in range(4)}  # TP1 x DP2: torch rank r is in stage r // 2
    assert stage[0] == stage[3], roles  # both stragglers now in one stage
    summary = json.loads((out / "summary.json").read_text())
    before, after = applied[0]["predicted_s"]
    slow, mitigated = summary["slow_iter_s"], summary["mitigated_iter_s"]
    print(f"consolidation: predicted {before} -> {after} s/iter, measured {slow} -> {mitigated}")
    # on devices that keep their speed (the emulated bed, as on a GPU cluster) the
    # planner's model is exact: what it predicted before and after is what the job ran
    assert mitigated < slow, summary
    assert abs(slow - before) <= 0.1 * before and abs(mitigated - after) <= 0.1 * after, summary


def test_consolidation_keeps_what_the_model_learns(jobs):
    assert_same_trajectory(losses(consolidate_job(jobs)), losses(vocab_reference(jobs)), ITERS)
