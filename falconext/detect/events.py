"""Fail-slow events and the interface every detector shares.

All three detectors (BOCD+V, plain BOCD, slide-window) are fed one iteration time at a
time and answer with the events whose state changed at that iteration, so the same
evaluation, command line and in-job wiring drive any of them (the ablation compares them
on exactly the same stream).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Iterable, Protocol


class InvalidSample(ValueError):
    """An iteration time that is not a finite positive number."""


@dataclass(frozen=True)
class FailSlowEvent:
    """A fail-slow as the detector sees it.

    Indices are 0-based iteration indices of the fed series. ``onset`` is the first slow
    iteration, ``detected_at`` the iteration at which the online detector confirmed it,
    ``end`` the first healthy iteration after it (exclusive) or None while it lasts.
    ``slowdown`` is the slow iteration time over the healthy one (1.5 = 50% slower): the
    highest sustained level seen so far. ``ended_at`` is when the recovery was confirmed.
    """

    id: int
    onset: int
    detected_at: int
    slowdown: float
    baseline: float
    end: int | None = None
    ended_at: int | None = None

    def to_dict(self) -> dict:
        """The fields a report shows: onset, detected_at, end and slowdown (4 decimals)."""
        return {
            "onset": self.onset,
            "detected_at": self.detected_at,
            "end": self.end,
            "slowdown": round(self.slowdown, 4),
        }

    def full_dict(self) -> dict:
        """Every field, unrounded (for logs that must be read back exactly)."""
        return asdict(self)

    def with_(self, **changes) -> "FailSlowEvent":
        """A copy with ``changes`` applied (the event is frozen; the id is kept unless changed)."""
        return replace(self, **changes)


class Detector(Protocol):
    """Online detector: feed iteration times, receive the events that changed."""

    name: str

    def feed(self, value: float) -> list[FailSlowEvent]:
        """Absorb one iteration time; return events confirmed, escalated or ended now."""

    @property
    def events(self) -> list[FailSlowEvent]:
        """Every event so far, latest state, in onset order."""


def check_sample(value: float, index: int) -> float:
    """Reject what cannot be an iteration time, naming the iteration."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            value = float(value)  # numpy scalars
        except (TypeError, ValueError):
            raise InvalidSample(f"iteration {index}: not a number ({value!r})") from None
    value = float(value)
    if math.isnan(value):
        raise InvalidSample(f"iteration {index}: iteration time is NaN")
    if not math.isfinite(value):
        raise InvalidSample(f"iteration {index}: iteration time is infinite")
    if value <= 0:
        raise InvalidSample(f"iteration {index}: iteration time must be > 0, got {value}")
    return value


def run_detector(detector: Detector, series: Iterable[float]) -> list[FailSlowEvent]:
    """Batch API: feed a whole series and return the final state of every event."""
    for value in series:
        detector.feed(value)
    return list(detector.events)


class EventBook:
    """The events of one detector, keyed by id, so updates replace the older state."""

    def __init__(self) -> None:
        self._events: dict[int, FailSlowEvent] = {}
        self._next_id = 0

    def open(self, onset: int, detected_at: int, slowdown: float, baseline: float) -> FailSlowEvent:
        """Record a new event with the next id (0, 1, ...) and return it."""
        ev = FailSlowEvent(self._next_id, onset, detected_at, slowdown, baseline)
        self._next_id += 1
        self._events[ev.id] = ev
        return ev

    def update(self, ev: FailSlowEvent) -> FailSlowEvent:
        """Replace the stored state of ``ev`` (same id) by ``ev``; returns ``ev``."""
        self._events[ev.id] = ev
        return ev

    @property
    def all(self) -> list[FailSlowEvent]:
        """Every event's latest state, ordered by onset then id."""
        return sorted(self._events.values(), key=lambda e: (e.onset, e.id))
