"""Acceptance: a straggler in a generated Megatron-like call log is found by the tracker
and BOCD+V together (detect/tracking.py), in iterations of the job, not of the series."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from falconext.detect.tracking import RankTracking
from falconext.sim.calllog import CallLog, CallSpec, Slowdown, dist_opt_spec, dp_only_spec, generate, tp_pp_spec

#: Megatron-LM's --log-interval timer all-gather
LOG_ALL_GATHER = (CallSpec("all_gather", "world", 64, 0.001),)
ONSET = 150


def straggler_log(base: str, factor: float | None) -> CallLog:
    """The log of test_itertime's log-interval test (an all-gather every 10 and every 100
    iterations, an evaluation every 50), with rank 1's compute ``factor`` x slower from
    iteration ONSET on (None: healthy). ``base``: "tp_pp", "dp" (four gradient buckets) or
    "distopt<k>" (the distributed optimizer's k calls per iteration)."""
    if base == "tp_pp":
        spec = tp_pp_spec(iterations=260, tp=2, pp=2, micro_batches=4)
    elif base.startswith("distopt"):
        spec = dist_opt_spec(iterations=260, calls=int(base[len("distopt"):]))
    else:
        spec = dp_only_spec(iterations=260)
    slow = () if factor is None else (Slowdown(ONSET, 260, factor, (1,)),)
    spec = replace(spec, extra_every=((10, LOG_ALL_GATHER), (100, LOG_ALL_GATHER)), eval_every=50, slowdowns=slow)
    return generate(spec, 11)


def track(log: CallLog, rank: int) -> list[tuple[int, int, int | None]]:
    """Every event the rank's tracking confirmed: (true onset iteration, true iteration
    at confirmation, series end), mapping series indices back to job iterations."""
    tracking = RankTracking()
    true_of: dict[int, int] = {}
    found = []
    for record in log.rank_records(rank):
        update = tracking.feed(record)
        assert not update.restarted  # one period from the start: one series
        for index, it in update.iterations:
            if index is not None:
                true_of[index] = log.iteration_at(rank, it.t_begin)
        for ev in update.events:
            if ev.end is None and ev.detected_at == tracking.series - 1:  # confirmed now
                found.append((true_of[ev.onset], true_of[ev.detected_at], ev.end))
    return found


BASES = ["tp_pp", "dp", "distopt2", "distopt3", "distopt4"]


@pytest.mark.parametrize("base", BASES)
def test_a_2x_straggler_is_detected_within_12_iterations_on_every_rank(base: str) -> None:
    log = straggler_log(base, 2.0)
    # the job's iterations are ~1.9x slower: rank 1's compute doubled, the rest wait for it
    durations = log.durations[0]
    assert np.median(durations[ONSET:]) / np.median(durations[60:ONSET]) > 1.8
    for rank in sorted(log.spec.patterns):
        found = track(log, rank)
        assert len(found) == 1, (rank, found)  # no event from the log-interval calls or evaluations
        onset, confirmed, _ = found[0]
        assert abs(onset - ONSET) <= 1, (rank, found)
        assert 0 < confirmed - ONSET <= 12, (rank, found)


@pytest.mark.parametrize("base", BASES)
def test_the_healthy_log_raises_no_event(base: str) -> None:
    log = straggler_log(base, None)
    for rank in sorted(log.spec.patterns):
        assert track(log, rank) == [], rank
