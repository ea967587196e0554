"""Iteration times of one rank from its collective calls, online and with bounded memory.

Once the period is known, Falcon takes the iteration time as the time between a call
and its occurrence one period earlier. :class:`IterationTracker` does this on a stream:

* SEARCHING: calls are buffered and the period search (``detect/period.py``: find,
  sharpen, refine by gaps) runs each time the buffer has grown by max(16, 10%), not on
  every call, so searching costs a bounded multiple of one scan of the final buffer.
  A full buffer without a period drops its oldest half.
* LOCKED: a template (the symbols of one period) is followed call by call, O(1) per
  call. At each anchor call an :class:`IterationTime` is emitted.
* LOST: a call did not match the template (an evaluation or checkpoint-save iteration
  inserted calls). Calls are kept until one full period of the template, starting at
  the anchor, is seen again; tracking resumes there without emitting the span that
  held the break. If it is not seen within ``4 * period + 64`` calls, or the template
  breaks again within two periods of three resyncs in a row (it is a fragment of a
  longer new pattern), the pattern has changed for good (e.g. re-planned
  micro-batches) and the search restarts on the calls since the break.

A template found early can be a unit repeated inside the iteration (a layer, or a
micro-batch on the last pipeline stage), exact in the short buffer it was found in.
It then breaks once per iteration; at such breaks the tracker looks at its history for
a longer exact period and moves to it. Until the history holds ``acf_min_repeats``
iterations, such a tracker emits sub-iteration times; ``IterationTime.period`` says
which template produced each one, and a consumer should restart its series when it
changes.

The anchor is the call that ends an iteration, and spans are measured between the
completion times of consecutive anchors (the issue time where completion is unknown):
the loop ends soon after its last collective returns, while the first call of an
iteration can come after all of its compute (data parallelism without pipelining).
When the stream is known to begin with an iteration (the tracer was installed between
iterations, as ``falconext train`` and the launch flag do: config
``stream_starts_iteration``), the last call before the stream's first call's phase ends
an iteration. Otherwise (attaching to a running job, or after the pattern changed) it is
the call before the longest median idle time in the period (a call's issue minus the
previous call's completion): the optimizer step and the next first forward.

Clock steps: calls are taken in the order they are fed (the issue order). An anchor
whose time is not after the previous anchor's gives no iteration (it is counted in
``dropped``) and becomes the new reference, so a clock that stepped back yields one
missing iteration instead of a negative or inflated duration.

Memory: the last ``tracker_buffer_calls`` calls sit in a fixed ring (a symbol code and
an issue time each); every buffer a state uses is a window of it.

Cost: a LOCKED call is a handful of Python operations (the soak benchmark,
``examples/soak_tracker.py``, holds the whole per-rank tracking to the hooks' 5 us
budget). The ring is written through :mod:`array` buffers, whose item stores and loads
are plain Python ints and floats, while the searches read the same memory as numpy
arrays; a call's symbol codes come from a small cache keyed by its op, group and size.

Ranks are independent: pipeline stages issue different numbers of calls per iteration,
so every rank gets its own tracker (:func:`iteration_times_by_rank`).
"""

from __future__ import annotations

import dataclasses
from array import array
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Sequence

import numpy as np

from falconext.config import DetectConfig, FalconConfig, detect_config
from falconext.detect.period import (
    P2P_OPS,
    SymbolTable,
    chance_match,
    coarse_symbol_of,
    gap_spacing,
    inner_period,
    refine_period,
    search_period,
    sharpen_period,
    size_agreement,
)
from falconext.trace.records import CallRecord

#: fewest calls the tracker locks on: with a symbolic period of 1 (one repeated call) it
#: needs room to test several multiples before settling for one call per iteration
MIN_LOCK_CALLS = 32
#: a window of one repeated call with no gap structure is locked on (period 1) only
#: after this many calls
SINGLE_SYMBOL_LOCK_CALLS = 1024
#: the search runs again after the buffer grew by max(this, 10%)
MIN_ATTEMPT_GROWTH = 16
#: breaks in a row, each within 2 periods of the previous resync, that end a template
SHAKY_BREAKS = 3
#: LOST gives up after this many calls plus 4 periods
LOST_SLACK_CALLS = 64
#: (op, group, size) triples whose codes are cached; past it the cache starts over, so
#: sizes that change every step (dynamic shapes) cannot make it grow without bound
CODE_CACHE_ENTRIES = 4096


