"""The fault injector of one rank (``--inject`` on the CPU bed): slows its compute and
its links as :mod:`falconext.model.faults` describes, by wrapping torch.distributed
below the tracer and hooking the model's forward and backward."""

from __future__ import annotations

import functools
import inspect
import time
from typing import Any, Callable

import torch

from falconext.model.faults import DEFAULT_LINK_BANDWIDTH, Fault, compute_factor, crossing_senders, link_bytes
from falconext.emulation.marks import mark_layers_input, marks_layers_input, on_backward
from falconext.trace.groups import to_process
from falconext.trace.wrappers import P2PWrapper


# -- the injector (I/O edge) ---------------------------------------------------------------
def _busy(seconds: float) -> None:
    """Stay busy for ``seconds``: a throttled device is occupied for the extra time, it
    does not hand its share of the machine to the other ranks (a sleep would, and on
    the oversubscribed test bed that would hide part of the fault)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _backward_started(clock: dict, delay: float) -> None:
    """At the model's output, the backward's first node: note when the backward starts;
    stall ``delay`` there when no end mark measures the backward."""
    clock["backward_start"] = time.perf_counter()
    if delay > 0:
        _busy(delay)


def _layers_backward_ended(clock: dict, factor: float) -> None:
    """At the transformer layers' input: the backward through them has just ended;
    stall (factor - 1) times its duration."""
    start = clock.get("backward_start")
    if start is not None:
        _busy((factor - 1.0) * (time.perf_counter() - start))


# name -> (normalised op, position of the full-size tensor, position of the group)
_COLLECTIVES = {
    "all_reduce": ("all_reduce", 0, 2),
    "broadcast": ("broadcast", 0, 2),
    "reduce_scatter_tensor": ("reduce_scatter", 1, 3),
    "all_gather_into_tensor": ("all_gather", 0, 2),
}


def _arg(args: tuple, kwargs: dict, pos: int, name: str) -> Any:
    return kwargs[name] if name in kwargs else (args[pos] if len(args) > pos else None)


class FaultInjector:
    """Applies the faults that concern this process; ``iteration`` is set by the loop.

    ``rank`` is the process's launch rank: a fault belongs to a GPU or a link, and a
    topology switch (S3) moves roles between processes, not faults. Peers named by torch
    rank are mapped to processes through :func:`falconext.trace.groups.to_process`."""

    def __init__(
        self,
        faults: list[Fault],
        rank: int,
        ranks_per_node: int,
        link_bandwidth: float = DEFAULT_LINK_BANDWIDTH,
    ) -> None:
        self.faults = faults
        self.rank = rank
        self.ranks_per_node = ranks_per_node
        self.bandwidth = link_bandwidth
        self.iteration = -1
        self.injected_s = 0.0
        self._saved: dict[str, Callable] = {}
        self._handles: list[Any] = []
        self._t0 = 0.0

    # compute -------------------------------------------------------------------------
    def _compute_factor(self) -> float:
        return compute_factor(self.faults, self.rank, self.iteration)

    def attach_model(self, module: torch.nn.Module) -> None:
        """Hook ``module`` so that, under this rank's compute fault, its forward and backward
        take ``factor`` times as long (a busy wait of the extra time); nothing is hooked when
        no compute fault targets this rank."""
        if not any(f.kind == "compute" and f.rank == self.rank for f in self.faults):
            return

        clock: dict[str, float] = {}
        marked = [False]

        def pre(_mod, _inputs):
            self._t0 = time.perf_counter()
            marked[0] = False

        def layers_pre(mod, args, kwargs):
            factor = self._compute_factor()
            if factor <= 1.0 or not marks_layers_input(mod, args, kwargs):
                return None
            marked[0] = True
            return mark_layers_input(mod, args, kwargs, functools.partial(_layers_backward_ended, clock, factor))

        def post(_mod, _inputs, output):
            factor = self._compute_factor()
            if factor <= 1.0:
                return output
            spent = time.perf_counter() - self._t0
            delay = (factor - 1.0) * spent
            _busy(delay)
            self.injected_s += delay
            if isinstance(output, torch.Tensor) and output.requires_grad:
                return on_backward(output, functools.partial(_backward_started, clock, 0.0 if marked[0] else 2.0 * delay))
            return output

        self._handles.append(module.register_forward_pre_hook(pre))
        self._handles.append(module.register_forward_hook(post))
        layers = getattr(module, "decoder", None)
        if isinstance(layers, torch.nn.Module):
            self._handles.append(layers.register_forward_pre_hook(layers_pre, with_kwargs=True))

    def stretch_compute(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` as this rank's emulated device runs it: (f - 1) x longer under a fault.

        The harness hands the stretched matmul to the validation GEMM, so a "slow GPU"
        is slow for every kernel, not only for the model it was attached to.
        """
        if not any(f.kind == "compute" and f.rank == self.rank for f in self.faults):
            return fn

        def stretched(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            factor = self._compute_factor()
            if factor > 1.0:
                _busy((factor - 1.0) * (time.perf_counter() - t0))
            return out

        return stretched

    # links ---------------------------------------------------------------------------
    def _links(self) -> list[Fault]:
        return [f for f in self.faults if f.kind == "link" and f.active(self.iteration)]

    def _node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def _delay_p2p(self, peer: int, nbytes: int) -> float:
        d = 0.0
        for f in self._links():
            if {self._node(self.rank), self._node(to_process(peer))} == set(f.nodes or ()):
                d += (f.factor - 1.0) * nbytes / self.bandwidth
        return d

    def _delay_collective(self, op: str, tensor: torch.Tensor, group: Any) -> float:
        links = self._links()
        if not links:
            return 0.0
        ranks = sorted(torch.distributed.get_process_group_ranks(group)) if group is not None else list(
            range(torch.distributed.get_world_size())
        )
        # the ring follows torch ranks; the links follow the processes playing them
        members = [to_process(r) for r in ranks]
        nbytes = link_bytes(op, tensor.numel() * tensor.element_size(), len(members))
        d = 0.0
        for f in links:
            if self.rank in crossing_senders(members, self.ranks_per_node, f.nodes or (0, 0)):
                d += (f.factor - 1.0) * nbytes / self.bandwidth
        return d

    def _sleep(self, delay: float) -> None:
        if delay > 0:
            time.sleep(delay)
            self.injected_s += delay

    def install(self) -> None:
        """Wrap torch.distributed below any tracer (call before the tracer installs)."""
        if self._saved or not any(f.kind == "link" for f in self.faults):
            return
        dist = torch.distributed
        c10d = dist.distributed_c10d

        for name, (op, tensor_pos, group_pos) in _COLLECTIVES.items():
            if not hasattr(dist, name):
                continue
            orig = getattr(dist, name)
            self._saved[name] = orig
            tensor_name = "output_tensor" if name == "all_gather_into_tensor" else "input" if tensor_pos else "tensor"

            def coll(*args, _orig=orig, _op=op, _t=tensor_pos, _g=group_pos, _tn=tensor_name, **kwargs):
                tensor = _arg(args, kwargs, _t, _tn)
                if isinstance(tensor, torch.Tensor):
                    self._sleep(self._delay_collective(_op, tensor, _arg(args, kwargs, _g, "group")))
                return _orig(*args, **kwargs)

            coll.__wrapped__ = orig  # type: ignore[attr-defined]
            setattr(dist, name, coll)

        for name in ("send", "isend"):
            orig = getattr(dist, name)
            self._saved[name] = orig

            def p2p(tensor, dst=None, *args, _orig=orig, **kwargs):
                if dst is not None:  # torch's dst is a global rank
                    self._sleep(self._delay_p2p(dst, tensor.numel() * tensor.element_size()))
                return _orig(tensor, dst, *args, **kwargs)

            p2p.__wrapped__ = orig  # type: ignore[attr-defined]
            # isend must still pass P2POp's "op in [isend, irecv]" check (no tracer above
            # may be there to make it so: a run without falconext)
            setattr(dist, name, P2PWrapper(p2p, orig, c10d.isend) if name == "isend" else p2p)

        orig_batch = dist.batch_isend_irecv
        self._saved["batch_isend_irecv"] = orig_batch

        def batch(p2p_ops):
            # batch_isend_irecv tells sends from receives by identity with c10d's own
            # isend, so hand it the unwrapped functions (a tracer above may have wrapped them)
            delay = 0.0
            for op in p2p_ops:
                base = inspect.unwrap(op.op)
                if base is c10d.isend:
                    delay += self._delay_p2p(op.peer, op.tensor.numel() * op.tensor.element_size())
                op.op = base
            self._sleep(delay)
            return orig_batch(p2p_ops)

        batch.__wrapped__ = orig_batch  # type: ignore[attr-defined]
        dist.batch_isend_irecv = batch

    def uninstall(self) -> None:
        """Put back the torch.distributed functions and remove the model hooks. Safe to call twice."""
        for name, orig in self._saved.items():
            setattr(torch.distributed, name, orig)
        self._saved.clear()
        for h in self._handles:
            h.remove()
        self._handles.clear()
