"""BOCD plus verification (BOCD+V): the fail-slow detector of Falcon-Detect.

BOCD proposes change points; most of them are jitter (spikes, bursts, periodic
fluctuation, drift). Verification turns a candidate into a fail-slow only when the
iterations after it are at least ``min_slowdown`` (10%) slower than the healthy
iterations before it, and stay so: the post-change window of ``min_duration`` iterations
is split into ``sustain_chunks`` chunks and every chunk must be slow by the same 10%, so
a burst that ends inside the window is rejected. A noisy candidate that is slow overall
but fails a chunk is checked again on two, three and four times longer windows (larger chunks,
steadier medians) before it is dropped. Levels are medians (a robust mean):
one checkpoint-save spike in the window must not turn jitter into an event, nor hide one.

An open event ends when the level is back within ``recovery_margin`` of the baseline
for a whole window, found either from a BOCD change point or, so an event can never stay
open because BOCD missed the relief, from the latest window itself. A sustained further
rise (a ladder-shaped fail-slow) raises the event's ``slowdown`` instead of opening a
second event.
"""

from __future__ import annotations

import math
from typing import Sequence

from falconext.config import FalconConfig
from falconext.detect.bocd import BOCD
from falconext.detect.events import EventBook, FailSlowEvent, check_sample, median


# -- pure checks over plain windows -------------------------------------------------------
def chunk_levels(post: Sequence[float], chunks: int) -> list[float]:
    """Median of each of ``chunks`` consecutive, near-equal parts of the window."""
    n = len(post)
    bounds = [round(i * n / chunks) for i in range(chunks + 1)]
    return [median(post[bounds[i] : bounds[i + 1]]) for i in range(chunks) if bounds[i + 1] > bounds[i]]


def slow_level(baseline: float, post: Sequence[float], cfg: FalconConfig) -> float | None:
    """The sustained slowdown (post level / baseline) if the window is a fail-slow, else None."""
    level = median(post) / baseline
    if level < 1.0 + cfg.min_slowdown:
        return None
    floor = baseline * (1.0 + cfg.min_slowdown)
    if min(chunk_levels(post, cfg.sustain_chunks)) < floor:
        return None
    return level


def best_split(values: Sequence[float], before: float, after: float) -> int:
    """Index j that best explains ``values`` as ``before`` up to j and ``after`` from j on.

    A window that just turned slow (or healthy) is matched to where the level actually
    moved, not to where the window happened to start. The fit is least *absolute* error
    on log times, so each iteration's vote is bounded by the gap between the two levels
    and one checkpoint spike cannot outvote ten ordinary iterations.
    """
    lb, la = math.log(before), math.log(after)
    # cost(j) = sum_{k<j} |v-before| + sum_{k>=j} |v-after|; minimise via suffix sums
    best_j, best_cost, suffix = len(values), 0.0, 0.0
    for j in range(len(values) - 1, -1, -1):
        lv = math.log(values[j])
        suffix += abs(lv - la) - abs(lv - lb)
        if suffix < best_cost:
            best_j, best_cost = j, suffix
    return best_j


def is_recovered(baseline: float, post: Sequence[float], cfg: FalconConfig, before: float | None = None) -> bool:
    """True if the window is healthy again.

    Every chunk must be under the fail-slow line (baseline + min_slowdown), and the level
    must be either back within ``recovery_margin`` of the baseline, or a clear step down
    (by min_slowdown) from ``before``, the level just before the window. The second way
    lets an event end when the healthy level itself drifted during a long event; the
    margin keeps a noisy event hovering at the line from being ended and reopened.
    """
    ceiling = baseline * (1.0 + cfg.min_slowdown)
    if max(chunk_levels(post, cfg.sustain_chunks)) >= ceiling:
        return False
    level = median(post)
    if level <= baseline * (1.0 + cfg.recovery_margin):
        return True
    return before is not None and level * (1.0 + cfg.min_slowdown) <= before


