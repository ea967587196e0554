"""False alarms per job-day: the rank side's whole detection run offline over healthy days.

Each rank's calls of a generated healthy day (sim/jobday.py) go through what a rank runs
(detect/tracking.py: the iteration tracker and BOCD+V; detect/scores.py's BusyClock for
the compute split; detect/steps.py's ComputeStep), and the ranks' fast-path readings are
compared across peers as the controller does (:func:`~falconext.detect.steps.stepped_alone`,
once per iteration: what a heartbeat a second would show). Every alarm on a healthy day
is false. Counted per detector (``bocd+v``: a rank's confirmed fail-slow; ``fast``: the
fast path naming a rank) and for the whole (alarms of any detector and rank within one
``episode_timeout_s`` of the first are one alarm, as the controller holds them in one
episode), each per day of the day's own length.
"""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from falconext.config import FalconConfig
from falconext.detect.scores import BusyClock, split_iteration
from falconext.detect.steps import ComputeStep, stepped_alone
from falconext.detect.tracking import RankTracking
from falconext.sim.jobday import JobDaySpec, generate_day

DAY_S = 86_400.0


@dataclass(frozen=True)
class RankPass:
    """One rank's detection over its day: per estimated iteration, when it ended and the fast
    path's (run, ratio) after it; the times of its BOCD+V alarms (first sightings)."""

    rank: int
    t_end: np.ndarray
    run: np.ndarray
    ratio: np.ndarray
    alarms: tuple[float, ...]
    estimates: int


@dataclass(frozen=True)
class DayResult:
    """False alarms on one healthy day: times of each detector's, the whole's, and the day's
    length (seconds) and iterations."""

    seed: int
    seconds: float
    iterations: int
    alarms: dict[str, tuple[float, ...]]
    whole: tuple[float, ...]
    estimates: int

    def per_day(self) -> dict[str, float]:
        """Each detector's false alarms, and the whole's, per 86,400 s."""
        days = self.seconds / DAY_S
        out = {name: len(times) / days for name, times in self.alarms.items()}
        out["whole"] = len(self.whole) / days
        return out


def rank_pass(spec: JobDaySpec, seed: int, rank: int, cfg: FalconConfig) -> RankPass:
    """Rank ``rank``'s calls of day ``seed`` through its tracker, BOCD+V and fast-path step
    counter, each started over where the rank's process is (as a restarted rank's are)."""
    day = generate_day(spec, seed)
    tracking, busy = RankTracking(cfg), BusyClock()
    step = ComputeStep.from_config(cfg, ratio=cfg.fast_ratio or 1.15)
    t_end: list[float] = []
    run: list[int] = []
    ratio: list[float] = []
    alarms: list[float] = []
    seen: set[tuple[int, int]] = set()
    for rec in day.records(rank):
        if rec is None:
            tracking, busy = RankTracking(cfg), BusyClock()
            step.reset()
            continue
        busy.feed(rec.t_issue, rec.t_end)
        update = tracking.feed(rec)
        if update.retract:
            step.reset()
        for it in update.inserted:  # one iteration of work, though not an estimate
            compute, _ = split_iteration(it.duration, busy.busy(it.t_begin, it.t_end))
            run.append(step.feed(compute))
            ratio.append(step.recent_ratio())
            t_end.append(it.t_end)
        for _, it in update.iterations:
            compute, _ = split_iteration(it.duration, busy.busy(it.t_begin, it.t_end))
            run.append(step.feed(compute))
            ratio.append(step.recent_ratio())
            t_end.append(it.t_end)
        for ev in update.events:
            if (tracking.restarts, ev.id) not in seen:  # a first sighting: the alarm
                seen.add((tracking.restarts, ev.id))
                alarms.append(update.iterations[-1][1].t_end if update.iterations else rec.t_issue)
    return RankPass(rank, np.array(t_end), np.array(run, dtype=np.int64), np.array(ratio), tuple(alarms), len(t_end))


def fast_alarms(day_starts: np.ndarray, passes: list[RankPass], cfg: FalconConfig) -> list[float]:
    """The fast path's alarms over the ranks' passes: at each iteration's start, every
    rank's latest reading (a heartbeat's), judged by :func:`stepped_alone`; a rank named
    once until its run ends."""
    if not cfg.fast_ratio:
        return []
    at = np.stack([np.searchsorted(p.t_end, day_starts, side="right") - 1 for p in passes], axis=1)
    runs = np.zeros(at.shape, dtype=np.int64)
    ratios = np.ones(at.shape)
    for k, p in enumerate(passes):
        ok = at[:, k] >= 0
        runs[ok, k] = p.run[at[ok, k]]
        ratios[ok, k] = p.ratio[at[ok, k]]
    acted: set[int] = set()
    out: list[float] = []
    for i in np.flatnonzero(runs.max(axis=1) >= cfg.fast_iterations).tolist() + [None]:
        if i is None:
            break
        acted = {r for r in acted if runs[i, r] > 0}
        known = at[i] >= 0
        for r in stepped_alone(runs[i], ratios[i], known, cfg.fast_iterations, cfg.fast_ratio):
            if r not in acted:
                acted.add(r)
                out.append(float(day_starts[i]))
                break
    return out


def merge(times: list[float], window_s: float) -> tuple[float, ...]:
    """``times`` sorted, each within ``window_s`` of the last kept one dropped: alarms the
    controller would hold in one episode."""
    kept: list[float] = []
    for t in sorted(times):
        if not kept or t - kept[-1] > window_s:
            kept.append(t)
    return tuple(kept)


def run_day(spec: JobDaySpec, seed: int, cfg: FalconConfig | None = None, jobs: int = 1) -> DayResult:
    """Day ``seed`` of ``spec``: every rank's pass (``jobs`` worker processes), the fast path
    across them, and the false alarms of each detector and of the whole."""
    cfg = cfg or FalconConfig()
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            passes = list(pool.map(rank_pass, [spec] * spec.ranks, [seed] * spec.ranks, range(spec.ranks),
                                   [cfg] * spec.ranks))
    else:
        passes = [rank_pass(spec, seed, r, cfg) for r in range(spec.ranks)]
    day = generate_day(spec, seed)
    bocd = merge([t for p in passes for t in p.alarms], cfg.episode_timeout_s)
    fast = tuple(fast_alarms(day.starts[:-1], passes, cfg))
    whole = merge([*bocd, *fast], cfg.episode_timeout_s)
    return DayResult(seed, day.seconds, spec.iterations, {"bocd+v": bocd, "fast": fast}, whole,
                     min(p.estimates for p in passes))


__all__ = ["DAY_S", "DayResult", "RankPass", "fast_alarms", "merge", "rank_pass", "run_day"]
