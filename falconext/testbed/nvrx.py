"""NVIDIA nvidia-resiliency-ext's straggler detection run beside falconext in a test-bed job
(``--nvrx-report-s``), for the side-by-side comparison of ``examples/compare_nvrx.py``.

NVRx (0.4.1, the optional ``nvrx`` extra, never a runtime dependency) times *sections* of
the training loop on the CPU and, on a GPU, the CUDA kernels launched inside them
(CUPTI), and scores each rank against the fastest rank (relative) and against its own
best (individual). Its ``Detector`` needs CUDA (CUPTI's library, ``torch.cuda``); on the
test bed this harness does what ``Detector`` does around NVRx's own scoring, which it
calls unchanged:

- the train step is the detection section, timed with ``perf_counter`` around it, as
  ``Detector.detection_section`` times it (Megatron Bridge's NVRx manager wraps the same
  train step);
- the emulated device's compute windows (each micro-batch's forward and backward) are the
  kernels CUPTI would time: a GPU's kernel durations are its device time;
- a report comes every ``report_s`` seconds counted in iterations as NVRx's interval
  tracker counts them: the median of the first 16 steps, the largest interval over the
  ranks (an all-reduce), then every that many steps;
- NVRx's ``ReportGenerator.generate_report`` (its collectives on the job's own group) and
  ``Report.identify_stragglers`` with its default thresholds (0.75) decide.

Rank 0 writes each report to ``nvrx.jsonl`` (with its ``report_s``); every rank writes what
NVRx cost it to ``ranks/nvrx-rank<r>.json`` (``ranks/nvrx-<S>s-rank<r>.json`` per interval
where the job runs several, one detector each).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

from falconext.inputs import InputError

#: steps NVRx's interval tracker times before it fixes the report interval
ESTIMATION_STEPS = 16
#: the scores NVRx computes ("all")
SCORES = ("relative_perf_scores", "individual_perf_scores")


def _nvrx() -> tuple[Any, Any]:
    """NVRx's ReportGenerator and Statistic, or InputError naming the missing extra."""
    try:
        # lazy: optional dependency (nvidia-resiliency-ext)
        from nvidia_resiliency_ext.straggler.reporting import ReportGenerator
        from nvidia_resiliency_ext.straggler.statistics import Statistic
    except ImportError as exc:
        raise InputError(f"--nvrx-report-s needs nvidia-resiliency-ext 0.4.1: pip install -e '.[nvrx]' ({exc})") from None
    return ReportGenerator, Statistic


def check_available() -> None:
    """Raise InputError (one line) when NVRx cannot be imported."""
    _nvrx()


class NvrxBeside:
    """NVRx's straggler detection in one rank of a test-bed job (module docstring)."""

    def __init__(self, out: str, rank: int, node: int, report_s: float, several: bool = False) -> None:
        """``report_s``: the report interval, checked > 0 with the job's arguments
        (testbed/options.py); ``several``: other intervals run beside it (its cost file
        names its interval)."""
        generator, self._stat = _nvrx()
        self.out, self.rank, self.report_s, self.several = out, rank, report_s, several
        self._gen = generator(scores_to_compute=list(SCORES), gather_on_rank0=True, node_name=f"node{node}")
        self._steps_ms: list[float] = []
        self._kernels_ms: dict[str, list[float]] = {}
        self._estimate: list[float] = []
        self.interval: int | None = None
        self._count = 0
        self.cost_s = 0.0
        self.reports = 0

    def window(self, kind: str, seconds: float) -> None:
        """One kernel's device time (the emulated device's compute window)."""
        self._kernels_ms.setdefault(kind, []).append(seconds * 1e3)

    def step(self, iteration: int, seconds: float) -> None:
        """The train step of ``iteration`` took ``seconds``: note it, and report when the
        interval has elapsed (every rank calls this every step: the report is collective)."""
        t0 = time.perf_counter()
        self._steps_ms.append(seconds * 1e3)
        self._count += 1
        if self.interval is None:
            self._estimate.append(seconds)
            if len(self._estimate) == ESTIMATION_STEPS:
                med = torch.tensor(self._estimate, dtype=torch.float64).median().item()
                wanted = torch.tensor([self.report_s / max(med, 1e-9)], dtype=torch.float64)
                if torch.distributed.is_initialized():
                    torch.distributed.all_reduce(wanted, op=torch.distributed.ReduceOp.MAX)
                self.interval = max(1, int(wanted.item()))
        elif self._count % self.interval == 0:
            self._report(iteration)
        self.cost_s += time.perf_counter() - t0

    def _summary(self, times_ms: list[float]) -> dict:
        t = torch.tensor(times_ms, dtype=torch.float64)
        s = self._stat
        return {s.MIN: t.min().item(), s.MAX: t.max().item(), s.MED: t.median().item(), s.AVG: t.mean().item(),
                s.STD: t.std().item() if len(times_ms) > 1 else float("nan"), s.NUM: len(times_ms)}

    def _report(self, iteration: int) -> None:
        sections = {"train_step": self._summary(self._steps_ms)} if self._steps_ms else {}
        kernels = {k: self._summary(v) for k, v in sorted(self._kernels_ms.items()) if v}
        report = self._gen.generate_report(sections, kernels)
        self._steps_ms.clear()
        self._kernels_ms.clear()
        self.reports += 1
        if self.rank != 0 or report is None:
            return
        found = report.identify_stragglers()

        def ranks(ids: Any) -> list[int]:
            return sorted({s.rank for s in ids})

        line = {
            "iteration": iteration, "time": time.time(), "report_s": self.report_s,
            "gpu_relative": {str(r): round(v, 4) for r, v in sorted(report.gpu_relative_perf_scores.items())},
            "gpu_individual": {str(r): round(v, 4) for r, v in sorted(report.gpu_individual_perf_scores.items())},
            "section_relative": {sec: {str(r): round(v, 4) for r, v in sorted(sc.items())}
                                 for sec, sc in report.section_relative_perf_scores.items()},
            "section_individual": {sec: {str(r): round(v, 4) for r, v in sorted(sc.items())}
                                   for sec, sc in report.section_individual_perf_scores.items()},
            "stragglers": {
                "gpu_relative": ranks(found["straggler_gpus_relative"]),
                "gpu_individual": ranks(found["straggler_gpus_individual"]),
                "section_relative": sorted({r for ids in found["straggler_sections_relative"].values() for r in ranks(ids)}),
                "section_individual": sorted({r for ids in found["straggler_sections_individual"].values()
                                              for r in ranks(ids)}),
            },
        }
        with open(os.path.join(self.out, "nvrx.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")

    def close(self, suffix: str = "") -> None:
        """Write this rank's cost: steps seen, reports made, seconds spent in NVRx."""
        name = f"nvrx-{self.report_s:g}s" if self.several else "nvrx"
        with open(os.path.join(self.out, "ranks", f"{name}{suffix}-rank{self.rank}.json"), "w") as f:
            json.dump({"steps": self._count, "reports": self.reports, "interval_steps": self.interval,
                       "cost_s": round(self.cost_s, 6),
                       "per_step_ms": round(1e3 * self.cost_s / self._count, 4) if self._count else None}, f)
