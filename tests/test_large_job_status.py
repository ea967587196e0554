"""What a large job's controller publishes about its ranks (control/snapshot.py,
control/stragglers.py): every rank up to ``listed_ranks``, beyond that the slowest by
score, with a summary of all of them that the progress line and the metrics read."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from falconext.config import FalconConfig
from falconext.control.snapshot import snapshot
from falconext.control.stragglers import StragglerWatch, scored_samples
from falconext.detect.scores import RankSample, RankScore, ScoreTable, rank_scores, score_column, score_values, slowest_listed
from falconext.protocol.codec import MAX_STATUS_BYTES, decode, encode
from falconext.protocol.messages import Heartbeat
from falconext.testbed.progress import progress_line

RANKS = 40
SLOW = 13
BEHIND = 31  # a healthy rank one iteration behind the others


def beats(now: float = 1000.0) -> dict[int, Heartbeat]:
    out = {}
    for r in range(RANKS):
        compute = 0.2 * (2.0 if r == SLOW else 1.0 + 0.001 * r)
        iter_s = 0.4 if r != SLOW else 0.42
        out[r] = Heartbeat(r, r // 8, 99 if r == BEHIND else 100, iter_s, now, replica=r, mb_s=compute / 4, micro=4,
                           role=r, stage=0, tp=1, pp=1, score_iteration=100, est_iter_s=iter_s, compute_s=compute,
                           wait_s=iter_s - compute)
    return out


def test_the_slowest_are_listed_in_rank_order_and_all_when_few():
    scores = {r: RankScore(0.1, 0.1, 1.0, 0.0, s, 3) for r, s in {4: 0.5, 1: 0.1, 9: 0.5, 2: 0.9}.items()}
    assert list(slowest_listed(scores, 2)) == [2, 4]  # 0.9, then the tie 0.5 by rank
    assert list(slowest_listed(scores, 10)) == [1, 2, 4, 9]


def test_a_score_table_reads_as_the_scores_it_holds_and_lists_the_same_slowest():
    # the controller's scores are a ScoreTable (columns); what it lists, the snapshot's
    # score column and the median must be those of the per-rank RankScores, ties by rank
    found = scored_samples(beats())
    table = found.scores()
    assert isinstance(table, ScoreTable) and len(table) == RANKS
    plain = dict(table.items())
    assert table == plain and all(isinstance(v, RankScore) for v in plain.values())
    assert table == rank_scores({r: RankSample(i, c, w) for r, i, c, w in
                                 zip(found.ranks, found.iter_s, found.compute_s, found.wait_s)},
                                dict(zip(found.ranks, found.roles)))
    for most in (1, 3, 8, RANKS - 1):
        assert slowest_listed(table, most) == slowest_listed(plain, most)
    tied = ScoreTable([7, 3, 5], np.array([[0.1, 0.1, 1.0, 0.0, s] for s in (0.5, 0.5, 0.9)]), np.array([2, 2, 2]))
    assert list(slowest_listed(tied, 2)) == [3, 5]  # 0.9, then the tie 0.5 by rank
    assert score_column(table, [SLOW, 999], -1.0).tolist() == [plain[SLOW].score, -1.0]
    assert score_values(table).tolist() == [s.score for s in plain.values()]


def test_a_large_jobs_snapshot_lists_the_slowest_and_summarizes_every_rank():
    cfg = FalconConfig(listed_ranks=8)
    snap = snapshot(1001.0, "j", None, beats(), RANKS, "tracking", -1, False, None, cfg)
    assert len(snap.ranks) == 8 and str(SLOW) in snap.ranks
    assert snap.summary == {"ranks": RANKS, "listed": 8, "iteration_min": 99, "iteration_max": 100,
                            "iter_s_max": 0.42, "iter_s_median": 0.4, "score_max": snap.ranks[str(SLOW)]["score"]}
    assert str(BEHIND) not in snap.ranks and snap.position() == (99, 0.42)  # the summary, not the listed rows
    assert "iteration 99/200, 0.420 s/iter" in progress_line(snap, 200)
    assert decode(encode(snap), max_bytes=MAX_STATUS_BYTES) == snap
    small = snapshot(1001.0, "j", None, beats(), RANKS, "tracking", -1, False, None, FalconConfig())
    assert len(small.ranks) == RANKS and small.summary["listed"] == RANKS


def test_a_large_jobs_rank_scores_event_lists_the_slowest_and_counts_all():
    out, _ = StragglerWatch().scores(beats(), {}, 1001.0, FalconConfig(listed_ranks=8), may_act=False)
    (ev,) = [o.event for o in out]
    assert ev["type"] == "rank_scores" and ev["scored"] == RANKS and ev["listed"] == 8
    assert len(ev["ranks"]) == 8 and str(SLOW) in ev["ranks"] and ev["slowest"] == SLOW
    full, _ = StragglerWatch().scores(beats(), {}, 1001.0, FalconConfig(), may_act=False)
    assert len(full[0].event["ranks"]) == RANKS
    assert replace(FalconConfig(), listed_ranks=1).listed_ranks == 1


def test_a_large_jobs_plan_says_even_and_in_order_without_listing_every_replica_and_rank():
    from falconext.control.metrics import strategy_in_force
    cfg = FalconConfig(listed_ranks=8)
    snap = snapshot(1001.0, "j", None, beats(), RANKS, "tracking", -1, False, None, cfg)
    assert snap.plan["roles"] is None and snap.plan["microbatches"] is None  # 40 of each: not listed
    assert snap.plan["roles_in_order"] is True and snap.plan["even"] is True
    assert strategy_in_force(snap) == "S1"
    moved = {r: replace(b, role=RANKS - 1 - r) for r, b in beats().items()}  # S3 reversed the roles
    snap = snapshot(1001.0, "j", None, moved, RANKS, "tracking", -1, False, None, cfg)
    assert snap.plan["roles"] is None and snap.plan["roles_in_order"] is False
    assert strategy_in_force(snap) == "S3"
    small = snapshot(1001.0, "j", None, moved, RANKS, "tracking", -1, False, None, FalconConfig())
    assert small.plan["roles"] == list(range(RANKS))[::-1] and small.plan["microbatches"] == [4] * RANKS


def test_scoring_a_large_job_comes_less_often_so_it_takes_at_most_its_share_of_the_controller():
    watch = StragglerWatch()
    out, _ = watch.scores(beats(), {}, 1000.0, FalconConfig(score_max_share=1.0), may_act=False)
    assert out and watch.next_scores == 1000.0 + FalconConfig().score_interval_s  # cheap: every interval
    watch = StragglerWatch()
    out, _ = watch.scores(beats(), {}, 1000.0, FalconConfig(score_max_share=1e-9), may_act=False)
    assert out and watch.next_scores > 1000.0 + 1000.0  # its cost over a tiny share: much later
    assert watch.scores(beats(), {}, 1000.0 + 10.0, FalconConfig(score_max_share=1e-9), may_act=False) == ([], None)
