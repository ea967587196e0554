"""BOCD plus verification (BOCD+V): the fail-slow detector of Falcon-Detect.

BOCD proposes change points; most of them are jitter (spikes, bursts, periodic
fluctuation, drift). Verification turns a candidate into a fail-slow only when the
iterations since it form a sustained *slow run* (:func:`trailing_run`), judged every
iteration while the candidate is recent:

- the run is the latest stretch of iterations all at least ``min_slowdown`` (10%) over
  the healthy baseline (the median of the healthy iterations before the candidate);
- its duration counts the iterations from its first to its last one *at its level*
  (near the median of its newer half, nearer to it than to healthy, and clear of healthy
  noise); iterations before those count only the fraction of the way they rose (a ramp),
  or in full when over the level but nearer to it than to its square (a slower start),
  and a spike or a noisy neighbour at either end counts nothing;
- it is confirmed once its duration reaches ``run_needed``: ``min_duration`` iterations
  (11; generated healthy bursts last up to 10) for a step up to ``fast_confirm_floor``
  (1.5x, and bursts reach 1.8x), and fewer for a larger clean step, as evidence
  ``duration * ln(level / 1.5) >= fast_confirm_evidence`` grows with both size and
  duration (a 2x step: 9 iterations; 2.5x: the floor of 7).

So the size of a step buys speed only where no healthy burst reaches, and the duration
needed is the burst's plus one, with both ends of the run checked so that a burst
extended by one noisy or spiky neighbour is not one iteration longer. A noisy candidate
that never shows such a run but is slow overall is checked again on two, three and four
times ``min_duration`` windows split into ``sustain_chunks`` chunks, at least half of
each chunk slow (larger chunks, where no burst can fill every one) before it is dropped.
Levels are (lower) medians: one checkpoint-save spike must not turn jitter into an
event, nor hide one.

An open event ends when the level is back within ``recovery_margin`` of the baseline
for a whole window, found either from a BOCD change point or, so an event can never stay
open because BOCD missed the relief, from the latest window itself. A sustained further
rise (a ladder-shaped fail-slow) raises the event's ``slowdown`` instead of opening a
second event.

Cost per iteration: one BOCD update (O(bocd_max_run_length)) plus, while a candidate is
watched, one pass over at most ``run_watch_factor * min_duration`` iterations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from falconext.config import DetectConfig, FalconConfig, detect_config
from falconext.detect.bocd import BOCD
from falconext.detect.events import EventBook, FailSlowEvent, check_sample
from falconext.medians import low_median, median


# -- pure checks over plain windows -------------------------------------------------------
def chunk_levels(post: Sequence[float], chunks: int, low: bool = False) -> list[float]:
    """Median of each of ``chunks`` consecutive, near-equal parts of the window.

    ``low``: the lower median (the middle value of an odd chunk, the lower of the two of
    an even one), so "the chunk is over the line" means at least half of its iterations
    are; the plain median of an even chunk averages a spike with a healthy iteration.
    """
    n = len(post)
    bounds = [round(i * n / chunks) for i in range(chunks + 1)]
    pick = low_median if low else median
    return [pick(post[bounds[i] : bounds[i + 1]]) for i in range(chunks) if bounds[i + 1] > bounds[i]]


def slow_level(baseline: float, post: Sequence[float], cfg: DetectConfig) -> float | None:
    """The sustained slowdown (post level / baseline) if the window is a fail-slow, else None.

    Sustained: at least half of the iterations of each of ``sustain_chunks`` chunks are
    ``min_slowdown`` over the baseline, so a burst that ends inside the window, or spikes
    at its ends, cannot pass for a fail-slow.
    """
    level = median(post) / baseline
    if level < 1.0 + cfg.min_slowdown:
        return None
    floor = baseline * (1.0 + cfg.min_slowdown)
    if min(chunk_levels(post, cfg.sustain_chunks, low=True)) < floor:
        return None
    return level


@dataclass(frozen=True)
class SlowRun:
    """The slow run a window ends with (see :func:`trailing_run`)."""

    offset: int  #: index in the window of its first counted iteration (a ramp's first)
    weight: float  #: its duration: iterations at its level, plus part credit (see there)
    level: float  #: median / baseline
    spread: float  #: robust standard deviation of its iterations' logs around the level


def run_needed(run: SlowRun, cfg: DetectConfig) -> int:
    """Duration (in iterations at its level) a slow run needs to be confirmed.

    Evidence grows with both size and duration, as in a sequential test: ``w``
    iterations at level ``L`` (slow/healthy) weigh ``w * ln(L / fast_confirm_floor)``,
    and the run is confirmed once that reaches ``fast_confirm_evidence``, or after
    ``min_duration`` iterations whatever its size. With the defaults, 10 iterations at
    up to ~1.9x (the largest healthy burst, 1.8x, plus noise) stay short of the
    evidence, a 2x step needs 9 and a 2.5x step the floor, ``min_duration_fast`` (7:
    longer than two adjoining spikes). Only a clean step is confirmed early: its level
    at least ``fast_confirm_snr`` robust standard deviations of its own iterations above
    healthy, which a burst with spikes glued to it is not.
    """
    level = run.level
    if level <= cfg.fast_confirm_floor or cfg.fast_confirm_snr * run.spread > math.log(level):
        return cfg.min_duration
    need = math.ceil(cfg.fast_confirm_evidence / math.log(level / cfg.fast_confirm_floor) - 1e-9)
    return min(cfg.min_duration, max(cfg.min_duration_fast, need))


def trailing_run(
    window: Sequence[float], baseline: float, cfg: DetectConfig, healthy_spread: float = 0.0
) -> SlowRun | None:
    """The slow run that ``window`` ends with, or None if the window does not end slow.

    The run is the longest suffix of the window over the 10% line (``min_slowdown``). Its
    level ``L`` is where it is now: the (lower) median of its newer half, over the
    baseline, so a ramp or a spike cluster before a burst does not set it. An iteration
    is *at the level* when it is within ``run_band_sigmas`` robust standard deviations of
    ``L`` in log terms (the newer half's own spread, at least ``run_band_floor``), never
    nearer to healthy or to ``L**2`` than to ``L``, and clear of healthy noise: over the
    baseline by ``run_band_sigmas`` x ``healthy_spread`` (the healthy iterations' robust
    log standard deviation).

    The run's duration (``weight``) is the span from its first to its last iteration at
    the level, everything in between included (a spike or a dip inside a fail-slow is
    the fail-slow), plus, for each earlier iteration clear of healthy noise and not over
    the level, the fraction of the way it rose, ``ln(x) / ln(L)`` (a congestion ramp),
    and for each earlier iteration over the level but nearer to ``L`` than to ``L**2``, one
    (a fault whose first iterations run slower than it settles). A spike (nearer to
    ``L**2``) or a noisy iteration glued to either end of a healthy burst therefore never
    makes the burst count one iteration longer, unless it is itself at the burst's level.
    """
    line = baseline * (1.0 + cfg.min_slowdown)
    start = len(window)
    while start > 0 and window[start - 1] >= line:
        start -= 1
    if start == len(window):
        return None
    logs = [math.log(v) for v in window[start:]]
    # lower medians: the plain median of an even count averages a spike with the level
    recent = logs[len(logs) // 2 :]
    centre = low_median(recent)
    spread = max(cfg.run_band_floor, 1.4826 * low_median([abs(v - centre) for v in recent]))
    lb = math.log(baseline)
    step = centre - lb  # ln(L) > 0: every iteration of the run is over the line
    width = min(cfg.run_band_sigmas * spread, 0.5 * step)
    top, bottom = centre + width, max(centre - width, lb + cfg.run_band_sigmas * healthy_spread)
    at_level = [k for k, v in enumerate(logs) if bottom <= v <= top]
    if not at_level:
        return None
    first, last = at_level[0], at_level[-1]
    clear = lb + cfg.run_band_sigmas * healthy_spread
    weight = float(last - first + 1)
    onset = first
    nearer = centre + 0.5 * step  # over it: nearer to L**2 than to L
    for k, v in enumerate(logs[:first]):
        if clear <= v <= top:
            weight += min(1.0, (v - lb) / step)
            onset = min(onset, k)
        elif top < v <= nearer:  # a slower start of the run (a spike is nearer to L**2)
            weight += 1.0
            onset = min(onset, k)
    return SlowRun(start + onset, weight, math.exp(step), spread)


def log_spread(values: Sequence[float], centre: float | None = None) -> float:
    """Robust standard deviation of log(values) around ``centre`` (their median if None):
    1.4826 x the median absolute deviation, which is sigma for normal noise."""
    logs = [math.log(v) for v in values]
    if centre is None:
        centre = median(logs)
    return 1.4826 * median([abs(v - centre) for v in logs])


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


def is_recovered(baseline: float, post: Sequence[float], cfg: DetectConfig, before: float | None = None) -> bool:
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
@dataclass(frozen=True)
class _Watch:
    """The stretch around recent BOCD candidates, checked every iteration for a slow run."""

    first: int  #: first index of the stretch (a little before the first candidate)
    until: int  #: last iteration to watch it
    baseline: float  #: median of the healthy iterations before it
    spread: float  #: their robust log standard deviation
    samples: list[float]  #: those healthy iterations


class VerifiedBOCD:
    """BOCD+V, online. Feed iteration times; get events when confirmed, raised or ended."""

    name = "bocd+v"
    #: a candidate whose first window is slow overall but not sustained is checked again
    #: on a window this many times longer, at most (noisy communication fail-slows)
    retries = 3

    def __init__(self, config: FalconConfig | DetectConfig | None = None) -> None:
        self.cfg = detect_config(config)
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
        # the stretch around recent candidates watched every iteration for a slow run:
        self._watch: _Watch | None = None

    @property
    def events(self) -> list[FailSlowEvent]:
        """Every event so far, latest state, in onset order."""
        return self._book.all

    @property
    def open_event(self) -> FailSlowEvent | None:
        """The fail-slow in progress (confirmed, not yet ended), or None."""
        return self._open

    def feed(self, value: float) -> list[FailSlowEvent]:
        """Absorb one iteration time; return the events it confirmed, escalated or ended (often
        none). A BOCD change point becomes an event only once verification confirms a
        sustained slowdown. Raises InvalidSample for a value that is not a finite positive
        number."""
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
                if self._open is None:
                    self._watch_from(start, i)

        if self._open is None and self._watch is not None:
            ev = self._check_run(i)
            if ev is not None:
                changed.append(ev)

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

    def _watch_from(self, c: int, i: int) -> None:
        """Watch the iterations from just before candidate ``c`` for a sustained slow run."""
        cfg = self.cfg
        until = c + cfg.run_watch_factor * cfg.min_duration - 1
        # BOCD's start may be late (a slow ramp) or early (a spike): look a little back,
        # and take the baseline from before that, unless too few iterations precede it
        # (a fail-slow soon after the series began): then from before the candidate
        lo = max(c - cfg.bocd_recent_window, self._healthy_from, self._hist0)
        pre = self._healthy_before(lo)
        if len(pre) < cfg.min_baseline:
            pre = self._healthy_before(c)
        w = self._watch
        if w is not None and i <= w.until:
            # the same stretch: keep the baseline from before its first candidate (a
            # ramp's later candidates see the ramp before them), unless this one's is
            # faster: the first candidate was the end of a burst, whose baseline is the
            # burst's own level
            base = median(pre) if len(pre) >= cfg.min_baseline else w.baseline
            if base < w.baseline:
                w = _Watch(lo, w.until, base, log_spread(pre), pre)
            self._watch = replace(w, until=max(until, w.until))
            return
        if len(pre) < cfg.min_baseline:
            return
        self._watch = _Watch(lo, until, median(pre), log_spread(pre), pre)

    def _check_run(self, i: int) -> FailSlowEvent | None:
        """Confirm a fail-slow when the watched stretch ends with a long enough slow run."""
        w = self._watch
        assert w is not None
        cfg = self.cfg
        if i > w.until:
            self._watch = None
            return None
        # bounded: a run longer than this has been confirmed (or rejected) already
        lo = max(w.first, i - cfg.run_watch_factor * cfg.min_duration + 1)
        run = trailing_run(self._window(lo, i + 1), w.baseline, cfg, w.spread)
        if run is None or run.weight < run_needed(run, cfg):
            return None
        self._watch = None
        self._prev_healthy = w.samples
        self._open = self._book.open(lo + run.offset, i, run.level, w.baseline)
        return self._open

    def _check_candidate(self, c: int, checked: int, i: int) -> FailSlowEvent | None:
        cfg = self.cfg
        post = self._window(c, i + 1)
        if self._open is None:
            pre = self._healthy_before(c)
            if len(pre) < cfg.min_baseline:
                return None
            base = median(pre)
            # the first window is the slow run's (watched every iteration); chunk medians
            # judge only the longer windows of noisy candidates, where a burst cannot fill
            # every chunk
            level = slow_level(base, post, cfg) if checked > 0 else None
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
