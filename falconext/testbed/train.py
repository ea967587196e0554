"""One rank of the test-bed training job: ``torchrun --nproc_per_node N -m falconext.testbed.train ...``.

``falconext train`` starts this through torchrun; it can also be started by hand. Each
rank trains, measures its loop's iteration times, and (with ``--falcon``) intercepts its
collective calls and runs per-rank tracking in a background thread. At the end, rank 0
merges the per-rank files and writes ``summary.json``.
"""

from __future__ import annotations

import gc

# Collecting garbage while torch and megatron-core import (about a million objects) costs
# a rank ~0.8 s of CPU at start; collection resumes once main() has built its model, with
# what start-up made frozen out of later collections (_set_up).
gc.disable()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from falconext.config import config_from_args, parse_microbatches, parse_topology  # noqa: E402
from falconext.control.client import JOB_ENV  # noqa: E402
from falconext.emulation.emulator import EmulatedDevice  # noqa: E402
from falconext.emulation.injector import FaultInjector  # noqa: E402
from falconext.protocol.actions import MicrobatchPlan, Restart, TopologyChange  # noqa: E402
from falconext.report.device import write_device_record  # noqa: E402
from falconext.runtime.host import PlanRefused, apply_action, versions  # noqa: E402
from falconext.mitigate import restart  # noqa: E402
from falconext.mitigate.topology import check_tp_in_nodes  # noqa: E402
from falconext.model import faults as faults_mod  # noqa: E402
from falconext.model.device import DEFAULT_GFLOPS, DEFAULT_INTER_BANDWIDTH, DeviceModel  # noqa: E402
from falconext.model.roles import check_roles  # noqa: E402
from falconext.protocol.eventlog import EventLog  # noqa: E402
from falconext.report import summary as report  # noqa: E402
from falconext.report.figures import report_at_end  # noqa: E402
from falconext.runtime.runtime import FalconRuntime  # noqa: E402
from falconext.runtime.switch import SwitchRefused, switch_roles  # noqa: E402
from falconext.testbed.chaos import BusChaos, kill_now, parse_chaos  # noqa: E402
from falconext.testbed.model import ModelShape  # noqa: E402
from falconext.testbed.netns import LinkShaper  # noqa: E402
from falconext.testbed.nvrx import NvrxBeside  # noqa: E402
from falconext.testbed.options import add_train_arguments, check_train_arguments  # noqa: E402
from falconext.testbed.trainer import Trainer, TrainOptions, init_distributed  # noqa: E402
from falconext.trace.groups import to_rank  # noqa: E402

_STARTED = time.time()  # this process's start, near enough: the module runs as __main__


def _topology(world: int, tp: int, pp: int, ranks_per_node: int) -> dict:
    # lazy: run-time order (megatron-core only in ranks, after cpu_compat)
    from megatron.core import parallel_state as ps

    mine = {
        "rank": torch.distributed.get_rank(),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "dp_rank": ps.get_data_parallel_rank(),
        "node": torch.distributed.get_rank() // ranks_per_node,
    }
    gathered: list = [None] * world
    torch.distributed.all_gather_object(gathered, mine)
    return {"world": world, "tp": tp, "pp": pp, "dp": world // (tp * pp), "ranks_per_node": ranks_per_node, "ranks": gathered}


@dataclass
class _Rig:
    """What this rank runs besides the model: the test bed's emulated device, link
    shaper or fault injector (each None when not asked for) and the faults they apply."""

    faults: list
    device: Any = None
    shaper: Any = None
    injector: Any = None


@dataclass
class _Job:
    """One rank's job, as the steps of :func:`main` build it up and the loop changes it
    (a topology switch replaces ``trainer``)."""

    args: argparse.Namespace
    cfg: Any
    world: int
    rank: int
    opts: Any
    events: Any
    rig: _Rig
    trainer: Any
    layout: dict
    first_it: int = 0
    restarted: dict | None = None
    #: the roles in force (process -> role) after the last topology switch; None: the launch's
    roles: list[int] | None = None
    suffix: str = ""
    runtime: Any = None
    estimates_file: Any = None
    chaos: Any = None
    loop_starts: list[float] = field(default_factory=list)
    #: NVRx's straggler detection beside falconext, one per report interval
    #: (--nvrx-report-s; testbed/nvrx.py)
    nvrx: list = field(default_factory=list)


def main(argv: list[str] | None = None) -> int:
    """Train one rank of the test-bed job from ``argv`` (``sys.argv`` by default) and
    return 0. Writes this rank's files under ``--out``; rank 0 also writes ``run.json``
    and, at the end, ``summary.json`` (or, after an S4 request, the restart request).
    Exits with argparse's status 2 on unparsable arguments; raises ValueError for
    arguments that do not fit the world size."""
    args, world, cfg = _parse(argv)
    job = _start(args, world, cfg)
    measured, request = _train(job)
    _finish(job, measured, request)
    return 0


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, int, Any]:
    """The command line, checked against the world size, and its FalconConfig."""
    parser = argparse.ArgumentParser(prog="falconext.testbed.train", description=__doc__.splitlines()[0])
    add_train_arguments(parser, launcher=False)
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_train_arguments(args, world)
    return args, world, config_from_args(args)


