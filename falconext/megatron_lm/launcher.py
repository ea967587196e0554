"""``falconext launch [torchrun options] SCRIPT [script args]``: Megatron-LM with falconext.

Takes torchrun's own options (``--nproc-per-node``, ``--nnodes``, ``--node-rank``,
``--master-addr``/``--master-port``, ``--rdzv-*``, ...) before the script, and runs torchrun
with them. Each rank runs :mod:`falconext.megatron_lm.rank`, which runs the script as
``__main__`` with its own arguments, minus the ``--falcon*`` flags.

With ``--falcon`` among the script's arguments the launcher, before any rank starts:
checks every ``--falcon*`` flag (an unknown one is a one-line error); decides which
strategies the job can use (S2 only where it is exact: :func:`contract.s2_refusal`; S3 is
not applied live inside Megatron-LM); starts the control plane (private Redis with a
password, or the one ``--falcon-redis-url-file`` names; the controller; one agent per
node); and after an S4 request relaunches the job with ``--load`` from its checkpoint.
Results go to ``--falcon-out``: ``events.jsonl``, ``iterations.csv``, ``estimates.csv``,
``summary.json``, ``report.html``.

What the launcher adds to what it was given (:data:`ADDED`):

- to torchrun's options: a free ``--master-port`` when no endpoint is given; in a job of
  several nodes, ``--nnodes FLOOR:MIN`` (the job trains on MIN nodes, more launchers are
  spares, and it may go on with FLOOR after an exclusion; a static rendezvous keeps
  ``MIN:MIN``), ``--max-restarts 3`` unless given, and on c10d ``--rdzv-conf is_host=``
  and ``--local-addr`` (which node hosts the store, from which address);
- to the script's arguments: ``--exit-signal-handler`` (S4 stops the workers through it),
  ``--save DIR --save-interval 1000000000`` without a ``--save``, and
  ``--ckpt-format torch`` without CUDA;
- to the ``--falcon*`` flags: ``--falcon-mitigation-strategies`` (S2 where exact, S4),
  ``--falcon-restart-floor-nodes`` (several nodes), and without CUDA the emulated device's
  settings (``--falcon-device-gflops`` from this host's cores, unless given), or on CUDA
  ``--falcon-gemm-size``.

Without CUDA the ranks run in CPU mode (:mod:`falconext.megatron_lm.cpu`), with or without
``--falcon``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

from falconext.config import ConfigError, FalconConfig, config_from_args, parse_topology
from falconext.control.client import JOB_ENV, REDIS_URL_ENV, redis_url_from_file
from falconext.control.plane import start_plane
from falconext.elastic import rendezvous
from falconext.elastic.hosts import NODES_ON_HOST_ENV, node_name
from falconext.elastic.join import OtherJob, find_plane, read_access, running_other_job
from falconext.elastic.node import NodeRun, run_node
from falconext.elastic.restart import DEFAULT_MAX_RESTARTS, write_refusal
from falconext.elastic.supervisor import AttemptEnd, Supervisor
from falconext.inputs import InputError, option, set_option
from falconext.megatron_lm import contract
from falconext.megatron_lm.hooks import (
    ATTEMPT_ENV,
    add_falcon_flags,
    FLAGS_ENV,
    MULTI_NODE_ENV,
    ROLES_ENV,
    FlagError,
    flags_digest,
    parse_flags,
)
from falconext.mitigate import restart
from falconext.mitigate.restart import LAUNCH_TIME_ENV
from falconext.mitigate.room import shrink_floor
from falconext.model.device import DEFAULT_INTER_BANDWIDTH, EMULATED_TESTBED, MESSAGE_S, host_gflops
from falconext.model.faults import copy_faults, read_faults
from falconext.model.roles import check_roles
from falconext.ports import free_port
from falconext.report import summary as report
from falconext.report.figures import report_at_end
from falconext.trace.groups import processes_of

#: torchrun options that take a value (both spellings are accepted by torchrun)
_VALUE_OPTIONS = {
    "--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--rdzv-backend",
    "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf", "--max-restarts", "--monitor-interval", "--start-method",
    "--role", "--log-dir", "--redirects", "-r", "--tee", "-t", "--local-ranks-filter", "--local-addr",
    "--logs-specs", "--event-log-handler", "--numa-binding", "--signals-to-handle", "--rdzv-timeout",
}
_SWITCHES = {"--standalone", "--run-path", "--no-python", "-m", "--module"}
_REFUSED = {"--no-python": "falconext launch runs a Python script (no --no-python)",
            "-m": "falconext launch runs a script file, not a module (-m)",
            "--module": "falconext launch runs a script file, not a module (--module)",
            "--run-path": "falconext launch runs a script file (no --run-path)"}

#: what :func:`launch_help` lists as added by the launcher (the module's docstring says each)
ADDED = ("--master-port", "--nnodes", "--max-restarts", "--rdzv-conf", "--local-addr", "--exit-signal-handler",
         "--save", "--save-interval", "--ckpt-format", "--falcon-mitigation-strategies",
         "--falcon-restart-floor-nodes", "--falcon-device-gflops", "--falcon-gemm-size")
#: the flag only the launcher takes (never passed to the ranks)
URL_FILE_HELP = ("an existing Redis for the control plane: a file whose first line is its URL "
                 "(redis://:PASSWORD@HOST:PORT/0), so the password never shows on a command line")


def launch_help() -> str:
    """``falconext launch --help``: what the launcher does and adds, and every ``--falcon*``
    flag it takes, grouped by concern."""
    parser = argparse.ArgumentParser(
        prog="falconext launch", add_help=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="falconext launch [torchrun options] SCRIPT [script arguments] --falcon [--falcon-* ...]",
        description=__doc__.split("\n", 2)[2].replace("``", "").replace(":data:`ADDED`", "").replace(
            ":mod:`falconext.megatron_lm.rank`", "falconext.megatron_lm.rank").replace(
            ":func:`contract.s2_refusal`", "megatron_lm/contract.py").replace(
            ":mod:`falconext.megatron_lm.cpu`", "falconext.megatron_lm.cpu").replace(" ()", ""))
    add_falcon_flags(parser)
    parser.add_argument_group("falconext launch only").add_argument(
        "--falcon-redis-url-file", metavar="FILE", help=URL_FILE_HELP)
    return parser.format_help()


#: the ``--save-interval`` added with the ``--save`` directory S4 needs: saves only on exit
NO_PERIODIC_SAVE = 10**9


@dataclass
class LaunchPlan:
    """A parsed ``falconext launch`` command line."""

    torchrun: list[str]
    script: str
    script_args: list[str]
    falcon_args: list[str] = field(default_factory=list)

    @property
    def falcon(self) -> bool:
        """True when ``--falcon`` was among the flags: falconext runs inside the job."""
        return "--falcon" in self.falcon_args


def _canon(opt: str) -> str:
    name, sep, value = opt.partition("=")
    if name.startswith("--"):
        name = name.replace("_", "-")
    return name


def split_command(argv: list[str]) -> LaunchPlan:
    """torchrun options / script / script arguments / ``--falcon*`` flags (pure)."""
    torchrun: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if not a.startswith("-"):
            break
        name = _canon(a)
        if name in _REFUSED:
            raise InputError(_REFUSED[name])
        if name in _SWITCHES:
            torchrun.append(name)
            i += 1
        elif name in _VALUE_OPTIONS:
            if "=" in a:
                torchrun.append(name + "=" + a.partition("=")[2])
                i += 1
            else:
                if i + 1 >= len(argv):
                    raise InputError(f"{a} needs a value")
                torchrun += [name, argv[i + 1]]
                i += 2
        else:
            raise InputError(f"unknown launcher option {a!r} (torchrun's options go before the script)")
    if i >= len(argv):
        raise InputError("no training script given (falconext launch [torchrun options] SCRIPT [args])")
    script, rest = argv[i], argv[i + 1:]
    script_args: list[str] = []
    falcon: list[str] = []
    j = 0
    while j < len(rest):
        a = rest[j]
        if a == "--falcon":
            falcon.append(a)
            j += 1
        elif a.startswith("--falcon-") or a.startswith("--falcon_"):
            if "=" in a:
                falcon.append(a)
                j += 1
            elif j + 1 < len(rest):
                falcon += [a, rest[j + 1]]
                j += 2
            else:
                raise InputError(f"{a} needs a value")
        else:
            script_args.append(a)
            j += 1
    return LaunchPlan(torchrun, script, script_args, falcon)


def values(args: list[str], name: str) -> list[str]:
    """Every value after ``name`` (a Megatron ``nargs='+'`` flag) up to the next flag."""
    out: list[str] = []
    for k, a in enumerate(args):
        if a == name:
            out = []
            for b in args[k + 1:]:
                if b.startswith("--"):
                    break
                out.append(b)
        elif a.startswith(name + "="):
            out = [a.partition("=")[2]]
    return out


def script_namespace(args: list[str]) -> argparse.Namespace:
    """What the launcher needs to know of Megatron-LM's settings, from its arguments."""
    has = set(a.split("=", 1)[0] for a in args)
    return argparse.Namespace(
        calculate_per_token_loss="--calculate-per-token-loss" in has,
        dataloader_type=option(args, "--dataloader-type") or "single",
        rampup_batch_size=option(args, "--rampup-batch-size"),
        cuda_graph_impl=option(args, "--cuda-graph-impl") or "none",
        cuda_graph_scope=values(args, "--cuda-graph-scope"),
        virtual_pipeline_model_parallel_size=option(args, "--num-layers-per-virtual-pipeline-stage")
        or option(args, "--num-virtual-stages-per-pipeline-rank"),
        hybrid_context_parallel="--hybrid-context-parallel" in has,
        rl_use_sequence_packing="--rl-use-sequence-packing" in has,
    )


