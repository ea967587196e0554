"""S3 applied live: give processes new (TP, DP, PP) roles without restarting them.

At an iteration boundary every process agreed on (a suspension commits the action),
each process serialises the state of the role it plays (model, optimizer, RNG: the
same payload as an S4 shard, mitigate/restart.py) and sends it, in memory over the
existing world group, to the process that takes that role over. Then the world group
is re-created with every process's new role as its torch rank, on the same rendezvous
store under a fresh prefix: megatron-core derives every group from torch ranks in its
fixed order, so re-initialising parallel_state on the permuted ranks rebuilds TP, DP,
PP and embedding groups exactly as for a job launched in that order. The model chunk,
DDP and optimizer are rebuilt for the new role and loaded with the received state.

A process keeps its launch rank as its identity (records, heartbeats, faults): the
torch rank is only the role. :func:`falconext.trace.groups.set_roles` keeps that
mapping for the tracer and the fault injector.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.distributed import distributed_c10d as c10d

from falconext.mitigate import restart
from falconext.model.roles import check_roles
from falconext.trace import groups

#: prefix of the rendezvous keys of re-created world groups (one per switch)
STORE_PREFIX = "falconext/roles"


def handover_pairs(now: list[int], after: list[int]) -> list[tuple[int, int]]:
    """(from torch rank, to torch rank) in today's numbering: the state of role r sits at
    torch rank r and goes to the process that plays r next (pure; skips stay-at-home
    roles)."""
    pairs = []
    for proc, role in enumerate(after):
        if now[proc] != role:
            pairs.append((role, now[proc]))
    return sorted(pairs)


class SwitchRefused(RuntimeError):
    """The switch was called off before anything was torn down: every process keeps its
    role, its groups and its state."""


@dataclass
class SwitchTimes:
    """Seconds of each phase of one switch, on this process."""

    serialize_s: float = 0.0
    transfer_s: float = 0.0
    regroup_s: float = 0.0
    rebuild_s: float = 0.0
    load_s: float = 0.0
    total_s: float = 0.0
    sent_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def exchange(payload: bytes, pairs: list[tuple[int, int]], me: int,
             all_gather: Callable, isend: Callable, irecv: Callable) -> bytes | None:
    """Send ``payload`` along my pair and receive the state of my next role, if it moves.

    Sizes first (every rank, one all-gather), then every send and receive at once, so
    cycles of the permutation cannot deadlock."""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    world = torch.distributed.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    all_gather(sizes, size)
    works, inbox = [], None
    for src, dst in pairs:
        if src == me:
            works.append(isend(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst))
        if dst == me:
            inbox = torch.empty(int(sizes[src].item()), dtype=torch.uint8)
            works.append(irecv(inbox, src))
    for w in works:
        w.wait()
    return None if inbox is None else inbox.numpy().tobytes()


def switch_roles(trainer: Any, after: list[int], process: int, layout: dict[str, int], iteration: int,
                 epoch: int, make_trainer: Callable[[list[int]], Any],
                 comm: dict[str, Callable] | None = None, timeout_s: float = 120.0,
                 probe: bool = False, on_teardown: Callable[[], None] | None = None) -> tuple[Any, SwitchTimes]:
    """Every process calls this at the same boundary; returns (new trainer, times).

    ``make_trainer(plan)`` builds the trainer of the new role once parallel_state is
    re-initialised; ``comm`` may hold untraced ``all_gather``/``isend``/``irecv`` so the
    hand-over does not show in the call log as training traffic. ``probe``: ``after``
    must be today's roles; each state still travels (round a ring, then dropped), so
    the pause measured is what a real switch costs: S3's overhead for the planner.
    ``on_teardown`` runs once every process has agreed, just before the groups go.

    Raises :class:`SwitchRefused`, with nothing changed, when any process could not
    serialise, receive or validate the state of its next role.
    """
    from megatron.core import parallel_state as ps  # lazy: run-time order (megatron-core only in ranks, after cpu_compat)

    dist = torch.distributed
    t0 = time.perf_counter()
    times = SwitchTimes()
    world = dist.get_world_size()
    after = list(check_roles(after, world))
    me = dist.get_rank()
    now = [groups.to_rank(p) for p in range(world)]
    if now[process] != me:
        raise RuntimeError(f"process {process} plays torch rank {me}, but the role map says {now[process]}")

    if probe and after != now:
        raise ValueError(f"a probe switch keeps the roles {now}, got {after}")
    comm = comm or {}
    plan = list(trainer.plan)
    payload: Any = None
    where = f"process {process}'s own state"
    problem = ""
    try:
        own = restart.state_payload(me, layout, iteration, trainer.model, trainer.optimizer, extra={"plan": plan})
        data = restart.payload_to_bytes(own)
        times.serialize_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        pairs = [(r, (r + 1) % world) for r in range(world)] if probe and world > 1 else handover_pairs(now, after)
        received = exchange(data, pairs, me, comm.get("all_gather", dist.all_gather),
                            comm.get("isend", dist.isend), comm.get("irecv", dist.irecv))
        times.sent_bytes = len(data) if any(src == me for src, _ in pairs) else 0
        times.transfer_s = time.perf_counter() - t1
        payload = own
        if received is not None and not probe:
            where = f"state handed to process {process}"
            payload = restart.payload_from_bytes(received, where)
        restart.check_payload(payload, where, after[process], layout, kind="hand-over state", verb="take over")
    except (restart.CheckpointError, RuntimeError, ValueError) as exc:
        problem = f"{type(exc).__name__}: {exc}"[:500]
    # all or nothing: nothing is torn down unless every process holds a valid state
    verdict = torch.tensor([0 if problem else 1], dtype=torch.int64)
    comm.get("all_reduce", dist.all_reduce)(verdict, op=dist.ReduceOp.MIN)
    if int(verdict.item()) == 0:
        raise SwitchRefused(problem or "another process could not take its role over; roles unchanged")

    t2 = time.perf_counter()
    if on_teardown is not None:
        on_teardown()
    store = c10d._get_default_store()
    backend = dist.get_backend()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    dist.init_process_group(
        backend=backend, store=dist.PrefixStore(f"{STORE_PREFIX}/{epoch}/", store), rank=after[process],
        world_size=world, timeout=datetime.timedelta(seconds=timeout_s),
    )
    ps.initialize_model_parallel(tensor_model_parallel_size=layout["tp"], pipeline_model_parallel_size=layout["pp"])
    groups.set_roles(after)
    times.regroup_s = time.perf_counter() - t2

    t3 = time.perf_counter()
    new = make_trainer(plan)
    times.rebuild_s = time.perf_counter() - t3

    t4 = time.perf_counter()
    restart.restore_payload(payload, where, after[process], layout, new.model, new.optimizer,
                            kind="hand-over state", verb="take over")
    times.load_s = time.perf_counter() - t4
    times.total_s = time.perf_counter() - t0
    return new, times
