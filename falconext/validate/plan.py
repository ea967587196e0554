"""What to validate after profiling: which ranks run the GEMM, which links get P2P passes.

Only suspects are validated, but a verdict needs a reference: the GEMM runs on every
rank of each compute suspect's groups, and links are tested for every group of a
suspicious group's role (groups of one role are disjoint, so they share passes and
cost nothing extra). Computation and communication are decided separately: with no
compute suspect every rank runs the GEMM, with no suspicious group every role's links
are tested (a link inside the only group of its kind has nothing to be compared with
during profiling). Either way a constant number of passes per role. Pure.

Across nodes NCCL runs all-reduces of small and medium messages as double binary trees
over the nodes, so a congested network link may carry tree traffic only, between nodes
that are not neighbours in any group's ring. Where :func:`trees_apply` says so (the
``validation_trees`` setting; the job's fabric and ``NCCL_ALGO`` as its ranks report
them; the group spanning nodes) a group's passes cover the edges of NCCL's two trees over
its nodes as well as its ring: over the first rank of the group on each node, nodes in
the order of their first rank in the group, as NCCL numbers them
(:func:`falconext.validate.passes.double_tree_passes`, at most 6 passes more; an edge
the ring already measures is not measured twice).

On the bus (:func:`split_plan`) the plan is cut in two, so that no message grows with the
world: a :class:`ValidationPlan` every rank needs alike (sizes, round counts) goes with
the suspend command, and each rank's own work (its GEMM round, its P2P pairs by round)
in :class:`ValidationShare` messages for blocks of consecutive ranks, each under the
bus's cap. A rank reads its work back with :func:`rank_work`; rounds are numbered as the
whole plan's were, so every rank runs exactly the pairs and barriers it ran before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from falconext.protocol.codec import MAX_MESSAGE_BYTES, encode
from falconext.protocol.commands import Share, ValidationPlan, ValidationShare
from falconext.validate.passes import double_tree_passes, merge_passes, one_per_link, ring_passes, split_rounds, without

#: roles whose groups partition the ranks: their rings carry the job's traffic
LINK_ROLES = ("tp", "cp", "ep", "dp", "pp")
#: values of FalconConfig.validation_trees
TREE_SETTINGS = ("auto", "on", "off")
#: NCCL algorithms whose traffic between nodes follows the double binary tree
TREE_ALGORITHMS = frozenset({"tree", "nvlstree"})


def nccl_allows_trees(nccl_algo: str | None) -> bool:
    """Whether NCCL may run all-reduces as trees under ``NCCL_ALGO`` = ``nccl_algo``
    (None or blank: unset, NCCL picks, trees included).

    NCCL reads a comma list of algorithms, case-insensitive (``Tree,Ring``), a list that
    starts with ``^`` naming the ones to leave out (``^Ring``: trees stay), and since 2.24
    ``;``-separated lists for one function each (``ring;allreduce:tree,ring``: the list
    without a function applies to the functions not named). Trees serve all-reduces, so
    the list that applies to ``allreduce`` decides: trees may run when it includes Tree or
    NVLSTree (NVLink SHARP inside a node, the tree between nodes), or leaves one of them in
    (``^tree`` leaves NVLSTree, which runs where the nodes have NVSwitch SHARP; ``^tree,
    nvlstree`` rules trees out)."""
    if nccl_algo is None or not nccl_algo.strip():
        return True
    applies: str | None = None
    for entry in nccl_algo.split(";"):
        function, sep, algos = entry.rpartition(":")
        function = function.strip().lower()
        if not sep or function == "allreduce":
            if function or applies is None:
                applies = algos
    if applies is None:  # only other functions named: all-reduces keep the default
        return True
    listed = applies.strip()
    leave_out = listed.startswith("^")
    names = {a.strip().lower() for a in listed.lstrip("^").split(",") if a.strip()}
    return not TREE_ALGORITHMS <= names if leave_out else bool(TREE_ALGORITHMS & names)


def on_nccl(fabric: str) -> bool:
    """Whether ``fabric`` (the job's torch.distributed backend, e.g. ``nccl``, ``gloo`` or
    ``cpu:gloo,cuda:nccl``, or its device, ``cuda``) runs collectives on NCCL."""
    words = fabric.lower().replace(",", " ").replace(":", " ").split()
    return "nccl" in words or "cuda" in words


def trees_apply(setting: str, fabric: str, nccl_algo: str | None, nodes: int) -> bool:
    """Whether a group on ``nodes`` nodes gets its tree edges validated: never within one
    node (NCCL's trees join nodes; inside a node it chains ranks, which the ring measures);
    ``on`` always across nodes (the CPU test bed, whose gloo runs rings, tests trees so);
    ``off`` never; ``auto`` when the collectives run on NCCL (``fabric``) and ``NCCL_ALGO``
    lets all-reduces run as trees (:func:`nccl_allows_trees`). Pure: the caller reads the
    environment."""
    if setting not in TREE_SETTINGS:
        raise ValueError(f"validation_trees must be one of {', '.join(TREE_SETTINGS)}, got {setting!r}")
    if nodes < 2 or setting == "off":
        return False
    return setting == "on" or (on_nccl(fabric) and nccl_allows_trees(nccl_algo))


def node_heads(members: Sequence[int], node_of: Mapping[int, int]) -> list[int]:
    """The first of ``members`` (in group order) on each node, nodes in the order of their
    first member: the ranks NCCL's trees over the group's nodes join (ranks without a
    node are left out)."""
    heads: dict[int, int] = {}
    for r in members:
        node = node_of.get(r)
        if node is not None and node not in heads:
            heads[node] = r
    return list(heads.values())


def validation_plan(
    groups: Mapping[str, tuple[str, Sequence[int]]],
    world: Sequence[int],
    compute_suspects: Sequence[int] = (),
    suspicious: Sequence[str] = (),
    *,
    gemm_n: int = 256,
    gemm_repeats: int = 10,
    gemm_concurrency: int = 0,
    validation_sweeps: int = 1,
    p2p_concurrency: int = 0,
    p2p_bytes: int = 262144,
    p2p_repeats: int = 5,
    node_of: Mapping[int, int] | None = None,
    trees: str = "off",
    fabric: str = "",
    nccl_algo: str | None = None,
) -> dict[str, Any]:
    """The plan sent to every rank with the suspend command (plain JSON data).

    ``groups`` maps group id -> (role, members in group order). With ``node_of`` (rank ->
    node), no two transfers of a pass share an inter-node link the same way
    (:func:`falconext.validate.passes.one_per_link`), and a group whose members span nodes
    gets its double binary trees' edges validated after its ring's where
    ``trees_apply(trees, fabric, nccl_algo, nodes)`` (``plan["trees"]``: those groups).
    """
    unknown = [g for g in suspicious if g not in groups]
    if unknown:
        raise ValueError(f"suspicious group(s) not in the layout: {', '.join(unknown)}")
    ranks = set(world)
    bad = sorted(set(compute_suspects) - ranks)
    if bad:
        raise ValueError(f"compute suspect(s) {bad} are not ranks of this job")
    linked = {g: (role, list(m)) for g, (role, m) in groups.items() if role in LINK_ROLES and len(m) >= 2}
    # computation and communication are judged separately: a compute suspect must not
    # keep the links of a job without suspicious groups from being tested, or vice versa
    compute_groups = [m for _, (_, m) in linked.items() if any(r in m for r in compute_suspects)]
    if compute_suspects:
        gemm = set(compute_suspects).union(*compute_groups)
    else:
        gemm = set(ranks)
    sus_roles = {groups[g][0] for g in suspicious if groups[g][0] in LINK_ROLES}
    roles = sorted(sus_roles) if sus_roles else sorted({role for role, _ in linked.values()})
    scope = "suspects" if compute_suspects or sus_roles else "all"
    passes: list[list[list[int]]] = []
    treed: list[str] = []
    for role in roles:
        schedules = []
        for g, (r, m) in sorted(linked.items()):
            if r != role:
                continue
            schedule = ring_passes(m)
            heads = node_heads(m, node_of) if node_of is not None else []
            if trees_apply(trees, fabric, nccl_algo, len(heads)):
                ring = [pair for p in schedule for pair in p]
                schedule = schedule + without(double_tree_passes(heads), ring)
                treed.append(g)
            schedules.append(schedule)
        merged = merge_passes(schedules)
        if node_of is not None:
            merged = one_per_link(merged, node_of)
        passes.extend([[list(p) for p in pas] for pas in merged])
    return {
        "scope": scope,
        "gemm": sorted(gemm),
        "gemm_n": gemm_n,
        "gemm_repeats": gemm_repeats,
        "gemm_concurrency": gemm_concurrency,
        "validation_sweeps": validation_sweeps,
        "passes": passes,
        "roles": roles,
        "trees": treed,
        "nbytes": p2p_bytes,
        "repeats": p2p_repeats,
        "p2p_concurrency": p2p_concurrency,
    }


def split_plan(plan: Mapping[str, Any], ranks: Sequence[int],
               max_bytes: int = MAX_MESSAGE_BYTES) -> tuple[ValidationPlan, list[ValidationShare]]:
    """``plan`` (from :func:`validation_plan`) as it travels: what every rank needs alike,
    and the shares of blocks of consecutive ``ranks`` (all of them covered), each of which
    encodes, inside a :class:`Share` command, to at most ``max_bytes``.

    GEMM round of the i-th GEMM rank (in rank order): i // gemm_concurrency (0: one round);
    P2P rounds: the passes cut by ``p2p_concurrency`` (:func:`split_rounds`), in order.
    """
    gemm = sorted(int(r) for r in plan.get("gemm", []))
    conc = int(plan.get("gemm_concurrency", 0)) or len(gemm) or 1
    rounds = split_rounds([[(int(a), int(b)) for a, b in p] for p in plan.get("passes", [])],
                          int(plan.get("p2p_concurrency", 0)))
    common = ValidationPlan(
        scope=str(plan.get("scope", "")), roles=[str(r) for r in plan.get("roles", [])],
        gemm_n=int(plan.get("gemm_n", 256)), gemm_repeats=int(plan.get("gemm_repeats", 10)),
        gemm_rounds=-(-len(gemm) // conc), validation_sweeps=int(plan.get("validation_sweeps", 1)),
        nbytes=int(plan.get("nbytes", 262144)), repeats=int(plan.get("repeats", 5)),
        p2p_rounds=len(rounds),
    )
    gemm_round = {r: i // conc for i, r in enumerate(gemm)}
    at_once = _shares_at_once(rounds, gemm_round, ranks, max_bytes)
    if at_once is not None:
        return common, at_once
    pairs_of: dict[int, list[list[int]]] = {}
    # an upper bound of the JSON each rank adds: its GEMM row and every pair it is in (a
    # pair's row counted once per end, worked out once)
    need_of: dict[int, int] = {}
    for k, rnd in enumerate(rounds):
        for src, dst in rnd:
            row = [k, src, dst]
            pairs_of.setdefault(src, []).append(row)
            pairs_of.setdefault(dst, []).append(row)
            size = len(str(k)) + len(str(src)) + len(str(dst)) + 5
            need_of[src] = need_of.get(src, 0) + size
            need_of[dst] = need_of.get(dst, 0) + size
    everyone = sorted(set(map(int, ranks)) | set(gemm_round) | set(pairs_of))
    budget = max(1024, max_bytes - 1024)  # the envelope and the Share command around the share
    shares: list[ValidationShare] = []
    block: list[int] = []
    size = 0
    for r in everyone:
        need = 3 * (len(str(r)) + 1) + 3 + need_of.get(r, 0)
        if block and size + need > budget:
            shares += _shares(block, gemm_round, pairs_of, max_bytes)
            block, size = [], 0
        block.append(r)
        size += need
    if block:
        shares += _shares(block, gemm_round, pairs_of, max_bytes)
    return common, shares


#: 10, 100, ... up to the largest int64 power of ten: a whole number's digits by search
_POW10 = np.array([10**k for k in range(1, 19)], dtype=np.int64)


def _digits(x: np.ndarray) -> np.ndarray:
    """``len(str(v))`` of each whole number ``v`` of ``x`` (int64 >= 0)."""
    return np.searchsorted(_POW10, x, side="right") + 1


def _shares_at_once(rounds: list[list[tuple[int, int]]], gemm_round: Mapping[int, int], ranks: Sequence[int],
                    max_bytes: int) -> list[ValidationShare] | None:
    """:func:`split_plan`'s shares worked out over arrays (a 131,072-rank validation has
    262,144 pairs: 0.7 s a pair at a time): exactly the loop's blocks, rows and order;
    None when anything is in doubt (a rank below 0 or past 2**62, or a block whose share
    is over ``max_bytes``: the loop's way then)."""
    k = np.fromiter((i for i, rnd in enumerate(rounds) for _ in rnd), dtype=np.int64)
    try:
        ends = np.array([p for rnd in rounds for p in rnd], dtype=np.int64).reshape(len(k), 2)
        listed = np.array(sorted(set(map(int, ranks)) | set(gemm_round)), dtype=np.int64)
    except OverflowError:
        return None
    if (len(ends) and (ends.min() < 0 or ends.max() > 2**62)) or (len(listed) and (listed.min() < 0 or listed.max() > 2**62)):
        return None
    everyone = np.union1d(listed, ends.ravel())
    if not len(everyone):
        return []
    # each rank's bound of the JSON it adds (split_plan's loop): its rows and every pair it is in
    size = _digits(k) + _digits(ends[:, 0]) + _digits(ends[:, 1]) + 5
    pos = np.searchsorted(everyone, ends)  # (n, 2): each end's place among everyone
    need = 3 * (_digits(everyone) + 1) + 3 + np.bincount(pos.ravel(), weights=np.repeat(size, 2),
                                                           minlength=len(everyone)).astype(np.int64)
    budget = max(1024, max_bytes - 1024)
    block_of = np.empty(len(everyone), dtype=np.int64)
    b, used = 0, 0
    for i, n in enumerate(need.tolist()):  # the loop's greedy blocks
        if used and used + n > budget:
            b, used = b + 1, 0
        block_of[i] = b
        used += n
    # the rows each block lists: its ranks in order, each rank's pairs in round order, once
    pair_id = np.repeat(np.arange(len(k)), 2)
    at = pos.ravel()
    order = np.lexsort((pair_id, at))
    # a pair listed twice (the same round, source and destination) is one row
    table = np.column_stack([k, ends])
    width = int(ends.max()) + 1 if len(k) else 1
    if len(k) and (int(k.max()) + 1) * width * width >= 2**62:  # too wide for one number per row
        _, same = np.unique(table, axis=0, return_inverse=True)
    else:
        _, same = np.unique((k * width + ends[:, 0]) * width + ends[:, 1], return_inverse=True)
    same = np.repeat(same.ravel(), 2)
    key = block_of[at[order]] * max(1, len(k)) + same[order]
    _, first = np.unique(key, return_index=True)
    keep = order[np.sort(first)]
    kept = table[pair_id[keep]]
    rows = kept.tolist()
    row_block = block_of[at[keep]]
    cuts = np.searchsorted(row_block, np.arange(b + 2)).tolist()
    # each block's rows' JSON length, "[k,s,d]" joined by commas (the share's size without
    # encoding it: an envelope with no rows, plus these)
    row_len = np.cumsum(np.r_[0, _digits(kept[:, 0]) + _digits(kept[:, 1]) + _digits(kept[:, 2]) + 5]).tolist()
    bounds = np.searchsorted(block_of, np.arange(b + 2)).tolist()
    members = everyone.tolist()
    shares = []
    for j in range(b + 1):
        block = members[bounds[j]:bounds[j + 1]]
        runs = _gemm_runs(block, gemm_round)
        lo, hi = cuts[j], cuts[j + 1]
        share = ValidationShare(block[0], block[-1], runs, rows[lo:hi])
        if len(block) > 1:
            bare = len(encode(Share(2**62, ValidationShare(block[0], block[-1], runs, []))))
            if bare + max(0, row_len[hi] - row_len[lo] - 1) > max_bytes:
                return None  # halved the loop's way
        shares.append(share)
    return shares


def _gemm_runs(block: list[int], gemm_round: Mapping[int, int]) -> list[list[int]]:
    """The GEMM rows of ``block`` (consecutive ranks): runs ``[first, last, round]`` of
    consecutive GEMM ranks of one round."""
    runs: list[list[int]] = []
    for r in block:
        k = gemm_round.get(r)
        if k is None:
            continue
        if runs and runs[-1][1] == r - 1 and runs[-1][2] == k:
            runs[-1][1] = r
        else:
            runs.append([r, r, k])
    return runs


def _shares(block: list[int], gemm_round: Mapping[int, int], pairs_of: Mapping[int, list[list[int]]],
            max_bytes: int) -> list[ValidationShare]:
    """The share of ``block`` (consecutive ranks), halved until each fits ``max_bytes``.
    Its GEMM rows are :func:`_gemm_runs`."""
    runs = _gemm_runs(block, gemm_round)
    seen: set[tuple[int, int, int]] = set()
    pairs = []
    for r in block:
        for row in pairs_of.get(r, []):
            key = (row[0], row[1], row[2])
            if key not in seen:
                seen.add(key)
                pairs.append(row)
    share = ValidationShare(block[0], block[-1], runs, pairs)
    if len(block) > 1 and len(encode(Share(2**62, share))) > max_bytes:
        half = len(block) // 2
        return _shares(block[:half], gemm_round, pairs_of, max_bytes) + _shares(block[half:], gemm_round, pairs_of,
                                                                                  max_bytes)
    return [share]


@dataclass(frozen=True)
class RankWork:
    """One rank's part of a validation session: the GEMM round it runs in (None: none),
    its P2P transfers as (round, src, dst), and whether a share covered the rank at all."""

    gemm_round: int | None = None
    pairs: list[tuple[int, int, int]] = field(default_factory=list)
    covered: bool = True


def rank_work(shares: Iterable[ValidationShare], rank: int) -> RankWork:
    """``rank``'s work from the shares of its session (those of other ranks are ignored)."""
    gemm_round: int | None = None
    pairs: set[tuple[int, int, int]] = set()
    covered = False
    for share in shares:
        if not share.first <= rank <= share.last:
            continue
        covered = True
        for first, last, k in share.gemm:
            if first <= rank <= last:
                gemm_round = k
        pairs.update((k, s, d) for k, s, d in share.pairs if rank in (s, d))
    return RankWork(gemm_round, sorted(pairs), covered)


def join_shares(validation: ValidationPlan, shares: Iterable[ValidationShare]) -> dict[str, Any]:
    """A session's whole plan put back together from its suspend's ``validation`` and its
    shares, in the form :func:`validation_plan` returns (``gemm`` ranks, ``passes`` as
    lists of (src, dst) per round, and the sizes); ``gemm_rounds`` says how the GEMMs were
    staggered. For simulated ranks that answer a plan as a whole (the experiments)."""
    shares = list(shares)
    gemm = sorted({r for sh in shares for first, last, _ in sh.gemm for r in range(first, last + 1)})
    passes = [sorted({(s, d) for sh in shares for k, s, d in sh.pairs if k == rnd})
              for rnd in range(validation.p2p_rounds)]
    return {"scope": validation.scope, "gemm": gemm, "gemm_n": validation.gemm_n,
            "gemm_repeats": validation.gemm_repeats, "gemm_rounds": validation.gemm_rounds,
            "validation_sweeps": validation.validation_sweeps, "passes": [list(p) for p in passes],
            "nbytes": validation.nbytes, "repeats": validation.repeats}
