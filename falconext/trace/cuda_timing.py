"""Transfer times from CUDA events, turned into host times off the training thread."""

from __future__ import annotations

import functools
from collections import deque
from typing import Any, Callable

from falconext.trace.entry import EV0, EV1, T_ISSUE


class CudaTiming:
    """CUDA events for transfer times, resolved into host times off the training thread.

    The training thread only records events (pooled, so no event creation per call).
    Host times come from a reference event recorded on an otherwise idle side stream
    next to a host clock reading: ``host(ev) = ref_host + ref.elapsed_time(ev)``. The
    reference is renewed every ``recalibrate_s`` so GPU/host clock drift stays small;
    each event is converted with the newest reference taken before its call was issued,
    so elapsed times are never negative. ``event_factory``/``side_record`` are injected
    by tests (no GPU on CI); by default they are torch.cuda's.
    """

    def __init__(
        self,
        clock: Callable[[], float],
        event_factory: Callable[[], Any] | None = None,
        side_record: Callable[[Any], None] | None = None,
        recalibrate_s: float = 10.0,
    ) -> None:
        if event_factory is None or side_record is None:
            import torch  # lazy: start-up time (falconext.trace is torch-free: the CLI imports it)

            if not torch.cuda.is_available():
                raise RuntimeError("cuda_events=True needs a CUDA device")
            side = torch.cuda.Stream(device=torch.cuda.current_device())
            event_factory = functools.partial(torch.cuda.Event, enable_timing=True)
            side_record = lambda ev: ev.record(side)  # noqa: E731
        self._clock = clock
        self._new = event_factory
        self._side_record = side_record
        self.recalibrate_s = recalibrate_s
        self._pool: deque[Any] = deque()
        self._refs: deque[tuple[float, Any]] = deque(maxlen=8)  # (host time, event), resolved
        self._pending_ref: tuple[float, Any] | None = None
        self.calibrate()

    def record(self) -> Any:
        """An event recorded on the current stream (training thread; never waits)."""
        try:
            ev = self._pool.pop()
        except IndexError:
            ev = self._new()
        ev.record()
        return ev

    def calibrate(self) -> None:
        """Record a new reference event on the side stream with the host clock's reading; it is adopted
        once complete (:meth:`maintain`)."""
        ev = self._new()
        self._side_record(ev)
        self._pending_ref = (self._clock(), ev)

    def maintain(self) -> None:
        """Adopt a completed reference; start a new one when the newest is old."""
        pending = self._pending_ref
        if pending is not None:
            if pending[1].query():
                self._refs.append(pending)
                self._pending_ref = None
        elif not self._refs or self._clock() - self._refs[-1][0] > self.recalibrate_s:
            self.calibrate()

    def to_host(self, ev: Any, t_issue: float) -> float | None:
        """Host time of a completed event, or None while it (or any reference) is pending."""
        if ev is None or not self._refs or not ev.query():
            return None
        ref_host, ref = self._refs[0]
        for host, r in self._refs:
            if host <= t_issue:
                ref_host, ref = host, r
        return ref_host + ref.elapsed_time(ev) / 1000.0

    def resolve(self, e: list) -> tuple[float | None, float | None] | None:
        """(t_start, t_end) of an entry whose end event was recorded, once both resolved."""
        t_end = self.to_host(e[EV1], e[T_ISSUE])
        if t_end is None:
            return None
        t_start = self.to_host(e[EV0], e[T_ISSUE]) if e[EV0] is not None else None
        for i in (EV0, EV1):
            if e[i] is not None:
                self._pool.append(e[i])
                e[i] = None
        return t_start, t_end

    def start_or_none(self, e: list) -> float | None:
        """t_start of an entry given up on (its end never came); events are not reused."""
        return self.to_host(e[EV0], e[T_ISSUE])
