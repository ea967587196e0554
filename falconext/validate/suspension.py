"""One rank's side of a suspension: hold at the agreed iteration, validate, resume.

The controller picks a loop iteration every rank has yet to start. At its first
collective call the rank's training thread is trapped (``CallTracer.trap``), so no rank
is inside a collective that waits for a trapped peer. The trapped thread says "held",
waits for the controller's "go" (sent once every rank is held), runs its share of the
validation plan (a GEMM if it is a suspect's group member, its send or receive in
each P2P pass), reports, and lets the trapped call go on.

Deadlines: the wait for "go" ends at the trap's deadline whatever happens to the
controller or Redis; a "release" ends it at once. While it waits, the rank says "held"
again every ``resend_s``: one lost message must not cost the whole suspension. The
validation itself has a budget (``budget_s``) for its repeats: the plan runs in sweeps
(every GEMM round, then every P2P pass), and the first sweep always runs, so every suspect
is measured once and a verdict never names a component healthy that was not measured.
Before each step of a later sweep the ranks agree whether any of them has spent the
budget, or would during a step as long as the last of its kind (:attr:`Bench.agree_stop`),
and if one has, every rank stops there and reports what it measured, marked partial.
The validation traffic runs on a dedicated process group whose timeout bounds a step
that loses its peer.

The verdict in the same hold: a plan with ``verdict_wait_s`` keeps the ranks held after
they reported, until the controller's "resume" (or a "release", or that many seconds).
The controller sends "resume" once it has the verdict; when it has also decided a
mitigation by then (an S2 plan for the GPU it just named), the action travels with it,
and every rank applies it from the next iteration: the action costs no second
suspension, and the slow iterations until one could be agreed on. All or nothing: every
rank that validated then votes, over the validation group, whether it holds the action
(:attr:`Bench.agree_stop`), and it is committed only if every rank does; one whose wait
ran out first votes no, and none applies it (the controller then agrees on it the usual
way).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from falconext.protocol.actions import MitigationAction
from falconext.protocol.commands import ValidationPlan
from falconext.protocol.messages import ValidationResult
from falconext.protocol.rank_side import held_ack, resumed_ack, validation_result
from falconext.validate.plan import RankWork


@dataclass
class Bench:
    """How this rank runs the benchmarks (functions from below the tracer)."""

    gemm: Callable[[int, int], float]  # (n, repeats) -> FLOP/s
    passes: Callable[[list, int, int, int], list]  # (passes, nbytes, repeats, concurrency) -> [(src, dst, s)]
    barrier: Callable[[], None]  # over every rank, on the validation group
    #: what the P2P passes run on, "backend:device" (gloo:cpu on the test bed, nccl:cuda:N on GPUs)
    fabric: str = "gloo:cpu"
    #: (this rank is out of budget) -> whether any rank is, over every rank on the
    #: validation group, so all stop at the same step; None: each rank decides alone
    agree_stop: Callable[[bool], bool] | None = None


class Suspension:
    """One rank's part in suspension ``session`` (module docstring): built when the trap is
    armed, with the validation ``plan`` and/or the mitigation ``action`` it carries,
    :meth:`run` on the trapped training thread, :meth:`go`, :meth:`release` and
    :meth:`resume` from the control client. However it ends, it posts a final "resumed" acknowledgement and a
    "suspension" event; after "go" it posts a ValidationResult (a benchmark's error, or
    the note that ``budget_s`` ran out and the result is partial, goes into it, never to
    training)."""

    def __init__(
        self,
        rank: int,
        session: int,
        iteration: int,
        plan: ValidationPlan | None,
        bench: Bench,
        post: Callable[[Any], None],
        emit: Callable[..., Any],
        commit: Callable[[MitigationAction], None] | None = None,
        resend_s: float = 0.5,
        budget_s: float | None = None,
        action: MitigationAction | None = None,
        work: RankWork | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rank = rank
        #: the monotonic clock that times holds, deadlines, steps and the budget (a seam:
        #: tests give it logical time that the benchmarks advance)
        self.clock = clock
        self.session = session
        self.iteration = iteration
        self.plan = plan
        self.bench = bench
        self.post = post
        self.emit = emit
        self.commit = commit
        #: the mitigation this suspension carries: committed once every rank holds "go"
        self.action = action
        #: this rank's part of ``plan`` (its GEMM round, its P2P pairs); None: no share came
        self.work = work
        self.resend_s = resend_s
        #: seconds validation may take once it starts (None: no budget)
        self.budget_s = budget_s
        #: validation stopped early because a rank had spent the budget
        self.budget_spent = False
        self.committed = False
        self._go = threading.Event()
        self._release = threading.Event()
        self._resume = threading.Event()
        #: the action a "resume" brought (None: the verdict came without one)
        self._resume_action: MitigationAction | None = None
        #: the ranks voted on the verdict's action (see :meth:`_await_verdict`): no barrier after
        self._voted = False
        self._wake = threading.Event()
        self.pause_s: float | None = None
        self.expired = False

    def go(self) -> None:
        """The controller's ``go``: every rank is held (any thread)."""
        self._go.set()
        self._wake.set()

    def release(self) -> None:
        """The controller's ``release``: the session is off (any thread)."""
        self._release.set()
        self._wake.set()

    def resume(self, action: MitigationAction | None = None) -> None:
        """The controller's ``resume``: the verdict, with the ``action`` to apply from the
        next iteration or none (any thread)."""
        self._resume_action = action
        self._resume.set()
        self._wake.set()

    def run(self, end: float) -> None:
        """Runs on the trapped training thread; ``end`` is the deadline (monotonic)."""
        t0 = self.clock()
        self.post(held_ack(self.rank, self.session, self.iteration, time.time()))
        next_ack = t0 + self.resend_s
        while not (self._go.is_set() or self._release.is_set()):
            now = self.clock()
            left = end - now
            if left <= 0:
                self.expired = True
                break
            if now >= next_ack:  # the controller may not have heard: say it again
                self.post(held_ack(self.rank, self.session, self.iteration, time.time()))
                next_ack = now + self.resend_s
            self._wake.wait(min(left, 0.05))
        outcome = "released" if self._release.is_set() else "expired" if self.expired else "validated"
        if self._go.is_set() and not self._release.is_set():
            if self.plan is not None and (self.plan.gemm_rounds or self.plan.p2p_rounds):
                self.post(self._validate())
                if self.plan.verdict_wait_s > 0 and self.action is None:
                    self._await_verdict(self.plan.verdict_wait_s)
            if self.action is not None and not self._voted:
                self._agree()
        self.pause_s = self.clock() - t0
        self.post(resumed_ack(self.rank, self.session, self.iteration, time.time(), self.pause_s, self.expired,
                              self.committed))
        self.emit(
            "suspension", rank=self.rank, session=self.session, iteration=self.iteration,
            outcome=outcome, pause_s=round(self.pause_s, 4),
            **({"fabric": self.bench.fabric} if self.plan is not None and self.plan.p2p_rounds
               and outcome == "validated" else {}),
            **({"committed": self.committed} if self.action is not None else {}),
            **({"budget_spent": True} if self.budget_spent else {}),
        )

    def _await_verdict(self, wait_s: float) -> None:
        """Held after reporting until "resume" (or "release", or ``wait_s``); an action the
        resume brought becomes this suspension's, committed only if every rank that
        validated holds it (a vote over the validation group, which each of them joins
        however its wait ended, so none waits on a peer that resumed)."""
        deadline = self.clock() + wait_s
        while not (self._resume.is_set() or self._release.is_set()):
            left = deadline - self.clock()
            if left <= 0:
                break
            self._wake.wait(min(left, 0.05))
            self._wake.clear()
        action = self._resume_action if self._resume.is_set() and not self._release.is_set() else None
        vote = self.bench.agree_stop
        if vote is None:  # no vote over the group: the barrier that only holders enter
            self.action = action
            return
        self._voted = True
        try:
            lacking = bool(vote(action is None))
        except Exception as exc:
            self.action = action
            self.emit("control_error", rank=self.rank, error=f"verdict not agreed: {type(exc).__name__}: {exc}"[:300])
            return
        if action is None:
            return
        self.action = action  # the event and the resumed ack say whether it was committed
        if lacking:
            self.emit("control_error", rank=self.rank, error="action with the verdict not applied: a rank lacked it")
            return
        if self.commit is not None:
            self.commit(action)
        self.committed = True

    def _agree(self) -> None:
        """Commit the plan's action only once every rank is known to hold "go".

        "go" reaches ranks one by one, and a rank's own deadline may fire just before
        it: a barrier on the validation group (which only ranks that got "go" enter)
        turns that into all or nothing, so every rank applies the action from the same
        iteration or none does. A failed barrier times out on the group's deadline.
        """
        try:
            self.bench.barrier()
        except Exception as exc:  # the peers did not all come: apply nothing
            self.emit("control_error", rank=self.rank, error=f"action not agreed: {type(exc).__name__}: {exc}"[:300])
            return
        if self.commit is not None and self.action is not None:
            self.commit(self.action)
        self.committed = True

    def _out_of_budget(self, t0: float, expected_s: float = 0.0) -> bool:
        """Before a benchmark step of a repeat sweep: stop here? True once this rank, or (with
        :attr:`Bench.agree_stop`) any rank, has spent ``budget_s`` since ``t0``, or would
        spend it during a step expected to take ``expected_s`` (as long as the last step of
        its kind took: a second P2P sweep over a congested link is as slow as the first)."""
        if self.budget_s is None:
            return False
        spent = self.clock() - t0 + expected_s >= self.budget_s
        if self.bench.agree_stop is not None:
            spent = bool(self.bench.agree_stop(spent))
        self.budget_spent = spent
        return spent

    def _validate(self) -> ValidationResult:
        """Run this rank's share of the plan's benchmarks, step by step, until done or out
        of budget; the result holds what was measured (an error string says why it is
        partial or what failed)."""
        plan = self.plan
        assert plan is not None
        work = self.work if self.work is not None else RankWork(covered=False)
        flops: float | None = None
        error = "" if work.covered else f"no share of the validation plan came for rank {self.rank}"
        t0 = self.clock()
        steps = done = 0
        best: dict[tuple[int, int], float] = {}
        try:
            sweeps = plan.validation_sweeps
            rounds = range(plan.gemm_rounds)
            # this rank's transfers in their rounds; every rank runs every round's barrier
            schedule: list[list[tuple[int, int]]] = [[] for _ in range(plan.p2p_rounds)]
            for k, src, dst in work.pairs:
                schedule[k].append((src, dst))
            steps = sweeps * len(rounds) + (sweeps if plan.p2p_rounds else 0)
            # the first sweep of each kind runs whatever the budget (bounded by the group's
            # timeout): a verdict needs every suspect measured once (a budget spent on GEMM
            # rounds used to leave the links unmeasured, and the verdict named none). The
            # budget cuts only the repeats, each expected to take as long as the last of its kind
            last_gemm_s = last_p2p_s = 0.0
            for sweep in range(sweeps):  # each rank and pair keeps its best sweep
                for k in rounds:  # rounds: every rank takes part in each barrier
                    if sweep > 0 and self._out_of_budget(t0, last_gemm_s):
                        raise _BudgetSpent
                    t_step = self.clock()
                    if plan.gemm_rounds > 1:
                        self.bench.barrier()
                    if work.gemm_round == k:
                        got = float(self.bench.gemm(plan.gemm_n, plan.gemm_repeats))
                        flops = got if flops is None else max(flops, got)
                    last_gemm_s = self.clock() - t_step
                    done += 1
                if not plan.p2p_rounds:
                    continue
                if sweep > 0 and self._out_of_budget(t0, last_p2p_s):
                    raise _BudgetSpent
                t_step = self.clock()
                for src, dst, sec in self.bench.passes(schedule, plan.nbytes, plan.repeats, 0):
                    best[(src, dst)] = min(float(sec), best.get((src, dst), math.inf))
                last_p2p_s = self.clock() - t_step
                done += 1
        except _BudgetSpent:
            error = (f"partial: validation budget of {self.budget_s:g} s spent after {done} of {steps} steps "
                     f"({self.clock() - t0:.3f} s)")
        except Exception as exc:  # a broken benchmark must not take training down
            error = f"{type(exc).__name__}: {exc}"[:500]
            best = {}  # a pass that failed may have left its peers' timings half-taken
        return validation_result(self.rank, self.session, flops, ((src, dst, sec) for (src, dst), sec in best.items()),
                                 error)


class _BudgetSpent(Exception):
    """Raised between benchmark steps once the ranks agree the budget is spent."""
