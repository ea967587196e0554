"""BOCD, verification and the baselines on synthetic iteration-time series."""

from __future__ import annotations

import math

import numpy as np
import pytest

from falconext.config import ConfigError, FalconConfig
from falconext.detect import METHODS, InvalidSample, UnknownMethod, detect, make_detector
from falconext.detect.bocd import BOCD
from falconext.detect.evaluate import score_trace, summarize
from falconext.detect.verify import (
    SlowRun,
    VerifiedBOCD,
    best_split,
    chunk_levels,
    is_recovered,
    run_needed,
    slow_level,
    trailing_run,
)
from falconext.sim.traces import generate_traces


def healthy(n: int, seed: int = 0, sigma: float = 0.02, base: float = 0.5) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return base * np.exp(rng.normal(0.0, sigma, n))


# -- BOCD ---------------------------------------------------------------------------------
def test_bocd_changepoint_mass_is_constant_hazard_and_recent_mass_moves():
    """The pitfall: P(r=0) is H at every step; our signal is near 0 when stable, ~1 after a change."""
    h = 1 / 250
    b = BOCD(hazard=h)
    x = healthy(400)
    x[300:] *= 1.3
    signal = []
    for v in x:
        b.update(v)
        assert math.isclose(b.run_length_posterior[0], h, rel_tol=1e-9)
        signal.append(b.recent_mass(15))
    assert max(signal[50:299]) < 0.9  # stable stretch: never fires
    assert max(signal[300:310]) > 0.9  # within ten iterations of the change it does
    fired = next(i for i in range(300, 400) if signal[i] > 0.9)
    b2 = BOCD(hazard=h)
    for v in x[: fired + 1]:
        b2.update(v)
    assert abs(b2.recent_start(15) - 300) <= 1


def test_bocd_posterior_is_normalised_and_bounded():
    b = BOCD(max_run_length=50)
    for v in healthy(500, seed=1):
        b.update(v)
        p = b.run_length_posterior
        assert p.size <= 51
        assert math.isclose(p.sum(), 1.0, rel_tol=1e-9)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0])
def test_bocd_rejects_invalid_values(bad):
    with pytest.raises(ValueError):
        BOCD().update(bad)


# -- verification (pure) -----------------------------------------------------------------
def test_slow_level_requires_every_chunk_slow():
    cfg = FalconConfig()
    assert slow_level(1.0, [1.3] * 30, cfg) == pytest.approx(1.3)
    burst = [1.5] * 15 + [1.0] * 15  # slow overall median? no: a burst that ends inside
    assert slow_level(1.0, burst, cfg) is None
    assert slow_level(1.0, [1.08] * 30, cfg) is None  # under 10%: jitter
    assert slow_level(1.0, [0.7] * 30, cfg) is None  # faster is not a fail-slow


def test_chunk_levels_split_evenly():
    assert chunk_levels([1, 1, 1, 5, 5, 5, 9, 9, 9], 3) == [1, 5, 9]
    assert len(chunk_levels(list(range(31)), 3)) == 3


def test_recovery_needs_whole_window_healthy():
    cfg = FalconConfig()
    assert is_recovered(1.0, [1.0] * 30, cfg)
    assert not is_recovered(1.0, [1.0] * 20 + [1.4] * 10, cfg)
    # drifted healthy level: back under the line and a clear step down from before
    assert is_recovered(1.0, [1.08] * 30, cfg, before=1.6)
    assert not is_recovered(1.0, [1.08] * 30, cfg, before=1.12)


def test_best_split_ignores_a_single_spike():
    values = [1.0] * 10 + [8.0] + [1.0] * 5 + [1.5] * 20
    assert best_split(values, 1.0, 1.5) == 16


