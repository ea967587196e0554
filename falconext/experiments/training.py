"""Training jobs for the experiments: ``falconext train`` as a child process, and its summary.

The experiments of the paper's section 7 that need training (fig12-fig19, table7, the
ablations) run real jobs on the emulated test bed, one at a time (the 2-core host has no
room for two), exactly as a user would with ``falconext train``. This module is the one
place that builds the command line, writes the fault file, bounds the run by a deadline
and reads back ``summary.json`` and the events; each experiment module only says which
jobs it wants and what it makes of their summaries.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: a job that has not finished by then is killed and reported as failed
DEFAULT_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Job:
    """One ``falconext train`` run: its name (the folder), arguments, ranks and faults."""

    name: str
    args: tuple[str, ...]
    nproc: int = 4
    #: fault dicts as ``--inject`` takes them (falconext/model/faults.py)
    faults: tuple[dict[str, Any], ...] = ()
    device: str = "emulated"
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass(frozen=True)
class JobResult:
    """What a finished job left: its folder, summary.json and events.jsonl (parsed)."""

    job: Job
    out: Path
    summary: dict[str, Any]
    events: list[dict[str, Any]] = field(default_factory=list)

    def events_of(self, type_: str) -> list[dict[str, Any]]:
        """The job's events of one type, in the order they were logged."""
        return [e for e in self.events if e.get("type") == type_]


class JobFailed(RuntimeError):
    """A job exited non-zero, ran past its deadline or left no summary."""


def command(job: Job, out: Path, inject: Path | None) -> list[str]:
    """The ``falconext train`` command line of ``job`` writing into ``out``."""
    cmd = [sys.executable, "-m", "falconext.cli", "train", "--nproc", str(job.nproc), "--out", str(out),
           "--device", job.device, "--no-report", *job.args]
    if inject is not None:
        cmd += ["--inject", str(inject)]
    return cmd


def _read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    found = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            found.append(json.loads(line))
    return found


def run_job(job: Job, base: Path) -> JobResult:
    """Run ``job`` into ``base/job.name`` and return what it wrote.

    One thread per rank (as the tests run them). Raises JobFailed naming the job and the
    last lines of its output when it fails, times out or writes no summary.
    """
    out = base / job.name
    inject = None
    if job.faults:
        inject = base / f"{job.name}-faults.json"
        inject.write_text(json.dumps(list(job.faults)), encoding="utf-8")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    try:
        proc = subprocess.run(command(job, out, inject), capture_output=True, text=True,
                              timeout=job.timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise JobFailed(f"job {job.name}: still running after {job.timeout_s:.0f} s") from None
    out.mkdir(parents=True, exist_ok=True)
    (out / "stdout.txt").write_text(proc.stdout + proc.stderr, encoding="utf-8")
    summary_path = out / "summary.json"
    if proc.returncode != 0 or not summary_path.exists():
        tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
        raise JobFailed(f"job {job.name}: exit {proc.returncode}, no summary: {tail}"[:600])
    summary = json.loads(summary_path.read_text(encoding="utf-8"))
    return JobResult(job, out, summary, _read_events(out / "events.jsonl"))


def jobs_folder(prefix: str) -> Path:
    """A scratch folder for an experiment's jobs (kept: the runs can be inspected after);
    ``FALCON_EXPERIMENT_JOBS`` chooses its parent."""
    parent = os.environ.get("FALCON_EXPERIMENT_JOBS")
    if parent:
        Path(parent).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"falconext-{prefix}-", dir=parent or None))


def slowdown(slow_s: float | None, healthy_s: float | None) -> float | None:
    """slow / healthy iteration time (1.0 = no slowdown); None when either is missing."""
    if not slow_s or not healthy_s:
        return None
    return slow_s / healthy_s



def phases_row(result: JobResult) -> dict[str, Any]:
    """The fields every mitigation experiment's row has, from the job's summary: its name,
    the healthy, slow and mitigated iteration times (the phases' medians), the slowdowns
    before and after (x healthy), the share removed, the first detection's delay in
    iterations, and the share of device time the host overran."""
    s = result.summary
    healthy, slow, mitigated = s.get("healthy_iter_s"), s.get("slow_iter_s"), s.get("mitigated_iter_s")
    faults = (s.get("detection") or {}).get("faults") or []
    delays = [f.get("first_detection_delay") for f in faults if f.get("detected")]
    before, after = slowdown(slow, healthy), slowdown(mitigated, healthy)
    return {
        "job": result.job.name,
        "healthy_s": healthy,
        "slow_s": slow,
        "mitigated_s": mitigated,
        "slowdown_before": None if before is None else round(before, 3),
        "slowdown_after": None if after is None else round(after, 3),
        "removed": s.get("slowdown_removed"),
        "detected_after": min(delays) if delays else None,
        "overrun_share": (s.get("device") or {}).get("overrun_share"),
    }


def first_localized(result: JobResult) -> dict[str, Any]:
    """The job's first localization (gpus, links, ...) from its summary; {} when none."""
    found = (result.summary.get("localization") or {}).get("localized") or []
    return found[0] if found else {}
