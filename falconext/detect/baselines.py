"""The ablation baselines of the paper's Tables 4 and 5, with BOCD+V's interface.

``slide-window`` reports a fail-slow when the median of the last few iterations is more
than 10% above the median of the iterations before them, and its end when it falls back
(medians, so that a single spike is not already an alarm).
``persistence`` reports one when each of the last ``persistence_iterations`` iterations
is more than 10% above that reference, and its end when each of as many is back within
10%: the one-line rule operators write by hand, which a detector must beat.
``bocd`` reports every BOCD change point with no verification: a change point starts an
event when none is open and ends the open one otherwise. Both are deliberately what the
paper compared against, not tuned: their job is to show what verification buys.
"""

from __future__ import annotations

from collections import deque

from falconext.config import DetectConfig, FalconConfig, detect_config
from falconext.detect.bocd import BOCD
from falconext.detect.events import EventBook, FailSlowEvent, check_sample
from falconext.medians import median


class SlideWindow:
    """The slide-window baseline (module docstring): an event when the median of the last
    ``slide_window`` iterations is ``min_slowdown`` above the median of the reference
    before them; it ends when that median is back under the line."""

    name = "slide-window"

    def __init__(self, config: FalconConfig | DetectConfig | None = None) -> None:
        self.cfg = detect_config(config)
        w, ref = self._window(), self.cfg.slide_reference
        self._recent: deque[float] = deque(maxlen=w)
        self._reference: deque[float] = deque(maxlen=ref)
        self._book = EventBook()
        self._open: FailSlowEvent | None = None
        self._n = 0

    @property
    def events(self) -> list[FailSlowEvent]:
        """Every event so far, latest state, in onset order."""
        return self._book.all

    def feed(self, value: float) -> list[FailSlowEvent]:
        """Absorb one iteration time; return the event opened or ended by it (empty list
        otherwise). Raises InvalidSample for a value that is not a finite positive number."""
        i = self._n
        x = check_sample(value, i)
        self._n += 1
        cfg = self.cfg
        if len(self._recent) == self._recent.maxlen:
            oldest = self._recent[0]
            if self._open is None:
                self._reference.append(oldest)  # the reference freezes during an event
        self._recent.append(x)
        if len(self._recent) < self._recent.maxlen or len(self._reference) < cfg.min_baseline:
            return []
        level = median(self._recent)
        start = i - len(self._recent) + 1
        if self._open is None:
            ref = median(self._reference)
            if self._slow(ref * (1.0 + cfg.min_slowdown)):
                self._open = self._book.open(start, i, level / ref, ref)
                return [self._open]
            return []
        ev = self._open
        if self._back(ev.baseline * (1.0 + cfg.min_slowdown)):
            self._open = None
            self._recent.clear()
            return [self._book.update(ev.with_(end=max(start, ev.onset + 1), ended_at=i))]
        if level / ev.baseline > ev.slowdown:
            self._open = self._book.update(ev.with_(slowdown=level / ev.baseline))
        return []

    def _window(self) -> int:
        return self.cfg.slide_window

    def _slow(self, floor: float) -> bool:
        """The recent iterations are slow: their median is above ``floor``."""
        return median(self._recent) > floor

    def _back(self, floor: float) -> bool:
        """The recent iterations are healthy again: their median is at most ``floor``."""
        return median(self._recent) <= floor


class Persistence(SlideWindow):
    """The persistence baseline: an event when every one of the last
    ``persistence_iterations`` iterations is ``min_slowdown`` above the reference, ended
    when every one of as many is back within it."""

    name = "persistence"

    def _window(self) -> int:
        return self.cfg.persistence_iterations

    def _slow(self, floor: float) -> bool:
        return min(self._recent) > floor

    def _back(self, floor: float) -> bool:
        return max(self._recent) <= floor


class PlainBOCD:
    """BOCD without verification: each new change point opens an event when none is open
    (slowdown = mean after / mean before) and ends the open one otherwise."""

    name = "bocd"

    def __init__(self, config: FalconConfig | DetectConfig | None = None) -> None:
        self.cfg = detect_config(config)
        c = self.cfg
        self._bocd = BOCD(hazard=c.bocd_hazard, max_run_length=c.bocd_max_run_length)
        self._book = EventBook()
        self._hist: deque[float] = deque(maxlen=c.baseline_window + c.bocd_recent_window + 1)
        self._open: FailSlowEvent | None = None
        self._last: int | None = None
        self._n = 0

    @property
    def events(self) -> list[FailSlowEvent]:
        """Every event so far, latest state, in onset order."""
        return self._book.all

    def feed(self, value: float) -> list[FailSlowEvent]:
        """Absorb one iteration time; return the event a new change point opened or ended
        (empty list otherwise). Raises InvalidSample for a value that is not a finite
        positive number."""
        i = self._n
        x = check_sample(value, i)
        self._n += 1
        self._hist.append(x)
        self._bocd.update(x)
        cfg = self.cfg
        if self._n < cfg.bocd_warmup or self._bocd.recent_mass(cfg.bocd_recent_window) <= cfg.bocd_threshold:
            return []
        c = self._bocd.recent_start(cfg.bocd_recent_window)
        if c is None or c == self._last:
            return []
        self._last = c
        if self._open is not None:
            if c <= self._open.onset:
                return []
            ev = self._book.update(self._open.with_(end=c, ended_at=i))
            self._open = None
            return [ev]
        hist = list(self._hist)
        split = len(hist) - (i - c + 1)
        pre, post = hist[:split], hist[split:]
        if not pre or not post:
            return []
        base = sum(pre) / len(pre)
        self._open = self._book.open(c, i, (sum(post) / len(post)) / base, base)
        return [self._open]
