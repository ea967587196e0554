"""A rank's suspension: held -> go/release/deadline -> validate -> resumed; and the trap
that runs it on the held thread. The benchmarks are plain functions here; the real ones
run in the end-to-end tests."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from falconext.protocol.actions import MicrobatchPlan
from falconext.protocol.messages import SessionAck, ValidationResult
from falconext.trace.trap import Trap
from falconext.validate.plan import split_plan, rank_work
from falconext.validate.suspension import Bench, Suspension
from wallclock import LOADED_HOST_SLACK_S

PLAN = {"gemm": [0, 1, 2], "gemm_n": 64, "gemm_repeats": 2, "gemm_concurrency": 1,
        "passes": [[[1, 0]], [[0, 1]]], "nbytes": 8, "repeats": 1}

#: run first, before any job runs ahead (conftest.py: RUN_FIRST):
#: it times holds and deadlines on the wall clock
RUN_FIRST = True


def make(rank=0, plan=PLAN, gemm=None, passes=None):
    """A suspension of ``rank`` for ``plan`` (a whole validation plan, as validate/plan.py
    makes it), given as it travels: the common part and the rank's share."""
    validation, shares = split_plan(plan, range(4))
    work = rank_work(shares, rank)
    posted, events, calls = [], [], []

    def g(n, reps):
        calls.append(("gemm", n, reps))
        return 1e9 if gemm is None else gemm()

    def p(sched, nbytes, reps, conc):
        calls.append(("passes", len(sched)))
        return [(s, d, 0.01) for ps in sched for s, d in ps if d == rank] if passes is None else passes()

    bench = Bench(g, p, lambda: calls.append(("barrier",)))
    sus = Suspension(rank, 5, 40, validation, bench, posted.append, lambda t, **f: events.append((t, f)), work=work)
    return sus, posted, events, calls


def test_without_go_the_deadline_resumes_training():
    sus, posted, events, calls = make()
    t0 = time.monotonic()
    sus.run(t0 + 0.3)
    assert 0.28 <= time.monotonic() - t0 < 0.3 + LOADED_HOST_SLACK_S
    assert [type(m) for m in posted] == [SessionAck, SessionAck]
    assert [m.status for m in posted] == ["held", "resumed"] and posted[1].expired
    assert calls == []  # nothing validated without the controller's go
    assert events[0][1]["outcome"] == "expired"


def test_release_ends_the_hold_at_once():
    sus, posted, events, _ = make()
    threading.Timer(0.05, sus.release).start()
    t0 = time.monotonic()
    sus.run(t0 + 5.0)
    assert time.monotonic() - t0 < 0.05 + LOADED_HOST_SLACK_S  # not the 5 s deadline
    assert events[0][1]["outcome"] == "released" and not posted[-1].expired


def test_go_runs_the_gemm_rounds_and_passes_then_reports():
    sus, posted, events, calls = make(rank=0)
    sus.go()
    sus.run(time.monotonic() + 5.0)
    # three GEMM rounds of one rank each, a barrier before each, then the passes
    assert calls == [("barrier",), ("gemm", 64, 2), ("barrier",), ("barrier",), ("passes", 2)]
    (result,) = [m for m in posted if isinstance(m, ValidationResult)]
    assert result.gemm_flops == 1e9 and result.links == [[1, 0, 0.01]] and result.error == ""
    assert [m.status for m in posted if isinstance(m, SessionAck)] == ["held", "resumed"]
    assert events[0][1]["outcome"] == "validated"


def test_a_rank_outside_the_gemm_still_joins_every_round():
    sus, _, _, calls = make(rank=3)
    sus.go()
    sus.run(time.monotonic() + 5.0)
    assert calls.count(("barrier",)) == 3 and not any(c[0] == "gemm" for c in calls)


