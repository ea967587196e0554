"""The calls Megatron-LM's training makes into falconext, one process at a time.

Two ways in, one implementation:

- **the patch** (``patches/megatron-lm/<version>.patch``) adds ``--falcon`` and ``--falcon-*``
  to Megatron-LM's parser (:func:`add_arguments`) and calls :func:`on_initialized`,
  :func:`forward_backward`, :func:`loop_start`, :func:`loop_end` and :func:`train_sampler`
  from ``pretrain()``/``train()``/``build_pretraining_data_loader``;
- **the launcher** (``falconext launch ... --falcon``, no file of Megatron-LM changed): each
  rank starts in :mod:`falconext.megatron_lm.rank`, which puts wrappers making the same
  calls in place of the names ``train()`` looks up when it runs
  (:mod:`falconext.megatron_lm.contract` checks them first).

What a rank does with them: from the first iteration on, falconext's runtime intercepts the
collectives (tracer, per-rank detection, control client: the same as in the test bed);
:func:`loop_start` gives it the loop's iteration boundary and applies what the controller
committed there (S2: a micro-batch plan, from an iteration the data loader has not
prefetched; S4: Megatron's own exit signal, so Megatron saves its checkpoint and exits 0,
and a restart request for the launcher; S3: the same restart, asking the launcher to hand
the torch ranks to the processes in a new order). Megatron's LR schedule, consumed samples and
logging keep the even values: only the count of micro-batches each replica runs changes.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable

from falconext.config import FalconConfig, add_config_arguments, config_from_args, parse_microbatches, parse_topology
from falconext.control.client import JOB_ENV, REDIS_URL_ENV
from falconext.control.plane import MAX_RESTARTS, agent_argv, falcon_argv
from falconext.control.service import PARENT_ENV
from falconext.elastic.hosts import HARDWARE_NODE_ENV, node_name
from falconext.elastic.restart import RESTART_EXIT, NodeLeave, mark_joined, wait_left, write_leave
from falconext.emulation.gpu_fault import BusyKernel
from falconext.megatron_lm import contract
from falconext.megatron_lm.sampler import PlanError, PlannedSampler, PlanSchedule
from falconext.mitigate import restart
from falconext.mitigate.restart import LAUNCH_TIME_ENV
from falconext.mitigate.topology import rank0_on_first_node
from falconext.model.device import DEFAULT_GFLOPS, DeviceModel, gpt_forward_flops
from falconext.model.faults import on_hardware, placed, read_faults
from falconext.protocol.actions import MicrobatchPlan, Restart, TopologyChange
from falconext.report.device import write_device_record
from falconext.runtime.host import PlanRefused, apply_action, versions
from falconext.model.roles import check_roles
from falconext.protocol.eventlog import EventLog, ForwardingEventLog
from falconext.protocol.messages import RankEvent
from falconext.report import summary as report
from falconext.report.summary import EstimatesFile
from falconext.trace import groups

#: the environment variable holding the launcher's ``--falcon*`` flags (a JSON list)
FLAGS_ENV = "FALCONEXT_MEGATRON_FLAGS"
#: the roles after an S3 restart: a JSON list, ``roles[process]`` = the torch rank that
#: process (launch slot: its GPU, its node) plays; absent: every process plays its own
ROLES_ENV = "FALCONEXT_ROLES"

_session: "Session | None" = None


def add_falcon_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--falcon`` and every ``--falcon-*`` flag on ``parser``; returns it."""
    group = parser.add_argument_group("falconext (fail-slow detection and mitigation)")
    group.add_argument("--falcon", action="store_true", help="turn falconext on")
    group.add_argument("--falcon-out", default=None, help="where falconext writes its files (default: falcon-out)")
    group.add_argument("--falcon-inject", default=None,
                       help="fault file (test bed JSON): stretch a rank's compute or a link from an iteration on")
    group.add_argument("--falcon-device", choices=("auto", "emulated", "cpu", "cuda"), default="auto",
                       help="whose clock times the work: auto = cuda where there is one, else the emulated device")
    group.add_argument("--falcon-device-gflops", type=float, default=None,
                       help="the emulated device's throughput (default: the test bed's)")
    group.add_argument("--falcon-ranks-per-node", type=int, default=None,
                       help="ranks per (virtual) node (default: --nproc-per-node)")
    group.add_argument("--falcon-on-exclude", default=None, metavar="CMD",
                       help="a job of several launchers: the excluded node's launcher runs CMD in a shell as it "
                       "leaves, {host} replaced by its host name (e.g. scontrol update nodename={host} state=drain)")
    group.add_argument("--falcon-force-restart", type=int, default=None,
                       help="operator override: S4 at this iteration (checkpoint with Megatron's exit path, relaunch)")
    add_config_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's parser with falconext's flags (the patch calls this)."""
    return add_falcon_flags(parser)


def parse_flags(argv: list[str]) -> argparse.Namespace:
    """The launcher's ``--falcon*`` flags, strictly: an unknown one is a one-line error."""

    class _Strict(argparse.ArgumentParser):
        def error(self, message: str) -> None:  # type: ignore[override]
            raise FlagError(message)

    parser = add_falcon_flags(_Strict(prog="falconext launch", add_help=False))
    return parser.parse_args(argv)


