"""An episode and its rules alone (control/episodes.py): the reports it keeps, joining,
ending, timing out and closing, and when a report under a mitigation is a new fault (no
Redis, no controller)."""

from __future__ import annotations

import collections

from falconext.config import FalconConfig
from falconext.control.episodes import (
    Episode,
    Sighting,
    dropped,
    ends,
    expire,
    is_new_fail_slow,
    mitigated_level,
)
from falconext.protocol.messages import FailSlowReport, Heartbeat, Localized
from falconext.mitigate.mitigation import new_mitigation
from falconext.mitigate.planner import Planner

CFG = FalconConfig(episode_timeout_s=30.0)


def report(rank=1, onset=40, baseline=0.3, slowdown=2.0, event_id=0, t=100.0, end=None):
    return FailSlowReport(rank, onset, onset + 5, slowdown, baseline, t, event_id=event_id, end=end)


def beats(iter_s: float, it: int = 60) -> dict[int, Heartbeat]:
    return {r: Heartbeat(r, r // 2, it, iter_s, 200.0) for r in range(4)}


def mitigated(ep: Episode, applied_at: int | None = None):
    planner = Planner("computation", ep.healthy_s(), {"S2": 0.5}, min(ep.onsets), settle_iterations=2,
                      judge_iterations=3, rise_margin=0.1)
    ep.mitigation = new_mitigation(planner, Localized(gpus=[1], links=[], evidence={}), {}, {}, clean_before=40,
                                   lookback=0, line=0.1, nbytes=0)
    if applied_at is not None:
        d = planner.observe(applied_at - 1, 10.0)  # the rent at once over S2's cost
        assert d is not None and d.strategy == "S2"
        planner.applied("S2", applied_at)
        ep.mitigation.applied.append({"strategy": "S2", "iteration": applied_at})
    return ep.mitigation


def test_an_episode_keeps_the_reports_it_was_given_and_what_it_saw_itself():
    ep = Episode.of_report(report(rank=1, onset=40, baseline=0.3))
    assert ep.join(report(rank=2, onset=42, baseline=0.32, slowdown=1.5), 7) == []
    assert ep.join(report(rank=2, onset=43, t=101.0), 7) == []  # a ladder update: nothing new
    assert [r.rank for r in ep.reports] == [1, 2] and ep.reporters == {1: 0, 2: 0}
    ep.sightings.append(Sighting(None, None, 0.9))  # a rise that joined: a level only
    assert ep.onsets == [40, 42] and ep.baselines == [0.3, 0.32]
    assert ep.slow_levels == [0.6, 0.32 * 1.5, 0.9] and ep.healthy_s() == 0.32
    assert ep.reference_onset() == 40 and ep.localizing() == "fail_slow" and ep.since(130.0) == 30.0
    assert Episode("operator", 1.0).reference_onset() is None


def test_the_end_of_every_reporter_ends_it_and_only_their_own_events_count():
    ep = Episode.of_report(report(rank=1, event_id=3))
    ep.join(report(rank=2, event_id=5), 1)
    assert not ep.end_reported(report(rank=1, event_id=4, end=60), 150.0)  # another event of rank 1
    assert ep.end_reported(report(rank=1, event_id=3, end=60), 150.0) and ep.first_end_t == 150.0
    assert not ep.all_ended() and not ends(ep)
    ep.end_reported(report(rank=2, event_id=5, end=61), 151.0)
    assert ep.all_ended() and ends(ep) and ep.first_end_t == 150.0
    assert ends(Episode("operator", 1.0)) and not ends(Episode("fail_slow", 1.0))


def test_a_planner_still_on_s1_finishes_when_every_reporter_ended():
    ep = Episode.of_report(report())
    mit = mitigated(ep)
    assert not ends(ep) and not mit.planner.finished
    ep.end_reported(report(end=50), 120.0)
    assert ends(ep) and mit.planner.finished


def test_an_episode_whose_end_reports_were_lost_times_out():
    ep = Episode.of_report(report(baseline=0.3))
    assert expire(ep, 100.0, beats(0.6), CFG) is None and ep.healthy_since is None
    assert expire(ep, 101.0, beats(0.31), CFG) is None and ep.healthy_since == 101.0
    assert expire(ep, 130.0, beats(0.6), CFG) is None and ep.healthy_since is None  # slow again: start over
    assert expire(ep, 131.0, beats(0.31), CFG) is None
    assert expire(ep, 161.0, beats(0.31), CFG) == "every rank is healthy again but the end reports did not come"
    lost = Episode.of_report(report(rank=1))
    lost.join(report(rank=2), 1)
    lost.end_reported(report(rank=1, end=60), 200.0)
    assert expire(lost, 229.0, beats(0.6), CFG) is None
    assert expire(lost, 230.0, beats(0.6), CFG) == "some ranks never reported the end"
    assert expire(Episode("operator", 1.0), 1e9, beats(0.3), CFG) is None


def test_a_mitigated_episode_is_not_timed_out_while_its_planner_decides():
    ep = Episode.of_report(report(baseline=0.3))
    mit = mitigated(ep, applied_at=50)
    assert expire(ep, 100.0, beats(0.31), CFG) is None and expire(ep, 1000.0, beats(0.31), CFG) is None
    waiting = Episode.of_report(report(baseline=0.3))
    w = mitigated(waiting)
    expire(waiting, 100.0, beats(0.31), CFG)
    assert expire(waiting, 130.0, beats(0.31), CFG) is not None and w.planner.finished  # over before any strategy
    assert not mit.planner.finished


def test_a_report_under_a_mitigation_is_new_only_past_the_settling_and_over_the_level_held():
    ep = Episode.of_report(report(rank=1, onset=40, baseline=0.3, event_id=1))
    mitigated(ep, applied_at=50)
    first = collections.deque(Heartbeat(0, 0, it, 0.33, 1.0) for it in range(50, 70))
    kw = dict(cfg=CFG, tracking=True, first_beats=first)
    assert not is_new_fail_slow(ep, report(rank=1, onset=60, event_id=1, slowdown=3.0), **kw)  # its own event
    settled = 50 + CFG.mitigation_settle_iterations
    assert not is_new_fail_slow(ep, report(rank=2, onset=settled, slowdown=3.0), **kw)  # still settling
    assert mitigated_level(ep.mitigation, settled, 65, first) == 0.33
    # 1.1x the level the strategy holds: the residual it only partly hides, not a new fault
    assert not is_new_fail_slow(ep, report(rank=2, onset=65, baseline=0.3, slowdown=1.2), **kw)
    assert is_new_fail_slow(ep, report(rank=2, onset=65, baseline=0.3, slowdown=1.5), **kw)
    assert not is_new_fail_slow(ep, report(rank=2, onset=65, baseline=0.3, slowdown=1.5), cfg=CFG, tracking=False,
                                first_beats=first)
    ep.relocalized_at = 66  # a re-localization saw every rise before it
    assert not is_new_fail_slow(ep, report(rank=2, onset=65, baseline=0.3, slowdown=1.5), **kw)


def test_a_report_from_before_the_restart_is_dropped():
    (ev,) = dropped(report(onset=40), restart_from=45)
    assert ev.event["type"] == "report_dropped" and "before the restart from iteration 45" in ev.event["reason"]
    assert dropped(report(onset=45), restart_from=45) is None
    assert dropped(report(onset=40, end=50), restart_from=45) is None  # an end is never dropped