# -- the online detector -----------------------------------------------------------------
def test_step_is_detected_with_onset_delay_and_recovery():
    x = healthy(1000)
    x[300:600] *= 1.4
    det = VerifiedBOCD()
    confirmed = None
    for i, v in enumerate(x):
        for ev in det.feed(v):
            if ev.end is None and confirmed is None:
                confirmed = (i, ev)
    assert confirmed is not None
    i, ev = confirmed
    assert ev.detected_at == i
    assert abs(ev.onset - 300) <= 2
    assert i - 300 <= FalconConfig().min_duration + 5
    assert ev.slowdown == pytest.approx(1.4, rel=0.03)
    (final,) = det.events
    assert final.end is not None and abs(final.end - 600) <= 3


def test_min_duration_is_configurable():
    x = healthy(800)
    x[300:600] *= 1.4
    for d in (10, 30, 60):
        (ev,) = detect(x, config=FalconConfig(min_duration=d))
        assert ev.detected_at - ev.onset == d - 1


@pytest.mark.parametrize(
    "name",
    ["spikes", "burst", "wave", "drift", "periodic_eval", "speedup", "small_step"],
)
def test_jitter_is_not_a_fail_slow(name):
    n = 1500
    x = healthy(n, seed=3)
    rng = np.random.default_rng(4)
    if name == "spikes":
        idx = rng.choice(n, 40, replace=False)
        x[idx] *= rng.uniform(2, 6, idx.size)
    elif name == "burst":
        for at in (200, 500, 800, 1100):
            x[at : at + 8] *= 1.8  # shorter than min_duration
    elif name == "wave":
        x *= 1 + 0.04 * np.sin(np.arange(n) / 10)
    elif name == "drift":
        x *= np.linspace(1.0, 1.35, n)  # +35% over the run, slowly
    elif name == "periodic_eval":
        x[::100] *= 5.0
        x[1::100] *= 5.0
    elif name == "speedup":
        x[700:] *= 0.7
    elif name == "small_step":
        x[700:] *= 1.06
    events = detect(x)
    assert events == [], [e.to_dict() for e in events]


def test_ladder_is_one_event_with_peak_slowdown():
    x = healthy(1500, seed=5)
    x[300:600] *= 1.3
    x[600:900] *= 1.8
    (ev,) = detect(x)
    assert abs(ev.onset - 300) <= 2
    assert ev.slowdown == pytest.approx(1.8, rel=0.05)
    assert abs(ev.end - 900) <= 3


def test_two_separate_events():
    x = healthy(1500, seed=6)
    x[200:400] *= 1.5
    x[800:1100] *= 1.25
    events = detect(x)
    assert [(abs(e.onset - o) <= 2) for e, o in zip(events, (200, 800))] == [True, True]
    assert all(e.end is not None for e in events)


def test_event_open_at_end_has_null_end():
    x = healthy(600)
    x[400:] *= 1.5
    (ev,) = detect(x)
    assert ev.end is None and ev.to_dict()["end"] is None


def test_memory_stays_bounded():
    det = VerifiedBOCD()
    x = healthy(20000, seed=8)
    for v in x:
        det.feed(v)
    assert len(det._hist) <= 2 * det._keep


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("bad", [float("nan"), -0.1, 0.0, float("inf"), "x"])
def test_invalid_samples_are_named(method, bad):
    det = make_detector(method)
    det.feed(0.5)
    with pytest.raises(InvalidSample, match="iteration 1"):
        det.feed(bad)


def test_unknown_method_and_bad_config():
    with pytest.raises(UnknownMethod, match="nope"):
        make_detector("nope")
    with pytest.raises(ConfigError):
        FalconConfig(min_slowdown=-1)
    with pytest.raises(ConfigError, match="no_such"):
        FalconConfig().replace(no_such=1)


# -- against the baselines, on generated traces -----------------------------------------
@pytest.fixture(scope="module")
def trace_set():
    return generate_traces(45, "mixed", seed=11, n=1500)


