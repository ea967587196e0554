"""The score trigger: every rank's straggler score from its latest heartbeat
(detect/scores.py), once per ``score_interval_s``, and the straggler the scores show
often enough to be localized without a report; and the fast path: a rank whose compute
stepped up against its own level for ``fast_iterations`` iterations while the rest of the
job's, read at the same iteration, did not (detect/steps.py), localized at once
(:class:`StragglerWatch`)."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np

from falconext.config import FalconConfig
from falconext.control.beat_table import columns
from falconext.control.episodes import Episode, Sighting
from falconext.protocol.messages import Heartbeat
from falconext.control.outputs import Output, event
from falconext.detect.steps import judged_at, stands_out
from falconext.detect.scores import ScoreTable, compute_outliers, role_key, score_values, scores_of, slowest, slowest_listed


#: ranks in a run the fast path judges against the rest of the job per call, steepest
#: first (each an O(ranks x heartbeat_history) read of the kept readings)
FAST_CHECKED = 8


def step_ratios(beats: Mapping[int, Heartbeat], history: Mapping[int, Iterable[Any]],
                iteration: int) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's fast-path ratio as of step iteration ``iteration`` (from its kept
    reading with the lowest step iteration at or after it, the newest of equals), in the
    order of ``beats``, and whether it has one: read from the table at once where ``history`` is the controller's
    (KeptReadings), else from each rank's kept heartbeats."""
    if hasattr(history, "step_ratios"):
        return history.step_ratios(iteration)
    ratio, found = np.ones(len(beats)), np.zeros(len(beats), dtype=bool)
    for k, r in enumerate(beats):
        kept = [(b.step_iteration, -j, b.step_ratio) for j, b in enumerate(history.get(r, ()))
                if getattr(b, "step_iteration", -1) >= iteration]
        if kept:
            ratio[k], found[k] = min(kept)[2], True
    return ratio, found


@dataclass(frozen=True)
class Suspect:
    """A rank the scores show as a straggler, ready to be localized: its compute over
    its peers' (``ratio``), where its run of slow readings began (``onset``), the
    iteration of its latest heartbeat, that heartbeat's iteration time, and its healthy
    time before the onset (None: no reading before it)."""

    rank: int
    ratio: float
    onset: int
    iteration: int
    level_s: float
    baseline_s: float | None
    #: what named it: "scores" (the score trigger) or "fast" (the fast path)
    by: str = "scores"

    def episode(self, now: float) -> Episode:
        """A fail-slow episode opened at ``now`` by this suspect, its sighting the fault's
        onset, the healthy time before it and its level now."""
        return Episode("fail_slow", now, suspected=self.rank, sightings=[Sighting(self.onset, self.baseline_s,
                                                                                  self.level_s)])

    def fields(self) -> dict[str, Any]:
        """The ``straggler_suspected`` event's fields."""
        return {"rank": self.rank, "compute_ratio": round(self.ratio, 4), "onset": self.onset,
                "iteration": self.iteration, "by": self.by}


@dataclass(frozen=True)
class Samples:
    """The scored ranks' latest figures (those whose heartbeat carries a score sample), a
    quantity at a time, each list in the same rank order: their estimated iteration,
    compute and wait seconds, role keys (:func:`~falconext.detect.scores.role_key`) and
    compute per micro-batch; ``iteration``: the oldest sample's loop iteration (-1: none)."""

    ranks: list[int]
    iter_s: list[float]
    compute_s: list[float]
    wait_s: list[float]
    roles: list[Any]
    mb_s: list[float]
    iteration: int

    def scores(self) -> ScoreTable:
        """Every scored rank's score against its peers (:func:`~falconext.detect.scores.scores_of`)."""
        return scores_of(self.ranks, self.iter_s, self.compute_s, self.wait_s, self.roles)


