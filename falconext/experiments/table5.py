"""Table 5: detection accuracy on communication fail-slows (BOCD+V, BOCD, slide-window,
persistence); see :mod:`falconext.experiments.detection_accuracy`."""

from __future__ import annotations

from falconext.experiments.detection_accuracy import draw_kind, measure_kind
from falconext.experiments.result import ExperimentResult


def measure(quick: bool) -> ExperimentResult:
    """Quick: one seed, 90 traces (30 comm + 30 healthy scored); full: seeds 2026 and
    4242, 600 traces each (200 comm + 200 healthy scored per seed)."""
    return measure_kind("comm", quick)


def draw(result: ExperimentResult, path: str) -> None:
    """The communication traces' accuracy per method as a PNG at ``path``."""
    draw_kind(result, path, "Table 5: communication fail-slows")
