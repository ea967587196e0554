"""falconext inside one training process: tracer, monitor, control client, suspensions.

The training loop makes three calls: :meth:`FalconRuntime.before_iteration` at the top
of each iteration (the only place a suspension can be scheduled from: the loop
iteration is the boundary every rank agrees on; it returns the mitigation action, if
any, that every rank applies from this iteration), :meth:`FalconRuntime.after_step`
with the step's micro-batch count and forward seconds (what S2 balances on), and
:meth:`FalconRuntime.close` at the end. With Megatron-LM the same calls go in
``train()`` (patches/).

A job that cannot make those calls (any torch.distributed script, with only its calls
to go by) passes ``loop_starts=None``: the tracker's own iteration count is then the
clock for events, heartbeats and suspensions (:class:`falconext.runtime.monitor.RankMonitor`),
and a suspension traps the first call of the agreed iteration by its sequence number.
Nothing can apply a mitigation there, so the configuration turns mitigation off.

Everything else runs off the training thread. A suspension traps the first collective
of the agreed iteration; validation traffic uses a dedicated gloo group created at
start-up (before the tracer, on every rank, so creating it cannot deadlock later) and
the torch.distributed functions found below the tracer.

What falconext costs the rank is kept as CPU time by component
(:meth:`FalconRuntime.cpu_seconds`, :meth:`FalconRuntime.overhead`), and
:meth:`FalconRuntime.set_enabled` turns it off and on at iteration boundaries, so a
benchmark can compare iterations with and without it in one run.
"""

from __future__ import annotations

import collections
import datetime
import math
import os
import threading
import time
from collections.abc import Sequence
from typing import Any, Callable

import torch

from falconext.config import FalconConfig
from falconext.control.client import JOB_ENV, REDIS_URL_ENV, RankClient
from falconext.protocol.actions import MitigationAction
from falconext.protocol.commands import Go, Release, Resume, Suspend, ValidationShare
from falconext.protocol.rank_side import beat_fields, beat_iter_s, beat_mb_s, fail_slow_report, missed_ack
from falconext.protocol.eventlog import EventLog
from falconext.runtime.monitor import RankMonitor
from falconext.trace.groups import megatron_roles, to_process, to_rank
from falconext.trace.hooks import CallTracer
from falconext.validate.gemm import gemm_benchmark
from falconext.validate.p2p import run_passes
from falconext.validate.plan import rank_work
from falconext.validate.suspension import Bench, Suspension


def step_forward_s(forward_s: Sequence[float]) -> float | None:
    """One step's compute per micro-batch: the fastest of its micro-batches' forward
    times, None without a usable one (none, or any not finite and > 0).

    A device's time for a micro-batch is a floor that the host only adds to (a thread
    holding the interpreter, a busy core, a page fault), and a slow GPU slows every
    micro-batch of a step alike: so the floor of the step measures the device, where the
    mean carried every stall of the step into what S2 balances on (healthy replicas read
    up to 1.6x their device time on the loaded 2-core test host, and S2 planned
    [8, 7, 8, 9] for a 2x straggler whose best plan is [9, 5, 9, 9])."""
    if not forward_s or not all(math.isfinite(t) and t > 0 for t in forward_s):
        return None
    return min(forward_s)