@dataclass(frozen=True)
class IterationTime:
    """One anchor-to-anchor span: a training iteration as seen from one rank's calls.

    It is the true iteration shifted by the anchor's offset into it; ``seq_end`` and the
    times let a consumer map it onto training-loop step numbers.
    """

    #: 0-based count of iterations emitted by this tracker (not the training step number)
    index: int
    t_begin: float
    t_end: float
    duration: float
    #: calls per iteration of the template that produced it; a change means the series
    #: restarted on a new pattern
    period: int
    #: index, in the rank's call stream as fed (0-based), of the anchor call that ended it
    seq_end: int
    #: the iteration it measures, counted from the stream's start (0-based): by the
    #: template's marker calls, so that calls inserted every N iterations, evaluations and
    #: iterations left out (one that held an insertion) keep the count true
    iteration: int = -1


class TrackerState(Enum):
    """Where a tracker stands: SEARCHING for a period, LOCKED on a template (iterations are
    emitted), or LOST after a break (resynchronising on the same template)."""

    SEARCHING = "searching"
    LOCKED = "locked"
    LOST = "lost"


_LOCKED = TrackerState.LOCKED  # one global lookup on the per-call path


class IterationTracker:
    """Streaming iteration-time tracker for one rank; see the module docstring."""

    def __init__(self, config: FalconConfig | DetectConfig | None = None) -> None:
        self.config = detect_config(config)
        self._cap = self.config.tracker_buffer_calls
        self._symbols = SymbolTable()
        self._coarse_symbols = SymbolTable()
        # (op, group, bytes) -> (fine code, coarse code, size bit length): one dict lookup
        # per call instead of building two symbols and looking each up
        self._code_cache: dict[tuple[str, str, int], tuple[int, int, int]] = {}
        # ring of the last `cap` calls, indexed by seq % cap; every buffer the states use
        # is a window of it, so memory is fixed at `cap` calls. Each ring is an array
        # buffer (cheap per-call stores and loads of Python numbers) with a numpy view of
        # the same memory (the searches' windows); the buffers are never resized.
        self._fine_buf, self._fine = _ring("q", self._cap)
        # the same calls without their sizes, and the sizes' bit lengths: jobs whose
        # message sizes change every step (dynamic shapes) repeat only in op and group
        self._coarse_buf, self._coarse = _ring("q", self._cap)
        self._bits_buf, self._bits = _ring("q", self._cap)
        #: the codes the states match: the fine ones, or the coarse ones once a period
        #: was found only without sizes (until the pattern changes); see _match()
        self._codes = self._fine
        self._codes_buf = self._fine_buf
        self._match_index = 0  # of the matched codes in a (fine, coarse, bits) triple
        self._times_buf, self._times = _ring("d", self._cap)
        # when the call let the host go (completion; issue time where unknown)
        self._ready_buf, self._ready = _ring("d", self._cap)
        self._fed = 0
        self._rank: int | None = None
        self._queue: deque[int] = deque()
        self._out: list[IterationTime] = []
        #: iterations that held an insertion (a timer all-gather, an evaluation's calls): left
        #: out of the estimates, kept here for readers of the rank's compute (take_inserted)
        self._inserted: list[IterationTime] = []
        #: (time, seq) of the last anchor before a break, until the resync that follows it
        self._broken: tuple[float, int] | None = None

        self._state = TrackerState.SEARCHING
        self._window_from = 0  # first seq of the SEARCHING or LOST buffer
        # seq of a call known to open an iteration: the first call of the stream, when
        # the tracer was installed between iterations (config.stream_starts_iteration)
        self._origin: int | None = 0 if self.config.stream_starts_iteration else None
        self._next_attempt = MIN_ATTEMPT_GROWTH

        self._template: list[int] = []
        self._rotated: np.ndarray = np.zeros(0, dtype=np.int64)
        self._rotated_last = 0  # int(self._rotated[-1]) once a template is adopted
        self._anchor = 0
        self._phase = 0
        self._last_anchor: tuple[float, int] | None = None

        # counters, for tests and monitoring
        self.emitted = 0
        self.locks = 0  # templates adopted (first lock, relocks, locks after fallback)
        self.breaks = 0  # calls that did not match the template
        self.resyncs = 0  # LOST -> LOCKED on the same template
        self.fallbacks = 0  # template given up, back to SEARCHING
        self.relocks = 0  # template replaced by a longer exact one at a break
        self.dropped = 0  # anchors not after the previous one (clock steps)

        # the iteration count: the template's marker (the code of its symbol least
        # inflated by insertions, and how often one period holds it) and the latest
        # (anchor seq, iteration number) emitted
        self._marker = 0
        self._marker_per_period = 1
        self._known: tuple[int, int] | None = None
        #: the template has matched every call since the latest emitted anchor
        self._steady = False

        self._checked_at = 0
        self._checked_held = 0
        self._clean = 0  # anchors matched since the last lock or resync
        self._shaky = 0  # breaks in a row that came before 2 clean periods
        self._shaky_from = 0

    # --- public -------------------------------------------------------------------
    @property
    def period(self) -> int | None:
        """Calls per iteration being followed; None while searching."""
        return None if self._state is TrackerState.SEARCHING else len(self._template)

    @property
    def state(self) -> TrackerState:
        """The tracker's current state."""
        return self._state

    @property
    def anchor_phase(self) -> int | None:
        """Position in the template of the call that ends an iteration (the anchor), or None
        while no template has been found."""
        return None if self._state is TrackerState.SEARCHING else self._anchor

    @property
    def buffered(self) -> int:
        """Calls the current state holds on to (0 while locked); never above the cap."""
        if self._state is TrackerState.LOCKED or self._fed == 0:
            return 0
        return self._fed - self._window_from

    @property
    def calls(self) -> int:
        """Calls fed so far."""
        return self._fed

    def feed(self, record: CallRecord) -> list[IterationTime]:
        """Take the rank's next call; returns the iterations it completed (often none).

        O(1) while LOCKED; a call that breaks the template or completes a search costs
        a search over the ring (see the module docstring)."""
        if record.rank != self._rank:
            if self._rank is not None:
                raise ValueError(
                    f"tracker follows rank {self._rank}, got a record of rank {record.rank}"
                )
            self._rank = record.rank
        codes = self._code_cache.get((record.op, record.group, record.bytes))
        if codes is None:
            codes = self._new_codes(record)
        seq = self._fed
        slot = seq % self._cap
        self._fine_buf[slot] = codes[0]
        self._coarse_buf[slot] = codes[1]
        self._bits_buf[slot] = codes[2]
        t_issue = record.t_issue
        self._times_buf[slot] = t_issue
        done = record.t_end
        # max(completion, issue); the issue time where completion is unknown
        self._ready_buf[slot] = t_issue if done is None or done < t_issue else done
        self._fed = seq + 1
        if self._state is _LOCKED and not self._queue:
            # the common case, without the queue: match the call just stored
            phase = self._phase
            code = codes[self._match_index]
            template = self._template
            if code == template[phase] and phase != self._anchor:
                # a matching call that is not the anchor only moves the phase on
                phase += 1
                self._phase = 0 if phase == len(template) else phase
                return []
            self._step_locked(seq, code)
        else:
            self._queue.append(seq)
        while self._queue:
            self._process(self._queue.popleft())
        if not self._out:
            return []
        out, self._out = self._out, []
        return out

    def _new_codes(self, record: CallRecord) -> tuple[int, int, int]:
        """The (fine, coarse, size bits) codes of a call not in the cache, now cached.

        Codes are handed out by the symbol tables in order of first appearance, so
        they do not depend on the cache: clearing it loses nothing but time."""
        if len(self._code_cache) >= CODE_CACHE_ENTRIES:
            self._code_cache.clear()
        codes = (
            self._symbols.code(record),
            self._coarse_symbols.code_of(coarse_symbol_of(record)),
            int(record.bytes).bit_length(),
        )
        self._code_cache[(record.op, record.group, record.bytes)] = codes
        return codes

    def _match(self, ring: np.ndarray) -> None:
        """Match the states against ``ring`` (the fine or the coarse codes)."""
        self._codes = ring
        self._match_index = 1 if ring is self._coarse else 0
        self._codes_buf = self._coarse_buf if self._match_index else self._fine_buf

    # --- state machine ------------------------------------------------------------
    def _process(self, seq: int) -> None:
        if self._state is TrackerState.LOCKED:
            self._step_locked(seq, self._codes_buf[seq % self._cap])
        elif self._state is TrackerState.LOST:
            self._step_lost(seq)
        else:
            self._step_searching(seq)

    def _step_locked(self, seq: int, code: int) -> None:
        """Match the call at ``seq`` (its matched ``code``) against the template: O(1)."""
        phase = self._phase
        template = self._template
        if code != template[phase]:
            self._break(seq)
            return
        if phase == self._anchor:
            t = self._ready_buf[seq % self._cap]
            if self._last_anchor is not None:
                t_prev = self._last_anchor[0]
                if t > t_prev:
                    self._emit(t_prev, t, seq)
                else:
                    self.dropped += 1
            self._last_anchor = (t, seq)
            self._clean += 1
        phase += 1
        self._phase = 0 if phase == len(template) else phase

    def _break(self, seq: int) -> None:
        """The call at ``seq`` does not fit the template."""
        self.breaks += 1
        self._steady = False
        self._state = TrackerState.LOST
        # A template that breaks again right after every resync is a fragment of a new,
        # longer pattern (more micro-batches after re-planning): the fragment is found
        # once per iteration, so LOST alone would never time out.
        if self._clean < 2:
            self._shaky += 1
            if self._shaky == 1:
                self._shaky_from = seq
        else:
            self._shaky = 0
        self._clean = 0
        if self._shaky >= SHAKY_BREAKS:
            self._fall_back(max(self._shaky_from, seq + 1 - self._history(seq)), seq)
            return
        self._broken = self._last_anchor  # the span from it to the resync held the insertion
        if self._recheck(seq):
            # a new, longer template: look for it among the latest calls
            self._window_from = seq + 1 - min(len(self._template), self._history(seq))
        elif self._last_anchor is not None:
            # search from the last anchor: an evaluation that began like an iteration
            # lets the real iteration start inside calls already matched
            self._window_from = self._last_anchor[1] + 1
        else:
            self._window_from = seq
        self._last_anchor = None
        self._step_lost(seq)

    def _fall_back(self, window_from: int, seq: int) -> None:
        """The pattern changed for good: search again on the calls since ``window_from``."""
        self.fallbacks += 1
        self._broken = None
        self._match(self._fine)  # a new pattern: sizes count again
        self._origin = None  # where the new pattern's iterations begin is not known
        self._state = TrackerState.SEARCHING
        self._template = []
        self._last_anchor = None
        self._shaky = 0
        self._window_from = window_from
        self._next_attempt = 0  # search right away
        self._step_searching(seq)

    def _step_lost(self, seq: int) -> None:
        q = len(self._template)
        held = seq - self._window_from + 1
        if held > min(4 * q + LOST_SLACK_CALLS, self._cap):
            self._fall_back(self._window_from, seq)
            return
        if held < q or self._codes_buf[seq % self._cap] != self._rotated_last:
            return
        start = seq - q + 1
        if np.array_equal(self._window_codes(start, seq + 1), self._rotated):
            self.resyncs += 1
            self._state = TrackerState.LOCKED
            self._last_anchor = (self._ready_buf[start % self._cap], start)
            self._phase = self._anchor
            self._note_inserted(start)

    def _step_searching(self, seq: int) -> None:
        held = seq - self._window_from + 1
        if held > self._cap:
            # never found a period in a full buffer: keep the newest half
            self._window_from = seq + 1 - self._cap // 2
            held = seq - self._window_from + 1
            self._next_attempt = held + max(MIN_ATTEMPT_GROWTH, held // 10)
        if held < self._next_attempt:
            return
        self._next_attempt = held + max(MIN_ATTEMPT_GROWTH, held // 10)
        self._attempt(seq)

    def _attempt(self, seq: int) -> None:
        times = self._window_times(self._window_from, seq + 1)
        ring = self._fine
        codes = self._ring_window(ring, self._window_from, seq + 1)
        q = self._search(codes, times)
        if q is None:  # sizes may change every step: try the ops and groups alone
            ring = self._coarse
            codes = self._ring_window(ring, self._window_from, seq + 1)
            q = self._search_without_sizes(codes, self._ring_window(self._bits, self._window_from, seq + 1), times)
            if q is None:
                return
        q = self._without_insertions(self._window_from, codes, q, self._collective_codes(ring))
        needed = max(self.config.acf_min_repeats * q, MIN_LOCK_CALLS)
        if q == 1 and chance_match(codes) >= 1.0 - 1e-12:
            # one symbol: only long pauses show where an iteration ends; wait for enough
            # of them, and without any, for long evidence (a long run of one call
            # inside an iteration looks the same)
            spacing = gap_spacing(times, self.config.long_pause_ratio)
            if spacing is not None and spacing > 1:
                needed = max(needed, self.config.acf_min_repeats * spacing + 1)
            needed = max(needed, min(SINGLE_SYMBOL_LOCK_CALLS, self._cap))
        if codes.size < needed:
            return
        start = self._adopt(codes, times, q, self._window_ready(self._window_from, seq + 1), self._window_from)
        if start is None:
            return
        self._match(ring)  # the locked states match the codes the period was found on
        # process the calls from the template's start again, now LOCKED, so the
        # iterations they hold are emitted
        self._state = TrackerState.LOCKED
        self._phase = 0
        self._last_anchor = None
        self._clean = 0
        self._shaky = 0
        self._queue.extendleft(reversed(range(self._window_from + start, seq + 1)))

    def _search(self, codes: np.ndarray, times: np.ndarray) -> int | None:
        return search_period(codes, times, self.config)

    def _search_without_sizes(self, coarse: np.ndarray, bits: np.ndarray, times: np.ndarray) -> int | None:
        """The period of the calls' ops and groups (``coarse`` codes), kept only when the
        sizes (``bits``) agree with it too, up to small changes."""
        q = self._search(coarse, times)
        if q is None or q >= coarse.size or size_agreement(bits, q) < self.config.size_agreement:
            return None
        return q

    def _collective_codes(self, ring: np.ndarray) -> np.ndarray:
        """For each code of ``ring`` (the fine or the coarse codes), whether its calls are
        collectives (not point-to-point: :data:`P2P_OPS`), indexed by code."""
        table = self._coarse_symbols if ring is self._coarse else self._symbols
        return np.array([sym[0] not in P2P_OPS for sym in table.symbols()], dtype=bool)

    def _without_insertions(self, first_seq: int, codes: np.ndarray, q: int,
                            collective: np.ndarray | None = None) -> int:
        """``q``, or the iteration inside it when one exact period of ``q`` calls is N
        iterations plus a few inserted calls (:func:`inner_period`). ``codes`` is the
        window of calls from ``first_seq`` on; ``collective``, indexed by code, whether
        its calls are collectives."""
        if codes.size < 2 * q or self.config.max_inserted_calls <= 0:
            return q
        start, run = _longest_run(codes[q:] == codes[:-q])
        if first_seq + start < 1:  # the stream's first call has no idle before it:
            start, run = start + 1, run - 1  # take the template one call later
        if run < q:
            return q
        lo = first_seq + start
        # idle by phase, the median over the periods the run holds: one period's first
        # call may follow an evaluation's or a checkpoint's pause
        rows = (run + q) // q
        idle = self._window_times(lo, lo + rows * q) - self._window_ready(lo - 1, lo + rows * q - 1)
        idle = np.median(idle.reshape(rows, q), axis=0)
        template = codes[start : start + q]
        inner = inner_period(template, self.config.max_inserted_calls, idle=idle,
                             collective=None if collective is None else collective[template])
        return q if inner is None else inner

    def _adopt(
        self, codes: np.ndarray, times: np.ndarray, q: int, ready: np.ndarray, window_seq: int
    ) -> int | None:
        """Take the template from the longest stretch that repeats exactly.

        The ACF tolerates a few mismatches, the template must not: a window holding a
        break would make every later call look like one. Returns the index in ``codes``
        where the template starts (phase 0), or None with fewer than two clean periods.
        """
        start, run = _longest_run(codes[q:] == codes[:-q])
        if run < q:
            return None
        template = codes[start : start + q]
        # idle time before each call (issue minus the previous call's completion) over
        # `rows` whole periods after the first, by phase: the longest stretch in which
        # the host computes without communicating is where one iteration ends and the
        # next begins (optimizer step, then the first forward)
        rows = run // q
        first = start + q
        stop = first + rows * q
        # The anchor is the call that ends an iteration, timed by its completion: the
        # host is released then, and what follows until the next iteration's first call
        # is compute whose jitter would otherwise enter every span.
        if self._origin is not None:
            # the stream began with an iteration: the call before its first call ends one
            anchor = (self._origin - 1 - (window_seq + start)) % q
        else:
            idle = (times[first:stop] - ready[first - 1 : stop - 1]).reshape(rows, q)
            anchor = (int(np.argmax(np.median(idle, axis=0))) - 1) % q
        self.locks += 1
        self._steady = False
        self._pick_marker(template, codes)
        self._template = [int(c) for c in template]
        self._anchor = anchor
        self._rotated = np.roll(template, -anchor)
        self._rotated_last = int(self._rotated[-1])
        return start

    def _recheck(self, seq: int) -> bool:
        """At a break, test whether the history shows a longer exact period.

        A template found early can be a unit repeated inside the iteration (a layer, a
        micro-batch) that was exact in the short buffer it came from; it then breaks
        every iteration. Once the history holds enough iterations the longer period is
        visible. Runs when the history grew by a quarter since the last look or, once
        the ring is full, after half a ring of new calls.
        """
        held = self._history(seq)
        grown = held >= 1.25 * self._checked_held
        if not grown and seq + 1 - self._checked_at < held // 2:
            return False
        self._checked_at = seq + 1
        self._checked_held = held
        cfg = self.config
        q = len(self._template)
        # the whole history, then its newer half: the job's first iteration often issues
        # a few calls more (set-up), which shifts every pair across it, and insertions
        # every N iterations break the longer period once per N; the newer half drops
        # the first and, early on, holds no insertion yet
        for lo in (seq + 1 - held, seq + 1 - held // 2):
            codes = self._window_codes(lo, seq + 1)
            longer = sharpen_period(codes, q, cfg.acf_min_repeats, cfg.max_period_calls)
            if longer > q:
                break
        else:
            return False
        inner = self._without_insertions(lo, codes, longer, self._collective_codes(self._codes))
        if inner == q:
            # this template N times plus a few calls inserted every N iterations: the
            # break was such an insertion (LOST resyncs)
            return False
        times = self._window_times(lo, seq + 1)
        # the iteration inside a super-period (a unit's template found it), or the
        # longer exact period, refined by its gaps
        longer = inner if inner < longer else refine_period(longer, times, cfg)
        if self._adopt(codes, times, longer, self._window_ready(lo, seq + 1), lo) is None:
            return False
        self.relocks += 1
        return True

    # --- helpers ------------------------------------------------------------------
    def _pick_marker(self, template: np.ndarray, window: np.ndarray) -> None:
        """Count iterations by the template's symbol whose share of ``window`` (the calls
        the template was found in) is lowest against its share of the template: a call
        that insertions and evaluations do not issue, such as a gradient reduction."""
        symbols, per_period = np.unique(template, return_counts=True)
        in_window = np.array([np.count_nonzero(window == c) for c in symbols])
        best = int(np.lexsort((per_period, in_window / per_period))[0])
        self._marker = int(symbols[best])
        self._marker_per_period = int(per_period[best])

    def _iteration_at(self, seq: int) -> int:
        """The number of the iteration whose anchor is the call at ``seq``: the previous
        number plus the marker calls since its anchor, in periods (half a period's worth
        more rounds down: an evaluation's few marker calls are not an iteration); counted
        from the stream's start for the first; by calls where the ring no longer holds
        the gap."""
        known_seq, known_n = self._known if self._known is not None else (-1, -1)
        q = len(self._template)
        if self._known is not None and seq - known_seq == q and self._steady:
            return known_n + 1  # the next anchor, one clean period on: nothing to count
        if seq - known_seq > self._history(seq):  # the ring dropped part of the gap
            return known_n + max(1, (seq - known_seq) // q)
        m = self._marker_per_period
        markers = int(np.count_nonzero(self._window_codes(known_seq + 1, seq + 1) == self._marker))
        return known_n + max(1, (markers + (m - 1) // 2) // m)

    def _note_inserted(self, start: int) -> None:
        """A resync at ``start`` after a break: when the break's last anchor and ``start``
        are one iteration apart by the marker calls between them (an iteration that held an
        insertion, not an evaluation of several), keep that span for take_inserted."""
        broken, self._broken = self._broken, None
        if broken is None or self._known is None or start - broken[1] > self._history(start):
            return
        t_begin, seq0 = broken
        t_end = float(self._ready_buf[start % self._cap])
        m = self._marker_per_period
        markers = int(np.count_nonzero(self._window_codes(seq0 + 1, start + 1) == self._marker))
        if (markers + (m - 1) // 2) // m != 1 or not t_end > t_begin:
            return
        n = self._known[1] + 1 if self._known[0] == seq0 else -1
        self._inserted.append(IterationTime(index=-1, t_begin=t_begin, t_end=t_end, duration=t_end - t_begin,
                                            period=len(self._template), seq_end=start, iteration=n))

    def take_inserted(self) -> list[IterationTime]:
        """The iterations that held an insertion since the last call, oldest first (their
        spans run anchor to anchor, the insertion within): never estimates, since the
        insertion's time is in them, but each still one iteration of the rank's work."""
        out, self._inserted = self._inserted, []
        return out

    def _emit(self, t_begin: float, t_end: float, seq: int) -> None:
        n = self._iteration_at(seq)
        self._known = (seq, n)
        self._steady = True
        self._out.append(
            IterationTime(
                index=self.emitted,
                t_begin=t_begin,
                t_end=t_end,
                duration=t_end - t_begin,
                period=len(self._template),
                seq_end=seq,
                iteration=n,
            )
        )
        self.emitted += 1

    def _history(self, seq: int) -> int:
        """Calls up to and including ``seq`` that the ring still holds."""
        return min(seq + 1, self._cap - (self._fed - 1 - seq))

    def _ring_window(self, ring: np.ndarray, start: int, stop: int) -> np.ndarray:
        """``ring``'s entries for the calls ``start`` .. ``stop - 1``."""
        return ring[np.arange(start, stop) % self._cap]

    def _window_codes(self, start: int, stop: int) -> np.ndarray:
        return self._ring_window(self._codes, start, stop)

    def _window_ready(self, start: int, stop: int) -> np.ndarray:
        return self._ring_window(self._ready, start, stop)

    def _window_times(self, start: int, stop: int) -> np.ndarray:
        return self._ring_window(self._times, start, stop)


def _ring(typecode: str, size: int) -> tuple[array, np.ndarray]:
    """A zeroed array buffer of ``size`` items and a numpy view of the same memory."""
    buf = array(typecode, bytes(size * array(typecode).itemsize))
    return buf, np.frombuffer(buf, dtype=np.int64 if typecode == "q" else np.float64)


def _longest_run(flags: np.ndarray) -> tuple[int, int]:
    """(start, length) of the longest run of True; the latest one on ties."""
    if flags.size == 0:
        return 0, 0
    padded = np.concatenate(([False], flags, [False])).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    starts, stops = edges[0::2], edges[1::2]
    if starts.size == 0:
        return 0, 0
    lengths = stops - starts
    best = int(np.flatnonzero(lengths == lengths.max())[-1])
    return int(starts[best]), int(lengths[best])


def iteration_times(
    records: Iterable[CallRecord], config: FalconConfig | DetectConfig | None = None
) -> list[IterationTime]:
    """Iteration times of one rank's calls, in issue order (a tracker fed in order).

    Unlike the live stream, a batch answer can be corrected after the fact:

    - spans emitted under a template that a relock later replaced by a longer exact
      period were sub-iteration units (a layer, a micro-batch), not iterations, and are
      left out;
    - the live tracker times an iteration boundary by the completion of the call that
      ends an iteration; where the next iteration's first call comes early in it, the
      issue of that call is the closer mark, and the batch answer uses it (per run of
      spans of one period; see :func:`_boundary_side`).

    Records of several ranks are an error (ValueError): use :func:`iteration_times_by_rank`.
    """
    return _track(records, config)[1]


def _track(
    records: Iterable[CallRecord], config: FalconConfig | DetectConfig | None
) -> tuple[IterationTracker, list[IterationTime]]:
    tracker = IterationTracker(config)
    kept: list[IterationTime] = []
    current: list[IterationTime] = []  # emitted under the template now in force
    relocks = 0
    issued: list[float] = []  # by feed order: the tracker's seq
    for record in records:
        issued.append(record.t_issue)
        emitted = tracker.feed(record)
        if tracker.relocks != relocks:
            relocks = tracker.relocks
            current = [it for it in current if it.period == tracker.period]
        for it in emitted:
            if current and it.period != current[-1].period:
                kept.extend(current)
                current = []
            current.append(it)
    return tracker, _boundary_side(kept + current, np.asarray(issued, dtype=np.float64),
                                   tracker.config.opening_pause_share)


def _boundary_side(its: list[IterationTime], issued: np.ndarray, share: float) -> list[IterationTime]:
    """``its`` with each run of one period timed by the issue of the call after each
    anchor (the call that opens the next iteration) when the pause before that call is
    short (below ``share`` of the iteration: config ``opening_pause_share``); else
    unchanged (timed by the anchor's completion).

    Where does an iteration start inside the pause between its first call and the
    previous iteration's last? A profiler marks the loop's top: after the optimizer
    step, before the data and the forward pass. When the first call comes early in the
    iteration (an embedding all-to-all, a tensor-parallel all-reduce in the first layer,
    a pipeline receive), the pause before it is a small share of the iteration and the
    call sits just after the boundary; when the first call waits for the forward and
    most of the backward pass (data parallelism alone, gradient buckets), the pause is
    most of the iteration and the last call's completion sits just before the boundary.
    Timing from the wrong side puts the other side's jitter into every span (a host
    hiccup in one optimizer step moves a third of a step into the next one).

    A span ends at the anchor call ``seq_end`` and began at its occurrence one period
    earlier. Timed by issue, a span whose next first call is not in the input (the last
    one of a log that ends with an anchor) has no end and is left out."""
    out: list[IterationTime] = []
    k = 0
    while k < len(its):
        j = k
        while j + 1 < len(its) and its[j + 1].period == its[k].period:
            j += 1
        run = its[k : j + 1]
        k = j + 1
        ends = np.array([it.seq_end + 1 for it in run])
        begins = ends - np.array([it.period for it in run])
        # the spans whose opening calls are in the input
        have = (begins >= 0) & (ends < issued.size)
        if not have.any():
            out.extend(run)
            continue
        pauses = np.array([issued[e] - it.t_end for it, e, h in zip(run, ends, have) if h])
        spans = np.array([it.duration for it, h in zip(run, have) if h])
        if float(np.median(pauses)) < share * float(np.median(spans)):
            # a span whose next iteration's first call is not in the input has no end on
            # this side: left out
            run = [dataclasses.replace(it, t_begin=float(issued[b]), t_end=float(issued[e]),
                                       duration=float(issued[e] - issued[b]))
                   for it, b, e, h in zip(run, begins, ends, have) if h and issued[e] > issued[b]]
        out.extend(run)
    return out


def iteration_numbers(its: Sequence[IterationTime], first: int = 0) -> list[int]:
    """The iteration each of ``its`` measures (``first`` is the stream's first iteration):
    what ``falconext period`` prints beside the times, and what a job without loop hooks
    numbers its estimates, onsets and detections with."""
    return [first + it.iteration for it in its]


def iteration_times_by_rank(
    records: Iterable[CallRecord], config: FalconConfig | DetectConfig | None = None
) -> dict[int, tuple[int | None, list[IterationTime]]]:
    """(final period, iterations) per rank of an interleaved multi-rank stream.

    Each rank's calls keep their relative order in the input, which is their issue
    order in a log merged by time; where every record of a rank carries ``seq`` (the
    hook's own counter) that order is used instead, so a merge that is not stable in
    time cannot reorder a rank's calls. The period is the one in force at the end.
    """
    by_rank: dict[int, list[CallRecord]] = {}
    for record in records:
        by_rank.setdefault(record.rank, []).append(record)
    result: dict[int, tuple[int | None, list[IterationTime]]] = {}
    for rank in sorted(by_rank):
        calls = by_rank[rank]
        if all(r.seq is not None for r in calls):
            calls.sort(key=lambda r: r.seq)  # type: ignore[arg-type, return-value]
        tracker, its = _track(calls, config)
        result[rank] = (its[-1].period if its else tracker.period, its)
    return result
