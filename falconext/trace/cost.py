"""What the tracer's wrappers cost the training thread, estimated by sampling.

:class:`HookCost` times a random ~1/n of the wrapper entries with the thread CPU clock
and scales up; ``CallTracer.cost`` holds one.
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable

#: one wrapper entry in this many, on average, is timed with the thread CPU clock
HOOK_SAMPLE_EVERY = 64
#: empty timings taken at start-up to learn what the timing itself adds to a sample
HOOK_CALIBRATION_RUNS = 101


class HookCost:
    """CPU time the tracer's wrappers cost the calling thread, the wrapped calls excluded.

    Reading a thread CPU clock is a system call (~0.5 us here, half a wrapper's own
    cost), so only a sample of wrapper entries is timed. The estimator:

    * every entry (a traced call, a proxy handle's ``wait``, a traced
      ``_coalescing_manager``) decrements ``left``; the entry that takes it to 0 is timed:
      the thread CPU time of the whole wrapper minus that of the wrapped call(s) inside
      it (:meth:`run` with :meth:`timed` around the original), or, for the coalescing
      manager, its own code before and after the manager it wraps (:meth:`add_sample`);
    * the next countdown is drawn uniformly from 1 .. 2n-1 (mean n = ``every``): random,
      so that sampling cannot lock onto one position of a training loop's periodic call
      sequence; the timed entries are then a uniform ~1/n subset of all entries;
    * what the timing itself adds to a sample (the clock reads and the extra call frame)
      is measured at construction: the median of ``calibration`` timings of an empty
      wrapped call (``bias_s``);
    * estimated seconds = ``calls`` x (mean sample - ``bias_s``), never below 0: the
      count of entries is exact, the mean per entry comes from the samples.

    Not counted: attribute forwarding and ``is_completed`` on proxy handles, and the
    ``contextlib`` machinery around the coalescing manager. Entries from several threads
    are counted alike; the timing is of whichever thread runs the sampled entry. A
    sampled entry that nests another entry (a wrapper below ours calling ours) times the
    outer one only. ``clock`` is injectable for tests (default: this thread's CPU clock).
    """

    __slots__ = ("left", "every", "samples", "sampled_s", "bias_s", "_gap", "_passed", "_inner_s", "_busy",
                 "_rng", "_clock")

    def __init__(
        self,
        every: int = HOOK_SAMPLE_EVERY,
        clock: Callable[[], float] = time.thread_time,
        calibration: int = HOOK_CALIBRATION_RUNS,
        seed: int = 0,
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every = int(every)
        self._clock = clock
        self._rng = random.Random(seed)
        #: entries until the next timed one (decremented by the wrappers)
        self.left = 0
        self._gap = 0
        self._passed = 0
        #: entries timed, and their summed seconds (bias included)
        self.samples = 0
        self.sampled_s = 0.0
        self._inner_s = 0.0
        self._busy = False
        #: seconds the timing adds to one sample (see the class docstring)
        self.bias_s = self._calibrate(calibration) if calibration > 0 else 0.0
        self._next_gap()

    @property
    def calls(self) -> int:
        """Wrapper entries so far (exact)."""
        return self._passed + self._gap - self.left

    def seconds(self) -> float:
        """Estimated CPU seconds spent in the wrappers so far (see the class docstring)."""
        if not self.samples:
            return 0.0
        return max(0.0, self.calls * (self.sampled_s / self.samples - self.bias_s))

    def per_call_s(self) -> float:
        """Estimated CPU seconds per wrapper entry (0 before the first sample)."""
        calls = self.calls
        return self.seconds() / calls if calls else 0.0

    def timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with its thread CPU time kept out of the sample it runs in."""
        clock = self._clock

        def inner(*args: Any, **kwargs: Any) -> Any:
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self._inner_s += clock() - t

        return inner

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Call ``fn(*args, **kwargs)`` as a timed entry; its :meth:`timed` parts excluded."""
        if self._busy:  # nested in a timed entry: the outer one is the sample
            return fn(*args, **kwargs)
        self._busy = True
        self._inner_s = 0.0
        clock = self._clock
        t = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = clock() - t - self._inner_s
            self._busy = False
            self.add_sample(spent)
            self.restart()

    def add_sample(self, seconds: float) -> None:
        """Record the seconds of one timed entry (one that took ``left`` to 0)."""
        self.samples += 1
        self.sampled_s += seconds

    def restart(self) -> None:
        """Start the next countdown (once per timed entry, when it ends or, for an entry
        that lets other entries run inside it, when it begins)."""
        self._next_gap()

    def _next_gap(self) -> None:
        self._passed += self._gap - self.left  # left < 0: entries nested in a timed one
        self._gap = self.left = self._rng.randint(1, 2 * self.every - 1)

    def _calibrate(self, runs: int) -> float:
        """Median seconds a timed entry reads when the wrapper does nothing but call
        through (a twin frame and the timed original, as a sampled wrapper has): the
        timing's own cost. Leaves the counters as they were."""
        inner = self.timed(_empty_call)

        def twin(*args: Any, **kwargs: Any) -> Any:
            return inner(*args, **kwargs)

        readings = []
        for _ in range(runs):
            before = self.sampled_s
            self.run(twin, (None,), {"group": None})
            readings.append(self.sampled_s - before)
        self.left = self._gap = self._passed = self.samples = 0
        self.sampled_s = 0.0
        readings.sort()
        return readings[len(readings) // 2]


def _empty_call(*args: Any, **kwargs: Any) -> None:
    """Stands in for a torch.distributed call in :meth:`HookCost._calibrate`."""
    return None


def _empty_call(*args: Any, **kwargs: Any) -> None:
    """Stands in for a torch.distributed call in :meth:`HookCost._calibrate`."""
    return None
