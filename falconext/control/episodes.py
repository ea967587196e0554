"""One fail-slow, from its first report to its end: the :class:`Episode` the controller
keeps, and the pure rules over it.

One episode per fail-slow: reports from the other ranks, and ladder updates, join the
episode rather than start new ones; the episode closes when every rank that reported
it has reported its end, and only then can a new one start. An episode keeps the
:class:`FailSlowReport` each rank first gave it, and the :class:`Sighting` of a fault the
controller saw itself (its scores, a re-localized rise).

Under a mitigation in force a rank's new event is news only when its level rose over the
one the strategy holds (:func:`is_new_fail_slow`: the residual of a fault a strategy only
partly hides, such as a slow link moved onto pipeline traffic, reads 1.1x healthy, and a
detector whose event ended on the strategy's step down opens one on it against the old
baseline); such a report is localized again like a rise the planner sees.

An episode whose end reports did not all come closes ``episode_timeout_s`` after the
first came, or after every rank's heartbeat reads healthy again (:func:`timeout_reason`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable, Mapping

from falconext.config import FalconConfig
from falconext.protocol.messages import FailSlowReport
from falconext.control.beat_table import columns
from falconext.control.outputs import Output, event
from falconext.mitigate.mitigation import Mitigation
from falconext.mitigate.planner import Rise


class State(str, Enum):
    """The controller's phase: at most one episode is past TRACKING at a time."""

    TRACKING = "tracking"
    PROFILING = "profiling"
    VALIDATING = "validating"
    MITIGATING = "mitigating"


@dataclass(frozen=True)
class Sighting:
    """A fail-slow the controller saw itself (no report told it): where it began (None: a
    level only), the healthy iteration time before it (None: not read), the slow level."""

    onset: int | None
    baseline_s: float | None
    level_s: float


