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

A compute fault may name the hardware instead of the rank: ``"node": n, "local_rank": l``
(the emulated node ``n`` of ``falconext nodes``, its local rank ``l``). Its ``rank`` is then
``n * ranks_per_node + l`` until the process knows which hardware it runs on
(:func:`on_hardware`): after a restart that renumbers ranks, or on a spare node, the fault
stays with the node that has it.

``end`` may be omitted (the fault lasts to the end of the run). This module is an
experiment tool: nothing in detect/, profile/, validate/ or mitigate/ imports it, and its
settings reach nobody but the process that injects them. It wraps torch.distributed
below the tracer (install it first), so the tracer sees injected delays as slow
transfers, exactly as it would see a congested link.

This module reads and answers questions about faults (no torch: the launcher reads the
fault file before any rank starts); :mod:`falconext.emulation.injector` applies them.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from falconext.inputs import InputError, loads_strict, read_text
from falconext.model.device import ring_hop_bytes

#: nominal bandwidth of a virtual link, bytes/s; a link fault of factor f adds
#: (f - 1) * bytes / this to each transfer over the link
DEFAULT_LINK_BANDWIDTH = 20e6


@dataclass(frozen=True)
class Fault:
    """One injected fault: a compute fault slows process ``rank``'s device by ``factor``, a
    link fault the link between ``nodes`` (a transfer over it takes ``factor`` times as
    long as at the link's nominal bandwidth); in force from ``start`` until ``end``
    (exclusive; None: to the end).

    ``start`` and ``end`` are on the clock of whatever injects the fault: loop
    iterations on the test bed (:func:`parse_faults` reads whole iterations and nothing
    else), simulated seconds in the discrete-event simulator (``experiments/des.py``)."""

    kind: str  # "compute" or "link"
    factor: float
    start: float  # an iteration (int) on the test bed, simulated seconds in the simulator
    end: float | None
    rank: int | None = None
    nodes: tuple[int, int] | None = None
    #: a compute fault named by its hardware: emulated node and local rank
    node: int | None = None
    local_rank: int | None = None

    def active(self, iteration: float) -> bool:
        """True when the fault is in force at ``iteration`` (or simulated time: the fault's clock)."""
        return self.start <= iteration and (self.end is None or iteration < self.end)

    def to_dict(self) -> dict[str, Any]:
        """The fault in the JSON form :func:`parse_faults` reads (``rank`` or ``nodes`` only where set)."""
        d: dict[str, Any] = {"kind": self.kind, "factor": self.factor, "start": self.start, "end": self.end}
        if self.rank is not None and self.rank >= 0:
            d["rank"] = self.rank
        if self.node is not None:
            d["node"], d["local_rank"] = self.node, self.local_rank
        if self.nodes is not None:
            d["nodes"] = list(self.nodes)
        return d


def parse_faults(obj: Any, world_size: int, ranks_per_node: int, where: str = "inject",
                 hardware_nodes: int | None = None) -> list[Fault]:
    """Validate a decoded fault list; every problem names the fault and the field. A fault
    named by hardware may name any of ``hardware_nodes`` emulated nodes (spares included;
    None: any node, as a rank sees it, which knows the job's nodes but not its spares)."""
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
        known = {"kind", "factor", "start", "end", "rank", "nodes", "node", "local_rank"}
        extra = sorted(set(f) - known)
        if extra:
            raise InputError(f"{w}: unknown field(s) {', '.join(extra)}")
        if kind == "compute" and ("node" in f or "local_rank" in f):
            node, local = f.get("node"), f.get("local_rank", 0)
            bound = hardware_nodes if hardware_nodes is not None else math.inf
            if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < bound:
                raise InputError(f"{w}: node must be in [0, {bound}), got {node!r}")
            if isinstance(local, bool) or not isinstance(local, int) or not 0 <= local < ranks_per_node:
                raise InputError(f"{w}: local_rank must be in [0, {ranks_per_node}), got {local!r}")
            faults.append(Fault("compute", float(factor), start, end, rank=node * ranks_per_node + local,
                                node=node, local_rank=local))
        elif kind == "compute":
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


def read_faults(path: str, world_size: int, ranks_per_node: int, hardware_nodes: int | None = None) -> list[Fault]:
    """The faults of the JSON file ``path``, checked against the job's size (see
    :func:`parse_faults`). Raises InputError naming the file, the fault and the field."""
    return parse_faults(loads_strict(read_text(path), path), world_size, ranks_per_node, path, hardware_nodes)


def on_hardware(faults: list[Fault], process: int, node: int, local_rank: int) -> list[Fault]:
    """``faults`` as process ``process`` sees them when it runs on emulated node ``node`` as
    local rank ``local_rank``: a fault named by hardware is this process's when it names
    this node and local rank, and no process's otherwise (pure)."""
    out = []
    for f in faults:
        if f.node is None:
            out.append(f)
        elif (f.node, f.local_rank) == (node, local_rank):
            out.append(dataclasses.replace(f, rank=process))
        else:
            out.append(dataclasses.replace(f, rank=-1))
    return out


def placed(faults: list[Fault], hardware: dict[tuple[int, int], int]) -> list[Fault]:
    """``faults`` with each one named by hardware given the process that runs there
    (``hardware``: (emulated node, local rank) -> process); one whose hardware runs no
    process of the job (a node that left, or a spare not in it) is left out (pure)."""
    out = []
    for f in faults:
        if f.node is None:
            out.append(f)
        elif (f.node, f.local_rank) in hardware:
            out.append(dataclasses.replace(f, rank=hardware[(f.node, f.local_rank or 0)]))
    return out


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


def copy_faults(path: str, out: str) -> str:
    """The fault file read once, here, and kept in the run directory as ``faults.json``,
    which the ranks read: a pipe or a file changed while the job runs cannot reach them."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise InputError(f"--inject {path}: cannot read it ({exc.strerror or exc})") from None
    os.makedirs(out, exist_ok=True)
    copy = os.path.join(out, "faults.json")
    if os.path.abspath(path) != os.path.abspath(copy):  # whole or not at all: other nodes' launchers read it
        tmp = f"{copy}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, copy)
    return copy
