"""Labelled iteration-time traces modelled on the paper's characterization study (§3).

What the study reports, and how it shows up here:
- computation fail-slows (CPU contention, GPU throttling): one per affected job, tens of
  percent slower, lasting minutes (hundreds of iterations), fairly clean steps;
- communication fail-slows (network congestion): more frequent (several per job),
  longer, noisier (inter-node RDMA has a CoV of 0.29), often ladder-shaped, and at scale
  compounded with computation fail-slows;
- healthy jobs are not flat: measurement noise, isolated spikes (checkpoint saves, GC),
  short bursts, periodic fluctuation (evaluation, data loading) and slow drift. None of
  these is a fail-slow, and a detector that reports them is wrong.

Labels are ``[onset, end, slowdown]`` with 0-based iteration indices, ``end`` exclusive
(None if the fail-slow lasts past the end of the trace), ``slowdown`` the peak ratio of
slow to healthy iteration time. Overlapping or touching faults form one label, as the
iteration time alone cannot tell them apart. Everything is drawn from a seeded generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

KINDS = ("compute", "comm", "healthy")
#: fewest iterations between the starts of two healthy bursts
BURST_GAP = 60


@dataclass(frozen=True)
class LabelledTrace:
    """One generated trace: its iteration times, its labels ``[onset, end, slowdown]`` (module docstring),
    its kind and how it was made (``meta``)."""

    id: str
    iter_times: list[float]
    events: list[tuple[int, int | None, float]]
    kind: str
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The trace as one JSONL object that :func:`falconext.detect.series_io.read_series` reads back
        (times to 6 decimals)."""
        return {
            "id": self.id,
            "kind": self.kind,
            "iter_times": [round(x, 6) for x in self.iter_times],
            "events": [[o, e, round(s, 4)] for o, e, s in self.events],
        }


@dataclass(frozen=True)
class _Fault:
    onset: int
    end: int  # exclusive, may be == n (lasts past the trace)
    profile: np.ndarray  # multiplicative factor over [onset, end)
    noise: float  # extra log-noise inside the fault


