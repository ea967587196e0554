"""Period finding from call sequences (detect/period.py)."""

from __future__ import annotations

import numpy as np
import pytest

from falconext.config import FalconConfig
from falconext.detect.period import (
    SymbolTable,
    acf,
    detect_period,
    gap_spacing,
    find_period,
    mismatch_rate,
    phase_r2,
    refine_by_gaps,
    sharpen_period,
    size_agreement,
    symbol_of,
    symbolize,
)
from falconext.sim.calllog import generate, long_period_spec, tp_pp_spec
from falconext.trace.records import CallRecord


def rec(
    op: str = "all_reduce", group: str = "dp", nbytes: int = 1024, t: float = 0.0
) -> CallRecord:
    return CallRecord(0, op, group, nbytes, t)


def periodic(unit: np.ndarray, repeats: int) -> np.ndarray:
    return np.tile(np.asarray(unit, dtype=np.int64), repeats)


# --- symbols -----------------------------------------------------------------------


def test_symbols_identical_calls_share_a_code_and_codes_follow_first_appearance() -> None:
    records = [rec("all_reduce"), rec("send", "pp"), rec("all_reduce"), rec("recv", "pp")]
    assert symbolize(records).tolist() == [0, 1, 0, 2]


def test_size_class_is_bit_length() -> None:
    assert symbol_of(rec(nbytes=1000)) == symbol_of(rec(nbytes=1023))
    assert symbol_of(rec(nbytes=1023)) != symbol_of(rec(nbytes=1024))
    assert symbol_of(rec(group="tp")) != symbol_of(rec(group="dp"))


def test_symbol_table_is_stable_across_calls() -> None:
    table = SymbolTable()
    first = symbolize([rec("a"), rec("b")], table)
    second = symbolize([rec("b"), rec("c"), rec("a")], table)
    assert first.tolist() == [0, 1]
    assert second.tolist() == [1, 2, 0]
    assert len(table) == 3


# --- ACF ---------------------------------------------------------------------------


def test_acf_is_one_at_the_period_and_independent_of_code_assignment() -> None:
    codes = periodic([0, 1, 2, 1, 3], 6)
    relabelled = np.array([7, 3, 100, 4, -5])[codes]
    assert acf(codes, 5) == pytest.approx(1.0)
    for k in range(1, 12):
        assert acf(codes, k) == pytest.approx(acf(relabelled, k))
    assert acf(codes, 2) < 0.5


def test_acf_is_per_pair_normalised_so_three_repeats_reach_one() -> None:
    # the paper's 1/N normalisation would give (N - k) / N = 2/3 here
    codes = periodic(np.arange(50) % 7, 3)
    assert acf(codes, 50) == pytest.approx(1.0)


def test_acf_of_independent_symbols_is_near_zero() -> None:
    codes = np.random.default_rng(0).integers(0, 5, 5000)
    assert abs(acf(codes, 7)) < 0.05


def test_acf_of_one_symbol_is_one_not_a_division_by_zero() -> None:
    assert acf(np.zeros(10, dtype=int), 3) == 1.0
    with pytest.raises(ValueError):
        acf(np.zeros(10, dtype=int), 10)


# --- find_period -------------------------------------------------------------------


def test_find_period_simple_and_first_lag() -> None:
    assert find_period(periodic([0, 1, 2, 3], 5)) == 4
    # 6 is also a period (and 12 ...): the first lag wins
    assert find_period(periodic([0, 1, 0, 2, 0, 1], 6)) == 6
    assert find_period(periodic([5, 5, 6], 10)) == 3


def test_find_period_needs_min_repeats_and_respects_max_period() -> None:
    unit = np.arange(10)
    assert find_period(periodic(unit, 3)) == 10
    assert find_period(periodic(unit, 3)[:-1]) is None  # fewer than 3 repeats
    assert find_period(periodic(unit, 2), min_repeats=2) == 10
    assert find_period(periodic(unit, 5), max_period=9) is None


def test_find_period_of_2500_calls_beyond_any_small_lag_limit() -> None:
    rng = np.random.default_rng(1)
    unit = rng.integers(0, 40, 2500)
    codes = periodic(unit, 3)
    assert find_period(codes) == 2500
    assert find_period(codes, max_period=2000) is None


def test_find_period_tolerates_a_few_corrupted_calls() -> None:
    rng = np.random.default_rng(2)
    codes = periodic(rng.integers(0, 10, 50), 20)
    codes[rng.choice(codes.size, 8, replace=False)] = 99
    assert find_period(codes) == 50
    assert mismatch_rate(codes, 50) > 0


def test_find_period_one_repeated_call_is_period_one() -> None:
    assert find_period(np.full(40, 3)) == 1


def test_find_period_none_for_random_symbols() -> None:
    codes = np.random.default_rng(3).integers(0, 6, 3000)
    assert find_period(codes) is None


def test_find_period_none_for_too_short_input() -> None:
    assert find_period(np.array([], dtype=int)) is None
    assert find_period(np.array([1])) is None
    assert find_period(np.array([1, 2])) is None


# --- sharpen -----------------------------------------------------------------------


def test_sharpen_moves_from_a_micro_batch_to_the_iteration() -> None:
    # 48 identical micro-batches, then one once-per-step call (gradient norm): lag 5
    # reaches the ACF threshold but breaks every iteration; the iteration is exact
    unit = np.array([0, 1, 1, 1, 2])
    iteration = np.concatenate([np.tile(unit, 48), [3]])
    codes = periodic(iteration, 4)
    first = find_period(codes)
    assert first == 5
    assert sharpen_period(codes, first) == 241
    assert sharpen_period(codes, 241) == 241
    assert sharpen_period(codes[: 241 * 2], first) == 5  # too short to show 241 three times
    assert sharpen_period(codes, first, max_period=200) == 5


