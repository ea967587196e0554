"""Table 4: detection accuracy on computation fail-slows (BOCD+V, BOCD, slide-window,
persistence); see :mod:`falconext.experiments.detection_accuracy`."""

from __future__ import annotations

from falconext.experiments.detection_accuracy import draw_kind, measure_kind
from falconext.experiments.result import ExperimentResult


def measure(quick: bool) -> ExperimentResult:
    """Quick: one seed, 90 traces (30 compute + 30 healthy scored); full: seeds 2026 and
    4242, 600 traces each (200 compute + 200 healthy scored per seed)."""
    return measure_kind("compute", quick)


def draw(result: ExperimentResult, path: str) -> None:
    """The computation traces' accuracy per method as a PNG at ``path``."""
    draw_kind(result, path, "Table 4: computation fail-slows")