def test_bocdv_beats_the_baselines(trace_set):
    summaries = {}
    for method in METHODS:
        scores = [score_trace(detect(t.iter_times, method), t.events) for t in trace_set]
        summaries[method] = summarize(scores)
    v = summaries["bocd+v"]
    assert v.accuracy >= 0.99 and v.fpr <= 0.01 and v.fnr <= 0.01
    for base in ("bocd", "slide-window"):
        assert v.accuracy > summaries[base].accuracy
        assert v.false_alarms < summaries[base].false_alarms
    # persistence: at least as accurate, no more false alarms, and sooner
    p = summaries["persistence"]
    assert v.accuracy >= p.accuracy and v.fpr <= p.fpr
    assert v.median_delay is not None and p.median_delay is not None
    assert v.median_delay <= 12 and v.median_delay < p.median_delay


def test_generator_labels_match_series(trace_set):
    kinds = {t.kind for t in trace_set}
    assert kinds == {"compute", "comm", "healthy"}
    for t in trace_set:
        x = np.asarray(t.iter_times)
        assert np.all(np.isfinite(x)) and np.all(x > 0)
        if t.kind == "healthy":
            assert t.events == []
        else:
            assert t.events
        for onset, end, slow in t.events:
            stop = end if end is not None else x.size
            pre = np.median(x[max(0, onset - 100) : onset])
            assert np.median(x[onset:stop]) > 1.1 * pre
            assert slow > 1.1


def test_score_trace_rules():
    from falconext.detect.events import FailSlowEvent

    labels = [(100, 200, 1.5)]
    hit = FailSlowEvent(0, 101, 130, 1.5, 1.0, 199)
    split = FailSlowEvent(1, 150, 180, 1.5, 1.0, 199)
    stray = FailSlowEvent(2, 500, 530, 1.5, 1.0, None)
    assert score_trace([hit], labels).correct
    s = score_trace([hit, split], labels)
    assert (s.detected, s.false_alarms) == (1, 1)
    s = score_trace([stray], labels)
    assert (s.detected, s.false_alarms) == (0, 1)
    assert score_trace([], []).correct


# -- the persistence baseline --------------------------------------------------------------
def test_persistence_alarms_after_k_slow_iterations_in_a_row_and_ends_after_k_healthy():
    k = FalconConfig().persistence_iterations
    x = healthy(600, seed=3, sigma=0.01)
    x[300:450] *= 1.5
    (ev,) = detect(x, "persistence")
    assert ev.onset == 300 and ev.detected_at == 300 + k - 1
    assert ev.end == 450 and ev.slowdown == pytest.approx(1.5, rel=0.05)


def test_persistence_ignores_a_burst_shorter_than_k_and_restarts_its_count_on_a_healthy_iteration():
    k = FalconConfig().persistence_iterations
    x = healthy(600, seed=4, sigma=0.01)
    x[200 : 200 + k - 1] *= 1.8  # one short of k
    x[400 : 400 + 2 * k] *= 1.5
    x[400 + k - 2] /= 1.5  # healthy once inside: the count starts again after it
    (ev,) = detect(x, "persistence")
    assert ev.onset == 400 + k - 1 and ev.detected_at == 400 + 2 * k - 2


# -- the slow-run rule (issue 14): size buys speed only where no healthy burst reaches ----
def confirmation_delay(x, onset: int) -> int | None:
    """Iterations from ``onset`` to the first event BOCD+V confirms (None: no event)."""
    det = VerifiedBOCD()
    for i, v in enumerate(x):
        for ev in det.feed(float(v)):
            if ev.end is None and ev.detected_at == i:
                return i - onset
    return None


def run_of(values, healthy_spread: float = 0.01) -> SlowRun | None:
    return trailing_run([1.0] * 5 + list(values), 1.0, FalconConfig(), healthy_spread)


@pytest.mark.parametrize("seed", range(5))
def test_a_clean_2x_step_is_confirmed_in_fewer_than_10_iterations(seed):
    x = healthy(800, seed=seed)
    x[300:600] *= 2.0
    delay = confirmation_delay(x, 300)
    assert delay is not None and delay < 10  # 9 iterations at 2x: delay 8
    (ev,) = detect(x)
    assert ev.onset == 300 and ev.detected_at - 300 == delay