def test_validation_sweeps_run_every_round_again_and_keep_the_best():
    readings = iter([0.7e9, 1.2e9, 0.9e9])  # a neighbour shared the core during the first
    sus, posted, _, calls = make(rank=1, plan={**PLAN, "validation_sweeps": 3}, gemm=lambda: next(readings))
    sus.go()
    sus.run(time.monotonic() + 5.0)
    assert calls.count(("barrier",)) == 9 and calls.count(("gemm", 64, 2)) == 3
    (result,) = [m for m in posted if isinstance(m, ValidationResult)]
    assert result.gemm_flops == 1.2e9
    # the passes ran three times too, and each pair kept its fastest message time
    readings = iter([[(0, 1, 0.05)], [(0, 1, 0.002)], [(0, 1, 0.04)]])
    sus, posted, _, calls = make(rank=1, plan={**PLAN, "validation_sweeps": 3}, passes=lambda: next(readings))
    sus.go()
    sus.run(time.monotonic() + 5.0)
    assert calls.count(("passes", 2)) == 3
    (result,) = [m for m in posted if isinstance(m, ValidationResult)]
    assert result.links == [[0, 1, 0.002]]


def test_a_failing_benchmark_is_reported_not_raised():
    sus, posted, _, _ = make(gemm=lambda: 1 / 0)
    sus.go()
    sus.run(time.monotonic() + 5.0)
    (result,) = [m for m in posted if isinstance(m, ValidationResult)]
    assert result.gemm_flops is None and "ZeroDivisionError" in result.error
    assert posted[-1].status == "resumed"


def test_trap_runs_on_hold_on_the_held_thread_with_its_deadline():
    trap = Trap()
    seen = {}

    def on_hold(end):
        seen["thread"] = threading.current_thread()
        seen["left"] = end - time.monotonic()
        seen["held"] = trap.held
        raise RuntimeError("a broken validation must not reach training")

    trap.arm(2.0, on_hold=on_hold)
    trap._hold()  # what an intercepted call does when it sees `armed`
    assert seen["thread"] is threading.current_thread() and seen["held"] is True
    assert 1.5 < seen["left"] <= 2.0
    assert trap.errors == 1 and trap.holds == 1 and not trap.armed and not trap.held
    trap._hold()  # one call per arming
    assert trap.holds == 1


def test_a_held_rank_says_held_again_until_go_so_one_lost_ack_costs_nothing():
    posted = []
    bench = Bench(lambda n, r: 1e9, lambda *a: [], lambda: None)
    sus = Suspension(0, 7, 40, None, bench, posted.append, lambda *a, **k: None, resend_s=0.1)
    threading.Timer(0.45, sus.go).start()
    sus.run(time.monotonic() + 3.0)
    held = [m for m in posted if m.status == "held"]
    assert 4 <= len(held) <= 6, len(held)
    assert all(m.session == 7 and m.iteration == 40 for m in held)
    assert posted[-1].status == "resumed" and not sus.expired


# --- the validation budget --------------------------------------------------------------------

SLOW_PLAN = {**PLAN, "gemm": [0], "validation_sweeps": 20}  # 20 sweeps of a GEMM round and a P2P sweep


class LogicalClock:
    """Monotonic time that only the fake benchmarks advance (Suspension's clock seam): the
    budget tests count steps, not the host's scheduling."""

    def __init__(self) -> None:
        self.t = 1024.0  # binary-exact sums below

    def __call__(self) -> float:
        return self.t

    def spend(self, seconds: float) -> None:
        self.t += seconds


def test_validation_stops_when_its_budget_is_spent_and_reports_what_it_measured():
    """The budget cuts repeats only: the first sweep measures every suspect (its GEMM and its
    links), so a budget spent on slow GEMMs still leaves every link measured once."""
    clock = LogicalClock()

    def slow_gemm():
        clock.spend(0.0625)
        return 1e9

    sus, posted, events, calls = make(rank=0, plan=SLOW_PLAN, gemm=slow_gemm)
    sus.clock = clock
    sus.budget_s = 0.2
    sus.go()
    t0 = clock()
    sus.run(clock() + 5.0)
    # without the budget: 20 sweeps of a 62.5 ms GEMM, 1.25 s; with it: every step whose
    # expected end (the last GEMM's 62.5 ms) stays inside 0.2 s, so the first sweep and two repeats
    assert clock() - t0 == 0.1875 and sus.pause_s == 0.1875
    (result,) = [m for m in posted if isinstance(m, ValidationResult)]
    assert result.gemm_flops == 1e9  # the rounds it ran count
    assert result.error == "partial: validation budget of 0.2 s spent after 6 of 40 steps (0.188 s)"
    assert calls.count(("passes", 2)) == 3 and calls.count(("gemm", 64, 2)) == 3  # no step once it is spent
    assert result.links  # the first sweep's links, whatever the budget
    assert sus.budget_spent and events[0][1]["budget_spent"] is True and events[0][1]["outcome"] == "validated"
    assert [m.status for m in posted if isinstance(m, SessionAck)] == ["held", "resumed"]