def launch(argv: list[str]) -> int:
    """Run the job; returns its exit status. Problems before start-up: :class:`InputError`."""
    plan = split_command(argv)
    if not os.path.isfile(plan.script):
        raise InputError(f"training script {plan.script!r} not found")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TORCHDYNAMO_DISABLE", "1")

    rdzv = rendezvous.parse(plan.torchrun)
    node = _NodeRole.of(rdzv, plan.torchrun)
    plan.torchrun += node.torchrun_additions
    if rdzv.multi_node and plan.falcon:
        plan.torchrun = elastic_options(plan.torchrun, rdzv, job_floor(plan.script_args, rdzv))
    if not plan.falcon:
        if plan.falcon_args:
            raise InputError(f"{plan.falcon_args[0]} needs --falcon")
        env[FLAGS_ENV] = "[]"
        return subprocess.run(_torchrun(plan), env=env).returncode
    url_file = option(plan.falcon_args, "--falcon-redis-url-file")
    if url_file is not None:  # an existing Redis for the plane, its password kept off command lines
        try:
            env[REDIS_URL_ENV] = redis_url_from_file(url_file)
        except ValueError as exc:
            raise InputError(str(exc)) from None
        plan.falcon_args = _without(plan.falcon_args, ("--falcon-redis-url-file",))
    job = _prepare(plan, rdzv, node.hosts_plane)
    env[FLAGS_ENV] = json.dumps(job.flags)
    if rdzv.multi_node:
        return _launch_node(plan, job, rdzv, node, env)

    plane = _start_plane(job, env)

    def start(attempt: int) -> AttemptEnd:
        env[ATTEMPT_ENV] = str(attempt)
        return AttemptEnd(subprocess.run(_torchrun(plan), env=env).returncode)

    def prepare(req) -> None:
        plan.script_args = set_option(plan.script_args, "--load", req.checkpoint)
        _drop_excluded_faults(job, req, env)
        roles = restart_roles(req.extra, job.world)
        how = f"without nodes {req.exclude_nodes}"
        if roles is not None:  # S3: the same ranks, handed to the processes in a new order
            env.update(roles_env(roles, dict(os.environ)))  # the GPUs as first listed
            how = f"with roles {roles} (S3)"
        print(f"falconext: restart {req.attempt} from Megatron-LM's checkpoint at iteration {req.iteration} "
              f"{how} (--load {req.checkpoint})", flush=True)

    try:
        Supervisor.for_plane(job.out, env, plane).run(start, prepare)
    finally:
        if plane is not None:
            plane.stop()
    _finalize(job.out)
    return 0


