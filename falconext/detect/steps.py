"""The fast path's rank side: a step up in one rank's compute, against its own recent level.

A rank's compute (its iteration's time outside collective calls, from its own calls:
detect/scores.py) is flat while its GPU is healthy. A slow GPU steps it up at once and
for good; a data-loader stall or a checkpoint save lifts it for an iteration or three; a
job-wide burst lifts every rank's alike. :class:`ComputeStep` counts, per rank, how many
of its latest iterations in a row read at least ``ratio`` x its own level before them
(the *run*); the controller compares runs across peers (control/stragglers.py), so that
a run on one rank while its peers read level names a straggler, and a run on all of them
names none. Where a rank's compute is itself noisy (a host shared by many processes: the
test bed's 16 ranks on two cores read about 9% apart from one iteration to the next), a
step is only a step beyond that noise: the line is ``noise`` robust standard deviations of
the level over it when that is above ``ratio``. Pure: no clock, no I/O; O(baseline) per
iteration.
"""

from __future__ import annotations

import math
from collections import deque
from statistics import median
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from falconext.config import FalconConfig, ProfileConfig


class ComputeStep:
    """One rank's run of iterations whose compute stepped up against its own level.

    The level is the median of the latest ``baseline`` readings outside any run, judged
    from ``warm`` readings on (no run before). A reading at or over the line (:meth:`line`:
    ``ratio`` x the level, or the level plus ``noise`` x its readings' robust standard
    deviation, 1.4826 x their median absolute deviation, whichever is higher) extends the
    run; one under it ends it, and the run's readings are dropped (a short stall must not
    raise the level). A run that lasts ``rebase`` readings is the new
    level (the rank has been slow so long that it is how it runs now; the controller has
    had it for ``rebase`` iterations). Readings that are not finite and non-negative are
    ignored.
    """

    def __init__(self, ratio: float, baseline: int = 16, warm: int = 8, rebase: int = 64,
                 noise: float = 3.0) -> None:
        if not ratio > 1.0:
            raise ValueError(f"ratio must be > 1, got {ratio}")
        if not (math.isfinite(noise) and noise >= 0.0):
            raise ValueError(f"noise must be a finite number >= 0, got {noise}")
        if not 1 <= warm <= baseline:
            raise ValueError(f"need 1 <= warm <= baseline, got warm {warm}, baseline {baseline}")
        if rebase < 1:
            raise ValueError(f"rebase must be >= 1, got {rebase}")
        self.ratio = ratio
        self.warm = warm
        self.rebase = rebase
        self.noise = noise
        self._level: deque[float] = deque(maxlen=baseline)
        self._run: list[float] = []

    @classmethod
    def from_config(cls, cfg: "FalconConfig | ProfileConfig", ratio: float | None = None) -> "ComputeStep":
        """A counter with the fast path's settings (``fast_*``), at ``ratio`` if given, else
        at ``fast_ratio``."""
        return cls(ratio or cfg.fast_ratio, cfg.fast_baseline, cfg.fast_warm, cfg.fast_rebase, cfg.fast_noise)

    def reset(self) -> None:
        """Forget the level and the run (the rank's work changed: a new plan, a new role)."""
        self._level.clear()
        self._run.clear()

    def level(self) -> float | None:
        """The rank's level (median compute outside runs); None while warming up."""
        return median(self._level) if len(self._level) >= self.warm else None

    def line(self) -> float | None:
        """The compute a reading must reach to extend a run: the higher of ``ratio`` x the
        level and the level plus ``noise`` robust standard deviations of its readings; None
        while warming up."""
        level = self.level()
        if level is None:
            return None
        spread = 1.4826 * median(abs(x - level) for x in self._level) if self.noise else 0.0
        return max(self.ratio * level, level + self.noise * spread)

    def feed(self, compute_s: float) -> int:
        """Add the compute seconds of the rank's next iteration; the run's length after it."""
        if not (math.isfinite(compute_s) and compute_s >= 0.0):
            return len(self._run)
        line = self.line()
        if line is None:
            self._level.append(compute_s)
            return 0
        if compute_s >= line and line > 0.0:
            self._run.append(compute_s)
            if len(self._run) >= self.rebase:
                self._level.extend(self._run)
                self._run.clear()
            return len(self._run)
        self._run.clear()
        self._level.append(compute_s)
        return 0

    @property
    def run(self) -> int:
        """Readings in the current run (0: the rank reads level)."""
        return len(self._run)

    def run_ratio(self) -> float:
        """The run's median compute over the level; 1.0 with no run or while warming up."""
        level = self.level()
        if not self._run or not level:
            return 1.0
        return median(self._run) / level


def stepped_alone(run: np.ndarray, ratio: np.ndarray, group: np.ndarray, known: np.ndarray, iterations: int,
                  line: float) -> list[int]:
    """The positions of the ranks the fast path names, steepest first (ties by position):
    those whose ``run`` is at least ``iterations`` long and whose peers (the other ``known``
    positions of the same ``group``, at least one) read a median ``ratio`` under ``line`` (a
    burst lifts every rank of a group: it names none). All arrays are per rank, in one order."""
    cand = np.flatnonzero((run >= iterations) & known)
    named: list[tuple[float, int]] = []
    for i in cand.tolist():
        peers = known & (group == group[i])
        peers[i] = False
        if peers.any() and float(np.median(ratio[peers])) < line:
            named.append((-float(ratio[i]), i))
    return [i for _, i in sorted(named)]


__all__ = ["ComputeStep", "stepped_alone"]