def test_a_step_that_would_overrun_the_budget_is_not_begun():
    """A P2P sweep over a congested link took 2.5 s of a 3 s budget on the test bed and the
    second sweep began anyway (5.5 s in all): a step is counted as long as the last of its
    kind, so here the second of two 0.3 s sweeps is not begun under a 0.5 s budget."""
    clock = LogicalClock()

    def slow_passes(*args):
        clock.spend(0.3)
        return [(1, 0, 0.01)]

    sus, posted, _, calls = make(rank=0, plan={**PLAN, "gemm": [], "validation_sweeps": 2})
    sus.clock = clock
    sus.bench.passes = slow_passes
    sus.budget_s = 0.5
    sus.go()
    t0 = clock()
    sus.run(clock() + 5.0)
    assert clock() - t0 == pytest.approx(0.3)  # one sweep: the second would have ended at 0.6 s
    (result,) = [m for m in posted if isinstance(m, ValidationResult)]
    assert result.links == [[1, 0, 0.01]] and "after 1 of 2 steps" in result.error


def test_every_rank_stops_at_the_step_where_any_rank_ran_out():
    asked: list[bool] = []

    def agree_stop(spent: bool) -> bool:  # the other ranks: one of them is out at the 3rd step
        asked.append(spent)
        return len(asked) >= 3

    sus, posted, _, calls = make(rank=0, plan=SLOW_PLAN)
    sus.bench.agree_stop = agree_stop
    sus.budget_s = 60.0
    sus.go()
    sus.run(time.monotonic() + 5.0)
    # this rank had budget left, and asked before each step of the repeat sweeps (the first
    # sweep is never cut): the GEMM and the passes of sweep 2, then the GEMM of sweep 3
    assert asked == [False, False, False]
    assert calls.count(("gemm", 64, 2)) == 2 and calls.count(("passes", 2)) == 2 and sus.budget_spent
    (result,) = [m for m in posted if isinstance(m, ValidationResult)]
    assert "after 4 of 40 steps" in result.error


def test_a_budget_that_is_not_reached_changes_nothing():
    sus, posted, events, calls = make(rank=0)
    sus.budget_s = 60.0
    sus.go()
    sus.run(time.monotonic() + 5.0)
    assert calls == [("barrier",), ("gemm", 64, 2), ("barrier",), ("barrier",), ("passes", 2)]
    (result,) = [m for m in posted if isinstance(m, ValidationResult)]
    assert result.error == "" and not sus.budget_spent and "budget_spent" not in events[0][1]


def test_an_action_is_committed_typed_once_every_rank_holds_go():
    action = MicrobatchPlan("S2", [3, 1], session=5)
    committed, posted, events, calls = [], [], [], []
    bench = Bench(lambda n, r: 0.0, lambda *a: [], lambda: calls.append("barrier"))
    sus = Suspension(0, 5, 40, None, bench, posted.append, lambda t, **f: events.append((t, f)),
                     commit=committed.append, action=action)
    sus.go()
    sus.run(time.monotonic() + 5.0)
    assert committed == [action] and calls == ["barrier"]  # the agreement, no validation
    assert posted[-1].committed and events[0][1]["committed"] is True
    # without the action nothing is committed and the event says nothing of it
    sus = Suspension(0, 6, 40, None, bench, posted.append, lambda t, **f: events.append((t, f)), commit=committed.append)
    sus.go()
    sus.run(time.monotonic() + 5.0)
    assert committed == [action] and "committed" not in events[-1][1]


def test_a_rank_without_a_share_joins_every_barrier_and_says_so():
    validation, _ = split_plan(PLAN, range(4))
    posted, calls = [], []
    bench = Bench(lambda n, r: calls.append("gemm") or 1e9,
                  lambda sched, *a: calls.append(("passes", [list(p) for p in sched])) or [],
                  lambda: calls.append("barrier"))
    sus = Suspension(0, 5, 40, validation, bench, posted.append, lambda *a, **k: None)
    sus.go()
    sus.run(time.monotonic() + 5.0)
    assert calls == ["barrier"] * 3 + [("passes", [[], []])]  # every round, nothing of its own
    (result,) = [m for m in posted if isinstance(m, ValidationResult)]
    assert "no share of the validation plan came for rank 0" in result.error


