"""Per-rank tracking inside a training process, off the training thread.

A background thread drains the call tracer's ring buffer, writes the call log, feeds
:class:`falconext.detect.tracking.RankTracking`, and reports estimated iteration times and
verified fail-slows. The detector sees nothing but the calls; this module only
translates its indices into the training loop's iteration numbers for reporting, using
the times at which the loop started each iteration (an estimated iteration is the span
between two anchor calls, and belongs to the loop iteration its first anchor fell in).

Without loop hooks (``loop_starts`` None: a job that only has its calls) the tracker's
own count is the clock: an estimated iteration is numbered by the calls since the
stream began (the tracer is installed between iterations), in periods, and the next
one by the periods since the last (occasional inserted calls round away). Every rank of
a job counts the same iterations that way, so events, heartbeats and the first call of
an agreed iteration (:meth:`RankMonitor.first_seq_of`, where a suspension traps) need
nothing from the training loop.

Its own cost is kept as thread CPU time (:meth:`RankMonitor.cpu_seconds`): the thread
reads its CPU clock after each round, and the final drain in :meth:`RankMonitor.stop`,
which runs on the stopping thread, is timed there.
"""

from __future__ import annotations

import bisect
import collections
import os
import threading
import time
from typing import Any, Callable

from falconext.config import FalconConfig
from falconext.protocol.eventlog import EventLog
from falconext.protocol.rank_side import FAIL_SLOW_END, FAIL_SLOW_UPDATE, EventReports
from falconext.detect.events import FailSlowEvent
from falconext.detect.scores import BusyClock, RankSample, recent_sample, split_iteration
from falconext.detect.steps import ComputeStep
from falconext.detect.itertime import IterationTime
from falconext.detect.tracking import RankTracking
from falconext.profile.window import RecentCollectives
from falconext.trace.records import RecordError


