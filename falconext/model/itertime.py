"""Predict one training iteration's time of a TP x DP x PP layout under faults.

Why a model. The S3 planner (:mod:`falconext.mitigate.topology`) must compare thousands
of candidate rank permutations in well under a second, long before any of them could be
tried on the job. It therefore scores them with this model: healthy costs measured on the
job (per-stage compute, p2p and all-reduce times) plus the faults the validator named
(slow GPUs as compute factors, slow inter-node links as excess seconds per byte). Only
*relative* accuracy across permutations really matters to the planner; absolute accuracy
(within ~15% of measured times on the CPU test bed) is what makes the predicted gain
worth reporting.

What is modelled, and why that much:

* Compute. A process's forward and backward take ``factor`` times their healthy time, and
  a TP group runs at its slowest member, because every TP layer ends in a collective that
  waits for all of them.
* Pipeline. Megatron's non-interleaved 1F1B schedule is simulated exactly as a small
  discrete-event computation, because where a slow stage or a slow p2p boundary sits in
  the pipeline changes the bubble, and a closed form would miss that.
* P2P. A message between adjacent stages costs ``p2p_s + act_bytes * (net + excess)``,
  ``net`` being the healthy network's seconds per byte (``net_s_per_byte``) when the two
  stages sit on different nodes; with ``tp > 1`` each TP rank sends its own message to
  the matching TP rank, and the stage boundary waits for the slowest of them.
* DP all-reduce. Runs after the pipeline (no overlap), per stage and per TP rank, as a
  ring in role order (gloo and NCCL rings follow group rank order). A ring moves
  ``2 (n-1)/n * B`` bytes over every ring link and is as slow as its slowest link
  (``net + excess`` per byte on a link between nodes).
* Everything else (optimizer step, data, loss reduction) is a fixed ``other_s``.

* A slow link's capacity. A node link carries its transfers one after another, so its
  busiest direction's bytes of one iteration (every pipeline message and ring step that
  crosses it, of every replica and TP rank) times its seconds per byte (``net +
  excess``), plus ``other_s``, bound the iteration from below; and the all-reduces that
  cross one slow link direction share it once the first of them starts (stage by stage,
  as the pipeline drains), so they end no earlier than that start plus all their bytes'
  time (measured: two stages' rings over one congested TCP link ended 0.05 s after what
  the one-ring-at-a-time price gave). Only where the healthy
  network's rate is known (``net_s_per_byte > 0``): an excess alone is not a link's
  time per byte (the simulated jobs of the experiments give excesses only, and their
  messages are priced one by one). The messages above are
  priced as if each had the link alone; when two replicas' pipelines cross one congested
  link, their messages queue behind each other, and this bound is what sees it (over
  real rate-limited links the bound read 0.53 s of a measured 0.56 s where the
  per-message model gave 0.49 s).

Intra-node transfers are never slowed (slow links are, by definition, between nodes).
Contention on healthy links is not modelled.

Conventions (shared with the planner): ``world = tp * dp * pp``; the node of process
``p`` is ``p // ranks_per_node``; a *role* (the torch rank a process plays) is
``tp_r + tp * (dp_r + dp * pp_r)`` (Megatron's default order); a permutation is
``roles[process] = role``.

Everything here is pure: no torch, no clock, no I/O. :class:`IterationModel` memoises
pipeline simulations keyed on their exact inputs, which is only an optimisation.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from falconext.integers import is_int
from falconext.model.roles import check_roles

__all__ = [
    "IterationBreakdown",
    "IterationModel",
    "JobCosts",
    "LayoutLike",
    "check_slow_gpus",
    "check_slow_links",
    "iteration_time",
    "one_f_one_b",
]


class LayoutLike(Protocol):
    """Anything with the four layout sizes (e.g. :class:`falconext.mitigate.topology.Layout`).

    A protocol rather than an import keeps the data flowing one way: the planner in
    ``mitigate/`` uses this model, never the other way round.
    """

    tp: int
    dp: int
    pp: int
    ranks_per_node: int


# ---------------------------------------------------------------------------------------
# validation helpers
# ---------------------------------------------------------------------------------------


def _finite_nonneg(name: str, x: object) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {x!r}")
    v = float(x)
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} = {x!r} must be finite and >= 0")
    return v


def _float_seq(name: str, xs: object, length: int | None = None) -> tuple[float, ...]:
    if isinstance(xs, (str, bytes)) or not isinstance(xs, Sequence):
        try:  # numpy arrays and other iterables
            xs = list(xs)  # type: ignore[call-overload]
        except TypeError:
            raise ValueError(f"{name} must be a sequence of numbers, got {xs!r}") from None
    out = tuple(_finite_nonneg(f"{name}[{i}]", x) for i, x in enumerate(xs))  # type: ignore[union-attr]
    if length is not None and len(out) != length:
        raise ValueError(f"{name} has {len(out)} entries, expected {length}")
    return out


def _layout_sizes(layout: LayoutLike) -> tuple[int, int, int, int]:
    sizes = []
    for field in ("tp", "dp", "pp", "ranks_per_node"):
        v = getattr(layout, field, None)
        if not is_int(v) or v < 1:
            raise ValueError(f"layout.{field} must be a positive int, got {v!r}")
        sizes.append(int(v))  # type: ignore[arg-type]
    return sizes[0], sizes[1], sizes[2], sizes[3]


def check_slow_gpus(slow_gpus: Mapping[int, float] | None, world: int) -> dict[int, float]:
    """Validate ``{process: compute factor}``; factors must be finite and > 0."""
    if slow_gpus is None:
        return {}
    if not isinstance(slow_gpus, Mapping):
        raise ValueError(f"slow_gpus must be a mapping process -> factor, got {slow_gpus!r}")
    out: dict[int, float] = {}
    for p, f in slow_gpus.items():
        if not is_int(p) or not 0 <= p < world:
            raise ValueError(f"slow_gpus names process {p!r}, outside range({world})")
        if isinstance(f, bool) or not isinstance(f, numbers.Real) or not (
            math.isfinite(float(f)) and float(f) > 0
        ):
            raise ValueError(f"slow_gpus[{p}] = {f!r} must be a finite factor > 0")
        out[int(p)] = float(f)
    return out


def check_slow_links(
    slow_links: Mapping[tuple[int, int], float] | None, n_nodes: int
) -> dict[tuple[int, int], float]:
    """Validate ``{(node_a, node_b): excess s/byte}`` and key it by ``(min, max)``.

    A link is undirected (a congested cable or switch port slows both directions), so
    ``(a, b)`` and ``(b, a)`` name the same link; giving both is rejected as ambiguous.
    """
    if slow_links is None:
        return {}
    if not isinstance(slow_links, Mapping):
        raise ValueError(
            f"slow_links must be a mapping (node_a, node_b) -> excess, got {slow_links!r}"
        )
    out: dict[tuple[int, int], float] = {}
    for key, e in slow_links.items():
        if (
            isinstance(key, (str, bytes))
            or not isinstance(key, Sequence)
            or len(key) != 2
            or not all(is_int(n) for n in key)
        ):
            raise ValueError(f"slow_links key {key!r} must be a pair of node ints")
        a, b = int(key[0]), int(key[1])
        for n in (a, b):
            if not 0 <= n < n_nodes:
                raise ValueError(f"slow_links key {key!r}: node {n} is outside range({n_nodes})")
        if a == b:
            raise ValueError(
                f"slow_links key {key!r} links node {a} to itself; "
                "intra-node transfers are never slowed"
            )
        if isinstance(e, bool) or not isinstance(e, numbers.Real) or not (
            math.isfinite(float(e)) and float(e) >= 0
        ):
            raise ValueError(f"slow_links[{key!r}] = {e!r} must be finite excess s/byte >= 0")
        k = (min(a, b), max(a, b))
        if k in out:
            raise ValueError(f"slow_links names link {k} twice (as ({a}, {b}) and reversed)")
        out[k] = float(e)
    return out


# ---------------------------------------------------------------------------------------
# inputs and outputs
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobCosts:
    """Healthy measured costs of one training job (everything the model needs but faults).

    ``fwd_s[s]``/``bwd_s[s]``: seconds per micro-batch of stage ``s`` (``bwd_s`` defaults
    to ``2 * fwd_s``, the usual ratio for transformer layers). ``act_bytes``: bytes of one
    p2p message (forward activation and backward gradient are the same shape);
    ``p2p_s``: healthy seconds of one such message. ``grad_bytes[s]``/``allreduce_s[s]``:
    bytes and healthy seconds of stage ``s``'s DP gradient all-reduce (default 0).
    ``other_s``: fixed per-iteration time. ``plan[d]``: micro-batches of DP replica ``d``
    (uneven after an S2 rebalance, which is why it is per replica). ``net_s_per_byte``:
    a healthy inter-node link's seconds per byte, added to every transfer between two
    nodes (0: healthy transfers are left in the compute and ``other_s`` a fit gives).

    Sequences are stored as tuples so a ``JobCosts`` is hashable and cannot change under
    a planner that is using it.
    """

    fwd_s: Sequence[float]
    plan: Sequence[int]
    bwd_s: Sequence[float] | None = None
    act_bytes: float = 0.0
    p2p_s: float = 0.0
    grad_bytes: Sequence[float] | None = None
    allreduce_s: Sequence[float] | None = None
    other_s: float = 0.0
    net_s_per_byte: float = 0.0

    def __post_init__(self) -> None:
        fwd = _float_seq("fwd_s", self.fwd_s)
        if not fwd:
            raise ValueError("fwd_s is empty: there must be at least one pipeline stage")
        pp = len(fwd)
        bwd = tuple(2.0 * f for f in fwd) if self.bwd_s is None else _float_seq("bwd_s", self.bwd_s, pp)
        grad = (0.0,) * pp if self.grad_bytes is None else _float_seq("grad_bytes", self.grad_bytes, pp)
        ar = (0.0,) * pp if self.allreduce_s is None else _float_seq("allreduce_s", self.allreduce_s, pp)
        if isinstance(self.plan, (str, bytes)):
            raise ValueError("plan must be a sequence of micro-batch counts, not a string")
        try:
            plan_list = list(self.plan)
        except TypeError:
            raise ValueError(f"plan must be a sequence of ints, got {self.plan!r}") from None
        if not plan_list:
            raise ValueError("plan is empty: there must be at least one DP replica")
        for d, m in enumerate(plan_list):
            if not is_int(m) or m < 1:
                raise ValueError(f"plan[{d}] = {m!r} must be an int >= 1 micro-batches")
        object.__setattr__(self, "fwd_s", fwd)
        object.__setattr__(self, "bwd_s", bwd)
        object.__setattr__(self, "grad_bytes", grad)
        object.__setattr__(self, "allreduce_s", ar)
        object.__setattr__(self, "plan", tuple(int(m) for m in plan_list))
        object.__setattr__(self, "act_bytes", _finite_nonneg("act_bytes", self.act_bytes))
        object.__setattr__(self, "p2p_s", _finite_nonneg("p2p_s", self.p2p_s))
        object.__setattr__(self, "other_s", _finite_nonneg("other_s", self.other_s))
        object.__setattr__(self, "net_s_per_byte", _finite_nonneg("net_s_per_byte", self.net_s_per_byte))

    @classmethod
    def uniform(
        cls,
        pp: int,
        dp: int,
        fwd_s: float,
        microbatches: int,
        *,
        bwd_s: float | None = None,
        act_bytes: float = 0.0,
        p2p_s: float = 0.0,
        grad_bytes: float = 0.0,
        allreduce_s: float = 0.0,
        other_s: float = 0.0,
    ) -> JobCosts:
        """Costs with identical stages and an even plan: the common case in tests and sims."""
        if not is_int(pp) or pp < 1 or not is_int(dp) or dp < 1:
            raise ValueError(f"pp = {pp!r} and dp = {dp!r} must be positive ints")
        return cls(
            fwd_s=[fwd_s] * pp,
            bwd_s=None if bwd_s is None else [bwd_s] * pp,
            plan=[microbatches] * dp,
            act_bytes=act_bytes,
            p2p_s=p2p_s,
            grad_bytes=[grad_bytes] * pp,
            allreduce_s=[allreduce_s] * pp,
            other_s=other_s,
        )


@dataclass(frozen=True)
class IterationBreakdown:
    """Where one predicted iteration's time goes.

    ``stage_finish_s[d][s]``: when stage ``s`` of DP replica ``d`` ends its last backward
    (pipeline time measured from the iteration start). ``pipeline_s[d]``: that replica's
    pipeline time (max over its stages). ``allreduce_start_s[s]``/``allreduce_s[s]``: when
    stage ``s``'s gradient all-reduce starts (the slowest replica's finish of ``s``) and
    how long it takes (0 when ``dp == 1``). ``link_busy_s``: the busiest slow link
    direction's transfer time per iteration (0 without slow links or a network rate).
    ``total_s`` includes ``other_s``, and is at least ``link_busy_s + other_s``.
    """

    total_s: float
    pipeline_s: tuple[float, ...]
    stage_finish_s: tuple[tuple[float, ...], ...]
    allreduce_start_s: tuple[float, ...]
    allreduce_s: tuple[float, ...]
    other_s: float
    link_busy_s: float = 0.0


# ---------------------------------------------------------------------------------------
# the 1F1B pipeline
# ---------------------------------------------------------------------------------------


def _schedule(pp: int, m: int) -> list[list[tuple[bool, int]]]:
    """Per stage, the op order of Megatron's non-interleaved 1F1B: (is_backward, mb)."""
    ops = []
    for s in range(pp):
        warm = min(pp - s - 1, m)
        order: list[tuple[bool, int]] = [(False, i) for i in range(warm)]
        for i in range(m - warm):  # steady state: one forward, then one backward
            order.append((False, warm + i))
            order.append((True, i))
        order.extend((True, i) for i in range(m - warm, m))  # cool-down
        ops.append(order)
    return ops


