"""The controller's side of a suspension: sessions, placement, acks and deadlines
(:class:`SuspensionCoordinator`).

Every rank suspends at one agreed loop iteration to validate (VALIDATING) or to apply a
mitigation (MITIGATING): the coordinator picks an iteration every rank has yet to start
(:func:`placement`), posts the suspend (a validation's shares first), sends "go" once
every rank is held, and counts the "resumed" acks. A rank that missed the iteration
gets a later one in a new session, ``suspend_tries`` times at most. A fail-slow's
validation keeps the ranks held for the verdict (``suspend_verdict_wait_s``): an action
decided by then travels with the verdict's "resume" (:meth:`SuspensionCoordinator.resume_with`)
instead of a suspension of its own. Sessions are numbered: a message of an older
session is ignored.

The rank's side is validate/suspension.py. The coordinator does no I/O and holds no
clock: ``now`` is passed in; what it posts is returned as :class:`Output`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from falconext.config import FalconConfig
from falconext.control.beat_table import columns
from falconext.protocol.actions import MitigationAction
from falconext.protocol.commands import Go, ProfileRequest, Release, Resume, Share, Suspend, ValidationPlan, ValidationShare
from falconext.protocol.messages import Heartbeat, SessionAck
from falconext.control.outputs import Output, event, post


@dataclass(frozen=True)
class Placement:
    """Where every rank suspends: the loop ``iteration``, how many iterations past the one
    next due it is (``margin``), and when the suspension is given up (``deadline``)."""

    iteration: int
    margin: int
    deadline: float


def is_long(iter_s: float, margin_s: float) -> bool:
    """Whether an iteration of ``iter_s`` lasts at least ``margin_s`` (``suspend_margin_s``; 0: never)."""
    return margin_s > 0 and iter_s >= margin_s


def margin_iterations(iter_s: float, cfg: FalconConfig) -> int:
    """Iterations between the controller's estimate of where the ranks are and the one
    they suspend at: ``suspend_margin_iterations``, or one when an iteration lasts at
    least ``suspend_margin_s``: the margin is time for the command to reach every
    rank, and one such iteration gives it. (When every heartbeat says how far into its
    iteration the rank was, :func:`placement` needs only ``suspend_margin_s`` itself.)"""
    return 1 if is_long(iter_s, cfg.suspend_margin_s) else cfg.suspend_margin_iterations


def placement(beats: Mapping[int, Heartbeat] | Iterable[Heartbeat], now: float, tries: int, cfg: FalconConfig) -> Placement:
    """An iteration every rank has yet to start at ``now``, from their latest heartbeats,
    further ahead on each try (``tries``, from 1): where each rank is at least (its
    iteration and the time since it began), plus :func:`margin_iterations` per try, or,
    when every rank said how far into its iteration it was and iterations are long, the
    first that starts ``suspend_margin_s`` per try from now. The deadline leaves time to
    reach it, ``suspend_deadline_s`` and ``control_slack_s``."""
    its, iters, times, into = columns(beats, "iteration", "iter_s", "time", "into_s")
    latest, iter_s, placed = 0.0, 0.0, bool((into >= 0).all())
    if len(its):
        iter_s = max(0.0, float(iters.max()))
        since = np.maximum(0.0, now - times + np.maximum(0.0, into))  # since its iteration began, at least
        safe = np.where(iters > 0, iters, 1.0)
        latest = max(0.0, float(np.where(iters > 0, its + since / safe, its).max()))
    if placed and is_long(iter_s, cfg.suspend_margin_s):
        iteration = int(math.ceil(latest + tries * cfg.suspend_margin_s / iter_s))
    else:
        iteration = int(math.ceil(latest)) + margin_iterations(iter_s, cfg) * tries
    wait = (iteration - latest + 1) * max(iter_s, 0.05)
    return Placement(iteration, iteration - int(math.ceil(latest)),
                     now + wait + cfg.suspend_deadline_s + cfg.control_slack_s)


def verdict_wait_s(validation: ValidationPlan, may_mitigate: bool, wait_s: float) -> float:
    """How long the ranks stay held for the verdict after validating: ``wait_s`` only where
    the verdict may start a mitigation at once (``may_mitigate``: a fail-slow's episode,
    mitigation on, not muted) and the ranks have something to validate (they report,
    then wait); else 0."""
    if not may_mitigate or not (validation.gemm_rounds or validation.p2p_rounds):
        return 0.0
    return wait_s


@dataclass
class AckOutcome:
    """What an ack did: the outputs to post; ``missed``: a rank missed the iteration (the
    ranks were released; a retry in a new session is due unless ``gave_up``);
    ``all_resumed``: every rank has resumed."""

    outputs: list[Output] = field(default_factory=list)
    missed: bool = False
    gave_up: bool = False
    all_resumed: bool = False


@dataclass(frozen=True)
class ActionEnd:
    """How an action's suspension ended: the action, whether it travelled with a verdict,
    the "resumed" acks, whether every rank committed it, the ranks not heard from."""

    action: MitigationAction | None
    via_resume: bool
    acks: Mapping[int, SessionAck]
    committed: bool
    unheard: list[int]

    def pause_s(self) -> float:
        """The longest pause a rank reported (0.0: none)."""
        return max((a.pause_s for a in self.acks.values()), default=0.0)


#: how long past its deadline a session may wait while its messages are still being taken
MAX_DEFER_S = 30.0


class SuspensionCoordinator:
    """The session now and its suspension: where, who acked what, until when."""

    def __init__(self, first_session: int = 0) -> None:
        """Sessions are numbered from ``first_session`` on (a restarted controller starts
        elsewhere than its predecessor, so no rank can take its commands for the old ones)."""
        self.session = first_session
        self.iteration = 0
        self.tries = 0
        self.acks: dict[str, dict[int, SessionAck]] = {}
        self.go_sent = False
        self.deadline = math.inf
        #: seconds the ranks of this validation session stay held for its verdict (0: none)
        self.wait_s = 0.0
        #: the validation session whose ranks are held for its verdict now (None: none)
        self.awaiting: int | None = None
        #: the MITIGATING action travelled with a validation's verdict (not its own suspension)
        self.via_resume = False
        self.action: MitigationAction | None = None  # the action of the MITIGATING session
        self.last_pause_s = 0.0
        self.held_since = 0.0  # when every rank was held in the suspension now running
        #: when the controller last took a rank's message of this session (a profile, an
        #: ack, a result): while they keep coming, a deadline waits (:meth:`still_coming`)
        self.heard_at = -math.inf

    def still_coming(self, now: float, slack_s: float) -> bool:
        """Whether a passed deadline waits: the session's messages are still being taken
        (one within ``slack_s``), at most :data:`MAX_DEFER_S` past the deadline. At 100k
        ranks the controller reads a session's acks or results for seconds after the ranks
        sent them in time; a rank that never answers still fails the session once the
        others' messages stop."""
        return now - self.heard_at < slack_s and now < self.deadline + MAX_DEFER_S

    def _fresh(self) -> None:
        self.session += 1
        self.acks.clear()
        self.tries = 0
        self.go_sent = False

    def profile(self, t_event: float, now: float, cfg: FalconConfig) -> Output:
        """A new session that asks every rank for its calls; its deadline runs from when
        the controller handles the event (the later of ``t_event`` and ``now``): a report
        that waited behind a backlog of heartbeats would otherwise find it passed."""
        self._fresh()
        self.deadline = max(t_event, now) + cfg.profile_timeout_s
        return post(ProfileRequest(self.session, cfg.profile_window_s, cfg.profile_timeout_s))

    def place(self, beats: Mapping[int, Heartbeat] | Iterable[Heartbeat], now: float, cfg: FalconConfig) -> Placement:
        """One more try at a suspension of this session: its :func:`placement`, no acks yet."""
        self.tries += 1
        p = placement(beats, now, self.tries, cfg)
        self.iteration, self.deadline = p.iteration, p.deadline
        self.acks = {"held": {}, "resumed": {}}
        self.go_sent = False
        return p

    def validation_posts(self, validation: ValidationPlan, shares: list[ValidationShare], wait_s: float,
                         cfg: FalconConfig) -> list[Output]:
        """The shares of each rank's work, then the suspend that carries what all need
        alike (one stream: every rank reads the shares first); ``wait_s``: the hold for the
        verdict (:func:`verdict_wait_s`)."""
        self.wait_s = wait_s
        if wait_s > 0:
            validation = dataclasses.replace(validation, verdict_wait_s=wait_s)
        posts = [post(Share(self.session, sh)) for sh in shares]
        return posts + [post(Suspend(self.session, self.iteration, cfg.suspend_deadline_s, validation=validation))]

    def action_posts(self, cfg: FalconConfig) -> list[Output]:
        """The suspend that carries the action (of this session: a retry is a new one)."""
        if self.action is not None:
            self.action = dataclasses.replace(self.action, session=self.session)
        return [post(Suspend(self.session, self.iteration, cfg.suspend_deadline_s, action=self.action))]

    def release(self) -> Output:
        """Let every rank of this session go on without validating or applying anything."""
        return post(Release(self.session))

    def ack(self, ack: SessionAck | Sequence[SessionAck], now: float, *, suspended: bool, validating: bool,
            covers: Callable[[Mapping[int, Any]], bool], tries: int, deadline_s: float,
            slack_s: float = 0.0) -> AckOutcome:
        """Take one ack of this session at ``now``, or several of one status at once (a
        node's: 100k ranks' come at a suspension; their last one decides, as it would
        one by one). "missed" (a rank was past the iteration
        before the "go"): release the ranks, and a new session for a retry, unless
        ``tries`` suspensions were tried. "held" from every rank (``covers``) while
        ``suspended``: "go" (a validation's ranks then wait for the verdict if it holds
        them), and the session's deadline at least ``deadline_s`` + ``slack_s`` from now:
        what the ranks are given after the "go" (at 65,536 ranks the last ack came after
        the deadline placed for it, and the verdict was due before the "go" had gone).
        "resumed" from every rank: the ``resumed`` event with the pauses."""
        many = [ack] if isinstance(ack, SessionAck) else list(ack)
        if len({a.status for a in many}) != 1:
            raise ValueError("acks taken at once must be of one status")
        ack = many[-1]
        if ack.status == "missed" and suspended and not self.go_sent:
            ack = many[0]  # the first that missed names the rank
            out = [self.release(), event("suspend_missed", session=self.session, rank=ack.rank,
                                         iteration=self.iteration, at=ack.iteration)]
            if self.tries >= tries:
                return AckOutcome(out, missed=True, gave_up=True)
            self.session += 1  # a new session: stale acks of the old one are ignored
            return AckOutcome(out, missed=True)
        if ack.status not in ("held", "resumed"):
            return AckOutcome()
        acks = self.acks.setdefault(ack.status, {})
        acks.update((a.rank, a) for a in many)
        res = AckOutcome()
        if ack.status == "held" and not self.go_sent and covers(acks) and suspended:
            self.go_sent = True
            self.held_since = now
            self.deadline = max(self.deadline, now + deadline_s + slack_s)
            if validating and self.wait_s > 0:
                self.awaiting = self.session  # they validate, report, and wait for the verdict
            res.outputs.append(post(Go(self.session, deadline_s)))
            res.outputs.append(event("suspended", session=self.session, iteration=self.iteration, ranks=len(acks)))
        if ack.status == "resumed" and covers(acks):
            pauses = [a.pause_s for a in acks.values()]
            self.last_pause_s = max(pauses)
            res.all_resumed = True
            res.outputs.append(event("resumed", session=self.session, pause_s=round(max(pauses), 4),
                                     pause_median_s=round(sorted(pauses)[len(pauses) // 2], 4),
                                     expired=sorted(a.rank for a in acks.values() if a.expired)))
        return res

    def held_for_verdict(self, now: float) -> bool:
        """Whether the ranks are still held for the verdict: then the hold so far prices
        the next action's suspension (at least what it has lasted: a job whose first
        suspension this is has no measured pause yet)."""
        if self.awaiting is None or self.acks.get("resumed"):
            return False
        self.last_pause_s = max(self.last_pause_s, now - self.held_since)
        return True

    def release_hold(self, ranks: set[int], deadline_s: float) -> list[Output]:
        """The verdict's "resume" without an action, for ranks still held for it."""
        session, self.awaiting = self.awaiting, None
        if session is None or set(self.acks.get("resumed", {})) >= ranks:
            return []
        return [post(Resume(session, deadline_s))]

    def resume_with(self, action: MitigationAction, now: float, tracking: bool, cfg: FalconConfig) -> Output | None:
        """The verdict's "resume" carrying ``action`` while the ranks of this session are
        still held for it (they vote and commit it from the iteration after their hold);
        None when they are not (the action needs a suspension of its own:
        :meth:`begin_action`)."""
        held = self.awaiting
        if held is None or held != self.session or not tracking or self.acks.get("resumed"):
            return None
        self.awaiting = None
        self.via_resume = True
        self.action = dataclasses.replace(action, session=held)
        self.deadline = now + cfg.suspend_deadline_s + cfg.control_slack_s
        return post(Resume(held, cfg.suspend_deadline_s, action=self.action))

    def begin_action(self, action: MitigationAction) -> None:
        """A new session for ``action``'s own suspension (placed by :meth:`place`)."""
        self.via_resume = False
        self._fresh()
        self.action = dataclasses.replace(action, session=self.session)

    def end_action(self, covers: Callable[[Mapping[int, Any]], bool], ranks: set[int]) -> ActionEnd:
        """The action's suspension is over: the action and how it ended. A rank commits
        only past a barrier that every rank must enter (Suspension._agree), so one rank's
        "committed" means all committed: a lost ack must not turn an action applied
        everywhere into a failure in the controller's books (seen under chaos)."""
        action, self.action = self.action, None
        via_resume, self.via_resume = self.via_resume, False
        acks = self.acks.get("resumed", {})
        committed = bool(acks) and all(a.committed for a in acks.values()) and (covers(acks) or self.go_sent)
        self.deadline = math.inf
        return ActionEnd(action, via_resume, acks, committed, sorted(ranks - set(acks)))
