"""The emulated accelerator of one rank (``--device emulated``): device time, real work.

Every rank keeps training for real (megatron-core on CPU tensors over gloo: real model,
losses and gradients), but the *time* the work takes is the time a GPU would take, from
:class:`falconext.model.device.DeviceModel`:

- **compute**: a micro-batch's forward starts a device window of its FLOPs at the
  device's throughput (times this process's compute-fault factor for the iteration); at
  the forward's end the rank sleeps until the window closes. Its backward opens a window
  of two forwards when the autograd engine reaches the model's output, and sleeps at the
  transformer layers' input until it closes. The sleep uses no CPU, so a healthy rank
  never slows a neighbour, and a fault is a step: exactly its factor from its first
  iteration. When the real CPU work outlasts the window (an overloaded host), the
  overrun is counted per iteration and reported, never hidden.
- **links**: each collective and point-to-point transfer, after the real gloo operation
  returns (for async handles: at ``wait()``), holds the rank for the link model's time:
  a ring over the members' nodes for collectives (all members compute the same), one hop
  for a message; a link fault divides that link's bandwidth by its factor. With real
  links (``--net netns``) this part is off: the kernel's rate limits take the time.
- **GEMMs** run through :meth:`EmulatedDevice.matmul`, the same clock, so the
  validation benchmark on a slowed rank is slow by the fault's factor.

This wraps torch.distributed *below* falconext's tracer (install it first): the tracer,
the detector and validation see only calls and their timings, as on a GPU cluster.
Nothing in the pipeline imports this module. Per-iteration records of the device time
applied (:meth:`EmulatedDevice.record`) let tests and the summary know the truth.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from typing import Any, Callable

import torch

from falconext.model.device import BACKWARD_PER_FORWARD, DeviceModel, gemm_flops
from falconext.model.faults import Fault, compute_factor, link_factor
from falconext.emulation.marks import mark_layers_input, on_backward
from falconext.trace.groups import to_process
from falconext.trace.aliases import rebind_aliases, restore_aliases
from falconext.trace.wrappers import P2PWrapper

# record columns, per iteration
COMPUTE_S, LINK_S, OVERRUN_S, WINDOWS, OVERRUNS, FACTOR, CLOSED = range(7)

# torch.distributed name -> (op for the link model, position and name of the full-size
# tensor, position of the group argument, position of async_op)
_COLLECTIVES = {
    "all_reduce": ("all_reduce", 0, "tensor", 2, 3),
    "broadcast": ("broadcast", 0, "tensor", 2, 3),
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input", 3, 4),
    "all_gather_into_tensor": ("all_gather", 0, "output_tensor", 2, 3),
}


def sleep_until(deadline: float, clock: Callable[[], float] = time.perf_counter) -> float:
    """Sleep (no CPU) until ``clock()`` reaches ``deadline``; returns how far past the
    deadline the clock already was when called (0 when on time)."""
    now = clock()
    if now >= deadline:
        return now - deadline
    time.sleep(deadline - now)
    return 0.0


def _arg(args: tuple, kwargs: dict, pos: int, name: str) -> Any:
    return kwargs[name] if name in kwargs else (args[pos] if len(args) > pos else None)


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class _Batch:
    """Transfers issued together: they complete together, ``delay_s`` after the first
    real completion is seen."""

    __slots__ = ("delay_s", "deadline", "device")

    def __init__(self, delay_s: float, device: "EmulatedDevice") -> None:
        self.delay_s, self.deadline, self.device = delay_s, None, device

    def finish(self) -> None:
        if self.deadline is None:
            self.deadline = time.perf_counter() + self.delay_s
            self.device._link(self.delay_s)
        sleep_until(self.deadline)


class _DelayedWork:
    """An async handle whose ``wait()`` also waits out the link model's time."""

    def __init__(self, work: Any, batch: _Batch) -> None:
        self._work, self._batch = work, batch

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        out = self._work.wait(*args, **kwargs)
        self._batch.finish()
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class EmulatedDevice:
    """One process's emulated GPU and its links; ``iteration`` is set by the loop.

    ``process`` is the launch rank (faults belong to processes and nodes, not to the
    roles a topology switch moves). ``real_links``: the links are real (network
    namespaces), so only compute is emulated."""

    def __init__(
        self,
        model: DeviceModel,
        process: int,
        ranks_per_node: int,
        faults: list[Fault] | None = None,
        real_links: bool = False,
    ) -> None:
        self.model = model
        self.process = process
        self.ranks_per_node = ranks_per_node
        self.faults = list(faults or [])
        self.real_links = real_links
        self.iteration = -1
        #: iteration -> [compute_s, link_s, overrun_s, windows, overruns, factor, closed]
        self.records: dict[int, list[float]] = {}
        #: forward FLOPs of one micro-batch of this process's current role
        self.forward_flops = 0.0
        self._fwd_deadline = 0.0
        self._bwd_deadline = 0.0
        self._handles: list[Any] = []
        self._saved: dict[str, Any] = {}
        self._aliases: list = []
        self._coalesced: dict[Any, list[tuple[str, int, Any]]] = {}
        #: told each compute window's kind ("forward", "backward") and device seconds, as a
        #: GPU's kernel timer would see them (the NVRx comparison's stand-in for CUPTI);
        #: None: nobody listens
        self.on_window: Callable[[str, float], None] | None = None

    # --- bookkeeping -------------------------------------------------------------------

    def _rec(self) -> list[float]:
        rec = self.records.get(self.iteration)
        if rec is None:
            rec = self.records[self.iteration] = [0.0, 0.0, 0.0, 0, 0, self.factor(), 0]
        return rec

    def _link(self, seconds: float) -> None:
        self._rec()[LINK_S] += seconds

    def _window(self, seconds: float, kind: str = "forward") -> float:
        rec = self._rec()
        rec[COMPUTE_S] += seconds
        rec[WINDOWS] += 1
        if self.on_window is not None:
            self.on_window(kind, seconds)
        return seconds

    def _closed(self, late_s: float) -> None:
        """A window was waited out, ``late_s`` after it should have closed."""
        rec = self._rec()
        rec[CLOSED] += 1
        if late_s > 0:
            rec[OVERRUN_S] += late_s
            rec[OVERRUNS] += 1

    def factor(self) -> float:
        """This process's compute-fault factor now."""
        return compute_factor(self.faults, self.process, self.iteration)

    def node(self, rank: int) -> int:
        """The virtual node of the process playing torch rank ``rank``."""
        return to_process(rank) // self.ranks_per_node

    def microbatch_s(self, factor: float = 1.0) -> float:
        """Device seconds of one micro-batch (forward + backward) of the current role."""
        return self.model.compute_s(self.forward_flops * (1.0 + BACKWARD_PER_FORWARD), factor)

    # --- compute -----------------------------------------------------------------------

    def attach_model(self, module: torch.nn.Module, forward_flops: float) -> None:
        """Time ``module``'s forward and backward on the device (a new role replaces the
        old hooks: call again after a topology switch)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.forward_flops = forward_flops

        def pre(_mod, _inputs):
            self._fwd_deadline = time.perf_counter() + self._window(self.model.compute_s(self.forward_flops, self.factor()))

        def post(_mod, _inputs, output):
            self._closed(sleep_until(self._fwd_deadline))
            if isinstance(output, torch.Tensor) and output.requires_grad:
                return on_backward(output, self._open_backward)
            return output

        def layers_pre(mod, args, kwargs):
            return mark_layers_input(mod, args, kwargs, self._close_backward)

        self._handles.append(module.register_forward_pre_hook(pre))
        self._handles.append(module.register_forward_hook(post))
        layers = getattr(module, "decoder", None)
        if isinstance(layers, torch.nn.Module):
            self._handles.append(layers.register_forward_pre_hook(layers_pre, with_kwargs=True))

    def _open_backward(self) -> None:
        seconds = self.model.compute_s(self.forward_flops * BACKWARD_PER_FORWARD, self.factor())
        self._bwd_deadline = time.perf_counter() + self._window(seconds, "backward")

    def _close_backward(self) -> None:
        self._closed(sleep_until(self._bwd_deadline))

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a @ b`` computed for real, taking the device's time for its FLOPs."""
        deadline = time.perf_counter() + self.model.compute_s(
            gemm_flops(a.shape[-2], a.shape[-1], b.shape[-1]), self.factor()
        )
        out = torch.matmul(a, b)
        sleep_until(deadline)
        return out

    # --- links -------------------------------------------------------------------------

    def collective_s(self, op: str, nbytes: int, group: Any) -> float:
        """The link model's time for a ring collective on ``group`` now."""
        dist = torch.distributed
        ranks = sorted(dist.get_process_group_ranks(group)) if group is not None else list(range(dist.get_world_size()))
        nodes = [self.node(r) for r in ranks]
        n = len(nodes)
        factors = [link_factor(self.faults, nodes[i], nodes[(i + 1) % n], self.iteration) for i in range(n)]
        return self.model.ring_s(op, nbytes, nodes, factors)

    def message_s(self, peer: int, nbytes: int) -> float:
        """The link model's time for one message between this process and torch rank ``peer``."""
        a, b = self.process // self.ranks_per_node, self.node(peer)
        return self.model.p2p_s(nbytes, a, b, link_factor(self.faults, a, b, self.iteration))

    def install(self) -> None:
        """Wrap torch.distributed (and Megatron's import-time aliases) with the link
        model; below any tracer: call before the tracer installs. No-op with real links."""
        if self._saved or self.real_links:
            return
        dist = torch.distributed
        c10d = dist.distributed_c10d
        wrapped: dict[str, Any] = {}
        for name, (op, t_pos, t_name, g_pos, a_pos) in _COLLECTIVES.items():
            orig = getattr(dist, name, None)
            if orig is not None:
                wrapped[name] = self._collective(orig, op, t_pos, t_name, g_pos, a_pos)
        for name in ("send", "recv"):
            wrapped[name] = self._sync_p2p(getattr(dist, name))
        for name in ("isend", "irecv"):
            orig = getattr(dist, name)
            wrapped[name] = P2PWrapper(self._async_p2p(orig), orig, getattr(c10d, name))
        wrapped["batch_isend_irecv"] = self._batch(dist.batch_isend_irecv, c10d)
        wrapped["_coalescing_manager"] = self._coalescing(dist._coalescing_manager, c10d)
        aliases: dict[int, tuple[Any, Any]] = {}
        for name, w in wrapped.items():
            orig = getattr(dist, name)
            self._saved[name] = orig
            setattr(dist, name, w)
            aliases[id(orig)] = (orig, w)
        self._aliases = rebind_aliases(aliases)

    def uninstall(self) -> None:
        """Put back the torch.distributed functions and module aliases found at install, and
        remove the model hooks; the device's record stays readable. Safe to call twice."""
        unbind = {}
        for name, orig in self._saved.items():
            unbind[id(getattr(torch.distributed, name))] = (getattr(torch.distributed, name), orig)
            setattr(torch.distributed, name, orig)
        restore_aliases(self._aliases, unbind)
        self._saved.clear()
        self._aliases = []
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _collective(self, orig: Callable, op: str, t_pos: int, t_name: str, g_pos: int, a_pos: int) -> Callable:
        c10d = torch.distributed.distributed_c10d

        @functools.wraps(orig)
        def coll(*args: Any, **kwargs: Any) -> Any:
            tensor = _arg(args, kwargs, t_pos, t_name)
            group = _arg(args, kwargs, g_pos, "group")
            pg = group if group is not None else c10d._get_default_group()
            queue = self._coalesced.get(pg)
            out = orig(*args, **kwargs)
            if queue is not None:  # runs when the coalescing manager exits
                queue.append((op, _nbytes(tensor), group))
                return out
            batch = _Batch(self.collective_s(op, _nbytes(tensor), group), self)
            if _arg(args, kwargs, a_pos, "async_op") and out is not None:
                return _DelayedWork(out, batch)
            batch.finish()
            return out

        return coll

    def _sync_p2p(self, orig: Callable) -> Callable:
        @functools.wraps(orig)
        def p2p(tensor: torch.Tensor, peer: int | None = None, *args: Any, **kwargs: Any) -> Any:
            out = orig(tensor, peer, *args, **kwargs)
            if peer is not None:  # torch's peer is a global rank
                _Batch(self.message_s(peer, _nbytes(tensor)), self).finish()
            return out

        return p2p

    def _async_p2p(self, orig: Callable) -> Callable:
        @functools.wraps(orig)
        def p2p(tensor: torch.Tensor, peer: int | None = None, *args: Any, **kwargs: Any) -> Any:
            work = orig(tensor, peer, *args, **kwargs)
            if peer is None or work is None:
                return work
            return _DelayedWork(work, _Batch(self.message_s(peer, _nbytes(tensor)), self))

        return p2p

    def _batch(self, orig: Callable, c10d: Any) -> Callable:
        @functools.wraps(orig)
        def batch(p2p_ops: list) -> Any:
            delay = 0.0
            for p in p2p_ops:
                p.op = inspect.unwrap(p.op) if not isinstance(p.op, P2PWrapper) else p.op._base
                delay = max(delay, self.message_s(p.peer, _nbytes(p.tensor)))
            works = orig(p2p_ops)
            shared = _Batch(delay, self)
            return [_DelayedWork(w, shared) for w in works]

        return batch

    def _coalescing(self, orig: Callable, c10d: Any) -> Callable:
        @contextlib.contextmanager
        def manager(group: Any = None, device: Any = None, async_ops: bool = False) -> Any:
            pg = group if group is not None else c10d._get_default_group()
            queue: list[tuple[str, int, Any]] = []
            self._coalesced[pg] = queue
            try:
                with orig(group, device, async_ops) as cm:
                    yield cm
            finally:
                self._coalesced.pop(pg, None)
            if queue:
                # the queued calls ran as one at the exit: the same ring, their bytes summed
                op, _, grp = queue[0]
                _Batch(self.collective_s(op, sum(b for _, b, _ in queue), grp), self).finish()

        functools.update_wrapper(manager, orig)
        return manager

    # --- what was applied ----------------------------------------------------------------

    def record(self) -> dict[str, Any]:
        """The device time applied, per iteration, and the overrun totals (JSON-ready)."""
        iters = sorted(self.records)
        windows = sum(int(self.records[i][WINDOWS]) for i in iters)
        overruns = sum(int(self.records[i][OVERRUNS]) for i in iters)
        closed = sum(int(self.records[i][CLOSED]) for i in iters)
        return {
            "process": self.process,
            "model": {k: getattr(self.model, k) for k in self.model.__dataclass_fields__},
            "real_links": self.real_links,
            "forward_flops": self.forward_flops,
            "microbatch_s": self.microbatch_s(),
            "windows": windows,
            #: windows the rank waited out; one never waited out is device time lost
            "closed": closed,
            "overruns": overruns,
            "overrun_s": round(sum(self.records[i][OVERRUN_S] for i in iters), 6),
            "iterations": {
                str(i): {
                    "compute_s": round(r[COMPUTE_S], 6), "link_s": round(r[LINK_S], 6),
                    "overrun_s": round(r[OVERRUN_S], 6), "windows": int(r[WINDOWS]),
                    "overruns": int(r[OVERRUNS]), "factor": r[FACTOR], "closed": int(r[CLOSED]),
                }
                for i, r in ((i, self.records[i]) for i in iters)
            },
        }