@dataclass
class _NodeRole:
    """This launcher's part in the job: whether it hosts the rendezvous (and with it the
    control plane), the address it reaches the others from, and what torchrun needs to
    know of that (:func:`falconext.elastic.rendezvous.torchrun_additions`)."""

    hosts_plane: bool
    address: str | None
    torchrun_additions: list[str]

    @classmethod
    def of(cls, rdzv, opts: list[str]) -> "_NodeRole":
        if not rdzv.multi_node:
            return cls(True, None, [])
        local = bool(rdzv.endpoint_host) and rendezvous.is_local_address(rdzv.endpoint_host)
        toward = rendezvous.address_toward(rdzv.endpoint_host, rdzv.endpoint_port) if rdzv.endpoint_host else None
        address, why = toward, None
        if toward is not None and rendezvous.is_loopback(toward):  # a host name mapped to 127.0.1.1
            address, why = rendezvous.cluster_address(toward, option(opts, "--local-addr"), rendezvous.route_address(),
                                                      rendezvous.global_addresses())
        if why:
            print(f"falconext: {why}", flush=True)
        return cls(rendezvous.hosts_plane(rdzv, local), address,
                   rendezvous.torchrun_additions(rdzv, opts, local, address))




def _launch_node(plan: LaunchPlan, job: "_Job", rdzv, node: _NodeRole, env: dict[str, str]) -> int:
    """One node's launcher in a job of several (:mod:`falconext.elastic.node`): the node that
    hosts the rendezvous starts the control plane (Redis bound to its cluster address and
    loopback, the controller), the others find it through the shared run directory; every
    node runs its TorchElastic agent, which restarts the node's workers itself; the node
    that started the plane writes the summary once the job is over."""
    env[MULTI_NODE_ENV] = "1"
    # torch (2.4 and later) shares the rendezvous's TCP store with the workers and keeps the
    # round-0 rank 0's address for later rounds: a spare that joins a later round then waits
    # for an address that rank 0 never publishes again, and the round dies (seen here on
    # torch 2.13; NVRx#348 reports the same for hot spares). A store per round avoids it.
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    name = node_name()
    cfg = _config(job)
    plane = None
    if node.hosts_plane:
        bind = "127.0.0.1" if node.address in (None, "127.0.0.1", "::1") else f"{node.address} 127.0.0.1"
        plane = _start_plane(job, env, redis_bind=bind, agents=False,
                             access={"rdzv_id": rdzv.rdzv_id, "flags": flags_digest(env[FLAGS_ENV]), "host": name})
        if plane is None:
            env[REDIS_URL_ENV] = ""
    elif cfg.control_plane:
        found = find_plane(job.out, rdzv.rdzv_id, cfg.plane_wait_s)
        if isinstance(found, OtherJob):  # the job's other launchers stop on this note, not a timeout
            why = found.refusal(job.out, rdzv.rdzv_id)
            write_refusal(job.out, name, why)
            raise InputError(f"node {name}: {why}")
        if isinstance(found, str):
            print(f"falconext: node {name}: {found}; this node trains without falconext's control plane", flush=True)
            env[REDIS_URL_ENV] = ""
        else:
            env[REDIS_URL_ENV], env[JOB_ENV] = found.url, found.job

    env[LAUNCH_TIME_ENV] = repr(time.time())
    spare = rdzv.node_rank is not None and rdzv.node_rank >= rdzv.min_nodes
    on_exclude = option(job.flags, "--falcon-on-exclude")
    try:
        code = run_node(NodeRun(name, job.out, _torchrun(plan), env, env.get(REDIS_URL_ENV) or None,
                                env.get(JOB_ENV, "falcon"), spare, on_exclude, cfg.on_exclude_timeout_s))
    finally:
        if plane is not None:
            plane.stop()
    if plane is not None:
        _finalize(job.out)
    return code


