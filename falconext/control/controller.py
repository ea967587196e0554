"""The global controller: one state machine per job, TRACKING -> PROFILING -> VALIDATING
(-> MITIGATING), as a small dispatcher over pure collaborators.

Ranks detect fail-slows on their own; the controller turns the first verified report
(or a straggler its scores show) into named slow components and, when mitigation is on,
into a strategy every rank applies. :class:`Controller` routes each message and tick to
the collaborator that decides, and sequences what one's result asks of another: the
heartbeats (heartbeats.JobView), the score trigger (stragglers.StragglerWatch), one
Episode per fail-slow and its rules (episodes), profile -> plan -> verdict
(localizer.Localizer), sessions, placement, acks and deadlines
(suspension.SuspensionCoordinator), the planner in and typed actions out
(mitigation_driver), operators' commands (operator.OperatorDesk) and the status
(snapshot). Each does no I/O and reads no clock.

:class:`Controller` is pure too: it takes messages and the time, and returns what to
post and what to log, so every path (a rank that misses the iteration, a profile that
never comes, a deadline) is tested without Redis. control/service.py is the thin
process around it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import numpy as np

from falconext.config import runtime_settable, FalconConfig
from falconext.control import mitigation_driver as driver
from falconext.control.episodes import Episode, State, dropped, ends, expire, is_new_fail_slow
from falconext.control.beat_table import ITERATION, RANK, heartbeats_of
from falconext.control.heartbeats import JobView
from falconext.control.localizer import Localizer, for_bus
from falconext.protocol.actions import MitigationAction
from falconext.protocol.commands import OPERATOR_COMMANDS, MitigateRequest, OperatorCommand, TableRequest
from falconext.protocol.messages import FailSlowReport, Heartbeat, Localized, NodeBatch, NodeHealth, NodeHeartbeats, ProfileData, SessionAck, StatusSnapshot, ValidationResult, heartbeat_block, heartbeat_row
from falconext.control.operator import OperatorDesk
from falconext.control.outputs import Output, event
from falconext.control.snapshot import TABLE_FILE, rank_table, snapshot
from falconext.control.stragglers import StragglerWatch
from falconext.control.suspension import SuspensionCoordinator, verdict_wait_s
from falconext.mitigate.mitigation import Mitigation
from falconext.mitigate.planner import Decision
from falconext.mitigate.room import RestartRoom

__all__ = ["Controller", "OPERATOR_COMMANDS", "Output", "RUNTIME_SETTABLE", "State", "for_bus"]

#: the thresholds ``ctl set`` may change: the config's fields marked RUNTIME
RUNTIME_SETTABLE = runtime_settable()


class Controller:
    """The control plane's decisions, as a pure state machine: :meth:`handle` takes one
    decoded message and :meth:`tick` the passing time, and both return the
    :class:`Output` list the I/O loop must carry out. It does no I/O and holds no clock
    of its own (``now`` is passed in), so every decision is testable on plain data."""

    def __init__(self, config: FalconConfig, world: int | None = None, first_session: int = 0,
                 clock: Callable[[], float] | None = None) -> None:
        """``first_session``: sessions are numbered from it (a restarted controller starts
        elsewhere than its predecessor, so no rank can take its commands for the old ones).
        ``clock``: the time now (the service's wall clock), read again after work that may
        take long (analysing a large job's profiles) so that a suspension is placed and
        given its deadline from when it is posted; None: the ``now`` handed in stands."""
        self.cfg = config
        self.clock = clock
        self.state = State.TRACKING
        self.episode: Episode | None = None
        self.job = JobView(world, config.heartbeat_history)
        self.stragglers = StragglerWatch()
        self.localizer = Localizer()
        self.suspension = SuspensionCoordinator(first_session)
        self.desk = OperatorDesk(RUNTIME_SETTABLE)
        #: a job of several launchers (fed by the I/O loop): each node's host name, the
        #: host that runs the control plane and the rendezvous store, spare nodes waiting
        self.node_hosts: dict[int, str] = {}
        self.plane_host: str | None = None
        self.spares = 0
        #: rendezvous rounds seen after the first, and the current one's id
        self.rounds = 0
        #: the restarts (S4) applied so far, and the fail-slow the last one answered:
        #: (healthy, slow) iteration times, whose share removed the status keeps serving
        #: after the restart ends the episode (the restart is the mitigation in force then)
        self.restarts = 0
        self.restarted_from: tuple[float, float] | None = None
        self.round_id: str | None = None

    # --- what the collaborators hold, as the controller's public view -----------------

    @property
    def session(self) -> int:
        """The session now (profiling, validation or an action's suspension)."""
        return self.suspension.session

    @property
    def world(self) -> int | None:
        """The ranks of the job (None: those heard from)."""
        return self.job.world

    @property
    def beats(self) -> dict[int, Heartbeat]:
        """Each rank's latest heartbeat."""
        return self.job.beats

    @property
    def history(self) -> dict[int, Any]:
        """Each rank's recent heartbeats."""
        return self.job.history

    @property
    def muted(self) -> bool:
        """Whether an operator muted the controller (no new episode, no planner decision)."""
        return self.desk.muted

    @property
    def localizations(self) -> list[Localized]:
        """Every verdict given, in order."""
        return self.localizer.localizations

    @property
    def link_baseline(self) -> dict[tuple[int, int], float]:
        """The healthy inter-node link times of the baseline session."""
        return self.localizer.link_baseline

    def ranks(self) -> set[int]:
        """The ranks the controller waits for (see JobView.ranks)."""
        return self.job.ranks()

    # --- inputs -----------------------------------------------------------------------

    def handle_beats(self, msgs: list[NodeHeartbeats], now: float) -> list[Output]:
        """Take several nodes' heartbeats read together at ``now`` as one block: what
        :meth:`handle` does with each message in turn, in a few array operations."""
        return self._beats(heartbeat_block(msgs), now)

    def handle_block(self, block: np.ndarray, now: float) -> list[Output]:
        """Take a block of heartbeats (rows of every Heartbeat field in order, as
        :func:`~falconext.protocol.messages.heartbeat_block` makes them: a beat reader's,
        control/beat_reader.py) received at ``now``, as :meth:`handle_beats` takes them."""
        return self._beats(block, now)

    def handle(self, msg: Any, now: float) -> list[Output]:
        """React to one message received at ``now``: heartbeats (a rank's, or a node's in a
        NodeHeartbeats), fail-slow reports (and the rest of the ranks' control flow, alone
        or a node's in a NodeBatch), operator commands, and the profiles,
        acknowledgements, validation results and node health of the current session (those
        of an older session are ignored). Returns what to post or log; an empty list when
        the message changes nothing. Never raises for a message that passed the schema."""
        if isinstance(msg, NodeHeartbeats):  # a node agent's: its ranks' heartbeats, as one block
            return self._beats(msg.block(), now)
        if isinstance(msg, NodeBatch):  # a node agent's: several ranks' messages of one kind
            msgs = msg.messages()
            taken = self._collect(msgs, now)  # a node's profiles, acks or results: at once
            if taken is not None:
                return taken
            got: list[Output] = []
            for one in msgs:
                got += self.handle(one, now)
            return got
        if isinstance(msg, Heartbeat):
            return self._beats(np.array([heartbeat_row(msg)]), now, made=msg)
        if isinstance(msg, FailSlowReport):
            return self._on_report(msg, now)
        if isinstance(msg, OPERATOR_COMMANDS):
            return self._operator(msg, now)
        if isinstance(msg, (ProfileData, SessionAck, ValidationResult)):
            return self._collect([msg], now) or []
        if isinstance(msg, NodeHealth) and msg.session == self.session:
            self.localizer.health[msg.node] = msg
        return []

    def defers_reports(self) -> bool:
        """Whether fail-slow reports may wait behind the session's own messages (the
        service reads them when the control stream is quiet): an episode is open past
        TRACKING, so a report can only join it, end it or rise in it. At 131,072 ranks
        every rank reports, and the 16,384 node batches of reports came before the
        profiles they had asked for."""
        return self.episode is not None and self.state is not State.TRACKING

    def _collect(self, msgs: list[Any], now: float) -> list[Output] | None:
        """Take ``msgs`` (one rank's, or a node's batch: 100k ranks' come at a
        suspension) when they are the session's acks of one status, or its profiles while
        PROFILING or validation results while VALIDATING: returns what follows (the "go",
        the analysis or the verdict once every rank's are in; else nothing). None for
        anything else (another session's are ignored, other kinds taken one by one)."""
        if not msgs:
            return None
        if isinstance(msgs[0], SessionAck):  # of one status: the session's acks at once
            if len({(m.session, m.status) for m in msgs}) != 1 or msgs[0].session != self.session:
                return None
            self.suspension.heard_at = now
            return self._on_ack(msgs, now)
        if isinstance(msgs[0], ProfileData) and self.state is State.PROFILING:
            kept, then = self.localizer.profiles, self._profiled
        elif isinstance(msgs[0], ValidationResult) and self.state is State.VALIDATING:
            kept, then = self.localizer.results, self._verdict
        else:
            return None
        if any(m.session != self.session for m in msgs):
            return None
        kept.update((m.rank, m) for m in msgs)
        self.suspension.heard_at = now
        return then(now) if self.job.covers(kept) else []

    def tick(self, now: float) -> list[Output]:
        """Deadlines (a phase that waits for ranks never waits forever), and the per-rank
        scores every ``score_interval_s``."""
        out = self._scores(now) + self._episode_timeout(now)
        if now < self.suspension.deadline or self.suspension.still_coming(now, self.cfg.control_slack_s):
            return out
        return out + self._deadline_passed(now)

    def _episode_timeout(self, now: float) -> list[Output]:
        """A fail-slow episode whose end reports did not all come closes (episodes.expire)."""
        ep = self.episode
        reason = None if ep is None or self.state is not State.TRACKING else expire(ep, now, self.job.beats, self.cfg)
        if ep is None or reason is None:
            return []
        self.episode = None
        return [event("episode_timeout", session=self.session, reason=reason,
                      missing=sorted(set(ep.reporters) - ep.ended), after_s=round(self.cfg.episode_timeout_s, 3))]

    def _scores(self, now: float) -> list[Output]:
        """The scores when due; a straggler they show is localized now: in an episode of
        its own when none is open, or as a re-localization inside a mitigated one that has
        not named it. Each outlier is acted on once, until it reads normal again."""
        if self.state in (State.PROFILING, State.VALIDATING):
            return []  # a localization runs (the ranks stand still at its suspension): due after it
        may_act = not self.muted and self.state is State.TRACKING
        out, s = self.stragglers.scores(self.job.beats, self.job.history, now, self.cfg, may_act)
        if s is None and may_act:
            s = self.stragglers.fast(self.job.beats, self.job.history, self.cfg)
        ep = self.episode
        if s is None:
            return out
        if ep is None:
            if s.baseline_s is None:
                return out  # no reading before it: nothing to measure the fault against
            self.stragglers.act(s)
            return out + [event("straggler_suspected", action="localize", **s.fields())] + self._start(
                "fail_slow", now, now, s.episode(now))
        d = driver.suspect_rise(ep, s)
        if d is None or ep.mitigation is None:
            return out
        self.stragglers.act(s)
        return out + [event("straggler_suspected", action="relocalize", **s.fields())] + self._decide(
            ep.mitigation, d, now, "scores")

    def _deadline_passed(self, now: float) -> list[Output]:
        if self.state is State.PROFILING:
            if not self.localizer.profiles:
                return self._abort(now, "no rank sent its profile in time")
            return self._profiled(now)
        if self.state is State.VALIDATING:
            if not self.suspension.go_sent:
                return [self.suspension.release()] + self._abort(now, "not every rank reached the suspension in time")
            return self._verdict(now)
        if self.state is State.MITIGATING:
            out = [] if self.suspension.go_sent else [self.suspension.release()]
            return out + self._mitigated(now, timed_out=True)
        return []

    # --- episodes ---------------------------------------------------------------------

    def _set(self, state: State, now: float, **why: Any) -> Output:
        old, self.state = self.state, state
        return event("controller_state", old=old.value, new=state.value, session=self.session, **why)

    def _on_report(self, rep: FailSlowReport, now: float) -> list[Output]:
        """A fail-slow report: held while muted, dropped when from before a restart, an end,
        a report that localizes again under a mitigation, one that joins the episode, or
        the start of one."""
        held = self.desk.hold(rep, self.episode is not None)
        if held is not None:
            return held
        ep, drop = self.episode, dropped(rep, self.job.restart_from)
        if drop is not None:
            return drop
        if rep.end is not None:
            if ep is not None and ep.end_reported(rep, now) and self.state is State.TRACKING:
                return self._maybe_close()
            return []
        if ep is not None and is_new_fail_slow(ep, rep, self.cfg, self.state is State.TRACKING, self.job.first_beats()):
            assert ep.mitigation is not None
            joined, d = driver.report_rise(ep, rep, self.session)
            return [joined] + ([] if d is None else self._decide(ep.mitigation, d, now, "report"))
        if ep is not None:
            return ep.join(rep, self.session)
        return self._start("fail_slow", rep.time, now, Episode.of_report(rep))

    def _start(self, trigger: str, t_event: float, now: float | None = None,
               ep: Episode | None = None) -> list[Output]:
        """Open an episode (``ep``, or an empty one) for the event at ``t_event`` and ask every
        rank for its calls. The profiles' deadline runs from when the controller handles the
        event (``now``)."""
        self.episode = ep if ep is not None else Episode(trigger, t_event)
        return self._session(trigger, t_event, now)

    def _session(self, trigger: str, t_event: float, now: float | None = None) -> list[Output]:
        """A new profiling session for the episode open now: every rank sends its calls."""
        self.localizer.begin()
        cmd = self.suspension.profile(t_event, now if now is not None else t_event, self.cfg)
        return [self._set(State.PROFILING, t_event, trigger=trigger), cmd]

    def _beats(self, block: np.ndarray, now: float, made: Heartbeat | None = None) -> list[Output]:
        """Take a block of heartbeats (a node's, :meth:`NodeHeartbeats.block`; ``made``: a
        lone Heartbeat's one row): kept (a clean reading while nothing is wrong), the
        first rank's fed to the planner (in a mitigated episode), and the link-baseline
        session started when it is due. Array operations over the block, nothing per
        heartbeat in the usual case (a node's heartbeats come a hundred thousand a second
        at 100k ranks)."""
        job = self.job
        job.record_block(block, clean=self.episode is None and self.state is State.TRACKING, made=made)
        out: list[Output] = []
        if self.episode is not None:  # each of the first rank's heartbeats, in turn (a read may hold two)
            rows = np.flatnonzero(block[:, RANK] == job.first_rank).tolist()
            for i in rows[:-1]:
                out += self._observe(heartbeats_of(block[i:i + 1])[0], now)
            if rows:
                out += self._observe(job.beats[int(job.first_rank)], now)
        if not self.localizer.baseline_started and self.cfg.link_baseline_iteration > 0:
            out += self._maybe_baseline(block, now)
        return out

    def _maybe_baseline(self, block: np.ndarray, now: float) -> list[Output]:
        """Start the link-baseline session once, when it is due (Localizer.baseline_due)."""
        idle = self.state is State.TRACKING and self.episode is None
        at = self.cfg.link_baseline_iteration
        past = block[block[:, ITERATION] >= at, RANK].astype(int).tolist()
        if self.localizer.baseline_due(past, at, idle, self.job.expected(), self.job.beats, self.job.first_beat):
            return self._start("baseline", now)
        return []

    def _abort(self, now: float, reason: str) -> list[Output]:
        self.suspension.deadline = math.inf
        if self.episode is not None:
            self.episode.drop_relocalization()
        out = self._release_hold() + [event("localization_failed", session=self.session, reason=reason),
                                      self._set(State.TRACKING, now)]
        return out + self._maybe_close()

    def _maybe_close(self) -> list[Output]:
        ep = self.episode
        if ep is None or not ends(ep):
            return []
        self.episode = None
        return [event("episode_end", session=self.session, ranks=sorted(ep.ended))]

    # --- localization -----------------------------------------------------------------

    def _profiled(self, now: float) -> list[Output]:
        ep = self.episode
        why = self.localizer.plan_validation(self.cfg, self.ranks(), self.job.node_of(),
                                             links_only=ep is not None and ep.trigger == "baseline")
        if why is not None:
            return self._abort(now, why)
        if self.clock is not None:  # the analysis of 100k profiles takes seconds: place from after it
            now = max(now, self.clock())
        profiled = event("profiled", session=self.session, **self.localizer.profiled(self.cfg.listed_ranks))
        return [profiled] + self._suspend(now)

    def _suspend(self, now: float, state: State = State.VALIDATING) -> list[Output]:
        """Pick an iteration every rank has yet to start, and tell everyone to stop there
        (placed after the validation plan is cut into shares, which takes seconds at 100k
        ranks: from the clock then, the commands' posting time)."""
        if state is State.VALIDATING:
            validation, shares = self.localizer.split()
            if self.clock is not None:
                now = max(now, self.clock())
        placed = self.suspension.place(self.job.beats, now, self.cfg)
        if state is State.VALIDATING:
            may = self.episode is not None and self.episode.may_mitigate(self.cfg, self.muted)
            wait = verdict_wait_s(validation, may, self.cfg.suspend_verdict_wait_s)
            posts = self.suspension.validation_posts(validation, shares, wait, self.cfg)
        else:
            posts = self.suspension.action_posts(self.cfg)
        change = [] if self.state is state else [self._set(state, now, iteration=placed.iteration,
                                                           margin=placed.margin)]
        return change + posts

    def _release_hold(self) -> list[Output]:
        return self.suspension.release_hold(self.ranks(), self.cfg.suspend_deadline_s)

    def _on_ack(self, ack: SessionAck | list[SessionAck], now: float) -> list[Output]:
        res = self.suspension.ack(ack, now, suspended=self.state in (State.VALIDATING, State.MITIGATING),
                                  validating=self.state is State.VALIDATING, covers=self.job.covers,
                                  tries=self.cfg.suspend_tries, deadline_s=self.cfg.suspend_deadline_s,
                                  slack_s=self.cfg.control_slack_s)
        if res.gave_up:
            rank = (ack if isinstance(ack, SessionAck) else ack[0]).rank
            return res.outputs + (self._mitigated(now, timed_out=True) if self.state is State.MITIGATING
                                  else self._abort(now, f"rank {rank} kept missing the suspension"))
        if res.missed:
            return res.outputs + self._suspend(now, self.state)
        return res.outputs + (self._mitigated(now) if res.all_resumed and self.state is State.MITIGATING else [])

    def _verdict(self, now: float) -> list[Output]:
        ep = self.episode
        onset = ep.reference_onset() if ep is not None else None
        v = self.localizer.verdict(self.cfg, self.ranks(), self.job.beats, self.job.history, onset)
        if isinstance(v, str):
            return self._abort(now, v)
        if ep is not None and ep.trigger == "baseline":
            return self._baseline_verdict(ep, v.link_evidence, now)
        if not v.gpus and not v.links and v.missing and self.suspension.tries < self.cfg.suspend_tries:
            return self._validate_again(v.missing, now)
        loc = self.localizer.localize(v, self.session, ep.localizing() if ep else "unknown")
        if ep is not None:
            ep.localized = True
        after = None if ep is None else round(ep.since(now), 3)
        out = [Output("localized", for_bus(loc)),
               event("localized", gpus=loc.gpus, links=loc.links, evidence=loc.evidence, after_event_s=after),
               self._set(State.TRACKING, now, localized=True)]
        self.suspension.deadline = math.inf
        if ep is not None and ep.relocalizing is not None:
            out += self._relocalized(ep, loc, now)
        elif ep is not None and ep.trigger == "fail_slow" and (v.gpus or v.links) and self.cfg.mitigation:
            if self.muted:
                out.append(event("mitigation_skipped", session=self.session, reason="muted by the operator"))
            else:
                out += self._plan_mitigation(ep, loc, now)
        out += self._decide_while_held(now) + self._release_hold()
        return out + self._maybe_close()

    def _baseline_verdict(self, ep: Episode, link_evidence: dict[str, Any], now: float) -> list[Output]:
        """The baseline session's end: keep the links' times if none was slow; a fail-slow
        reported meanwhile gets its own episode."""
        kept = self.localizer.keep_baseline(link_evidence)
        out = [event("link_baseline", session=self.session, links=link_evidence.get("links", {}), kept=kept,
                     after_event_s=round(now - ep.t_event, 3)),
               self._set(State.TRACKING, now)]
        self.suspension.deadline = math.inf
        self.episode = None
        if ep.reporters and not ep.ended >= set(ep.reporters):  # the reports carry over
            out += self._start("fail_slow", now, ep=dataclasses.replace(ep, trigger="fail_slow", t_event=now))
        return out

    def _validate_again(self, missing: list[int], now: float) -> list[Output]:
        """Nothing found, and some ranks' results never came (lost on the bus, seen under
        chaos): nothing found is no verdict without the peers a result is judged against.
        Validate again in a new session; after ``suspend_tries`` the verdict is given."""
        out = self._release_hold() + [event("validation_incomplete", session=self.session, missing=missing,
                                            tries=self.suspension.tries,
                                            reason="nothing found without their results: validating again")]
        self.suspension.session += 1  # a new session: stale acks and results of the old one are ignored
        self.localizer.clear_results()
        return out + self._suspend(now)

    # --- mitigation -------------------------------------------------------------------

    def _plan_mitigation(self, ep: Episode, loc: Localized, now: float,
                         clean_before: int | None = None) -> list[Output]:
        mit = driver.start_mitigation(ep, loc, self.job.clean_before(min(ep.onsets, default=-1)), self.job.beats,
                                      self.job.history, self.cfg, self.suspension.last_pause_s,
                                      self.localizer.p2p_bytes(), clean_before)
        if isinstance(mit, str):
            return [event("mitigation_skipped", session=self.session, reason=mit)]
        ep.mitigation = mit
        return [event("planner_started", session=self.session, **mit.planner.status())]

    def _relocalized(self, ep: Episode, loc: Localized, now: float) -> list[Output]:
        r = driver.relocalized(ep, loc, self.muted, self.job.beats, self.job.history, self.cfg, self.session, now,
                               self.localizer.p2p_bytes())
        if r.new_episode is None:
            return r.outputs
        assert r.part is not None
        self.episode = r.new_episode
        return r.outputs + self._plan_mitigation(r.new_episode, r.part, now, clean_before=r.clean_before)

    def _observe(self, beat: Heartbeat, now: float) -> list[Output]:
        """Feed the planner one observation per loop iteration (from the first rank), unless muted."""
        ep = self.episode
        if ep is None or ep.mitigation is None or self.muted or beat.rank != self.job.first_rank:
            return []
        out, d = driver.observe(ep, beat, self.job.beats, self.cfg, self.suspension.last_pause_s, self.session)
        return out + ([] if d is None else self._decide(ep.mitigation, d, now))

    def _decide_while_held(self, now: float) -> list[Output]:
        """The ranks are still held for the verdict: the planner sees the latest iteration
        now, so an action it decides travels with the verdict's "resume"."""
        if not self.job.beats or not self.suspension.held_for_verdict(now):
            return []
        return self._observe(self.job.beats[int(self.job.first_rank)], now)

    def _decide(self, mit: Mitigation, d: Decision, now: float, trigger: str = "planner") -> list[Output]:
        out = [driver.decision_event(d, self.session, trigger)]
        if d.action == "relocalize":
            ep = self.episode
            if self.state is not State.TRACKING or ep is None or ep.mitigation is not mit:
                mit.planner.relocalized(False)
                return out
            # the planner saw a rise: localize again, in this episode, before it escalates
            ep.relocalizing, ep.relocalizing_t = mit.planner.state().relocalizing, now
            return out + self._session("relocalize", now, now)
        if self.state is not State.TRACKING:
            return out + driver.action_failed(mit, d, f"controller busy ({self.state.value})", self.session)
        action = driver.prepare_action(mit, d, self.job.beats, self.cfg, self.restart_room())
        if isinstance(action, str):
            return out + driver.action_failed(mit, d, action, self.session)
        return out + self._start_action(action, now)

    def _start_action(self, action: MitigationAction, now: float) -> list[Output]:
        """Apply ``action`` on every rank from one iteration: with the verdict's "resume"
        while the ranks are still held for it, else in a suspension of its own one margin ahead."""
        cmd = self.suspension.resume_with(action, now, self.state is State.TRACKING, self.cfg)
        if cmd is not None:
            return [self._set(State.MITIGATING, now, iteration=self.suspension.iteration, with_verdict=True), cmd]
        self.suspension.begin_action(action)
        return self._suspend(now, State.MITIGATING)

    def _mitigated(self, now: float, timed_out: bool = False) -> list[Output]:
        """The action's suspension is over: applied on every rank, or on none. One that
        travelled with a verdict and was not applied (a rank's wait for the verdict ran
        out first) is agreed on again in a suspension of its own: the strategy did not
        fail, the hold was over."""
        end = self.suspension.end_action(self.job.covers, self.ranks())
        out = [self._set(State.TRACKING, now, mitigated=end.committed)]
        ep = self.episode
        mit = ep.mitigation if ep is not None else None
        d = mit.in_flight if mit is not None else None
        if mit is not None:
            mit.in_flight = None
        if not end.committed:
            events, retry = driver.not_committed(end, mit, d, timed_out, self.session)
            if retry is not None:
                return out + events + self._start_action(retry, now)
            return out + events + (self._maybe_close() if mit is not None and d is not None else [])
        strategy, effective = end.action.strategy if end.action is not None else "?", self.suspension.iteration + 1
        applied, again = driver.applied(end, mit, d, effective, self.job.beats, self.session)
        self.job.plan_changed(strategy, effective, self.cfg.beat_iter_window)
        if strategy == "S4":
            self.stragglers.forget()  # every process restarts: its scores are of processes that are gone
        out.append(applied)
        if mit is not None and again is not None:
            out += self._decide(mit, again, now)
        if strategy == "S4":
            self.restarts += 1
        if strategy == "S4" and ep is not None:  # the ranks restart: their detectors start over
            levels = ep.slow_levels
            if mit is not None and levels and mit.planner.state().healthy_s:
                self.restarted_from = (float(mit.planner.state().healthy_s), float(sorted(levels)[len(levels) // 2]))
            self.episode = None
            out.append(event("episode_end", session=self.session, ranks=sorted(ep.ended), reason="restart"))
        elif mit is not None and mit.planner.finished:
            out += self._maybe_close()
        return out

    # --- the job's rounds -------------------------------------------------------------

    def new_round(self, world: int) -> None:
        """A job of several launchers formed a new rendezvous round of ``world`` ranks (after
        a restart, or a node lost): forget the nodes' hosts and what every rank said before."""
        self.rounds += 1
        self.node_hosts.clear()
        self.job.new_round(world)

    def restart_room(self) -> RestartRoom:
        """What the job can absorb when nodes leave (see RestartRoom), from the heartbeats'
        nodes, the launcher's floor, the spares waiting and the plane's host."""
        return self.job.restart_room(self.cfg.restart_floor_nodes, self.node_hosts, self.plane_host, self.spares)

    # --- operators (falconext ctl) ----------------------------------------------------

    def _operator(self, cmd: OperatorCommand, now: float) -> list[Output]:
        """One operator command, taken by the desk (OperatorDesk.take) and recorded by it
        (an ``operator_command`` event and, when it carries an ``id``, a CommandReply)."""
        if isinstance(cmd, TableRequest):  # the whole table, which a large job's status leaves out
            rows = rank_table(now, self.job.beats, self.stragglers.latest)
            return self.desk.record(cmd, now, [Output("table", rows)],
                                    f"every rank's row ({len(rows)} ranks) in {TABLE_FILE}, beside the events", self.session)
        t = self.desk.take(cmd, self.cfg, None if self.state is State.TRACKING else f"busy ({self.state.value})",
                           self.job.beats)
        self.cfg, out, text = t.cfg, t.outputs, t.text
        if t.validate:
            out = self._start("operator", now)
            text = f"validation started (session {self.session})"
        elif t.action is not None:
            out += self._start_action(t.action, now)
            strategy = cmd.strategy if isinstance(cmd, MitigateRequest) else None
            text = (f"{strategy} applies after the suspension at iteration "
                    f"{self.suspension.iteration} (session {self.session})")
        for rep in t.unmuted or []:  # taken up now: the first starts an episode, the others join it
            out += self._on_report(dataclasses.replace(rep, time=now), now)
        return self.desk.record(cmd, now, out, text, self.session)

    def operator_state(self) -> dict[str, Any]:
        """What operators changed (mute, thresholds set), as plain JSON data: a controller
        that is restarted takes it up again with :meth:`restore`."""
        return self.desk.state()

    def restore(self, state: Any) -> list[Output]:
        """Take up a predecessor's :meth:`operator_state` (checked like the commands were:
        what does not check out is left out and named in the event)."""
        self.cfg, out = self.desk.restore(self.cfg, state)
        return out

    def snapshot(self, now: float, job: str = "", last_event: dict[str, Any] | None = None) -> StatusSnapshot:
        """The job as the controller sees it now (control/snapshot.py), a large job's ranks'
        scores those of the latest rank_scores."""
        return snapshot(now, job, last_event, self.job.beats, self.job.world, self.state.value, self.session,
                        self.muted, self.episode, self.cfg, self.stragglers.latest,
                        restarts=self.restarts, restarted_from=self.restarted_from)
