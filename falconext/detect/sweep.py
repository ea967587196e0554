"""Detection delay against false alarms: each detector's sensitivity swept over a labelled set.

A user picks an operating point, not a detector: how many iterations of a fail-slow they
pay to see it, for how many false alarms on healthy jobs. This module sweeps the knob
that sets each method's sensitivity (:data:`SWEEPS`: the confirmation length of BOCD+V,
the run length and threshold of persistence, ...), scores every setting with the rules
of ``falconext eval-detect`` (:mod:`falconext.detect.evaluate`), and folds the settings
into one curve per method: at each false-positive rate, the lowest median delay any
setting reaches without more false alarms than that (:func:`curve`).

The delay counts a missed fail-slow as never detected (:func:`delay_with_misses`), so a
setting cannot buy a short delay by missing the faults it would see late; a setting that
misses half of them has no delay at all.

Pure functions over plain data; ``falconext eval-detect --sweep`` reads the traces and
writes the CSV and the figure (:mod:`falconext.detect.sweep_report`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from statistics import median
from typing import Iterable, Mapping, Sequence

from falconext.config import OWNER, FalconConfig
from falconext.detect.evaluate import TraceScore, summarize

#: method -> config field -> the values swept (the grid is their product). BOCD+V: how
#: many iterations at a slow level confirm a fail-slow (a larger step is confirmed
#: sooner, down to ``min_duration_fast``); persistence and slide-window: their window and
#: their threshold; plain BOCD: its change-point threshold.
SWEEPS: dict[str, dict[str, tuple[float, ...]]] = {
    "bocd+v": {"min_duration": tuple(range(5, 17))},
    "persistence": {"persistence_iterations": tuple(range(2, 17)), "min_slowdown": (0.1, 0.15, 0.2, 0.3)},
    "slide-window": {"slide_window": tuple(range(2, 17)), "min_slowdown": (0.1, 0.15, 0.2, 0.3)},
    "bocd": {"bocd_threshold": (0.3, 0.5, 0.7, 0.9, 0.95, 0.99)},
}

#: the false-positive rates a curve is read at by default (percent of healthy traces)
FPR_GRID_PCT: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0)


@dataclass(frozen=True)
class Setting:
    """One sensitivity of one method: the config fields it overrides, in :data:`SWEEPS`'
    order."""

    method: str
    overrides: tuple[tuple[str, float], ...]

    def config(self, base: FalconConfig) -> FalconConfig:
        """``base`` with this setting's fields replaced (validated as any config is)."""
        return base.replace(**dict(self.overrides))

    def label(self) -> str:
        """``field=value`` pairs joined by spaces, e.g. ``min_duration=11``."""
        return " ".join(f"{k}={v:g}" for k, v in self.overrides)

    def is_default(self, base: FalconConfig) -> bool:
        """True when ``base`` already has every value this setting sets."""
        return all(getattr(base, k) == v for k, v in self.overrides)


def settings(method: str, sweeps: Mapping[str, Mapping[str, Sequence[float]]] = SWEEPS) -> list[Setting]:
    """Every setting of ``method``'s grid (the product of its swept values). Raises
    ValueError for a method without a sweep or a field FalconConfig does not have."""
    if method not in sweeps:
        raise ValueError(f"no sensitivity sweep for method {method!r} (choose from {', '.join(sweeps)})")
    grid = sweeps[method]
    known = set(OWNER)
    unknown = [k for k in grid if k not in known]
    if unknown or not grid:
        raise ValueError(f"{method}: sweep field {unknown[0] if unknown else '(none)'!r} is not a FalconConfig field")
    names = list(grid)
    return [Setting(method, tuple(zip(names, values))) for values in itertools.product(*(grid[n] for n in names))]


def delay_with_misses(scores: Iterable[TraceScore]) -> float | None:
    """The median detection delay over every labelled fail-slow, a missed one counting as
    never detected (infinitely late): None when at least half are missed or there is no
    label; an even count's median averages its two middle delays."""
    delays: list[float] = []
    for s in scores:
        delays.extend(float(d) for d in s.delays)
        delays.extend([math.inf] * (s.labels - s.detected))
    if not delays:
        return None
    mid = median(delays)
    return None if math.isinf(mid) else float(mid)


@dataclass(frozen=True)
class Point:
    """One setting's result on the set: its false-positive rate (percent of healthy
    traces with an alarm), false-negative rate (percent of labels missed), median delay
    (:func:`delay_with_misses`), false alarms over every trace, and whether it is the
    configuration's own setting."""

    setting: Setting
    fpr_pct: float
    fnr_pct: float
    median_delay: float | None
    false_alarms: int
    healthy: int
    labels: int
    default: bool


def point(setting: Setting, scores: Sequence[TraceScore], base: FalconConfig) -> Point:
    """Score one setting from its per-trace scores."""
    s = summarize(scores)
    return Point(setting, 100.0 * s.fpr, 100.0 * s.fnr, delay_with_misses(scores), s.false_alarms,
                 s.healthy, s.labels, setting.is_default(base))


@dataclass(frozen=True)
class CurvePoint:
    """A method's best at one false-positive rate: the lowest median delay among its
    settings with at most that rate (None: no setting gets there), and that setting."""

    fpr_pct: float
    median_delay: float | None
    setting: Setting | None


def curve(points: Sequence[Point], fprs_pct: Sequence[float] = FPR_GRID_PCT) -> list[CurvePoint]:
    """The lower envelope of ``points`` (one method's) read at each rate of ``fprs_pct``:
    for each rate, the setting with the lowest delay among those at or under it (ties:
    the lower false-positive rate, then the lower false-negative rate)."""
    out = []
    for f in fprs_pct:
        ok = [p for p in points if p.median_delay is not None and p.fpr_pct <= f + 1e-9]
        best = min(ok, key=lambda p: (p.median_delay, p.fpr_pct, p.fnr_pct), default=None)
        out.append(CurvePoint(f, best.median_delay if best else None, best.setting if best else None))
    return out


def worse_at(ours: Sequence[CurvePoint], theirs: Sequence[CurvePoint]) -> list[float]:
    """The rates where ``ours`` is above ``theirs`` (a later median delay, or none where
    they have one); both read at the same rates."""
    bad = []
    for a, b in zip(ours, theirs, strict=True):
        if a.fpr_pct != b.fpr_pct:
            raise ValueError(f"curves read at different rates: {a.fpr_pct} and {b.fpr_pct}")
        if b.median_delay is not None and (a.median_delay is None or a.median_delay > b.median_delay):
            bad.append(a.fpr_pct)
    return bad


def operating_point(points: Sequence[Point], max_fpr_pct: float = 0.0) -> Point | None:
    """The setting a user should run when at most ``max_fpr_pct`` of healthy jobs may see a
    false alarm: the lowest delay under that rate (ties: fewer false alarms over every
    trace, then fewer misses); None when no setting stays under it."""
    ok = [p for p in points if p.median_delay is not None and p.fpr_pct <= max_fpr_pct + 1e-9]
    return min(ok, key=lambda p: (p.median_delay, p.false_alarms, p.fnr_pct), default=None)
