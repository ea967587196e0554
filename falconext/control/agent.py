"""The per-node agent: one per node, between the node's ranks and the controller.

It forwards what the node's ranks post (already decoded strictly by the bus, so
nothing malformed travels further) to the controller's stream, so the controller reads
one stream whatever the job's size, and it adds what only the node can see: the
health of its GPUs (pynvml clocks, throttle reasons, temperature, power) when a
suspension starts, as evidence for the verdict. It forwards only what the node's own
ranks say (the launcher's rank-node map): a message on its stream in another rank's
name is dropped and counted in ``refused``. It holds no state worth losing: the
launcher restarts it if it dies, and ranks keep training meanwhile.
"""

from __future__ import annotations

from typing import Any, Callable

from falconext.control.bus import Bus
from falconext.control.client import CMD_STREAM, CTL_STREAM, node_stream
from falconext.control.messages import Command, NodeHealth

#: what a rank may post to its node stream
RANK_MESSAGES = {"Heartbeat", "FailSlowReport", "ProfileData", "SessionAck", "ValidationResult"}


class NodeAgent:
    """One node's agent: forwards the messages its ranks post on the node's stream to the
    controller, refusing (and counting in ``refused``) those that speak for a rank of
    another node, and answers a suspension with the node's GPU health. ``forwarded``
    counts what reached the controller."""

    def __init__(self, bus: Bus, node: int, health: Callable[[], list[dict[str, Any]]],
                 ranks: set[int] | None = None) -> None:
        self.bus = bus
        self.node = node
        self.health = health
        #: the ranks on this node (None: not known, every rank's message is forwarded)
        self.ranks = ranks
        self.forwarded = 0
        self.refused = 0

    def step(self, block_ms: int = 200) -> None:
        """Handle what arrived within ``block_ms`` milliseconds, then return: forward rank
        messages from this node, refuse the others, and post a NodeHealth for every suspend
        command that carries an integer session. Never raises for a bad message (the bus
        drops and counts it)."""
        for stream, msg in self.bus.read([node_stream(self.node), CMD_STREAM], block_ms=block_ms):
            if stream == CMD_STREAM:
                if isinstance(msg, Command) and msg.kind == "suspend":
                    session = msg.args.get("session")
                    if isinstance(session, int) and not isinstance(session, bool):
                        self.bus.post(CTL_STREAM, NodeHealth(self.node, session, self.health()))
                continue
            if type(msg).__name__ not in RANK_MESSAGES:
                continue
            if not self._from_this_node(msg):
                self.refused += 1
                continue
            if self.bus.post(CTL_STREAM, msg):
                self.forwarded += 1

    def _from_this_node(self, msg: Any) -> bool:
        """The message speaks for a rank of this node (and a heartbeat names this node)."""
        if self.ranks is not None and msg.rank not in self.ranks:
            return False
        return getattr(msg, "node", self.node) == self.node