@pytest.mark.parametrize("factor", [1.15, 1.3, 1.5, 1.8])
def test_a_step_up_to_the_burst_level_needs_min_duration(factor):
    """Healthy bursts last up to 10 iterations at up to 1.8x: such steps wait 11."""
    x = healthy(800, seed=9)
    x[300:600] *= factor
    assert confirmation_delay(x, 300) == FalconConfig().min_duration - 1


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("factor", [1.2, 1.5, 1.8, 1.85])
def test_a_10_iteration_burst_is_not_a_fail_slow(seed, factor):
    x = healthy(600, seed=20 + seed)
    x[300:310] *= factor
    assert detect(x) == []


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_burst_with_a_noisy_or_spiky_neighbour_is_not_a_fail_slow(where):
    """Ten iterations at 1.4x and one more over the 10% line, but not at the burst's
    level (healthy noise at 1.12x, a 2.5x spike): the 11th does not count."""
    for neighbour in (1.12, 1.25, 2.5):
        x = healthy(600, seed=31, sigma=0.01)
        x[300:310] *= 1.4
        x[299 if where == "before" else 310] *= neighbour
        assert detect(x) == [], neighbour


def test_a_spike_cluster_glued_to_a_burst_is_not_a_fail_slow():
    """Seen in generated healthy traces: 9 iterations at 1.6x then 3 spikes (4.7x, 3x),
    and 5 spike iterations at 4x before a burst: 12 and 10 iterations over the line."""
    x = healthy(800, seed=32, sigma=0.015)
    x[300:309] *= 1.6
    x[309:312] *= [4.7, 3.0, 3.0]
    x[500:505] *= 4.0
    x[505:510] *= 1.75
    assert detect(x) == []


def test_a_ramped_fail_slow_counts_its_ramp_in_part():
    """A congestion ramp (1.25, 1.5, 1.75) before a 2x plateau is part of the evidence:
    confirmed sooner than the plateau alone would allow, and the onset is the ramp's."""
    x = healthy(800, seed=33)
    x[300:303] *= [1.25, 1.5, 1.75]
    x[303:600] *= 2.0
    delay = confirmation_delay(x, 300)
    plateau_alone = 9 + 3 - 1  # nine plateau iterations after a three-iteration ramp
    assert delay is not None and delay < plateau_alone
    (ev,) = detect(x)
    assert 300 <= ev.onset <= 302


def test_a_spike_inside_a_fail_slow_neither_breaks_nor_delays_it():
    x = healthy(800, seed=34, sigma=0.01)
    x[300:600] *= 1.3
    x[304:307] *= 3.0  # a checkpoint save during the fail-slow
    assert confirmation_delay(x, 300) == FalconConfig().min_duration - 1


def test_run_needed_shrinks_with_the_step_above_the_floor_only():
    cfg = FalconConfig()
    clean = dict(offset=0, weight=0.0, spread=0.02)
    needed = {level: run_needed(SlowRun(level=level, **clean), cfg) for level in (1.2, 1.5, 1.9, 2.0, 2.5, 4.0)}
    assert needed == {1.2: 11, 1.5: 11, 1.9: 11, 2.0: 9, 2.5: 7, 4.0: 7}
    # a noisy "step" (a burst with spikes glued to it) waits the full min_duration
    assert run_needed(SlowRun(0, 0.0, 2.5, 0.3), cfg) == cfg.min_duration
    # without the early path every step waits min_duration
    assert run_needed(SlowRun(level=2.5, **clean), cfg.replace(fast_confirm_floor=100.0)) == cfg.min_duration


