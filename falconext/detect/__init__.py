"""Detect: iteration time from collective calls, and fail-slow events from iteration time.

Public surface: :func:`make_detector` / :func:`detect` over iteration-time series, and the
period finder and streaming iteration tracker over call records.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Iterable

from falconext.config import DetectConfig, FalconConfig
from falconext.detect.events import Detector, FailSlowEvent, InvalidSample, run_detector

if TYPE_CHECKING:
    from falconext.detect.baselines import Persistence, PlainBOCD, SlideWindow
    from falconext.detect.verify import VerifiedBOCD

#: method name -> (module, class); the classes are imported on first use (they need scipy,
#: which a process that only tracks or reports should not pay for at start-up)
_METHOD_CLASSES = {
    "bocd+v": ("falconext.detect.verify", "VerifiedBOCD"),
    "bocd": ("falconext.detect.baselines", "PlainBOCD"),
    "slide-window": ("falconext.detect.baselines", "SlideWindow"),
    "persistence": ("falconext.detect.baselines", "Persistence"),
}
#: the detection methods' names, in the order they are listed
METHOD_NAMES = tuple(_METHOD_CLASSES)


def __getattr__(name: str) -> Any:
    """``METHODS`` (name -> detector class) and the detector classes, imported on first use."""
    if name == "METHODS":
        methods = {m: getattr(importlib.import_module(mod), cls) for m, (mod, cls) in _METHOD_CLASSES.items()}
        globals()["METHODS"] = methods
        return methods
    for mod, cls in _METHOD_CLASSES.values():
        if cls == name:
            return getattr(importlib.import_module(mod), cls)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class UnknownMethod(ValueError):
    """A detection method name that is not one of METHODS."""


def make_detector(method: str = "bocd+v", config: FalconConfig | DetectConfig | None = None) -> Detector:
    """A fresh online detector of ``method`` (one of :data:`METHODS`) with ``config``.
    Raises UnknownMethod, naming the known methods, for any other name."""
    try:
        mod, cls = _METHOD_CLASSES[method]
    except KeyError:
        known = ", ".join(METHOD_NAMES)
        raise UnknownMethod(f"unknown detection method {method!r} (choose from {known})") from None
    return getattr(importlib.import_module(mod), cls)(config)


def detect(series: Iterable[float], method: str = "bocd+v", config: FalconConfig | DetectConfig | None = None) -> list[FailSlowEvent]:
    """Batch API: the events of a whole iteration-time series, as the online detector saw them."""
    return run_detector(make_detector(method, config), series)


__all__ = [
    "METHODS",
    "METHOD_NAMES",
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
