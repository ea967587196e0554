"""A healthy job's day of collective calls, with the noise real jobs have, for counting
false alarms per job-day (falconext eval-detect --job-day: detect/jobday.py).

Model: a data-parallel job of ``ranks`` ranks. Every iteration each rank computes (its
forward and backward), then all-reduces its gradients in ``buckets`` calls; a collective
ends when its last member has arrived plus the transfer, so a rank that computes longer
makes its peers wait inside the call (unlike sim/calllog.py, whose calls never block:
there a late rank only delays the next iteration's start). Then the optimizer step, and,
as Megatron-LM does:

- every ``log_interval``-th iteration, the timers' all-gather;
- every ``eval_every``-th, an evaluation: ``eval_steps`` forwards, each with its loss
  all-reduce;
- every ``checkpoint_every``-th, a checkpoint save (rank 0 writes, the others wait at the
  barrier that ends it);
- once, at ``restart_at``, the job restarts (every rank's process starts over after
  ``restart_s``).

Noise: job-wide jitter (every rank alike), per-rank jitter, job-wide bursts (every rank's
compute or every transfer slower for 1-8 iterations), and data-loader stalls on one rank
for 1-3 iterations. Nothing here is a fail-slow: a detector that raises anything on it
raised a false alarm. Pure and seeded: the same spec and seed give the same calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from falconext.trace.records import CallRecord


@dataclass(frozen=True)
class JobDaySpec:
    """What a healthy job-day looks like (module docstring); ``iterations`` of about
    ``compute_s`` + the gradients' transfer + ``step_s`` seconds each (1 s by default: a day)."""

    ranks: int = 8
    iterations: int = 86_400
    compute_s: float = 0.80
    buckets: int = 4
    bucket_bytes: int = 40_000_000
    bandwidth: float = 2e9  # bytes/s: a bucket's transfer
    step_s: float = 0.06  # the optimizer step, after the gradients
    job_jitter: float = 0.02  # log-normal sigma of the job-wide factor per iteration
    rank_jitter: float = 0.02  # log-normal sigma of each rank's own factor per iteration
    burst_every: float = 1500.0  # mean iterations between job-wide bursts
    burst_factor: tuple[float, float] = (1.2, 2.0)
    stall_every: float = 2500.0  # mean iterations between data-loader stalls (one rank each)
    stall_s: tuple[float, float] = (0.3, 3.0)
    log_interval: int = 10
    eval_every: int = 2000
    eval_steps: int = 10
    eval_compute_s: float = 0.25
    checkpoint_every: int = 1000
    checkpoint_s: float = 12.0
    restart_at: int | None = 43_200
    restart_s: float = 90.0
    #: (rank, factor, first iteration): that rank's compute this many times slower from then
    #: on; not a healthy day (what checks that the evaluation sees a fail-slow at all)
    fault: tuple[int, float, int] | None = None

    def __post_init__(self) -> None:
        if self.ranks < 2:
            raise ValueError(f"ranks must be >= 2, got {self.ranks}")
        if self.iterations < 1 or self.buckets < 1:
            raise ValueError("iterations and buckets must be >= 1")
        if min(self.log_interval, self.eval_every, self.checkpoint_every) < 0:
            raise ValueError("log_interval, eval_every and checkpoint_every must be >= 0 (0: never)")


@dataclass(frozen=True)
class JobDay:
    """A generated day: per iteration, when it started (``starts``, plus the end of the
    last), and the iterations at which every process started over (``restarts``)."""

    spec: JobDaySpec
    seed: int
    starts: np.ndarray
    restarts: tuple[int, ...]
    #: (iteration, rank) of each data-loader stall's first iteration; (first, last) of each burst
    stalls: tuple[tuple[int, int], ...]
    bursts: tuple[tuple[int, int], ...]
    _plan: dict

    @property
    def seconds(self) -> float:
        """The day's length in seconds (first start to last end)."""
        return float(self.starts[-1] - self.starts[0])

    def records(self, rank: int) -> Iterator[CallRecord | None]:
        """``rank``'s calls in issue order; None where its process starts over (what came
        before belongs to a process that is gone)."""
        p, s = self._plan, self.spec
        group = "dp:" + ",".join(map(str, range(s.ranks)))
        seq = 0
        restart = set(self.restarts)
        for i in range(s.iterations):
            if i in restart:
                yield None
                seq = 0
            arrive, ends = p["arrive"][i], p["bucket_end"][i]
            for j in range(s.buckets):
                yield CallRecord(rank, "all_reduce", group, s.bucket_bytes, float(arrive[j, rank]), None,
                                 float(ends[j]), seq)
                seq += 1
            t = float(p["after_step"][i])
            if s.log_interval and (i + 1) % s.log_interval == 0:
                yield CallRecord(rank, "all_gather", group, 64 * s.ranks, t, None, t + 2e-4, seq)
                seq += 1
                t += 2e-4
            if s.eval_every and (i + 1) % s.eval_every == 0:
                for k in range(s.eval_steps):
                    a = float(p["eval_arrive"][i][k, rank])
                    yield CallRecord(rank, "all_reduce", group, 4, a, None, float(p["eval_end"][i][k]), seq)
                    seq += 1
            if s.checkpoint_every and (i + 1) % s.checkpoint_every == 0:
                a = float(p["ckpt_arrive"][i][rank])
                yield CallRecord(rank, "barrier", group, 4, a, None, float(p["ckpt_end"][i]), seq)
                seq += 1