@dataclass
class Episode:
    """One fail-slow as the controller keeps it: what opened it (``trigger``: fail_slow,
    operator, baseline), when, who reported it and who reported its end, the reports and
    sightings it was given, its mitigation, and the re-localization running in it."""

    trigger: str
    t_event: float
    reporters: dict[int, int] = field(default_factory=dict)  # rank -> event id
    ended: set[int] = field(default_factory=set)
    localized: bool = False
    #: the first report of each rank that joined, in order
    reports: list[FailSlowReport] = field(default_factory=list)
    sightings: list[Sighting] = field(default_factory=list)
    mitigation: Mitigation | None = None
    #: when the first reporter said the fail-slow ended (the others' ends may be lost)
    first_end_t: float | None = None
    #: since when every rank's heartbeat reads healthy again (None: not now)
    healthy_since: float | None = None
    #: the planner's rise being localized again, and since when (None: none)
    relocalizing: Rise | None = None
    relocalizing_t: float = 0.0
    #: the rank the controller's scores suspected, when they opened the episode (no report did)
    suspected: int | None = None
    #: the iteration of the episode's latest re-localization (-1: none): it saw every rise
    #: that began before it
    relocalized_at: int = -1
    #: (reports, sightings) counted, and the healthy_s they gave
    _healthy: tuple[tuple[int, int], float] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of_report(cls, rep: FailSlowReport) -> Episode:
        """A fail-slow episode opened by ``rep`` (at its time)."""
        ep = cls("fail_slow", rep.time)
        ep.add(rep)
        return ep

    @property
    def onsets(self) -> list[int]:
        """The onset iteration of every report and sighting that has one."""
        return [r.onset for r in self.reports] + [s.onset for s in self.sightings if s.onset is not None]

    @property
    def baselines(self) -> list[float]:
        """The healthy iteration time every report and sighting read before the fault."""
        return [r.baseline_s for r in self.reports] + [s.baseline_s for s in self.sightings if s.baseline_s is not None]

    @property
    def slow_levels(self) -> list[float]:
        """The slow iteration times measured: each report's baseline x slowdown, each sighting's level."""
        return [r.baseline_s * r.slowdown for r in self.reports] + [s.level_s for s in self.sightings]

    def healthy_s(self) -> float:
        """The episode's healthy iteration time: the median of the baselines (0.0: none);
        worked out again only when a report or sighting was added (it is asked every tick,
        and a large job's episode holds a report of every rank)."""
        key = (len(self.reports), len(self.sightings))
        if self._healthy is None or self._healthy[0] != key:
            base = self.baselines
            self._healthy = (key, sorted(base)[len(base) // 2] if base else 0.0)
        return self._healthy[1]

    def add(self, rep: FailSlowReport) -> None:
        """Take ``rep`` as its rank's report of this episode (its end is awaited)."""
        self.reporters[rep.rank] = rep.event_id
        self.reports.append(rep)

    def join(self, rep: FailSlowReport, session: int) -> list[Output]:
        """A report that joins the open episode: a rank's first is taken (:meth:`add`); a
        new event of a rank that reported under a mitigation in force is no news (a
        ``report_joined`` event says so: it is on the level the strategy holds, from
        before a re-localization, or while one runs); a ladder update changes nothing."""
        if rep.rank not in self.reporters:
            self.add(rep)
            return []
        if self.reporters[rep.rank] != rep.event_id and self.mitigation is not None and self.mitigation.applied:
            return [event("report_joined", session=session, rank=rep.rank, onset=rep.onset, event_id=rep.event_id,
                          level_s=round(rep.baseline_s * rep.slowdown, 6),
                          reason="no rise the episode has not localized")]
        return []

    def end_reported(self, rep: FailSlowReport, now: float) -> bool:
        """Whether ``rep`` (an end) ends this episode's event of its rank: then the rank
        has ended, and the first end's time is kept."""
        if self.reporters.get(rep.rank) != rep.event_id:
            return False
        self.ended.add(rep.rank)
        if self.first_end_t is None:
            self.first_end_t = now
        return True

    def all_ended(self) -> bool:
        """Whether some rank reported the fail-slow and every one that did reported its end."""
        return bool(self.reporters) and self.ended >= set(self.reporters)

    def localizing(self) -> str:
        """What the localization running now is for: ``relocalize`` (a rise in this
        episode), else the episode's trigger."""
        return "relocalize" if self.relocalizing is not None else self.trigger

    def since(self, now: float) -> float:
        """Seconds from the event being localized now (the episode's, or the rise's) to ``now``."""
        return now - (self.t_event if self.relocalizing is None else self.relocalizing_t)

    def may_mitigate(self, cfg: FalconConfig, muted: bool) -> bool:
        """Whether a verdict in this episode may start a mitigation at once: a fail-slow's,
        mitigation on (``cfg.mitigation``), not ``muted``."""
        return self.trigger == "fail_slow" and bool(cfg.mitigation) and not muted

    def drop_relocalization(self) -> None:
        """The re-localization running in this episode failed: the planner goes on as if
        it found nothing new."""
        if self.relocalizing is None:
            return
        self.relocalizing = None
        if self.mitigation is not None and not self.mitigation.planner.finished:
            self.mitigation.planner.relocalized(False)

    def reference_onset(self) -> int | None:
        """Where the fault being localized began: the episode's onset, or the reference
        iteration of the rise being localized again; None: no onset known."""
        if not self.onsets:
            return None
        return min(self.onsets) if self.relocalizing is None else int(self.relocalizing.reference_iteration)


def dropped(rep: FailSlowReport, restart_from: int) -> list[Output] | None:
    """A ``report_dropped`` event for a report of a fail-slow that began before the job
    restarted from iteration ``restart_from`` (sent just before the restart: a detector
    saw the restart's own hold; the processes that saw it are gone, and a session for it
    would hold ranks that are restarting); None for any other report."""
    if rep.end is not None or rep.onset >= restart_from:
        return None
    return [event("report_dropped", rank=rep.rank, onset=rep.onset, event_id=rep.event_id,
                  reason=f"onset {rep.onset} is before the restart from iteration {restart_from}")]


def beats_healthy(ep: Episode, beats: Mapping[int, Any], line: float) -> bool:
    """Every rank's latest iteration time is within ``line`` (min_slowdown) of the
    episode's healthy baseline (the median of the reports')."""
    if not (ep.reports or any(s.baseline_s is not None for s in ep.sightings)) or not beats:
        return False
    base = ep.healthy_s()  # kept until a report comes: this is asked every tick
    (iter_s,) = columns(beats, "iter_s")  # asked every tick: no Heartbeat made for it
    return bool((iter_s <= base * (1.0 + line)).all())


def waiting_for_a_strategy(mit: Mitigation | None) -> bool:
    """A planner that has applied nothing, decided nothing and is not finished: the
    fail-slow may be over before any strategy."""
    return (mit is not None and not mit.planner.finished and not mit.applied and mit.in_flight is None
            and mit.planner.pending() is None)


def planner_ends_it(mit: Mitigation | None) -> bool:
    """Whether the mitigation's planner decides when the fail-slow is over (it is not
    finished, or an action is in flight)."""
    return mit is not None and (not mit.planner.finished or mit.in_flight is not None)


def finish_before_any_strategy(mit: Mitigation) -> None:
    """The fail-slow ended before any strategy was applied: the planner finishes."""
    mit.planner.recovered(max(0, mit.planner.state().last_iteration))


def expire(ep: Episode, now: float, beats: Mapping[int, Any], cfg: FalconConfig) -> str | None:
    """Why the fail-slow episode ``ep`` closes now by timeout (None: it does not; see
    :func:`timeout_reason`, with ``episode_timeout_s`` and ``min_slowdown`` from
    ``cfg``). Never while its planner decides when it is over, except one still waiting
    for a first strategy, which then finishes (nothing applied, nothing to revert)."""
    if ep.trigger != "fail_slow":
        return None
    mit = ep.mitigation
    waiting = waiting_for_a_strategy(mit)
    if planner_ends_it(mit) and not waiting:
        return None  # the planner decides when a mitigated fail-slow is over
    reason = timeout_reason(ep, now, cfg.episode_timeout_s, beats_healthy(ep, beats, cfg.min_slowdown), waiting)
    if reason is not None and waiting and mit is not None:
        finish_before_any_strategy(mit)
    return reason


def ends(ep: Episode) -> bool:
    """Whether the episode ends now (:func:`closes`), its planner (if any) done. A planner
    still on S1, with nothing pending or in flight, when every reporter reported the end,
    is finished first: the fail-slow was over before any strategy."""
    mit = ep.mitigation
    if (mit is not None and not mit.planner.finished and mit.in_flight is None and mit.planner.current == "S1"
            and mit.planner.pending() is None and ep.all_ended()):
        finish_before_any_strategy(mit)
    return not planner_ends_it(mit) and closes(ep)


def timeout_reason(ep: Episode, now: float, limit: float, healthy: bool, waiting: bool) -> str | None:
    """Why the fail-slow episode ``ep`` closes now though not every end report came (None:
    it does not): ``limit`` seconds after the first end came (not while ``waiting`` for a
    strategy), or after every rank read ``healthy`` again, counted from the first
    heartbeat of the healthy streak (kept on the episode; a slow one starts it over). A
    lost report (a rank's client died, Redis dropped it) must not keep the episode open
    and absorb every later fail-slow."""
    if not healthy:
        ep.healthy_since = None
    elif ep.healthy_since is None:
        ep.healthy_since = now
    if ep.first_end_t is not None and now - ep.first_end_t >= limit and not waiting:
        return "some ranks never reported the end"
    if ep.healthy_since is not None and now - ep.healthy_since >= limit:
        return "every rank is healthy again but the end reports did not come"
    return None


def closes(ep: Episode) -> bool:
    """Whether an episode whose planner (if any) is done may close: one opened by an
    operator or for the link baseline, one that was mitigated, one whose every reporter
    reported the end, or one the scores opened that was localized and no rank reported."""
    return (ep.trigger in ("operator", "baseline") or ep.mitigation is not None or ep.all_ended()
            or (ep.suspected is not None and ep.localized and not ep.reporters))


def mitigated_level(mit: Mitigation, settled: int, onset: int, first_beats: Iterable[Any]) -> float | None:
    """The iteration time the strategy in force held from its settling up to ``onset``:
    the lowest of the first rank's heartbeats there (``first_beats``, each a median of
    recent iterations), or the planner's reference level (the lowest since settling)
    where none is kept; None: neither."""
    readings = [b.iter_s for b in first_beats if settled < b.iteration <= onset and b.iter_s > 0]
    reference = mit.planner.state().reference_s
    candidates = readings + ([reference] if reference else [])
    return min(candidates) if candidates else None


def is_new_fail_slow(ep: Episode, rep: FailSlowReport, cfg: FalconConfig, tracking: bool,
                     first_beats: Iterable[Any]) -> bool:
    """Whether a report may be a fault the open episode does not know: its mitigation
    is in force (applied, nothing in flight, ``tracking``); the report is a new event (not
    the one this rank reported for the episode) whose onset comes after the last
    strategy had settled (``mitigation_settle_iterations``) and after the episode's
    latest re-localization (which saw any rise before it); and its slow level (baseline
    x slowdown) is a rise over the level the strategy held before that onset
    (:func:`mitigated_level`, from the first rank's heartbeats ``first_beats``) by
    ``mitigation_relocalize_rise`` (``min_slowdown`` where that is 0), or no such level
    was read. Without the level rule, the residual of a fault the strategy only partly
    hides read as a new fault: S3 left the shared S3 job's x3 link on pipeline traffic
    (1.1x the healthy time), a detector's event ended on the step down, one on the same
    level opened against the old baseline, and the new episode localized that link alone
    and decided S3 again."""
    mit = ep.mitigation
    if mit is None or not mit.applied or mit.in_flight is not None or not tracking:
        return False
    if ep.reporters.get(rep.rank) == rep.event_id:
        return False
    settled = max(int(mit.applied[-1]["iteration"]) + cfg.mitigation_settle_iterations, ep.relocalized_at)
    if rep.onset <= settled:
        return False
    held = mitigated_level(mit, settled, rep.onset, first_beats)
    rise = cfg.mitigation_relocalize_rise or cfg.min_slowdown
    return held is None or rep.baseline_s * rep.slowdown > held * (1.0 + rise)

