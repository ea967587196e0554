"""What a job of several launchers can absorb when nodes leave (S4 "without node X").

Pure rules: how few nodes the job can train on with its global batch unchanged
(:func:`shrink_floor`, the launcher's), and whether an exclusion leaves the job able to go
on (:class:`RestartRoom`, the controller's, before it starts an S4). See
:mod:`falconext.elastic.restart` for how the restart itself runs.
"""

from __future__ import annotations

from dataclasses import dataclass


def shrink_floor(nodes: int, nproc_per_node: int, tp: int, pp: int, global_batch: int, micro_batch: int) -> int:
    """The fewest nodes (1..``nodes``) the job can train on with the same global batch and
    the same model-parallel layout: the world divides by TP x PP, and the global batch by
    micro-batch x DP (pure). ``nodes`` itself when no fewer can."""
    mp = max(1, tp) * max(1, pp)
    for n in range(1, nodes + 1):
        world = n * nproc_per_node
        if world % mp:
            continue
        dp = world // mp
        if global_batch % (max(1, micro_batch) * dp) == 0:
            return n
    return nodes


@dataclass(frozen=True)
class RestartRoom:
    """What a multi-node job can absorb when nodes leave: ``nodes`` in the job now, the
    ``floor`` it can shrink to (0: no floor, one launcher that replaces nodes itself),
    ``spares`` waiting, and ``fixed`` nodes that cannot leave (the one hosting the
    rendezvous store and the control plane)."""

    nodes: int
    floor: int = 0
    spares: int = 0
    fixed: tuple[int, ...] = ()

    def refusal(self, exclude: list[int]) -> str | None:
        """Why excluding ``exclude`` would stop the job (one line), or None when it can go on."""
        if self.floor <= 0:
            return None
        if not exclude:
            return None
        stuck = sorted(set(exclude) & set(self.fixed))
        if stuck:
            return (f"node {stuck[0]} hosts the rendezvous store and the control plane and cannot leave; "
                    "training goes on with it")
        k = len(set(exclude))
        if self.nodes - k + min(self.spares, k) >= self.floor:  # spares fill in; the rest shrinks
            return None
        return (f"no spare node waits and the job cannot shrink below {self.floor} node(s) with its global batch "
                f"unchanged ({self.nodes} now); training goes on with the slow node")

    def nodes_left(self, exclude: list[int]) -> int:
        """The nodes the job trains on after excluding ``exclude`` (spares fill what they can)."""
        k = len(set(exclude))
        return self.nodes - k + min(self.spares, k)

    def after_s(self, exclude: list[int], healthy_s: float) -> float:
        """The iteration time expected after excluding ``exclude``: healthy where spares fill
        every place, else the healthy time scaled by the nodes lost (the same global batch on
        fewer data-parallel replicas)."""
        return healthy_s * self.nodes / max(1, self.nodes_left(exclude))

    def slower(self, exclude: list[int], healthy_s: float | None, level_s: float | None) -> str | None:
        """Why excluding ``exclude`` would leave the job no faster than its ``level_s`` now
        (a shrink that costs more than the slow node does), or None."""
        if self.floor <= 0 or not exclude or not healthy_s or not level_s:
            return None
        after = self.after_s(exclude, healthy_s)
        if after < level_s:
            return None
        return (f"without a spare the job would shrink to {self.nodes_left(exclude)} node(s) and train at about {after:.3f} s per "
                f"iteration, no faster than {level_s:.3f} s now; training goes on with the slow node")
