"""S2 mitigation: give slow data-parallel replicas fewer micro-batches.

Every data-parallel (DP) replica processes its micro-batches and then waits in the
gradient all-reduce for the others, so an iteration takes as long as the *slowest*
replica: ``max_i m_i * t_i`` for ``m_i`` micro-batches at ``t_i`` seconds each. When one
replica fails slow, moving some of its micro-batches to healthy replicas (keeping the
global batch, and hence the training semantics, unchanged) shortens the iteration.

The planner is on the critical path of a reconfiguration, so it must be fast even at
thousands of replicas: :func:`plan_microbatches` is an exact greedy that needs
``O(D log D)`` time. :func:`plan_microbatches_cvxpy` states the same problem as a
mixed-integer program; it exists to cross-check the greedy and to show what a generic
solver costs (the Falcon paper reports 35.93 s at 512 replicas for its solver).

Everything here is pure: no I/O, no torch, no global state.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from falconext.integers import is_int

__all__ = ["plan_microbatches", "plan_microbatches_cvxpy", "slowest_time"]

Caps = int | Sequence[int] | None


# ---------------------------------------------------------------------------------------
# validation (shared by both solvers so they accept and reject exactly the same inputs)
# ---------------------------------------------------------------------------------------


def _validate(
    times: Sequence[float] | np.ndarray, total: int, max_per_replica: Caps
) -> tuple[np.ndarray, int, np.ndarray]:
    """Check the inputs and return ``(t, M, caps)`` in a form both solvers can use.

    ``caps`` comes back as an int64 array already clipped to ``M - D + 1``: with every
    other replica holding at least one micro-batch, no replica can ever hold more, so the
    clipped caps describe exactly the same feasible set while keeping numbers small (and
    "no cap" needs no special case downstream).
    """
    if isinstance(times, (str, bytes)):
        raise ValueError("times must be a sequence of numbers, not a string")
    try:
        t = np.asarray(times if isinstance(times, np.ndarray) else list(times), dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"times must be a sequence of numbers: {exc}") from None
    if t.ndim != 1:
        raise ValueError(f"times must be one-dimensional, got shape {t.shape}")
    d = t.size
    if d == 0:
        raise ValueError("times is empty: there must be at least one replica")
    bad = np.flatnonzero(~np.isfinite(t) | (t <= 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"times[{i}] = {t[i]!r} is not a finite positive number of seconds per micro-batch"
        )

    if not is_int(total):
        raise ValueError(f"total must be an int number of micro-batches, got {total!r}")
    m_total = int(total)
    if m_total < d:
        raise ValueError(
            f"total = {m_total} micro-batches < {d} replicas: "
            "cannot give every replica a micro-batch"
        )

    limit = m_total - d + 1
    if max_per_replica is None:
        return t, m_total, np.full(d, limit, dtype=np.int64)
    if is_int(max_per_replica):
        cap = int(max_per_replica)  # type: ignore[arg-type]
        if cap < 1:
            raise ValueError(
                f"max_per_replica = {cap} < 1: every replica needs at least one micro-batch"
            )
        if cap * d < m_total:
            raise ValueError(
                f"infeasible: the caps allow at most {cap * d} micro-batches in total "
                f"but total = {m_total}"
            )
        return t, m_total, np.full(d, min(cap, limit), dtype=np.int64)

    if isinstance(max_per_replica, (str, bytes)):
        raise ValueError("max_per_replica must be None, an int or a sequence of ints")
    try:
        raw = list(max_per_replica)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(
            f"max_per_replica must be None, an int or a sequence of ints, got {max_per_replica!r}"
        ) from None
    if len(raw) != d:
        raise ValueError(
            f"max_per_replica has {len(raw)} entries but there are {d} replicas"
        )
    for i, c in enumerate(raw):
        if not is_int(c):
            raise ValueError(f"max_per_replica[{i}] = {c!r} is not an int")
    caps_list = [int(c) for c in raw]
    for i, c in enumerate(caps_list):
        if c < 1:
            raise ValueError(
                f"max_per_replica[{i}] = {c} < 1: every replica needs at least one micro-batch"
            )
    cap_sum = sum(caps_list)  # Python ints: no overflow however large the caps are
    if cap_sum < m_total:
        raise ValueError(
            f"infeasible: the caps allow at most {cap_sum} micro-batches in total "
            f"but total = {m_total}"
        )
    caps = np.fromiter((min(c, limit) for c in caps_list), dtype=np.int64, count=d)
    return t, m_total, caps


# ---------------------------------------------------------------------------------------
# exact greedy
# ---------------------------------------------------------------------------------------


def _relaxed_level(t: np.ndarray, caps: np.ndarray, total: int) -> tuple[float, float]:
    """Bracket ``[lo, hi]`` around the level of the continuous relaxation.

    ``f(T) = sum_i clip(T / t_i, 1, cap_i)`` is the largest number of micro-batches that
    fit below a finishing time ``T`` if micro-batches were divisible. Any integer plan
    with slowest time ``T*`` has ``m_i <= clip(T*/t_i, 1, cap_i)``, so ``f(T*) >= M``:
    the level where ``f`` reaches ``M`` is a lower bound on the optimum, and flooring
    ``T / t_i`` there loses less than one micro-batch per replica. The bracket need not be
    tight or even correct for the result to be exact (see :func:`_complete`); it only
    keeps the number of heap operations at most about ``D``.
    """
    inv = 1.0 / t
    lo, hi = 0.0, float(np.max(caps * t))
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if mid <= lo or mid >= hi:
            break
        if float(np.clip(mid * inv, 1.0, caps).sum()) < total:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return lo, hi


def _start(t: np.ndarray, caps: np.ndarray, level: float) -> np.ndarray:
    """Per-replica counts whose every micro-batch finishes by ``level`` (at least one each)."""
    return np.clip(np.floor(level / t), 1, caps).astype(np.int64)


def _complete(t: np.ndarray, caps: np.ndarray, total: int, m: np.ndarray) -> np.ndarray:
    """Turn any start ``1 <= m <= caps`` into the canonical optimal plan (in place).

    Why this is exact: call the ``j``-th micro-batch of replica ``i`` (``j >= 2``) an
    *increment* with value ``v = j * t_i``, the finishing time it gives that replica, and
    order increments by ``(v, i)``. A plan is a choice of ``M - D`` increments that is a
    prefix per replica (``2..m_i``), and its slowest time is the larger of ``max_i t_i``
    (unavoidable: everyone has one micro-batch) and its largest chosen value. No choice
    of ``M - D`` increments can have a largest element smaller than the ``(M - D)``-th
    smallest increment overall, and the set of the ``M - D`` smallest *is* a per-replica
    prefix (values grow with ``j``), so that set is min-max optimal. It is also unique
    under the ``(v, i)`` order, which makes the result deterministic and independent of
    the start, and ties go to lower indices (all times equal and ``D | M`` gives the
    even plan). Taking the smallest increments also minimises their sum,
    ``sum_i t_i (m_i (m_i + 1) / 2 - 1)``, over all plans: a convex imbalance measure, so
    the plan is balanced below the slowest replica too, not just at it.

    The three phases reach that set from any start:

    1. while too many micro-batches, drop the largest chosen increment (max-heap of each
       replica's last increment ``m_i t_i``);
    2. while too few, add the smallest unchosen one (min-heap of ``(m_i + 1) t_i``);
    3. while the largest chosen increment comes after the smallest unchosen one, swap
       them (this only does work for a start that was not a lower level set, e.g. when
       floating-point rounding in ``floor(level / t_i)`` disagrees with ``j * t_i``).

    If the start is a level set (all chosen values ``<= level`` and every unchosen value
    ``> level``, which is what :func:`_start` builds), the chosen increments are all
    smaller than the unchosen ones, so phases 1 and 2 stop at exactly the ``M - D``
    smallest and phase 3 is a single vectorised check. All comparisons use the same
    float products ``j * t_i``, so the argument holds exactly in floating point.
    """
    tl = t.tolist()
    cl = caps.tolist()
    ml = m.tolist()
    d = len(tl)
    excess = sum(ml) - total

    if excess > 0:  # phase 1
        tops = [(-(ml[i] * tl[i]), -i) for i in range(d) if ml[i] > 1]
        heapq.heapify(tops)
        for _ in range(excess):
            _, ni = heapq.heappop(tops)
            i = -ni
            ml[i] -= 1
            if ml[i] > 1:
                heapq.heappush(tops, (-(ml[i] * tl[i]), ni))
    elif excess < 0:  # phase 2
        nexts = [((ml[i] + 1) * tl[i], i) for i in range(d) if ml[i] < cl[i]]
        heapq.heapify(nexts)
        for _ in range(-excess):
            _, i = heapq.heappop(nexts)
            ml[i] += 1
            if ml[i] < cl[i]:
                heapq.heappush(nexts, ((ml[i] + 1) * tl[i], i))

    m[:] = ml
    if not _needs_swaps(t, caps, m):
        return m

    # phase 3: lazy heaps; an entry is stale once its replica's count changed.
    tops3 = [(-(ml[i] * tl[i]), -i, ml[i]) for i in range(d) if ml[i] > 1]
    nexts3 = [((ml[i] + 1) * tl[i], i, ml[i]) for i in range(d) if ml[i] < cl[i]]
    heapq.heapify(tops3)
    heapq.heapify(nexts3)
    while True:
        while tops3 and ml[-tops3[0][1]] != tops3[0][2]:
            heapq.heappop(tops3)
        while nexts3 and ml[nexts3[0][1]] != nexts3[0][2]:
            heapq.heappop(nexts3)
        if not tops3 or not nexts3:
            break
        hv, hi = -tops3[0][0], -tops3[0][1]
        lv, li = nexts3[0][0], nexts3[0][1]
        if (lv, li) > (hv, hi):
            break  # every chosen increment precedes every unchosen one: optimal
        # hi != li here: a replica's next increment always comes after its last one.
        ml[hi] -= 1
        ml[li] += 1
        for i in (hi, li):
            if ml[i] > 1:
                heapq.heappush(tops3, (-(ml[i] * tl[i]), -i, ml[i]))
            if ml[i] < cl[i]:
                heapq.heappush(nexts3, ((ml[i] + 1) * tl[i], i, ml[i]))
    m[:] = ml
    return m


def _needs_swaps(t: np.ndarray, caps: np.ndarray, m: np.ndarray) -> bool:
    """True unless the largest chosen increment precedes the smallest unchosen one."""
    has_top = m > 1
    has_next = m < caps
    if not has_top.any() or not has_next.any():
        return False
    top = np.where(has_top, m * t, -np.inf)
    nxt = np.where(has_next, (m + 1) * t, np.inf)
    hv = top.max()
    hi = int(np.flatnonzero(top == hv)[-1])
    lv = nxt.min()
    li = int(np.flatnonzero(nxt == lv)[0])
    return not (lv, li) > (hv, hi)


def plan_microbatches(
    times: Sequence[float] | np.ndarray, total: int, max_per_replica: Caps = None
) -> list[int]:
    """Split ``total`` micro-batches over DP replicas so the slowest finishes earliest.

    Args:
        times: seconds per micro-batch of each DP replica (finite, > 0), e.g. the
            per-replica compute time measured by the profiler.
        total: ``M``, micro-batches per global batch. It is fixed because changing it
            would change the global batch size and hence the optimisation.
        max_per_replica: None (no cap), one int for all replicas, or one int per
            replica -- e.g. what fits in a replica's activation memory.

    Returns:
        ``m`` as Python ints with ``1 <= m_i <= cap_i`` (every replica must take part
        in the all-reduce, so none can be emptied), ``sum(m) == total``, and
        ``max_i m_i * t_i`` minimal. Among the optimal plans it returns the one made of
        the smallest per-micro-batch finishing times, ties to lower replica indices, so
        equal times give the even plan and the answer is reproducible on every rank.

    Algorithm (``O(D log D)``, a few ms at 8192 replicas): bisect the level ``T`` of the
    continuous relaxation ``sum_i clip(T / t_i, 1, cap_i) = M`` (a lower bound on the
    optimum), start from ``m_i = clip(floor(T / t_i), 1, cap_i)``, i.e. every
    micro-batch that certainly fits under the optimum, and then add (or, if the
    ``m_i >= 1`` floor overshot, remove) one micro-batch at a time where it finishes
    earliest (latest), using a heap. Because the start holds exactly the micro-batches
    finishing by ``T`` and every other one finishes after ``T``, the greedy ends with
    the ``M - D`` earliest-finishing extra micro-batches, which is optimal; the proof is
    in :func:`_complete`. Starting at the relaxation instead of at all-ones bounds the
    heap work by about ``D`` steps instead of ``M``.

    Raises:
        ValueError: empty ``times``, a non-finite or non-positive time (the index is
            named), ``total`` not an int (or a bool), ``total < len(times)``, a cap below
            1, a cap list of the wrong length, or caps summing to less than ``total``.
    """
    t, m_total, caps = _validate(times, total, max_per_replica)
    lo, hi = _relaxed_level(t, caps, m_total)
    m = _start(t, caps, hi)
    if int(m.sum()) > m_total:
        m = _start(t, caps, lo)
    return [int(x) for x in _complete(t, caps, m_total, m)]


def slowest_time(times: Sequence[float] | np.ndarray, plan: Sequence[int]) -> float:
    """``max_i plan_i * times_i``: the iteration time a plan leads to (compute part)."""
    t = np.asarray(times, dtype=np.float64)
    p = np.asarray(plan)
    if t.shape != p.shape or t.ndim != 1 or t.size == 0:
        raise ValueError(
            f"times and plan must be non-empty and of equal length, got {t.size} and {p.size}"
        )
    return float(np.max(p.astype(np.float64) * t))


# ---------------------------------------------------------------------------------------
# generic-solver reference
# ---------------------------------------------------------------------------------------


def plan_microbatches_cvxpy(
    times: Sequence[float] | np.ndarray,
    total: int,
    max_per_replica: Caps = None,
    solver: str = "HIGHS",
    *,
    time_limit_s: float | None = None,
) -> list[int]:
    """The same plan via a mixed-integer program in cvxpy (a cross-check, not for production).

    The Falcon paper states S2 as a quadratic program minimising the spread
    ``sum_i (m_i t_i - mean)^2``; with integer ``m_i`` that is a mixed-integer QP. What
    the iteration time depends on is the slowest replica, so this states the min-max
    MILP instead: integer ``m``, continuous ``T``, minimise ``T`` subject to
    ``m_i t_i <= T``, ``sum m = M`` and ``1 <= m <= cap``. Its optimum has the same
    slowest replica as the optimum the greedy finds (the plans themselves may differ
    on replicas that are not the slowest, as min-max solutions are rarely unique).

    With HiGHS (default) or SCIPY the relative and absolute MIP gaps are set to 0 so the
    solver proves optimality instead of stopping at its 1e-4 default gap; its feasibility
    tolerances (~1e-7) still apply, so compare slowest times with a small tolerance.
    ``time_limit_s`` bounds the solve for those two solvers; hitting it is not optimal
    and raises. cvxpy is imported here so the fast path never pays for it.

    Raises:
        ValueError: the same input errors as :func:`plan_microbatches`, or a solver
            status other than optimal, or a rounded solution that violates the
            constraints.
    """
    t, m_total, caps = _validate(times, total, max_per_replica)
    import cvxpy as cp  # lazy: start-up time (cvxpy is heavy; only the reference solve needs it)

    d = t.size
    m = cp.Variable(d, integer=True)
    level = cp.Variable()
    constraints = [
        cp.multiply(t, m) <= level,
        cp.sum(m) == m_total,
        m >= 1,
        m <= caps.astype(np.float64),
    ]
    problem = cp.Problem(cp.Minimize(level), constraints)

    opts: dict[str, object] = {}
    name = solver.upper()
    if name == "HIGHS":
        opts = {"mip_rel_gap": 0.0, "mip_abs_gap": 0.0}
        if time_limit_s is not None:
            opts["time_limit"] = float(time_limit_s)
    elif name == "SCIPY":
        sp: dict[str, object] = {"mip_rel_gap": 0.0}
        if time_limit_s is not None:
            sp["time_limit"] = float(time_limit_s)
        opts = {"scipy_options": sp}
    problem.solve(solver=solver, **opts)

    if problem.status != cp.OPTIMAL or m.value is None:
        raise ValueError(
            f"cvxpy solver {solver} did not find an optimal plan (status {problem.status!r})"
        )
    plan = np.rint(np.asarray(m.value, dtype=np.float64)).astype(np.int64)
    if int(plan.sum()) != m_total or (plan < 1).any() or (plan > caps).any():
        raise ValueError(
            f"cvxpy solver {solver} returned a plan that violates the constraints after "
            f"rounding (sum {int(plan.sum())}, expected {m_total})"
        )
    return [int(x) for x in plan]