def held_for_verdict(wait_s=2.0, votes=None, lacking=False):
    """A rank of a validation whose plan holds it ``wait_s`` for the verdict; ``votes``
    collects what it says in the vote on the action (None: no vote, the barrier path), and
    ``lacking`` is what the vote over every rank answers."""
    validation, shares = split_plan(PLAN, range(4))
    validation = dataclasses.replace(validation, verdict_wait_s=wait_s)
    posted, events, calls, committed = [], [], [], []

    def vote(lacks):
        votes.append(lacks)
        return lacking or lacks

    bench = Bench(lambda n, r: 1e9, lambda sched, *a: [], lambda: calls.append("barrier"),
                  agree_stop=None if votes is None else vote)
    sus = Suspension(0, 5, 40, validation, bench, posted.append, lambda t, **f: events.append((t, f)),
                     commit=committed.append, work=rank_work(shares, 0))
    return sus, posted, events, calls, committed


def test_a_resume_with_an_action_after_validating_is_committed_once_every_rank_holds_it():
    """The verdict in the same hold: the rank reports, stays held, and the action the resume
    brings is committed after the vote over every rank (no second suspension)."""
    action = MicrobatchPlan("S2", [3, 5], session=5)
    votes = []
    sus, posted, events, calls, committed = held_for_verdict(votes=votes)
    sus.go()
    timer = threading.Timer(0.1, sus.resume, args=(action,))
    timer.start()
    t0 = time.monotonic()
    sus.run(t0 + 5.0)
    assert 0.09 <= time.monotonic() - t0 < 0.1 + LOADED_HOST_SLACK_S  # held until the resume, not the 5 s wait
    assert isinstance(posted[1], ValidationResult) and posted[-1].status == "resumed"
    assert votes == [False] and committed == [action] and posted[-1].committed
    assert events[0][1]["committed"] is True


def test_a_resume_without_an_action_ends_the_wait_and_commits_nothing():
    votes = []
    sus, posted, events, _, committed = held_for_verdict(votes=votes)
    sus.go()
    sus.resume()
    sus.run(time.monotonic() + 5.0)
    assert votes == [True] and committed == [] and not posted[-1].committed
    assert "committed" not in events[0][1]


def test_a_rank_whose_wait_ran_out_votes_no_and_nobody_applies_the_action():
    """One rank's wait for the verdict ran out before the resume came: it votes "lacking"
    and the rank that got the action does not commit it either (all or nothing)."""
    votes = []
    sus, posted, events, _, committed = held_for_verdict(wait_s=0.1, votes=votes)
    sus.go()
    t0 = time.monotonic()
    sus.run(t0 + 5.0)
    assert 0.09 <= time.monotonic() - t0 < 1.0 and votes == [True] and committed == []
    action = MicrobatchPlan("S2", [3, 5], session=5)
    votes = []
    sus, posted, events, _, committed = held_for_verdict(votes=votes, lacking=True)
    sus.go()
    sus.resume(action)
    sus.run(time.monotonic() + 5.0)
    assert votes == [False] and committed == [] and not posted[-1].committed
    (ev,) = [f for t, f in events if t == "suspension"]
    assert ev["committed"] is False
    assert any(t == "control_error" and "lacked" in f["error"] for t, f in events)


def test_without_a_vote_the_action_of_the_verdict_is_agreed_by_the_barrier():
    action = MicrobatchPlan("S2", [3, 5], session=5)
    sus, posted, events, calls, committed = held_for_verdict(votes=None)
    sus.go()
    sus.resume(action)
    sus.run(time.monotonic() + 5.0)
    assert committed == [action] and calls[-1] == "barrier" and posted[-1].committed


def test_a_plan_without_a_verdict_wait_resumes_right_after_reporting():
    votes = []
    sus, posted, events, _, committed = held_for_verdict(wait_s=0.0, votes=votes)
    sus.go()
    t0 = time.monotonic()
    sus.run(t0 + 5.0)
    assert time.monotonic() - t0 < 0.5 and votes == [] and committed == []
