"""What to validate after profiling: which ranks run the GEMM, which links get P2P passes.

Only suspects are validated, but a verdict needs a reference: the GEMM runs on every
rank of each compute suspect's groups, and links are tested for every group of a
suspicious group's role (groups of one role are disjoint, so they share passes and
cost nothing extra). Computation and communication are decided separately: with no
compute suspect every rank runs the GEMM, with no suspicious group every role's links
are tested (a link inside the only group of its kind has nothing to be compared with
during profiling). Either way a constant number of passes per role. Pure.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from falconext.validate.passes import merge_passes, ring_passes

#: roles whose groups partition the ranks: their rings carry the job's traffic
LINK_ROLES = ("tp", "cp", "ep", "dp", "pp")


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
) -> dict[str, Any]:
    """The plan sent to every rank with the suspend command (plain JSON data).

    ``groups`` maps group id -> (role, members in group order).
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
    for role in roles:
        rings = [ring_passes(m) for g, (r, m) in sorted(linked.items()) if r == role]
        passes.extend([[list(p) for p in pas] for pas in merge_passes(rings)])
    return {
        "scope": scope,
        "gemm": sorted(gemm),
        "gemm_n": gemm_n,
        "gemm_repeats": gemm_repeats,
        "gemm_concurrency": gemm_concurrency,
        "validation_sweeps": validation_sweeps,
        "passes": passes,
        "roles": roles,
        "nbytes": p2p_bytes,
        "repeats": p2p_repeats,
        "p2p_concurrency": p2p_concurrency,
    }
