"""What the controller keeps about one mitigated fail-slow, and the pure rules it uses.

The controller (control/controller.py) owns the I/O and the suspension protocol; this
module holds the decisions that need no I/O: which replica is how fast (from the
heartbeats' compute time per micro-batch), which nodes a restart leaves out, and when a
straggler under S2 has recovered.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from falconext.mitigate.planner import Planner


@dataclass
class Mitigation:
    planner: Planner
    root_cause: str  # "computation" | "communication"
    gpus: list[int]
    links: list[list[int]]
    slow_replicas: set[int] = field(default_factory=set)
    in_flight: Any = None  # the Decision whose action is being applied
    solve_s: float = 0.0
    recovered_since: int | None = None  # first iteration of the current healthy streak
    applied: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class ReplicaView:
    """The job's replicas as the heartbeats describe them."""

    times: list[float]  # compute seconds per micro-batch, per replica (slowest member)
    plan: list[int]  # micro-batches per replica now
    total: int


def replica_view(beats: Iterable[Any]) -> ReplicaView | None:
    """None until every replica has reported a compute time and its micro-batch count.

    A replica is as fast as its slowest member: its TP peers wait for each other on
    every layer, its PP stages pass every micro-batch along.
    """
    times: dict[int, float] = {}
    micro: dict[int, int] = {}
    for b in beats:
        if b.replica < 0 or b.mb_s <= 0 or b.micro <= 0:
            return None
        times[b.replica] = max(times.get(b.replica, 0.0), b.mb_s)
        micro[b.replica] = b.micro
    if not times or sorted(times) != list(range(len(times))):
        return None
    n = len(times)
    return ReplicaView([times[r] for r in range(n)], [micro[r] for r in range(n)], sum(micro.values()))


def replicas_of(ranks: Iterable[int], beats: Mapping[int, Any]) -> set[int]:
    return {beats[r].replica for r in ranks if r in beats and beats[r].replica >= 0}


def exclude_nodes(gpus: list[int], links: list[list[int]], node_of: Mapping[int, int]) -> list[int]:
    """Nodes S4 leaves out: every node holding a slow GPU; for a slow link, one of its
    two ends (the higher-numbered: either end cuts the link, and one spare is enough)."""
    nodes = {node_of[r] for r in gpus if r in node_of}
    for link in links:
        if not nodes & set(link):
            nodes.add(max(link))
    return sorted(nodes)


def straggler_recovered(times: list[float], slow: set[int], margin: float) -> bool:
    """The slow replicas compute a micro-batch within ``margin`` of the others' median."""
    others = [t for r, t in enumerate(times) if r not in slow]
    mine = [t for r, t in enumerate(times) if r in slow]
    if not others or not mine:
        return False
    return max(mine) <= (1.0 + margin) * statistics.median(others)
