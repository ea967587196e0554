"""Per-rank tracking: collective calls in, iteration times and verified fail-slows out.

This is Falcon-Detect's tracking analysis for one rank, as plain data: the streaming
iteration tracker recovers iteration times from the call stream and BOCD+V watches
them. It knows nothing about the training loop; what a "loop iteration" is gets mapped
on at the edge (``falconext/runtime``), which needs only the times carried here.

Early on, a tracker can lock onto a unit repeated inside the iteration (a layer, a
micro-batch) and emit sub-iteration spans until it has seen enough history; when it
relocks onto a longer period, those spans may not have been iterations, so the
detector's series restarts. That includes a longer period that is not a multiple of
the old one: a data-parallel job with gradient buckets was seen to lock onto a
3-call unit and then onto its 41-call iteration, and comparing the two as one series
raised a false 18x fail-slow. A relock onto a shorter period (the job re-planned to
fewer micro-batches) keeps the detector: those spans were iterations too. The cost
of a restart is a new warm-up, during which a fail-slow is not watched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from falconext.config import DetectConfig, FalconConfig, detect_config
from falconext.detect.events import FailSlowEvent
from falconext.detect.itertime import IterationTime, IterationTracker
from falconext.detect.verify import VerifiedBOCD
from falconext.trace.records import CallRecord


@dataclass(frozen=True)
class TrackingUpdate:
    """What one call changed: iterations estimated, events confirmed/raised/ended.

    Events index the detector's series; each iteration carries its position in that
    series (None for warm-up iterations, which the detector does not see).

    ``restarted``: the period grew, so the detector starts over. ``retract``: it grew to a
    whole multiple of the old one, so the spans estimated so far were sub-iteration units
    and must be withdrawn; a growth to a non-multiple is the job's own change (a new
    micro-batch plan), and what was estimated before it stands.

    A call that changed nothing (most calls) gets one shared update, :data:`NO_CHANGE`,
    whose sequences are empty tuples: read an update, never modify it.
    """

    iterations: Sequence[tuple[int | None, IterationTime]]  # None: a warm-up iteration
    events: Sequence[FailSlowEvent]
    restarted: bool = False
    retract: bool = False
    #: iterations that held an insertion, completed by this call (IterationTracker.take_inserted):
    #: not estimates, but each one iteration of the rank's work (the fast path reads its compute)
    inserted: Sequence[IterationTime] = ()


#: the update of a call that completed no iteration (shared: allocating one per call
#: would cost more than following the call)
NO_CHANGE = TrackingUpdate((), ())


class RankTracking:
    """Iteration tracker and BOCD+V detector of one rank, fed its calls in issue order."""

    def __init__(self, config: FalconConfig | DetectConfig | None = None) -> None:
        self.config = detect_config(config)
        self.tracker = IterationTracker(self.config)
        self.detector = VerifiedBOCD(self.config)
        self.series = 0  # iteration times fed to the current detector
        self.seen = 0  # iteration times estimated (warm-up included)
        self.restarts = 0
        self._period: int | None = None

    def feed(self, record: CallRecord) -> TrackingUpdate:
        """Take the rank's next call; the iterations it completed and the events they
        confirmed, raised or ended (:data:`NO_CHANGE` when none)."""
        its = self.tracker.feed(record)
        if not its:
            if self.tracker._inserted:
                return TrackingUpdate((), (), inserted=self.tracker.take_inserted())
            return NO_CHANGE
        out_its: list[tuple[int, IterationTime]] = []
        events: list[FailSlowEvent] = []
        restarted = retract = False
        for it in its:
            if self._period is not None and it.period > self._period:
                self.detector = VerifiedBOCD(self.config)  # earlier spans may have been sub-iteration
                self.series = 0
                self.seen = 0
                self.restarts += 1
                restarted = True
                retract = retract or it.period % self._period == 0
            self._period = it.period
            if it.duration <= 0:
                continue
            self.seen += 1
            if self.seen <= self.config.tracking_warmup:
                out_its.append((None, it))
                continue
            out_its.append((self.series, it))
            events.extend(self.detector.feed(it.duration))
            self.series += 1
        return TrackingUpdate(out_its, events, restarted, retract, self.tracker.take_inserted())

    @property
    def period(self) -> int | None:
        """Calls per iteration of the tracker's current template, or None while it searches."""
        return self.tracker.period