def one_f_one_b(
    fwd_s: Sequence[float], bwd_s: Sequence[float], msg_s: Sequence[float], microbatches: int
) -> tuple[float, ...]:
    """Simulate one pipeline's 1F1B schedule; return each stage's finish time.

    ``fwd_s``/``bwd_s`` are the (already fault-stretched) per-stage compute times,
    ``msg_s[s]`` the time of one message over boundary ``s -> s+1`` (both directions).
    Every op starts when its stage is free *and* its input has arrived: a forward needs
    the previous stage's forward of the same micro-batch plus one message, a backward the
    next stage's backward of it plus one message. The op order per stage is fixed by the
    schedule, so the result does not depend on the order in which ops are evaluated.
    """
    pp = len(fwd_s)
    if pp < 1 or len(bwd_s) != pp or len(msg_s) != pp - 1:
        raise ValueError(
            f"one_f_one_b needs pp >= 1 stages and pp - 1 boundaries, got "
            f"{len(fwd_s)} fwd, {len(bwd_s)} bwd, {len(msg_s)} msg"
        )
    if not is_int(microbatches) or microbatches < 1:
        raise ValueError(f"microbatches = {microbatches!r} must be an int >= 1")
    fwd_s = _float_seq("fwd_s", fwd_s)
    bwd_s = _float_seq("bwd_s", bwd_s)
    msg_s = _float_seq("msg_s", msg_s)
    m = int(microbatches)
    ops = _schedule(pp, m)
    nan = math.nan
    f_end = [[nan] * m for _ in range(pp)]
    b_end = [[nan] * m for _ in range(pp)]
    free = [0.0] * pp
    ptr = [0] * pp
    left = 2 * m * pp
    while left:
        progressed = False
        for s in range(pp):
            order = ops[s]
            while ptr[s] < len(order):
                backward, i = order[ptr[s]]
                if backward:
                    if s == pp - 1:
                        ready = f_end[s][i]  # the loss: its own forward, already done
                    else:
                        dep = b_end[s + 1][i]
                        if dep != dep:  # NaN: the gradient has not been computed yet
                            break
                        ready = dep + msg_s[s]
                    end = max(free[s], ready) + bwd_s[s]
                    b_end[s][i] = end
                else:
                    if s == 0:
                        ready = 0.0
                    else:
                        dep = f_end[s - 1][i]
                        if dep != dep:
                            break
                        ready = dep + msg_s[s - 1]
                    end = max(free[s], ready) + fwd_s[s]
                    f_end[s][i] = end
                free[s] = end
                ptr[s] += 1
                left -= 1
                progressed = True
        if not progressed:  # pragma: no cover - the 1F1B order has no cycle
            raise RuntimeError("1F1B simulation deadlocked; the schedule is inconsistent")
    return tuple(free)