class FalconRuntime:
    """falconext in one training process (module docstring): installs the tracer, runs the
    monitor and, with ``redis_url``, the control client; schedules and runs suspensions
    for validation and hands the training loop the mitigation actions every rank agreed
    on. No failure of its own reaches training: without Redis it keeps tracking locally."""

    def __init__(
        self,
        config: FalconConfig,
        rank: int,
        node: int,
        out: str,
        events: EventLog,
        loop_starts: list[float] | None,
        *,
        redis_url: str | None = None,
        job: str | None = None,
        matmul: Callable[..., Any] = torch.matmul,
        device: str = "cpu",
        replica: int = -1,
        restart_s: float = 0.0,
        calls_suffix: str = "",
        first_iteration: int = 0,
        spill_estimates: Callable[[list], None] | None = None,
        chaos: Any = None,
    ) -> None:
        self.cfg = config
        self.rank = rank
        self.node = node
        self.events = events
        self.loop_starts = loop_starts
        #: the training loop calls before_iteration (False: the calls are the clock)
        self.hooked = loop_starts is not None
        self._first_iteration = first_iteration  # loop_starts[0] is this iteration's start
        self._iteration = -1
        self._lock = threading.Lock()
        self._pending: Suspension | None = None
        self._active: Suspension | None = None
        self._matmul = matmul
        self._device = device
        self.suspensions: list[Suspension] = []
        self.replica = replica
        self.restart_s = restart_s
        #: measured pause of the last topology switch (S3's cost); 0: none yet
        self.switch_s = 0.0
        #: the role this process plays, for the heartbeats (see :meth:`set_role`)
        self.role: dict[str, int] = {}
        self._mb_s: collections.deque[float] = collections.deque(maxlen=config.beat_compute_window)
        self._action: tuple[int, MitigationAction] | None = None
        #: this rank's shares of the latest validation plans, by session
        self._shares: dict[int, list[ValidationShare]] = {}
        self._micro = 0
        self._enabled = True
        #: loop iterations run with falconext on (the denominator of the per-iteration cost)
        self.iterations_on = 0
        #: (iteration, on) at each set_enabled change; falconext is on before the first
        self.toggles: list[tuple[int, bool]] = []
        self._off_cpu: dict[str, float] = {}  # CPU seconds by component spent while off
        self._off_mark: dict[str, float] = {}  # cpu_seconds() when falconext was last turned off

        url = redis_url or os.environ.get(REDIS_URL_ENV) or None
        self.control = bool(config.control_plane and url)
        self._vgroup = None
        self._bgroup = None
        if self.control:
            # every rank creates them, even one whose Redis is unreachable: new_group is collective
            self._new_groups()

        self.tracer = CallTracer(rank, roles=megatron_roles(), cuda_events=device == "cuda")
        self.tracer.install()
        self.monitor = RankMonitor(
            self.tracer.drain, config, rank, loop_starts, events,
            os.path.join(out, "calls", f"rank{rank}{calls_suffix}.jsonl"), on_event=self._on_event,
            first_iteration=first_iteration, spill=spill_estimates, on_iteration_s=self._pending_timeout,
        )
        self.client = None
        if self.control:
            self.client = RankClient(url, job or os.environ.get(JOB_ENV, "falcon"), rank, node, config, self, events.emit,
                                     chaos=chaos)
        self.monitor.start()
        if self.client is not None:
            self.client.start()
        backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
        events.emit("tracking_started", rank=rank, control=self.control, loop_hooks=self.hooked, backend=backend,
                    timing="cuda_events" if device == "cuda" else "host")

    # --- called by the training loop --------------------------------------------------------

    def before_iteration(self, it: int) -> MitigationAction | None:
        """Arms a scheduled suspension; returns the action committed for this iteration."""
        self._iteration = it
        self.iterations_on += self._enabled
        self.monitor.wake()  # the previous iteration's calls are in: read them
        action = None
        if self._action is not None and self._action[0] <= it:
            action, self._action = self._action[1], None
        self._arm(it)
        return action

    def after_step(self, micro_batches: int, forward_s: Sequence[float]) -> None:
        """The step ran ``micro_batches`` micro-batches whose forwards took ``forward_s``
        seconds each: the step's reading (:func:`step_forward_s`) is kept for the
        heartbeat's per-micro-batch time (what S2 balances on)."""
        if micro_batches != self._micro and self._micro:
            self.monitor.restep()  # another share of the batch: another compute per iteration
        self._micro = micro_batches
        reading = step_forward_s(forward_s) if micro_batches > 0 else None
        if reading is not None:
            self._mb_s.append(reading)

    def _arm(self, it: int) -> None:
        pend = self._pending
        if pend is None:
            return
        with self._lock:
            pend, self._pending = self._pending, None
        if pend is None:
            return
        if it == pend.iteration and self._enabled:
            self._active = pend
            self.suspensions.append(pend)
            self.tracer.trap.arm(self.cfg.suspend_deadline_s, on_hold=pend.run)
        elif it >= pend.iteration or not self._enabled:  # too late, or no trap while off
            self._missed(pend.session, it)
        else:
            self._pending = pend  # not yet

    def _missed(self, session: int, it: int) -> None:
        """Tell the controller this rank will not hold for ``session``."""
        if self.client is not None:
            self.client.post(missed_ack(self.rank, session, it, time.time()))

    # --- falconext on and off (benchmarks) ----------------------------------------------------

    @property
    def enabled(self) -> bool:
        """True while falconext is on (see :meth:`set_enabled`)."""
        return self._enabled

    def set_enabled(self, on: bool) -> None:
        """Turn falconext off or back on from this iteration; idempotent.

        Only at an iteration boundary, on the training thread, right after
        :meth:`before_iteration` (every rank at the same iteration). Off: a suspension
        armed or pending is dropped and answered "missed" (none is scheduled while off),
        the tracer is uninstalled (training calls torch.distributed directly), the
        monitor stops draining and analysing, and heartbeats stop (:meth:`iter_s` reads
        0). On: the tracer is installed again, at a boundary as at start, and the
        monitor and heartbeats resume. The iteration counts toward ``iterations_on``
        in the state it is left in.
        """
        on = bool(on)
        if on == self._enabled:
            return
        with self._lock:
            self._enabled = on
        if on:
            self._off_cpu = self._cpu_while_off()
            self.tracer.install()
            self.monitor.pause(False)
        else:
            self._drop_suspensions()
            self.tracer.uninstall()
            self.monitor.pause(True)
            self._off_mark = self.cpu_seconds()
        if self._iteration >= 0:
            self.iterations_on += 1 if on else -1
        self.toggles.append((self._iteration, on))

    def _drop_suspensions(self) -> None:
        """Disarm the trap and forget the pending suspension, answering "missed"."""
        trap = self.tracer.trap
        if trap.armed:
            trap.release()
            if self._active is not None and not trap.held:
                self._missed(self._active.session, self._iteration)
                self._active = None
        with self._lock:
            pend, self._pending = self._pending, None
        if pend is not None:
            self._missed(pend.session, self._iteration)

    # --- what falconext costs this rank ----------------------------------------------------------

    def cpu_seconds(self) -> dict[str, float]:
        """falconext's CPU seconds on this rank so far, by component.

        ``hooks``: the training thread inside the tracer's wrappers, the wrapped calls
        excluded (sampled estimate, :class:`falconext.trace.cost.HookCost`);
        ``suspension``: the training thread while trapped (validation work);
        ``monitor`` and ``client``: their threads' CPU clocks; ``total``: the sum. Thread
        CPU clocks count time on a core only, never waiting or sleeping.
        """
        parts = {
            "hooks": self.tracer.cost.seconds(),
            "suspension": self.tracer.trap.cpu_s,
            "monitor": self.monitor.cpu_seconds(),
            "client": self.client.cpu_seconds() if self.client is not None else 0.0,
        }
        parts["total"] = sum(parts.values())
        return parts

    def _cpu_while_off(self) -> dict[str, float]:
        """CPU seconds by component spent while falconext was off (idle threads polling),
        the current off phase included. The threads' clocks are as of their latest round
        (monitor 50 ms, client ~0.1 s), so a phase's share is that coarse."""
        off = dict(self._off_cpu)
        if not self._enabled:
            for k, v in self.cpu_seconds().items():
                off[k] = off.get(k, 0.0) + v - self._off_mark.get(k, 0.0)
        return off

    def overhead(self) -> dict[str, Any]:
        """What :func:`falconext.report.summary.write_rank_files` keeps of this rank's
        cost: CPU seconds by component while falconext was on (``cpu_s``, what the
        per-iteration cost divides) and while it was off (``cpu_off_s``: idle threads
        polling), the iterations run with falconext on, the hook estimator's counts, and
        the on/off toggles ([iteration, on])."""
        total = self.cpu_seconds()
        off = self._cpu_while_off()
        return {
            "rank": self.rank,
            "cpu_s": {k: round(v - off.get(k, 0.0), 6) for k, v in total.items()},
            "cpu_off_s": {k: round(off.get(k, 0.0), 6) for k in total},
            "iterations": self.iterations_on,
            "hook_calls": self.tracer.cost.calls,
            "hook_samples": self.tracer.cost.samples,
            "toggles": [[it, on] for it, on in self.toggles],
        }

    def set_role(self, role: int, stage: int, tp: int, pp: int, grad_bytes: int, act_bytes: int) -> None:
        """What S3 needs to know about this process's role; set at start and after a switch."""
        self.role = {"role": role, "stage": stage, "tp": tp, "pp": pp, "grad_bytes": grad_bytes,
                     "act_bytes": act_bytes}

    def untraced(self) -> dict[str, Callable[..., Any]]:
        """torch.distributed below the tracer: a topology switch's state hand-over is not
        training traffic and must not enter the call log."""
        return {name: self.tracer.original(name) for name in ("all_gather", "all_reduce", "isend", "irecv")}

    def bench_group(self) -> Any:
        """The group P2P validation sends over: NCCL on GPUs, the gloo group on CPU (None
        without a control plane: the default group)."""
        return self._bgroup

    def _new_groups(self) -> None:
        """The groups a suspension uses, bounded by a timeout from the config: gloo for the
        agreement, and for the P2P benchmark the job's own fabric (NCCL on GPUs: gloo's CPU
        tensors would measure the host network, not the links training uses)."""
        timeout = datetime.timedelta(seconds=max(10.0, 2 * self.cfg.suspend_deadline_s))
        self._vgroup = torch.distributed.new_group(backend="gloo", timeout=timeout)
        self._bgroup = (torch.distributed.new_group(backend="nccl", timeout=timeout)
                        if self._device == "cuda" else self._vgroup)

    def before_switch(self) -> None:
        """The world group is about to be re-created: the validation groups die with it."""
        self._vgroup = None
        self._bgroup = None

    def after_switch(self, replica: int, pause_s: float) -> None:
        """Runs on every process right after the new world group exists (collective)."""
        self.replica = replica
        self.switch_s = round(pause_s, 3)
        self._mb_s.clear()  # the new role's compute is another stage's
        self.monitor.restep()
        self.tracer.forget_groups()
        if self.control:
            self._new_groups()

    def close(self) -> None:
        """Release any held call, uninstall the tracer, stop the monitor after a final drain,
        then the control client. Call once, when training has ended."""
        self.tracer.trap.release()
        self.tracer.uninstall()
        self.monitor.stop()
        if self.client is not None:
            self.client.stop()

    # --- called by the control client (its thread) ------------------------------------------

    def iteration(self) -> int:
        """The loop's iteration, or without loop hooks the latest one counted from calls."""
        return self._iteration if self.hooked else self.monitor.tracked

    def beat_fields(self) -> dict[str, Any]:
        """The optional fields of this rank's next heartbeat: replica, median compute seconds
        per micro-batch, measured restart and switch costs, role, micro-batch count and the
        latest straggler sample (when there is one)."""
        scored = self.monitor.score_sample
        score = {} if scored is None else {
            "score_iteration": scored[0], "est_iter_s": scored[1].iter_s,
            "compute_s": scored[1].compute_s, "wait_s": scored[1].wait_s,
        }
        return beat_fields(into_s=self.into_s(), replica=self.replica, mb_s=beat_mb_s(self._mb_s),
                           restart_s=self.restart_s, switch_s=self.switch_s, role=self.role, micro=self._micro,
                           step=self.monitor.step_sample, **score)

    def into_s(self) -> float:
        """Seconds the current loop iteration has been running (perf_counter, as the loop's
        starts); -1 without loop hooks or before the first iteration."""
        starts, i = self.loop_starts, self._iteration - self._first_iteration
        if starts is None or not 0 <= i < len(starts):
            return -1.0
        return max(0.0, time.perf_counter() - starts[i])

    def iter_s(self) -> float:
        """Median recent loop iteration time; 0 (no heartbeat) while falconext is off."""
        if not self._enabled:
            return 0.0
        if not self.hooked:
            scored = self.monitor.score_sample
            return scored[1].iter_s if scored is not None else 0.0
        return beat_iter_s(self.loop_starts, self.cfg.beat_iter_window)

    def profile(self, window_s: float, limit: int = 1500) -> dict[str, Any]:
        """ProfileData's fields: at most ``limit`` of the calls of the last ``window_s``, and
        what says whether its collectives may run as NCCL's trees: the backend they run on
        and this process's ``NCCL_ALGO`` (the validation plan decides with them)."""
        snap = dict(self.monitor.profile_snapshot(window_s, limit))
        snap["fabric"] = self._fabric()
        snap["nccl_algo"] = os.environ.get("NCCL_ALGO")
        return snap

    def _fabric(self) -> str:
        """The default group's torch.distributed backend (``nccl``, ``gloo``, or e.g.
        ``cpu:gloo,cuda:nccl``); the device where there is none (between a topology
        switch's groups, or none initialised)."""
        try:
            if torch.distributed.is_initialized():
                return str(torch.distributed.get_backend())
        except (RuntimeError, ValueError):
            pass
        return str(self._device)

    def share(self, session: int, share: ValidationShare) -> None:
        """Keep this rank's share of session ``session``'s validation plan for its suspend
        (the shares come first; those of the latest few sessions are kept)."""
        self._shares.setdefault(session, []).append(share)
        while len(self._shares) > 4:
            self._shares.pop(min(self._shares))

    def schedule(self, cmd: Suspend) -> int | None:
        """Arm a suspension for ``cmd.iteration``; the current iteration if already past it."""
        session = cmd.session
        if cmd.validation is None and cmd.action is None:
            self.events.emit("control_error", rank=self.rank, error="suspend without plan or action")
            return None
        if not self.hooked:
            return self._schedule_by_calls(cmd, session)
        if self._iteration >= cmd.iteration or not self._enabled:
            return self._iteration
        sus = self._suspension(cmd, session)
        with self._lock:
            self._pending = sus
        return None

    def _suspension(self, cmd: Suspend, session: int) -> Suspension:
        """This rank's side of the suspension ``cmd`` asks for (either way of trapping), with
        its share of the validation plan."""
        work = rank_work(self._shares.get(session, []), self.rank) if cmd.validation is not None else None
        return Suspension(self.rank, session, cmd.iteration, cmd.validation, self._bench(), self.client.post,
                          self.events.emit, commit=self._commit, resend_s=self.cfg.heartbeat_s,
                          budget_s=self.cfg.validation_budget_s, action=cmd.action, work=work)

    def _schedule_by_calls(self, cmd: Suspend, session: int) -> int | None:
        """No loop hooks: trap the first call of ``cmd.iteration`` as this rank's calls
        count iterations; the latest counted iteration if that call is already past."""
        trap = self.tracer.trap
        target = self.monitor.first_seq_of(cmd.iteration)
        if target is None or target <= trap.seen + 1 or not self._enabled or trap.held:
            return self.monitor.tracked
        sus = self._suspension(cmd, session)
        self._active = sus
        self.suspensions.append(sus)
        trap.arm(self.cfg.suspend_deadline_s, on_hold=sus.run, at_seq=target)
        return None

    def signal(self, cmd: Go | Release | Resume) -> None:
        """A suspension signal from the controller (control client's thread): passed to the
        suspension of ``cmd.session`` (active or pending), a ``resume`` with the ``action`` it
        carries; ``release`` also drops a pending one and, without loop hooks, disarms a
        trap that has not caught its call yet. Signals of other sessions are ignored."""
        session = cmd.session
        for sus in (self._active, self._pending):
            if sus is not None and sus.session == session:
                match cmd:
                    case Go():
                        sus.go()
                    case Release():
                        sus.release()
                    case Resume(action=action):
                        sus.resume(action)
        if isinstance(cmd, Release):
            with self._lock:
                if self._pending is not None and self._pending.session == session:
                    self._pending = None
            trap = self.tracer.trap
            if not self.hooked and self._active is not None and self._active.session == session and not trap.held:
                trap.release()  # armed at a call not reached yet: nothing to hold any more

    # --- internals -----------------------------------------------------------------------

    def _commit(self, action: MitigationAction) -> None:
        """Runs on the trapped training thread of iteration K: the step of K is already
        under way with the old plan, so the action takes effect from K + 1 on every rank."""
        self._action = (self._iteration + 1, action)

    def _on_event(self, kind: str, fields: dict[str, Any]) -> None:
        """The monitor's reported event (its event-log record's ``kind`` and fields, in loop
        iterations) as a FailSlowReport to the controller."""
        if self.client is None:
            return
        report = fail_slow_report(self.rank, kind, fields["event_id"], fields.get("onset"), fields.get("detected_at"),
                                  fields["slowdown"], fields["baseline_s"], time.time(), fields.get("end"),
                                  fields.get("ended_at"))
        if report is not None:
            self.client.post(report)

    def _pending_timeout(self, iter_s: float) -> None:
        """How long the tracer waits for a call's completion: scaled to the iteration."""
        c = self.cfg
        self.tracer.pending_timeout_s = max(c.pending_timeout_s, c.pending_timeout_iterations * iter_s)

    def _bench(self) -> Bench:
        tr = self.tracer
        send, recv, barrier = tr.original("send"), tr.original("recv"), tr.original("barrier")
        all_reduce = tr.original("all_reduce")
        group = self._vgroup
        on_gpu = self._device == "cuda"
        sync = torch.cuda.synchronize if on_gpu else None
        device = f"cuda:{torch.cuda.current_device()}" if on_gpu else "cpu"

        def gemm(n: int, repeats: int) -> float:
            # the best repeat, not the median: on a shared host, time-slicing only ever
            # adds time, and a slow device is slow in every repeat; on a GPU each repeat is
            # timed with CUDA events (a host clock around a synchronize times the launch too)
            result = gemm_benchmark(n, repeats, matmul=self._matmul, device=self._device)
            return result.best_flops

        def passes(schedule: list, nbytes: int, repeats: int, concurrency: int) -> list:
            # the plan names processes; send/recv take torch ranks (different after S3)
            ranked = [[(to_rank(a), to_rank(b)) for a, b in p] for p in schedule]
            # on the job's fabric: NCCL and device tensors on GPUs (bench_group), gloo on CPU
            found = run_passes(ranked, to_rank(self.rank), nbytes, repeats, group=self.bench_group(), send=send,
                               recv=recv, barrier=barrier, concurrency=concurrency, device=device, sync=sync)
            return [(to_process(a), to_process(b), sec) for a, b, sec in found]

        def agree_stop(spent: bool) -> bool:
            # any rank out of budget stops every rank at this step: a MAX over the group
            flag = torch.tensor([1 if spent else 0], dtype=torch.int32)
            all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
            return bool(flag.item())

        bgroup = self.bench_group()
        backend = torch.distributed.get_backend(bgroup) if torch.distributed.is_initialized() else "none"
        return Bench(gemm, passes, lambda: barrier(group=group), fabric=f"{backend}:{device}", agree_stop=agree_stop)
