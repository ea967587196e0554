"""S2 micro-batch rebalancing: exactness, the canonical tie-break, caps and input errors."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from falconext.mitigate.microbatch import (
    _complete,
    _validate,
    plan_microbatches,
    plan_microbatches_cvxpy,
    slowest_time,
)


def compositions(total: int, parts: int, caps: list[int]):
    """Every split of `total` into `parts` counts with 1 <= m_i <= caps[i]."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        m = [b - a for a, b in zip((0,) + cuts, cuts + (total,))]
        if all(x <= c for x, c in zip(m, caps)):
            yield m


def greedy_from_ones(times, total, caps):
    """Textbook reference: from all ones, add where the next micro-batch finishes first."""
    m = [1] * len(times)
    for _ in range(total - len(times)):
        best = min(
            (i for i in range(len(times)) if m[i] < caps[i]),
            key=lambda i: ((m[i] + 1) * times[i], i),
        )
        m[best] += 1
    return m


def check_plan(times, total, caps, plan):
    assert all(type(x) is int for x in plan)
    assert sum(plan) == total
    assert all(1 <= x <= c for x, c in zip(plan, caps))


def random_times(rng, d, kind):
    if kind == "ties":  # small integers: many exactly tied finishing times
        return [float(x) for x in rng.integers(1, 4, d)]
    if kind == "wild":
        return list(10.0 ** rng.uniform(-3, 3, d))
    return list(rng.uniform(0.5, 2.0, d))


def test_brute_force_optimal_small_cases():
    rng = np.random.default_rng(1234)
    n = 0
    for d in range(1, 5):
        for total in range(d, 11):
            for kind in ("uniform", "ties", "wild"):
                for capped in (False, True):
                    times = random_times(rng, d, kind)
                    if capped:
                        caps = [int(c) for c in rng.integers(1, total + 1, d)]
                        if sum(caps) < total:
                            caps[int(rng.integers(d))] += total - sum(caps)
                        arg = caps
                    else:
                        caps, arg = [total] * d, None
                    best = min(slowest_time(times, m) for m in compositions(total, d, caps))
                    plan = plan_microbatches(times, total, arg)
                    check_plan(times, total, caps, plan)
                    assert slowest_time(times, plan) == best, (times, total, caps, plan)
                    n += 1
    assert n == 3 * 2 * sum(11 - d for d in range(1, 5))


def test_same_cap_for_all_as_int():
    times = [1.0, 1.0, 3.0]
    plan = plan_microbatches(times, 9, 4)
    assert plan == [4, 4, 1]
    assert slowest_time(times, plan) == min(
        slowest_time(times, m) for m in compositions(9, 3, [4, 4, 4])
    )


