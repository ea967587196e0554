"""The heartbeats' view of the job (control/heartbeats.py), the score trigger
(control/stragglers.py) and the status snapshot (control/snapshot.py), each alone, on
plain heartbeats (no Redis, no controller)."""

from __future__ import annotations

from falconext.config import FalconConfig
from falconext.control.episodes import Episode
from falconext.control.heartbeats import JobView
from falconext.protocol.messages import FailSlowReport, Heartbeat
from falconext.control.snapshot import snapshot
from falconext.control.stragglers import StragglerWatch, outlier_onset

CFG = FalconConfig()


def hb(rank, it, iter_s=0.3, node=None, role=-1, mb_s=0.05, t=1.0, **kw):
    return Heartbeat(rank, rank // 2 if node is None else node, it, iter_s, t, role=role, mb_s=mb_s, **kw)


def test_the_view_keeps_one_reading_per_iteration_and_the_first_rank_s_clean_level():
    job = JobView(world=4, keep=3)
    assert job.ranks() == {0, 1, 2, 3} and not job.covers({0: 1, 1: 1, 2: 1})
    assert job.covers({r: 1 for r in range(4)}) and not job.covers({r: 1 for r in (0, 1, 2, 5)})
    job.record(hb(2, 10), clean=True)
    job.record(hb(1, 10, iter_s=0.31), clean=True)
    job.record(hb(1, 10, iter_s=0.32), clean=True)  # the same iteration again: replaces
    assert job.first_rank == 1 and [b.iter_s for b in job.history[1]] == [0.32]
    assert list(job.clean) == [(10, 0.32)]
    for it in (11, 12, 13):
        job.record(hb(1, it), clean=it != 12)
    assert [b.iteration for b in job.history[1]] == [11, 12, 13]  # kept: the last 3
    assert list(job.clean) == [(10, 0.32), (11, 0.3), (13, 0.3)] and job.clean_before(11) == [0.32, 0.3]
    assert job.first_beat == {2: 10, 1: 10} and [b.iteration for b in job.first_beats()] == [11, 12, 13]
    job.record(hb(0, 13), clean=True)
    assert job.first_rank == 0 and job.node_of() == {0: 0, 1: 0, 2: 1}
    unknown = JobView(world=None, keep=3)
    assert unknown.ranks() == set() and unknown.expected() == 0 and list(unknown.first_beats()) == []


def test_a_strategy_changes_the_clean_level_and_s4_forgets_the_processes():
    job = JobView(world=4, keep=8)
    for r in range(4):
        job.record(hb(r, 20), clean=True)
    job.plan_changed("S2", 30, 5)
    assert job.clean_from == 35 and list(job.clean) == [(20, 0.3)] and job.beats
    job.record(hb(0, 34), clean=True)
    assert list(job.clean) == [(20, 0.3)]  # before clean_from: the plan is still settling
    job.plan_changed("S3", 40, 5)
    assert not job.clean and job.beats
    job.plan_changed("S4", 50, 5)
    assert job.restart_from == 50 and not job.beats and not job.history
    job.new_round(2)
    assert job.world == 2 and not job.first_beat


def test_the_restart_room_counts_the_nodes_and_keeps_the_plane_s_host():
    job = JobView(world=4, keep=8)
    for r in range(4):
        job.record(hb(r, 20), clean=True)
    room = job.restart_room(1, {0: "a", 1: "b"}, "a", 2)
    assert (room.nodes, room.floor, room.spares, room.fixed) == (2, 1, 2, (0,))


def test_a_straggler_shown_in_enough_fresh_scores_in_a_row_is_suspected_once():
    cfg = CFG.replace(score_trigger_readings=2, score_interval_s=1.0)
    watch = StragglerWatch()
    history: dict[int, list[Heartbeat]] = {r: [] for r in range(4)}

    def at(it, slow=True):
        out = {}
        for r in range(4):
            mb = 0.1 if (slow and r == 1 and it >= 22) else 0.05
            b = hb(r, it, mb_s=mb, score_iteration=it, est_iter_s=0.5, compute_s=mb * 4, wait_s=0.5 - mb * 4,
                   stage=0, tp=1)
            history[r].append(b)
            out[r] = b
        return out

    events, s = watch.scores(at(20), history, 0.0, cfg, True)
    assert [e.event["type"] for e in events] == ["rank_scores"] and s is None
    assert watch.scores(at(21), history, 0.5, cfg, True) == ([], None)  # not due yet
    _, s = watch.scores(at(22), history, 1.0, cfg, True)
    assert s is None and watch.outliers[1][0] == 1
    _, s = watch.scores(at(22), history, 2.0, cfg, True)
    assert s is None and watch.outliers[1][0] == 1  # the same reading again is not fresh
    _, s = watch.scores(at(23), history, 3.0, cfg, False)
    assert s is None  # may not act now; counted anyway
    _, s = watch.scores(at(24), history, 4.0, cfg, True)
    assert s.rank == 1 and s.onset == 22 and s.baseline_s == 0.3 and s.ratio > 1.5
    assert s.episode(4.0).sightings[0].onset == 22 and s.episode(4.0).suspected == 1
    watch.acted.add(1)
    assert watch.scores(at(25), history, 5.0, cfg, True)[1] is None  # acted on already
    watch.scores(at(26, slow=False), history, 6.0, cfg, True)
    assert 1 not in watch.outliers and 1 not in watch.acted  # normal again: forgotten
    assert outlier_onset(history[1][-1], history[1][:-1], 0.2) == history[1][-1].iteration


def test_the_snapshot_reads_the_plan_from_the_heartbeats_and_the_episode():
    beats = {r: hb(r, 50, replica=r, micro=m, tp=1, pp=1, role=r) for r, m in enumerate((10, 6, 8, 8))}
    ep = Episode.of_report(FailSlowReport(1, 40, 45, 2.0, 0.3, 10.0))
    snap = snapshot(12.0, "job", None, beats, 4, "tracking", 3, False, ep, CFG.replace(suspend_tries=9))
    assert snap.plan == {"tp": 1, "pp": 1, "dp": 4, "nodes": 2, "microbatches": [10, 6, 8, 8], "even": False,
                         "roles": [0, 1, 2, 3], "roles_in_order": True}
    assert snap.episode["onset"] == 40 and snap.episode["reporters"] == [1] and snap.planner is None
    assert snap.config == {"suspend_tries": 9} and snap.ranks["2"]["age_s"] == 11.0 and snap.session == 3