def _start(args: argparse.Namespace, world: int, cfg: Any) -> _Job:
    """Everything before the first iteration: process groups, output folders, the test
    bed's devices, the model (resumed after a restart), run.json and falconext's runtime."""
    opts = TrainOptions(
        tp=args.tp,
        pp=args.pp,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        iters=args.iters,
        shape=ModelShape(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab, seq_len=args.seq_len),
        device=args.device,
        seed=args.seed,
        plan=parse_microbatches(cfg.force_microbatches),
    )
    init_distributed(opts)
    rank = torch.distributed.get_rank()
    events = _open_output(args.out, rank)
    rig = _install_rig(args, rank, world)
    trainer = Trainer(opts)
    _attach(rig, trainer)
    topology = _topology(world, args.tp, args.pp, args.ranks_per_node)
    job = _Job(args, cfg, world, rank, opts, events, rig, trainer, {"world": world, "tp": args.tp, "pp": args.pp})
    if args.resume:
        t_load = time.perf_counter()
        state = restart.load_shard(args.resume, rank, job.layout, trainer.model, trainer.optimizer)
        job.first_it = state["iteration"]
        job.restarted = {"load_s": time.perf_counter() - t_load, **state["extra"]}
    job.suffix = f"-r{args.attempt}" if args.attempt else ""
    if rank == 0:
        _write_run_info(job, topology)
    job.estimates_file = report.EstimatesFile(args.out, rank, job.suffix)
    job.chaos = parse_chaos(args.chaos)  # checked by the launcher
    if args.nvrx_report_s:
        job.nvrx = [NvrxBeside(args.out, rank, rank // args.ranks_per_node, s, several=len(args.nvrx_report_s) > 1)
                    for s in args.nvrx_report_s]
        if rig.device is not None:
            rig.device.on_window = lambda kind, seconds: [n.window(kind, seconds) for n in job.nvrx]
    if args.falcon:
        job.runtime = _start_runtime(job, BusChaos(job.chaos, rank, events.emit) if job.chaos.bus else None)
        _tell_role(job.runtime, trainer, opts)
    _set_up()
    return job


def _open_output(out: str, rank: int):
    """Create ``out``'s folders and return the event log; a stale events.jsonl of an
    earlier run is removed unless the launcher's controller may have written it."""
    os.makedirs(os.path.join(out, "ranks"), exist_ok=True)
    os.makedirs(os.path.join(out, "calls"), exist_ok=True)
    # under the launcher, the controller may have written events already: keep them
    if rank == 0 and JOB_ENV not in os.environ and os.path.exists(os.path.join(out, "events.jsonl")):
        os.remove(os.path.join(out, "events.jsonl"))
    torch.distributed.barrier()
    return EventLog(os.path.join(out, "events.jsonl"))


def _install_rig(args: argparse.Namespace, rank: int, world: int) -> _Rig:
    """Install the test bed's emulated device, link shaper or fault injector that the
    arguments ask for, below the tracer (installed later), so the tracer sees their
    device-timed or delayed transfers."""
    rig = _Rig(faults_mod.read_faults(args.inject, world, args.ranks_per_node) if args.inject else [])
    if args.device == "emulated":
        # the emulated accelerator takes the faults itself: they multiply device time
        rig.device = EmulatedDevice(device_model(args), rank, args.ranks_per_node, rig.faults,
                                    real_links=args.net == "netns")
        rig.device.install()  # below the tracer: the tracer sees device-timed transfers
    if args.net == "netns":
        # real links: a link fault is the kernel's rate limit on this node's veth
        rig.shaper = LinkShaper.from_env(rig.faults)
    if rig.device is None and rig.faults:
        bw = args.link_bandwidth or faults_mod.DEFAULT_LINK_BANDWIDTH
        injected = [f for f in rig.faults if f.kind != "link"] if rig.shaper is not None else rig.faults

        rig.injector = FaultInjector(injected, rank, args.ranks_per_node, bw)
        rig.injector.install()  # below the tracer: injected delays look like slow transfers
    return rig


def _attach(rig: _Rig, trainer) -> None:
    """Point the injector and the emulated device at ``trainer``'s model (at start and
    after a topology switch rebuilt it)."""
    if rig.injector is not None:
        rig.injector.attach_model(trainer.model.module)
    if rig.device is not None:
        rig.device.attach_model(trainer.model.module, trainer.forward_flops())


def _write_run_info(job: _Job, topology: dict) -> None:
    """Rank 0's run.json (run-rN.json for restarted attempt N): arguments, config,
    faults, versions, topology and the clocks' origin."""
    args = job.args
    run_info = {
        "args": {k: v for k, v in vars(args).items() if not k.startswith("falcon_")},
        "falcon_config": job.cfg.to_dict() if args.falcon else None,
        "faults": [f.to_dict() for f in job.rig.faults],
        "versions": versions(),
        "topology": topology,
        "clock": {"perf_counter": time.perf_counter(), "time": time.time()},
    }
    # a restarted attempt keeps the original run.json: the summary scores the job
    with open(os.path.join(args.out, f"run{job.suffix}.json"), "w") as f:
        json.dump(run_info, f, indent=2)


def _start_runtime(job: _Job, bus_chaos):
    """falconext's runtime for this rank (tracer, monitor, control client), whose
    validation GEMMs run on the test bed's device or injector when there is one."""
    args, cfg, rig = job.args, job.cfg, job.rig
    if rig.device is not None:
        matmul = rig.device.matmul
    else:
        matmul = rig.injector.stretch_compute(torch.matmul) if rig.injector is not None else torch.matmul
    return FalconRuntime(
        cfg, job.rank, job.rank // args.ranks_per_node, args.out, job.events,
        job.loop_starts if cfg.loop_hooks else None,
        redis_url=args.falcon_redis_url,
        matmul=matmul,
        device="cuda" if args.device == "cuda" else "cpu",
        replica=job.trainer.replica,
        calls_suffix=job.suffix,
        first_iteration=job.first_it,
        spill_estimates=job.estimates_file.write,
        chaos=bus_chaos,
    )


def _train(job: _Job) -> tuple[list[tuple[int, float, float | None]], "restart.RestartRequest | None"]:
    """The training loop: each iteration's (index, seconds, loss), and the S4 restart
    request that ended it early, if any. The test bed's devices are uninstalled and the
    runtime closed however it ends."""
    args, cfg, runtime = job.args, job.cfg, job.runtime
    s3_probe = runtime is not None and cfg.mitigation and "S3" in cfg.strategies()
    s4_probe = runtime is not None and cfg.mitigation and "S4" in cfg.strategies()
    host = _BedHost(job)
    measured: list[tuple[int, float, float | None]] = []
    request = None
    forced_topology = parse_topology(cfg.force_topology)
    startup_s = time.time() - float(os.environ.get(restart.LAUNCH_TIME_ENV, _STARTED))
    t_prev = time.perf_counter()
    try:
        for it in range(job.first_it, args.iters):
            job.loop_starts.append(t_prev)
            _begin_iteration(job, it)
            # --falcon-loop-hooks false: falconext sees the calls only, as in any other job
            action = runtime.before_iteration(it) if runtime is not None and cfg.loop_hooks else None
            if runtime is not None and args.bench_falcon_toggle:  # benchmark: off N, on N, ...
                runtime.set_enabled((it // args.bench_falcon_toggle) % 2 == 1)
            if forced_topology is not None and it == forced_topology[0]:
                action = TopologyChange(list(forced_topology[1]), forced=True)
            if action is not None:
                request = apply_action(host, action, it, job.events)
                if request is not None:
                    break
            # S4's cost, measured by a save and load, only where S4 may be chosen
            if s4_probe and it == job.first_it + 2:
                _probe_restart_cost(job, it, startup_s)
            if s3_probe and it == job.first_it + 3:
                # S3's cost, measured: a switch to the same roles (state handed round a
                # ring and dropped, groups re-created, model rebuilt and reloaded)
                host.change_topology(TopologyChange([], probe=True), it)
            t_step = time.perf_counter()
            loss = job.trainer.step(it)
            step_s = time.perf_counter() - t_step
            for nvrx in job.nvrx:
                nvrx.step(it, step_s)
            if runtime is not None:
                runtime.after_step(job.trainer.plan[job.trainer.replica], job.trainer.forward_times())
            now = time.perf_counter()
            measured.append((it, now - t_prev, loss))
            t_prev = now
    finally:
        _tear_down(job)
    return measured, request


def _begin_iteration(job: _Job, it: int) -> None:
    """Tell the test bed's devices the iteration; on rank 0, run the chaos kills due now
    and note a restarted attempt's first iteration."""
    rig = job.rig
    if rig.injector is not None:
        rig.injector.iteration = it
    if rig.device is not None:
        rig.device.iteration = it
    if rig.shaper is not None:
        rig.shaper.set_iteration(it)
    if job.rank == 0:  # chaos mode: the control plane's processes die at their iterations
        for kill in (k for k in job.chaos.kills if k.iteration == it):
            job.events.emit("chaos", iteration=it, **kill_now(kill, job.args.out))
    if it == job.first_it and job.restarted is not None and job.rank == 0:
        job.events.emit("restarted", iteration=it, attempt=job.args.attempt,
                        load_s=round(job.restarted["load_s"], 4),
                        downtime_s=round(time.time() - float(job.restarted.get("requested_at", time.time())), 3))


def _probe_restart_cost(job: _Job, it: int, startup_s: float) -> None:
    """Estimate S4's cost (this rank's state saved and loaded at the checkpoint
    directory's measured rates, plus this process's start-up; no checkpoint is written)
    and hand it to the runtime's planner."""
    cost = restart.estimate_cost(os.path.join(job.args.out, "checkpoint-probe"), job.rank,
                                 job.trainer.model, job.trainer.optimizer, job.cfg.restart_probe_bytes)
    job.runtime.restart_s = startup_s + cost.save_load_s
    job.events.emit("restart_probe", rank=job.rank, iteration=it, restart_s=round(job.runtime.restart_s, 4),
                    save_load_s=round(cost.save_load_s, 4), startup_s=round(startup_s, 4),
                    state_bytes=cost.state_bytes, write_mb_s=round(cost.write_bps / 1e6, 1),
                    read_mb_s=round(cost.read_bps / 1e6, 1))


def _tear_down(job: _Job) -> None:
    """Close the runtime and uninstall the test bed's devices; the emulated device's
    record goes to ranks/device-rankN.json."""
    rig = job.rig
    if job.runtime is not None:
        job.runtime.close()
    for nvrx in job.nvrx:
        nvrx.close(job.suffix)
    if rig.injector is not None:
        rig.injector.uninstall()
    if rig.shaper is not None:
        rig.shaper.close()
    if rig.device is not None:
        rig.device.uninstall()
        write_device_record(job.args.out, job.rank, rig.device.record(), job.suffix)


def _finish(job: _Job, measured: list[tuple[int, float, float | None]],
            request: "restart.RestartRequest | None") -> None:
    """Write this rank's files; then rank 0 writes the restart request or the summary
    (and the HTML report with ``--report``); the process group is destroyed."""
    out, rank, runtime = job.args.out, job.rank, job.runtime
    report.write_rank_files(out, rank, measured, runtime.monitor.estimates if runtime else {}, job.suffix,
                            overhead=runtime.overhead() if runtime else None,
                            splits=runtime.monitor.splits if runtime else None, estimates_file=job.estimates_file)
    torch.distributed.barrier()
    if request is not None:
        if rank == 0:
            restart.write_request(out, request)
            print(f"falconext: checkpoint saved at iteration {request.iteration}; restarting without nodes "
                  f"{request.exclude_nodes}", flush=True)
    elif rank == 0:
        summary = report.finalize(out)
        print(report.format_summary(summary), flush=True)
        if job.args.report:
            print(report_at_end(out), flush=True)
    job.events.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # the interpreter's last garbage collections walk every object torch and megatron-core
    # made at import (about a second per rank on the 2-core host); everything is written
    # and closed by now, so they are skipped
    gc.freeze()


def _set_up() -> None:
    """Start-up is over: its objects live as long as the process, so later collections
    skip them (frozen), and garbage is collected again from here on."""
    gc.freeze()
    gc.enable()


def device_model(args: argparse.Namespace):
    """The emulated device of ``--device emulated`` from the command line."""
    return DeviceModel(gflops=DEFAULT_GFLOPS if args.device_gflops is None else args.device_gflops,
                       inter_bandwidth=DEFAULT_INTER_BANDWIDTH if args.link_bandwidth is None else args.link_bandwidth)


def _switch(action: TopologyChange, it: int, trainer, opts, epoch: int, events, process: int, layout: dict, runtime, injector,
            device=None):
    """S3 at this boundary (every process does, at the same one): new roles, same state.
    Returns the trainer of this process's new role (the old one if the switch was refused)."""
    world = layout["world"]
    probe = action.probe
    try:
        roles = [to_rank(p) for p in range(world)] if probe else list(check_roles(action.roles, world))
        check_tp_in_nodes(roles, layout["tp"], layout["ranks_per_node"])
    except ValueError as exc:  # agreed but impossible: every process refuses alike
        events.emit("control_error", rank=process, error=f"topology not applied: {exc}")
        return trainer
    comm = runtime.untraced() if runtime is not None else None
    try:
        new, times = switch_roles(
            trainer, roles, process, {k: layout[k] for k in ("world", "tp", "pp")}, it, epoch,
            lambda plan: Trainer(dataclasses.replace(opts, plan=plan)), comm=comm, probe=probe,
            on_teardown=runtime.before_switch if runtime is not None else None,
        )
    except SwitchRefused as exc:  # called off on every process alike: training goes on as it was
        events.emit("control_error", rank=process, error=f"topology not applied: {exc}")
        return trainer
    if runtime is not None:
        runtime.after_switch(new.replica, times.total_s)
        _tell_role(runtime, new, opts)
    if injector is not None:
        injector.attach_model(new.model.module)
    if device is not None:
        device.attach_model(new.model.module, new.forward_flops())
    events.emit(
        "topology_switch", rank=process, iteration=it, roles=roles, role=roles[process], epoch=epoch,
        strategy=action.strategy, forced=action.forced, probe=probe,
        pause_s=round(times.total_s, 4), serialize_s=round(times.serialize_s, 4),
        transfer_s=round(times.transfer_s, 4), regroup_s=round(times.regroup_s, 4),
        rebuild_s=round(times.rebuild_s, 4), load_s=round(times.load_s, 4), sent_bytes=times.sent_bytes,
    )
    return new


def _tell_role(runtime, trainer, opts) -> None:
    # lazy: run-time order (megatron-core only in ranks, after cpu_compat)
    from megatron.core import parallel_state as ps

    grad, act = trainer.traffic()
    runtime.set_role(torch.distributed.get_rank(), ps.get_pipeline_model_parallel_rank(), opts.tp, opts.pp, grad, act)


class _BedHost:
    """The test bed's trainer as a rank host (:mod:`falconext.runtime.host`): plans in force at
    once, S3 live (:func:`_switch`), S4 a checkpoint of this process's shard and a restart
    request."""

    def __init__(self, job: _Job) -> None:
        self.job = job
        self.process = job.rank
        #: topology switches so far (each is an epoch of the switch protocol)
        self.switches = 0

    def apply_plan(self, action: MicrobatchPlan, iteration: int) -> dict[str, Any] | None:
        try:
            self.job.trainer.set_plan(action.plan)
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanRefused(str(exc)) from None
        return {"iteration": iteration, "plan": self.job.trainer.plan, "strategy": action.strategy} if self.process == 0 else None

    def change_topology(self, action: TopologyChange, iteration: int) -> None:
        job = self.job
        self.switches += 1
        before = job.trainer
        job.trainer = _switch(action, iteration, job.trainer, job.opts, self.switches, job.events, job.rank,
                              dict(job.layout, ranks_per_node=job.args.ranks_per_node), job.runtime,
                              job.rig.injector, job.rig.device)
        if job.trainer is not before and not action.probe:  # applied (a refusal keeps the trainer)
            job.roles = list(action.roles)

    def restart(self, action: Restart, iteration: int) -> "restart.RestartRequest":
        """An S4 request carries the roles in force, so the restarted job takes them up again."""
        job = self.job
        directory = os.path.join(job.args.out, restart.CHECKPOINT_DIR)
        # a shard belongs to the role (torch rank), which a topology switch may have moved:
        # the restarted job starts with launch ranks = roles again
        save_s = restart.save_shard(directory, torch.distributed.get_rank(), job.layout, iteration, job.trainer.model,
                                    job.trainer.optimizer, extra={"requested_at": time.time()})
        return restart.RestartRequest(
            iteration=iteration, exclude_nodes=[int(n) for n in action.exclude_nodes], checkpoint=directory,
            session=action.session, requested_at=time.time(), save_s=save_s,
            attempt=job.args.attempt + 1, reason=action.reason, extra={"roles": job.roles} if job.roles else {},
        )


if __name__ == "__main__":
    sys.exit(main())
