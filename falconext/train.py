"""One rank of the test-bed training job: ``torchrun --nproc_per_node N -m falconext.train ...``.

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
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from falconext.config import config_from_args, parse_microbatches, parse_topology  # noqa: E402
from falconext.mitigate import restart  # noqa: E402
from falconext.testbed.options import add_train_arguments, check_train_arguments  # noqa: E402

_STARTED = time.time()  # this process's start, near enough: the module runs as __main__


def _versions() -> dict[str, str]:
    import falconext

    try:
        from importlib.metadata import version

        mcore = version("megatron-core")
    except Exception:  # pragma: no cover - reported, not required
        mcore = "unknown"
    return {"python": platform.python_version(), "torch": torch.__version__, "megatron-core": mcore, "falconext": falconext.__version__}


def _topology(world: int, tp: int, pp: int, ranks_per_node: int) -> dict:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="falconext.train", description=__doc__.splitlines()[0])
    add_train_arguments(parser, launcher=False)
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_train_arguments(args, world)
    cfg = config_from_args(args)

    from falconext.control.client import JOB_ENV
    from falconext.testbed import faults as faults_mod
    from falconext.testbed import report
    from falconext.testbed.model import ModelShape
    from falconext.control.eventlog import EventLog
    from falconext.testbed.trainer import Trainer, TrainOptions, init_distributed

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
    out = args.out
    os.makedirs(os.path.join(out, "ranks"), exist_ok=True)
    os.makedirs(os.path.join(out, "calls"), exist_ok=True)
    # under the launcher, the controller may have written events already: keep them
    if rank == 0 and JOB_ENV not in os.environ and os.path.exists(os.path.join(out, "events.jsonl")):
        os.remove(os.path.join(out, "events.jsonl"))
    torch.distributed.barrier()
    events = EventLog(os.path.join(out, "events.jsonl"))

    faults = faults_mod.read_faults(args.inject, world, args.ranks_per_node) if args.inject else []
    injector = None
    device = None
    if args.device == "emulated":
        # the emulated accelerator takes the faults itself: they multiply device time
        from falconext.testbed.emulator import EmulatedDevice

        device = EmulatedDevice(device_model(args), rank, args.ranks_per_node, faults, real_links=args.net == "netns")
        device.install()  # below the tracer: the tracer sees device-timed transfers
    shaper = None
    if args.net == "netns":
        # real links: a link fault is the kernel's rate limit on this node's veth
        from falconext.testbed.netns import LinkShaper

        shaper = LinkShaper.from_env(faults)
    if device is None and faults:
        bw = args.link_bandwidth or faults_mod.DEFAULT_LINK_BANDWIDTH
        injected = [f for f in faults if f.kind != "link"] if shaper is not None else faults
        from falconext.testbed.injector import FaultInjector

        injector = FaultInjector(injected, rank, args.ranks_per_node, bw)
        injector.install()  # below the tracer: injected delays look like slow transfers

    loop_starts: list[float] = []
    trainer = Trainer(opts)
    if injector is not None:
        injector.attach_model(trainer.model.module)
    if device is not None:
        device.attach_model(trainer.model.module, trainer.forward_flops())
    topology = _topology(world, args.tp, args.pp, args.ranks_per_node)
    layout = {"world": world, "tp": args.tp, "pp": args.pp}
    switch_layout = dict(layout, ranks_per_node=args.ranks_per_node)
    first_it, restarted = 0, None
    if args.resume:
        t_load = time.perf_counter()
        state = restart.load_shard(args.resume, rank, layout, trainer.model, trainer.optimizer)
        first_it = state["iteration"]
        restarted = {"load_s": time.perf_counter() - t_load, **state["extra"]}
    suffix = f"-r{args.attempt}" if args.attempt else ""
    if rank == 0:
        run_info = {
            "args": {k: v for k, v in vars(args).items() if not k.startswith("falcon_")},
            "falcon_config": cfg.to_dict() if args.falcon else None,
            "faults": [f.to_dict() for f in faults],
            "versions": _versions(),
            "topology": topology,
            "clock": {"perf_counter": time.perf_counter(), "time": time.time()},
        }
        # a restarted attempt keeps the original run.json: the summary scores the job
        with open(os.path.join(out, f"run{suffix}.json"), "w") as f:
            json.dump(run_info, f, indent=2)

    runtime = None
    estimates_file = report.EstimatesFile(out, rank, suffix)
    from falconext.testbed.chaos import BusChaos, kill_now, parse_chaos

    chaos = parse_chaos(args.chaos)  # checked by the launcher
    if args.falcon:
        from falconext.runtime.runtime import FalconRuntime

        runtime = FalconRuntime(
            cfg, rank, rank // args.ranks_per_node, out, events, loop_starts if cfg.loop_hooks else None,
            redis_url=args.falcon_redis_url,
            matmul=device.matmul if device is not None else (
                injector.stretch_compute(torch.matmul) if injector is not None else torch.matmul),
            device="cuda" if args.device == "cuda" else "cpu",
            replica=trainer.replica,
            calls_suffix=suffix,
            first_iteration=first_it,
            spill_estimates=estimates_file.write,
            chaos=BusChaos(chaos, rank, events.emit) if chaos.bus else None,
        )

    if runtime is not None:
        _tell_role(runtime, trainer, opts)
    _set_up()
    s3_probe = runtime is not None and cfg.mitigation and "S3" in cfg.strategies()
    measured: list[tuple[int, float, float | None]] = []
    request = None
    forced_topology = parse_topology(cfg.force_topology)
    switches = 0
    startup_s = time.time() - float(os.environ.get(restart.LAUNCH_TIME_ENV, _STARTED))
    t_prev = time.perf_counter()
    try:
        for it in range(first_it, args.iters):
            loop_starts.append(t_prev)
            if injector is not None:
                injector.iteration = it
            if device is not None:
                device.iteration = it
            if shaper is not None:
                shaper.set_iteration(it)
            if rank == 0:  # chaos mode: the control plane's processes die at their iterations
                for kill in (k for k in chaos.kills if k.iteration == it):
                    events.emit("chaos", iteration=it, **kill_now(kill, out))
            if it == first_it and restarted is not None and rank == 0:
                events.emit("restarted", iteration=it, attempt=args.attempt, load_s=round(restarted["load_s"], 4),
                            downtime_s=round(time.time() - float(restarted.get("requested_at", time.time())), 3))
            # --falcon-loop-hooks false: falconext sees the calls only, as in any other job
            action = runtime.before_iteration(it) if runtime is not None and cfg.loop_hooks else None
            if runtime is not None and args.bench_falcon_toggle:  # benchmark: off N, on N, ...
                runtime.set_enabled((it // args.bench_falcon_toggle) % 2 == 1)
            if forced_topology is not None and it == forced_topology[0]:
                action = {"kind": "topology", "roles": forced_topology[1], "strategy": "S3", "forced": True}
            if action is not None and action.get("kind") == "topology":
                switches += 1
                trainer = _switch(action, it, trainer, opts, switches, events, rank, switch_layout, runtime, injector,
                                  device)
            elif action is not None:
                request = _apply(action, it, trainer, events, rank, out, layout, args)
                if request is not None:
                    break
            # S4's cost, measured by a save and load, only where S4 may be chosen
            if runtime is not None and it == first_it + 2 and cfg.mitigation and "S4" in cfg.strategies():
                disk_s = restart.probe_cost(os.path.join(out, "checkpoint-probe"), rank, layout, trainer.model,
                                            trainer.optimizer)
                runtime.restart_s = startup_s + disk_s
                events.emit("restart_probe", rank=rank, iteration=it, restart_s=round(runtime.restart_s, 4),
                            save_load_s=round(disk_s, 4), startup_s=round(startup_s, 4))
            if s3_probe and it == first_it + 3:
                # S3's cost, measured: a switch to the same roles (state handed round a
                # ring and dropped, groups re-created, model rebuilt and reloaded)
                switches += 1
                trainer = _switch({"kind": "topology", "roles": None, "probe": True}, it, trainer, opts, switches,
                                  events, rank, switch_layout, runtime, injector, device)
            loss = trainer.step(it)
            if runtime is not None:
                runtime.after_step(trainer.plan[trainer.replica], trainer.forward_time()[0])
            now = time.perf_counter()
            measured.append((it, now - t_prev, loss))
            t_prev = now
    finally:
        if runtime is not None:
            runtime.close()
        if injector is not None:
            injector.uninstall()
        if shaper is not None:
            shaper.close()
        if device is not None:
            device.uninstall()
            with open(os.path.join(out, "ranks", f"device{suffix}-rank{rank}.json"), "w") as f:
                json.dump(device.record(), f)

    report.write_rank_files(out, rank, measured, runtime.monitor.estimates if runtime else {}, suffix,
                            overhead=runtime.overhead() if runtime else None,
                            splits=runtime.monitor.splits if runtime else None, estimates_file=estimates_file)
    torch.distributed.barrier()
    if request is not None:
        if rank == 0:
            restart.write_request(out, request)
            print(f"falconext: checkpoint saved at iteration {request.iteration}; restarting without nodes "
                  f"{request.exclude_nodes}", flush=True)
    elif rank == 0:
        summary = report.finalize(out)
        print(report.format_summary(summary), flush=True)
        if args.report:
            from falconext.testbed.figures import report_at_end

            print(report_at_end(out), flush=True)
    events.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # the interpreter's last garbage collections walk every object torch and megatron-core
    # made at import (about a second per rank on the 2-core host); everything is written
    # and closed by now, so they are skipped
    gc.freeze()
    return 0


def _set_up() -> None:
    """Start-up is over: its objects live as long as the process, so later collections
    skip them (frozen), and garbage is collected again from here on."""
    gc.freeze()
    gc.enable()


def device_model(args: argparse.Namespace):
    """The emulated device of ``--device emulated`` from the command line."""
    from falconext.testbed.device import DEFAULT_GFLOPS, DEFAULT_INTER_BANDWIDTH, DeviceModel

    return DeviceModel(gflops=DEFAULT_GFLOPS if args.device_gflops is None else args.device_gflops,
                       inter_bandwidth=DEFAULT_INTER_BANDWIDTH if args.link_bandwidth is None else args.link_bandwidth)


def _switch(action: dict, it: int, trainer, opts, epoch: int, events, process: int, layout: dict, runtime, injector,
            device=None):
    """S3 at this boundary (every process does, at the same one): new roles, same state.
    Returns the trainer of this process's new role (the old one if the switch was refused)."""
    import dataclasses

    from falconext.runtime.switch import SwitchRefused, switch_roles
    from falconext.testbed.trainer import Trainer
    from falconext.mitigate.topology import check_tp_in_nodes
    from falconext.sim.itertime import check_roles
    from falconext.trace.groups import to_rank

    world = layout["world"]
    probe = bool(action.get("probe"))
    try:
        roles = [to_rank(p) for p in range(world)] if probe else list(check_roles(action.get("roles"), world))
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
        strategy=action.get("strategy", "S3"), forced=bool(action.get("forced", False)), probe=probe,
        pause_s=round(times.total_s, 4), serialize_s=round(times.serialize_s, 4),
        transfer_s=round(times.transfer_s, 4), regroup_s=round(times.regroup_s, 4),
        rebuild_s=round(times.rebuild_s, 4), load_s=round(times.load_s, 4), sent_bytes=times.sent_bytes,
    )
    return new


