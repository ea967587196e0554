"""The fast path's rank side (detect/steps.py): a run of iterations whose compute stepped up
against the rank's own level."""

from __future__ import annotations

import math

import pytest

from falconext.detect.steps import ComputeStep


def runs(step: ComputeStep, readings: list[float]) -> list[int]:
    return [step.feed(x) for x in readings]


def test_a_step_up_counts_a_run_from_its_first_slow_iteration():
    step = ComputeStep(1.15, baseline=16, warm=8)
    level = [1.0, 1.02, 0.98, 1.01, 0.99, 1.0, 1.03, 0.97]
    assert runs(step, level) == [0] * 8 and step.level() == pytest.approx(1.0, abs=0.01)
    assert runs(step, [2.0, 2.01, 1.99, 2.0]) == [1, 2, 3, 4]
    assert step.run_ratio() == pytest.approx(2.0, rel=0.01)


def test_stalls_of_one_to_three_iterations_end_their_run_and_leave_the_level_alone():
    step = ComputeStep(1.15, baseline=16, warm=8)
    runs(step, [1.0] * 8)
    for stall in (1, 2, 3):
        got = runs(step, [3.0] * stall + [1.0])
        assert got == list(range(1, stall + 1)) + [0]
        assert step.level() == 1.0 and step.run == 0 and step.run_ratio() == 1.0


def test_nothing_is_judged_while_warming_up_and_a_mild_rise_is_no_run():
    step = ComputeStep(1.15, baseline=16, warm=8)
    assert runs(step, [1.0] * 7 + [5.0]) == [0] * 8  # the eighth reading still warms up
    step = ComputeStep(1.15, baseline=16, warm=8)
    assert runs(step, [1.0] * 8 + [1.1] * 20) == [0] * 28  # 10% up: under the ratio


def test_a_run_that_lasts_becomes_the_level_and_a_reset_relearns_it():
    step = ComputeStep(1.15, baseline=16, warm=8, rebase=10)
    runs(step, [1.0] * 16)
    got = runs(step, [2.0] * 12)
    assert got[:9] == list(range(1, 10)) and got[9] == 0 and got[10:] == [0, 0]
    # the level now holds the slow readings (ten of 16); a further step counts again
    assert step.level() == 2.0
    step.reset()
    assert step.level() is None and runs(step, [3.0] * 8) == [0] * 8 and step.level() == 3.0


def test_on_a_noisy_rank_a_step_must_clear_the_noise_not_just_the_ratio():
    """A rank whose compute reads about 9% apart from one iteration to the next (the test
    bed's 16 ranks on two cores): four readings at 1.2x its level are no run (its line is
    three robust standard deviations up, about 1.31x); on a rank reading 1% apart they are,
    and a 1.4x step clears both."""
    noisy = [1.0, 1.1, 0.9, 1.05, 0.95, 1.12, 0.88, 1.0, 1.08, 0.92, 1.03, 0.97, 1.1, 0.9, 1.0, 1.06]
    quiet = [1.0 + (x - 1.0) / 9 for x in noisy]
    step = ComputeStep(1.15, baseline=16, warm=8)
    runs(step, noisy)
    assert step.line() == pytest.approx(1.0 + 3 * 1.4826 * 0.07, rel=0.01)
    assert runs(step, [1.2] * 4) == [0] * 4
    step = ComputeStep(1.15, baseline=16, warm=8)
    runs(step, noisy)
    assert runs(step, [1.4] * 4) == [1, 2, 3, 4]
    step = ComputeStep(1.15, baseline=16, warm=8)
    runs(step, quiet)
    assert step.line() == pytest.approx(1.15, rel=0.01)
    assert runs(step, [1.2] * 4) == [1, 2, 3, 4]
    step = ComputeStep(1.15, baseline=16, warm=8, noise=0.0)
    runs(step, noisy)
    assert runs(step, [1.2] * 4) == [1, 2, 3, 4]


def test_readings_that_are_not_finite_or_negative_are_ignored():
    step = ComputeStep(1.15, baseline=16, warm=8)
    runs(step, [1.0] * 8)
    assert runs(step, [2.0, math.nan, -1.0, math.inf, 2.0]) == [1, 1, 1, 1, 2]


@pytest.mark.parametrize("kwargs", [dict(ratio=1.0), dict(ratio=1.2, warm=0), dict(ratio=1.2, warm=20, baseline=16),
                                    dict(ratio=1.2, rebase=0), dict(ratio=1.2, noise=-1.0),
                                    dict(ratio=1.2, noise=math.nan)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        ComputeStep(**kwargs)


def test_the_summary_counts_suspicions_by_path_and_those_validation_did_not_confirm():
    """summary.json's detection side: each ``straggler_suspected`` by the path that named it,
    and the ones whose localization named someone else or nothing (a suspension each)."""
    from falconext.report.summary import suspicion_figures

    events = [
        {"type": "straggler_suspected", "rank": 2, "by": "fast"},
        {"type": "localized", "gpus": [], "links": []},  # cleared: a stall, not a GPU
        {"type": "straggler_suspected", "rank": 2, "by": "fast"},
        {"type": "localized", "gpus": [2], "links": []},
        {"type": "straggler_suspected", "rank": 1},  # the score trigger, no verdict after it
    ]
    assert suspicion_figures(events) == {"count": 3, "by": {"fast": 2, "scores": 1}, "not_confirmed": 2}
    assert suspicion_figures([]) == {"count": 0, "by": {}, "not_confirmed": 0}
