"""GEMM benchmark that tells a slow GPU from a healthy one during validation.

The validation plan compares the FLOP/s of suspect ranks with their median (see
``verdict.slow_ranks``), so one number per rank is enough; the median of several
repeats keeps a single preempted repeat from condemning a healthy device.

``matmul`` is a parameter because on the CPU test bed a "slow GPU" is a fault injector
that stretches compute: the experiment harness passes its stretched matmul here, and the
benchmark must see exactly what training sees.

Timing: on CUDA (``device`` starting with "cuda") and no explicit ``sync``, each repeat
is timed with CUDA events, which measure the device stream without a host round trip
per repeat; host-side stretching between the two records still counts, because the end
event cannot be recorded before the host gets there. Otherwise the host ``clock`` is
read around each repeat, after ``sync()`` when one is given (on CUDA that would be
``torch.cuda.synchronize``; kernels are asynchronous and the clock would see launches only).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class GemmResult:
    """A GEMM benchmark's outcome: FLOP/s of the median and of the fastest repeat, and every repeat's
    seconds."""

    flops: float  # FLOP/s of the median repeat
    median_s: float
    samples: list[float]  # seconds per repeat, in run order
    best_flops: float  # FLOP/s of the fastest repeat


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"gemm_benchmark: {name} must be an integer >= {low}, got {value!r}")
    return value


def gemm_benchmark(
    n: int = 256,
    repeats: int = 10,
    warmup: int = 2,
    *,
    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.matmul,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    sync: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> GemmResult:
    """Time ``matmul`` on two n x n matrices; 2 n^3 FLOP per repeat, median over repeats."""
    _check_int("n", n, 1)
    _check_int("repeats", repeats, 1)
    _check_int("warmup", warmup, 0)
    if not callable(matmul):
        raise ValueError(f"gemm_benchmark: matmul must be callable, got {matmul!r}")
    if sync is not None and not callable(sync):
        raise ValueError(f"gemm_benchmark: sync must be callable or None, got {sync!r}")
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"gemm_benchmark: dtype must be a torch.dtype, got {dtype!r}")
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    use_events = str(device).startswith("cuda") and sync is None

    for _ in range(warmup):
        matmul(a, b)
    samples = _time_events(matmul, a, b, repeats) if use_events else _time_clock(matmul, a, b, repeats, sync, clock)

    median_s = statistics.median(samples)
    if not min(samples) > 0:
        raise ValueError(
            f"gemm_benchmark: a repeat time of {min(samples)!r} s is not positive; "
            f"the clock is too coarse for n={n} (raise n)"
        )
    # best_flops is what validation compares: on a shared host noise only ever adds time,
    # so the fastest repeat is the steadiest reading of what the device can do.
    return GemmResult(
        flops=2.0 * n**3 / median_s, median_s=median_s, samples=samples, best_flops=2.0 * n**3 / min(samples)
    )


def _time_clock(matmul, a, b, repeats: int, sync, clock) -> list[float]:
    samples = []
    if sync is not None:
        sync()  # warm-up kernels must not land in the first repeat
    for _ in range(repeats):
        t0 = clock()
        matmul(a, b)
        if sync is not None:
            sync()
        samples.append(float(clock() - t0))
    return samples


def _time_events(matmul, a, b, repeats: int) -> list[float]:
    pairs = []
    with torch.cuda.device(a.device):  # events record on the current stream of a's device
        torch.cuda.synchronize()
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            matmul(a, b)
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in pairs]
