"""The per-node agent: one per node, between the node's ranks and the controller.

It forwards what the node's ranks post (already decoded strictly by the bus, so
nothing malformed travels further) to the controller, and it adds what only the node
can see: the health of its GPUs (pynvml clocks, throttle reasons, temperature, power)
when a suspension starts, as evidence for the verdict. It forwards only what the
node's own ranks say (the launcher's rank-node map): a message on its stream in another
rank's name is dropped and counted in ``refused``. It holds no state worth losing: the
launcher restarts it if it dies, and ranks keep training meanwhile.

Two paths to the controller. The control flow (fail-slow reports, profiles, suspension
acks, validation results) goes on at once to the ``ctl`` stream, which the controller
reads first: what the node's ranks sent together (at a suspension, all of them) as one
:class:`~falconext.protocol.messages.NodeBatch` per kind (:func:`runs`), so that the
controller reads one message per node, not one per rank. Heartbeats, the bulk (one per rank every
``heartbeat_s``), are combined per node (:class:`HeartbeatAggregator`): the latest of
each rank, in one :class:`~falconext.protocol.messages.NodeHeartbeats` per heartbeat
period on the ``beats`` stream, so the controller reads one message per node rather than
one per rank, and a backlog of heartbeats never stands in front of a profile.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from falconext.control.shards import AnyBus
from falconext.control.client import BEATS_STREAM, CMD_STREAM, CTL_STREAM, node_copy, node_stream
from falconext.protocol.codec import MAX_MESSAGE_BYTES, pack_batch, pack_heartbeats
from falconext.protocol.commands import Suspend
from falconext.protocol.messages import BATCH_KINDS, Heartbeat, NodeBatch, NodeHealth, NodeHeartbeats

#: what a rank may post to its node stream
RANK_MESSAGES = {"Heartbeat", "FailSlowReport", "ProfileData", "SessionAck", "ValidationResult", "RankEvent"}


class HeartbeatAggregator:
    """One node's heartbeats combined into NodeHeartbeats messages (pure: the time is
    passed in). It keeps each rank's latest heartbeat; :meth:`due` says when to send
    them: ``period_s`` after the first one waiting, or as soon as every rank of the
    node (``ranks``, when known) has one waiting. A rank that beats twice before they
    go has its older beat replaced (counted in ``superseded``): a heartbeat says where
    a rank is now, and the controller needs the newest."""

    def __init__(self, node: int, period_s: float, ranks: set[int] | None = None,
                 max_bytes: int = MAX_MESSAGE_BYTES) -> None:
        if period_s <= 0:
            raise ValueError(f"period_s must be > 0, got {period_s}")
        self.node = node
        self.period_s = period_s
        self.ranks = ranks
        self.max_bytes = max_bytes
        self.superseded = 0
        self._pending: dict[int, Heartbeat] = {}
        self._since: float | None = None  # when the oldest waiting beat came

    def add(self, beat: Heartbeat, now: float) -> None:
        """Keep ``beat`` (of this node; the agent checked) to send with the others."""
        if beat.rank in self._pending:
            self.superseded += 1
        self._pending[beat.rank] = beat
        if self._since is None:
            self._since = now

    def due(self, now: float) -> bool:
        """Whether the waiting beats should go now."""
        if self._since is None:
            return False
        if self.ranks and len(self._pending) >= len(self.ranks) and self.ranks <= self._pending.keys():
            return True
        return now - self._since >= self.period_s

    def wait_s(self, now: float) -> float | None:
        """Seconds until the waiting beats are due (0: now), None when none waits."""
        if self._since is None:
            return None
        return 0.0 if self.due(now) else max(0.0, self._since + self.period_s - now)

    def flush(self) -> list[NodeHeartbeats]:
        """The waiting beats as NodeHeartbeats, each under ``max_bytes`` (one for a node of
        up to about 250 ranks), and forget them."""
        beats, self._pending, self._since = list(self._pending.values()), {}, None
        return pack_heartbeats(self.node, beats, self.max_bytes)


def runs(msgs: Sequence[Any]) -> list[list[Any]]:
    """``msgs`` (a node's ranks' control flow, in the order they came) cut into runs that
    may travel as one NodeBatch each: consecutive messages of one batch kind, each rank
    once. Order is kept (a run never overtakes what came before it); a message of another
    kind (a RankEvent) is a run of its own."""
    out: list[list[Any]] = []
    ranks: set[int] = set()
    for msg in msgs:
        last = out[-1] if out else None
        if (last is not None and type(msg) is type(last[0]) and type(msg).__name__ in BATCH_KINDS
                and msg.rank not in ranks):
            last.append(msg)
            ranks.add(msg.rank)
        else:
            out.append([msg])
            ranks = {msg.rank}
    return out


def combined(node: int, msgs: Sequence[Any], max_bytes: int = MAX_MESSAGE_BYTES) -> list[Any]:
    """What node ``node``'s agent posts for its ranks' control flow ``msgs``: each run
    (:func:`runs`) of several as NodeBatches (split to fit ``max_bytes``), a lone message
    as it is."""
    out: list[Any] = []
    for run in runs(msgs):
        out += pack_batch(node, run, max_bytes) if len(run) > 1 else run
    return out


class NodeAgent:
    """One node's agent: forwards the messages its ranks post on the node's stream to the
    controller (heartbeats combined per heartbeat period, the rest at once, what came
    together combined per kind), refusing
    (and counting in ``refused``) those that speak for a rank of another node, and
    answers a suspension with the node's GPU health. ``forwarded`` counts the ranks'
    messages that reached the controller (each heartbeat in a NodeHeartbeats counts)."""

    def __init__(self, bus: AnyBus, node: int, health: Callable[[], list[dict[str, Any]]],
                 ranks: set[int] | None = None, heartbeat_s: float = 0.5) -> None:
        self.bus = bus
        self.node = node
        self.health = health
        #: the ranks on this node (None: not known, every rank's message is forwarded)
        self.ranks = ranks
        self.beats = HeartbeatAggregator(node, heartbeat_s, ranks)
        self.forwarded = 0
        self.refused = 0

    def step(self, block_ms: int = 200) -> None:
        """Handle what arrived within ``block_ms`` milliseconds (less when heartbeats are
        due sooner), then return: forward rank messages from this node, refuse the
        others, send the node's heartbeats when due, and post a NodeHealth for every
        suspend command. Never raises for a bad message
        (the bus drops and counts it)."""
        wait = self.beats.wait_s(time.monotonic())
        if wait is not None:
            block_ms = min(block_ms, int(wait * 1000))
        cmd, ctl = node_copy(CMD_STREAM, self.node), node_copy(CTL_STREAM, self.node)
        flow: list[Any] = []  # the ranks' control flow read now, combined below
        for stream, msg in self.bus.read([node_stream(self.node), cmd], block_ms=block_ms):
            if stream == cmd:
                if isinstance(msg, Suspend):
                    self.bus.post(ctl, NodeHealth(self.node, msg.session, self.health()))
                continue
            if type(msg).__name__ not in RANK_MESSAGES:
                continue
            if not self._from_this_node(msg):
                self.refused += 1
                continue
            if isinstance(msg, Heartbeat):
                self.beats.add(msg, time.monotonic())
            else:
                flow.append(msg)
        for out in combined(self.node, flow):
            if self.bus.post(ctl, out):
                self.forwarded += len(out.rows) if isinstance(out, NodeBatch) else 1
        if self.beats.due(time.monotonic()):
            for agg in self.beats.flush():
                if self.bus.post(node_copy(BEATS_STREAM, self.node), agg):
                    self.forwarded += len(agg.rows)

    def _from_this_node(self, msg: Any) -> bool:
        """The message speaks for a rank of this node (and a heartbeat names this node)."""
        if self.ranks is not None and msg.rank not in self.ranks:
            return False
        return getattr(msg, "node", self.node) == self.node
