"""The job as the controller sees it, for ``ctl status``, the metrics and the launcher's
progress line: :func:`snapshot`, a pure function of the heartbeats and the controller's
state."""

from __future__ import annotations

import heapq
import math
from typing import Any, Mapping

from falconext.config import FalconConfig
from falconext.control.episodes import Episode
from falconext.protocol.messages import Heartbeat, StatusSnapshot
from falconext.detect.scores import RankSample, rank_scores, role_key
from falconext.mitigate.mitigation import replica_view
from falconext.mitigate.planner import slowdown_removed


def snapshot(now: float, job: str, last_event: dict[str, Any] | None, beats: Mapping[int, Heartbeat],
             world: int | None, state: str, session: int, muted: bool, episode: Episode | None,
             cfg: FalconConfig, scores: Mapping[int, Any] | None = None) -> StatusSnapshot:
    """The job now: per rank, its latest heartbeat (node, loop iteration and iteration
    time, the estimate from calls, replica, micro-batches, role) with its straggler score
    against its peers and the heartbeat's age; the plan in force, read from the
    heartbeats (what the ranks run, not what was asked); the controller's ``state``,
    ``session`` and mute; the open episode and its planner (with the share of the
    slowdown the strategies removed); the config where it differs from the defaults.
    ``scores``: the ranks' latest straggler scores (the controller's rank_scores), used
    when they cover every scored rank; otherwise (or None) scored here from ``beats``."""
    beats = dict(sorted(beats.items()))
    scores = _scores(beats, scores)
    shown = beats
    if len(beats) > cfg.listed_ranks:  # the slowest: by score, then by iteration time
        slow = heapq.nsmallest(cfg.listed_ranks, beats, key=lambda r: (
            -(scores[r].score if r in scores else -math.inf), -beats[r].iter_s, r))
        shown = {r: beats[r] for r in sorted(slow)}
    ranks = {str(r): rank_row(b, scores.get(r), now) for r, b in shown.items()}
    view = replica_view(beats.values())
    any_beat = next(iter(beats.values()), None)
    tp = any_beat.tp if any_beat is not None else 0
    pp = any_beat.pp if any_beat is not None else 0
    world = world if world is not None else len(beats)
    plan = {
        "tp": tp, "pp": pp, "dp": world // (tp * pp) if tp > 0 and pp > 0 else None,
        "nodes": len({b.node for b in beats.values()}),
        "even": None if view is None else view.plan == [view.total // len(view.plan)] * len(view.plan),
    }
    # every replica's micro-batches and every rank's role up to listed_ranks of them; a
    # larger job's status says only whether they are even and in launch order
    plan["microbatches"] = None if view is None or len(view.plan) > cfg.listed_ranks else list(view.plan)
    roles = [b.role for b in beats.values()] if beats and all(b.role >= 0 for b in beats.values()) else None
    plan["roles"] = roles if roles is not None and len(roles) <= cfg.listed_ranks else None
    plan["roles_in_order"] = None if roles is None else all(a <= b for a, b in zip(roles, roles[1:]))
    ep_view = planner = None
    if episode is not None:
        ep_view, planner = _episode_view(episode, beats, cfg.listed_ranks)
    defaults = FalconConfig().to_dict()
    config = {k: v for k, v in cfg.to_dict().items() if v != defaults[k]}
    return StatusSnapshot(
        time=now, job=job, world=world, state=state, session=session, muted=muted,
        ranks=ranks, plan=plan, episode=ep_view, planner=planner, config=config, last_event=last_event,
        summary=_summary(beats, scores, len(ranks)),
    )


#: the file, beside the job's events.jsonl, the whole table goes to on an operator's request
TABLE_FILE = "ranks.csv"
#: the columns of a rank's row (the status snapshot's ``ranks``, and ranks.csv after the rank)
ROW_COLUMNS = ("node", "iteration", "iter_s", "est_iter_s", "score_iteration", "score", "late_s", "compute_ratio",
               "replica", "micro", "role", "stage", "age_s")


def rank_row(b: Heartbeat, sc: Any, now: float) -> dict[str, Any]:
    """One rank's row of the status (:data:`ROW_COLUMNS`): its latest heartbeat ``b`` and its
    score ``sc`` (None: not scored) at ``now``."""
    return {
        "node": b.node, "iteration": b.iteration, "iter_s": round(b.iter_s, 6),
        "est_iter_s": round(b.est_iter_s, 6), "score_iteration": b.score_iteration,
        "score": None if sc is None else round(sc.score, 4),
        "late_s": None if sc is None else round(sc.late_s, 6),
        "compute_ratio": None if sc is None else round(sc.compute_ratio, 4),
        "replica": b.replica, "micro": b.micro, "role": b.role, "stage": b.stage,
        "age_s": round(max(0.0, now - b.time), 3),
    }


def rank_table(now: float, beats: Mapping[int, Heartbeat],
               scores: Mapping[int, Any] | None = None) -> list[dict[str, Any]]:
    """Every rank's row (:func:`rank_row`, led by its ``rank``), in rank order: the whole
    table a large job's status leaves out (``scores`` as :func:`snapshot` takes them)."""
    scores = _scores(beats, scores)
    return [{"rank": r, **rank_row(b, scores.get(r), now)} for r, b in sorted(beats.items())]


def _scores(beats: Mapping[int, Heartbeat], latest: Mapping[int, Any] | None = None) -> Mapping[int, Any]:
    """Every scored rank's straggler score against its peers (none below two scored ranks):
    ``latest`` (the controller's latest rank_scores) when it has every rank that is scored
    now, else worked out here (a rank heard from since has none there yet)."""
    scored = {r: b for r, b in beats.items() if b.score_iteration >= 0}
    if latest is not None and all(r in latest for r in scored):
        return latest
    if len(scored) < 2:
        return {}
    return rank_scores({r: RankSample(b.est_iter_s, b.compute_s, b.wait_s) for r, b in scored.items()},
                       {r: role_key(b.stage, b.role, b.tp) for r, b in scored.items()})


def _summary(beats: Mapping[int, Heartbeat], scores: Mapping[int, Any], listed: int) -> dict[str, Any] | None:
    """The snapshot's summary of every rank heard from (None: none yet)."""
    if not beats:
        return None
    its = [b.iteration for b in beats.values()]
    times = sorted(b.iter_s for b in beats.values())
    return {"ranks": len(beats), "listed": listed, "iteration_min": min(its), "iteration_max": max(its),
            "iter_s_max": round(times[-1], 6), "iter_s_median": round(times[len(times) // 2], 6),
            "score_max": round(max(s.score for s in scores.values()), 4) if scores else None}


def _episode_view(ep: Episode, beats: Mapping[int, Heartbeat],
                  listed: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The snapshot's episode and planner parts (the ranks that reported it, and its end, up
    to ``listed`` of each, with their counts: in a large job every rank reports)."""
    episode = {"trigger": ep.trigger, "t_event": round(ep.t_event, 3),
               "reporters": sorted(ep.reporters)[:listed], "reporters_count": len(ep.reporters),
               "ended": sorted(ep.ended)[:listed], "ended_count": len(ep.ended), "localized": ep.localized,
               "onset": min(ep.onsets) if ep.onsets else None}
    mit = ep.mitigation
    if mit is None:
        return episode, None
    planner = dict(mit.planner.status(), gpus=mit.gpus, links=mit.links, applied=list(mit.applied))
    removed = None
    job_s = max((b.iter_s for b in beats.values()), default=0.0)
    levels = ep.slow_levels
    if mit.applied and levels and job_s > 0:
        slow = sorted(levels)[len(levels) // 2]
        removed = slowdown_removed(mit.planner.state().healthy_s, slow, job_s)
    planner["slowdown_removed"] = None if removed is None else round(removed, 4)
    return episode, planner
