"""The global controller: one state machine per job, TRACKING -> PROFILING -> VALIDATING.

Ranks detect fail-slows on their own; the controller turns the first verified report
into named slow components. It asks every rank for its recent collective calls
(PROFILING), analyses them into suspects, and has every rank suspend at one agreed loop
iteration to validate the suspects (VALIDATING): GEMMs and P2P passes, run by the
ranks while their training threads are trapped. The verdict is a ``Localized`` message
and a ``localized`` event; planning (issue 5) will hang off that state.

:class:`Controller` is pure: it takes messages and the time, and returns what to post
and what to log, so every path (a rank that misses the iteration, a profile that never
comes, a deadline) is tested without Redis. :func:`main` is the thin process around it.

One episode per fail-slow: reports from the other ranks, and ladder updates, join the
episode rather than start new ones; the episode closes when every rank that reported
it has reported its end, and only then can a new one start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from falconext.config import FalconConfig
from falconext.control.messages import (
    Command,
    FailSlowReport,
    Heartbeat,
    Localized,
    NodeHealth,
    ProfileData,
    SessionAck,
    ValidationResult,
)
from falconext.profile.window import Findings, analyze_window
from falconext.validate.plan import validation_plan
from falconext.validate.verdict import slow_links, slow_ranks

#: times a suspension is retried after a rank missed the agreed iteration
MAX_SUSPEND_TRIES = 3
#: extra seconds the controller gives ranks beyond their own deadlines
SLACK_S = 2.0


class State(str, Enum):
    TRACKING = "tracking"
    PROFILING = "profiling"
    VALIDATING = "validating"


@dataclass
class Output:
    """Something the I/O loop must do: post a message, or write an event."""

    kind: str  # "command" | "localized" | "event"
    message: Any = None
    event: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Episode:
    trigger: str
    t_event: float
    reporters: dict[int, int] = field(default_factory=dict)  # rank -> event id
    ended: set[int] = field(default_factory=set)
    localized: bool = False


class Controller:
    def __init__(self, config: FalconConfig, world: int | None = None) -> None:
        self.cfg = config
        self.world = world
        self.state = State.TRACKING
        self.session = 0
        self.beats: dict[int, Heartbeat] = {}
        self.episode: _Episode | None = None
        self._profiles: dict[int, ProfileData] = {}
        self._findings: Findings | None = None
        self._plan: dict[str, Any] | None = None
        self._acks: dict[str, dict[int, SessionAck]] = {}
        self._results: dict[int, ValidationResult] = {}
        self._health: dict[int, NodeHealth] = {}
        self._deadline = math.inf
        self._tries = 0
        self._iteration = 0
        self._go_sent = False
        self.localizations: list[Localized] = []

    # --- inputs -----------------------------------------------------------------------

    def ranks(self) -> set[int]:
        if self.world is not None:
            return set(range(self.world))
        return set(self.beats)

    def handle(self, msg: Any, now: float) -> list[Output]:
        if isinstance(msg, Heartbeat):
            self.beats[msg.rank] = msg
            return []
        if isinstance(msg, FailSlowReport):
            return self._on_report(msg, now)
        if isinstance(msg, Command) and msg.kind == "validate":
            if self.state is not State.TRACKING:
                return [_event("operator_ignored", reason=f"busy ({self.state.value})")]
            return self._start("operator", now)
        if isinstance(msg, ProfileData) and self.state is State.PROFILING and msg.session == self.session:
            self._profiles[msg.rank] = msg
            if set(self._profiles) >= self.ranks():
                return self._profiled(now)
            return []
        if isinstance(msg, SessionAck) and msg.session == self.session:
            return self._on_ack(msg, now)
        if isinstance(msg, ValidationResult) and self.state is State.VALIDATING and msg.session == self.session:
            self._results[msg.rank] = msg
            if set(self._results) >= self.ranks():
                return self._verdict(now)
            return []
        if isinstance(msg, NodeHealth) and msg.session == self.session:
            self._health[msg.node] = msg
        return []

    def tick(self, now: float) -> list[Output]:
        """Deadlines: a phase that waits for ranks never waits forever."""
        if now < self._deadline:
            return []
        if self.state is State.PROFILING:
            if not self._profiles:
                return self._abort(now, "no rank sent its profile in time")
            return self._profiled(now)
        if self.state is State.VALIDATING:
            if not self._go_sent:
                out = [Output("command", Command("release", 0.0, args={"session": self.session}))]
                return out + self._abort(now, "not every rank reached the suspension in time")
            return self._verdict(now)
        return []

    # --- transitions ------------------------------------------------------------------

    def _set(self, state: State, now: float, **why: Any) -> Output:
        old, self.state = self.state, state
        return _event("controller_state", old=old.value, new=state.value, session=self.session, **why)

    def _on_report(self, rep: FailSlowReport, now: float) -> list[Output]:
        ep = self.episode
        if rep.end is not None:
            if ep is not None and ep.reporters.get(rep.rank) == rep.event_id:
                ep.ended.add(rep.rank)
                if ep.ended >= set(ep.reporters) and self.state is State.TRACKING:
                    self.episode = None
                    return [_event("episode_end", session=self.session, ranks=sorted(ep.ended))]
            return []
        if ep is not None:
            ep.reporters.setdefault(rep.rank, rep.event_id)
            return []
        out = self._start("fail_slow", rep.time)
        assert self.episode is not None
        self.episode.reporters[rep.rank] = rep.event_id
        return out

    def _start(self, trigger: str, t_event: float) -> list[Output]:
        self.session += 1
        self.episode = _Episode(trigger, t_event)
        self._profiles.clear()
        self._results.clear()
        self._health.clear()
        self._acks.clear()
        self._findings = self._plan = None
        self._tries = 0
        self._go_sent = False
        self._deadline = t_event + self.cfg.profile_timeout_s
        cmd = Command("profile", self.cfg.profile_timeout_s, args={"session": self.session, "window_s": self.cfg.profile_window_s})
        return [self._set(State.PROFILING, t_event, trigger=trigger), Output("command", cmd)]

    def _profiled(self, now: float) -> list[Output]:
        try:
            findings = analyze_window(list(self._profiles.values()), self.cfg.suspicious_factor, self.cfg.profile_min_bytes)
        except ValueError as exc:
            return self._abort(now, f"bad profile data: {exc}")
        self._findings = findings
        ranks = sorted(self.ranks() | set(self._profiles))
        try:
            self._plan = validation_plan(
                findings.groups,
                ranks,
                [r for r in findings.compute_suspects if r in ranks],
                findings.suspicious_groups,
                gemm_n=self.cfg.gemm_size,
                gemm_repeats=self.cfg.gemm_repeats,
                gemm_concurrency=self.cfg.gemm_concurrency,
                p2p_concurrency=self.cfg.p2p_concurrency,
                p2p_bytes=self.cfg.p2p_bytes,
                p2p_repeats=self.cfg.p2p_repeats,
            )
        except ValueError as exc:
            return self._abort(now, f"no validation plan: {exc}")
        out = [_event("profiled", session=self.session, ranks=sorted(self._profiles), **findings.evidence())]
        return out + self._suspend(now)

    def _suspend(self, now: float) -> list[Output]:
        """Pick an iteration every rank has yet to start, and tell everyone to stop there."""
        self._tries += 1
        latest, iter_s = 0.0, 0.0
        for b in self.beats.values():
            iter_s = max(iter_s, b.iter_s)
            latest = max(latest, b.iteration + max(0.0, now - b.time) / b.iter_s if b.iter_s > 0 else b.iteration)
        margin = self.cfg.suspend_margin_iterations * self._tries
        self._iteration = int(math.ceil(latest)) + margin
        self._acks = {"held": {}, "resumed": {}}
        self._go_sent = False
        wait = (self._iteration - latest + 1) * max(iter_s, 0.05)
        self._deadline = now + wait + self.cfg.suspend_deadline_s + SLACK_S
        cmd = Command(
            "suspend",
            self.cfg.suspend_deadline_s,
            iteration=self._iteration,
            args={"session": self.session, "plan": self._plan},
        )
        state = [] if self.state is State.VALIDATING else [self._set(State.VALIDATING, now, iteration=self._iteration)]
        return state + [Output("command", cmd)]

    def _on_ack(self, ack: SessionAck, now: float) -> list[Output]:
        if ack.status == "missed" and self.state is State.VALIDATING and not self._go_sent:
            out = [
                Output("command", Command("release", 0.0, args={"session": self.session})),
                _event("suspend_missed", session=self.session, rank=ack.rank, iteration=self._iteration, at=ack.iteration),
            ]
            if self._tries >= MAX_SUSPEND_TRIES:
                return out + self._abort(now, f"rank {ack.rank} kept missing the suspension")
            self.session += 1  # a new session: stale acks of the old one are ignored
            return out + self._suspend(now)
        if ack.status not in ("held", "resumed"):
            return []
        acks = self._acks.setdefault(ack.status, {})
        acks[ack.rank] = ack
        out: list[Output] = []
        if ack.status == "held" and not self._go_sent and set(acks) >= self.ranks() and self.state is State.VALIDATING:
            self._go_sent = True
            out.append(Output("command", Command("go", self.cfg.suspend_deadline_s, args={"session": self.session})))
            out.append(_event("suspended", session=self.session, iteration=self._iteration, ranks=len(acks)))
        if ack.status == "resumed" and set(acks) >= self.ranks():
            pauses = [a.pause_s for a in acks.values()]
            out.append(
                _event(
                    "resumed",
                    session=self.session,
                    pause_s=round(max(pauses), 4),
                    pause_median_s=round(sorted(pauses)[len(pauses) // 2], 4),
                    expired=sorted(a.rank for a in acks.values() if a.expired),
                )
            )
        return out

    def _verdict(self, now: float) -> list[Output]:
        ep = self.episode
        flops = {r.rank: r.gemm_flops for r in self._results.values() if r.gemm_flops is not None}
        pairs = [(int(s), int(d), float(t)) for r in self._results.values() for s, d, t in r.links]
        node_of = {r: b.node for r, b in self.beats.items()}
        errors = {str(r.rank): r.error for r in self._results.values() if r.error}
        try:
            gpus = slow_ranks(flops, self.cfg.validation_slow_factor)
            links, link_evidence = slow_links(
                [p for p in pairs if p[0] in node_of and p[1] in node_of], node_of, self.cfg.validation_slow_factor
            )
        except ValueError as exc:
            return self._abort(now, f"bad validation results: {exc}")
        evidence: dict[str, Any] = {
            "session": self.session,
            "trigger": ep.trigger if ep else "unknown",
            "scope": (self._plan or {}).get("scope"),
            "profile": self._findings.evidence() if self._findings else {},
            "gemm_gflops": {str(r): round(f / 1e9, 3) for r, f in sorted(flops.items())},
            "links": link_evidence,
            "missing": sorted(self.ranks() - set(self._results)),
            "health": {str(n): h.gpus for n, h in sorted(self._health.items())},
        }
        if errors:
            evidence["errors"] = errors
        loc = Localized(gpus=list(gpus), links=[list(link) for link in links], evidence=evidence)
        self.localizations.append(loc)
        if ep is not None:
            ep.localized = True
        after = round(now - ep.t_event, 3) if ep else None
        out = [
            Output("localized", loc),
            _event("localized", gpus=loc.gpus, links=loc.links, evidence=evidence, after_event_s=after),
            self._set(State.TRACKING, now, localized=True),
        ]
        self._deadline = math.inf
        return out + self._maybe_close()

    def _abort(self, now: float, reason: str) -> list[Output]:
        self._deadline = math.inf
        out = [_event("localization_failed", session=self.session, reason=reason), self._set(State.TRACKING, now)]
        return out + self._maybe_close()

    def _maybe_close(self) -> list[Output]:
        ep = self.episode
        if ep is not None and (ep.trigger == "operator" or (ep.reporters and ep.ended >= set(ep.reporters))):
            self.episode = None
            return [_event("episode_end", session=self.session, ranks=sorted(ep.ended))]
        return []


def _event(type_: str, **fields: Any) -> Output:
    return Output("event", event={"type": type_, **fields})