class FlagError(ValueError):
    """A ``--falcon*`` flag that falconext does not know, or a bad value."""


def roles_from_env(world: int, environ: dict[str, str] | None = None) -> list[int] | None:
    """The roles the launcher set (:data:`ROLES_ENV`), checked to be a permutation of
    ``range(world)``; None when unset. A bad value is a :class:`ValueError` naming it."""
    text = (os.environ if environ is None else environ).get(ROLES_ENV, "")
    if not text:
        return None
    try:
        roles = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"{ROLES_ENV}={text!r} is not a JSON list") from None
    if not isinstance(roles, list):
        raise ValueError(f"{ROLES_ENV}={text!r} is not a JSON list")
    return list(check_roles(roles, world, ROLES_ENV))


def on_initialized(args: argparse.Namespace, flags: argparse.Namespace | None = None) -> None:
    """After ``initialize_megatron``: start falconext on this rank if ``args.falcon`` (the
    patch: the flags are Megatron's) or ``flags.falcon`` (the launcher's flags)."""
    global _session
    source = flags if flags is not None else args
    if _session is not None or not getattr(source, "falcon", False):
        return
    names = vars(parse_flags([]))
    picked = argparse.Namespace(**{k: getattr(source, k, None) for k in names})
    _session = Session(config_from_args(picked), picked, args)


def session() -> "Session | None":
    """This process's falconext session, or None before :func:`on_initialized` (or without ``--falcon``)."""
    return _session