def shrink_floor_of(script_args: list[str], rdzv) -> int:
    """The fewest nodes this Megatron-LM job can train on with its global batch unchanged
    (its node count when it names no --global-batch-size: Megatron's default scales with DP)."""
    gbs = option(script_args, "--global-batch-size")
    if gbs is None or not gbs.isdigit():
        return rdzv.min_nodes
    ints = {k: option(script_args, k) for k in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                                                 "--micro-batch-size")}
    tp, pp, mbs = (int(v) if v and v.isdigit() else 1 for v in ints.values())
    return shrink_floor(rdzv.min_nodes, rdzv.nproc_per_node, tp, pp, int(gbs), mbs)


def job_floor(script_args: list[str], rdzv) -> int:
    """The fewest nodes the job may go on with after an exclusion: :func:`shrink_floor_of`
    on an elastic rendezvous (c10d); all of them on a static one (``--master-addr``/
    ``--master-port``), whose nodes are fixed: an S4 there restarts them in place, and one
    without a node is refused by the controller before anything stops. A static
    rendezvous given ``--nnodes MIN:MAX`` (room for spares it cannot have) is an InputError."""
    if rdzv.elastic:
        return shrink_floor_of(script_args, rdzv)
    if rdzv.max_nodes != rdzv.min_nodes:
        raise InputError(f"--nnodes {rdzv.min_nodes}:{rdzv.max_nodes} with a static rendezvous "
                         "(--master-addr/--master-port): its nodes are fixed, so it has no spares; "
                         "use --rdzv-backend c10d --rdzv-endpoint HOST:PORT for spares and shrinking")
    return rdzv.min_nodes


