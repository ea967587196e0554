"""The controller's suspension coordinator alone (control/suspension.py): placement,
sessions, acks, the hold for the verdict and an action's end, with the time passed in
(no Redis, no controller)."""

from __future__ import annotations

import math

import pytest

from falconext.config import FalconConfig
from falconext.protocol.actions import MicrobatchPlan
from falconext.protocol.commands import ProfileRequest, ValidationPlan
from falconext.protocol.messages import Heartbeat, SessionAck
from falconext.control.suspension import (
    SuspensionCoordinator,
    margin_iterations,
    placement,
    verdict_wait_s,
)
from falconext.validate.plan import split_plan

CFG = FalconConfig()
RANKS = {0, 1, 2, 3}


def covers(got) -> bool:
    return set(got) >= RANKS


def beats(it=50, iter_s=0.3, t=100.0, into_s=-1.0):
    return [Heartbeat(r, r // 2, it, iter_s, t, into_s=into_s) for r in sorted(RANKS)]


def plan(gemm_rounds=1) -> ValidationPlan:
    whole = {"gemm": [0, 1, 2, 3] if gemm_rounds else [], "passes": [], "nbytes": 0, "repeats": 1,
             "gemm_n": 64, "gemm_repeats": 1, "scope": "suspects"}
    validation, _ = split_plan(whole, sorted(RANKS))
    return validation


def ack(rank, session, status, it=53, t=101.0, **kw):
    return SessionAck(rank, session, status, it, t, **kw)


def test_short_iterations_suspend_the_margin_ahead_per_try_and_long_ones_one_iteration():
    p1 = placement(beats(), 100.0, 1, CFG)
    assert p1.iteration == 50 + CFG.suspend_margin_iterations and p1.margin == CFG.suspend_margin_iterations
    assert placement(beats(), 100.0, 2, CFG).iteration == 50 + 2 * CFG.suspend_margin_iterations
    # a heartbeat 1.5 s old, iterations of 0.3 s: the ranks are 5 iterations further
    assert placement(beats(), 101.5, 1, CFG).iteration == 55 + CFG.suspend_margin_iterations
    long_s = CFG.suspend_margin_s + 1.0
    assert margin_iterations(long_s, CFG) == 1 and margin_iterations(0.3, CFG) == CFG.suspend_margin_iterations
    assert placement(beats(iter_s=long_s), 100.0, 1, CFG).iteration == 51
    # every rank said how far into its iteration it was: the next start at least margin_s away
    into = placement(beats(iter_s=long_s, into_s=long_s - 0.1), 100.0, 1, CFG)
    assert into.iteration == math.ceil(50 + (long_s - 0.1) / long_s + CFG.suspend_margin_s / long_s)
    assert p1.deadline > 100.0 + CFG.suspend_deadline_s


def test_go_goes_once_every_rank_is_held_and_resumed_acks_give_the_pauses():
    sus = SuspensionCoordinator(first_session=7)
    assert sus.profile(100.0, 100.5, CFG).message == ProfileRequest(8, CFG.profile_window_s, CFG.profile_timeout_s)
    assert sus.deadline == 100.5 + CFG.profile_timeout_s
    p = sus.place(beats(), 101.0, CFG)
    posts = sus.validation_posts(plan(), [], 0.0, CFG)
    assert [o.message.KIND for o in posts] == ["suspend"] and posts[-1].message.iteration == p.iteration
    kw = dict(suspended=True, validating=True, covers=covers, tries=CFG.suspend_tries, deadline_s=4.0)
    for r in (0, 1, 2):
        assert not sus.ack(ack(r, 8, "held"), 101.0, **kw).outputs
    out = sus.ack(ack(3, 8, "held"), 101.2, **kw).outputs
    assert [o.message.KIND for o in out if o.kind == "command"] == ["go"]
    assert [o.event["type"] for o in out if o.kind == "event"] == ["suspended"] and sus.go_sent
    assert not sus.ack(ack(3, 8, "held"), 101.3, **kw).outputs  # a repeated "held": no second go
    for r in (0, 1, 2):
        assert not sus.ack(ack(r, 8, "resumed", pause_s=0.1 * r), 102.0, **kw).all_resumed
    res = sus.ack(ack(3, 8, "resumed", pause_s=0.7, expired=True), 102.0, **kw)
    (resumed,) = [o.event for o in res.outputs]
    assert res.all_resumed and resumed["pause_s"] == 0.7 and resumed["expired"] == [3]
    assert resumed["pause_median_s"] == 0.2 and sus.last_pause_s == 0.7


def test_a_node_s_acks_of_one_status_are_taken_at_once_as_one_by_one():
    """Acks taken together (a node's batch) give what the last of them gives one by one:
    the "go" once, the resumed event once; the first of several "missed" names the rank."""
    sus = SuspensionCoordinator(first_session=7)
    sus.profile(100.0, 100.5, CFG)
    sus.place(beats(), 101.0, CFG)
    sus.validation_posts(plan(), [], 0.0, CFG)
    kw = dict(suspended=True, validating=True, covers=covers, tries=2, deadline_s=4.0)
    assert not sus.ack([ack(0, 8, "held"), ack(1, 8, "held")], 101.0, **kw).outputs
    out = sus.ack([ack(2, 8, "held"), ack(3, 8, "held")], 101.2, **kw).outputs
    assert [o.message.KIND for o in out if o.kind == "command"] == ["go"] and sus.go_sent
    assert [o.event["ranks"] for o in out if o.kind == "event"] == [4]
    res = sus.ack([ack(r, 8, "resumed", pause_s=0.1 * r) for r in sorted(RANKS)], 102.0, **kw)
    assert res.all_resumed and [o.event["pause_s"] for o in res.outputs] == [0.3]
    with pytest.raises(ValueError, match="one status"):
        sus.ack([ack(0, 8, "held"), ack(1, 8, "missed")], 102.0, **kw)
    again = SuspensionCoordinator()
    again.profile(100.0, 100.0, CFG)
    again.place(beats(), 100.0, CFG)
    res = again.ack([ack(2, again.session, "missed"), ack(3, again.session, "missed")], 101.0, **kw)
    assert res.missed and [o.event["rank"] for o in res.outputs if o.kind == "event"] == [2]


def test_a_missed_iteration_releases_and_retries_in_a_new_session_until_the_tries_run_out():
    sus = SuspensionCoordinator()
    sus.profile(100.0, 100.0, CFG)
    kw = dict(suspended=True, validating=True, covers=covers, tries=2, deadline_s=4.0)
    sus.place(beats(), 100.0, CFG)
    first = sus.session
    res = sus.ack(ack(2, first, "missed"), 101.0, **kw)
    assert res.missed and not res.gave_up and sus.session == first + 1
    assert res.outputs[0].message.KIND == "release" and res.outputs[0].message.session == first
    assert res.outputs[1].event["type"] == "suspend_missed"
    later = sus.place(beats(), 100.0, CFG)
    assert later.iteration == 50 + 2 * CFG.suspend_margin_iterations  # the second try is further ahead
    res = sus.ack(ack(2, sus.session, "missed"), 101.0, **kw)
    assert res.gave_up and sus.session == first + 1
    # once "go" is out, a "missed" changes nothing
    sus.place(beats(), 101.0, CFG)
    for r in RANKS:
        sus.ack(ack(r, sus.session, "held"), 101.0, **kw)
    assert not sus.ack(ack(2, sus.session, "missed"), 101.0, **kw).missed


def test_the_ranks_held_for_the_verdict_get_the_action_with_the_resume_or_a_plain_resume():
    sus = SuspensionCoordinator()
    sus.profile(100.0, 100.0, CFG)
    sus.place(beats(), 101.0, CFG)
    (cmd,) = sus.validation_posts(plan(), [], 2.0, CFG)
    assert cmd.message.validation.verdict_wait_s == 2.0
    kw = dict(suspended=True, validating=True, covers=covers, tries=3, deadline_s=4.0)
    for r in RANKS:
        sus.ack(ack(r, sus.session, "held"), 101.0, **kw)
    assert sus.awaiting == sus.session
    assert sus.held_for_verdict(101.5) and sus.last_pause_s == 0.5  # the hold so far prices an action
    action = MicrobatchPlan("S2", [5, 3])
    assert sus.resume_with(action, 101.7, False, CFG) is None  # the controller is busy
    resume = sus.resume_with(action, 101.7, True, CFG)
    assert resume.message.KIND == "resume" and resume.message.action.session == sus.session and sus.via_resume
    assert sus.awaiting is None and not sus.held_for_verdict(101.8)
    # without an action: a plain resume, none once every rank resumed anyway
    sus.awaiting = sus.session
    assert sus.release_hold(RANKS, 4.0)[0].message.action is None and sus.awaiting is None
    sus.awaiting = sus.session
    sus.acks["resumed"] = {r: ack(r, sus.session, "resumed") for r in RANKS}
    assert sus.release_hold(RANKS, 4.0) == []


def test_an_action_in_a_session_of_its_own_commits_only_when_every_rank_committed():
    sus = SuspensionCoordinator(first_session=3)
    sus.begin_action(MicrobatchPlan("S2", [5, 3]))
    assert sus.session == 4 and sus.action.session == 4 and not sus.via_resume
    sus.place(beats(), 101.0, CFG)
    (cmd,) = sus.action_posts(CFG)
    assert cmd.message.action.plan == [5, 3] and cmd.message.iteration == sus.iteration
    kw = dict(suspended=True, validating=False, covers=covers, tries=3, deadline_s=4.0)
    for r in RANKS:
        sus.ack(ack(r, 4, "held"), 101.0, **kw)
    assert sus.awaiting is None  # an action's suspension holds nothing for a verdict
    for r in (0, 1, 2):  # rank 3's ack is lost: one rank's commit means every rank committed
        sus.ack(ack(r, 4, "resumed", pause_s=0.5, committed=True), 102.0, **kw)
    end = sus.end_action(covers, RANKS)
    assert end.committed and end.unheard == [3] and end.pause_s() == 0.5 and end.action.plan == [5, 3]
    assert sus.action is None and sus.deadline == math.inf
    sus.begin_action(MicrobatchPlan("S2", [5, 3]))
    sus.place(beats(), 103.0, CFG)
    for r in RANKS:
        sus.ack(ack(r, sus.session, "resumed", committed=r != 2), 104.0, **kw)
    assert not sus.end_action(covers, RANKS).committed


def test_the_verdict_holds_the_ranks_only_where_it_may_start_a_mitigation():
    assert verdict_wait_s(plan(), True, 2.0) == 2.0
    assert verdict_wait_s(plan(), False, 2.0) == 0.0
    assert verdict_wait_s(plan(gemm_rounds=0), True, 2.0) == 0.0  # nothing to validate: nothing to wait for
