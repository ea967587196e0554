"""Fault injection for experiments on the test bed: slow "GPUs" and congested links.

The paper injected fail-slows with GPU clock locking and side-channel traffic; here:

- ``{"kind": "compute", "rank": r, "factor": f, "start": i, "end": j}`` stretches rank r's
  compute by f during iterations [i, j): after each forward of a micro-batch the rank
  stays busy (f - 1) times the forward's duration, and after the backward through the
  transformer layers (f - 1) times that backward's measured duration. (An earlier
  version assumed a backward costs two forwards; on CPU it costs about one, which made
  a "2x" fault 2.6-2.9x and S2's balancing on forward times miss it. A pipeline stage
  whose layers take no input gradient still uses that rule.)
- ``{"kind": "link", "nodes": [a, b], "factor": f, ...}`` congests the link between
  virtual nodes a and b (ranks grouped by ``--ranks-per-node``): a point-to-point transfer
  over it, and a collective whose ring (members in rank order) crosses it, is delayed by
  (f - 1) times the bytes the link carries over a nominal bandwidth, on the rank that
  sends over the link, before the transfer starts.

``end`` may be omitted (the fault lasts to the end of the run). This module is an
experiment tool: nothing in detect/, profile/, validate/ or mitigate/ imports it, and its
settings reach nobody but the process that injects them. It wraps torch.distributed
below the tracer (install it first), so the tracer sees injected delays as slow
transfers, exactly as it would see a congested link.
"""

from __future__ import annotations

import functools
import inspect
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from falconext.inputs import InputError, loads_strict, read_text
from falconext.testbed.device import ring_hop_bytes
from falconext.testbed.marks import mark_layers_input, marks_layers_input, on_backward
from falconext.trace.groups import to_process
from falconext.trace.wrappers import P2PWrapper

#: nominal bandwidth of a virtual link, bytes/s; a link fault of factor f adds
#: (f - 1) * bytes / this to each transfer over the link
DEFAULT_LINK_BANDWIDTH = 20e6


@dataclass(frozen=True)
class Fault:
    """One injected fault: a compute fault slows process ``rank``'s device by ``factor``, a
    link fault the link between ``nodes``; in force from iteration ``start`` until
    ``end`` (exclusive; None: to the end)."""

    kind: str  # "compute" or "link"
    factor: float
    start: int
    end: int | None
    rank: int | None = None
    nodes: tuple[int, int] | None = None

    def active(self, iteration: int) -> bool:
        """True when the fault is in force at ``iteration``."""
        return self.start <= iteration and (self.end is None or iteration < self.end)

    def to_dict(self) -> dict[str, Any]:
        """The fault in the JSON form :func:`parse_faults` reads (``rank`` or ``nodes`` only where set)."""
        d: dict[str, Any] = {"kind": self.kind, "factor": self.factor, "start": self.start, "end": self.end}
        if self.rank is not None:
            d["rank"] = self.rank
        if self.nodes is not None:
            d["nodes"] = list(self.nodes)
        return d


def parse_faults(obj: Any, world_size: int, ranks_per_node: int, where: str = "inject") -> list[Fault]:
    """Validate a decoded fault list; every problem names the fault and the field."""
    if not isinstance(obj, list):
        raise InputError(f"{where}: expected a JSON list of faults")
    n_nodes = math.ceil(world_size / ranks_per_node)
    faults = []
    for k, f in enumerate(obj):
        w = f"{where}: fault {k}"
        if not isinstance(f, dict):
            raise InputError(f"{w}: expected an object")
        kind = f.get("kind")
        if kind not in ("compute", "link"):
            raise InputError(f"{w}: kind must be 'compute' or 'link', got {kind!r}")
        factor = f.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor < 1.0:
            raise InputError(f"{w}: factor must be a finite number >= 1, got {factor!r}")
        start = f.get("start", 0)
        end = f.get("end")
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise InputError(f"{w}: start must be an iteration >= 0, got {start!r}")
        if end is not None and (isinstance(end, bool) or not isinstance(end, int) or end <= start):
            raise InputError(f"{w}: end must be null or an iteration > start, got {end!r}")
        known = {"kind", "factor", "start", "end", "rank", "nodes"}
        extra = sorted(set(f) - known)
        if extra:
            raise InputError(f"{w}: unknown field(s) {', '.join(extra)}")
        if kind == "compute":
            rank = f.get("rank")
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
                raise InputError(f"{w}: rank must be in [0, {world_size}), got {rank!r}")
            faults.append(Fault("compute", float(factor), start, end, rank=rank))
        else:
            nodes = f.get("nodes")
            if (
                not isinstance(nodes, list)
                or len(nodes) != 2
                or any(isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < n_nodes for x in nodes)
                or nodes[0] == nodes[1]
            ):
                raise InputError(f"{w}: nodes must be two different virtual nodes in [0, {n_nodes}), got {nodes!r}")
            faults.append(Fault("link", float(factor), start, end, nodes=(nodes[0], nodes[1])))
    return faults


def read_faults(path: str, world_size: int, ranks_per_node: int) -> list[Fault]:
    """The faults of the JSON file ``path``, checked against the job's size (see
    :func:`parse_faults`). Raises InputError naming the file, the fault and the field."""
    return parse_faults(loads_strict(read_text(path), path), world_size, ranks_per_node, path)


# -- factors in force (pure) ---------------------------------------------------------------
def compute_factor(faults: list[Fault], process: int, iteration: int) -> float:
    """The factor by which process ``process``'s device is slow at ``iteration``
    (product of its active compute faults; 1.0 when healthy)."""
    f = 1.0
    for fault in faults:
        if fault.kind == "compute" and fault.rank == process and fault.active(iteration):
            f *= fault.factor
    return f


def link_factor(faults: list[Fault], node_a: int, node_b: int, iteration: int) -> float:
    """The factor by which the link between virtual nodes ``node_a`` and ``node_b`` is
    slow at ``iteration`` (1.0 when healthy, and always within a node)."""
    f = 1.0
    if node_a == node_b:
        return f
    for fault in faults:
        if fault.kind == "link" and fault.active(iteration) and set(fault.nodes or ()) == {node_a, node_b}:
            f *= fault.factor
    return f


# -- the link model (pure) ----------------------------------------------------------------
def crossing_senders(members: list[int], ranks_per_node: int, link: tuple[int, int]) -> list[int]:
    """Ranks of a ring (members in rank order) whose send to the next member crosses ``link``."""
    pair = {link[0], link[1]}
    n = len(members)
    out = []
    for i, r in enumerate(members):
        nxt = members[(i + 1) % n]
        if n > 1 and {r // ranks_per_node, nxt // ranks_per_node} == pair:
            out.append(r)
    return out


#: bytes one ring link carries for a collective (one model for the injector and the
#: emulated device)
link_bytes = ring_hop_bytes


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