def scored_samples(beats: Mapping[int, Heartbeat]) -> Samples:
    """:class:`Samples` of the ranks in ``beats`` with a score sample, read a column at a
    time (from the controller's table without making a Heartbeat per rank)."""
    rank, score_it, est, compute, wait, stage, role, tp, mb = columns(
        beats, "rank", "score_iteration", "est_iter_s", "compute_s", "wait_s", "stage", "role", "tp", "mb_s")
    at = np.flatnonzero(score_it >= 0)
    roles = list(map(role_key, stage[at].astype(int).tolist(), role[at].astype(int).tolist(),
                     tp[at].astype(int).tolist()))
    return Samples(rank[at].astype(int).tolist(), est[at].tolist(), compute[at].tolist(), wait[at].tolist(), roles,
                   mb[at].tolist(), int(score_it[at].min()) if len(at) else -1)


class StragglerWatch:
    """When the scores are due, and each outlier's run of fresh readings."""

    def __init__(self) -> None:
        """Scores due at once; no outlier seen yet."""
        self.next_scores = -math.inf  # when the next rank_scores event is due
        #: ranks the scores show as stragglers: (fresh readings in a row, the iteration of the
        #: last counted), and those already acted on (until they read normal again)
        self.outliers: dict[int, tuple[int, int]] = {}
        self.acted: set[int] = set()
        #: ranks the fast path acted on, until their run ends
        self.fast_acted: set[int] = set()
        #: every scored rank's score at the latest rank_scores (None: none yet), which the
        #: status snapshot shows rather than scoring 100k ranks again every second
        self.latest: dict[int, Any] | None = None

    def forget(self) -> None:
        """Every process restarted: the outliers seen are of processes that are gone."""
        self.outliers.clear()
        self.acted.clear()
        self.fast_acted.clear()
        self.latest = None

    def act(self, s: Suspect) -> None:
        """``s`` is being localized: neither path names its rank again until it reads normal."""
        (self.fast_acted if s.by == "fast" else self.acted).add(s.rank)

    def fast(self, beats: Mapping[int, Heartbeat], history: Mapping[int, Iterable[Heartbeat]],
             cfg: FalconConfig) -> Suspect | None:
        """The fast path's straggler, if any: of the ranks whose latest heartbeat shows a run
        of at least ``fast_iterations`` iterations of compute stepped up against their own
        level (detect/steps.py), the steepest not acted on whose recent ratio, at an
        iteration the others' readings have reached (:func:`~falconext.detect.steps.judged_at`),
        :func:`~falconext.detect.steps.stands_out` of theirs (ranks with a known role, at
        least half of them with a reading that far): a step on one rank that a job-wide
        burst, which lifts every rank, cannot make. No rank while more than half the job is
        in such a run (a burst), and at most ``FAST_CHECKED`` ranks judged a call. Ranks
        whose run ended are forgotten. Costs a few column reads while no rank has such a
        run."""
        if not cfg.fast_ratio:
            return None
        rank, run, ratio, step_it = columns(beats, "rank", "step_run", "step_ratio", "step_iteration")
        if self.fast_acted:
            running = set(rank[run > 0].astype(int).tolist())
            self.fast_acted &= running
        cand = np.flatnonzero(run >= cfg.fast_iterations)
        if not len(cand):
            return None
        stage, role = columns(beats, "stage", "role")
        known = (stage >= 0) & (role >= 0) & (step_it >= 0)
        cand = cand[known[cand]]
        if 2 * len(cand) > int(known.sum()):
            return None
        checked = 0
        for i in sorted(cand.tolist(), key=lambda k: (-ratio[k], k)):
            r = int(rank[i])
            if r in self.fast_acted or r in self.acted:
                continue
            if checked == FAST_CHECKED:
                break
            checked += 1
            others = known.copy()
            others[i] = False
            at = judged_at(int(step_it[i]), int(run[i]), cfg.fast_iterations, step_it[others])
            if at is None:
                continue
            then, found = step_ratios(beats, history, at)
            peers = others & found
            if not found[i] or 2 * int(peers.sum()) < int(others.sum()):
                continue
            if not stands_out(float(then[i]), then[peers], cfg.fast_ratio):
                continue
            beat = beats[r]
            onset = int(step_it[i]) - int(run[i]) + 1
            before = [b.iter_s for b in history.get(r, ()) if b.iteration < onset and b.iter_s > 0]
            return Suspect(r, float(then[i]), onset, beat.iteration, beat.iter_s,
                           statistics.median(before) if before else None, by="fast")
        return None

    def scores(self, beats: Mapping[int, Heartbeat], history: Mapping[int, Iterable[Heartbeat]], now: float,
               cfg: FalconConfig, may_act: bool) -> tuple[list[Output], Suspect | None]:
        """The ``rank_scores`` event when one is due at ``now`` (every ``score_interval_s``,
        from two scored ranks on, whatever the episode; every rank's score up to
        ``listed_ranks``, else that many slowest, with the count and median of all), and the straggler to localize
        now, if any (only when ``may_act``): one shown by
        :func:`~falconext.detect.scores.compute_outliers` in ``score_trigger_readings``
        fresh scores in a row and not acted on yet (the most extreme). Each outlier's
        count is kept whether or not it may be acted on; one that reads normal again is
        forgotten."""
        if now < self.next_scores:
            return [], None
        found = scored_samples(beats)
        if len(found.ranks) < 2:
            return [], None
        t0 = time.perf_counter()
        ranks, role_of = found.ranks, found.roles
        scores = self.latest = found.scores()
        roles = dict(zip(ranks, role_of))
        listed = slowest_listed(scores, cfg.listed_ranks)
        # the slowest of all is the first of the listed (the highest scores)
        out = [event("rank_scores", iteration=found.iteration, slowest=slowest(listed),
                     window=cfg.score_window, scored=len(scores), listed=len(listed),
                     score_median=round(float(np.median(score_values(scores))), 4) if scores else None,
                     ranks={str(r): s.to_dict() for r, s in listed.items()})]
        flagged = compute_outliers(scores, dict(zip(ranks, found.mb_s)), roles, cfg.score_trigger_ratio,
                                   cfg.min_slowdown) if cfg.score_trigger_ratio else {}
        # due again in score_interval_s, or later, so that scoring every rank takes at most
        # score_max_share of the controller's time (about a second at 131,072 ranks)
        self.next_scores = now + max(cfg.score_interval_s, (time.perf_counter() - t0) / cfg.score_max_share)
        if not cfg.score_trigger_ratio:
            return out, None
        for r in [r for r in self.outliers if r not in flagged]:
            del self.outliers[r]
            self.acted.discard(r)
        ready: list[tuple[float, int]] = []
        for r, ratio in flagged.items():
            n, last = self.outliers.get(r, (0, -1))
            it = beats[r].iteration
            self.outliers[r] = (n + 1, it) if it > last else (n, last)
            if self.outliers[r][0] >= cfg.score_trigger_readings and r not in self.acted and r not in self.fast_acted:
                ready.append((ratio, r))
        if not ready or not may_act:
            return out, None
        ratio, r = max(ready)
        beat = beats[r]
        onset = outlier_onset(beat, history.get(r, ()), beat.mb_s / ratio * cfg.score_trigger_ratio)
        before = [b.iter_s for b in history.get(r, ()) if b.iteration < onset and b.iter_s > 0]
        return out, Suspect(r, ratio, onset, beat.iteration, beat.iter_s, statistics.median(before) if before else None)


def outlier_onset(beat: Heartbeat, kept: Iterable[Heartbeat], line: float) -> int:
    """Where a rank's run of compute readings at or over ``line`` began: walking its kept
    heartbeats back from the latest (``beat``'s iteration when none is over it)."""
    onset = beat.iteration
    for b in reversed(list(kept)):
        if b.mb_s < line:
            break
        onset = b.iteration
    return onset

