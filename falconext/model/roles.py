"""A job's roles: which torch rank each process plays (``roles[process] = role``).

A role is ``tp_r + tp * (dp_r + dp * pp_r)`` in Megatron's default order; a layout in
force, a topology switch (S3), a restart that moves ranks, and the cost model
(:mod:`falconext.model.itertime`) all take a permutation of ``range(world)``, checked here
once. The S3 planner that finds one is :mod:`falconext.mitigate.topology`.
"""

from __future__ import annotations

from collections.abc import Sequence

from falconext.integers import is_int


def check_roles(roles: Sequence[int], world: int, name: str = "roles") -> tuple[int, ...]:
    """Return ``roles`` as a tuple after checking it is a permutation of ``range(world)``."""
    if isinstance(roles, (str, bytes)):
        raise ValueError(f"{name} must be a sequence of ints, not a string")
    try:
        rs = list(roles)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of ints, got {roles!r}") from None
    if len(rs) != world:
        raise ValueError(f"{name} has {len(rs)} entries, expected world = {world}")
    seen = [False] * world
    for p, r in enumerate(rs):
        if not is_int(r) or not 0 <= r < world:
            raise ValueError(f"{name}[{p}] = {r!r} is not a role in range({world})")
        if seen[r]:
            raise ValueError(f"{name} is not a permutation: role {r} is played twice")
        seen[r] = True
    return tuple(int(r) for r in rs)
