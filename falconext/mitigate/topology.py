"""S3 mitigation: change which process plays which rank (the parallel topology).

Why. A slow GPU or a congested inter-node link hurts in proportion to the traffic and
the position it carries. Megatron has no rank-permutation option, but the roles (torch
ranks) can be handed out to processes in any order; a permutation that puts the fault
where it costs least recovers much of the loss without giving up a node (S4):

* **Link reassignment** (Falcon, Figure 10): a congested link that carries a DP gradient
  all-reduce (``2 (n-1)/n`` gradient bytes per iteration, one of the heaviest transfers)
  is moved so that it carries pipeline p2p messages instead (one activation per
  micro-batch and direction, usually far fewer bytes).
* **Straggler consolidation**: slow GPUs are gathered into the fewest PP stages (and, for
  ``tp > 1``, into the fewest TP groups), so that fewer stages run slow; interior stages
  are tried first when ``pp > 2`` because the first and last stages already carry the
  embedding and the loss.

How. Candidates are scored with the iteration-time model of
:mod:`falconext.sim.itertime` (a discrete-event 1F1B pipeline plus ring all-reduces),
so the planner trades the two effects above, and anything else the model sees, in one
currency: predicted seconds per iteration. Constructive candidates for both ideas are
built first, then a best-improvement local search over pairwise swaps refines the
current layout and the most promising candidates. The work is bounded by counts (never
by a clock), so the same input always gives the same plan.

The constraint. Every TP group must stay inside one node (TP collectives run after every
layer and cannot afford a network hop). A permutation is therefore described by *blocks*
(the TP groups of roles, one per ``(dp_r, pp_r)``) placed on *groups* of ``tp``
processes of one node; ``tp_r = i`` of the block is played by the block's ``i``-th
process. The aligned slots ``[k*tp, (k+1)*tp)`` are the groups of the identity layout
(they lie inside one node because ``ranks_per_node % tp == 0``); the search may also
regroup the processes *within* a node, which is what lets two slow GPUs of one node
share a single TP group. Every permutation produced keeps each TP group inside a node.

Pure: no torch, no I/O, no clock.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from falconext.sim.itertime import IterationModel, JobCosts, check_roles

__all__ = ["Layout", "TopologyPlan", "plan_topology"]

#: Relative improvement below which a change is not worth moving model state for.
REL_EPS = 1e-3


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@dataclass(frozen=True)
class Layout:
    """Sizes of a TP x DP x PP job and how many processes share a physical node.

    Roles follow Megatron's default order ``role = tp_r + tp * (dp_r + dp * pp_r)``; the
    node of process ``p`` is ``p // ranks_per_node`` and never changes (processes are
    pinned to GPUs; only the roles they play move).
    """

    tp: int
    dp: int
    pp: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        for field in ("tp", "dp", "pp", "ranks_per_node"):
            v = getattr(self, field)
            if not _is_int(v) or v < 1:
                raise ValueError(f"Layout.{field} must be a positive int, got {v!r}")
            object.__setattr__(self, field, int(v))
        if self.ranks_per_node % self.tp:
            raise ValueError(
                f"Layout.ranks_per_node = {self.ranks_per_node} is not a multiple of "
                f"tp = {self.tp}: a TP group could not stay inside one node"
            )

    @property
    def world(self) -> int:
        """Number of processes (= roles)."""
        return self.tp * self.dp * self.pp

    @property
    def n_nodes(self) -> int:
        """Number of physical nodes (the last one may be partly filled)."""
        return -(-self.world // self.ranks_per_node)

    def _check_role(self, role: int) -> int:
        if not _is_int(role) or not 0 <= role < self.world:
            raise ValueError(f"role {role!r} is outside range({self.world})")
        return int(role)

    def role_coords(self, role: int) -> tuple[int, int, int]:
        """``(tp_r, dp_r, pp_r)`` of ``role``."""
        r = self._check_role(role)
        return r % self.tp, (r // self.tp) % self.dp, r // (self.tp * self.dp)

    def role_of(self, tp_r: int, dp_r: int, pp_r: int) -> int:
        """The role with coordinates ``(tp_r, dp_r, pp_r)``."""
        for name, v, n in (("tp_r", tp_r, self.tp), ("dp_r", dp_r, self.dp), ("pp_r", pp_r, self.pp)):
            if not _is_int(v) or not 0 <= v < n:
                raise ValueError(f"{name} = {v!r} is outside range({n})")
        return tp_r + self.tp * (dp_r + self.dp * pp_r)

    def node_of(self, process: int) -> int:
        """Physical node of ``process``."""
        if not _is_int(process) or not 0 <= process < self.world:
            raise ValueError(f"process {process!r} is outside range({self.world})")
        return int(process) // self.ranks_per_node

    def tp_groups(self) -> list[list[int]]:
        """Roles of every TP group, ordered by ``(pp_r, dp_r)`` (Megatron's order)."""
        return [
            [self.role_of(t, d, s) for t in range(self.tp)]
            for s in range(self.pp)
            for d in range(self.dp)
        ]

    def dp_groups(self) -> list[list[int]]:
        """Roles of every DP group (same ``tp_r, pp_r``), ordered by ``(pp_r, tp_r)``."""
        return [
            [self.role_of(t, d, s) for d in range(self.dp)]
            for s in range(self.pp)
            for t in range(self.tp)
        ]

    def pp_groups(self) -> list[list[int]]:
        """Roles of every pipeline (same ``tp_r, dp_r``), ordered by ``(dp_r, tp_r)``."""
        return [
            [self.role_of(t, d, s) for s in range(self.pp)]
            for d in range(self.dp)
            for t in range(self.tp)
        ]


@dataclass(frozen=True)
class TopologyPlan:
    """The planner's answer.

    ``roles[process] = role`` is the permutation to apply (the current one when nothing
    helps). ``moved_processes`` are the processes whose role changes, i.e. those whose
    model and optimizer state must be moved. Times are model predictions, seconds per
    iteration, before and after.
    """

    roles: tuple[int, ...]
    predicted_before_s: float
    predicted_after_s: float
    moved_processes: tuple[int, ...]
    reason: str

    @property
    def changed(self) -> bool:
        """Whether applying the plan changes anything."""
        return bool(self.moved_processes)


# ---------------------------------------------------------------------------------------
# search state: blocks[b] = the processes playing block b's tp ranks, in tp_r order
# ---------------------------------------------------------------------------------------

Blocks = list[tuple[int, ...]]


class _Search:
    """Scoring, moves and candidate builders over the block representation."""

    def __init__(self, layout: Layout, model: IterationModel, budget: int) -> None:
        self.lay = layout
        self.model = model
        self.tp, self.dp, self.pp, self.world = layout.tp, layout.dp, layout.pp, layout.world
        self.n_blocks = layout.dp * layout.pp
        self.rpn = layout.ranks_per_node
        self.factor = [model.factor(p) for p in range(self.world)]
        self.link_nodes = {n for link in model.slow_links if model.slow_links[link] > 0 for n in link}
        self.budget = budget  # model evaluations left for local search
        self.evaluations = 0
        self._memo: dict[tuple[int, ...], float] = {}

    # -- conversions ---------------------------------------------------------------------

    def roles(self, blocks: Blocks) -> tuple[int, ...]:
        roles = [0] * self.world
        tp = self.tp
        for b, procs in enumerate(blocks):
            for t, p in enumerate(procs):
                roles[p] = tp * b + t
        return tuple(roles)

    def blocks_of(self, roles: Sequence[int]) -> Blocks | None:
        """Blocks of ``roles``, or None if some TP group straddles nodes."""
        proc = [0] * self.world
        for p, r in enumerate(roles):
            proc[r] = p
        tp, rpn = self.tp, self.rpn
        blocks = []
        for b in range(self.n_blocks):
            procs = tuple(proc[tp * b + t] for t in range(tp))
            if len({p // rpn for p in procs}) != 1:
                return None
            blocks.append(procs)
        return blocks

    def score(self, blocks: Blocks) -> float:
        roles = self.roles(blocks)
        t = self._memo.get(roles)
        if t is None:
            self.evaluations += 1
            t = self.model.time(roles, checked=True)
            self._memo[roles] = t
        return t

    def stage(self, b: int) -> int:
        return b // self.dp

    def slowness(self, procs: tuple[int, ...]) -> float:
        return max(self.factor[p] for p in procs)

    def dirty(self, procs: tuple[int, ...]) -> bool:
        """Whether moving a block onto/off these processes can change the model's time.

        Swapping two blocks that both sit on healthy GPUs of nodes with no slow link
        changes nothing the model sees (all factors 1, all excesses 0), so such swaps are
        skipped exactly, not heuristically.
        """
        return any(self.factor[p] != 1.0 for p in procs) or (procs[0] // self.rpn) in self.link_nodes

    # -- local search ----------------------------------------------------------------------

    def _moves(self, blocks: Blocks) -> list[tuple[str, int, int, int, int]]:
        moves: list[tuple[str, int, int, int, int]] = []
        dirty = [self.dirty(procs) for procs in blocks]
        n = self.n_blocks
        for i in range(n):
            for j in range(i + 1, n):
                if dirty[i] or dirty[j]:
                    moves.append(("swap", i, j, 0, 0))
        if self.tp > 1:  # regroup processes of one node between two of its TP groups
            rpn, fac = self.rpn, self.factor
            for i in range(n):
                ni = blocks[i][0] // rpn
                for j in range(i + 1, n):
                    if blocks[j][0] // rpn != ni:
                        continue
                    for a, pa in enumerate(blocks[i]):
                        for c, pc in enumerate(blocks[j]):
                            if fac[pa] != fac[pc]:
                                moves.append(("exchange", i, j, a, c))
        return moves

    @staticmethod
    def _apply(blocks: Blocks, move: tuple[str, int, int, int, int]) -> Blocks:
        kind, i, j, a, c = move
        out = list(blocks)
        if kind == "swap":
            out[i], out[j] = blocks[j], blocks[i]
        else:
            bi, bj = list(blocks[i]), list(blocks[j])
            bi[a], bj[c] = bj[c], bi[a]
            out[i], out[j] = tuple(bi), tuple(bj)
        return out

    def climb(self, blocks: Blocks, max_rounds: int) -> tuple[Blocks, float]:
        """Best-improvement pairwise swaps until no move gains more than ``REL_EPS``."""
        t = self.score(blocks)
        for _ in range(max_rounds):
            best_t, best = t, None
            for move in self._moves(blocks):
                if self.budget <= 0:
                    break
                cand = self._apply(blocks, move)
                before = self.evaluations
                ct = self.score(cand)
                self.budget -= self.evaluations - before
                if ct < best_t:
                    best_t, best = ct, cand
            if best is None or best_t >= t * (1.0 - REL_EPS):
                break
            blocks, t = best, best_t
        return blocks, t

    # -- constructive candidates -----------------------------------------------------------

    def _node_slots(self, node_order: Sequence[int]) -> list[tuple[int, ...]]:
        """Aligned TP slots of the given nodes, in that order."""
        slots = []
        for node in node_order:
            lo, hi = node * self.rpn, min((node + 1) * self.rpn, self.world)
            slots.extend(tuple(range(k, k + self.tp)) for k in range(lo, hi, self.tp))
        return slots

    def link_candidates(self) -> list[tuple[str, Blocks]]:
        """Fill blocks pipeline-major along node orders that make slow links adjacent.

        Filling stage after stage of one pipeline along consecutive slots makes node
        boundaries pipeline boundaries; ordering the nodes so that the two ends of a slow
        link come one after the other puts that link on a p2p boundary instead of inside
        a DP ring. The cyclic offset moves where pipelines start relative to the node
        boundaries, so that the slow boundary does not fall between two pipelines.
        """
        links = sorted(
            ((e, k) for k, e in self.model.slow_links.items() if e > 0), key=lambda x: (-x[0], x[1])
        )
        if not links:
            return []
        n_nodes = self.lay.n_nodes
        orders: list[tuple[str, list[int]]] = []
        for _, (a, b) in links[:4]:
            for x, y in ((a, b), (b, a)):
                rest = [n for n in range(n_nodes) if n not in (x, y)]
                orders.append((f"link ({a}, {b}) onto a pipeline boundary", [x, y, *rest]))
        if len(links) > 1:  # one chain through all slow links, strongest first
            adj: dict[int, list[tuple[float, int]]] = {}
            for e, (a, b) in links:
                adj.setdefault(a, []).append((-e, b))
                adj.setdefault(b, []).append((-e, a))
            chain: list[int] = []
            for _, (a, _b) in links:
                node = a
                while node is not None and node not in chain:
                    chain.append(node)
                    nxt = [m for _, m in sorted(adj[node]) if m not in chain]
                    node = nxt[0] if nxt else None
            rest = [n for n in range(n_nodes) if n not in chain]
            orders.append(("all slow links onto pipeline boundaries", chain + rest))
        seq = [d + self.dp * s for d in range(self.dp) for s in range(self.pp)]
        out = []
        for label, order in orders:
            slots = self._node_slots(order)
            for off in range(self.pp):
                blocks: Blocks = [()] * self.n_blocks
                for i, slot in enumerate(slots):
                    blocks[seq[(i + off) % self.n_blocks]] = slot
                out.append((label, blocks))
        return out

    def regroup(self, blocks: Blocks) -> Blocks:
        """Within every node, gather the slowest processes into the same TP groups."""
        if self.tp == 1:
            return list(blocks)
        out = list(blocks)
        by_node: dict[int, list[int]] = {}
        for b, procs in enumerate(blocks):
            by_node.setdefault(procs[0] // self.rpn, []).append(b)
        for bs in by_node.values():
            procs = [p for b in bs for p in blocks[b]]
            if all(self.factor[p] == 1.0 for p in procs):
                continue
            procs.sort(key=lambda p: (-self.factor[p], p))
            chunks = [tuple(sorted(procs[i : i + self.tp])) for i in range(0, len(procs), self.tp)]
            # the block that already sat on the slowest group gets the slowest chunk
            order = sorted(bs, key=lambda b: (-self.slowness(blocks[b]), b))
            for b, chunk in zip(order, chunks):
                kept = [p for p in blocks[b] if p in chunk]
                if len(kept) == self.tp:
                    out[b] = blocks[b]  # same group: keep its tp_r order (no move)
                else:
                    out[b] = chunk
        return out

    def consolidation_candidates(self, base: Blocks, label: str) -> list[tuple[str, Blocks]]:
        """Put the slow TP groups into the fewest stages, interior windows first."""
        grouped = self.regroup(base)
        slow = sorted(
            (b for b, procs in enumerate(grouped) if self.slowness(procs) > 1.0),
            key=lambda b: (-self.slowness(grouped[b]), b),
        )
        if not slow:
            return []
        k = -(-len(slow) // self.dp)
        if k > self.pp:
            return []
        if self.pp > 2 and k <= self.pp - 2:
            starts = list(range(1, self.pp - k))  # interior windows only
        else:
            starts = list(range(0, self.pp - k + 1))
        out = [(f"{label}: slow GPUs regrouped within their nodes", grouped)]
        for start in starts:
            window = range(start, start + k)
            blocks = list(grouped)
            targets = [b for b in range(self.n_blocks) if self.stage(b) in window]
            slow_now = {b for b in slow}
            for b in slow:
                if self.stage(b) in window:
                    continue
                # a target block still on a healthy group takes this slow group
                for t in targets:
                    if t not in slow_now and self.slowness(blocks[t]) <= 1.0:
                        blocks[b], blocks[t] = blocks[t], blocks[b]
                        slow_now.discard(b)
                        slow_now.add(t)
                        break
            stages = f"stage {start}" if k == 1 else f"stages {start}..{start + k - 1}"
            out.append((f"{label}: slow GPUs consolidated into {stages}", blocks))
        return out


def _reason(
    layout: Layout, label: str, before: float, after: float, moved: int, roles: Sequence[int]
) -> str:
    gain = (before - after) / before if before > 0 else 0.0
    return (
        f"{label}: predicted {before:.6g} s -> {after:.6g} s per iteration "
        f"({100 * gain:.1f}% faster), {moved} of {layout.world} processes change role"
    )


def plan_topology(
    layout: Layout,
    current_roles: Sequence[int],
    costs: JobCosts,
    slow_gpus: Mapping[int, float] | None = None,
    slow_links: Mapping[tuple[int, int], float] | None = None,
    *,
    max_rounds: int = 32,
    max_evaluations: int = 20_000,
) -> TopologyPlan:
    """Find a rank permutation that predicts the fastest iteration under the given faults.

    ``current_roles[process] = role`` is the layout in effect (identity for a fresh
    Megatron job); each of its TP groups must lie inside one node. ``slow_gpus``
    (``{process: factor}``) and ``slow_links`` (``{(node_a, node_b): excess s/byte}``) are
    the validator's findings; ``costs`` the healthy measured costs.

    Candidates: the current layout; link reassignments; straggler consolidations (of the
    current layout and of the best link candidate); and best-improvement local search
    (``max_rounds`` rounds of pairwise block swaps and intra-node process exchanges, at
    most ``max_evaluations`` model evaluations in all) from the current layout and the
    three best constructive candidates. The winner is the fastest; among candidates within
    ``REL_EPS`` of it, the one moving fewest processes, then the lexicographically smallest
    roles. If it does not beat the current layout by more than ``REL_EPS`` (relative), the
    current roles come back unchanged.
    """
    if not isinstance(layout, Layout):
        raise ValueError(f"layout must be a Layout, got {type(layout).__name__}")
    for name, v in (("max_rounds", max_rounds), ("max_evaluations", max_evaluations)):
        if not _is_int(v) or v < 0:
            raise ValueError(f"{name} = {v!r} must be an int >= 0")
    model = IterationModel(layout, costs, slow_gpus, slow_links)  # validates costs and faults
    current = check_roles(current_roles, layout.world, "current_roles")
    search = _Search(layout, model, max_evaluations)
    base = search.blocks_of(current)
    if base is None:
        bad = next(
            [p for p in range(layout.world) if current[p] in grp]
            for grp in layout.tp_groups()
            if len({layout.node_of(p) for p in range(layout.world) if current[p] in grp}) > 1
        )
        raise ValueError(
            f"current_roles puts a TP group on processes {bad} of different nodes; "
            "every TP group must stay inside one node"
        )
    before = search.score(base)

    if not any(f != 1.0 for f in model.slow_gpus.values()) and not search.link_nodes:
        return TopologyPlan(current, before, before, (), "no slow GPU or link: nothing to move")

    # 1. constructive candidates, scored once each
    found: list[tuple[float, str, Blocks]] = [(before, "current layout", base)]
    link = search.link_candidates()
    scored_links = sorted(
        ((search.score(b), label, b) for label, b in link), key=lambda x: (x[0], search.roles(x[2]))
    )
    found.extend(scored_links)
    bases = [("current layout", base)]
    if scored_links:
        bases.append((scored_links[0][1], scored_links[0][2]))
    for label, b in bases:
        found.extend((search.score(c), lab, c) for lab, c in search.consolidation_candidates(b, label))

    # 2. local search from the current layout and the three best distinct constructive ones
    starts: list[tuple[str, Blocks]] = [("current layout", base)]
    seen = {search.roles(base)}
    for t, label, b in sorted(found[1:], key=lambda x: (x[0], search.roles(x[2]))):
        r = search.roles(b)
        if r in seen:
            continue
        seen.add(r)
        starts.append((label, b))
        if len(starts) == 4:
            break
    for label, b in starts:
        climbed, t = search.climb(b, max_rounds)
        if search.roles(climbed) != search.roles(b):
            found.append((t, f"{label}, then pairwise swaps", climbed))

    # 3. pick among those that gain more than REL_EPS: fastest; near-ties -> fewest moved,
    #    then smallest roles (determinism)
    gaining = [x for x in found if x[0] < before * (1.0 - REL_EPS)]
    if not gaining:
        return TopologyPlan(
            current,
            before,
            before,
            (),
            f"no permutation predicts more than {100 * REL_EPS:.1f}% gain over the current "
            f"layout ({before:.6g} s per iteration): nothing to move",
        )
    best_t = min(t for t, _, _ in gaining)

    def key(item: tuple[float, str, Blocks]) -> tuple[int, tuple[int, ...]]:
        roles = search.roles(item[2])
        return sum(1 for p in range(layout.world) if roles[p] != current[p]), roles

    near = [x for x in gaining if x[0] <= best_t * (1.0 + REL_EPS)]
    t, label, blocks = min(near, key=key)
    roles = search.roles(blocks)
    moved = tuple(p for p in range(layout.world) if roles[p] != current[p])
    return TopologyPlan(roles, before, t, moved, _reason(layout, label, before, t, len(moved), roles))
