"""The "NCCL hooks": every torch.distributed call Megatron makes, logged per process.

Megatron reaches collectives through attribute lookups on the ``torch.distributed``
module (``torch.distributed.all_reduce(...)``), so replacing those attributes intercepts
them without touching Megatron. A few Megatron modules bind a function to a module
global at import time (``dist_all_gather_func = torch.distributed.all_gather_into_tensor``
in the DDP buffers and tensor-parallel mappings); :meth:`CallTracer.install` rebinds such
aliases in already imported ``megatron.*`` modules too, and uninstall puts them back.

The training thread pays for one record per call and nothing else: it appends a small
list to a bounded deque (no locks beyond the GIL, never waiting for the consumer) and
the analysis thread turns those into :class:`CallRecord` objects in :meth:`drain`.

Completion times (``t_end``):

* synchronous calls: the clock when the original function returns;
* async calls on CPU: the handle is returned inside :class:`_TimedWork`, a thin proxy
  that notes the time when ``wait()`` returns or ``is_completed()`` first says True: an
  upper bound on completion, exact when the training thread waits before the transfer
  ends. With ``completion_futures=True`` the Work's future callback gives the exact
  time where the backend has futures (gloo: all_reduce, all_gather, broadcast,
  all_to_all, barrier; not isend/irecv or reduce_scatter, which keep the proxy). It is
  off by default because on gloo it is not free for the training thread: the callback
  needs the GIL on gloo's thread and ``wait()`` may block until it has run, which
  measured ~30 us per call here (examples/bench_hooks.py), beyond the 5 us budget;
* ``cuda_events=True``: CUDA events recorded on the current stream around the call (for
  async calls, the end event at ``wait()``, when the current stream has been made to wait
  for the communication stream). They are converted to host times in :meth:`drain` on
  the analysis thread with ``Event.query()``; the training thread never synchronises.
  NCCL futures complete at enqueue time, so futures are never used for timing on GPU.
* calls queued inside ``torch.distributed._coalescing_manager`` (Megatron's DDP gradient
  reduction) run when the manager exits, not when they return. The manager is wrapped
  too (and Megatron's import-time alias of it rebound): a sync batch completes when the
  manager exits, an async one when the manager's handle is waited on. Calls queued by
  a manager the tracer cannot see get ``t_end=None`` (unknown), never a wrong time.

A record still incomplete ``pending_timeout_s`` after issue (a handle never waited on) is
drained with ``t_end=None`` so it cannot hold up the records behind it for long.

The :class:`Trap` is the suspension point of the validation phase: armed from another
thread, it holds the next intercepted call in a wait loop until released or until its
deadline, so training pauses at a collective with no checkpoint and no restart.

What the wrappers cost the training thread in CPU time is estimated by sampling with the
thread CPU clock (:class:`HookCost`, ``tracer.cost``); what a held call spends (validation
work run on the training thread) is counted apart, in ``trap.cpu_s``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import random
import sys
import threading
import time
import warnings
from collections import deque
from typing import Any, Callable, NamedTuple

from falconext.config import FalconConfig
from falconext.trace.groups import GroupInfo, describe_group, megatron_roles, to_process
from falconext.trace.records import CallRecord

__all__ = ["CallTracer", "HookCost", "Trap", "megatron_roles", "rebind_aliases", "restore_aliases"]

#: an async record whose completion is still unknown this long after issue is drained
#: with t_end None (its handle was dropped or never waited on); the runtime raises it to
#: a few iterations (FalconConfig.pending_timeout_s / pending_timeout_iterations)
PENDING_TIMEOUT_S = FalconConfig().pending_timeout_s
#: modules whose import-time aliases of torch.distributed functions are rebound
ALIAS_MODULE_PREFIXES = ("megatron",)
#: the trap's wait loop wakes up this often (keeps signals and Ctrl-C responsive)
TRAP_SLICE_S = 0.05
#: one wrapper entry in this many, on average, is timed with the thread CPU clock
HOOK_SAMPLE_EVERY = 64
#: empty timings taken at start-up to learn what the timing itself adds to a sample
HOOK_CALIBRATION_RUNS = 101

# entry layout: a plain list is the cheapest thing the training thread can build
_SEQ, _OP, _INFO, _BYTES, _PEER, _T_ISSUE, _T_START, _T_END, _DONE, _EV0, _EV1 = range(11)


class _OpSpec(NamedTuple):
    """Where one torch.distributed function keeps the arguments a record needs."""

    name: str  # attribute of torch.distributed
    op: str  # normalised op name in records
    tensor_pos: int | None  # the buffer counted in bytes (None: barrier)
    tensor_kw: str
    many: bool  # the buffer is a list of tensors (bytes summed)
    group_pos: int
    async_pos: int


# bytes = the full (unsharded) buffer: all_gather's output, reduce_scatter's input, the
# convention of nccl-tests, so a record's size does not depend on the group size
_COLLECTIVES = (
    _OpSpec("all_reduce", "all_reduce", 0, "tensor", False, 2, 3),
    _OpSpec("reduce_scatter_tensor", "reduce_scatter", 1, "input", False, 3, 4),
    _OpSpec("_reduce_scatter_base", "reduce_scatter", 1, "input", False, 3, 4),
    _OpSpec("reduce_scatter", "reduce_scatter", 1, "input_list", True, 3, 4),
    _OpSpec("all_gather_into_tensor", "all_gather", 0, "output_tensor", False, 2, 3),
    _OpSpec("_all_gather_base", "all_gather", 0, "output_tensor", False, 2, 3),
    _OpSpec("all_gather", "all_gather", 0, "tensor_list", True, 2, 3),
    _OpSpec("broadcast", "broadcast", 0, "tensor", False, 2, 3),
    _OpSpec("all_to_all_single", "all_to_all", 1, "input", False, 4, 5),
    _OpSpec("barrier", "barrier", None, "", False, 0, 1),
)
# (attribute, op, peer keyword, group-rank peer keyword, async)
_P2P = (
    ("send", "send", "dst", "group_dst", False),
    ("recv", "recv", "src", "group_src", False),
    ("isend", "send", "dst", "group_dst", True),
    ("irecv", "recv", "src", "group_src", True),
)

_install_lock = threading.Lock()
_active: "CallTracer | None" = None


class HookCost:
    """CPU time the tracer's wrappers cost the calling thread, the wrapped calls excluded.

    Reading a thread CPU clock is a system call (~0.5 us here, half a wrapper's own
    cost), so only a sample of wrapper entries is timed. The estimator:

    * every entry (a traced call, a proxy handle's ``wait``, a traced
      ``_coalescing_manager``) decrements ``left``; the entry that takes it to 0 is timed:
      the thread CPU time of the whole wrapper minus that of the wrapped call(s) inside
      it (:meth:`run` with :meth:`timed` around the original), or, for the coalescing
      manager, its own code before and after the manager it wraps (:meth:`add_sample`);
    * the next countdown is drawn uniformly from 1 .. 2n-1 (mean n = ``every``): random,
      so that sampling cannot lock onto one position of a training loop's periodic call
      sequence; the timed entries are then a uniform ~1/n subset of all entries;
    * what the timing itself adds to a sample (the clock reads and the extra call frame)
      is measured at construction: the median of ``calibration`` timings of an empty
      wrapped call (``bias_s``);
    * estimated seconds = ``calls`` x (mean sample - ``bias_s``), never below 0: the
      count of entries is exact, the mean per entry comes from the samples.

    Not counted: attribute forwarding and ``is_completed`` on proxy handles, and the
    ``contextlib`` machinery around the coalescing manager. Entries from several threads
    are counted alike; the timing is of whichever thread runs the sampled entry. A
    sampled entry that nests another entry (a wrapper below ours calling ours) times the
    outer one only. ``clock`` is injectable for tests (default: this thread's CPU clock).
    """

    __slots__ = ("left", "every", "samples", "sampled_s", "bias_s", "_gap", "_passed", "_inner_s", "_busy",
                 "_rng", "_clock")

    def __init__(
        self,
        every: int = HOOK_SAMPLE_EVERY,
        clock: Callable[[], float] = time.thread_time,
        calibration: int = HOOK_CALIBRATION_RUNS,
        seed: int = 0,
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every = int(every)
        self._clock = clock
        self._rng = random.Random(seed)
        #: entries until the next timed one (decremented by the wrappers)
        self.left = 0
        self._gap = 0
        self._passed = 0
        #: entries timed, and their summed seconds (bias included)
        self.samples = 0
        self.sampled_s = 0.0
        self._inner_s = 0.0
        self._busy = False
        #: seconds the timing adds to one sample (see the class docstring)
        self.bias_s = self._calibrate(calibration) if calibration > 0 else 0.0
        self._next_gap()

    @property
    def calls(self) -> int:
        """Wrapper entries so far (exact)."""
        return self._passed + self._gap - self.left

    def seconds(self) -> float:
        """Estimated CPU seconds spent in the wrappers so far (see the class docstring)."""
        if not self.samples:
            return 0.0
        return max(0.0, self.calls * (self.sampled_s / self.samples - self.bias_s))

    def per_call_s(self) -> float:
        """Estimated CPU seconds per wrapper entry (0 before the first sample)."""
        calls = self.calls
        return self.seconds() / calls if calls else 0.0

    def timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with its thread CPU time kept out of the sample it runs in."""
        clock = self._clock

        def inner(*args: Any, **kwargs: Any) -> Any:
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self._inner_s += clock() - t

        return inner

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Call ``fn(*args, **kwargs)`` as a timed entry; its :meth:`timed` parts excluded."""
        if self._busy:  # nested in a timed entry: the outer one is the sample
            return fn(*args, **kwargs)
        self._busy = True
        self._inner_s = 0.0
        clock = self._clock
        t = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = clock() - t - self._inner_s
            self._busy = False
            self.add_sample(spent)
            self.restart()

    def add_sample(self, seconds: float) -> None:
        """Record the seconds of one timed entry (one that took ``left`` to 0)."""
        self.samples += 1
        self.sampled_s += seconds

    def restart(self) -> None:
        """Start the next countdown (once per timed entry, when it ends or, for an entry
        that lets other entries run inside it, when it begins)."""
        self._next_gap()

    def _next_gap(self) -> None:
        self._passed += self._gap - self.left  # left < 0: entries nested in a timed one
        self._gap = self.left = self._rng.randint(1, 2 * self.every - 1)

    def _calibrate(self, runs: int) -> float:
        """Median seconds a timed entry reads when the wrapper does nothing but call
        through (a twin frame and the timed original, as a sampled wrapper has): the
        timing's own cost. Leaves the counters as they were."""
        inner = self.timed(_empty_call)

        def twin(*args: Any, **kwargs: Any) -> Any:
            return inner(*args, **kwargs)

        readings = []
        for _ in range(runs):
            before = self.sampled_s
            self.run(twin, (None,), {"group": None})
            readings.append(self.sampled_s - before)
        self.left = self._gap = self._passed = self.samples = 0
        self.sampled_s = 0.0
        readings.sort()
        return readings[len(readings) // 2]


def _empty_call(*args: Any, **kwargs: Any) -> None:
    """Stands in for a torch.distributed call in :meth:`HookCost._calibrate`."""
    return None


class Trap:
    """Holds the next intercepted call until :meth:`release` or the deadline.

    The training thread checks ``armed`` (one attribute read) on every call; everything
    else happens only while a call is held. The deadline is mandatory and counts from
    the moment the call is caught, so a validation phase that dies cannot leave
    training suspended for longer than it asked for. Any thread's next intercepted call
    is caught, so the arming thread must not issue one before ``held`` turns True.

    ``at_seq`` (a job without loop hooks): the trap lets calls pass until the one whose
    sequence number (the tracer's ``seq``) reaches it, so every rank can hold at the
    first call of the same iteration as its own call stream counts them. The tracer
    keeps ``seen``, the last ``seq`` it gave out, up to date for that.
    """

    def __init__(self) -> None:
        self.armed = False
        #: hold no call numbered below this (None: the next call)
        self.at_seq: int | None = None
        #: the last sequence number the tracer gave a call (-1: none yet)
        self.seen = -1
        #: a call is being held right now
        self.held = False
        #: calls held so far
        self.holds = 0
        #: seconds the last held call waited
        self.last_pause_s = 0.0
        #: holds that ended by the deadline rather than by release()
        self.expired = 0
        self._deadline_s = 0.0
        self._on_hold: Callable[[float], None] | None = None
        #: exceptions raised by an on_hold callback (swallowed)
        self.errors = 0
        #: thread CPU seconds the held threads spent in holds (validation work included)
        self.cpu_s = 0.0
        self._released = threading.Event()
        self._claim = threading.Lock()

    def arm(self, deadline_s: float, on_hold: Callable[[float], None] | None = None,
            at_seq: int | None = None) -> None:
        """Catch the next intercepted call (``at_seq``: the first numbered at least that);
        hold it at most ``deadline_s`` seconds.

        ``on_hold(end)`` runs on the held thread, given the deadline as a
        ``time.monotonic()`` value; the call goes on as soon as it returns (a suspension
        does its work there, on the thread that owns the training's process groups).
        Whatever it raises is counted in ``errors``, never passed to training.
        """
        if deadline_s is None:
            raise ValueError("a trap needs a deadline: a lost release must not hang training")
        deadline_s = float(deadline_s)
        if not math.isfinite(deadline_s) or deadline_s <= 0:
            raise ValueError(f"deadline_s must be a positive finite number, got {deadline_s!r}")
        if self.held:
            raise RuntimeError("the trap is holding a call; release it before arming again")
        self._deadline_s = deadline_s
        self._on_hold = on_hold
        self.at_seq = at_seq
        self._released.clear()
        self.armed = True

    def release(self) -> None:
        """Let the held call go, or cancel the arming if no call was caught yet."""
        self.armed = False
        self.at_seq = None
        self._released.set()

    def _hold(self) -> None:
        """Called by a wrapper that saw ``armed``; waits on the calling thread."""
        at = self.at_seq
        if at is not None and self.seen + 1 < at:
            return  # not yet: this call comes before the agreed one
        if not self._claim.acquire(blocking=False):
            return  # another thread's call is the one being held
        try:
            if not self.armed:
                return
            self.armed = False  # one call per arming
            self.at_seq = None
            cpu0 = time.thread_time()
            start = time.monotonic()
            end = start + self._deadline_s
            self.held = True
            try:
                if self._on_hold is not None:
                    try:
                        self._on_hold(end)
                    except Exception:
                        self.errors += 1
                    return
                while not self._released.is_set():
                    left = end - time.monotonic()
                    if left <= 0:
                        self.expired += 1
                        break
                    self._released.wait(min(left, TRAP_SLICE_S))
            finally:
                self.last_pause_s = time.monotonic() - start
                self.cpu_s += time.thread_time() - cpu0
                self.holds += 1
                self.held = False
        finally:
            self._claim.release()


class CallTracer:
    """Per-process interceptor of torch.distributed calls; see the module docstring.

    ``rank`` is the global rank written into every record; ``roles(group)`` names a
    group's parallelism role (``megatron_roles()`` for Megatron's parallel_state);
    ``clock`` is the host clock of every time in the records. ``capacity`` bounds the
    records waiting for :meth:`drain`; beyond it new calls are not recorded and counted
    in ``dropped`` (their ``seq`` numbers are still used, so a consumer sees the gap).
    ``cuda_events`` and ``completion_futures`` choose how completion is timed (module
    docstring). ``cost`` estimates the wrappers' CPU time on the training thread, timing
    one entry in ``sample_every`` on average (:class:`HookCost`).
    """

    def __init__(
        self,
        rank: int,
        capacity: int = 65536,
        clock: Callable[[], float] = time.perf_counter,
        roles: Callable[[object], str | None] | None = None,
        cuda_events: bool = False,
        *,
        completion_futures: bool = False,
        sample_every: int = HOOK_SAMPLE_EVERY,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.rank = int(rank)
        self.trap = Trap()
        #: the wrappers' own CPU time on the calling thread (sampled estimate)
        self.cost = HookCost(sample_every)
        #: records lost because the ring was full (the consumer is too slow)
        self.dropped = 0
        #: bookkeeping failures swallowed so that a tracer bug cannot fail a training call
        self.errors = 0
        #: see PENDING_TIMEOUT_S
        self.pending_timeout_s = PENDING_TIMEOUT_S
        self._capacity = capacity
        self._clock = clock
        self._roles = roles
        self._cuda: _CudaTiming | None = _CudaTiming(clock) if cuda_events else None
        self._futures = completion_futures and not cuda_events  # NCCL futures fire at enqueue
        self._ring: deque[list] = deque()
        self._seq = itertools.count()
        self._groups: dict[int, GroupInfo] = {}
        self._drain_lock = threading.Lock()
        self._coalescing: dict = {}
        #: process group -> entries queued inside a traced _coalescing_manager on it
        self._open_batches: dict[object, list[list]] = {}
        self._base_isend: object = None
        self._patched: dict[str, tuple[Any, Any]] = {}
        self._aliases: list[tuple[dict, str, Any, Any]] = []

    # --- installation ---------------------------------------------------------------

    def install(self) -> None:
        """Replace the torch.distributed functions with recording wrappers (idempotent)."""
        global _active
        with _install_lock:
            if _active is self:
                return
            if _active is not None:
                raise RuntimeError("another CallTracer is installed in this process")
            import torch.distributed as dist
            from torch.distributed import distributed_c10d as c10d

            world = getattr(c10d, "_world", None)
            state = getattr(world, "pg_coalesce_state", None)
            self._coalescing = state if isinstance(state, dict) else {}
            self._base_isend = c10d.isend
            self._groups.clear()
            patched: dict[str, tuple[Any, Any]] = {}
            for spec in _COLLECTIVES:
                orig = getattr(dist, spec.name, None)
                if orig is not None:
                    patched[spec.name] = (orig, _collective_wrapper(self, spec, orig))
            for name, op, peer_kw, gpeer_kw, is_async in _P2P:
                orig = getattr(dist, name, None)
                if orig is not None:
                    wrapper = _p2p_wrapper(self, name, op, peer_kw, gpeer_kw, is_async, orig)
                    if is_async:  # usable as P2POp's op: compares equal to c10d's isend/irecv
                        wrapper = P2PWrapper(wrapper, orig, getattr(c10d, name))
                    patched[name] = (orig, wrapper)
            orig = getattr(dist, "batch_isend_irecv", None)
            if orig is not None:
                patched["batch_isend_irecv"] = (orig, _batch_wrapper(self, orig))
            orig = getattr(dist, "_coalescing_manager", None)
            if orig is not None:
                patched["_coalescing_manager"] = (orig, _coalescing_wrapper(self, orig))
            for name, (_, wrapper) in patched.items():
                setattr(dist, name, wrapper)
            self._patched = patched
            # an alias may hold c10d's function while torch.distributed holds another
            # wrapper (the fault injector installs below us): rebind both to ours
            aliases: dict[int, tuple[Any, Any]] = {}
            for name, (o, w) in patched.items():
                base = getattr(c10d, name, None)
                if base is not None:
                    aliases[id(base)] = (base, w)
                aliases[id(o)] = (o, w)
            self._aliases = rebind_aliases(aliases)
            _active = self

    def uninstall(self) -> None:
        """Put back exactly the functions (and module aliases) found at install."""
        global _active
        with _install_lock:
            if _active is not self:
                return
            import torch.distributed as dist

            for name, (orig, wrapper) in self._patched.items():
                if getattr(dist, name, None) is wrapper:
                    setattr(dist, name, orig)
                else:
                    warnings.warn(
                        f"torch.distributed.{name} was replaced after the tracer installed; "
                        "leaving the newer function in place",
                        RuntimeWarning,
                        stacklevel=2,
                    )
            restore_aliases(self._aliases, {id(w): (w, o) for o, w in self._patched.values()})
            self._patched = {}
            self._aliases = []
            _active = None

    @property
    def installed(self) -> bool:
        return _active is self

    def forget_groups(self) -> None:
        """Drop the group cache: a topology switch destroyed every group (and a new one
        may come to live at a recycled ``id``)."""
        self._groups.clear()

    def original(self, name: str) -> Callable[..., Any]:
        """The torch.distributed function found at install (below the tracer).

        Validation traffic goes through these: it must not enter the training's call
        log, but must still pass through anything installed below (a fault injector).
        """
        import torch.distributed as dist

        if name in self._patched:
            return self._patched[name][0]
        return getattr(dist, name)

    # --- consumer side (analysis thread) ----------------------------------------------

    def drain(self, limit: int | None = None) -> list[CallRecord]:
        """Completed records in ``seq`` order, oldest first; never blocks the producer.

        Stops at the first record whose completion is unknown and younger than
        ``pending_timeout_s``, so records come out in order and each exactly once.
        """
        out: list[CallRecord] = []
        with self._drain_lock:
            ring = self._ring
            cuda = self._cuda
            if cuda is not None:
                cuda.maintain()
            now: float | None = None
            while ring and (limit is None or len(out) < limit):
                e = ring[0]
                if cuda is None or (e[_EV0] is None and e[_EV1] is None):
                    times: tuple[float | None, float | None] | None = (
                        (e[_T_START], e[_T_END]) if e[_DONE] else None
                    )
                else:
                    times = cuda.resolve(e) if e[_DONE] else None
                if times is None:
                    if now is None:
                        now = self._clock()
                    if now - e[_T_ISSUE] < self.pending_timeout_s:
                        break
                    times = (cuda.start_or_none(e) if cuda is not None else e[_T_START], None)
                ring.popleft()
                info: GroupInfo = e[_INFO]
                out.append(
                    CallRecord(
                        self.rank, e[_OP], info.gid, e[_BYTES], e[_T_ISSUE], times[0],
                        times[1], e[_SEQ], info.ranks, info.role, e[_PEER],
                    )
                )
        return out

    def pending(self) -> int:
        """Records waiting for :meth:`drain` (complete or not)."""
        return len(self._ring)

    # --- producer side (training thread) ----------------------------------------------

    def _describe(self, group: object) -> GroupInfo:
        info = describe_group(group, self._roles)
        self._groups[id(group)] = info
        return info

    def _fail(self) -> None:
        self.errors += 1

    def _coalesced_on(self, group: object) -> object:
        """The process group if ``group`` is inside a ``_coalescing_manager`` (the call
        was only queued), else None."""
        if group is None:
            from torch.distributed import distributed_c10d as c10d

            group = c10d._get_default_group()
        return group if group in self._coalescing else None

    def _track(
        self,
        op: str,
        group: object,
        nbytes: int,
        peer: int | None,
        gpeer: int | None,
        t_issue: float,
        t_ret: float,
        out: Any,
        is_async: bool,
        ev0: Any,
    ) -> Any:
        """Append the record of one call; return what the caller should get back."""
        seq = next(self._seq)
        self.trap.seen = seq
        ring = self._ring
        if len(ring) >= self._capacity:
            self.dropped += 1
            return out
        info = self._groups.get(id(group))
        if info is None:
            info = self._describe(group)
        if peer is None and gpeer is not None:
            peer = info.ranks[gpeer]
        elif peer is not None:
            peer = to_process(peer)
        if self._coalescing:
            pg = self._coalesced_on(group)
            if pg is not None:
                batch = self._open_batches.get(pg)
                # untraced manager: completion unknown, drained at once with t_end None
                entry = [seq, op, info, nbytes, peer, t_issue, t_issue if ev0 is None else None,
                         None, batch is None, ev0 if batch is not None else None, None]
                ring.append(entry)
                if batch is not None:
                    batch.append(entry)
                return out
        if not is_async or out is None:
            if ev0 is None:
                ring.append(
                    [seq, op, info, nbytes, peer, t_issue, t_issue, t_ret, True, None, None]
                )
            else:
                ev1 = self._cuda.record()  # type: ignore[union-attr]
                ring.append([seq, op, info, nbytes, peer, t_issue, None, None, True, ev0, ev1])
            return out
        entry = [seq, op, info, nbytes, peer, t_issue, t_issue if ev0 is None else None,
                 None, False, ev0, None]
        ring.append(entry)
        return self._watch(out, [entry], info, op)

    def _track_batch(self, ops: list, works: Any, t_issue: float, t_ret: float,
                     evs: list | None) -> Any:
        """One record per P2POp of a batch_isend_irecv; completion from its handles."""
        ring = self._ring
        entries: list[list | None] = []
        for i, p in enumerate(ops):
            seq = next(self._seq)
            self.trap.seen = seq
            if len(ring) >= self._capacity:
                self.dropped += 1
                entries.append(None)
                continue
            group = p.group
            info = self._groups.get(id(group))
            if info is None:
                info = self._describe(group)
            op = "send" if _reaches(p.op, self._base_isend) else "recv"
            ev0 = evs[i] if evs is not None else None
            e = [seq, op, info, p.tensor.nbytes, to_process(p.peer), t_issue,
                 t_issue if ev0 is None else None, None, False, ev0, None]
            ring.append(e)
            entries.append(e)
        live = [e for e in entries if e is not None]
        if not isinstance(works, list) or not works:
            self._finish(live, t_ret)
            return works
        if len(works) == len(entries):
            return [
                w if e is None or w is None else self._watch(w, [e], e[_INFO], e[_OP])
                for w, e in zip(works, entries)
            ]
        # a coalescing backend (NCCL) hands back one handle for the whole batch
        if live:
            works = list(works)
            works[-1] = self._watch(works[-1], live, live[0][_INFO], "batch")
        return works

    def _watch(self, work: Any, entries: list[list], info: GroupInfo, key: str) -> Any:
        """Arrange for ``entries`` to learn when ``work`` completes."""
        if self._futures and key not in info.no_future:
            try:
                fut = work.get_future()
            except Exception:  # gloo: "Work::getFuture not implemented" for P2P etc.
                info.no_future.add(key)
            else:
                fut.add_done_callback(functools.partial(_done_callback, entries, self._clock))
                return work
        return _TimedWork(work, entries, self)

    def _finish(self, entries: list[list], t: float | None = None) -> None:
        """Mark entries complete now (host clock, or an end event on the current stream)."""
        cuda = self._cuda
        if cuda is None:
            if t is None:
                t = self._clock()
            for e in entries:
                e[_T_END] = t
                e[_DONE] = True
        else:
            for e in entries:
                e[_EV1] = cuda.record()
                e[_DONE] = True


    def _close_batch(self, entries: list[list], cm: Any, async_ops: bool) -> None:
        """A traced _coalescing_manager exited: its queued calls were issued as one."""
        works = getattr(cm, "works", None)
        if async_ops and isinstance(works, list) and works and works[-1] is not None:
            works[-1] = self._watch(works[-1], entries, entries[0][_INFO], "coalesced")
        else:
            self._finish(entries)  # sync: the manager waited for the batch before exiting


def _done_callback(entries: list[list], clock: Callable[[], float], _fut: Any) -> None:
    """Future callback (a backend thread, or inline if already complete)."""
    t = clock()
    for e in entries:
        e[_T_END] = t
        e[_DONE] = True


class _TimedWork:
    """A Work handle that notes its completion time on the first successful wait.

    Everything but ``wait``/``is_completed`` is forwarded, so code that only waits on
    handles (Megatron's P2P communication) cannot tell it apart. It is not a
    ``torch.distributed.Work`` instance: a Python subclass of that pybind class costs
    ~2.6 us to create here, half the overhead budget.
    """

    __slots__ = ("_work", "_entries", "_tracer")

    def __init__(self, work: Any, entries: list[list], tracer: CallTracer) -> None:
        self._work = work
        self._entries: list[list] | None = entries
        self._tracer = tracer

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        cost = self._tracer.cost
        cost.left -= 1
        if cost.left <= 0:
            return cost.run(self._sampled_wait, (cost.timed(self._work.wait), args, kwargs), {})
        result = self._work.wait(*args, **kwargs)
        entries = self._entries
        if entries is not None:
            self._entries = None
            self._tracer._finish(entries)
        return result

    def _sampled_wait(self, wait: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """:meth:`wait` on a timed entry: ``wait`` is the handle's own, timed apart."""
        result = wait(*args, **kwargs)
        entries = self._entries
        if entries is not None:
            self._entries = None
            self._tracer._finish(entries)
        return result

    def is_completed(self) -> bool:
        done = self._work.is_completed()
        # on GPU "completed" says nothing about the current stream: the end event is
        # recorded at wait(), when that stream is made to wait for the transfer
        if done and self._entries is not None and self._tracer._cuda is None:
            entries, self._entries = self._entries, None
            self._tracer._finish(entries)
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)

    def __repr__(self) -> str:
        return f"_TimedWork({self._work!r})"


class P2PWrapper:
    """isend/irecv stand-in that compares equal to the function it wraps.

    ``P2POp(op, ...)`` accepts only ``op in [isend, irecv]`` of c10d's own module, and
    Megatron builds ``P2POp(torch.distributed.isend, ...)``: equality (not identity) lets
    our wrapper through. ``batch_isend_irecv`` then tells sends from receives by
    identity, so our batch wrapper puts the unwrapped function back into each P2POp.
    """

    def __init__(self, traced: Callable[..., Any], wrapped: Any, base: Any) -> None:
        self._call = traced
        self.__wrapped__ = wrapped
        #: c10d's own function, the one P2POp and batch_isend_irecv compare against
        self._base = base
        self.__name__ = getattr(wrapped, "__name__", "p2p")
        self.__qualname__ = getattr(wrapped, "__qualname__", self.__name__)
        self.__doc__ = getattr(wrapped, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __eq__(self, other: object) -> bool:
        return other is self or other is self.__wrapped__ or other is self._base

    def __hash__(self) -> int:
        return hash(self._base)

    def __repr__(self) -> str:
        return f"<traced {self.__name__}>"


def _reaches(fn: Any, target: Any) -> bool:
    """Is ``fn`` the ``target`` function or a wrapper (``__wrapped__`` chain) around it?

    Not "unwrap to the innermost": c10d's own collectives are themselves decorated, and
    c10d compares against the decorated module attribute.
    """
    for _ in range(16):
        if fn is target:
            return True
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return False
    return False


def _collective_wrapper(
    tracer: CallTracer, spec: _OpSpec, orig: Callable[..., Any]
) -> Callable[..., Any]:
    """The traced ``orig``; its twin that runs on sampled entries times ``orig`` apart."""
    sampled = _collective_traced(tracer, spec, tracer.cost.timed(orig), None)
    return _collective_traced(tracer, spec, orig, sampled)


def _collective_traced(tracer: CallTracer, spec: _OpSpec, orig: Callable[..., Any],
                       sampled: Callable[..., Any] | None) -> Callable[..., Any]:
    """Records one call; ``sampled``: the twin a timed entry runs (None: this is it)."""
    trap, clock, track, cuda, cost = tracer.trap, tracer._clock, tracer._track, tracer._cuda, tracer.cost
    run = cost.run
    op, tpos, tkw, many = spec.op, spec.tensor_pos, spec.tensor_kw, spec.many
    gpos, apos = spec.group_pos, spec.async_pos

    def traced(*args: Any, **kwargs: Any) -> Any:
        if trap.armed:
            trap._hold()
        if sampled is not None:
            cost.left -= 1
            if cost.left <= 0:
                return run(sampled, args, kwargs)
        ev0 = cuda.record() if cuda is not None else None
        t_issue = clock()
        out = orig(*args, **kwargs)
        t_ret = clock()
        try:
            n = len(args)
            if tpos is None:
                nbytes = 0
            else:
                t = args[tpos] if n > tpos else kwargs[tkw]
                nbytes = sum(x.nbytes for x in t) if many else t.nbytes
            group = args[gpos] if n > gpos else kwargs.get("group")
            is_async = args[apos] if n > apos else kwargs.get("async_op", False)
            return track(op, group, nbytes, None, None, t_issue, t_ret, out, is_async, ev0)
        except Exception:
            tracer._fail()
            return out

    functools.update_wrapper(traced, orig)
    return traced


def _p2p_wrapper(tracer: CallTracer, name: str, op: str, peer_kw: str, gpeer_kw: str,
                 is_async: bool, orig: Callable[..., Any]) -> Callable[..., Any]:
    """The traced ``orig``; its twin that runs on sampled entries times ``orig`` apart."""
    sampled = _p2p_traced(tracer, name, op, peer_kw, gpeer_kw, is_async, tracer.cost.timed(orig), None)
    return _p2p_traced(tracer, name, op, peer_kw, gpeer_kw, is_async, orig, sampled)


def _p2p_traced(tracer: CallTracer, name: str, op: str, peer_kw: str, gpeer_kw: str, is_async: bool,
                orig: Callable[..., Any], sampled: Callable[..., Any] | None) -> Callable[..., Any]:
    """Records one call; ``sampled``: the twin a timed entry runs (None: this is it)."""
    trap, clock, track, cuda, cost = tracer.trap, tracer._clock, tracer._track, tracer._cuda, tracer.cost
    run = cost.run
    # c10d's own batch_isend_irecv, handed a P2POp holding this wrapper, mistakes the send
    # for a receive and passes ``group_src``: translate instead of failing
    fix_src = name == "isend"
    sync_recv = name == "recv"

    def traced(*args: Any, **kwargs: Any) -> Any:
        if trap.armed:
            trap._hold()
        if sampled is not None:
            cost.left -= 1
            if cost.left <= 0:
                return run(sampled, args, kwargs)
        if fix_src and "group_src" in kwargs:
            kwargs["group_dst"] = kwargs.pop("group_src")
        ev0 = cuda.record() if cuda is not None else None
        t_issue = clock()
        out = orig(*args, **kwargs)
        t_ret = clock()
        try:
            n = len(args)
            tensor = args[0] if n else kwargs["tensor"]
            group = args[2] if n > 2 else kwargs.get("group")
            peer = args[1] if n > 1 else kwargs.get(peer_kw)
            gpeer = kwargs.get(gpeer_kw) if peer is None else None
            if sync_recv and peer is None and type(out) is int:
                peer = out  # recv from any source returns the sender
            return track(op, group, tensor.nbytes, peer, gpeer, t_issue, t_ret, out, is_async, ev0)
        except Exception:
            tracer._fail()
            return out

    functools.update_wrapper(traced, orig)
    return traced


def _batch_wrapper(tracer: CallTracer, orig: Callable[..., Any]) -> Callable[..., Any]:
    """The traced ``orig``; its twin that runs on sampled entries times ``orig`` apart."""
    sampled = _batch_traced(tracer, tracer.cost.timed(orig), None)
    return _batch_traced(tracer, orig, sampled)


def _batch_traced(tracer: CallTracer, orig: Callable[..., Any],
                  sampled: Callable[..., Any] | None) -> Callable[..., Any]:
    """Records one batch; ``sampled``: the twin a timed entry runs (None: this is it)."""
    trap, clock, cuda, cost = tracer.trap, tracer._clock, tracer._cuda, tracer.cost
    run = cost.run

    def traced(p2p_op_list: Any) -> Any:
        if trap.armed:
            trap._hold()
        if sampled is not None:
            cost.left -= 1
            if cost.left <= 0:
                return run(sampled, (p2p_op_list,), {})
        evs = None
        try:
            for p in p2p_op_list:
                fn = getattr(p, "op", None)
                if isinstance(fn, P2PWrapper):
                    p.op = fn._base  # c10d compares with ``is`` against its own isend
            if cuda is not None:
                evs = [cuda.record() for _ in p2p_op_list]
        except TypeError:
            pass  # not a list: the original rejects it with its own message
        t_issue = clock()
        works = orig(p2p_op_list)
        t_ret = clock()
        try:
            return tracer._track_batch(p2p_op_list, works, t_issue, t_ret, evs)
        except Exception:
            tracer._fail()
            return works

    functools.update_wrapper(traced, orig)
    return traced


def _coalescing_wrapper(tracer: CallTracer, orig: Callable[..., Any]) -> Callable[..., Any]:
    """``_coalescing_manager`` that tells the tracer when its queued calls really ran."""

    cost = tracer.cost
    cpu = time.thread_time

    @contextlib.contextmanager
    def traced(group: Any = None, device: Any = None, async_ops: bool = False) -> Any:
        from torch.distributed import distributed_c10d as c10d

        cost.left -= 1
        timed = cost.left <= 0 and not cost._busy  # sampled: our code before and after, timed
        if timed:
            cost.restart()  # the calls queued inside are entries of their own
        t0 = cpu() if timed else 0.0
        pg = group if group is not None else c10d._get_default_group()
        entries: list[list] = []
        tracer._open_batches[pg] = entries
        spent = cpu() - t0 if timed else 0.0
        try:
            with orig(group, device, async_ops) as cm:
                yield cm
        finally:
            t1 = cpu() if timed else 0.0
            tracer._open_batches.pop(pg, None)
        if entries:
            try:
                tracer._close_batch(entries, cm, async_ops)
            except Exception:
                tracer._fail()
        if timed:
            cost.add_sample(spent + cpu() - t1)

    functools.update_wrapper(traced, orig)
    return traced


def rebind_aliases(replace: dict[int, tuple[Any, Any]]) -> list[tuple[dict, str, Any, Any]]:
    """Point module-global aliases of the originals (in Megatron modules) at the wrappers.

    ``replace``: id(original) -> (original, wrapper). Returns the rebindings made, which
    :func:`restore_aliases` undoes (the tracer and the test bed's emulator both use it).
    """
    done: list[tuple[dict, str, Any, Any]] = []
    for modname, module in list(sys.modules.items()):
        if module is None or not _alias_module(modname):
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for key, value in list(namespace.items()):
            hit = replace.get(id(value))
            if hit is not None and hit[0] is value:
                namespace[key] = hit[1]
                done.append((namespace, key, hit[0], hit[1]))
    return done


def restore_aliases(
    done: list[tuple[dict, str, Any, Any]], wrappers: dict[int, tuple[Any, Any]]
) -> None:
    """Undo :func:`rebind_aliases`, and unbind wrappers aliased by modules imported since.

    Each alias gets back the very object it held (c10d's function or the wrapper below).
    """
    for namespace, key, orig, wrapper in done:
        if namespace.get(key) is wrapper:
            namespace[key] = orig
    rebind_aliases(wrappers)


def _alias_module(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in ALIAS_MODULE_PREFIXES)


class _CudaTiming:
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
            import torch

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
        t_end = self.to_host(e[_EV1], e[_T_ISSUE])
        if t_end is None:
            return None
        t_start = self.to_host(e[_EV0], e[_T_ISSUE]) if e[_EV0] is not None else None
        for i in (_EV0, _EV1):
            if e[i] is not None:
                self._pool.append(e[i])
                e[i] = None
        return t_start, t_end

    def start_or_none(self, e: list) -> float | None:
        """t_start of an entry given up on (its end never came); events are not reused."""
        return self.to_host(e[_EV0], e[_T_ISSUE])
