"""GPU smoke tests: run where a machine has NVIDIA GPUs, skipped (with the reason) elsewhere.

- P2P validation runs on the job's fabric: on GPUs, NCCL and device tensors (gloo's CPU
  tensors would time the host network, not the links training uses). Two ranks need two
  GPUs: NCCL refuses two ranks on one device.
- CUDA-event timings: the iteration times falconext recovers from CUDA events on the
  collectives agree with the training loop's own within 2% (median over iterations).
"""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

import pytest
import torch

from jobs import events, train

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_two = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 NVIDIA GPUs (NCCL allows one rank per GPU); found {GPUS}")


def _loop_and_estimated(out: Path) -> tuple[dict, dict]:
    loop, est = {}, {}
    for name, into in (("iterations.csv", loop), ("estimates.csv", est)):
        with open(out / name, newline="") as f:
            for row in csv.DictReader(f):
                into[(int(row["rank"]), int(row["iteration"]))] = float(row["iter_time_s"])
    return loop, est


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory) -> Path:
    """Two ranks of DP2 on two GPUs with NCCL, rank 1 2x slow from 40: detected,
    validated (GEMMs and P2P passes on the GPUs) and localized."""
    return train(tmp_path_factory.mktemp("gpu") / "run", "--iters", "80", "--global-batch-size", "16",
                 "--micro-batch-size", "1", "--falcon-mitigation", "false", nproc=2, device="cuda",
                 faults=[{"kind": "compute", "rank": 1, "factor": 2.0, "start": 40}])


@needs_two
def test_p2p_validation_runs_on_nccl_with_device_tensors(gpu_run):
    loc = events(gpu_run, "localized")
    assert loc and loc[0]["gpus"] == [1], loc
    held = [e for e in events(gpu_run, "suspension") if e.get("outcome") == "validated" and "fabric" in e]
    assert held, "no P2P validation ran"
    assert all(e["fabric"].startswith("nccl:cuda") for e in held), held


@needs_two
def test_cuda_event_timings_agree_with_the_loop_within_2_percent(gpu_run):
    loop, est = _loop_and_estimated(gpu_run)
    common = [k for k in est if k in loop and k[1] >= 10]
    assert len(common) > 40, len(common)
    err = statistics.median(abs(est[k] - loop[k]) / loop[k] for k in common)
    assert err <= 0.02, err