# -- the online detector ------------------------------------------------------------------
class VerifiedBOCD:
    """BOCD+V, online. Feed iteration times; get events when confirmed, raised or ended."""

    name = "bocd+v"
    #: a candidate whose first window is slow overall but not sustained is checked again
    #: on a window this many times longer, at most (noisy communication fail-slows)
    retries = 3

    def __init__(self, config: FalconConfig | None = None) -> None:
        self.cfg = config or FalconConfig()
        c = self.cfg
        self._bocd = BOCD(hazard=c.bocd_hazard, max_run_length=c.bocd_max_run_length)
        self._book = EventBook()
        self._hist: list[float] = []
        self._hist0 = 0  # series index of _hist[0]
        self._n = 0
        self._keep = c.baseline_window + c.bocd_max_run_length + (self.retries + 2) * c.min_duration
        self._pending: dict[int, int] = {}  # candidate onset -> windows already checked
        self._last_candidate: int | None = None
        self._open: FailSlowEvent | None = None
        self._healthy_from = 0  # first index after the last event
        self._prev_healthy: list[float] = []  # baseline samples from before the last event

    @property
    def events(self) -> list[FailSlowEvent]:
        return self._book.all

    @property
    def open_event(self) -> FailSlowEvent | None:
        return self._open

    def feed(self, value: float) -> list[FailSlowEvent]:
        i = self._n
        x = check_sample(value, i)
        self._hist.append(x)
        self._n += 1
        self._bocd.update(x)
        cfg = self.cfg
        changed: list[FailSlowEvent] = []

        if self._n >= cfg.bocd_warmup and self._bocd.recent_mass(cfg.bocd_recent_window) > cfg.bocd_threshold:
            start = self._bocd.recent_start(cfg.bocd_recent_window)
            if start is not None and start != self._last_candidate and start >= self._healthy_from:
                self._last_candidate = start
                self._pending.setdefault(start, 0)

        due = [c for c, k in self._pending.items() if i == c + (k + 1) * cfg.min_duration - 1]
        # newest first: when an older candidate's longer retry window and a newer
        # candidate's window end together, the newer one is the cleaner regime boundary
        for c in sorted(due, reverse=True):
            checked = self._pending.pop(c, None)
            if checked is None:
                continue
            ev = self._check_candidate(c, checked, i)
            if ev is not None:
                changed.append(ev)

        if self._open is not None and not changed:
            ev = self._sliding_recovery(i)
            if ev is not None:
                changed.append(ev)
        self._trim()
        return changed

    # -- internals ----------------------------------------------------------------------
    def _window(self, start: int, stop: int) -> list[float]:
        return self._hist[start - self._hist0 : stop - self._hist0]

    def _healthy_before(self, c: int) -> list[float]:
        """Up to baseline_window healthy iterations before c, skipping the last event."""
        want = self.cfg.baseline_window
        lo = max(self._healthy_from, c - want, self._hist0)
        samples = self._window(lo, c)
        if len(samples) < want and self._prev_healthy:
            samples = self._prev_healthy[-(want - len(samples)) :] + samples
        return samples

    def _check_candidate(self, c: int, checked: int, i: int) -> FailSlowEvent | None:
        cfg = self.cfg
        post = self._window(c, i + 1)
        if self._open is None:
            pre = self._healthy_before(c)
            if len(pre) < cfg.min_baseline:
                return None
            base = median(pre)
            level = slow_level(base, post, cfg)
            if level is None:
                if checked < self.retries and median(post) >= base * (1.0 + cfg.min_slowdown):
                    self._pending[c] = checked + 1
                else:
                    self._reanchor(c, post, base)
                return None
            self._prev_healthy = pre
            # BOCD's start may sit on jitter just before the fault (a burst, a spike);
            # with both levels known now, place the onset where the level really rose
            lo = max(c - cfg.bocd_recent_window, self._healthy_from, self._hist0)
            split = lo + best_split(self._window(lo, i + 1), base, base * level)
            onset = min(split, c + cfg.min_duration // cfg.sustain_chunks)
            self._open = self._book.open(onset, i, level, base)
            # candidates inside the new event are judged against its baseline from now on
            return self._open
        ev = self._open
        if c <= ev.onset:
            return None
        if is_recovered(ev.baseline, post, cfg, self._level_before(c)):
            return self._close(c, i)
        level = slow_level(ev.baseline, post, cfg)
        if level is not None and level >= ev.slowdown * (1.0 + cfg.min_slowdown):
            self._open = self._book.update(ev.with_(slowdown=level))
            return self._open
        return None

    def _reanchor(self, c: int, post: list[float], base: float) -> None:
        """A rejected window that ends slow: propose the point where the level rose.

        BOCD can fire on jitter just before a fault that ramps up, then treat the ramp as
        part of that run and never propose the fault's own start. The window's tail then
        says what BOCD missed, and the split tells where it began.
        """
        tail = chunk_levels(post, self.cfg.sustain_chunks)[-1]
        if tail < base * (1.0 + self.cfg.min_slowdown):
            return
        j = c + best_split(post, base, tail)
        if c < j < c + len(post):
            self._pending.setdefault(j, 0)

    def _sliding_recovery(self, i: int) -> FailSlowEvent | None:
        ev = self._open
        assert ev is not None
        start = i - self.cfg.min_duration + 1
        if start <= ev.onset:
            return None
        if is_recovered(ev.baseline, self._window(start, i + 1), self.cfg, self._level_before(start)):
            lo = max(ev.onset + 1, start - self.cfg.min_duration, self._hist0)
            span = self._window(lo, i + 1)
            end = lo + best_split(span, ev.baseline * ev.slowdown, ev.baseline)
            return self._close(min(end, start + self.cfg.min_duration // 2), i)
        return None

    def _level_before(self, c: int) -> float | None:
        """Median of the min_duration iterations before c, inside the open event."""
        ev = self._open
        lo = max(c - self.cfg.min_duration, self._hist0, ev.onset if ev else 0)
        return median(self._window(lo, c)) if c - lo >= self.cfg.sustain_chunks else None

    def _close(self, end: int, i: int) -> FailSlowEvent:
        ev = self._open
        assert ev is not None
        closed = self._book.update(ev.with_(end=end, ended_at=i))
        self._open = None
        self._healthy_from = end
        self._pending = {c: k for c, k in self._pending.items() if c >= end}
        return closed

    def _trim(self) -> None:
        if len(self._hist) > 2 * self._keep:
            drop = len(self._hist) - self._keep
            del self._hist[:drop]
            self._hist0 += drop
