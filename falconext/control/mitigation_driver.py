"""Driving a localized fail-slow's mitigation: the ski-rental planner in
(mitigate/planner.py), typed actions out.

A localized fail-slow gets a planner (:func:`start_mitigation`), fed one observation per
loop iteration from the first rank's heartbeats (:func:`observe`) with the overheads
measured so far (:func:`overheads`). When it decides, :func:`prepare_action` turns the
decision into the action every rank applies (S2 a new micro-batch plan, S3 a new
topology, S4 a restart without the bad node); the controller applies it in a suspension
and reports back (:func:`applied_overhead`). Recovery under S2 is read from the slow
GPUs' own compute time per micro-batch against theirs before the onset (the iteration
time cannot show it: the plan hides the straggler), or else the replicas'
(:func:`check_recovery`), and reverts to the even plan once.

A rise the planner sees (the iteration time up by ``mitigation_relocalize_rise`` over the
lowest level of the episode, or a strategy judged enough that no longer is) is localized
again before the planner escalates: the ranks' detectors cannot be relied on for a
second fault that begins inside an episode (their open event takes it as a ladder step,
and a detector restarted by S3 takes it as its baseline). :func:`relocalized` sorts what
was found: a fault found under a strategy that was enough gets an episode of its own
(the first stays mitigated); one found while nothing had helped joins the episode, whose
planner goes on with the strategies for both (a slow GPU under a congested link: S3 ->
S2 -> S4).

Everything here is a function of plain data and the episode's :class:`Mitigation`; it
posts nothing and reads no clock but the solver's own timing.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from falconext.config import FalconConfig
from falconext.control.beat_table import columns
from falconext.control.episodes import Episode, Sighting
from falconext.protocol.actions import MitigationAction, action_details
from falconext.protocol.messages import FailSlowReport, Heartbeat, Localized
from falconext.control.outputs import Output, event
from falconext.control.stragglers import Suspect
from falconext.control.suspension import ActionEnd
from falconext.mitigate.microbatch import plan_microbatches
from falconext.mitigate.mitigation import (
    Mitigation,
    action_for,
    back_to_own_level,
    gpu_factors,
    healthy_mb_s,
    link_excess,
    new_mitigation,
    recovery_references,
    replica_view_in,
    replica_view_of,
    replicas_of,
    straggler_recovered,
)
from falconext.mitigate.planner import Decision, Planner
from falconext.mitigate.room import RestartRoom


def overheads(root: str, beats: Mapping[int, Heartbeat], last_pause_s: float,
              cfg: FalconConfig) -> dict[str, float | None]:
    """Measured costs, in milliseconds (finer is timer jitter, and an unchanged cost is not
    re-recorded), None where not measured or not allowed (``mitigation_strategies``): S2
    = solving now + the last suspension's pause ``last_pause_s`` (applying a plan is one
    more such suspension; computation only); S4 = the ranks' measured checkpoint save,
    load and start-up (every rank's); S3 = the ranks' measured pause of a topology
    switch (a probe switch at start-up, then the last real one) plus the last pause."""
    s2 = None
    # columns, not a Heartbeat per rank (131,072 of them, three times a decision)
    replica, mb, micro, restart_s, switch_s = columns(beats, "replica", "mb_s", "micro", "restart_s", "switch_s")
    view = replica_view_of(replica, mb, micro)
    if root == "computation" and view is not None:
        t0 = time.perf_counter()
        try:
            plan_microbatches(view.times, view.total, cfg.max_microbatches_per_replica or None)
            s2 = time.perf_counter() - t0 + last_pause_s
        except ValueError:
            s2 = None
    restart, switch = restart_s[restart_s > 0], switch_s[switch_s > 0]
    s4 = float(restart.max()) if len(restart) and len(restart) == len(beats) else None
    s3 = float(switch.max()) + last_pause_s if len(switch) and len(switch) == len(beats) else None
    out: dict[str, float | None] = {"S3": s3, "S4": s4}
    if root == "computation":
        out["S2"] = s2
    allowed = cfg.strategies()
    return {k: (round(v, 3) if k in allowed and v is not None else None) for k, v in out.items()}


def start_mitigation(ep: Episode, loc: Localized, clean: list[float], beats: Mapping[int, Heartbeat],
                     history: Mapping[int, Iterable[Heartbeat]], cfg: FalconConfig, last_pause_s: float,
                     nbytes: int, clean_before: int | None = None) -> Mitigation | str:
    """A planner for the fail-slow ``loc`` localized in ``ep`` and its complete
    :class:`Mitigation`, or why there is none. The healthy time is the episode's (the
    reports' median baseline), or the job's own ``clean`` iteration times before the
    onset where there are ``min_baseline`` of them and they read lower: the detectors'
    baselines can only read too high (they may hold iterations run under an earlier
    mitigation, S2's uneven plan, which the detectors cannot tell from healthy ones).
    ``clean_before``: the iteration each process's compute before the fault is read at
    (default: the onset)."""
    root = "computation" if loc.gpus else "communication"
    healthy = ep.healthy_s()
    if len(clean) >= cfg.min_baseline and healthy > 0:
        healthy = min(healthy, statistics.median(clean))
    if not healthy > 0 or not ep.onsets:
        return "no healthy baseline in the reports"
    onset = min(ep.onsets)
    planner = Planner(
        root, healthy, overheads(root, beats, last_pause_s, cfg), onset,
        enough_margin=cfg.mitigation_enough_margin,
        settle_iterations=cfg.mitigation_settle_iterations,
        judge_iterations=cfg.mitigation_judge_iterations,
        rise_margin=cfg.mitigation_relocalize_rise or None,
    )
    return new_mitigation(planner, loc, beats, history, clean_before=onset if clean_before is None else clean_before,
                          lookback=cfg.min_duration, line=cfg.min_slowdown, nbytes=nbytes)


def observe(ep: Episode, beat: Heartbeat, beats: Mapping[int, Heartbeat], cfg: FalconConfig,
            last_pause_s: float, session: int) -> tuple[list[Output], Decision | None]:
    """Feed the planner of ``ep``'s mitigation ``beat`` (the first rank's, of an iteration
    it has not seen since the onset; others, a finished planner, or one whose rise is
    being localized again, which counts these iterations at its next observation, are
    left alone): costs re-measured as ranks report them first, then, under S2 with
    nothing in flight, whether the fail-slow is over (:func:`check_recovery`; S3 stays:
    its layout is as good healthy), then the observation. Returns the events and the
    planner's decision (None: none)."""
    mit = ep.mitigation
    if mit is None or mit.planner.finished or ep.relocalizing is not None:
        return [], None
    planner = mit.planner
    st = planner.state()
    if beat.iteration <= st.last_iteration or beat.iteration < st.onset:
        return [], None
    state = {c.strategy: c.state for c in st.candidates}
    for name, value in overheads(mit.root_cause, beats, last_pause_s, cfg).items():
        if state.get(name) in ("remaining", "unavailable") and value is not None:
            planner.set_overhead(name, value)
    if planner.current == "S2" and mit.in_flight is None:
        out, d = check_recovery(mit, beats, beat.iteration, cfg, session)
        if planner.finished:
            return out, d
    return [], planner.observe(beat.iteration, beat.iter_s)


def check_recovery(mit: Mitigation, beats: Mapping[int, Heartbeat], it: int, cfg: FalconConfig,
                   session: int) -> tuple[list[Output], Decision | None]:
    """Whether the fail-slow under S2 is over at iteration ``it`` (then the planner
    finishes, and its revert is returned with a ``fail_slow_recovered`` event). Read first
    on the slow GPUs' own compute per micro-batch against theirs before the onset: every
    one back within the jitter line (min_slowdown) in ``mitigation_recovered_beats``
    fresh readings in a row, and one reading over it starts the count again. Without
    such references (see :func:`recovery_references`): the slow replicas within
    ``mitigation_enough_margin`` of the others for ``mitigation_judge_iterations``
    iterations."""
    # every slow GPU needs its reference: one read against nothing could still be slow
    own = back_to_own_level(beats, mit.recovery_refs, cfg.min_slowdown) \
        if set(mit.recovery_refs) == set(mit.gpus) else None
    view = replica_view_in(beats)
    if own is not None:
        seen = min(beats[g].iteration for g in mit.recovery_refs)
        if seen > mit.own_seen:  # a fresh reading (several heartbeats may carry one)
            mit.own_seen = seen
            mit.own_streak = mit.own_streak + 1 if own else 0
        if mit.own_streak < cfg.mitigation_recovered_beats:
            return [], None
        rule: dict[str, Any] = {
            "rule": "own compute", "gpu_mb_s": {str(g): round(beats[g].mb_s, 6) for g in mit.recovery_refs},
            "before_mb_s": {str(g): round(ref, 6) for g, (_, ref) in mit.recovery_refs.items()},
            "readings": mit.own_streak}
    else:
        if view is None or not straggler_recovered(view.times, mit.slow_replicas, cfg.mitigation_enough_margin):
            mit.recovered_since = None
            return [], None
        if mit.recovered_since is None:
            mit.recovered_since = it
        if it - mit.recovered_since < cfg.mitigation_judge_iterations:
            return [], None
        rule = {"rule": "replicas"}
    decision = mit.planner.recovered(it)
    return [event("fail_slow_recovered", session=session, iteration=it,
                  replica_mb_s=None if view is None else view.times, **rule)], decision


def decision_event(d: Decision, session: int, trigger: str) -> Output:
    """The ``mitigation_decision`` event of ``d`` (``trigger``: planner, scores, report)."""
    return event("mitigation_decision", session=session, trigger=trigger, action=d.action, strategy=d.strategy,
                 iteration=d.iteration, impact_s=round(d.impact_s, 4),
                 overhead_s=None if d.overhead_s is None else round(d.overhead_s, 4), reason=d.reason)


def prepare_action(mit: Mitigation, d: Decision, beats: Mapping[int, Heartbeat], cfg: FalconConfig,
                   room: RestartRoom) -> MitigationAction | str:
    """The action every rank must apply for the decision ``d`` (mitigate/mitigation.py
    action_for), or why it cannot be done now. An S2 plan's solving time is kept as part
    of its overhead; the decision is then in flight."""
    t0 = time.perf_counter()
    action = action_for(mit, d, beats, cfg.max_microbatches_per_replica or None, room)
    if isinstance(action, str):
        return action
    if d.strategy == "S2" and d.action == "apply":
        mit.solve_s = time.perf_counter() - t0
    mit.in_flight = d
    return action


def action_failed(mit: Mitigation | None, d: Decision, reason: str, session: int) -> list[Output]:
    """The decision ``d`` could not be applied: a pending strategy drops out of the
    planner's candidates; a ``mitigation_failed`` event says why."""
    if mit is not None and d.action == "apply" and mit.planner.pending() == d.strategy:
        mit.planner.failed(d.strategy, reason)
    return [event("mitigation_failed", session=session, strategy=d.strategy, action=d.action, reason=reason)]


def applied_overhead(strategy: str, pause_s: float, mit: Mitigation | None, d: Decision | None,
                     beats: Mapping[int, Heartbeat]) -> float:
    """What applying ``strategy`` cost: the suspension's pause, plus S2's solving time,
    S3's switch (it comes after the suspension: the ranks' last measured pause), or S4's
    measured save + restart + load estimate (the run logs the real downtime)."""
    overhead = pause_s
    if mit is not None and strategy == "S2":
        overhead += mit.solve_s
    elif strategy == "S3":
        overhead += max((b.switch_s for b in beats.values()), default=0.0)
    elif strategy == "S4" and d is not None and d.overhead_s is not None:
        overhead += d.overhead_s
    return overhead


def applied(end: ActionEnd, mit: Mitigation | None, d: Decision | None, effective: int,
            beats: Mapping[int, Heartbeat], session: int) -> tuple[Output, Decision | None]:
    """Every rank committed the action of ``end`` from iteration ``effective``: the
    ``mitigation`` event (its pause, overhead, the impact so far; an operator's when no
    decision ``d`` was in flight), and, for the planner's ``apply``, the strategy recorded
    as applied with the planner and what the planner decides at once (a revert, when the
    fail-slow recovered while the action was in flight). After S4 the planner finishes."""
    strategy = end.action.strategy if end.action is not None else "?"
    pause = end.pause_s()
    overhead = applied_overhead(strategy, pause, mit, d, beats)
    ev = event("mitigation", strategy=strategy, session=session, iteration=effective, pause_s=round(pause, 4),
               overhead_s=round(overhead, 4), impact_s=None if mit is None else round(mit.planner.impact_s, 4),
               trigger="operator" if d is None else "planner", **({"acks_lost": end.unheard} if end.unheard else {}),
               **(action_details(end.action) if end.action is not None else {}))
    again = None
    if mit is not None and d is not None and d.action == "apply":
        mit.applied.append({"strategy": strategy, "iteration": effective})
        again = mit.planner.applied(strategy, effective, overhead)
    if strategy == "S4" and mit is not None and not mit.planner.finished:
        mit.planner.recovered(effective)  # the ranks restart: their detectors start over, the episode ends
    return ev, again


def not_committed(end: ActionEnd, mit: Mitigation | None, d: Decision | None, timed_out: bool,
                  session: int) -> tuple[list[Output], MitigationAction | None]:
    """Not every rank committed the action of ``end`` (or its suspension ``timed_out``):
    one that travelled with a verdict is agreed on again in a suspension of its own (a
    ``mitigation_retry`` event and the action to retry, its decision ``d`` in flight
    again: the strategy did not fail, the hold was over); else it failed (the planner
    drops a pending strategy)."""
    reason = "timed out" if timed_out else "not every rank committed the action"
    strategy = end.action.strategy if end.action is not None else "?"
    if end.via_resume and mit is not None and d is not None and end.action is not None:
        mit.in_flight = d
        return [event("mitigation_retry", session=session, strategy=strategy,
                      reason=f"{reason} with the verdict; in a suspension of its own")], \
            dataclasses.replace(end.action, session=0)
    if mit is not None and d is not None:
        return action_failed(mit, d, reason, session), None
    return [event("mitigation_failed", session=session, strategy=strategy, reason=reason)], None


def suspect_rise(ep: Episode, s: Suspect) -> Decision | None:
    """A straggler the scores show inside the mitigated episode ``ep`` that it has not
    named: the planner's ``relocalize`` decision for it (None: the episode's own
    localization or mitigation comes first, or the planner is busy)."""
    mit = ep.mitigation
    if (mit is None or not mit.applied or mit.in_flight is not None or ep.relocalizing is not None
            or s.rank in mit.gpus):
        return None
    return mit.planner.relocalize(s.iteration, s.onset, f"rank {s.rank} computes {s.ratio:.2f}x its peers")


def report_rise(ep: Episode, rep: FailSlowReport, session: int) -> tuple[Output, Decision | None]:
    """A report that may be a fault the mitigated episode ``ep`` does not know
    (episodes.is_new_fail_slow) joins it (its end is awaited), and the planner localizes
    again from the report's onset: a ``report_joined`` event and the planner's
    ``relocalize`` decision (None: it is busy). Without this, a GPU that slowed after S3
    had moved a congested link's traffic read as "S3 not enough", and the planner
    restarted the job without the link's node."""
    mit = ep.mitigation
    assert mit is not None
    ep.reporters[rep.rank] = rep.event_id
    ep.ended.discard(rep.rank)
    level = rep.baseline_s * rep.slowdown
    d = mit.planner.relocalize(max(rep.onset, mit.planner.state().last_iteration), rep.onset,
                               f"rank {rep.rank} reported a fail-slow from iteration {rep.onset} ({level:.3f}s)")
    joined = event("report_joined", session=session, rank=rep.rank, onset=rep.onset, event_id=rep.event_id,
                   level_s=round(level, 6), reason="localized again" if d is not None else "the planner is busy")
    return joined, d


@dataclass
class Relocalized:
    """What a re-localization led to: its events, and, for a new fault under a strategy
    that was enough, the ``new_episode`` to mitigate with the verdict's ``part`` that is
    new, reading compute before ``clean_before``."""

    outputs: list[Output] = field(default_factory=list)
    new_episode: Episode | None = None
    part: Localized | None = None
    clean_before: int = 0


def relocalized(ep: Episode, loc: Localized, muted: bool, beats: Mapping[int, Heartbeat],
                history: Mapping[int, Iterable[Heartbeat]], cfg: FalconConfig, session: int,
                now: float, nbytes: int) -> Relocalized:
    """What the re-localization of ``ep``'s rise found (``loc``; ``nbytes``: its validation
    messages' size), and what becomes of it: nothing
    new, or ``muted`` (the planner goes on, the level now its reference); a new fault
    under a strategy that was enough (an episode of its own, the first stays mitigated);
    a new fault while nothing had helped (it joins: the planner widens its candidates and
    goes on with the rent so far)."""
    rise, ep.relocalizing = ep.relocalizing, None
    mit = ep.mitigation
    assert rise is not None
    ep.relocalized_at = max(ep.relocalized_at, int(rise.iteration))
    if mit is None or mit.planner.finished:
        return Relocalized()
    known = {tuple(sorted(x)) for x in mit.links}
    gpus = [g for g in loc.gpus if g not in mit.gpus]
    links = [list(x) for x in loc.links if tuple(sorted(x)) not in known]
    fields = {"session": session, "iteration": rise.iteration, "level_s": round(rise.level_s, 4),
              "reference_s": round(rise.reference_s, 4), "gpus": gpus, "links": links}
    if not (gpus or links) or muted:
        mit.planner.relocalized(False)
        return Relocalized([event("relocalized", outcome="nothing new" if not (gpus or links) else "muted", **fields)])
    part = Localized(gpus=gpus, links=links, evidence=loc.evidence)
    if rise.was_enough:
        healthy = mit.planner.state().healthy_s
        new = Episode("fail_slow", now, localized=True,
                      sightings=[Sighting(int(rise.rise_iteration), healthy, float(rise.level_s))])
        out = [event("relocalized", outcome="new episode", **fields),
               event("episode_end", session=session, ranks=sorted(ep.ended),
                     reason="superseded by a new fail-slow", gpus=gpus, links=links)]
        return Relocalized(out, new, part, int(rise.reference_iteration))
    mit.gpus += gpus
    mit.links += links
    if gpus:
        mit.planner.widen("computation")
        mit.root_cause = mit.planner.state().root_cause
        mit.slow_replicas |= replicas_of(gpus, beats)
        mit.gpu_factors.update(gpu_factors(loc, gpus))
        # the reference before the episode's onset is before the joined fault too; a GPU
        # that changed role since (S3) has none, and the replicas are judged instead
        before = healthy_mb_s(history, min(ep.onsets), cfg.min_duration) if ep.onsets else {}
        mit.recovery_refs.update(recovery_references(beats, gpus, before, cfg.min_slowdown))
    mit.link_excess.update(link_excess(part.links, part.evidence.get("links", {}), nbytes))
    mit.planner.relocalized(True)
    ep.sightings.append(Sighting(None, None, float(rise.level_s)))
    return Relocalized([event("relocalized", outcome="joined the episode", root_cause=mit.root_cause, **fields)])