def test_matches_textbook_greedy_exactly():
    """The fast start must not change the answer: same plan as the greedy from all ones."""
    rng = np.random.default_rng(7)
    for _ in range(40):
        d = int(rng.integers(1, 40))
        total = d + int(rng.integers(0, 300))
        times = random_times(rng, d, ["uniform", "ties", "wild"][int(rng.integers(3))])
        caps = [int(c) for c in rng.integers(1, total // d + 5, d)]
        if sum(caps) < total:
            caps = [total] * d
        assert plan_microbatches(times, total, caps) == greedy_from_ones(times, total, caps)


def test_any_start_reaches_the_same_plan():
    """_complete is exact from any start (exercises the removal and swap phases)."""
    rng = np.random.default_rng(11)
    for _ in range(100):
        d = int(rng.integers(1, 12))
        total = d + int(rng.integers(0, 40))
        times = random_times(rng, d, ["uniform", "ties", "wild"][int(rng.integers(3))])
        t, m_total, caps = _validate(times, total, None)
        start = np.array([int(rng.integers(1, c + 1)) for c in caps], dtype=np.int64)
        got = [int(x) for x in _complete(t, caps, m_total, start)]
        assert got == plan_microbatches(times, total)


@pytest.mark.parametrize("d", [1, 2, 3, 8, 64, 1000, 8192])
@pytest.mark.parametrize("per", [1, 2, 8, 13])
def test_equal_times_give_the_even_plan(d, per):
    assert plan_microbatches([0.37] * d, per * d) == [per] * d


def test_equal_times_remainder_goes_to_lower_indices():
    assert plan_microbatches([2.0] * 5, 13) == [3, 3, 3, 2, 2]


def test_slow_replica_gets_fewer():
    times = [1.0, 2.0, 1.0, 1.0]
    plan = plan_microbatches(times, 16)
    assert slowest_time(times, plan) == 5.0
    assert plan[1] == min(plan) == 2
    assert slowest_time(times, [4, 4, 4, 4]) == 8.0  # what the even plan would cost


def test_caps_respected_and_binding():
    times = [1.0, 10.0, 10.0, 10.0]
    plan = plan_microbatches(times, 20, [5, 20, 20, 20])
    assert plan[0] == 5  # the fast replica would take far more without its cap
    check_plan(times, 20, [5, 20, 20, 20], plan)
    assert slowest_time(times, plan) == 50.0


def _is_optimal(times, total, caps, plan) -> bool:
    """Certificate: fewer than `total` micro-batches can finish strictly before `slowest`."""
    t = np.asarray(times)
    c = np.asarray(caps)
    level = slowest_time(times, plan)
    if level == t.max():
        return True  # every replica runs at least one micro-batch
    j = np.floor(level / t)
    j = np.where(j * t >= level, j - 1, j)  # largest j with j * t < level
    j = np.where((j + 1) * t < level, j + 1, j)
    return int(np.minimum(j, c).sum()) < total


def test_random_properties_large_and_wild():
    rng = np.random.default_rng(2024)
    for d in (1, 5, 100, 1000, 3000):
        for kind in ("uniform", "ties", "wild"):
            for capped in (False, True):
                times = random_times(rng, d, kind)
                total = d * int(rng.integers(1, 17)) + int(rng.integers(0, d))
                if capped:
                    caps = [int(c) for c in rng.integers(1, 3 * total // d + 2, d)]
                    if sum(caps) < total:
                        caps = [c + (total - sum(caps)) // d + 1 for c in caps]
                    arg = caps
                else:
                    caps, arg = [total] * d, None
                plan = plan_microbatches(times, total, arg)
                check_plan(times, total, caps, plan)
                assert _is_optimal(times, total, caps, plan)


def test_numpy_inputs_accepted():
    plan = plan_microbatches(np.array([1.0, 2.0]), np.int64(6), np.array([5, 5]))
    assert plan == [4, 2] and all(type(x) is int for x in plan)


def test_fast_at_8192_replicas():
    rng = np.random.default_rng(0)
    times = 1.0 + 0.02 * rng.standard_normal(8192)
    slow = rng.random(8192) < 0.1
    times[slow] *= rng.uniform(1.5, 4.0, int(slow.sum()))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        plan = plan_microbatches(times, 8 * 8192)
        best = min(best, time.perf_counter() - t0)
    assert sum(plan) == 8 * 8192
    assert best < 0.5  # typically ~15 ms; generous for shared CI hosts


def test_cvxpy_agrees_on_slowest_time():
    rng = np.random.default_rng(5)
    cases = [([1.0, 2.0, 1.0, 1.0], 16, None)]
    for d in (3, 8, 17, 32):
        times = list(rng.uniform(0.5, 3.0, d))
        cases.append((times, 4 * d + int(rng.integers(0, d)), None))
    times = list(rng.uniform(0.5, 3.0, 10))
    cases.append((times, 40, [int(c) for c in rng.integers(3, 8, 10)]))
    for times, total, caps in cases:
        fast = plan_microbatches(times, total, caps)
        ref = plan_microbatches_cvxpy(times, total, caps)
        check_plan(times, total, caps or [total] * len(times), ref)
        assert slowest_time(times, ref) == pytest.approx(slowest_time(times, fast), rel=1e-6)
        assert slowest_time(times, fast) <= slowest_time(times, ref) * (1 + 1e-12)


@pytest.mark.parametrize("solve", [plan_microbatches, plan_microbatches_cvxpy])
@pytest.mark.parametrize(
    "times, total, caps, match",
    [
        ([], 4, None, "times is empty"),
        ([1.0, float("nan")], 4, None, r"times\[1\]"),
        ([1.0, 1.0, float("inf")], 4, None, r"times\[2\]"),
        ([0.0, 1.0], 4, None, r"times\[0\]"),
        ([1.0, -2.0], 4, None, r"times\[1\]"),
        ([[1.0, 2.0]], 4, None, "one-dimensional"),
        (["a", 1.0], 4, None, "sequence of numbers"),
        ([1.0, 1.0], 4.0, None, "total must be an int"),
        ([1.0, 1.0], True, None, "total must be an int"),
        ([1.0, 1.0], "4", None, "total must be an int"),
        ([1.0, 1.0, 1.0], 2, None, "cannot give every replica a micro-batch"),
        ([1.0, 1.0], 4, 0, "max_per_replica = 0 < 1"),
        ([1.0, 1.0], 4, [3, -1], r"max_per_replica\[1\] = -1 < 1"),
        ([1.0, 1.0], 4, [3, 3, 3], "has 3 entries but there are 2 replicas"),
        ([1.0, 1.0], 4, [2.5, 3], r"max_per_replica\[0\] = 2.5 is not an int"),
        ([1.0, 1.0], 4, True, "max_per_replica must be"),
        ([1.0, 1.0], 4, "22", "max_per_replica must be"),
        ([1.0, 1.0], 5, [2, 2], "infeasible: the caps allow at most 4"),
        ([1.0, 1.0, 1.0], 7, 2, "infeasible"),
    ],
)
def test_bad_input(solve, times, total, caps, match):
    with pytest.raises(ValueError, match=match):
        solve(times, total, caps)


def test_slowest_time_checks_lengths():
    assert slowest_time([1.0, 2.5], [3, 2]) == 5.0
    with pytest.raises(ValueError, match="equal length"):
        slowest_time([1.0, 2.0], [1])
