"""The job as the ranks' heartbeats describe it: :class:`JobView`.

The controller's collaborators read the job from here: each rank's latest heartbeat and
a bounded history of them, the ranks it waits for, the job's iteration time while
nothing was wrong, and what a restart without some nodes leaves (a
:class:`~falconext.mitigate.room.RestartRoom`).
"""

from __future__ import annotations

import collections
import math
from typing import Any, Iterable, Mapping

import numpy as np

from falconext.control.beat_table import ITER_S, ITERATION, RANK, BeatTable, KeptReadings, LatestBeats, Reading
from falconext.protocol.messages import Heartbeat, heartbeat_row
from falconext.mitigate.room import RestartRoom


class JobView:
    """Heartbeats kept for decisions. ``world``: the ranks the controller waits for (None:
    those heard from); ``keep``: heartbeats kept per rank (and clean readings kept)."""

    def __init__(self, world: int | None, keep: int) -> None:
        """An empty view: no rank heard from yet."""
        self.world = world
        self.keep = keep
        self.table = BeatTable(keep)
        #: each rank's latest heartbeat (a read-only view of the table)
        self.beats = LatestBeats(self.table)
        #: each rank's readings of its recent iterations: S3 reads each process's compute
        #: before the onset
        self.history = KeptReadings(self.table)
        self.first_beat: dict[int, int] = {}  # rank -> iteration of its first heartbeat seen
        self.first_rank = math.inf  # the lowest rank heard from: min(self.beats), kept
        #: the job's iteration time while nothing was wrong: (iteration, iter_s) of the
        #: first rank's heartbeats taken with no episode open and no mitigation in force
        #: (from beat_iter_window iterations after the plan last changed: a heartbeat is a
        #: median of that many); a topology change or restart starts it over
        self.clean: collections.deque[tuple[int, float]] = collections.deque(maxlen=keep)
        self.clean_from = 0
        #: the iteration the job restarted from at the latest S4 (-1: none): a report of
        #: a fail-slow that began before it is of processes that are gone
        self.restart_from = -1

    def ranks(self) -> set[int]:
        """The ranks the controller waits for: ``range(world)`` when the world size is known, else those
        that have sent a heartbeat."""
        if self.world is not None:
            return set(range(self.world))
        return set(self.beats)

    def expected(self) -> int:
        """How many ranks the controller waits for."""
        return self.world if self.world is not None else len(self.beats)

    def covers(self, got: Mapping[int, Any]) -> bool:
        """Whether ``got`` (by rank) has every rank the controller waits for; constant work
        until it has as many (it is asked once per profile, ack and result: at 16,384
        ranks, building the sets every time made a session's messages quadratic)."""
        if len(got) < self.expected():
            return False
        return got.keys() >= self.ranks()

    def record(self, beat: Heartbeat, clean: bool) -> None:
        """Keep ``beat`` (one reading per loop iteration and rank: a later heartbeat of the
        same iteration and role replaces the earlier); ``clean``: nothing is wrong now, so
        the first rank's iteration time is the job's healthy one (from ``clean_from`` on)."""
        self.record_block(np.array([heartbeat_row(beat)]), clean, made=beat)

    def record_block(self, block: np.ndarray, clean: bool, made: Heartbeat | None = None) -> None:
        """Keep a block of heartbeats (rows of every Heartbeat field, as
        :meth:`NodeHeartbeats.block <falconext.protocol.messages.NodeHeartbeats.block>`
        gives them), each as :meth:`record` keeps one; ``made``: a one-row block's
        Heartbeat."""
        for rank, it in _first_iterations(block, self.table.record(block, made)).items():
            self.first_rank = min(self.first_rank, rank)
            self.first_beat.setdefault(rank, it)
        if not clean or not math.isfinite(self.first_rank):
            return
        first = np.flatnonzero(block[:, RANK] == self.first_rank)
        for i in first.tolist():
            it, iter_s = int(block[i, ITERATION]), float(block[i, ITER_S])
            if it >= self.clean_from and iter_s > 0:
                self.clean_keep((it, iter_s))

    def clean_keep(self, reading: tuple[int, float]) -> None:
        """Keep a clean (iteration, iter_s) reading, replacing one of the same iteration."""
        _keep_latest(self.clean, reading, bool(self.clean) and self.clean[-1][0] == reading[0])

    def clean_before(self, onset: int) -> list[float]:
        """The clean iteration times read at or before ``onset``."""
        return [x for it, x in self.clean if it <= onset]

    def first_beats(self) -> Iterable[Reading]:
        """The kept readings of the lowest rank heard from (none yet: empty)."""
        return self.history.get(int(self.first_rank), ()) if math.isfinite(self.first_rank) else ()

    def node_of(self) -> dict[int, int]:
        """Each rank's node, from its latest heartbeat."""
        return dict(zip(self.table.ranks(), self.table.column("node").astype(int).tolist()))

    def plan_changed(self, strategy: str, effective: int, window: int) -> None:
        """A strategy took effect at iteration ``effective``: clean readings count again
        ``window`` iterations later (a heartbeat is a median of that many); S3 and S4 make
        another job (another layout, other nodes), whose healthy time is read anew; after
        S4 every process restarted, and what they said before is forgotten."""
        self.clean_from = effective + window
        if strategy in ("S3", "S4"):
            self.clean.clear()
        if strategy == "S4":
            self.restart_from = effective
            self.table.clear()

    def new_round(self, world: int) -> None:
        """Every process of the job started again in a new rendezvous round of ``world``
        ranks (when the world size is known): what the ranks said before is forgotten."""
        if self.world is not None:
            self.world = world
        self.table.clear()
        self.first_beat.clear()
        self.clean.clear()

    def restart_room(self, floor: int, node_hosts: Mapping[int, str], plane_host: str | None,
                     spares: int) -> RestartRoom:
        """What the job can absorb when nodes leave (see RestartRoom): the heartbeats'
        nodes, the launcher's ``floor``, the ``spares`` waiting, and the nodes on the
        plane's host (``node_hosts``), which cannot leave."""
        nodes = set(self.table.column("node").astype(int).tolist())
        fixed = tuple(sorted(n for n, h in node_hosts.items() if h == plane_host))
        return RestartRoom(len(nodes), floor, spares, fixed)


def _first_iterations(block: np.ndarray, fresh: list[int]) -> dict[int, int]:
    """Each of the ranks ``fresh`` (new to the table) with the iteration of its first row in
    ``block``."""
    if not fresh:
        return {}
    first: dict[int, int] = {}
    for r, it in zip(block[:, RANK].astype(np.int64).tolist(), block[:, ITERATION].astype(np.int64).tolist()):
        first.setdefault(r, it)
    return {r: first[r] for r in fresh}


def _keep_latest(kept: collections.deque, item: Any, same: bool) -> None:
    """Append ``item`` to ``kept``, or replace its last entry when ``same`` (another reading
    of the same loop iteration)."""
    if same:
        kept[-1] = item
    else:
        kept.append(item)