def elastic_options(opts: list[str], rdzv, floor: int) -> list[str]:
    """torchrun's options for one node of a multi-node falconext job: the job trains on
    ``--nnodes``' MIN nodes (more launchers are spares, which torch keeps out of a full
    round), and may go on with as few as ``floor`` after an exclusion that no spare fills:
    ``--nnodes FLOOR:MIN``; ``--max-restarts`` DEFAULT_MAX_RESTARTS unless given (pure)."""
    out = set_option(opts, "--nnodes", f"{min(floor, rdzv.min_nodes)}:{rdzv.min_nodes}")
    if option(out, "--max-restarts") is None:
        out += ["--max-restarts", str(DEFAULT_MAX_RESTARTS)]
    return out


def _config(job: "_Job"):
    """The job's FalconConfig."""
    return FalconConfig(**job.config)


@dataclass
class _Job:
    out: str
    flags: list[str]
    world: int
    ranks_per_node: int
    config: dict


def _prepare(plan: LaunchPlan, rdzv, hosts: bool = True) -> _Job:
    """Check the ``--falcon*`` flags and complete the script's arguments for S2 and S4.
    ``hosts``: this launcher owns the run directory's job-wide files (one per job)."""
    try:
        flags = parse_flags(plan.falcon_args)
        cfg = config_from_args(flags)
    except (FlagError, ConfigError) as exc:
        raise InputError(str(exc)) from None
    out = os.path.abspath(flags.falcon_out or "falcon-out")
    other = running_other_job(read_access(out), rdzv.rdzv_id) if hosts and rdzv.multi_node else None
    if other is not None:  # its events, summary and access.json are not this job's to clear
        raise InputError(other.refusal(out, rdzv.rdzv_id))
    os.makedirs(out, exist_ok=True)
    for stale in ("events.jsonl", "restart.json", "summary.json"):  # the node that owns them clears them
        if hosts and os.path.exists(os.path.join(out, stale)):
            os.remove(os.path.join(out, stale))
    nproc = rdzv.nproc_per_node
    nnodes = rdzv.min_nodes  # the job's nodes; more launchers are spares
    world = nproc * nnodes
    rpn = flags.falcon_ranks_per_node or nproc
    extra: list[str] = ["--falcon-out", out]
    if flags.falcon_inject:
        path = copy_faults(flags.falcon_inject, out)
        try:
            read_faults(path, world, rpn, hardware_nodes=rdzv.max_nodes)  # a spare's hardware too
        except ValueError as exc:
            raise InputError(str(exc)) from None
        extra += ["--falcon-inject", path]
    why = contract.s2_refusal(script_namespace(plan.script_args))
    if cfg.force_microbatches and why:
        raise InputError(f"--falcon-force-microbatches: {why}")
    forced = parse_topology(cfg.force_topology)
    if forced is not None:
        checked_roles(forced[1], world, "--falcon-force-topology")
    if rdzv.multi_node:  # what an exclusion may leave: the controller refuses one the job cannot absorb
        extra += ["--falcon-restart-floor-nodes", str(max(1, job_floor(plan.script_args, rdzv)))]
        if not rdzv.elastic and hosts:
            print(f"falconext: a static rendezvous (--master-addr/--master-port) keeps its {rdzv.min_nodes} nodes: "
                  "S4 restarts them in place, never without a node (that needs --rdzv-backend c10d)", flush=True)
    if flags.falcon_mitigation_strategies is None:
        strategies = [s for s in ("S2", "S4") if not (s == "S2" and why)]
        extra += ["--falcon-mitigation-strategies", ",".join(strategies) or "S4"]
        if why:
            print(f"falconext: {why}; S2 is off for this job", flush=True)
    # S4 through Megatron-LM's own exit path: its signal handler and a checkpoint directory
    if "--exit-signal-handler" not in plan.script_args:
        plan.script_args.append("--exit-signal-handler")
    if option(plan.script_args, "--save") is None:
        plan.script_args += ["--save", os.path.join(out, "checkpoint")]
        if option(plan.script_args, "--save-interval") is None:  # Megatron wants one with --save
            plan.script_args += ["--save-interval", str(NO_PERIODIC_SAVE)]
    if option(plan.script_args, "--ckpt-format") is None and not _has_cuda():
        plan.script_args += ["--ckpt-format", "torch"]
    if not _has_cuda():  # the emulated device's validation settings, unless given
        knobs = dict(EMULATED_TESTBED, falcon_p2p_bytes=max(4096, int(DEFAULT_INTER_BANDWIDTH * MESSAGE_S)))
        if flags.falcon_device_gflops is None:  # the device speed this host keeps up with
            # the job's nodes on this host (a spare's ranks do not run until one leaves)
            sharing = min(int(os.environ.get(NODES_ON_HOST_ENV, "1") or 1), rdzv.min_nodes)
            cores = len(os.sched_getaffinity(0))
            knobs["falcon_device_gflops"] = round(host_gflops(cores, nproc * sharing), 4)
            print(f"falconext: emulated device at {knobs['falcon_device_gflops']:g} GFLOP/s "
                  f"({nproc * sharing} ranks on this host's {cores} cores)", flush=True)
        for knob, value in knobs.items():
            if getattr(flags, knob, None) is None:
                extra += ["--" + knob.replace("_", "-"), str(value)]
    elif flags.falcon_gemm_size is None:  # a GPU's validation GEMM, unless given
        extra += ["--falcon-gemm-size", str(CUDA_GEMM_SIZE)]
    all_flags = [a for a in _without(plan.falcon_args, ("--falcon-out", "--falcon-inject"))] + extra
    final = parse_flags(all_flags)
    return _Job(out, all_flags, world, rpn, config_from_args(final).to_dict())


