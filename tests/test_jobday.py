"""False alarms per job-day (detect/jobday.py over sim/jobday.py's healthy days): the rank
side's whole detection, offline. The day-long counts are the benchmark's
(`falconext eval-detect --job-day`); these hold that the evaluation sees what it counts."""

from __future__ import annotations

import numpy as np
import pytest

from falconext.config import FalconConfig
from falconext.detect.jobday import merge, run_day
from falconext.sim.jobday import JobDaySpec, generate_day

#: stalls and bursts every few hundred iterations: a short day holds several of each
NOISY = dict(ranks=4, iterations=3000, restart_at=1500, burst_every=300.0, stall_every=300.0, checkpoint_every=500,
             eval_every=700)


def test_a_noisy_healthy_day_raises_nothing():
    """Bursts on every rank, stalls of 1-3 iterations on one, checkpoints, evaluations,
    timer calls and a restart: no detector names anything."""
    spec = JobDaySpec(**NOISY)
    day = generate_day(spec, 7)
    assert len(day.stalls) >= 4 and len(day.bursts) >= 4 and day.restarts == (1500,)
    result = run_day(spec, 7)
    assert result.alarms == {"bocd+v": (), "fast": ()} and result.whole == ()
    assert result.estimates > 0.8 * spec.iterations  # every rank's tracker followed the day


@pytest.mark.parametrize("factor", [1.25, 2.0])
def test_a_slow_gpu_on_the_same_day_is_named_by_the_fast_path_first(factor):
    """The same day with rank 3 slower from iteration 2000: the fast path names it within
    fast_iterations + 2 iterations, BOCD+V later; each once (one alarm of the whole)."""
    cfg = FalconConfig()
    spec = JobDaySpec(**{**NOISY, "fault": (3, factor, 2000)})
    day = generate_day(spec, 7)
    result = run_day(spec, 7, cfg)
    (fast,) = result.alarms["fast"]
    (bocd,) = result.alarms["bocd+v"]
    at = lambda t: int(np.searchsorted(day.starts, t, side="right")) - 1  # noqa: E731
    assert 2000 + cfg.fast_iterations <= at(fast) <= 2000 + cfg.fast_iterations + 2
    assert at(fast) < at(bocd)
    assert len(result.whole) == 1


def test_the_fast_path_off_counts_no_fast_alarm():
    spec = JobDaySpec(**{**NOISY, "fault": (3, 2.0, 2000)})
    result = run_day(spec, 7, FalconConfig(fast_ratio=0.0))
    assert result.alarms["fast"] == () and len(result.alarms["bocd+v"]) == 1


def test_alarms_within_an_episode_are_one():
    assert merge([5.0, 1.0, 30.0, 100.0, 62.0], 60.0) == (1.0, 62.0)
