"""Detect: iteration time from collective calls, and fail-slow events from iteration time.

Public surface: :func:`make_detector` / :func:`detect` over iteration-time series, and the
period finder and streaming iteration tracker over call records.
"""

from __future__ import annotations

from typing import Iterable

from falconext.config import FalconConfig
from falconext.detect.baselines import Persistence, PlainBOCD, SlideWindow
from falconext.detect.events import Detector, FailSlowEvent, InvalidSample, run_detector
from falconext.detect.verify import VerifiedBOCD

METHODS = {"bocd+v": VerifiedBOCD, "bocd": PlainBOCD, "slide-window": SlideWindow, "persistence": Persistence}


class UnknownMethod(ValueError):
    """A detection method name that is not one of METHODS."""


def make_detector(method: str = "bocd+v", config: FalconConfig | None = None) -> Detector:
    """A fresh online detector of ``method`` (one of :data:`METHODS`) with ``config``.
    Raises UnknownMethod, naming the known methods, for any other name."""
    try:
        cls = METHODS[method]
    except KeyError:
        known = ", ".join(METHODS)
        raise UnknownMethod(f"unknown detection method {method!r} (choose from {known})") from None
    return cls(config)


def detect(series: Iterable[float], method: str = "bocd+v", config: FalconConfig | None = None) -> list[FailSlowEvent]:
    """Batch API: the events of a whole iteration-time series, as the online detector saw them."""
    return run_detector(make_detector(method, config), series)


__all__ = [
    "METHODS",
    "Detector",
    "FailSlowEvent",
    "InvalidSample",
    "Persistence",
    "PlainBOCD",
    "SlideWindow",
    "UnknownMethod",
    "VerifiedBOCD",
    "detect",
    "make_detector",
]