def test_sharpen_keeps_a_period_broken_by_irregular_insertions() -> None:
    rng = np.random.default_rng(4)
    iteration = rng.integers(0, 8, 30)
    parts = []
    for n in range(100):
        parts.append(iteration)
        if n in (17, 71):
            parts.append(np.array([50, 51]))
    codes = np.concatenate(parts)
    assert find_period(codes) == 30
    assert sharpen_period(codes, 30) == 30


# --- refine by gaps ----------------------------------------------------------------


def gaps_to_times(gaps: np.ndarray) -> np.ndarray:
    return np.concatenate([[1.0], 1.0 + np.cumsum(gaps)])


def test_refine_four_identical_buckets_per_iteration() -> None:
    rng = np.random.default_rng(5)
    # forward pass before the first bucket, short gaps between buckets
    base = np.tile([0.08, 0.01, 0.01, 0.01], 30)
    times = gaps_to_times(base * np.exp(0.02 * rng.standard_normal(base.size)))
    assert find_period(np.zeros(times.size, dtype=int)) == 1
    assert refine_by_gaps(1, times) == 4


def test_refine_keeps_one_call_per_iteration_with_uniform_gaps() -> None:
    rng = np.random.default_rng(6)
    times = gaps_to_times(0.1 * np.exp(0.02 * rng.standard_normal(200)))
    assert refine_by_gaps(1, times) == 1


def test_refine_needs_enough_repetitions_and_respects_max_period() -> None:
    gaps = np.tile([0.08, 0.01, 0.01, 0.01], 2)  # two iterations only
    assert refine_by_gaps(1, gaps_to_times(gaps)) == 1
    gaps = np.tile([0.08, 0.01, 0.01, 0.01], 30)
    assert refine_by_gaps(1, gaps_to_times(gaps), max_period=3) == 1


def test_refine_multiplies_a_symbolic_period() -> None:
    rng = np.random.default_rng(7)
    # symbols repeat every 3 calls, the iteration holds two such units
    base = np.tile([0.2, 0.01, 0.02, 0.01, 0.01, 0.02], 20)
    times = gaps_to_times(base * np.exp(0.02 * rng.standard_normal(base.size)))
    assert refine_by_gaps(3, times) == 6


def test_refine_survives_equal_and_backwards_timestamps() -> None:
    times = np.tile([0.0, 0.0, 0.0, 0.0], 20) + np.repeat(np.arange(20.0), 4)
    times[10] = times[9] - 5.0  # clock step back
    assert refine_by_gaps(1, times) in (1, 4)


def test_phase_r2_is_zero_for_one_phase_and_high_for_structure() -> None:
    values = np.tile([5.0, 1.0, 1.0], 20)
    assert phase_r2(values, 1) == 0.0
    assert phase_r2(values, 3) == pytest.approx(1.0)
    noise = np.random.default_rng(8).standard_normal(300)
    assert phase_r2(noise, 10) < 0.3


# --- detect_period on generated logs -------------------------------------------------


def test_detect_period_per_pipeline_stage() -> None:
    spec = tp_pp_spec(iterations=8, tp=1, pp=4, micro_batches=6)
    log = generate(spec, 0)
    counts = set()
    for rank, pattern in spec.patterns.items():
        records = log.rank_records(rank)
        assert detect_period(records) == len(pattern)
        times = np.array([r.t_issue for r in records])
        assert detect_period((symbolize(records), times)) == len(pattern)
        counts.add(len(pattern))
    assert len(counts) == 3  # first, middle and last stages differ


def test_detect_period_long_pipeline_stage() -> None:
    spec = long_period_spec(iterations=4)
    log = generate(spec, 0)
    records = log.rank_records(0)
    assert len(spec.patterns[0]) > 2000
    assert detect_period(records) == len(spec.patterns[0])


def test_detect_period_identical_buckets_and_none_without_repetition() -> None:
    rng = np.random.default_rng(9)
    t, records = 1.0, []
    for _ in range(30):
        for gap in (0.08, 0.01, 0.01, 0.01):
            t += gap * float(np.exp(0.02 * rng.standard_normal()))
            records.append(rec(t=t))
    assert detect_period(records) == 4
    ops = rng.integers(0, 6, 600)
    noise = [rec(op=f"op{o}", t=i * 0.01) for i, o in enumerate(ops)]
    assert detect_period(noise, FalconConfig()) is None


def test_gap_spacing_counts_calls_between_long_pauses() -> None:
    t = np.cumsum(np.tile([0.2] + [0.0003] * 99, 5))
    assert gap_spacing(t) == 100
    assert gap_spacing(np.cumsum(np.full(500, 0.001))) is None  # no long pause
    assert gap_spacing(np.array([0.0, 1.0])) is None  # too short to say


def test_refine_reaches_beyond_max_multiple_through_the_long_pauses() -> None:
    t = np.cumsum(np.tile([0.2] + [0.0003] * 299, 4))
    assert refine_by_gaps(1, t, max_multiple=256) == 300
    assert refine_by_gaps(1, t[:800], max_multiple=256) == 1  # fewer than 3 steps: not yet


def test_size_agreement_tolerates_small_size_changes() -> None:
    bits = np.array([28, 22, 19, 28, 22, 18, 28, 22, 19])
    assert size_agreement(bits, 3) == 1.0
    assert size_agreement(np.array([10, 20, 10, 20]), 1) == 0.0
    with pytest.raises(ValueError):
        size_agreement(bits, 0)