def test_trailing_run_counts_from_the_first_to_the_last_iteration_at_the_level():
    run = run_of([1.4] * 10)
    assert (run.offset, run.weight) == (5, 10.0) and run.level == pytest.approx(1.4)
    # a spike or a noisy iteration at either end: not at the level, not counted
    for edge in (1.12, 2.5):
        assert run_of([1.4] * 10 + [edge]).weight == 10.0
    assert run_of([2.5] + [1.4] * 10).weight == 10.0
    # before the run, 1.12 may be a ramp: it counts the part of the way it rose, < 1
    assert run_of([1.12] + [1.4] * 10).weight == pytest.approx(10 + math.log(1.12) / math.log(1.4))
    # inside the run they are the fail-slow
    assert run_of([1.4] * 4 + [3.0, 1.15] + [1.4] * 4).weight == 10.0
    # a ramp counts the fraction of the way it rose
    ramp = run_of([2.0**0.5] + [2.0] * 8)
    assert ramp.offset == 5 and ramp.weight == pytest.approx(8.5)
    # iterations within healthy noise of the baseline count nothing, even at the level
    assert run_of([1.12] + [1.4] * 10, healthy_spread=0.04).weight == 10.0
    assert run_of([1.15] * 10 + [1.12], healthy_spread=0.01).weight == 11.0
    assert run_of([1.15] * 10 + [1.12], healthy_spread=0.04).weight == 10.0
    # the level is where the run is now: its newer half, not a long ramp before it
    ramped = run_of([1.3] * 6 + [2.0] * 5)
    assert ramped.level == pytest.approx(2.0)
    assert ramped.weight == pytest.approx(5 + 6 * math.log(1.3) / math.log(2.0))
    assert run_of([1.0] * 3) is None and run_of([1.4, 1.05]) is None


def test_a_fail_slow_soon_after_the_series_begins_is_confirmed_as_soon():
    """In a live job the series starts after the tracker's warm-up, and a fault may come
    25 iterations later: too few iterations before BOCD's look-back for a baseline there,
    so it comes from before the candidate, and the run is confirmed at min_duration (a
    replayed 4-rank training run once waited for the 22-iteration chunk check instead)."""
    x = healthy(300, seed=35, sigma=0.02)
    x[24:] *= 1.5
    assert confirmation_delay(x, 24) == FalconConfig().min_duration - 1


@pytest.mark.parametrize("seed", range(4))
def test_a_step_after_an_early_burst_is_judged_against_the_healthy_level(seed):
    """A host burst (1.5x to 1.15x) six iterations into the series, healthy again, then a
    2x step: BOCD's first watched candidate is the burst's end, whose only baseline is
    the burst itself. The step's own candidate, in the same watched stretch, brings the
    faster baseline, so the step is confirmed as a clean 2x step (in a 4-rank link-fault
    run the burst's baseline had held the confirmation back for 21 iterations)."""
    x = healthy(200, seed=40 + seed, sigma=0.03)
    x[6:13] *= [1.55, 1.5, 1.15, 1.35, 1.35, 1.3, 1.15]
    x[25:] *= 2.1
    delay = confirmation_delay(x, 25)
    assert delay is not None and delay < 10


@pytest.mark.parametrize("seed", range(4))
def test_a_step_that_starts_slower_counts_its_start(seed):
    """A 1.85x link fault whose first three iterations run 10% over the level it settles
    at (seen in a 4-rank link-fault run): nearer to the level than to its square, they are
    the run's start, not spikes glued to it, so the step is confirmed at min_duration as
    a plain step is; a spike at the square's side before a burst still counts nothing."""
    x = healthy(300, seed=50 + seed, sigma=0.02)
    x[100:] *= 1.85
    x[100:103] *= 1.1
    assert confirmation_delay(x, 100) == FalconConfig().min_duration - 1
    run = run_of([1.85 * 1.1] * 3 + [1.85] * 7)
    assert run.offset == 5 and run.weight == 10.0
    assert run_of([1.85**1.6] + [1.85] * 7).weight == 7.0
