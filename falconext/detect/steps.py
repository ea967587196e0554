"""The fast path's rank side: a step up in one rank's compute, against its own recent level.

A rank's compute (its iteration's time outside collective calls, from its own calls:
detect/scores.py) is flat while its GPU is healthy. A slow GPU steps it up at once and
for good; a data-loader stall or a checkpoint save lifts it for an iteration or three; a
job-wide burst (a loaded host, a shared filesystem's hiccup) lifts every rank's alike.
:class:`ComputeStep` counts, per rank, how many of its latest iterations in a row read at
least ``ratio`` x its own level before them (the *run*), and what its latest few read over
that level (:meth:`ComputeStep.recent_ratio`, run or not); the controller compares the
ranks' recent ratios (control/stragglers.py, :func:`stepped_alone`), so that a run on one
rank while the rest of the job is calm names a straggler, and a burst that lifts every
rank names none, even where it lifts them unevenly and breaks their runs. Where a rank's
compute is itself noisy (a host shared by many processes: the test bed's 16 ranks on two
cores read about 9% apart from one iteration to the next), a step is only a step beyond
that noise: the line is ``noise`` robust standard deviations of the level over it when
that is above ``ratio``. Pure: no clock, no I/O; O(baseline) per
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
    run; one under it ends it, and the run's readings join the level's (a stall's few
    readings barely move a median of ``baseline``; a job drifting up, whose readings cross
    the line now and then, moves it, so the level follows the drift: dropped, they left a
    drifting rank's level behind, its ratio 1.38 on core_v0.19.0's first 30 iterations
    while its peer's, whose readings stayed under its line, read level). A run that lasts
    ``rebase`` readings is the new
    level (the rank has been slow so long that it is how it runs now; the controller has
    had it for ``rebase`` iterations). Readings that are not finite and non-negative are
    ignored. The latest ``recent`` readings, in a run or not, are kept for
    :meth:`recent_ratio`.
    """

    def __init__(self, ratio: float, baseline: int = 16, warm: int = 8, rebase: int = 64,
                 noise: float = 3.0, recent: int = 4) -> None:
        if not ratio > 1.0:
            raise ValueError(f"ratio must be > 1, got {ratio}")
        if not (math.isfinite(noise) and noise >= 0.0):
            raise ValueError(f"noise must be a finite number >= 0, got {noise}")
        if not 1 <= warm <= baseline:
            raise ValueError(f"need 1 <= warm <= baseline, got warm {warm}, baseline {baseline}")
        if rebase < 1:
            raise ValueError(f"rebase must be >= 1, got {rebase}")
        if recent < 1:
            raise ValueError(f"recent must be >= 1, got {recent}")
        self.ratio = ratio
        self.warm = warm
        self.rebase = rebase
        self.noise = noise
        self._level: deque[float] = deque(maxlen=baseline)
        self._run: list[float] = []
        self._recent: deque[float] = deque(maxlen=recent)

    @classmethod
    def from_config(cls, cfg: "FalconConfig | ProfileConfig", ratio: float | None = None) -> "ComputeStep":
        """A counter with the fast path's settings (``fast_*``), at ``ratio`` if given, else
        at ``fast_ratio``; its recent readings are the latest ``fast_iterations``."""
        return cls(ratio or cfg.fast_ratio, cfg.fast_baseline, cfg.fast_warm, cfg.fast_rebase, cfg.fast_noise,
                   cfg.fast_iterations)

    def reset(self) -> None:
        """Forget the level and the run (the rank's work changed: a new plan, a new role)."""
        self._level.clear()
        self._run.clear()
        self._recent.clear()

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
        self._recent.append(compute_s)
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
        self._level.extend(self._run)
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

    def recent_ratio(self) -> float:
        """The median of the latest ``recent`` readings (in a run or not) over the level; 1.0
        while warming up. What a peer compares with: a burst that lifts a rank unevenly
        breaks its run but still shows here."""
        level = self.level()
        if not self._recent or not level:
            return 1.0
        return median(self._recent) / level


def stands_out(ratio: float, others: np.ndarray, line: float) -> bool:
    """Whether a rank's recent ratio stands out of the rest of the job's (``others``,
    readings of the same iterations, at least one): the others are calm (nine in ten of
    them under a third of the way from 1 to ``line``: beside a slow GPU the others' highest
    read 1.002-1.015 in every compare_nvrx case and CI job of 2026-12-03) and the rank reads
    at least ``line`` x their median. A burst lifts every rank, though not alike (two ranks
    sharing a loaded host's cores read 1.37x and 1.18x; a rank that had read flat rose 1.30x
    while three others rose 1.06-1.08x): while the job is not calm nothing stands out, and
    the fast path leaves it to BOCD+V and the score trigger. Ratios are over each rank's own
    level, so ranks of any role compare."""
    if not len(others):
        return False
    calm = float(np.percentile(others, 90)) < 1.0 + (line - 1.0) / 3.0
    return calm and ratio >= line * float(np.median(others))


def stepped_alone(run: np.ndarray, ratio: np.ndarray, known: np.ndarray, iterations: int,
                  line: float) -> list[int]:
    """The positions of the ranks the fast path names from readings of one common
    iteration, steepest first (ties by position): those whose ``run`` is at least
    ``iterations`` long and whose ``ratio`` :func:`stands_out` of the other ``known``
    positions'. All arrays are per rank, in one order; O(n) per rank in a run."""
    cand = np.flatnonzero((run >= iterations) & known)
    if not len(cand) or int(known.sum()) < 2:
        return []
    named: list[tuple[float, int]] = []
    for i in cand.tolist():
        others = known.copy()
        others[i] = False
        if stands_out(float(ratio[i]), ratio[others], line):
            named.append((-float(ratio[i]), i))
    return [i for _, i in sorted(named)]


def judged_at(step_iteration: int, run: int, iterations: int, others_latest: np.ndarray) -> int | None:
    """The step iteration at which to compare a rank in a run with the rest of the job:
    its latest (``step_iteration``) if at least half the others' latest readings
    (``others_latest``, their step iterations) reached it, else the latest that half
    reached; None while that is before the run was ``iterations`` long (wait for the
    others' next readings: comparing a rank's newest with the others' older readings
    misreads a burst that reached them later)."""
    first = step_iteration - run + iterations
    if not len(others_latest):
        return None
    half = np.sort(others_latest)[::-1][(len(others_latest) + 1) // 2 - 1]
    at = min(step_iteration, int(half))
    return at if at >= first else None


__all__ = ["ComputeStep", "judged_at", "stands_out", "stepped_alone"]
