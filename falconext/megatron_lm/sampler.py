"""S2 inside Megatron-LM: which samples each DP replica trains on, per global batch (pure).

Megatron-LM's ``MegatronPretrainingSampler`` gives replica ``r`` micro-batch ``k`` of a global
batch as samples ``start + (k * dp + r) * mbs ...`` (interleaved). A micro-batch plan
(``plan[r]`` micro-batches for replica ``r``, summing to the global batch's micro-batches)
keeps the global batch's samples and only moves them between replicas: replica ``r`` takes
the contiguous run of ``plan[r] * mbs`` samples that starts after the runs of replicas
``0 .. r-1``. With ``--calculate-per-token-loss`` the gradient is the sum over the same
samples divided by the same token count, so it is the even plan's gradient up to float
rounding.

A plan takes effect from a global batch (iteration) that every rank agrees on, and the
data loader prefetches, so :class:`PlanSchedule` keeps the plan *per iteration*: the
sampler and the forward-backward count read the same entry, whenever each reads it.
"""

from __future__ import annotations

import bisect
import threading
from typing import Iterator


class PlanError(ValueError):
    """A micro-batch plan that this job cannot run."""


def check_plan(plan: list[int], dp: int, microbatches: int) -> list[int]:
    """``plan`` as a list of ``dp`` positive ints summing to ``microbatches``, or PlanError."""
    if not isinstance(plan, (list, tuple)) or len(plan) != dp:
        raise PlanError(f"a micro-batch plan needs one count per DP replica ({dp}), got {plan!r}")
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in plan):
        raise PlanError(f"micro-batch counts must be integers >= 1, got {plan!r}")
    if sum(plan) != microbatches:
        raise PlanError(f"a micro-batch plan must sum to the global batch's {microbatches} micro-batches, "
                        f"got {list(plan)} (sum {sum(plan)})")
    return [int(c) for c in plan]


class PlanSchedule:
    """Micro-batch plans by first iteration (thread-safe; None: Megatron's even split)."""

    def __init__(self, dp: int, microbatches: int) -> None:
        self.dp = dp
        self.microbatches = microbatches
        self._starts: list[int] = []
        self._plans: list[list[int] | None] = []
        self._lock = threading.Lock()

    def set(self, from_iteration: int, plan: list[int] | None) -> None:
        """From ``from_iteration`` on, ``plan`` (checked); later entries are dropped."""
        if plan is not None:
            plan = check_plan(plan, self.dp, self.microbatches)
            if plan == [self.microbatches // self.dp] * self.dp and self.microbatches % self.dp == 0:
                plan = None  # the even plan: Megatron's own order
        with self._lock:
            k = bisect.bisect_left(self._starts, from_iteration)
            del self._starts[k:], self._plans[k:]
            self._starts.append(int(from_iteration))
            self._plans.append(plan)

    def plan_at(self, iteration: int) -> list[int] | None:
        """The plan of ``iteration`` (None: the even split)."""
        with self._lock:
            k = bisect.bisect_right(self._starts, iteration) - 1
            return self._plans[k] if k >= 0 else None

    def count(self, iteration: int, replica: int) -> int:
        """Micro-batches replica ``replica`` runs in ``iteration``."""
        plan = self.plan_at(iteration)
        return self.microbatches // self.dp if plan is None else plan[replica]


def replica_microbatches(start: int, mbs: int, dp: int, replica: int, plan: list[int] | None,
                         microbatches: int) -> list[list[int]]:
    """The sample indices of each micro-batch replica ``replica`` trains on in the global
    batch that starts at sample ``start``: Megatron's interleaved order under the even plan
    (None), the replica's contiguous run under ``plan``."""
    if plan is None:
        per = microbatches // dp
        return [list(range(start + (k * dp + replica) * mbs, start + (k * dp + replica + 1) * mbs))
                for k in range(per)]
    first = start + sum(plan[:replica]) * mbs
    return [list(range(first + k * mbs, first + (k + 1) * mbs)) for k in range(plan[replica])]


class PlannedSampler:
    """Megatron's training batch sampler with S2 plans: yields this replica's micro-batches
    (lists of sample indices), global batch after global batch, from ``consumed_samples``.

    Iteration ``g`` of the job is the global batch starting at sample ``g * global_batch``
    (a job with a batch-size ramp-up is refused before this is built).
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, global_batch_size: int,
                 replica: int, schedule: PlanSchedule) -> None:
        if global_batch_size != schedule.microbatches * micro_batch_size:
            raise PlanError(f"global batch {global_batch_size} is not micro-batches ({schedule.microbatches}) "
                            f"x micro-batch size ({micro_batch_size})")
        if consumed_samples % global_batch_size:
            raise PlanError(f"consumed samples {consumed_samples} is not a whole number of global batches "
                            f"of {global_batch_size}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.replica = replica
        self.schedule = schedule

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[list[int]]:
        start = self.consumed_samples
        while start + self.global_batch_size <= self.total_samples:
            it = start // self.global_batch_size
            yield from replica_microbatches(start, self.micro_batch_size, self.schedule.dp, self.replica,
                                            self.schedule.plan_at(it), self.schedule.microbatches)
            start += self.global_batch_size
