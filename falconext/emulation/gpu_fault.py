"""A compute fault on a real CUDA device: a busy kernel on the rank's stream.

The emulated device stretches its modelled compute (:mod:`falconext.emulation.emulator`); a
real GPU is slowed the way a throttled one would be: at the start of each faulty iteration
one kernel that spins (``torch.cuda._sleep``) is queued on the current stream, so the
iteration's work waits behind it. It lasts ``(factor - 1)`` times the healthy iteration
time, the median of the loop's own iteration times before the fault began, so a 2x fault
doubles the iteration. Like the rest of the test bed this is an experiment tool: nothing in
detect/, profile/, validate/ or mitigate/ reads it.
"""

from __future__ import annotations

import statistics
from typing import Callable

from falconext.model.faults import Fault, compute_factor

#: cycles of the calibration kernel (a few milliseconds on a current GPU)
CALIBRATION_CYCLES = 10_000_000
#: the healthy reference is the median of at most this many iterations before the fault
REFERENCE_ITERATIONS = 20


def busy_seconds(factor: float, healthy_s: float) -> float:
    """Seconds of extra work a ``factor`` fault adds to an iteration of ``healthy_s``
    (0 for a healthy factor, never negative)."""
    return max(0.0, (factor - 1.0) * healthy_s)


def healthy_reference(loop_s: list[tuple[int, float]], before: int, skip: int = 3) -> float | None:
    """The median of the loop's iteration times ``(iteration, seconds)`` for iterations
    before ``before``, the first ``skip`` iterations (start-up) left out, over at most
    :data:`REFERENCE_ITERATIONS` of them; None when there is none."""
    times = [s for it, s in loop_s if it < before and s > 0]
    times = times[skip:] if len(times) > skip else times
    times = times[-REFERENCE_ITERATIONS:]
    return statistics.median(times) if times else None


class BusyKernel:
    """Applies this process's compute faults on its CUDA device, once per iteration.

    ``sleep(cycles)`` queues the busy kernel and ``cycles_per_s`` converts seconds to its
    cycles; both default to torch.cuda's (``_sleep`` and a calibration timed with CUDA
    events) and are injected by tests, which have no GPU."""

    def __init__(self, faults: list[Fault], process: int, sleep: Callable[[int], None] | None = None,
                 cycles_per_s: float | None = None) -> None:
        self.faults = [f for f in faults if f.kind == "compute" and f.rank == process]
        self.process = process
        self._sleep = sleep
        self._cycles_per_s = cycles_per_s
        #: the healthy iteration time each fault's busy time is a multiple of (None: not yet known)
        self.healthy_s: float | None = None
        #: seconds queued, by iteration
        self.queued: dict[int, float] = {}

    def _calibrate(self) -> float:
        import torch  # lazy: start-up time (the launcher imports megatron_lm.hooks: no torch there)

        torch.cuda._sleep(CALIBRATION_CYCLES)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(CALIBRATION_CYCLES)
        end.record()
        end.synchronize()
        return CALIBRATION_CYCLES / (start.elapsed_time(end) / 1e3)

    def at(self, iteration: int, loop_s: list[tuple[int, float]]) -> float:
        """Iteration ``iteration`` starts: queue its busy kernel when a fault is in force.
        ``loop_s`` are the loop's iteration times so far. Returns the seconds queued."""
        factor = compute_factor(self.faults, self.process, iteration)
        if factor <= 1.0:
            return 0.0
        if self.healthy_s is None:
            start = min(f.start for f in self.faults if f.active(iteration))
            self.healthy_s = healthy_reference(loop_s, start)
            if self.healthy_s is None:  # a fault from the first iteration: nothing to scale
                return 0.0
        seconds = busy_seconds(factor, self.healthy_s)
        if self._sleep is None:
            import torch  # lazy: start-up time (the launcher imports megatron_lm.hooks: no torch there)

            self._sleep = torch.cuda._sleep
        if self._cycles_per_s is None:
            self._cycles_per_s = self._calibrate()
        self._sleep(int(seconds * self._cycles_per_s))
        self.queued[iteration] = seconds
        return seconds
