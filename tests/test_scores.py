"""Per-rank straggler scores (detect/scores.py): the pure parts, the controller's
``rank_scores`` events, and a DP4 emulated-device run with a 1.5x slow rank."""

from __future__ import annotations

import csv
import math
from statistics import median

import pytest

from falconext.config import FalconConfig
from falconext.control.controller import Controller
from falconext.protocol.codec import decode, encode
from falconext.protocol.messages import Heartbeat
from falconext.detect.scores import (
    BusyClock,
    RankSample,
    compute_outliers,
    rank_scores,
    recent_sample,
    role_key,
    slowest,
    split_iteration,
)

from jobs import CALLS_ONLY_ONSET, CALLS_ONLY_SLOW_RANK, calls_only_job, events

#: the job lane held for the whole module (conftest.py: alone): it reads the calls-only
#: job (tests/jobs.py), which runs with nothing beside it
ALONE = True


# --- BusyClock ------------------------------------------------------------------------------

def test_busy_clock_counts_overlapping_calls_once_and_clips_to_the_span():
    clock = BusyClock()
    clock.feed(0.0, 1.0)
    clock.feed(0.5, 2.0)  # overlaps the first: the union is [0, 2]
    clock.feed(3.0, 4.0)
    clock.feed(3.2, 3.5)  # inside the previous one
    assert clock.busy(0.0, 10.0) == pytest.approx(3.0)
    assert clock.busy(1.5, 3.5) == pytest.approx(1.0)  # [1.5, 2] and [3, 3.5]
    assert clock.busy(2.0, 3.0) == 0.0
    assert clock.busy(5.0, 4.0) == 0.0  # reversed span


def test_busy_clock_ignores_calls_of_unknown_or_impossible_completion():
    clock = BusyClock()
    clock.feed(0.0, None)
    clock.feed(1.0, 0.5)
    clock.feed(2.0, float("nan"))
    assert clock.busy(0.0, 10.0) == 0.0


def test_busy_clock_memory_is_bounded():
    clock = BusyClock(capacity=4)
    for k in range(100):
        clock.feed(float(k), k + 0.5)
    assert clock.busy(0.0, 100.0) == pytest.approx(4 * 0.5)  # only the latest 4 intervals


def test_split_iteration_never_gives_negative_parts():
    assert split_iteration(1.0, 0.25) == (0.75, 0.25)
    assert split_iteration(1.0, 1.5) == (0.0, 1.0)
    assert split_iteration(1.0, -0.1) == (1.0, 0.0)


def test_recent_sample_takes_medians():
    s = recent_sample([(1.0, 0.6, 0.4), (1.0, 0.7, 0.3), (9.0, 8.0, 1.0)])
    assert (s.iter_s, s.compute_s, s.wait_s) == (1.0, 0.7, 0.4)
    assert recent_sample([]) is None


# --- rank_scores ------------------------------------------------------------------------------

def _dp(compute: list[float], transfer: float = 0.05) -> dict[int, RankSample]:
    """Synchronous data parallelism: every rank's iteration lasts the slowest compute plus
    the transfer; the rest of a rank's iteration is spent waiting inside the collective."""
    it = max(compute) + transfer
    return {r: RankSample(it, c, it - c) for r, c in enumerate(compute)}


def test_a_straggler_scores_highest_although_every_iteration_time_is_equal():
    samples = _dp([0.2, 0.2, 0.3, 0.2])
    assert len({s.iter_s for s in samples.values()}) == 1
    scores = rank_scores(samples)
    assert slowest(scores) == 2
    assert scores[2].compute_ratio == pytest.approx(1.5)
    assert scores[2].late_s == pytest.approx(0.1)  # it keeps the others waiting 0.1 s each iteration
    assert scores[2].score == pytest.approx(0.1 / 0.35)
    for r in (0, 1, 3):
        assert scores[r].score == pytest.approx(0.0, abs=1e-12)
        assert scores[r].compute_ratio == pytest.approx(1.0)


def test_peers_are_the_ranks_of_the_same_role():
    # two pipeline stages: stage 1 computes twice as long by design, which is no straggler
    samples = {0: RankSample(1.0, 0.3, 0.7), 1: RankSample(1.0, 0.3, 0.7),
               2: RankSample(1.0, 0.6, 0.4), 3: RankSample(1.0, 0.6, 0.4)}
    roles = {0: (0, 0), 1: (0, 0), 2: (1, 0), 3: (1, 0)}
    by_role = rank_scores(samples, roles)
    assert all(s.compute_ratio == pytest.approx(1.0) and s.score == pytest.approx(0.0) for s in by_role.values())
    together = rank_scores(samples)  # compared across stages, stage 1 would look slow
    assert together[2].compute_ratio > 1.5


def test_a_rank_alone_in_its_role_and_bad_samples_get_no_blame():
    samples = {0: RankSample(1.0, 0.5, 0.5), 1: RankSample(1.0, float("nan"), 0.5), 2: RankSample(1.0, 0.5, -1.0)}
    scores = rank_scores(samples)
    assert set(scores) == {0}
    assert scores[0].peers == 0 and scores[0].score == 0.0
    assert slowest({}) is None