def generate_day(spec: JobDaySpec = JobDaySpec(), seed: int = 0) -> JobDay:
    """Simulate ``spec`` with ``seed``: every rank's arrival at every collective, and when
    each collective and iteration ends (module docstring)."""
    rng = np.random.default_rng(seed)
    n, r = spec.iterations, spec.ranks
    job = np.exp(spec.job_jitter * rng.standard_normal(n) - spec.job_jitter ** 2 / 2)
    own = np.exp(spec.rank_jitter * rng.standard_normal((n, r)) - spec.rank_jitter ** 2 / 2)
    compute = spec.compute_s * job[:, None] * own
    transfer = np.full(n, spec.bucket_bytes / spec.bandwidth)
    bursts: list[tuple[int, int]] = []
    i = int(rng.exponential(spec.burst_every))
    while i < n:
        length = int(rng.integers(1, 9))
        factor = float(rng.uniform(*spec.burst_factor))
        if rng.random() < 0.5:
            compute[i:i + length] *= factor  # every GPU slower: a shared power or thermal event
        else:
            transfer[i:i + length] *= factor  # every transfer slower: the fabric
        bursts.append((i, min(i + length, n) - 1))
        i += length + int(rng.exponential(spec.burst_every))
    stalls: list[tuple[int, int]] = []
    i = int(rng.exponential(spec.stall_every))
    while i < n:
        rank, length = int(rng.integers(r)), int(rng.integers(1, 4))
        compute[i:i + length, rank] += rng.uniform(*spec.stall_s, size=len(compute[i:i + length]))
        stalls.append((i, rank))
        i += length + int(rng.exponential(spec.stall_every))
    if spec.fault is not None:
        rank, factor, first = spec.fault
        compute[first:, rank] *= factor
    restarts = (spec.restart_at,) if spec.restart_at is not None and 0 < spec.restart_at < n else ()

    starts = np.empty(n + 1)
    plan: dict = {"arrive": [], "bucket_end": [], "after_step": np.empty(n), "eval_arrive": {}, "eval_end": {},
                  "ckpt_arrive": {}, "ckpt_end": {}}
    t = 1.0
    gap = 2e-3  # compute between two buckets (the backward pass's last layers)
    for i in range(n):
        if i in restarts:
            t += spec.restart_s
        starts[i] = t
        arrive = np.empty((spec.buckets, r))
        ends = np.empty(spec.buckets)
        a = t + compute[i]
        for j in range(spec.buckets):
            arrive[j] = a
            ends[j] = a.max() + transfer[i]
            a = ends[j] + gap * own[i]
        plan["arrive"].append(arrive)
        plan["bucket_end"].append(ends)
        t = ends[-1] + spec.step_s * job[i]
        plan["after_step"][i] = t
        if spec.log_interval and (i + 1) % spec.log_interval == 0:
            t += 2e-4
        if spec.eval_every and (i + 1) % spec.eval_every == 0:
            ea, ee = np.empty((spec.eval_steps, r)), np.empty(spec.eval_steps)
            for k in range(spec.eval_steps):
                ea[k] = t + spec.eval_compute_s * job[i] * rng.lognormal(0.0, spec.rank_jitter, r)
                ee[k] = ea[k].max() + 1e-4
                t = ee[k]
            plan["eval_arrive"][i], plan["eval_end"][i] = ea, ee
        if spec.checkpoint_every and (i + 1) % spec.checkpoint_every == 0:
            ca = np.full(r, t + 0.2)
            ca[0] = t + spec.checkpoint_s * float(rng.uniform(0.8, 1.2))  # rank 0 writes
            plan["ckpt_arrive"][i], plan["ckpt_end"][i] = ca, float(ca.max() + 1e-4)
            t = plan["ckpt_end"][i]
    starts[n] = t
    return JobDay(spec, seed, starts, restarts, tuple(stalls), tuple(bursts), plan)


__all__ = ["JobDay", "JobDaySpec", "generate_day"]
