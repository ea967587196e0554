"""The "NCCL hooks": every torch.distributed call Megatron makes, logged per process.

Megatron reaches collectives through attribute lookups on the ``torch.distributed``
module (``torch.distributed.all_reduce(...)``), so replacing those attributes intercepts
them without touching Megatron. A few Megatron modules bind a function to a module
global at import time (``dist_all_gather_func = torch.distributed.all_gather_into_tensor``
in the DDP buffers and tensor-parallel mappings); :meth:`CallTracer.install` rebinds such
aliases in already imported ``megatron.*`` modules too, and uninstall puts them back.

The training thread pays for one record per call and nothing else: it appends a small
list to a bounded deque (no locks beyond the GIL, never waiting for the consumer) and
the analysis thread turns those into :class:`CallRecord` objects in :meth:`drain`.

Completion times (``t_end``):

* synchronous calls: the clock when the original function returns;
* async calls on CPU: the handle is returned inside :class:`~falconext.trace.wrappers.TimedWork`, a thin proxy
  that notes the time when ``wait()`` returns or ``is_completed()`` first says True: an
  upper bound on completion, exact when the training thread waits before the transfer
  ends. With ``completion_futures=True`` the Work's future callback gives the exact
  time where the backend has futures (gloo: all_reduce, all_gather, broadcast,
  all_to_all, barrier; not isend/irecv or reduce_scatter, which keep the proxy). It is
  off by default because on gloo it is not free for the training thread: the callback
  needs the GIL on gloo's thread and ``wait()`` may block until it has run, which
  measured ~30 us per call here (examples/bench_hooks.py), beyond the 5 us budget;
* ``cuda_events=True``: CUDA events recorded on the current stream around the call (for
  async calls, the end event at ``wait()``, when the current stream has been made to wait
  for the communication stream). They are converted to host times in :meth:`drain` on
  the analysis thread with ``Event.query()``; the training thread never synchronises.
  NCCL futures complete at enqueue time, so futures are never used for timing on GPU.
* calls queued inside ``torch.distributed._coalescing_manager`` (Megatron's DDP gradient
  reduction) run when the manager exits, not when they return. The manager is wrapped
  too (and Megatron's import-time alias of it rebound): a sync batch completes when the
  manager exits, an async one when the manager's handle is waited on. Calls queued by
  a manager the tracer cannot see get ``t_end=None`` (unknown), never a wrong time.

A record still incomplete ``pending_timeout_s`` after issue (a handle never waited on) is
drained with ``t_end=None`` so it cannot hold up the records behind it for long.

The modules beside this one hold the parts :class:`CallTracer` puts together: the
wrappers and their handle proxies (:mod:`~falconext.trace.wrappers`), the suspension
point of the validation phase (:class:`~falconext.trace.trap.Trap`), the sampled cost
of the wrappers (:class:`~falconext.trace.cost.HookCost`, ``tracer.cost``; what a held
call spends, validation work run on the training thread, is counted apart in
``trap.cpu_s``), CUDA-event timing (:mod:`~falconext.trace.cuda_timing`) and the
rebinding of Megatron's import-time aliases (:mod:`~falconext.trace.aliases`).
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
import warnings
from collections import deque
from typing import Any, Callable

from falconext.config import FalconConfig
from falconext.trace.aliases import rebind_aliases, restore_aliases
from falconext.trace.cost import HOOK_SAMPLE_EVERY, HookCost
from falconext.trace.cuda_timing import CudaTiming
from falconext.trace.entry import BYTES, DONE, EV0, EV1, INFO, OP, PEER, SEQ, T_END, T_ISSUE, T_START
from falconext.trace.groups import GroupInfo, describe_group, megatron_roles, to_process
from falconext.trace.records import CallRecord
from falconext.trace.trap import Trap
from falconext.trace.wrappers import (
    COLLECTIVES,
    P2P_CALLS,
    P2PWrapper,
    TimedWork,
    batch_wrapper,
    coalescing_wrapper,
    collective_wrapper,
    done_callback,
    p2p_wrapper,
    reaches,
)

__all__ = [
    "CallTracer", "HookCost", "P2PWrapper", "Trap", "megatron_roles", "rebind_aliases", "restore_aliases",
]

#: an async record whose completion is still unknown this long after issue is drained
#: with t_end None (its handle was dropped or never waited on); the runtime raises it to
#: a few iterations (FalconConfig.pending_timeout_s / pending_timeout_iterations)
PENDING_TIMEOUT_S = FalconConfig().pending_timeout_s

_install_lock = threading.Lock()
_active: "CallTracer | None" = None


class CallTracer:
    """Per-process interceptor of torch.distributed calls; see the module docstring.

    ``rank`` is the global rank written into every record; ``roles(group)`` names a
    group's parallelism role (``megatron_roles()`` for Megatron's parallel_state);
    ``clock`` is the host clock of every time in the records. ``capacity`` bounds the
    records waiting for :meth:`drain`; beyond it new calls are not recorded and counted
    in ``dropped`` (their ``seq`` numbers are still used, so a consumer sees the gap).
    ``cuda_events`` and ``completion_futures`` choose how completion is timed (module
    docstring). ``cost`` estimates the wrappers' CPU time on the training thread, timing
    one entry in ``sample_every`` on average (:class:`HookCost`).
    """

    def __init__(
        self,
        rank: int,
        capacity: int = 65536,
        clock: Callable[[], float] = time.perf_counter,
        roles: Callable[[object], str | None] | None = None,
        cuda_events: bool = False,
        *,
        completion_futures: bool = False,
        sample_every: int = HOOK_SAMPLE_EVERY,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.rank = int(rank)
        self.trap = Trap()
        #: the wrappers' own CPU time on the calling thread (sampled estimate)
        self.cost = HookCost(sample_every)
        #: records lost because the ring was full (the consumer is too slow)
        self.dropped = 0
        #: bookkeeping failures swallowed so that a tracer bug cannot fail a training call
        self.errors = 0
        #: see PENDING_TIMEOUT_S
        self.pending_timeout_s = PENDING_TIMEOUT_S
        self._capacity = capacity
        self._clock = clock
        self._roles = roles
        self._cuda: CudaTiming | None = CudaTiming(clock) if cuda_events else None
        self._futures = completion_futures and not cuda_events  # NCCL futures fire at enqueue
        self._ring: deque[list] = deque()
        self._seq = itertools.count()
        self._groups: dict[int, GroupInfo] = {}
        self._drain_lock = threading.Lock()
        self._coalescing: dict = {}
        #: process group -> entries queued inside a traced _coalescing_manager on it
        self._open_batches: dict[object, list[list]] = {}
        self._base_isend: object = None
        self._patched: dict[str, tuple[Any, Any]] = {}
        self._aliases: list[tuple[dict, str, Any, Any]] = []

    # --- installation ---------------------------------------------------------------

    def install(self) -> None:
        """Replace the torch.distributed functions with recording wrappers (idempotent)."""
        global _active
        with _install_lock:
            if _active is self:
                return
            if _active is not None:
                raise RuntimeError("another CallTracer is installed in this process")
            # lazy: start-up time (falconext.trace is torch-free: the CLI imports it)
            import torch.distributed as dist
            from torch.distributed import distributed_c10d as c10d

            world = getattr(c10d, "_world", None)
            state = getattr(world, "pg_coalesce_state", None)
            self._coalescing = state if isinstance(state, dict) else {}
            self._base_isend = c10d.isend
            self._groups.clear()
            patched: dict[str, tuple[Any, Any]] = {}
            for spec in COLLECTIVES:
                orig = getattr(dist, spec.name, None)
                if orig is not None:
                    patched[spec.name] = (orig, collective_wrapper(self, spec, orig))
            for name, op, peer_kw, gpeer_kw, is_async in P2P_CALLS:
                orig = getattr(dist, name, None)
                if orig is not None:
                    wrapper = p2p_wrapper(self, name, op, peer_kw, gpeer_kw, is_async, orig)
                    if is_async:  # usable as P2POp's op: compares equal to c10d's isend/irecv
                        wrapper = P2PWrapper(wrapper, orig, getattr(c10d, name))
                    patched[name] = (orig, wrapper)
            orig = getattr(dist, "batch_isend_irecv", None)
            if orig is not None:
                patched["batch_isend_irecv"] = (orig, batch_wrapper(self, orig))
            orig = getattr(dist, "_coalescing_manager", None)
            if orig is not None:
                patched["_coalescing_manager"] = (orig, coalescing_wrapper(self, orig))
            for name, (_, wrapper) in patched.items():
                setattr(dist, name, wrapper)
            self._patched = patched
            # an alias may hold c10d's function while torch.distributed holds another
            # wrapper (the fault injector installs below us): rebind both to ours
            aliases: dict[int, tuple[Any, Any]] = {}
            for name, (o, w) in patched.items():
                base = getattr(c10d, name, None)
                if base is not None:
                    aliases[id(base)] = (base, w)
                aliases[id(o)] = (o, w)
            self._aliases = rebind_aliases(aliases)
            _active = self

    def uninstall(self) -> None:
        """Put back exactly the functions (and module aliases) found at install."""
        global _active
        with _install_lock:
            if _active is not self:
                return
            import torch.distributed as dist  # lazy: start-up time (falconext.trace is torch-free: the CLI imports it)

            for name, (orig, wrapper) in self._patched.items():
                if getattr(dist, name, None) is wrapper:
                    setattr(dist, name, orig)
                else:
                    warnings.warn(
                        f"torch.distributed.{name} was replaced after the tracer installed; "
                        "leaving the newer function in place",
                        RuntimeWarning,
                        stacklevel=2,
                    )
            restore_aliases(self._aliases, {id(w): (w, o) for o, w in self._patched.values()})
            self._patched = {}
            self._aliases = []
            _active = None

    @property
    def installed(self) -> bool:
        """True while this tracer's wrappers are installed in the process."""
        return _active is self

    def forget_groups(self) -> None:
        """Drop the group cache: a topology switch destroyed every group (and a new one
        may come to live at a recycled ``id``)."""
        self._groups.clear()

    def original(self, name: str) -> Callable[..., Any]:
        """The torch.distributed function found at install (below the tracer).

        Validation traffic goes through these: it must not enter the training's call
        log, but must still pass through anything installed below (a fault injector).
        """
        import torch.distributed as dist  # lazy: start-up time (falconext.trace is torch-free: the CLI imports it)

        if name in self._patched:
            return self._patched[name][0]
        return getattr(dist, name)

    # --- consumer side (analysis thread) ----------------------------------------------

    def drain(self, limit: int | None = None) -> list[CallRecord]:
        """Completed records in ``seq`` order, oldest first; never blocks the producer.

        Stops at the first record whose completion is unknown and younger than
        ``pending_timeout_s``, so records come out in order and each exactly once.
        """
        out: list[CallRecord] = []
        with self._drain_lock:
            ring = self._ring
            cuda = self._cuda
            if cuda is not None:
                cuda.maintain()
            now: float | None = None
            while ring and (limit is None or len(out) < limit):
                e = ring[0]
                if cuda is None or (e[EV0] is None and e[EV1] is None):
                    times: tuple[float | None, float | None] | None = (
                        (e[T_START], e[T_END]) if e[DONE] else None
                    )
                else:
                    times = cuda.resolve(e) if e[DONE] else None
                if times is None:
                    if now is None:
                        now = self._clock()
                    if now - e[T_ISSUE] < self.pending_timeout_s:
                        break
                    times = (cuda.start_or_none(e) if cuda is not None else e[T_START], None)
                ring.popleft()
                info: GroupInfo = e[INFO]
                out.append(
                    CallRecord(
                        self.rank, e[OP], info.gid, e[BYTES], e[T_ISSUE], times[0],
                        times[1], e[SEQ], info.ranks, info.role, e[PEER],
                    )
                )
        return out

    def pending(self) -> int:
        """Records waiting for :meth:`drain` (complete or not)."""
        return len(self._ring)

    # --- producer side (training thread) ----------------------------------------------

    def _describe(self, group: object) -> GroupInfo:
        info = describe_group(group, self._roles)
        self._groups[id(group)] = info
        return info

    def _fail(self) -> None:
        self.errors += 1

    def _coalesced_on(self, group: object) -> object:
        """The process group if ``group`` is inside a ``_coalescing_manager`` (the call
        was only queued), else None."""
        if group is None:
            # lazy: start-up time (falconext.trace is torch-free: the CLI imports it)
            from torch.distributed import distributed_c10d as c10d

            group = c10d._get_default_group()
        return group if group in self._coalescing else None

    def _track(
        self,
        op: str,
        group: object,
        nbytes: int,
        peer: int | None,
        gpeer: int | None,
        t_issue: float,
        t_ret: float,
        out: Any,
        is_async: bool,
        ev0: Any,
    ) -> Any:
        """Append the record of one call; return what the caller should get back."""
        seq = next(self._seq)
        self.trap.seen = seq
        ring = self._ring
        if len(ring) >= self._capacity:
            self.dropped += 1
            return out
        info = self._groups.get(id(group))
        if info is None:
            info = self._describe(group)
        if peer is None and gpeer is not None:
            peer = info.ranks[gpeer]
        elif peer is not None:
            peer = to_process(peer)
        if self._coalescing:
            pg = self._coalesced_on(group)
            if pg is not None:
                batch = self._open_batches.get(pg)
                # untraced manager: completion unknown, drained at once with t_end None
                entry = [seq, op, info, nbytes, peer, t_issue, t_issue if ev0 is None else None,
                         None, batch is None, ev0 if batch is not None else None, None]
                ring.append(entry)
                if batch is not None:
                    batch.append(entry)
                return out
        if not is_async or out is None:
            if ev0 is None:
                ring.append(
                    [seq, op, info, nbytes, peer, t_issue, t_issue, t_ret, True, None, None]
                )
            else:
                ev1 = self._cuda.record()  # type: ignore[union-attr]
                ring.append([seq, op, info, nbytes, peer, t_issue, None, None, True, ev0, ev1])
            return out
        entry = [seq, op, info, nbytes, peer, t_issue, t_issue if ev0 is None else None,
                 None, False, ev0, None]
        ring.append(entry)
        return self._watch(out, [entry], info, op)

    def _track_batch(self, ops: list, works: Any, t_issue: float, t_ret: float,
                     evs: list | None) -> Any:
        """One record per P2POp of a batch_isend_irecv; completion from its handles."""
        ring = self._ring
        entries: list[list | None] = []
        for i, p in enumerate(ops):
            seq = next(self._seq)
            self.trap.seen = seq
            if len(ring) >= self._capacity:
                self.dropped += 1
                entries.append(None)
                continue
            group = p.group
            info = self._groups.get(id(group))
            if info is None:
                info = self._describe(group)
            op = "send" if reaches(p.op, self._base_isend) else "recv"
            ev0 = evs[i] if evs is not None else None
            e = [seq, op, info, p.tensor.nbytes, to_process(p.peer), t_issue,
                 t_issue if ev0 is None else None, None, False, ev0, None]
            ring.append(e)
            entries.append(e)
        live = [e for e in entries if e is not None]
        if not isinstance(works, list) or not works:
            self._finish(live, t_ret)
            return works
        if len(works) == len(entries):
            return [
                w if e is None or w is None else self._watch(w, [e], e[INFO], e[OP])
                for w, e in zip(works, entries)
            ]
        # a coalescing backend (NCCL) hands back one handle for the whole batch
        if live:
            works = list(works)
            works[-1] = self._watch(works[-1], live, live[0][INFO], "batch")
        return works

    def _watch(self, work: Any, entries: list[list], info: GroupInfo, key: str) -> Any:
        """Arrange for ``entries`` to learn when ``work`` completes."""
        if self._futures and key not in info.no_future:
            try:
                fut = work.get_future()
            except Exception:  # gloo: "Work::getFuture not implemented" for P2P etc.
                info.no_future.add(key)
            else:
                fut.add_done_callback(functools.partial(done_callback, entries, self._clock))
                return work
        return TimedWork(work, entries, self)

    def _finish(self, entries: list[list], t: float | None = None) -> None:
        """Mark entries complete now (host clock, or an end event on the current stream)."""
        cuda = self._cuda
        if cuda is None:
            if t is None:
                t = self._clock()
            for e in entries:
                e[T_END] = t
                e[DONE] = True
        else:
            for e in entries:
                e[EV1] = cuda.record()
                e[DONE] = True


    def _close_batch(self, entries: list[list], cm: Any, async_ops: bool) -> None:
        """A traced _coalescing_manager exited: its queued calls were issued as one."""
        works = getattr(cm, "works", None)
        if async_ops and isinstance(works, list) and works and works[-1] is not None:
            works[-1] = self._watch(works[-1], entries, entries[0][INFO], "coalesced")
        else:
            self._finish(entries)  # sync: the manager waited for the batch before exiting