def test_compute_outliers_are_slow_per_micro_batch_and_cost_the_job():
    # rank 2 computes each micro-batch 1.5x slower and keeps the others waiting
    scores = rank_scores(_dp([0.2, 0.2, 0.3, 0.2]))
    mb = {0: 0.025, 1: 0.025, 2: 0.0375, 3: 0.025}
    assert compute_outliers(scores, mb, {}, 1.25, 0.1) == {2: pytest.approx(1.5)}
    assert compute_outliers(scores, mb, {}, 1.6, 0.1) == {}  # under the ratio
    # S2 lightened rank 2's replica: still slow per micro-batch, but no one waits for it
    balanced = rank_scores(_dp([0.2, 0.2, 0.2, 0.2]))
    assert compute_outliers(balanced, mb, {}, 1.25, 0.1) == {}
    # a replica with more micro-batches computes longer per iteration, not per micro-batch
    heavy = rank_scores(_dp([0.2, 0.2, 0.3, 0.2]))
    assert compute_outliers(heavy, {r: 0.025 for r in range(4)}, {}, 1.25, 0.1) == {}
    # peers are the ranks of the same role; alone in a role, or no reading: never an outlier
    assert compute_outliers(scores, mb, {0: "a", 1: "a", 2: "b", 3: "a"}, 1.25, 0.1) == {}
    assert compute_outliers(scores, {**mb, 2: 0.0}, {}, 1.25, 0.1) == {}
    assert compute_outliers(scores, {**mb, 2: math.nan}, {}, 1.25, 0.1) == {}


def test_role_key_is_stage_and_tensor_parallel_index():
    assert role_key(1, 6, 2) == (1, 0)
    assert role_key(1, 7, 2) == (1, 1)
    assert role_key(-1, 3, 1) is None


# --- the controller publishes them ------------------------------------------------------------

def _beat(rank: int, compute: float, wait: float, it: int = 30) -> Heartbeat:
    return Heartbeat(rank, 0, it, compute + wait, 0.0, replica=rank, role=rank, stage=0, tp=1, pp=1,
                     score_iteration=it, est_iter_s=compute + wait, compute_s=compute, wait_s=wait)


def test_controller_publishes_rank_scores_every_interval_before_any_fail_slow():
    cfg = FalconConfig(score_interval_s=5.0)
    ctl = Controller(cfg, world=4)
    assert ctl.tick(0.0) == []  # no samples yet
    for r, c in enumerate([0.2, 0.2, 0.3, 0.2]):
        ctl.handle(_beat(r, c, 0.35 - c), 1.0)
    first = [o.event for o in ctl.tick(1.0) if o.event.get("type") == "rank_scores"]
    assert len(first) == 1
    ev = first[0]
    assert ev["slowest"] == 2 and ev["iteration"] == 30 and ev["window"] == cfg.score_window
    assert ev["ranks"]["2"]["compute_ratio"] == pytest.approx(1.5)
    assert not [o for o in ctl.tick(5.9) if o.event.get("type") == "rank_scores"]  # within the interval
    assert [o for o in ctl.tick(6.0) if o.event.get("type") == "rank_scores"]
    assert ctl.state.value == "tracking"  # scores alone start nothing


def test_heartbeat_score_fields_survive_the_bus_and_are_checked():
    beat = _beat(1, 0.2, 0.1)
    assert decode(encode(beat)) == beat
    bad = encode(beat).replace('"compute_s":0.2', '"compute_s":"fast"')
    with pytest.raises(ValueError, match="compute_s"):
        decode(bad)


# --- a DP4 job on the emulated device ---------------------------------------------------------

SLOW_RANK, ONSET = CALLS_ONLY_SLOW_RANK, CALLS_ONLY_ONSET


@pytest.fixture(scope="module")
def scored_run(jobs):
    """DP4, rank 2's device 1.5x slow from iteration 35, the plan even throughout
    (tests/jobs.py calls_only_job: falconext has nothing but the calls, so the scores
    come from them alone)."""
    return calls_only_job(jobs)


def test_a_1_5x_slow_rank_has_the_highest_score_in_every_interval_after_the_onset(scored_run):
    evs = events(scored_run, "rank_scores")
    window = FalconConfig().score_window
    before = [e for e in evs if e["iteration"] < ONSET]
    after = [e for e in evs if e["iteration"] - window + 1 >= ONSET]  # windows wholly after the onset
    assert before, "scores are published before any fail-slow"
    assert len(after) >= 3, [e["iteration"] for e in evs]
    for e in after:
        assert e["slowest"] == SLOW_RANK, e
        assert 1.3 <= e["ranks"][str(SLOW_RANK)]["compute_ratio"] <= 1.7, e
    # while every rank's iteration takes the same time (the straggler's compute plus the
    # others' waiting): the score does not come from iteration times
    rows = list(csv.DictReader(open(scored_run / "estimates.csv", newline="")))
    by_it: dict[int, dict[int, dict]] = {}
    for r in rows:
        by_it.setdefault(int(r["iteration"]), {})[int(r["rank"])] = r
    per_rank: dict[int, list[float]] = {}
    top = []
    for it, ranks in by_it.items():
        if it < ONSET + 2 or len(ranks) < 4 or not all(r["score"] for r in ranks.values()):
            continue
        for k, r in ranks.items():
            per_rank.setdefault(k, []).append(float(r["iter_time_s"]))
        top.append(max(ranks, key=lambda k: float(ranks[k]["score"])))
    assert len(top) >= 20
    typical = [median(v) for v in per_rank.values()]
    assert max(typical) / min(typical) < 1.02, typical
    assert sum(t == SLOW_RANK for t in top) >= 0.9 * len(top), top
    assert all(math.isfinite(float(r["compute_s"])) for r in rows if r["compute_s"])