class CallLog:
    """A rank's call log (JSON lines), rotated at ``max_bytes``: the full file becomes
    ``<path>.1`` (replacing the previous one) and writing starts afresh, so a job of weeks
    keeps at most twice the cap on disk. ``max_bytes`` 0: no cap."""

    def __init__(self, path: str, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.rotations = 0
        #: records left out for a time JSON cannot write (NaN, infinity)
        self.skipped = 0
        self._f = open(path, "w")
        self._size = 0

    def write(self, rec: Any) -> None:
        """Append ``rec`` (a CallRecord) as one JSON line, rotating first when the line would
        take the file past ``max_bytes`` (a single oversized line is still written whole)."""
        self.write_many([rec])

    def write_many(self, recs: list[Any]) -> None:
        """:meth:`write` each of ``recs``, in one write to the file when they fit under the
        cap (the monitor logs a round's calls at once). A record with a time JSON has no
        form for (NaN, infinity) is left out and counted in :attr:`skipped`."""
        lines = []
        for rec in recs:
            try:
                lines.append(rec.to_json() + "\n")
            except RecordError:
                self.skipped += 1
        size = sum(len(line) for line in lines)
        if self.max_bytes and self._size + size > self.max_bytes:
            for line in lines:  # rotate where a line would pass the cap
                self._write_line(line)
            return
        self._f.write("".join(lines))
        self._size += size

    def _write_line(self, line: str) -> None:
        if self.max_bytes and self._size + len(line) > self.max_bytes and self._size:
            self._f.close()
            os.replace(self.path, self.path + ".1")
            self._f = open(self.path, "w")
            self._size = 0
            self.rotations += 1
        self._f.write(line)
        self._size += len(line)

    def close(self) -> None:
        """Close the file; a later :meth:`write` raises ValueError."""
        self._f.close()


#: spans of a new period that tell whether it is shorter than the loop's iterations
BELOW_LOOP_SPANS = 6


class RankMonitor:
    """One rank's analysis thread: drains the tracer's records once per loop iteration (or
    every ``interval_s`` without loop hooks), writes
    the call log, estimates iteration times from the calls alone, runs detection on them
    and keeps the rank's recent compute/wait sample for the straggler scores. Fail-slow
    events go to ``events`` and ``on_event``; nothing it does blocks the training thread."""

    def __init__(
        self,
        drain: Callable[[], list],
        config: FalconConfig,
        rank: int,
        loop_starts: list[float] | None,
        events: EventLog,
        call_log_path: str | None,
        interval_s: float | None = None,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
        first_iteration: int = 0,
        spill: Callable[[list[tuple[int, float, tuple[float, float] | None]]], None] | None = None,
        on_iteration_s: Callable[[float], None] | None = None,
    ) -> None:
        self.drain = drain
        #: takes the oldest estimates once more than 2 x 8192 are held (a long job's memory
        #: stays bounded); None: they are dropped
        self.spill = spill
        #: told the rank's recent iteration time (median) whenever it is re-estimated
        self.on_iteration_s = on_iteration_s
        self.first_iteration = first_iteration  # loop_starts[0] is this iteration (a resumed job)
        self.tracking = RankTracking(config)
        self.rank = rank
        self.loop_starts = loop_starts  # appended by the training thread; None: no loop hooks
        #: the latest iteration number given to an estimate (-1: none yet)
        self.tracked = -1
        #: without loop hooks: (iteration, tracer seq of the call that ended it, calls per
        #: iteration) of the latest estimate, replaced whole; None until one is numbered
        self.clock: tuple[int, int, int] | None = None
        self.events = events
        #: the longest sleep between two reads of the calls: with loop hooks the loop wakes
        #: the thread once per iteration (:meth:`wake`), without them it polls
        self.interval = interval_s if interval_s is not None else (
            config.monitor_idle_s if loop_starts is not None else config.monitor_poll_s)
        self._wake = threading.Event()
        self.estimates: dict[int, float] = {}  # loop iteration -> estimated seconds
        #: loop iteration -> (compute, waiting) seconds of the estimated iteration
        self.splits: dict[int, tuple[float, float]] = {}
        self._busy = BusyClock()
        #: the newest score_window estimates, one per loop iteration (a later span that maps to
        #: an iteration already here replaces its estimate, as in ``estimates``)
        self._recent_its: collections.deque[tuple[int, float, float, float]] = collections.deque(
            maxlen=config.score_window)
        #: (newest loop iteration, medians over the last score_window iterations), replaced
        #: whole by the monitor thread so the control thread reads it without a lock
        self.score_sample: tuple[int, RankSample] | None = None
        #: the fast path's rank side (detect/steps.py): this rank's compute against its own
        #: level, one reading per loop iteration, and (newest loop iteration, run, run's
        #: ratio), replaced whole so the control thread reads it without a lock
        self._step = ComputeStep.from_config(config) if config.fast_ratio else None
        self._step_fed = -1
        self._step_reset = False
        self.step_sample: tuple[int, int, float] | None = None
        self._series_to_loop: dict[int, int] = {}
        self._keep = 8192
        self._calls = CallLog(call_log_path, int(config.call_log_max_mb * 2**20)) if call_log_path else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"falcon-monitor-{rank}", daemon=True)
        self.records = 0
        self.errors = 0
        self._period: int | None = None
        #: with loop hooks: whether the followed period's spans are shorter than the loop's
        #: iterations (a micro-batch or a layer): see _shorter_than_the_loop
        self._below_loop: tuple[int, list[int] | bool] | None = None  # (period, its spans' loop iterations or the verdict)
        #: which changes of the detector's events are reported, under run-wide ids
        self._reports = EventReports()
        self.on_event = on_event
        self._recent = RecentCollectives()
        self._recent_lock = threading.Lock()
        #: paused: the thread wakes up but neither drains nor analyses (falcon off)
        self._paused = False
        self._thread_cpu_s = 0.0  # the thread's own CPU clock, as it last read it
        self._stop_cpu_s = 0.0  # the final drain in stop(), on the stopping thread

    def start(self) -> None:
        """Start the analysis thread (once); returns at once."""
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread after a final drain (called once training has ended)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)
        cpu0 = time.thread_time()
        self._round()
        self._stop_cpu_s += time.thread_time() - cpu0
        if self._calls:
            try:
                self._calls.close()
            except OSError as exc:  # the end of training must not fail on falconext's log
                self.errors += 1
                self.events.emit("monitor_error", rank=self.rank, error=f"call log not closed: {exc!r}")

    def pause(self, paused: bool) -> None:
        """Stop (True) or resume (False) draining and analysing; records wait in the ring."""
        self._paused = bool(paused)

    def cpu_seconds(self) -> float:
        """Thread CPU seconds this monitor has used: its thread's, up to its latest round,
        plus the final drain's."""
        return self._thread_cpu_s + self._stop_cpu_s

    def wake(self) -> None:
        """Read the calls now (the training loop calls this once per iteration): the
        thread sleeps between iterations instead of polling, so its cost follows the
        work, not the wall clock."""
        self._wake.set()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.wait(self.interval)
                self._wake.clear()
                if self._stop.is_set():
                    break
                if not self._paused:
                    self._round()
                self._thread_cpu_s = time.thread_time()
        finally:
            self._thread_cpu_s = time.thread_time()

    def _round(self) -> None:
        """One drain and analysis; whatever it raises (a full disk under the call log, a
        bug) is counted and logged, and the thread goes on with the next round."""
        try:
            self._process()
        except Exception as exc:
            self.errors += 1
            try:
                self.events.emit("monitor_error", rank=self.rank, error=f"monitor round failed: {exc!r}",
                                 errors=self.errors)
            except Exception:  # the event log itself failed: the count is all that is left
                pass

    def _loop_iteration(self, t_begin: float, t_end: float) -> int | None:
        """The loop iteration an anchor-to-anchor span overlaps most.

        Where the anchor sits in the iteration is the tracker's choice (the call after
        the longest pause), so a span may run from late in one loop iteration to late in
        the next; it then measures the second one, and overlap says so.
        """
        starts = self.loop_starts
        i = bisect.bisect_right(starts, t_begin) - 1
        if i < 0:
            return None
        if i + 1 < len(starts):
            first = starts[i + 1] - t_begin
            second = t_end - starts[i + 1]
            if second > first:
                return self.first_iteration + i + 1
        return self.first_iteration + i

    def _tracker_iteration(self, it: IterationTime, seq_end: int) -> int:
        """The number of the iteration ``it`` measures (its last call has tracer seq
        ``seq_end``), as the tracker counts them from the stream's start; always after
        the previous number."""
        period = it.period
        n = max(self.first_iteration + it.iteration, self.tracked + 1)
        self.clock = (n, seq_end, period)
        return n

    def _spill(self) -> None:
        """Hand the oldest estimates over to ``spill``, keeping the latest 8192."""
        old = sorted(self.estimates)[: len(self.estimates) - self._keep]
        rows = [(n, self.estimates.pop(n), self.splits.pop(n, None)) for n in old]
        if self.spill is None:
            return
        try:
            self.spill(rows)
        except Exception as exc:  # a full disk must not stop tracking
            self.errors += 1
            self.events.emit("monitor_error", rank=self.rank, error=f"estimates not written: {exc!r}")

    def first_seq_of(self, iteration: int) -> int | None:
        """The tracer seq of the first call of ``iteration`` as this rank's calls count
        iterations (no loop hooks); None before the first estimate."""
        clock = self.clock
        if clock is None:
            return None
        n, seq_end, period = clock
        return seq_end + 1 + (iteration - n - 1) * period

    def _process(self) -> None:
        try:
            records = self.drain()
        except Exception as exc:  # the tracer must never take training down
            self.errors += 1
            self.events.emit("monitor_error", rank=self.rank, error=repr(exc))
            return
        with self._recent_lock:
            for rec in records:
                self._recent.feed(rec)
        if self._calls and records:
            self._calls.write_many(records)
        for rec in records:
            self.records += 1
            self._busy.feed(rec.t_issue, rec.t_end)
            seq_offset = 0 if rec.seq is None else rec.seq - self.tracking.tracker.calls
            try:
                update = self.tracking.feed(rec)
            except ValueError as exc:
                self.errors += 1
                self.events.emit("monitor_error", rank=self.rank, error=str(exc))
                continue
            if update.restarted:  # a new detector series: its indices start again at 0
                self._series_to_loop.clear()
            if update.retract:  # the spans so far were sub-iteration units: withdraw them
                self.estimates.clear()
                self.splits.clear()
                self._recent_its.clear()
                self.clock = None
                self._step_reset = True
                self.step_sample = None
            for it in update.inserted:  # not an estimate: the fast path's compute reading only
                if self.loop_starts is None:
                    n = self.first_iteration + it.iteration if it.iteration >= 0 and self.clock else None
                elif self._below_loop == (it.period, False):  # spans of this period are iterations
                    n = self._loop_iteration(it.t_begin, it.t_end)
                else:
                    n = None
                if n is not None and n > self.tracked:
                    self._feed_step(n, split_iteration(it.duration, self._busy.busy(it.t_begin, it.t_end))[0])
            for k, it in update.iterations:
                if self.loop_starts is None:
                    n = self._tracker_iteration(it, it.seq_end + seq_offset)
                else:
                    n = self._loop_iteration(it.t_begin, it.t_end)
                    if n is not None and self._shorter_than_the_loop(it.period, n):
                        continue
                if n is None:
                    continue
                self.tracked = max(self.tracked, n)
                self.estimates[n] = it.duration
                split = split_iteration(it.duration, self._busy.busy(it.t_begin, it.t_end))
                self.splits[n] = split
                self._remember(n, (it.duration, *split))
                self._feed_step(n, split[0])
                sample = recent_sample([row[1:] for row in self._recent_its])
                if sample is not None:
                    self.score_sample = (n, sample)
                    if self.on_iteration_s is not None:
                        self.on_iteration_s(sample.iter_s)
                if k is None:  # warm-up: estimated, not watched
                    continue
                self._series_to_loop[k] = n
                if len(self._series_to_loop) > 2 * self._keep:
                    for old in sorted(self._series_to_loop)[: self._keep]:
                        del self._series_to_loop[old]
            if len(self.estimates) > 2 * self._keep:
                self._spill()
            if self.tracking.period != self._period and self.tracking.period is not None:
                self._period = self.tracking.period
                self.events.emit("period", rank=self.rank, period=self._period)
            below = self._below_loop is not None and self._below_loop == (self.tracking.period, True)
            for ev in update.events:
                if not below:
                    self._report(ev)

    def restep(self) -> None:
        """The rank's work per iteration changed (a new plan or role): its compute level is
        learnt again from the next iteration (any thread; the monitor thread acts on it)."""
        self._step_reset = True

    def _feed_step(self, n: int, compute_s: float) -> None:
        """Loop iteration ``n``'s compute to the fast path's step counter, once per
        iteration, in order (a re-estimate of an iteration already fed is not fed again)."""
        if self._step is None:
            return
        if self._step_reset:
            self._step_reset = False
            self._step.reset()
        if n <= self._step_fed:
            return
        self._step_fed = n
        run = self._step.feed(compute_s)
        self.step_sample = (n, run, self._step.recent_ratio())

    def _remember(self, n: int, row: tuple[float, float, float]) -> None:
        """Keep loop iteration ``n``'s estimate among the recent ones: in place of an earlier
        estimate of the same iteration, else as the newest."""
        for i, old in enumerate(self._recent_its):
            if old[0] == n:
                self._recent_its[i] = (n, *row)
                return
        self._recent_its.append((n, *row))

    def _shorter_than_the_loop(self, period: int, n: int) -> bool:
        """Whether spans of ``period`` calls are shorter than the loop's iterations. Judged
        over a period's first :data:`BELOW_LOOP_SPANS` spans (``n``: the loop iteration
        each fell in): when they fall in fewer than two thirds as many loop iterations,
        the period is a unit inside the iteration (a micro-batch, which the tracker
        follows until its history shows the iteration), and from then until the tracker
        follows another period its spans are neither estimates nor watched; what was
        estimated under it is withdrawn. A plan change can put two spans in one loop
        iteration once, which one look would take for a unit."""
        judged = self._below_loop
        if judged is None or judged[0] != period:
            judged = self._below_loop = (period, [])
        seen = judged[1]
        if seen is True:
            return True
        if seen is False:
            return False
        seen.append(n)
        if len(seen) < BELOW_LOOP_SPANS:
            return False
        below = 3 * len(set(seen)) < 2 * len(seen)
        self._below_loop = (period, below)
        if not below:
            return False
        self.events.emit("period_below_iteration", rank=self.rank, period=period, iteration=n)
        self.estimates.clear()
        self.splits.clear()
        self._recent_its.clear()
        self.score_sample = None
        self._step_reset = True
        self.step_sample = None
        return True

    def profile_snapshot(self, window_s: float, limit: int = 1500) -> dict[str, Any]:
        """This rank's collective calls of the last ``window_s`` seconds, the newest
        ``limit`` of them (any thread)."""
        with self._recent_lock:
            return self._recent.snapshot(window_s, limit)

    def _map(self, k: int | None) -> int | None:
        if k is None:
            return None
        if k in self._series_to_loop:
            return self._series_to_loop[k]
        if k - 1 in self._series_to_loop:  # an end one past the last mapped iteration
            return self._series_to_loop[k - 1] + 1
        return None

    def _report(self, ev: FailSlowEvent) -> None:
        """Log a change of a detector event, in loop iterations, and pass a reported one
        (a first sighting or an end: :class:`EventReports`) to ``on_event``."""
        event_id = self._reports.event_id(self.tracking.restarts, ev.id)
        fields = {
            "rank": self.rank,
            "event_id": event_id,
            "onset": self._map(ev.onset),
            "detected_at": self._map(ev.detected_at),
            "end": self._map(ev.end),
            "slowdown": round(ev.slowdown, 4),
            "baseline_s": round(ev.baseline, 6),
        }
        kind = self._reports.kind(event_id, ev.end is not None)  # an update: a ladder, the same event got slower
        if kind == FAIL_SLOW_END:
            fields["ended_at"] = self._map(ev.ended_at)
        self.events.emit(kind, **fields)
        if self.on_event is not None and kind != FAIL_SLOW_UPDATE:
            try:
                self.on_event(kind, fields)
            except Exception as exc:  # reporting must not stop tracking
                self.errors += 1
                self.events.emit("monitor_error", rank=self.rank, error=repr(exc))