#: the validation GEMM's n on a GPU: the config's 256 is timed by its launch on a current GPU
#: (1.3 TFLOP/s on an H200 in the GPU check, 2026-11-27), where a throttled clock would hardly
#: show; 4096 takes a few milliseconds per repeat there
CUDA_GEMM_SIZE = 4096


def checked_roles(roles: object, world: int, name: str) -> list[int]:
    """``roles`` if it is a permutation of the job's ``world`` ranks; else an
    :class:`InputError` naming ``name``."""
    try:
        return list(check_roles(roles, world, name))  # type: ignore[arg-type]
    except ValueError as exc:
        raise InputError(str(exc)) from None


def restart_roles(extra: dict, world: int) -> list[int] | None:
    """The roles an S3 restart request asks for (None: S4, roles unchanged); a request
    whose roles are not a permutation of the job's ranks is an :class:`InputError`."""
    return checked_roles(extra["roles"], world, "the restart request's roles") if "roles" in extra else None


def roles_env(roles: list[int], env: dict[str, str]) -> dict[str, str]:
    """What the relaunched ranks need to play ``roles`` (``roles[process]`` = torch rank,
    one launcher holding every rank): the roles for falconext, and where there are GPUs, a
    ``CUDA_VISIBLE_DEVICES`` in which local rank ``r`` finds the GPU of the process that
    now plays it (Megatron picks the GPU by local rank)."""
    out = {ROLES_ENV: json.dumps(roles)}
    if _has_cuda():
        listed = env.get("CUDA_VISIBLE_DEVICES", "")
        gpus = [g.strip() for g in listed.split(",")] if listed.strip() else [str(i) for i in range(len(roles))]
        if len(gpus) < len(roles):
            raise InputError(f"S3 restart: {len(roles)} ranks but CUDA_VISIBLE_DEVICES lists {len(gpus)} GPUs")
        out["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[p] for p in processes_of(roles))
    return out


def _without(flags: list[str], names: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    skip = False
    for a in flags:
        if skip:
            skip = False
            continue
        if a in names:
            skip = True
            continue
        if a.split("=", 1)[0] in names:
            continue
        out.append(a)
    return out


def _has_cuda() -> bool:
    import torch  # lazy: start-up time (no torch in the launcher until a --falcon job asks about CUDA)

    return torch.cuda.is_available()


def _torchrun(plan: LaunchPlan) -> list[str]:
    opts = list(plan.torchrun)
    if option(opts, "--master-port") is None and option(opts, "--rdzv-endpoint") is None \
            and "--standalone" not in opts:
        opts += ["--master-port", str(free_port())]
    return [sys.executable, "-m", "torch.distributed.run", *opts, "-m", "falconext.megatron_lm.rank",
            plan.script, *plan.script_args]


def _start_plane(job: _Job, env: dict[str, str], redis_bind: str = "127.0.0.1", agents: bool = True,
                 access: dict | None = None):
    """The control plane (one per job), its variables in ``env``; None when off."""
    if not _config(job).control_plane:
        return None

    ns = argparse.Namespace(falcon=True, out=job.out, nproc=job.world, ranks_per_node=job.ranks_per_node,
                            falcon_redis_url=None,
                            **{"falcon_" + k: v for k, v in job.config.items()})
    return start_plane(ns, env, redis_bind=redis_bind, agents=agents, access=access)


def _drop_excluded_faults(job: _Job, req, env: dict[str, str]) -> None:
    """The test bed replaces an excluded (virtual) node: its faults are dropped."""
    flags = json.loads(env[FLAGS_ENV])
    if "--falcon-inject" not in flags:
        return
    k = flags.index("--falcon-inject")
    with open(flags[k + 1]) as f:
        faults = json.load(f)
    kept = restart.faults_without_nodes(faults, req.exclude_nodes, job.ranks_per_node)
    path = os.path.join(job.out, f"faults-r{req.attempt}.json")
    with open(path, "w") as f:
        json.dump(kept, f)
    flags[k + 1] = path
    env[FLAGS_ENV] = json.dumps(flags)


def _finalize(out: str) -> None:
    if not os.path.exists(os.path.join(out, "run.json")):
        return
    summary = report.finalize(out)
    print(report.format_summary(summary), flush=True)

    print(report_at_end(out), flush=True)
