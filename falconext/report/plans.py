"""The micro-batch plan in force through a job's attempts, from its events (pure): what
the report draws (``plan.png``) and what ``summary.json`` lists per attempt."""

from __future__ import annotations

from typing import Any


def even_plan(total: int, dp: int) -> list[int]:
    """``total`` micro-batches over ``dp`` replicas as evenly as they go (the first
    replicas take the remainder)."""
    if dp < 1:
        return []
    return [total // dp + (1 if k < total % dp else 0) for k in range(dp)]


def plan_in_force(events: list[dict[str, Any]], first: int, dp: int, total: int) -> list[tuple[int, list[int]]]:
    """The micro-batch plan in force as steps (from iteration, micro-batches per replica),
    following the job through its attempts: the even plan from ``first`` and again from
    every restart's iteration (a restarted attempt runs the even plan until it applies one),
    each applied plan (S2, a revert: ``plan_applied``) from its iteration. A restart that
    resumes at iteration r drops the steps from r on (the iterations it runs again);
    events in the order they were written."""
    even = even_plan(total, dp)
    steps: list[tuple[int, list[int]]] = [(first, even)]
    for e in events:
        kind = e.get("type")
        if kind == "plan_applied" and isinstance(e.get("plan"), list) and e.get("rank", 0) == 0:
            at, plan = int(e["iteration"]), [int(x) for x in e["plan"]]
        elif kind == "restarted" and e.get("iteration") is not None:
            at, plan = int(e["iteration"]), even
        else:
            continue
        steps = [st for st in steps if st[0] < at] + [(at, plan)]
    return steps


def plan_shape(run: dict[str, Any]) -> tuple[int, int]:
    """(DP replicas, micro-batches per iteration) of the run described by ``run.json``
    (the job's first attempt)."""
    topo = run.get("topology") or {}
    args = run.get("args") or {}
    dp = int(topo.get("dp") or 0) or max(1, int(topo.get("world", 1) or 1))
    return dp, int(args.get("global_batch_size") or dp) // max(1, int(args.get("micro_batch_size") or 1))


def plans_by_attempt(events: list[dict[str, Any]], first: int, dp: int, total: int) -> list[dict[str, Any]]:
    """Each attempt of the job (0: the launch; then one per ``restarted`` event), from the
    iteration it started at, with the plans in force during it as ``[iteration, plan]``
    pairs (:func:`plan_in_force`'s steps from its start to the next attempt's)."""
    steps = plan_in_force(events, first, dp, total)
    starts = [(0, first)] + [(int(e.get("attempt") or k + 1), int(e["iteration"])) for k, e in
                             enumerate(e for e in events if e.get("type") == "restarted" and e.get("iteration") is not None)]
    out = []
    for k, (attempt, start) in enumerate(starts):
        end = starts[k + 1][1] if k + 1 < len(starts) else None
        out.append({"attempt": attempt, "from_iteration": start,
                    "plans": [[it, plan] for it, plan in steps if it >= start and (end is None or it < end)]})
    return out