def forward_backward(func: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron's forward-backward function, running this replica's planned micro-batches."""
    return func if _session is None else _session.wrap_forward_backward(func)


def loop_start(iteration: int) -> None:
    """Megatron's training loop starts ``iteration``: the session's per-iteration work (nothing without a
    session)."""
    if _session is not None:
        _session.loop_start(iteration)


def loop_end() -> None:
    """Megatron's training step is over: the session records it (nothing without a session)."""
    if _session is not None:
        _session.loop_end()


def train_sampler(batch_sampler: Any, dataset: Any) -> Any:
    """Megatron's training batch sampler, or falconext's planned one (S2 can run)."""
    return batch_sampler if _session is None else _session.train_sampler(batch_sampler, dataset)


class Session:
    """falconext in one Megatron-LM rank (created by :func:`on_initialized`)."""

    def __init__(self, cfg: FalconConfig, flags: argparse.Namespace, margs: argparse.Namespace) -> None:
        import torch  # lazy: start-up time (the launcher imports megatron_lm.hooks: no torch there)

        self.cfg = cfg
        self.flags = flags
        self.margs = margs
        self.created = time.time()

        self.rank = torch.distributed.get_rank()
        self.world = torch.distributed.get_world_size()
        #: after an S3 restart, process (GPU, node, faults, files) and torch rank differ
        self.roles = roles_from_env(self.world)
        groups.set_roles(self.roles)
        self.process = groups.to_process(self.rank)
        self.out = flags.falcon_out or "falcon-out"
        self.attempt = int(os.environ.get(ATTEMPT_ENV, "0"))
        self.suffix = f"-r{self.attempt}" if self.attempt else ""
        os.makedirs(os.path.join(self.out, "ranks"), exist_ok=True)
        os.makedirs(os.path.join(self.out, "calls"), exist_ok=True)
        #: one of several launchers (one per node): the controller alone writes events.jsonl
        self.multi_node = os.environ.get(MULTI_NODE_ENV) == "1"
        #: this process's rank on its node (torchrun's LOCAL_RANK); local rank 0 speaks for the node
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        #: each node's host by node index, known from the first iteration's all-gather
        self.node_hosts: list[str] = []
        self.node_name = node_name()
        if self.multi_node:
            self.events: EventLog = ForwardingEventLog(os.path.join(self.out, "nodes", self.node_name, "events.jsonl"))
        else:
            self.events = EventLog(os.path.join(self.out, "events.jsonl"))
        self._agent: Any = None

        self.estimates_file = EstimatesFile(self.out, self.process, self.suffix)
        self.loop_starts: list[float] = []
        self.measured: list[tuple[int, float, float | None]] = []
        self.runtime = None
        self.device = None
        #: compute faults on a CUDA device (--falcon-inject with --falcon-device cuda)
        self.busy: Any = None
        self.iteration = -1
        self._t_start = 0.0
        self._t_end = 0.0  # when the last step ended (loop_end)
        self._forward_s: list[float] = []  # each forward step's seconds in this step
        self._micro = 0
        self._model_seen = False
        self._restart: dict[str, Any] | None = None
        self._leaving = False
        self._closed = False
        #: the training data loader draws from the planned sampler (S2 can run)
        self.sampler_planned = False
        # lazy: run-time order (megatron-core only in ranks, after cpu_compat)
        from megatron.core import parallel_state as ps

        self.tp = ps.get_tensor_model_parallel_world_size()
        self.pp = ps.get_pipeline_model_parallel_world_size()
        self.dp = ps.get_data_parallel_world_size()
        self.replica = ps.get_data_parallel_rank()
        self.stage = ps.get_pipeline_model_parallel_rank()
        self.ranks_per_node = flags.falcon_ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", self.world))

        microbatches = margs.global_batch_size // margs.micro_batch_size
        self.schedule = PlanSchedule(self.dp, microbatches)
        #: why S2 cannot be exact in this job (None: it can)
        self.s2_refused = contract.s2_refusal(margs)
        forced = parse_microbatches(cfg.force_microbatches)
        if forced is not None:
            if self.s2_refused:
                raise FlagError(f"--falcon-force-microbatches: {self.s2_refused}")
            self.schedule.set(0, forced)
        self.forced_topology = parse_topology(cfg.force_topology)
        if self.forced_topology is not None:
            check_roles(self.forced_topology[1], self.world, "--falcon-force-topology")
        self.faults = self._faults()
        atexit.register(self.close)

    # --- set-up --------------------------------------------------------------------------

    def _faults(self) -> list:
        self.job_faults: list = []
        if not self.flags.falcon_inject:
            return []

        faults = read_faults(self.flags.falcon_inject, self.world, self.ranks_per_node)
        self.job_faults = faults
        hardware = self._hardware()
        if hardware is not None:  # an emulated node of falconext nodes: faults follow the hardware
            faults = on_hardware(faults, self.process, *hardware)
        return faults

    def _hardware(self) -> tuple[int, int] | None:
        """(emulated node, local rank) this process runs on under ``falconext nodes``, else None."""
        hardware = os.environ.get(HARDWARE_NODE_ENV, "")
        return (int(hardware), self.local_rank) if hardware.isdigit() else None

    def _device_kind(self) -> str:
        import torch  # lazy: start-up time (the launcher imports megatron_lm.hooks: no torch there)

        kind = self.flags.falcon_device or "auto"
        if kind == "auto":
            return "cuda" if torch.cuda.is_available() else "emulated"
        return kind

    def _start(self, iteration: int) -> None:
        """Everything that must happen on every rank at the same point: the first iteration."""
        # lazy: start-up time (the launcher imports megatron_lm.hooks: no torch there)
        import torch

        from falconext.runtime.runtime import FalconRuntime

        kind = self._device_kind()
        if kind == "emulated":
            # lazy: start-up time (the launcher imports megatron_lm.hooks: no torch there)
            from falconext.emulation.emulator import EmulatedDevice

            gflops = self.flags.falcon_device_gflops or DEFAULT_GFLOPS
            self.device = EmulatedDevice(DeviceModel(gflops=gflops), self.process, self.ranks_per_node, self.faults)
            self.device.install()  # below the tracer
        elif kind == "cuda" and self.faults:  # a compute fault is a busy kernel on this rank's stream
            self.busy = BusyKernel(self.faults, self.process)
            if any(f.kind != "compute" for f in self.faults):
                self.events.emit("control_error", rank=self.process,
                                 error="--falcon-inject: link faults need the emulated device; only compute faults apply on CUDA")
        elif self.faults:
            self.events.emit("control_error", rank=self.process,
                             error="--falcon-inject needs the emulated device or CUDA (--falcon-device); ignored")
        topology = self._topology()
        #: each node's host, by node index (process // ranks_per_node)
        self.node_hosts = node_hosts(topology["ranks"], self.ranks_per_node)
        self._agree_on_plane(topology["ranks"])
        if self.rank == 0:
            self._write_run(topology)
        self.runtime = FalconRuntime(
            self.cfg, self.process, self.process // self.ranks_per_node, self.out, self.events,
            self.loop_starts if self.cfg.loop_hooks else None,  # --falcon-loop-hooks false: calls only
            matmul=self.device.matmul if self.device is not None else torch.matmul,
            device="cuda" if kind == "cuda" else "cpu", replica=self.replica, calls_suffix=self.suffix,
            first_iteration=iteration, spill_estimates=self.estimates_file.write,
        )
        self.runtime.set_role(self.rank, self.stage, self.tp, self.pp, *self._traffic())
        client = self.runtime.client
        if self.multi_node and client is not None:
            process = self.process
            self.events.forward_to(lambda record: client.post(RankEvent.of(process, record)))  # type: ignore[attr-defined]
            if self.local_rank == 0:
                self._agent = NodeAgentProcess(self, topology["ranks"]).start()
        if self.multi_node and self.local_rank == 0:
            mark_joined(self.out, self.node_name)  # a spare that joined is one no longer
            self.events.emit("node_joined", node=self.process // self.ranks_per_node, host=self.node_name,
                             attempt=self.attempt, world=self.world, round_id=round_id(os.environ),
                             agent_restarts=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0), ranks=sorted(int(r["process"]) for r in topology["ranks"]
                                                                if r.get("host") == self.node_name))

        launched = float(os.environ.get(LAUNCH_TIME_ENV, 0) or 0)
        if launched:  # S4's cost: this start-up (load included), measured
            self.runtime.restart_s = max(0.0, time.time() - launched)
            # S3 is a restart here too: its switch costs what a restart costs
            self.runtime.switch_s = round(self.runtime.restart_s, 3)
            self.events.emit("restart_probe", rank=self.process, iteration=iteration,
                             restart_s=round(self.runtime.restart_s, 4), startup_s=round(self.runtime.restart_s, 4))
            if self.attempt > 0 and self.rank == 0:  # the report's attempt boundary (the test bed's event)
                self.events.emit("restarted", iteration=iteration, attempt=self.attempt, load_s=None,
                                 downtime_s=round(self.runtime.restart_s, 3))
        if self.rank == 0 and self.s2_refused and self.cfg.mitigation and "S2" in self.cfg.strategies():
            self.events.emit("control_error", rank=0, error=f"S2 off: {self.s2_refused}")

    def _topology(self) -> dict[str, Any]:
        import torch  # lazy: start-up time (the launcher imports megatron_lm.hooks: no torch there)

        mine = {"rank": self.rank, "process": self.process, "tp_rank": 0, "pp_rank": self.stage,
                "dp_rank": self.replica, "node": self.process // self.ranks_per_node, "host": self.node_name,
                "plane": bool(os.environ.get(REDIS_URL_ENV)), "flags": flags_digest(os.environ.get(FLAGS_ENV, "[]")),
                "hardware": self._hardware()}
        # lazy: run-time order (megatron-core only in ranks, after cpu_compat)
        from megatron.core import parallel_state as ps

        mine["tp_rank"] = ps.get_tensor_model_parallel_rank()
        gathered: list = [None] * self.world
        torch.distributed.all_gather_object(gathered, mine)
        return {"world": self.world, "tp": self.tp, "pp": self.pp, "dp": self.dp,
                "ranks_per_node": self.ranks_per_node, "roles": self.roles, "ranks": gathered}

    def _agree_on_plane(self, ranks: list[dict[str, Any]]) -> None:
        """Every rank runs with the control plane, or none does (its collectives and
        agreements need every rank): when a node has no route to the plane, or its
        launcher's ``--falcon*`` flags differ from the others', the job trains on with
        falconext's control off on every rank (rank 0 says why, once). Same on all ranks:
        decided from the all-gathered topology."""
        why = plane_refusal(ranks)
        if why is None or not self.cfg.control_plane:
            return
        self.cfg = dataclasses.replace(self.cfg, control_plane=False)
        if self.rank == 0:
            print(f"falconext: {why}; the job trains on without falconext's control plane", flush=True)
            self.events.emit("control_error", rank=0, error=f"control plane off: {why}")

    def _write_run(self, topology: dict[str, Any]) -> None:
        path = os.path.join(self.out, f"run{self.suffix}.json")
        keep = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "micro_batch_size",
                "global_batch_size", "train_iters", "num_layers", "hidden_size", "seq_length", "log_interval")
        info = {
            "framework": "megatron-lm",
            "args": {k: getattr(self.margs, k, None) for k in keep},
            "falcon_config": self.cfg.to_dict(),
            "faults": [f.to_dict() for f in self._placed_faults(topology["ranks"])],
            "versions": versions(),
            "topology": topology,
            "clock": {"perf_counter": time.perf_counter(), "time": time.time()},
        }
        with open(path, "w") as f:
            json.dump(info, f, indent=2)

    def _placed_faults(self, ranks: list[dict[str, Any]]) -> list:
        """The job's faults, each named by hardware given the process running there."""
        where = {tuple(r["hardware"]): int(r["process"]) for r in ranks if r.get("hardware") is not None}
        return placed(self.job_faults, where) if where else self.faults

    def _traffic(self) -> tuple[int, int]:
        a = self.margs
        act = a.micro_batch_size * a.seq_length * a.hidden_size * 4
        h, layers = a.hidden_size, a.num_layers // max(1, self.pp)
        grad = 4 * (12 * h * h * layers) // max(1, self.tp)
        return grad, act

    def _forward_flops(self) -> float:
        a = self.margs
        vocab = getattr(a, "padded_vocab_size", None) or a.vocab_size or 0
        return gpt_forward_flops(a.num_layers // max(1, self.pp), a.hidden_size, a.seq_length, a.micro_batch_size,
                                 vocab, self.tp, self.stage == self.pp - 1)

    # --- the loop ------------------------------------------------------------------------

    def loop_start(self, iteration: int) -> None:
        """Iteration ``iteration`` begins: start the runtime on the first call, record the
        previous iteration's time, tell the emulated device, and apply the action the
        controller (or an operator override for this iteration) has agreed for it."""
        now = time.perf_counter()
        if self.runtime is None:
            self._start(iteration)
        elif self._t_start:
            self.measured.append((self.iteration, now - self._t_start, None))
        self._t_start = now
        self.iteration = iteration
        self.loop_starts.append(now)
        if self._agent is not None:
            self._agent.check()
        if self.device is not None:
            self.device.iteration = iteration
        if self.busy is not None:
            self.busy.at(iteration, [(i, t) for i, t, _ in self.measured])
        action = self.runtime.before_iteration(iteration) if self.cfg.loop_hooks else None
        if self._restart is None:  # operator overrides: a restart at a given iteration
            if self.flags.falcon_force_restart == iteration:
                action = Restart([], reason="forced")
            elif self.forced_topology is not None and self.forced_topology[0] == iteration:
                action = TopologyChange(list(self.forced_topology[1]), reason="forced")
        if action is not None:
            apply_action(self, action, iteration, self.events)

    def loop_end(self) -> None:
        """The step is over: hand the runtime this replica's micro-batch count and forward times."""
        self._t_end = time.perf_counter()
        if self.runtime is not None:
            self.runtime.after_step(self._micro, self._forward_s)

    # --- the rank host (runtime/host.py) ------------------------------------------------

    def apply_plan(self, action: MicrobatchPlan, iteration: int) -> dict[str, Any] | None:
        """S2 from the first iteration the data loader has not fetched yet; one
        ``plan_applied`` per node (every node applies it)."""
        why = self.s2_refused or (None if self.sampler_planned else
                                  "the training data loader does not draw from Megatron's single sampler")
        if why:
            raise PlanRefused(why)
        start = iteration + self._prefetch_lag()
        try:
            self.schedule.set(start, action.plan)
        except PlanError as exc:
            raise PlanRefused(str(exc)) from None
        if self.local_rank != 0:
            return None
        return {"iteration": start, "plan": self.schedule.plan_at(start), "strategy": action.strategy,
                "committed_at": iteration, "host": self.node_name}

    def change_topology(self, action: TopologyChange, iteration: int) -> None:
        """S3 inside Megatron-LM: a restart with the ranks in a new order."""
        self._request_restart(action, iteration)

    def restart(self, action: Restart, iteration: int) -> None:
        """S4 through Megatron's own exit path."""
        self._request_restart(action, iteration)

    def _prefetch_lag(self) -> int:
        """Iterations the training data loader may have drawn ahead: a plan starts after them."""
        workers = int(getattr(self.margs, "num_workers", 0) or 0)
        if workers <= 0:
            return 0
        # torch's DataLoader keeps prefetch_factor (2) batches per worker requested; each
        # replica runs at least one micro-batch per iteration
        return 2 * workers + 1

    def _request_restart(self, action: Restart | TopologyChange, iteration: int) -> None:
        """S4 (and S3, a restart with new roles) through Megatron's own exit path: its signal
        handler sees the signal after this step, every rank saves with ``save_checkpoint``
        and Megatron exits 0; rank 0 leaves the launcher a restart request at exit."""
        a = self.margs
        strategy = "S3" if isinstance(action, TopologyChange) else "S4"
        why = None
        if not getattr(a, "exit_signal_handler", False) or not getattr(a, "save", None):
            why = "Megatron-LM runs without --exit-signal-handler or --save"
        roles: list[int] | None = None
        if strategy == "S3" and why is None:
            try:
                roles = list(check_roles(action.roles if isinstance(action, TopologyChange) else [], self.world))
            except ValueError as exc:
                why = str(exc)
            if why is None and self.multi_node:  # ranks move between nodes: see resumed_roles
                anchored = rank0_on_first_node(roles, self.tp, self.dp, self.ranks_per_node)
                if anchored is None:
                    why = ("no process of node 0 would play a first-stage rank, and rank 0's process serves the "
                           "workers' store at node 0's address")
                roles = anchored
        if why is not None:
            self.events.emit("control_error", rank=self.process, error=f"{strategy} not applied: {why}")
            return
        nodes = action.exclude_nodes if isinstance(action, Restart) else []
        #: this node leaves the job (a job of several launchers: its launcher exits)
        self._leaving = self.multi_node and (self.process // self.ranks_per_node) in {int(n) for n in nodes}
        self._restart = {"iteration": iteration + 1, "exclude_nodes": [int(n) for n in nodes],
                         "session": action.session, "reason": action.reason or "",
                         "requested_at": time.time(), "checkpoint": a.save,
                         "extra": {"strategy": strategy, **({"roles": roles} if roles is not None else {}),
                                   **({"hosts": self.node_hosts} if roles is not None and self.multi_node else {})}}
        if self.rank == 0:
            fields: dict[str, Any] = {"roles": roles} if roles is not None else {}
            self.events.emit("restart_requested", iteration=iteration, resume_at=iteration + 1,
                             exclude_nodes=self._restart["exclude_nodes"], strategy=strategy,
                             forced=action.reason == "forced", **fields)
        if self.rank == 0:  # now, before any rank exits: the next round's ranks read it at start
            r = self._restart
            restart.write_request(self.out, restart.RestartRequest(
                iteration=r["iteration"], exclude_nodes=r["exclude_nodes"], checkpoint=r["checkpoint"],
                session=r["session"], requested_at=r["requested_at"], attempt=self.attempt + 1, reason=r["reason"],
                extra=r["extra"]))
        sig = getattr(a, "exit_signal", signal.SIGTERM)
        signal.raise_signal(sig)

    def wrap_forward_backward(self, func: Callable[..., Any]) -> Callable[..., Any]:
        """``func`` running ``schedule.count(iteration, replica)`` micro-batches in training
        steps (never in evaluation: ``forward_only``), timing the forward steps."""
        session = self

        def forward_backward_func(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("forward_only") or session.iteration < 0:
                return func(*args, **kwargs)
            if not session._model_seen:
                session._model_seen = True
                session._attach(kwargs.get("model"))
            count = session.schedule.count(session.iteration, session.replica) if session.sampler_planned \
                else session.schedule.microbatches // session.dp
            kwargs["num_microbatches"] = count
            step = kwargs.get("forward_step_func")
            session._forward_s = []
            session._micro = count
            if step is not None:
                kwargs["forward_step_func"] = session._timed(step)
            return func(*args, **kwargs)

        forward_backward_func.__wrapped__ = func  # type: ignore[attr-defined]
        return forward_backward_func

    def _timed(self, step: Callable[..., Any]) -> Callable[..., Any]:
        session = self

        def forward_step(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                session._forward_s.append(time.perf_counter() - t0)

        return forward_step

    def _attach(self, model: Any) -> None:
        if self.device is None or model is None:
            return
        chunk = model[0] if isinstance(model, (list, tuple)) else model
        while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
            chunk = chunk.module
        self.device.attach_model(chunk, self._forward_flops())

    def train_sampler(self, batch_sampler: Any, dataset: Any) -> Any:
        """The planned sampler in place of Megatron's for the training split (other splits,
        and samplers other than Megatron's plain one, are left alone and S2 stays off)."""
        try:
            # lazy: run-time order (megatron-core only in ranks, after cpu_compat)
            from megatron.core.datasets.utils import Split
        except ImportError:  # pragma: no cover - megatron-core is a dependency
            return batch_sampler
        split = getattr(dataset, "split", getattr(dataset, "index_split", None))
        if split != Split.train or type(batch_sampler).__name__ != "MegatronPretrainingSampler":
            return batch_sampler
        if self.s2_refused:
            return batch_sampler
        self.sampler_planned = True
        return PlannedSampler(batch_sampler.total_samples, batch_sampler.consumed_samples,
                              self.margs.micro_batch_size, self.margs.global_batch_size, self.replica, self.schedule)

    # --- the end -------------------------------------------------------------------------

    def close(self) -> None:
        """At exit: the last iteration's time, the rank's files, a restart request (rank 0)."""
        if self._closed:
            return
        self._closed = True
        if self._t_start and self.iteration >= 0:  # it ended at its step's end, not at exit (a checkpoint)
            end = self._t_end if self._t_end > self._t_start else time.perf_counter()
            self.measured.append((self.iteration, end - self._t_start, None))

        if self._restart is not None and self._leaving and self.local_rank == 0:
            leave = NodeLeave(self.node_name, self.process // self.ranks_per_node, self._restart["iteration"] - 1,
                              f"S4 without node {self.process // self.ranks_per_node}: {self._restart['reason']}",
                              time.time())
            self.events.emit("excluded", host=leave.host, node=leave.node, iteration=leave.iteration,
                             reason=leave.reason)
            write_leave(self.out, leave)
        if self.runtime is not None:
            self.runtime.close()
        if self._agent is not None:
            self._agent.stop()
        if self.device is not None:
            self.device.uninstall()
            write_device_record(self.out, self.process, self.device.record(), self.suffix)
        report.write_rank_files(self.out, self.process, [(i, s, l) for i, s, l in self.measured],
                                self.runtime.monitor.estimates if self.runtime else {}, self.suffix,
                                overhead=self.runtime.overhead() if self.runtime else None,
                                splits=self.runtime.monitor.splits if self.runtime else None,
                                estimates_file=self.estimates_file)
        self.events.close()
        sys.stdout.flush()


def round_id(environ: Any) -> str:
    """The rendezvous round this process belongs to: the workers' store address, which each
    round's rank 0 publishes anew (the launcher turns torch's shared store off), plus the
    run id; the same on every node of a round."""
    return f"{environ.get('TORCHELASTIC_RUN_ID', '')}@{environ.get('MASTER_ADDR', '')}:{environ.get('MASTER_PORT', '')}"


def exit_status(code: int) -> int:
    """The rank's exit status once the script returned ``code``: in a job of several
    launchers, a rank that stopped for a restart and stays in the job exits with
    RESTART_EXIT, so its TorchElastic agent restarts the node's workers in a new round (a
    leaving node's ranks exit 0; their launcher stops the agent)."""
    s = _session
    if code == 0 and s is not None and s.multi_node and s._restart is not None and not s._leaving:
        hosts = [s.node_hosts[n] for n in s._restart["exclude_nodes"] if 0 <= n < len(s.node_hosts)]
        late = wait_left(s.out, [h for h in hosts if h], s.cfg.leave_wait_s)
        if late and s.rank == 0:
            print(f"falconext: node {', '.join(late)} had not stopped its agent after {s.cfg.leave_wait_s:g}s; "
                  "restarting without waiting longer", file=sys.stderr, flush=True)
        return RESTART_EXIT
    return code


#: flags a node's launcher may set from its own host, left out of :func:`flags_digest`: the
#: emulated device's speed (picked from the host's cores: hosts of two sizes differ) and the
#: run directory's path (one shared folder may be mounted at two paths)
HOST_FLAGS = ("--falcon-device-gflops", "--falcon-out")


def flags_digest(flags_json: str) -> str:
    """A short digest of a launcher's ``--falcon*`` flags (the JSON list in FLAGS_ENV),
    :data:`HOST_FLAGS` left out, to compare nodes' launchers without sending the flags
    around: equal for the same job configuration on hosts of any size."""
    try:
        flags = json.loads(flags_json)
    except ValueError:
        flags = None
    if isinstance(flags, list):
        kept: list[Any] = []
        skip = False
        for a in flags:
            if skip:
                skip = False
            elif isinstance(a, str) and a in HOST_FLAGS:
                skip = True
            elif not (isinstance(a, str) and a.split("=", 1)[0] in HOST_FLAGS):
                kept.append(a)
        flags_json = json.dumps(kept)
    return hashlib.sha256(flags_json.encode()).hexdigest()[:16]


def node_hosts(ranks: list[dict[str, Any]], ranks_per_node: int) -> list[str]:
    """Each node's host name by node index (``process // ranks_per_node``), from the
    all-gathered topology; a node whose host no rank named is ``""``."""
    hosts: dict[int, str] = {}
    for r in ranks:
        hosts.setdefault(int(r["process"]) // ranks_per_node, str(r.get("host") or ""))
    return [hosts.get(n, "") for n in range(max(hosts, default=-1) + 1)]


def plane_refusal(ranks: list[dict[str, Any]]) -> str | None:
    """Why the job cannot use the control plane, from every rank's topology entry
    (``host``, ``plane``: it has the plane's address, ``flags``: its launcher's flags
    digest); None when every rank has the plane and every launcher the same flags. Pure."""
    cut = [r.get("host", "?") for r in ranks if not r.get("plane", True)]
    if cut:
        return f"node(s) {', '.join(sorted(set(map(str, cut))))} cannot reach the control plane"
    digests: dict[str, list[str]] = {}
    for r in ranks:
        digests.setdefault(str(r.get("flags")), []).append(str(r.get("host", "?")))
    if len(digests) > 1:
        groups = sorted((sorted(set(hosts)) for hosts in digests.values()), key=lambda h: (-len(h), h))
        odd = ", ".join(h for g in groups[1:] for h in g)
        return f"the --falcon* flags of node(s) {odd} differ from those of {', '.join(groups[0])}"
    return None


#: seconds before a session's start from which its node's agent forwards what the ranks posted
SINCE_MARGIN_S = 2.0


class NodeAgentProcess:
    """This node's agent (:mod:`falconext.control.agent`) in a job of several launchers,
    started by the node's local rank 0 once the rendezvous has given the node its ranks
    (they change from round to round), watched from the rank's loop (restarted up to
    ``plane.MAX_RESTARTS`` times if it dies) and stopped with the rank. Its output goes to
    ``nodes/<host>/agent.log``."""

    def __init__(self, session: "Session", ranks: list[dict[str, Any]]) -> None:
        node = session.process // session.ranks_per_node
        mine = sorted(int(r["process"]) for r in ranks if r.get("host") == session.node_name)

        cfg = argparse.Namespace(**{"falcon_" + k: v for k, v in session.cfg.to_dict().items()})
        job = os.environ.get(JOB_ENV, "falcon")
        self.argv = agent_argv(job, node, mine, falcon_argv(cfg))
        #: the first start forwards what the ranks posted since the session began (less a
        #: margin for the clocks of this node and of Redis's); a restart, from its start
        self.since_ms = int((session.created - SINCE_MARGIN_S) * 1000)
        self.log = os.path.join(session.out, "nodes", session.node_name, "agent.log")
        self.proc: Any = None
        self.restarts = 0

    def start(self) -> "NodeAgentProcess":
        """Start the agent process (its parent: this rank, which it outlives by at most a
        parent-watch period); returns self."""
        argv = self.argv + (["--since-ms", str(self.since_ms)] if self.restarts == 0 else [])
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, env=dict(os.environ, **{PARENT_ENV: str(os.getpid())}),
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return self

    def check(self) -> None:
        """Start it again if it died (a bounded number of times)."""
        if self.proc is not None and self.proc.poll() is not None and self.restarts < MAX_RESTARTS:
            self.restarts += 1
            self.start()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


#: the launcher's attempt number (0: the first run; n: after the n-th S4 restart)
ATTEMPT_ENV = "FALCONEXT_ATTEMPT"
#: set to "1" by a launcher that is one of several (one per node): see Session.multi_node
MULTI_NODE_ENV = "FALCONEXT_MULTI_NODE"