def _healthy(
    rng: np.random.Generator, n: int, comm: bool, onsets: list[int]
) -> tuple[np.ndarray, dict[str, Any]]:
    """A healthy job: base time times noise, spikes, bursts, periodic wave and drift.

    Bursts are kept out of the BURST_GAP/2 iterations before a fault's onset: a burst
    running into a fault makes the true onset a matter of opinion, not of detection.
    """
    meta: dict[str, Any] = {}
    base = float(rng.uniform(0.15, 3.0))
    sigma = float(rng.uniform(0.01, 0.03) if not comm else rng.uniform(0.02, 0.05))
    if comm and rng.random() < 0.5:
        df = float(rng.uniform(4, 10))
        noise = sigma * rng.standard_t(df, n) / np.sqrt(df / (df - 2))
        meta["noise"] = f"student-t df={df:.1f}"
    else:
        noise = rng.normal(0.0, sigma, n)
    logx = np.full(n, np.log(base)) + noise
    meta.update(base=round(base, 4), sigma=round(sigma, 4))

    if rng.random() < 0.5:  # slow drift: up to +-10% over the whole run
        total = float(rng.uniform(-0.10, 0.10))
        logx += np.log1p(total) * np.linspace(0.0, 1.0, n)
        meta["drift"] = round(total, 3)
    if rng.random() < 0.5:  # periodic fluctuation: a wave of a few percent
        amp = float(rng.uniform(0.01, 0.04))
        period = float(rng.uniform(20, 200))
        logx += np.log1p(amp * np.sin(2 * np.pi * np.arange(n) / period + rng.uniform(0, 2 * np.pi)))
        meta["wave"] = [round(amp, 3), round(period, 1)]
    if rng.random() < 0.4:  # periodic spikes: evaluation or checkpoint every k iterations
        every = int(rng.integers(50, 400))
        height = float(rng.uniform(1.5, 5.0))
        logx[int(rng.integers(0, every)) :: every] += np.log(height)
        meta["periodic_spike"] = [every, round(height, 2)]
    n_spikes = int(rng.poisson(n * float(rng.uniform(0.0, 0.006))))
    for _ in range(n_spikes):  # isolated spikes of 1-3 iterations
        at = int(rng.integers(0, n))
        logx[at : at + int(rng.integers(1, 4))] += np.log(rng.uniform(1.3, 4.0))
    n_bursts = int(rng.poisson(n / 500)) if rng.random() < 0.6 else 0
    # short bursts: slower for 3-10 iterations, then gone; kept apart so that two bursts
    # never merge into a stretch as long as a real (sustained) fail-slow
    starts = np.sort(rng.integers(0, n, n_bursts))
    last = -BURST_GAP
    for at in starts:
        if at - last < BURST_GAP or any(0 <= o - at < BURST_GAP // 2 for o in onsets):
            continue
        logx[at : at + int(rng.integers(3, 11))] += np.log(rng.uniform(1.15, 1.8))
        last = int(at)
    meta.update(spikes=n_spikes, bursts=n_bursts)
    return logx, meta


def _compute_fault(rng: np.random.Generator, n: int, onset: int) -> _Fault:
    length = int(rng.integers(150, 800))
    factor = float(rng.uniform(1.15, 2.0))
    end = min(n, onset + length)
    prof = np.full(end - onset, factor)
    return _Fault(onset, end, prof, float(rng.uniform(0.0, 0.01)))


def _comm_fault(rng: np.random.Generator, n: int, onset: int) -> _Fault:
    length = int(rng.integers(250, 1500))
    end = min(n, onset + length)
    m = end - onset
    steps = int(rng.choice([1, 1, 2, 3]))  # ladder-shaped in about half the cases
    cuts = np.sort(rng.choice(np.arange(40, max(41, m - 40)), size=steps - 1, replace=False)) if steps > 1 and m > 120 else []
    levels = np.sort(rng.uniform(1.2, 2.5, size=len(cuts) + 1))
    if rng.random() < 0.3:
        levels = levels[::-1]  # ladder down: worst first, partial relief, then recovery
    prof = np.empty(m)
    bounds = [0, *[int(c) for c in cuts], m]
    for lv, a, b in zip(levels, bounds[:-1], bounds[1:]):
        prof[a:b] = lv
    ramp = int(rng.integers(1, 8))  # congestion builds up over a few iterations
    prof[:ramp] = 1.0 + (prof[:ramp] - 1.0) * (np.arange(1, ramp + 1) / (ramp + 1))
    return _Fault(onset, end, prof, float(rng.uniform(0.02, 0.08)))


def generate_trace(
    rng: np.random.Generator,
    kind: str,
    n: int = 2000,
    trace_id: str = "trace",
) -> LabelledTrace:
    """One labelled trace of ``kind``: 'compute', 'comm' or 'healthy'."""
    if kind not in KINDS:
        raise ValueError(f"unknown trace kind {kind!r} (choose from {', '.join(KINDS)})")
    comm = kind == "comm"
    faults: list[_Fault] = []
    if kind == "compute":
        faults.append(_compute_fault(rng, n, int(rng.integers(150, n - 200))))
    elif kind == "comm":
        t = int(rng.integers(150, 600))
        while t < n - 150:
            faults.append(_comm_fault(rng, n, t))
            if rng.random() < 0.3:  # compound: a GPU slows down during the congestion
                f = faults[-1]
                inner = int(rng.integers(f.onset + 40, max(f.onset + 41, f.end - 40)))
                if inner < f.end - 40:
                    g = _compute_fault(rng, n, inner)
                    faults.append(_Fault(g.onset, min(g.end, f.end), g.profile[: min(g.end, f.end) - g.onset], 0.0))
            t = max(f.end for f in faults) + int(rng.integers(200, 900))
            if len(faults) >= 4:
                break
    logx, meta = _healthy(rng, n, comm, [f.onset for f in faults])

    factor = np.ones(n)
    extra = np.zeros(n)
    for f in faults:
        factor[f.onset : f.end] *= f.profile
        extra[f.onset : f.end] = np.maximum(extra[f.onset : f.end], f.noise)
    logx = logx + np.log(factor) + rng.normal(0.0, 1.0, n) * extra
    times = np.exp(logx)
    return LabelledTrace(trace_id, times.tolist(), _labels(factor, n), kind, meta)


def _labels(factor: np.ndarray, n: int) -> list[tuple[int, int | None, float]]:
    """Contiguous runs of factor > 1 become one label each."""
    slow = factor > 1.0 + 1e-9
    labels: list[tuple[int, int | None, float]] = []
    i = 0
    while i < n:
        if not slow[i]:
            i += 1
            continue
        j = i
        while j < n and slow[j]:
            j += 1
        labels.append((i, j if j < n else None, float(factor[i:j].max())))
        i = j
    return labels


def generate_traces(
    count: int, kinds: str | Sequence[str] = "mixed", seed: int = 0, n: int = 2000
) -> list[LabelledTrace]:
    """A labelled set drawing ``kinds`` in turn ('mixed' = compute, comm and healthy)."""
    rng = np.random.default_rng(seed)
    if isinstance(kinds, str):
        kinds = list(KINDS) if kinds == "mixed" else [kinds]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ValueError(f"unknown trace kind {bad[0] if bad else ''!r} (choose from mixed, {', '.join(KINDS)})")
    return [generate_trace(rng, kinds[i % len(kinds)], n, f"{kinds[i % len(kinds)]}-{seed}-{i}") for i in range(count)]
