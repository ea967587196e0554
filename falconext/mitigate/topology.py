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
:mod:`falconext.model.itertime` (a discrete-event 1F1B pipeline plus ring all-reduces),
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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from falconext.integers import is_int
from falconext.model.itertime import IterationModel, JobCosts
from falconext.model.roles import check_roles

__all__ = ["Layout", "TopologyPlan", "plan_topology", "rank0_on_first_node"]

#: Relative improvement below which a change is not worth moving model state for.
REL_EPS = 1e-3


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
            if not is_int(v) or v < 1:
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
        if not is_int(role) or not 0 <= role < self.world:
            raise ValueError(f"role {role!r} is outside range({self.world})")
        return int(role)

    def role_coords(self, role: int) -> tuple[int, int, int]:
        """``(tp_r, dp_r, pp_r)`` of ``role``."""
        r = self._check_role(role)
        return r % self.tp, (r // self.tp) % self.dp, r // (self.tp * self.dp)

    def role_of(self, tp_r: int, dp_r: int, pp_r: int) -> int:
        """The role with coordinates ``(tp_r, dp_r, pp_r)``."""
        for name, v, n in (("tp_r", tp_r, self.tp), ("dp_r", dp_r, self.dp), ("pp_r", pp_r, self.pp)):
            if not is_int(v) or not 0 <= v < n:
                raise ValueError(f"{name} = {v!r} is outside range({n})")
        return tp_r + self.tp * (dp_r + self.dp * pp_r)

    def node_of(self, process: int) -> int:
        """Physical node of ``process``."""
        if not is_int(process) or not 0 <= process < self.world:
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
# search state: proc[tp * b + i] = the process playing tp_r i of block b (block b is the
# TP group of roles with dp_r + dp * pp_r == b). Swapping two blocks swaps two slices.
# ---------------------------------------------------------------------------------------

Move = tuple[int, int, int, int]  # (i, j, -1, -1): swap blocks i, j; (i, j, a, c): exchange


class _Search:
    """Scoring, moves and candidate builders over the block representation."""

    def __init__(self, layout: Layout, model: IterationModel, budget: int) -> None:
        self.lay = layout
        self.model = model
        self.tp, self.dp, self.pp, self.world = layout.tp, layout.dp, layout.pp, layout.world
        self.n_blocks = layout.dp * layout.pp
        self.rpn = layout.ranks_per_node
        self.factor = [model.factor(p) for p in range(self.world)]
        self.link_nodes = {n for link, e in model.slow_links.items() if e > 0 for n in link}
        self.budget = budget  # model evaluations left for local search
        self._memo: dict[bytes, float] = {}

    # -- conversions ---------------------------------------------------------------------

    def roles(self, proc: np.ndarray) -> tuple[int, ...]:
        roles = np.empty(self.world, dtype=np.intp)
        roles[proc] = np.arange(self.world)
        return tuple(roles.tolist())

    def proc_of(self, roles: Sequence[int]) -> np.ndarray | None:
        """``proc[role] = process`` of ``roles``, or None if a TP group straddles nodes."""
        proc = np.empty(self.world, dtype=np.intp)
        proc[np.asarray(roles, dtype=np.intp)] = np.arange(self.world)
        nodes = (proc // self.rpn).reshape(self.n_blocks, self.tp)
        if np.any(nodes != nodes[:, :1]):
            return None
        return proc

    def block(self, proc: np.ndarray, b: int) -> list[int]:
        return proc[self.tp * b : self.tp * (b + 1)].tolist()

    def score(self, proc: np.ndarray) -> float:
        key = proc.tobytes()
        t = self._memo.get(key)
        if t is None:
            t = self.model.time_of_processes(proc)
            self._memo[key] = t
            self.budget -= 1
        return t

    def stage(self, b: int) -> int:
        return b // self.dp

    def slowness(self, procs: Sequence[int]) -> float:
        return max(self.factor[p] for p in procs)

    def dirty(self, procs: Sequence[int]) -> bool:
        """Whether moving a block onto/off these processes can change the model's time.

        Swapping two blocks that both sit on healthy GPUs of nodes with no slow link
        changes nothing the model sees (all factors 1, all excesses 0), so such swaps are
        skipped exactly, not heuristically.
        """
        return any(self.factor[p] != 1.0 for p in procs) or (procs[0] // self.rpn) in self.link_nodes

    # -- local search ----------------------------------------------------------------------

    def _moves(self, proc: np.ndarray) -> list[Move]:
        n, tp, rpn, fac = self.n_blocks, self.tp, self.rpn, self.factor
        blocks = [self.block(proc, b) for b in range(n)]
        dirty = [self.dirty(procs) for procs in blocks]
        moves: list[Move] = [
            (i, j, -1, -1) for i in range(n) for j in range(i + 1, n) if dirty[i] or dirty[j]
        ]
        if tp > 1:  # regroup processes of one node between two of its TP groups
            for i in range(n):
                ni = blocks[i][0] // rpn
                for j in range(i + 1, n):
                    if blocks[j][0] // rpn != ni:
                        continue
                    for a, pa in enumerate(blocks[i]):
                        for c, pc in enumerate(blocks[j]):
                            if fac[pa] != fac[pc]:
                                moves.append((i, j, a, c))
        return moves

    def _apply(self, proc: np.ndarray, move: Move) -> None:
        """Apply ``move`` in place (every move is its own inverse)."""
        i, j, a, c = move
        tp = self.tp
        if a < 0:
            tmp = proc[tp * i : tp * (i + 1)].copy()
            proc[tp * i : tp * (i + 1)] = proc[tp * j : tp * (j + 1)]
            proc[tp * j : tp * (j + 1)] = tmp
        else:
            x, y = tp * i + a, tp * j + c
            proc[x], proc[y] = proc[y], proc[x]

    def climb(self, proc: np.ndarray, max_rounds: int) -> tuple[np.ndarray, float]:
        """Best-improvement pairwise moves until none gains more than ``REL_EPS``."""
        proc = proc.copy()
        t = self.score(proc)
        for _ in range(max_rounds):
            best_t, best = t, None
            for move in self._moves(proc):
                if self.budget <= 0:
                    break
                self._apply(proc, move)
                ct = self.score(proc)
                self._apply(proc, move)
                if ct < best_t:
                    best_t, best = ct, move
            if best is None or best_t >= t * (1.0 - REL_EPS):
                break
            self._apply(proc, best)
            t = best_t
        return proc, t

    # -- constructive candidates -----------------------------------------------------------

    def _node_slots(self, node_order: Sequence[int]) -> list[range]:
        """Aligned TP slots of the given nodes, in that order."""
        slots = []
        for node in node_order:
            lo, hi = node * self.rpn, min((node + 1) * self.rpn, self.world)
            slots.extend(range(k, k + self.tp) for k in range(lo, hi, self.tp))
        return slots

    def link_candidates(self, stage_major: bool = False) -> list[tuple[str, np.ndarray]]:
        """Fill blocks pipeline-major along node orders that make slow links adjacent.

        Filling stage after stage of one pipeline along consecutive slots makes node
        boundaries pipeline boundaries; ordering the nodes so that the two ends of a slow
        link come one after the other puts that link on a p2p boundary instead of inside
        a DP ring. The cyclic offset moves where pipelines start relative to the node
        boundaries, so that the slow boundary does not fall between two pipelines.

        ``stage_major``: fill replica after replica of one stage instead (offsets by whole
        stages). When a node holds more blocks than a pipeline has stages, pipeline-major
        filling puts whole pipelines on each node and every DP ring then spans the node
        boundary whatever the offset (two nodes of TP2 x DP4 x PP2: each ring crosses the
        slow link, and the planner used to answer "nothing to move" although Megatron's
        own stage-per-node order is 3x faster). Stage-major filling keeps each stage's DP
        ring on as few nodes as possible and puts the slow boundary between two stages.
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
                orders.append((f"link ({a}, {b}) moved onto a pipeline boundary", [x, y, *rest]))
        if len(links) > 1:  # one chain through all slow links, strongest first
            adj: dict[int, list[tuple[float, int]]] = {}
            for e, (a, b) in links:
                adj.setdefault(a, []).append((-e, b))
                adj.setdefault(b, []).append((-e, a))
            chain: list[int] = []
            for _, (a, _b) in links:
                node: int | None = a
                while node is not None and node not in chain:
                    chain.append(node)
                    nxt = [m for _, m in sorted(adj[node]) if m not in chain]
                    node = nxt[0] if nxt else None
            rest = [n for n in range(n_nodes) if n not in chain]
            orders.append(("all slow links moved onto pipeline boundaries", chain + rest))
        if stage_major:
            seq, offsets = list(range(self.n_blocks)), range(0, self.n_blocks, self.dp)
        else:
            seq, offsets = [d + self.dp * s for d in range(self.dp) for s in range(self.pp)], range(self.pp)
        out = []
        for label, order in orders:
            slots = self._node_slots(order)
            for off in offsets:
                proc = np.empty(self.world, dtype=np.intp)
                for i, slot in enumerate(slots):
                    b = seq[(i + off) % self.n_blocks]
                    proc[self.tp * b : self.tp * (b + 1)] = slot
                out.append((label, proc))
        return out

    def regroup(self, proc: np.ndarray) -> np.ndarray:
        """Within every node, gather the slowest processes into the same TP groups."""
        out = proc.copy()
        if self.tp == 1:
            return out
        tp = self.tp
        by_node: dict[int, list[int]] = {}
        for b in range(self.n_blocks):
            by_node.setdefault(int(proc[tp * b]) // self.rpn, []).append(b)
        for bs in by_node.values():
            procs = [p for b in bs for p in self.block(proc, b)]
            if all(self.factor[p] == 1.0 for p in procs):
                continue
            procs.sort(key=lambda p: (-self.factor[p], p))
            chunks = [sorted(procs[i : i + tp]) for i in range(0, len(procs), tp)]
            # the block that already sat on the slowest group gets the slowest chunk
            order = sorted(bs, key=lambda b: (-self.slowness(self.block(proc, b)), b))
            for b, chunk in zip(order, chunks):
                if sorted(self.block(proc, b)) != chunk:  # same group: keep its tp_r order
                    out[tp * b : tp * (b + 1)] = chunk
        return out

    def consolidation_candidates(self, base: np.ndarray, label: str) -> list[tuple[str, np.ndarray]]:
        """Put the slow TP groups into the fewest stages, interior windows first."""
        grouped = self.regroup(base)
        slow = sorted(
            (b for b in range(self.n_blocks) if self.slowness(self.block(grouped, b)) > 1.0),
            key=lambda b: (-self.slowness(self.block(grouped, b)), b),
        )
        if not slow:
            return []
        k = -(-len(slow) // self.dp)
        if self.pp > 2 and k <= self.pp - 2:
            starts = list(range(1, self.pp - k))  # interior windows only
        else:
            starts = list(range(0, self.pp - k + 1))
        out = [(f"{label}, slow GPUs regrouped within their nodes", grouped)]
        for start in starts:
            window = range(start, start + k)
            proc = grouped.copy()
            for b in slow:
                if self.stage(b) in window:
                    continue
                # a target-stage block still on healthy GPUs takes this slow group
                for t in range(start * self.dp, (start + k) * self.dp):
                    if self.slowness(self.block(proc, t)) <= 1.0:
                        self._apply(proc, (b, t, -1, -1))
                        break
            stages = f"stage {start}" if k == 1 else f"stages {start}..{start + k - 1}"
            out.append((f"{label}, slow GPUs consolidated into {stages}", proc))
        return out


def _link_traffic(layout: Layout, roles: Sequence[int], a: int, b: int) -> str:
    """What a link between nodes ``a`` and ``b`` carries under ``roles``: DP, PP or none."""
    proc = [0] * layout.world
    for p, r in enumerate(roles):
        proc[r] = p
    kinds = []
    for kind, groups, ring in (("DP", layout.dp_groups(), True), ("PP", layout.pp_groups(), False)):
        for g in groups:
            nodes = [layout.node_of(proc[r]) for r in g]
            pairs = list(zip(nodes, nodes[1:] + nodes[:1] if ring else nodes[1:]))
            if (a, b) in pairs or (b, a) in pairs:
                kinds.append(kind)
                break
    return "+".join(kinds) or "nothing"


def _reason(
    layout: Layout, label: str, before: float, after: float, moved: int,
    current: Sequence[int], roles: Sequence[int], model: IterationModel,
) -> str:
    """One line for the operator: what won, the predicted gain, and where the faults sit."""
    gain = (before - after) / before if before > 0 else 0.0
    parts = [
        f"{label}: predicted {before:.6g} s -> {after:.6g} s per iteration "
        f"({100 * gain:.1f}% faster), {moved} of {layout.world} processes change role"
    ]
    slow = sorted(p for p, f in model.slow_gpus.items() if f > 1.0)
    if slow:

        def stages(rs: Sequence[int]) -> list[int]:
            return sorted({layout.role_coords(rs[p])[2] for p in slow})

        parts.append(f"slow GPUs {slow} in stages {stages(current)} -> {stages(roles)}")
    for (a, b), e in sorted(model.slow_links.items()):
        if e > 0:
            parts.append(
                f"link ({a}, {b}) carries {_link_traffic(layout, current, a, b)} -> "
                f"{_link_traffic(layout, roles, a, b)}"
            )
    return "; ".join(parts)


def check_tp_in_nodes(roles: Sequence[int], tp: int, ranks_per_node: int, where: str = "roles") -> None:
    """Each TP group (torch ranks tp*k .. tp*k+tp-1) must be played by processes of one
    node: TP traffic is the heaviest and only intra-node links carry it well."""
    process_of = {role: proc for proc, role in enumerate(roles)}
    for start in range(0, len(roles), tp):
        members = [process_of[r] for r in range(start, start + tp)]
        nodes = sorted({p // ranks_per_node for p in members})
        if len(nodes) > 1:
            raise ValueError(f"{where}: TP group of ranks {start}..{start + tp - 1} would be played by processes "
                             f"{members} on nodes {nodes}; a TP group must stay inside one node")


def rank0_on_first_node(roles: Sequence[int], tp: int, dp: int, ranks_per_node: int) -> list[int] | None:
    """``roles`` relabelled, if need be, so that torch rank 0 is played by a process of node 0,
    doing the same work: in a job of several launchers the workers' store is served by rank
    0's process at the address of the node whose agent is first in the rendezvous (node 0),
    so rank 0 cannot move to another node. The relabelling swaps two DP replica indices
    and two TP indices everywhere (Megatron's order ``role = tp_r + tp * (dp_r + dp * pp_r)``),
    which leaves every pipeline, stage and TP group where the plan put it, on the same
    processes. Returns ``roles`` itself when rank 0 is already on node 0, and None when no
    process of node 0 plays a first-stage role (then no relabelling can help). Pure."""
    roles = list(roles)
    if not roles or roles.index(0) // ranks_per_node == 0:
        return roles
    for proc in range(min(ranks_per_node, len(roles))):
        role = roles[proc]
        t, d, stage = role % tp, (role // tp) % dp, role // (tp * dp)
        if stage != 0:
            continue

        def swap(x: int, a: int, b: int) -> int:
            return b if x == a else a if x == b else x

        return [swap(r % tp, t, 0) + tp * (swap((r // tp) % dp, d, 0) + dp * (r // (tp * dp))) for r in roles]
    return None


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
    best constructive candidate of each kind. The winner is the fastest; among candidates within
    ``REL_EPS`` of it, the one moving fewest processes, then the lexicographically smallest
    roles. If it does not beat the current layout by more than ``REL_EPS`` (relative), the
    current roles come back unchanged.
    """
    if not isinstance(layout, Layout):
        raise ValueError(f"layout must be a Layout, got {type(layout).__name__}")
    for name, v in (("max_rounds", max_rounds), ("max_evaluations", max_evaluations)):
        if not is_int(v) or v < 0:
            raise ValueError(f"{name} = {v!r} must be an int >= 0")
    model = IterationModel(layout, costs, slow_gpus, slow_links)  # validates costs and faults
    current = check_roles(current_roles, layout.world, "current_roles")
    search = _Search(layout, model, max_evaluations)
    base = search.proc_of(current)
    if base is None:
        check_tp_in_nodes(current, layout.tp, layout.ranks_per_node, "current_roles")
    assert base is not None
    before = search.score(base)

    if not any(f != 1.0 for f in model.slow_gpus.values()) and not search.link_nodes:
        return TopologyPlan(current, before, before, (), "no slow GPU or link: nothing to move")

    # 1. constructive candidates, scored once each
    found: list[tuple[float, str, np.ndarray]] = [(before, "current layout", base)]
    link = sorted(
        ((search.score(p), label, p) for label, p in search.link_candidates()),
        key=lambda x: (x[0], search.roles(x[2])),
    )
    bases = [("current layout", base)] + [(label, p) for _, label, p in link[:1]]
    consolidated = sorted(
        (
            (search.score(c), lab, c)
            for label, p in bases
            for lab, c in search.consolidation_candidates(p, label)
        ),
        key=lambda x: (x[0], search.roles(x[2])),
    )
    found += link + consolidated

    # 2. local search from the current layout and the best candidate of each kind (the
    #    others mostly climb to the same optima, and each climb costs rounds of swaps)
    starts: list[tuple[str, np.ndarray]] = [("current layout", base)]
    seen = {search.roles(base)}
    for kind in (link, consolidated):
        if kind and search.roles(kind[0][2]) not in seen:
            seen.add(search.roles(kind[0][2]))
            starts.append((kind[0][1], kind[0][2]))
    for label, p in starts:
        climbed, t = search.climb(p, max_rounds)
        if not np.array_equal(climbed, p):
            found.append((t, f"{label}, then pairwise swaps", climbed))

    # 2b. stage-major link candidates and a climb from their best, after everything above
    #     so that they only add to it (same evaluations and climbs as without them first)
    if search.lay.dp > 1:  # with dp = 1 both fills are the same
        stage_link = sorted(
            ((search.score(p), label, p) for label, p in search.link_candidates(stage_major=True)),
            key=lambda x: (x[0], search.roles(x[2])),
        )
        found += stage_link
        if stage_link and search.roles(stage_link[0][2]) not in seen:
            _, label, p = stage_link[0]
            climbed, t = search.climb(p, max_rounds)
            if not np.array_equal(climbed, p):
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

    def key(item: tuple[float, str, np.ndarray]) -> tuple[int, tuple[int, ...]]:
        roles = search.roles(item[2])
        return sum(1 for p in range(layout.world) if roles[p] != current[p]), roles

    near = [x for x in gaining if x[0] <= best_t * (1.0 + REL_EPS)]
    t, label, proc = min(near, key=key)
    roles = search.roles(proc)
    moved = tuple(p for p in range(layout.world) if roles[p] != current[p])
    reason = _reason(layout, label, before, t, len(moved), current, roles, model)
    return TopologyPlan(roles, before, t, moved, reason)
