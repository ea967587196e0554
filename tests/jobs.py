"""Running ``falconext train`` from the tests, and reading what a run wrote.

One place for the test modules that train real jobs (test_train, test_mitigation_e2e,
test_topology_e2e, test_switch): the command line, the environment (one thread per
rank, on the 2-core test host), the fault file, and the readers of events and losses.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path


def launch(out: Path, *args: str, nproc: int = 4, faults: list | None = None,
           timeout: int = 500, device: str = "cpu") -> subprocess.CompletedProcess:
    """Run one job; the caller judges the exit status. ``device``: the test bed's
    ``--device`` (the tests not yet moved to the emulated device keep the CPU bed)."""
    cmd = [sys.executable, "-m", "falconext.cli", "train", "--nproc", str(nproc), "--out", str(out),
           "--device", device, *args]
    if faults is not None:
        inject = out.parent / f"{out.name}-faults.json"
        inject.write_text(json.dumps(faults))
        cmd += ["--inject", str(inject)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def train(out: Path, *args: str, nproc: int = 4, faults: list | None = None, timeout: int = 500,
          device: str = "cpu") -> Path:
    """Run one job that must succeed; its output is kept in ``stdout.txt``."""
    proc = launch(out, *args, nproc=nproc, faults=faults, timeout=timeout, device=device)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (out / "stdout.txt").write_text(proc.stdout)
    return out


def events(out: Path, type_: str | None = None) -> list[dict]:
    evs = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines() if line.strip()]
    return [e for e in evs if type_ is None or e["type"] == type_]


def losses_by_rank(out: Path) -> dict[int, dict[int, float]]:
    """iteration -> {rank: loss}: last-stage ranks report the global-batch loss."""
    found: dict[int, dict[int, float]] = {}
    with open(out / "iterations.csv", newline="") as f:
        for row in csv.DictReader(f):
            if row["loss"]:
                found.setdefault(int(row["iteration"]), {})[int(row["rank"])] = float(row["loss"])
    return found


def losses(out: Path) -> dict[int, float]:
    """iteration -> the global-batch loss, which every reporting rank must agree on."""
    got: dict[int, float] = {}
    for it, by_rank in losses_by_rank(out).items():
        assert len(set(by_rank.values())) == 1, f"two losses for iteration {it}: {by_rank}"
        got[it] = next(iter(by_rank.values()))
    return got


def assert_same_trajectory(a: dict[int, float], b: dict[int, float], iters: int) -> float:
    """Every iteration's loss within 1e-4 (relative); returns the worst difference."""
    assert sorted(a) == sorted(b) == list(range(iters))
    worst = max(abs(a[i] - b[i]) / abs(b[i]) for i in a)
    assert worst <= 1e-4, worst
    return worst
