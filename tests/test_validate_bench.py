"""GEMM benchmark: real FLOP/s, a stretched matmul reads as slower, exact timing arithmetic."""

from __future__ import annotations

import os
import time

import pytest
import torch

from falconext.validate.gemm import GemmResult, gemm_benchmark
from falconext.validate.health import decode_throttle_reasons, gpu_health

#: run first, before any job runs ahead (conftest.py: RUN_FIRST):
#: it times real GEMM and transfer benchmarks
RUN_FIRST = True


def stretched(a, b):
    """What the fault injector does to a slow GPU: compute, then stall as long again."""
    t0 = time.perf_counter()
    out = torch.matmul(a, b)
    spent = time.perf_counter() - t0
    end = time.perf_counter() + spent
    while time.perf_counter() < end:
        pass
    return out


def test_plain_gemm_has_positive_flops():
    r = gemm_benchmark(n=64, repeats=5, warmup=1)
    assert isinstance(r, GemmResult)
    assert len(r.samples) == 5 and all(s > 0 for s in r.samples)
    assert sorted(r.samples)[2] == r.median_s
    assert r.flops == pytest.approx(2 * 64**3 / r.median_s)
    assert r.flops > 1e6  # even one slow core does far more than a MFLOP/s


def test_stretched_matmul_halves_flops():
    # Real GEMMs on the wall clock, judged as a ratio (no seam: this is the benchmark itself).
    # Interleaved rounds, best repeat of each: a CI host busy in one stretch of time
    # must not make the healthy benchmark look as slow as the stretched one.
    plain_best, slow_best = 0.0, 0.0
    for _ in range(8):  # beside the suite's prefetched training job: 4 rounds once failed
        plain_best = max(plain_best, gemm_benchmark(n=256, repeats=10, warmup=1).best_flops)
        slow_best = max(slow_best, gemm_benchmark(n=256, repeats=10, warmup=1, matmul=stretched).best_flops)
    assert slow_best < 0.75 * plain_best, (slow_best, plain_best)
    assert slow_best > 0.2 * plain_best, "the stretch doubles the time, no more"


def test_timing_arithmetic_with_fake_clock_and_sync():
    events: list[str] = []
    ticks = iter(range(0, 1000, 2))  # every clock read advances 2 s

    def clock():
        events.append("clock")
        return float(next(ticks))

    def matmul(a, b):
        events.append("mm")
        return a

    r = gemm_benchmark(n=10, repeats=3, warmup=1, matmul=matmul, clock=clock, sync=lambda: events.append("sync"))
    assert r.samples == [2.0, 2.0, 2.0] and r.median_s == 2.0
    assert r.flops == 2 * 10**3 / 2.0
    # warm-up, drained, then each repeat: clock, matmul, sync before the clock is read again
    assert events == ["mm", "sync"] + ["clock", "mm", "sync", "clock"] * 3


def test_median_not_mean():
    times = iter([0.0, 1.0, 1.0, 1.5, 1.5, 101.5])  # samples 1, 0.5, 100

    r = gemm_benchmark(n=4, repeats=3, warmup=0, matmul=lambda a, b: a, clock=lambda: next(times))
    assert r.samples == [1.0, 0.5, 100.0] and r.median_s == 1.0


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(n=0), "n must"),
        (dict(n=2.5), "n must"),
        (dict(n=True), "n must"),
        (dict(repeats=0), "repeats must"),
        (dict(warmup=-1), "warmup must"),
        (dict(matmul="torch.matmul"), "matmul must"),
        (dict(sync=3), "sync must"),
        (dict(dtype="float32"), "dtype must"),
        (dict(n=8, clock=lambda: 1.0), "clock is too coarse"),
    ],
)
def test_bad_arguments_are_named(kwargs, word):
    with pytest.raises(ValueError, match=word):
        gemm_benchmark(**kwargs)


def test_gpu_health_never_raises():
    rows = gpu_health()
    assert isinstance(rows, list)
    if not os.path.exists("/dev/nvidiactl"):  # no driver: NVML cannot start
        assert rows == []
    for row in rows:
        assert {"index", "name", "sm_clock_mhz", "max_sm_clock_mhz", "temperature_c", "power_w",
                "power_limit_w", "throttle_reasons", "utilization_gpu_pct"} <= row.keys()


def test_throttle_reasons_decoded():
    assert decode_throttle_reasons(0) == []
    assert decode_throttle_reasons(0x4 | 0x40) == ["sw_power_cap", "hw_thermal_slowdown"]
    assert decode_throttle_reasons(0x1 | 0x2000) == ["gpu_idle", "bit_0x2000"]
