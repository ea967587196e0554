"""Stable names for process groups, and the Megatron roles behind them.

A process group object means nothing outside the process that holds it, yet the
detector and the validation phase compare calls across ranks and across log files. So
every group gets a string id that every member computes alike: a role prefix and the
sorted global ranks of its members ("tp:0,1", "dp:0,2", "world:0,1,2,3", "g:4,5" when
the role is unknown). Two distinct groups with the same members and role share an id;
for Falcon they cover the same links, which is what the id stands for.

Lookups happen once per group object (the tracer caches the :class:`GroupInfo` by
``id(group)``), so nothing here is on the training thread's hot path.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

#: role prefix of the default (world) group
WORLD = "world"
#: role prefix of a group whose role is unknown
UNKNOWN = "g"

#: (role, parallel_state getter, keyword arguments) in priority order: when one group
#: object is returned by several getters (Megatron reuses objects, e.g. the amax group),
#: the first role listed names it
MEGATRON_GETTERS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("tp", "get_tensor_model_parallel_group", {}),
    ("pp", "get_pipeline_model_parallel_group", {}),
    ("dp", "get_data_parallel_group", {}),
    ("dp_cp", "get_data_parallel_group", {"with_context_parallel": True}),
    ("cp", "get_context_parallel_group", {}),
    ("mp", "get_model_parallel_group", {}),
    ("embd", "get_embedding_group", {}),
    ("pos_embd", "get_position_embedding_group", {}),
    ("tp_dp", "get_tensor_and_data_parallel_group", {}),
    ("tp_dp_cp", "get_tensor_and_data_parallel_group", {"with_context_parallel": True}),
    ("tp_cp", "get_tensor_and_context_parallel_group", {}),
    ("ep", "get_expert_model_parallel_group", {}),
    ("etp", "get_expert_tensor_parallel_group", {}),
    ("edp", "get_expert_data_parallel_group", {}),
    ("etp_ep", "get_expert_tensor_and_model_parallel_group", {}),
    ("etp_ep_pp", "get_expert_tensor_model_pipeline_parallel_group", {}),
    ("dist_opt", "get_intra_distributed_optimizer_instance_group", {}),
    ("dist_opt_inter", "get_inter_distributed_optimizer_instance_group", {}),
    ("dp_gloo", "get_data_parallel_group_gloo", {}),
    ("dp_cp_gloo", "get_data_parallel_group_gloo", {"with_context_parallel": True}),
    ("edp_gloo", "get_expert_data_parallel_group_gloo", {}),
)


#: with no context parallelism (CP size 1) Megatron still hands its DDP gradient traffic
#: to the "with context parallel" groups; they have the data-parallel members, so they
#: are named as such (the detector and planner think in DP replicas, not in CP)
CP_FREE_ROLES = {"dp_cp": "dp", "tp_dp_cp": "tp_dp", "dp_cp_gloo": "dp_gloo"}


#: the process (launch rank) behind each torch rank, once a topology switch (S3) has
#: given processes new ranks; None while every process still has its launch rank. Every
#: record, profile and verdict speaks of processes: a process stays on its node and its
#: GPU, which is what a fault belongs to, whatever role it plays.
_PROCESS_OF: tuple[int, ...] | None = None
#: and its inverse: the torch rank each process plays
_RANK_OF: tuple[int, ...] | None = None


def processes_of(roles: list[int]) -> list[int]:
    """The inverse of ``roles`` (``roles[process]`` = torch rank): the process playing
    each torch rank, by rank."""
    inverse = [0] * len(roles)
    for proc, role in enumerate(roles):
        inverse[role] = proc
    return inverse


def set_roles(roles: list[int] | None) -> None:
    """``roles[process]`` = the torch rank that process now has (None: launch ranks)."""
    global _PROCESS_OF, _RANK_OF
    if roles is None or list(roles) == list(range(len(roles))):
        _PROCESS_OF = _RANK_OF = None
        return
    _PROCESS_OF, _RANK_OF = tuple(processes_of(roles)), tuple(roles)


def to_process(rank: int) -> int:
    """The process playing torch rank ``rank`` now."""
    table = _PROCESS_OF
    return rank if table is None or not 0 <= rank < len(table) else table[rank]


def to_rank(process: int) -> int:
    """The torch rank process ``process`` plays now."""
    table = _RANK_OF
    return process if table is None or not 0 <= process < len(table) else table[process]


class GroupInfo:
    """What the tracer needs to know about one process group, computed once."""

    __slots__ = ("gid", "ranks", "role", "group", "no_future")

    def __init__(self, gid: str, ranks: tuple[int, ...], role: str | None, group: object) -> None:
        self.gid = gid
        #: processes in group-rank order (index = group rank); the id holds them sorted
        self.ranks = ranks
        self.role = role
        #: a strong reference, so the ``id(group)`` cache key cannot be reused by another
        #: object while the entry lives
        self.group = group
        #: ops whose Work handles on this group have no future (gloo P2P, reduce_scatter)
        self.no_future: set[str] = set()


def group_id(role: str | None, ranks: Iterable[int]) -> str:
    """``<role>:<sorted member ranks>``, the same string on every member."""
    return f"{role or UNKNOWN}:{','.join(str(r) for r in sorted(ranks))}"


def describe_group(group: object, roles: Callable[[object], str | None] | None) -> GroupInfo:
    """Resolve ``group`` (None = the default group) into id, member ranks and role.

    Never raises: a group that cannot be described (the process is not a member, the
    default group is gone) gets an "unknown" id rather than failing a training call.
    """
    # lazy: start-up time (falconext.trace is torch-free: the CLI imports it)
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    try:
        default = c10d._get_default_group()
    except Exception:  # not initialised (a call that is about to fail anyway)
        default = None
    pg = default if group is None else group
    try:
        ranks = tuple(to_process(int(r)) for r in dist.get_process_group_ranks(pg))
    except Exception:
        return GroupInfo("unknown", (), None, pg)
    if pg is not None and pg is default:
        role: str | None = WORLD
    else:
        role = None
        if roles is not None:
            try:
                role = roles(pg)
            except Exception:
                role = None
    return GroupInfo(group_id(role, ranks), ranks, role, pg)


def megatron_roles() -> Callable[[object], str | None]:
    """A ``roles`` callback naming Megatron's groups by identity with parallel_state's.

    The table is rebuilt on every call because the tracer calls it once per new group
    object only, and Megatron may rebuild its groups (a topology change re-initialises
    parallel_state); a stale table would misname the new groups.
    """

    def roles(group: object) -> str | None:
        return megatron_role_table().get(id(group))

    return roles


def megatron_role_table() -> dict[int, str]:
    """``id(group) -> role`` for every parallel_state group this process can get.

    Empty when megatron-core is absent or parallel_state is not initialised. Each getter
    is guarded: which ones work depends on the parallel configuration and version.
    """
    try:
        # lazy: start-up time (falconext.trace is torch-free: the CLI imports it)
        from megatron.core import parallel_state as ps
    except Exception:
        return {}
    try:
        if not ps.model_parallel_is_initialized():
            return {}
    except Exception:
        return {}
    try:
        cp_free = ps.get_context_parallel_world_size() == 1
    except Exception:
        cp_free = False
    table: dict[int, str] = {}
    for role, name, kwargs in MEGATRON_GETTERS:
        if cp_free:
            role = CP_FREE_ROLES.get(role, role)
        getter = getattr(ps, name, None)
        if getter is None:
            continue
        try:
            found = getter(**kwargs)
        except Exception:
            continue
        for g in found if isinstance(found, (list, tuple)) else (found,):
            if g is not None and not isinstance(g, (int, bool)):
                table.setdefault(id(g), role)
    return table
