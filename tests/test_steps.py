"""The fast path's rank side (detect/steps.py): a run of iterations whose compute stepped up
against the rank's own level."""

from __future__ import annotations

import math

import pytest

import numpy as np

from falconext.detect.steps import ComputeStep, judged_at, stepped_alone


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


def test_a_drifting_rank_s_level_follows_it():
    """A job's first iterations drifting up 40% (rank 0's compute on core_v0.19.0,
    2026-12-03): readings that cross the line now and then join the level when their run
    breaks, so the level follows (1.15 at the end, the drift's own level) and later
    readings are no run; dropped, they left the level at 1.04 and runs of up to 6."""
    drift = [0.914, 0.942, 0.889, 0.94, 0.881, 0.93, 0.937, 0.999, 1.139, 1.092, 1.058, 1.394, 1.146, 1.334, 1.288,
             1.336, 3.043, 1.063, 1.163, 1.106, 1.197, 1.084, 1.198, 1.068, 1.31, 1.178, 1.029, 1.085, 1.128, 0.988,
             1.243]
    step = ComputeStep(1.15, baseline=16, warm=8)
    got = runs(step, drift)
    assert max(got) == 4 and got[17:] == [0] * (len(drift) - 17)
    assert step.level() == pytest.approx(1.145, abs=0.01) and step.recent_ratio() < 1.0


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


def test_the_recent_ratio_shows_a_lift_that_broke_its_run():
    """A rank lifted unevenly by a burst (1.25x, 1.1x, 1.3x, 1.2x: its run breaks at the
    second) reads no run but a recent ratio of about 1.22; a rank at level reads 1.0, and
    one in a 2x run reads 2."""
    step = ComputeStep(1.15, baseline=16, warm=8, recent=4)
    assert step.recent_ratio() == 1.0
    runs(step, [1.0] * 8)
    assert step.recent_ratio() == 1.0
    assert runs(step, [1.25, 1.1, 1.3, 1.2]) == [1, 0, 1, 2]
    assert step.recent_ratio() == pytest.approx(1.225, rel=0.01)
    runs(step, [2.0] * 4)
    assert step.run == 6 and step.recent_ratio() == pytest.approx(2.0 / step.level(), rel=0.01)
    step.reset()
    assert step.recent_ratio() == 1.0


def test_stepped_alone_names_a_rank_whose_step_the_rest_of_the_job_does_not_share():
    """Rank 2 in a run at 1.3x while the others read level: named. The same run during a
    burst that lifts the others unevenly (their runs broken, recent ratios 1.15-1.25): not
    named, though two of them read under the line. Nor is a 2x GPU during that burst (the
    others are lifted: nothing stands out until the job is calm again). Two ranks of a
    loaded host read 1.37x and 1.18x: none. A run too short, a rank alone, a rank without
    a reading: none."""
    known = np.ones(4, dtype=bool)
    run = np.array([0, 0, 4, 0])
    assert stepped_alone(run, np.array([1.0, 1.02, 1.3, 0.99]), known, 4, 1.15) == [2]
    burst = np.array([1.15, 1.25, 1.3, 1.18])
    assert stepped_alone(run, burst, known, 4, 1.15) == []
    assert stepped_alone(run, np.array([1.15, 1.25, 2.0, 1.18]), known, 4, 1.15) == []
    assert stepped_alone(run, np.array([1.03, 1.05, 2.0, 0.98]), known, 4, 1.15) == [2]
    assert stepped_alone(np.array([4, 0]), np.array([1.37, 1.18]), np.ones(2, dtype=bool), 4, 1.15) == []
    assert stepped_alone(np.array([0, 0, 3, 0]), np.array([1.0, 1.0, 1.3, 1.0]), known, 4, 1.15) == []
    assert stepped_alone(run[2:3], np.array([1.3]), known[2:3], 4, 1.15) == []
    assert stepped_alone(run, np.array([1.0, 1.3, 1.3, 1.3]), np.array([True, False, True, False]), 4, 1.15) == [2]
    # two in runs among 20, the steeper first (each is judged against the others, the other
    # one among them); among five, one in five is lifted: the job is not calm, nobody named
    run20, ratio20 = np.zeros(20, dtype=int), np.ones(20)
    run20[[0, 2]], ratio20[[0, 2]] = 4, (1.4, 2.0)
    assert stepped_alone(run20, ratio20, np.ones(20, dtype=bool), 4, 1.15) == [2, 0]
    assert stepped_alone(np.array([4, 0, 4, 0, 0]), np.array([1.4, 1.0, 2.0, 1.0, 1.0]),
                         np.ones(5, dtype=bool), 4, 1.15) == []
    # a rank that had read flat rose 1.30x while the three others rose 1.06-1.08x (the
    # link job on four one-rank nodes, CI 2026-12-03): not calm, nobody named
    assert stepped_alone(np.array([0, 0, 0, 4]), np.array([1.057, 1.084, 1.062, 1.30]),
                         np.ones(4, dtype=bool), 4, 1.15) == []


def test_a_run_is_judged_where_half_the_others_readings_reached():
    """A run that became four long at iteration 33 (latest 35) is judged at 35 when half
    the others read that far, at 34 when half read only that far, and not yet while half
    have not reached 33; with no others, never."""
    assert judged_at(35, 6, 4, np.array([35, 36, 34])) == 35
    assert judged_at(35, 6, 4, np.array([34, 34, 36, 33])) == 34
    assert judged_at(35, 6, 4, np.array([32, 36, 32])) is None
    assert judged_at(33, 4, 4, np.array([33])) == 33
    assert judged_at(33, 4, 4, np.array([], dtype=np.int64)) is None


def test_readings_that_are_not_finite_or_negative_are_ignored():
    step = ComputeStep(1.15, baseline=16, warm=8)
    runs(step, [1.0] * 8)
    assert runs(step, [2.0, math.nan, -1.0, math.inf, 2.0]) == [1, 1, 1, 1, 2]


@pytest.mark.parametrize("kwargs", [dict(ratio=1.0), dict(ratio=1.2, warm=0), dict(ratio=1.2, warm=20, baseline=16),
                                    dict(ratio=1.2, rebase=0), dict(ratio=1.2, noise=-1.0),
                                    dict(ratio=1.2, noise=math.nan), dict(ratio=1.2, recent=0)])
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