# ---------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------


class IterationModel:
    """A validated (layout, costs, faults) triple that scores permutations fast.

    Validation happens once here, so a planner can evaluate thousands of permutations
    without re-checking the faults. Pipeline simulations are memoised on their exact
    inputs (micro-batches, stretched compute, message times): most candidate permutations
    leave most replicas untouched, and healthy replicas all look alike. Everything else
    is a handful of numpy gathers over the ``(pp, dp, tp)`` role grid.
    """

    def __init__(
        self,
        layout: LayoutLike,
        costs: JobCosts,
        slow_gpus: Mapping[int, float] | None = None,
        slow_links: Mapping[tuple[int, int], float] | None = None,
    ) -> None:
        tp, dp, pp, rpn = _layout_sizes(layout)
        if not isinstance(costs, JobCosts):
            raise ValueError(f"costs must be a JobCosts, got {type(costs).__name__}")
        if len(costs.fwd_s) != pp:
            raise ValueError(f"costs.fwd_s has {len(costs.fwd_s)} stages, layout.pp = {pp}")
        if len(costs.plan) != dp:
            raise ValueError(f"costs.plan has {len(costs.plan)} replicas, layout.dp = {dp}")
        self.tp, self.dp, self.pp, self.ranks_per_node = tp, dp, pp, rpn
        self.world = tp * dp * pp
        self.n_nodes = -(-self.world // rpn)
        self.costs = costs
        self.slow_gpus = check_slow_gpus(slow_gpus, self.world)
        self.slow_links = check_slow_links(slow_links, self.n_nodes)

        self._factor = np.ones(self.world)
        for p, f in self.slow_gpus.items():
            self._factor[p] = f
        # links with zero excess are healthy: drop them so "any slow link?" is exact.
        self._links = {k: e for k, e in self.slow_links.items() if e > 0}
        # Nodes are renumbered: 0 for every node without a slow link (all its transfers
        # are healthy, so those nodes are interchangeable), 1.. for the others. The excess
        # matrix then has (nodes with slow links + 1)^2 entries, not n_nodes^2.
        link_nodes = sorted({n for k in self._links for n in k})
        code = np.zeros(self.n_nodes, dtype=np.intp)
        code[link_nodes] = np.arange(1, len(link_nodes) + 1)
        self._node = code[np.arange(self.world) // rpn]  # process -> renumbered node
        self._n_codes = len(link_nodes) + 1
        excess = np.zeros((self._n_codes, self._n_codes))
        for (a, b), e in self._links.items():
            excess[code[a], code[b]] = excess[code[b], code[a]] = e
        self._excess_flat = excess.ravel()
        # a slow link's seconds per byte in all (healthy network + excess), for its capacity
        self._link_rate_flat = np.where(excess > 0, excess + costs.net_s_per_byte, 0.0).ravel()
        self._net = costs.net_s_per_byte
        self._host = np.arange(self.world) // rpn  # process -> its real node
        # role grid: _grid[s, d, t] = role (tp_r t, dp_r d, pp_r s); _ring_next is the role
        # after it in its DP ring (role order, wrapping around).
        self._grid = np.arange(self.world).reshape(pp, dp, tp)
        self._dp_next = (np.arange(dp) + 1) % dp  # replica d's next in its DP ring
        self._ring_next = self._grid[:, self._dp_next, :]
        self._fwd = np.asarray(costs.fwd_s, dtype=float)
        self._bwd = np.asarray(costs.bwd_s, dtype=float)
        self._ring_bytes = 2.0 * (dp - 1) / dp * np.asarray(costs.grad_bytes, dtype=float)
        self._allreduce = (
            np.asarray(costs.allreduce_s, dtype=float) if dp > 1 else np.zeros(pp)
        )
        priced = bool(self._links) or self._net > 0  # some transfer between nodes costs time
        self._p2p_slowed = priced and costs.act_bytes > 0 and pp > 1
        self._ring_slowed = priced and dp > 1 and bool(np.any(self._ring_bytes > 0))
        # bytes of one iteration's pipeline messages per stage boundary and replica (each
        # way), and of its ring steps per stage, for the capacity of slow links
        self._pipe_bytes = np.asarray(costs.plan, dtype=float)[None, :, None] * costs.act_bytes
        self._ring_step_bytes = self._ring_bytes[:, None, None] * np.ones((1, dp, tp))
        self._healthy_msgs = (costs.p2p_s,) * (pp - 1)
        self._pipe_cache: dict[tuple, tuple[float, ...]] = {}
        self._grid_cache: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
        # ~16 MB of cached finish times at most, whatever the job's size
        self._grid_cache_cap = max(1_000, 2_000_000 // (dp * pp))

    def factor(self, process: int) -> float:
        """Compute factor of ``process`` (1.0 when healthy)."""
        return float(self._factor[process])

    def excess(self, node_a: int, node_b: int) -> float:
        """Excess seconds per byte on the link between two nodes (0 within a node)."""
        return self._links.get((min(node_a, node_b), max(node_a, node_b)), 0.0)

    def _pipeline(self, m: int, factors: np.ndarray, msgs: np.ndarray | None) -> tuple[float, ...]:
        key = (m, factors.tobytes(), b"" if msgs is None else msgs.tobytes())
        hit = self._pipe_cache.get(key)
        if hit is None:
            msg = self._healthy_msgs if msgs is None else msgs.tolist()
            hit = one_f_one_b((self._fwd * factors).tolist(), (self._bwd * factors).tolist(), msg, m)
            if len(self._pipe_cache) > 100_000:  # bound memory on very long searches
                self._pipe_cache.clear()
            self._pipe_cache[key] = hit
        return hit

    def _per_byte(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Seconds per byte, beyond the healthy cost already in the fit, of transfers
        from processes ``src`` to processes ``dst`` (arrays of one shape)."""
        out = self._excess_flat[self._node[src] * self._n_codes + self._node[dst]]
        if self._net > 0:
            out = out + self._net * (self._host[src] != self._host[dst])
        return out

    def _link_bounds(self, pgrid: np.ndarray, start: np.ndarray) -> tuple[float, float]:
        """Two lower bounds from the capacity of slow links, for the layout ``pgrid``:
        (the busiest slow link direction's transfer seconds of one iteration, the latest
        end of the all-reduces that cross one slow link direction, which share it after the
        earliest of them starts, ``start[s]`` being stage ``s``'s all-reduce start)."""
        codes = self._node[pgrid]
        n = self._n_codes
        idx, weight = [], []
        if self._p2p_slowed:
            a, b = codes[:-1], codes[1:]
            w = np.broadcast_to(self._pipe_bytes, a.shape)
            idx += [(a * n + b).ravel(), (b * n + a).ravel()]  # forward and backward
            weight += [w.ravel(), w.ravel()]
        tail = 0.0
        if self._ring_slowed:
            nxt = codes[:, self._dp_next, :]
            ring_idx = (codes * n + nxt).ravel()
            ring_w = self._ring_step_bytes.ravel()
            idx.append(ring_idx)
            weight.append(ring_w)
            on = self._link_rate_flat[ring_idx] > 0
            if on.any():
                first = np.full(n * n, np.inf)
                np.minimum.at(first, ring_idx[on], np.broadcast_to(start[:, None, None], codes.shape).ravel()[on])
                ring_s = np.bincount(ring_idx[on], weights=ring_w[on], minlength=n * n) * self._link_rate_flat
                tail = float(np.max(np.where(np.isfinite(first), first + ring_s, 0.0)))
        if not idx:
            return 0.0, tail
        moved = np.bincount(np.concatenate(idx), weights=np.concatenate(weight), minlength=n * n)
        return float((moved * self._link_rate_flat).max()), tail

    def _evaluate(self, proc: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, float]:
        """Core of the model for ``proc[role] = process``: (stage_finish, start, dur,
        total, link_busy)."""
        pgrid = proc[self._grid]  # (pp, dp, tp) processes
        factors = self._factor[pgrid]
        # a TP group runs at its slowest member
        factors = factors[:, :, 0] if self.tp == 1 else factors.max(axis=2)
        msgs = None
        if self._p2p_slowed:
            worst = self._per_byte(pgrid[:-1], pgrid[1:])
            worst = worst[:, :, 0] if self.tp == 1 else worst.max(axis=2)  # slowest tp message
            msgs = self.costs.p2p_s + self.costs.act_bytes * worst  # (pp - 1, dp)
        # All replicas at once first: most candidates a planner tries leave every
        # replica's pipeline inputs as they were in some earlier candidate.
        key = factors.tobytes() + (b"" if msgs is None else msgs.tobytes())
        hit = self._grid_cache.get(key)
        if hit is None:
            plan = self.costs.plan
            finish = np.array(
                [
                    self._pipeline(plan[d], factors[:, d], None if msgs is None else msgs[:, d])  # type: ignore[index]
                    for d in range(self.dp)
                ]
            )  # (dp, pp)
            hit = (finish, finish.max(axis=0))  # each stage's all-reduce waits for its slowest replica
            if len(self._grid_cache) > self._grid_cache_cap:
                self._grid_cache.clear()
            self._grid_cache[key] = hit
        finish, start = hit
        dur = self._allreduce
        if self._ring_slowed:
            ring = self._per_byte(pgrid, proc[self._ring_next])
            dur = dur + self._ring_bytes * ring.reshape(self.pp, -1).max(axis=1)
        total = float((start + dur).max())
        busy = 0.0
        if self._links and self._net > 0:
            busy, tail = self._link_bounds(pgrid, start)
            total = max(total, busy, tail)
        return finish, start, dur, total + self.costs.other_s, busy

    def _proc(self, roles: Sequence[int], checked: bool) -> np.ndarray:
        if not checked:
            roles = check_roles(roles, self.world)
        proc = np.empty(self.world, dtype=np.intp)
        proc[np.asarray(roles, dtype=np.intp)] = np.arange(self.world)
        return proc

    def breakdown(self, roles: Sequence[int], *, checked: bool = False) -> IterationBreakdown:
        """Predict one iteration of the layout where ``roles[process] = role``.

        ``checked=True`` skips the permutation check (for callers that built ``roles``
        themselves and call this in a hot loop).
        """
        finish, start, dur, total, busy = self._evaluate(self._proc(roles, checked))
        return IterationBreakdown(
            total_s=total,
            pipeline_s=tuple(float(x) for x in finish.max(axis=1)),
            stage_finish_s=tuple(tuple(float(x) for x in row) for row in finish),
            allreduce_start_s=tuple(float(x) for x in start),
            allreduce_s=tuple(float(x) for x in dur),
            other_s=self.costs.other_s,
            link_busy_s=busy,
        )

    def time(self, roles: Sequence[int], *, checked: bool = False) -> float:
        """Predicted seconds of one iteration (see :meth:`breakdown`)."""
        return self._evaluate(self._proc(roles, checked))[3]

    def time_of_processes(self, proc: np.ndarray) -> float:
        """Like :meth:`time` for the inverse permutation ``proc[role] = process``.

        The planner's hot path: it keeps ``proc`` as an int array, so this skips both the
        inversion and the permutation check. ``proc`` must be a permutation (unchecked).
        """
        return self._evaluate(proc)[3]


def iteration_time(
    layout: LayoutLike,
    roles: Sequence[int],
    costs: JobCosts,
    slow_gpus: Mapping[int, float] | None = None,
    slow_links: Mapping[tuple[int, int], float] | None = None,
) -> float:
    """Predicted seconds of one training iteration of ``layout`` played by ``roles``.

    ``slow_gpus``: ``{process: factor}`` (> 1 is slower); ``slow_links``:
    ``{(node_a, node_b): excess seconds per byte}``. See the module docstring for the
    model; :class:`IterationModel` gives the breakdown and is faster for many calls.
    """
    return IterationModel(layout, costs, slow_gpus, slow_links).time(roles)