def _tell_role(runtime, trainer, opts) -> None:
    from megatron.core import parallel_state as ps

    grad, act = trainer.traffic()
    runtime.set_role(torch.distributed.get_rank(), ps.get_pipeline_model_parallel_rank(), opts.tp, opts.pp, grad, act)


def _apply(action: dict, it: int, trainer, events, rank: int, out: str, layout: dict, args) -> "restart.RestartRequest | None":
    """Apply a committed mitigation at this iteration boundary (every rank does, at the same one)."""
    kind = action.get("kind")
    if kind == "microbatches":
        try:
            trainer.set_plan(action["plan"])
        except (KeyError, TypeError, ValueError) as exc:  # agreed but impossible: keep training as is
            events.emit("control_error", rank=rank, error=f"plan not applied: {exc}")
            return None
        if rank == 0:
            events.emit("plan_applied", iteration=it, plan=trainer.plan, strategy=action.get("strategy", "S2"))
        return None
    if kind == "restart":
        directory = os.path.join(out, restart.CHECKPOINT_DIR)
        # a shard belongs to the role (torch rank), which a topology switch may have moved:
        # the restarted job starts with launch ranks = roles again
        save_s = restart.save_shard(directory, torch.distributed.get_rank(), layout, it, trainer.model, trainer.optimizer,
                                    extra={"requested_at": time.time()})
        return restart.RestartRequest(
            iteration=it, exclude_nodes=[int(n) for n in action.get("exclude_nodes", [])], checkpoint=directory,
            session=int(action.get("session", 0)), requested_at=time.time(), save_s=save_s,
            attempt=args.attempt + 1, reason=str(action.get("reason", "")),
        )
    events.emit("control_error", rank=rank, error=f"unknown action {kind!r}")
    return None


if __name__ == "__main__":
    sys.exit(main())
