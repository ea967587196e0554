"""The job as the controller sees it, for ``ctl status``, the metrics and the launcher's
progress line: :func:`snapshot`, a pure function of the heartbeats and the controller's
state."""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from falconext.config import FalconConfig
from falconext.control.beat_table import columns
from falconext.control.stragglers import scored_samples
from falconext.control.episodes import Episode
from falconext.detect.scores import score_column, score_values
from falconext.protocol.messages import Heartbeat, StatusSnapshot
from falconext.mitigate.mitigation import replica_view_of
from falconext.mitigate.planner import slowdown_removed


def snapshot(now: float, job: str, last_event: dict[str, Any] | None, beats: Mapping[int, Heartbeat],
             world: int | None, state: str, session: int, muted: bool, episode: Episode | None,
             cfg: FalconConfig, scores: Mapping[int, Any] | None = None, restarts: int = 0,
             restarted_from: tuple[float, float] | None = None) -> StatusSnapshot:
    """The job now: per rank, its latest heartbeat (node, loop iteration and iteration
    time, the estimate from calls, replica, micro-batches, role) with its straggler score
    against its peers and the heartbeat's age; the plan in force, read from the
    heartbeats (what the ranks run, not what was asked); the controller's ``state``,
    ``session`` and mute; the open episode and its planner (with the share of the
    slowdown the strategies removed); the config where it differs from the defaults.
    ``scores``: the ranks' latest straggler scores (the controller's rank_scores), used
    for a job of more than ``listed_ranks`` ranks when they cover every scored rank;
    otherwise (or None) scored here from ``beats``, so that each row's score is of its
    heartbeat's window.
    ``restarts``: the restarts (S4) applied so far, in the planner part whenever there is
    one; ``restarted_from``: the (healthy, slow) iteration times the last restart answered:
    with no episode open since, the restart is the mitigation in force, and the planner
    part says S4 and the share of that slowdown removed at the job's iteration time now."""
    # a quantity at a time over every rank (the table's columns), Heartbeats made only for
    # the ranks listed: at 131,072 ranks the status is built every few seconds
    rank_col, iters, iter_s, node, replica, mb_s, micro, role, tp_col, pp_col = columns(
        beats, "rank", "iteration", "iter_s", "node", "replica", "mb_s", "micro", "role", "tp", "pp")
    order = np.argsort(rank_col, kind="stable")  # by rank
    ranks_in = rank_col[order].astype(int).tolist()
    # a job whose every rank is listed is scored from the heartbeats shown (each row's score
    # is of the window its score_iteration ends: the controller scores every
    # score_interval_s, and its latest scores lagged the rows by up to that); a larger one
    # shows the latest rank_scores (scoring it comes less often, at most its share)
    scores = _scores(beats, scores if len(ranks_in) > cfg.listed_ranks else None)
    if len(ranks_in) > cfg.listed_ranks:  # the slowest: by score, then by iteration time, then rank
        score = score_column(scores, ranks_in, -math.inf)
        by = np.lexsort((np.asarray(ranks_in), -iter_s[order], -score))
        shown_ranks = sorted(np.asarray(ranks_in)[by[:cfg.listed_ranks]].tolist())
    else:
        shown_ranks = ranks_in
    ranks = {str(r): rank_row(beats[r], scores.get(r), now) for r in shown_ranks}
    view = replica_view_of(replica[order].astype(int).tolist(), mb_s[order].tolist(), micro[order].astype(int).tolist())
    tp = int(tp_col[order[0]]) if len(order) else 0
    pp = int(pp_col[order[0]]) if len(order) else 0
    world = world if world is not None else len(ranks_in)
    plan = {
        "tp": tp, "pp": pp, "dp": world // (tp * pp) if tp > 0 and pp > 0 else None,
        "nodes": len(set(node.tolist())),
        "even": None if view is None else view.plan == [view.total // len(view.plan)] * len(view.plan),
    }
    # every replica's micro-batches and every rank's role up to listed_ranks of them; a
    # larger job's status says only whether they are even and in launch order
    plan["microbatches"] = None if view is None or len(view.plan) > cfg.listed_ranks else list(view.plan)
    roles = role[order].astype(int).tolist() if len(order) and (role >= 0).all() else None
    plan["roles"] = roles if roles is not None and len(roles) <= cfg.listed_ranks else None
    plan["roles_in_order"] = None if roles is None else all(a <= b for a, b in zip(roles, roles[1:]))
    ep_view = planner = None
    if episode is not None:
        ep_view, planner = _episode_view(episode, beats, cfg.listed_ranks)
    elif restarted_from is not None:
        job_s = float(iter_s.max()) if len(iter_s) else 0.0
        removed = slowdown_removed(restarted_from[0], restarted_from[1], job_s) if job_s > 0 else None
        planner = {"current": "S4", "healthy_s": restarted_from[0], "slow_s": restarted_from[1],
                   "slowdown_removed": None if removed is None else round(removed, 4)}
    if planner is None and restarts:
        planner = {}
    if planner is not None:
        planner["restarts"] = restarts
    defaults = FalconConfig().to_dict()
    config = {k: v for k, v in cfg.to_dict().items() if v != defaults[k]}
    return StatusSnapshot(
        time=now, job=job, world=world, state=state, session=session, muted=muted,
        ranks=ranks, plan=plan, episode=ep_view, planner=planner, config=config, last_event=last_event,
        summary=_summary(iters, iter_s, scores, len(ranks)),
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
    if latest is not None:  # which ranks are scored now: two columns, not every sample
        rank, score_it = columns(beats, "rank", "score_iteration")
        if all(r in latest for r in rank[score_it >= 0].astype(int).tolist()):
            return latest
    found = scored_samples(beats)
    return found.scores() if len(found.ranks) >= 2 else {}


def _summary(iterations: np.ndarray, iter_s: np.ndarray, scores: Mapping[int, Any], listed: int) -> dict[str, Any] | None:
    """The snapshot's summary of every rank heard from (their loop iterations and
    iteration times; None: none yet)."""
    if not len(iterations):
        return None
    times = np.sort(iter_s)
    return {"ranks": len(iterations), "listed": listed, "iteration_min": int(iterations.min()),
            "iteration_max": int(iterations.max()), "iter_s_max": round(float(times[-1]), 6),
            "iter_s_median": round(float(times[len(times) // 2]), 6),
            "score_max": round(float(score_values(scores).max()), 4) if scores else None}


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
    (iter_s,) = columns(beats, "iter_s")
    job_s = float(iter_s.max()) if len(iter_s) else 0.0
    levels = ep.slow_levels
    if mit.applied and levels and job_s > 0:
        slow = sorted(levels)[len(levels) // 2]
        removed = slowdown_removed(mit.planner.state().healthy_s, slow, job_s)
    planner["slowdown_removed"] = None if removed is None else round(removed, 4)
    return episode, planner
