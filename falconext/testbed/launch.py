"""``falconext train``: start the test-bed job under torchrun on this machine.

Checks the layout and the fault file before any process starts (a typo should not cost
a torchrun start-up), picks a free loopback port, runs ``-m falconext.train`` on every
rank, and returns its exit status. What the ranks write lands in ``--out``.
"""

from __future__ import annotations

import argparse
import os
import json
import socket
import subprocess
import sys
import time

from falconext.config import config_from_args
from falconext.inputs import InputError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(args: argparse.Namespace, argv_tail: list[str], port: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", str(args.nproc),
        "--master_addr", "127.0.0.1",
        "--master_port", str(port),
        "-m", "falconext.train", *argv_tail,
    ]


def rank_argv(args: argparse.Namespace) -> list[str]:
    """The per-rank command line: every option but the launcher's own."""
    out: list[str] = []
    for key, value in vars(args).items():
        if key in ("command", "nproc", "falcon_redis_url") or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if key == "falcon":
            out.append("--falcon" if value else "--no-falcon")
        else:
            out += [flag, str(value)]
    return out


def falcon_argv(args: argparse.Namespace) -> list[str]:
    """The ``--falcon-*`` threshold options, for the controller's command line."""
    out: list[str] = []
    for key, value in vars(args).items():
        if key.startswith("falcon_") and key != "falcon_redis_url" and value is not None:
            out += ["--" + key.replace("_", "-"), str(value)]
    return out


#: validation settings for the CPU test bed, unless given on the command line: its
#: ranks share the host's cores (one benchmark at a time), and its loopback messages
#: pick up milliseconds of scheduling noise (see FalconConfig)
CPU_TESTBED = {
    "falcon_gemm_concurrency": 1,
    "falcon_p2p_concurrency": 1,
    "falcon_validation_min_link_excess_s": 0.005,
}

#: validation settings for the emulated device, unless given on the command line: each
#: rank owns its (emulated) device, so benchmarks run side by side, and device time is
#: exact, so a few GEMM repeats suffice. Messages are 1 MB, so that the milliseconds of
#: real loopback noise under the modelled time (21 ms over a 50 MB/s network link) stay
#: far below the 1.5x verdict line, and the 5 ms floor keeps it so on a loaded host.
EMULATED_TESTBED = {
    "falcon_gemm_repeats": 10,
    "falcon_p2p_bytes": 1 << 20,
    "falcon_validation_min_link_excess_s": 0.005,
}
TESTBED_KNOBS = {"cpu": CPU_TESTBED, "emulated": EMULATED_TESTBED}


def launch_training(args: argparse.Namespace) -> int:
    from falconext.testbed.faults import read_faults
    from falconext.testbed.options import check_train_arguments

    if args.nproc < 1:
        raise InputError("--nproc must be >= 1")
    try:
        check_train_arguments(args, args.nproc)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    if args.inject:
        read_faults(args.inject, args.nproc, args.ranks_per_node)  # fail early, with a clear message
    for knob, value in TESTBED_KNOBS.get(args.device, {}).items():
        if getattr(args, knob, None) is None:
            setattr(args, knob, value)
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    cmd = torchrun_command(args, rank_argv(args), free_port())
    plane = None
    if args.falcon and config_from_args(args).control_plane:
        from falconext.control.client import REDIS_URL_ENV
        from falconext.control.plane import ControlPlane
        from falconext.control.redis_server import RedisUnavailable

        events = os.path.join(args.out, "events.jsonl")
        if os.path.exists(events):  # the controller appends from the start
            os.remove(events)
        nodes = -(-args.nproc // args.ranks_per_node)
        plane = ControlPlane(args.out, args.nproc, nodes, falcon_argv(args), redis_url=args.falcon_redis_url or env.get(REDIS_URL_ENV))
        try:
            plane.start()
        except RedisUnavailable as exc:
            raise InputError(str(exc)) from None
        env.update(plane.env())
    from falconext.mitigate.restart import LAUNCH_TIME_ENV

    env[LAUNCH_TIME_ENV] = repr(time.time())
    try:
        while True:
            proc = subprocess.run(cmd, env=env)
            if proc.returncode != 0:
                raise InputError(f"training failed (torchrun exit status {proc.returncode}); see the messages above")
            req = _take_restart_request(args.out)
            if req is None:
                return 0
            if req.attempt > MAX_RESTARTS:
                raise InputError(f"the job asked for restart number {req.attempt}; at most {MAX_RESTARTS} are allowed")
            _prepare_restart(args, req)
            cmd = torchrun_command(args, rank_argv(args), free_port())
            env[LAUNCH_TIME_ENV] = repr(req.requested_at)  # S4's downtime runs from the request
    finally:
        if plane is not None:
            plane.stop()


#: S4 restarts one job may ask for before the launcher gives up
MAX_RESTARTS = 3


def _take_restart_request(out: str):
    """The ranks' restart request, if they left one, moved aside so it is acted on once."""
    from falconext.mitigate import restart

    path = os.path.join(out, restart.RESTART_FILE)
    if not os.path.exists(path):
        return None
    try:
        req = restart.read_request(path)
    except restart.CheckpointError as exc:
        raise InputError(str(exc)) from None
    os.replace(path, os.path.join(out, f"restart-{req.attempt}.json"))
    return req


def _prepare_restart(args: argparse.Namespace, req) -> None:
    """Relaunch from the checkpoint without the excluded nodes. On the test bed the
    excluded virtual node is replaced by a healthy one: its faults are dropped."""
    from falconext.mitigate import restart

    if args.inject:
        with open(args.inject) as f:
            faults = json.load(f)
        kept = restart.faults_without_nodes(faults, req.exclude_nodes, args.ranks_per_node)
        path = os.path.join(args.out, f"faults-r{req.attempt}.json")
        with open(path, "w") as f:
            json.dump(kept, f)
        args.inject = path
    args.resume = req.checkpoint
    args.attempt = req.attempt
    print(f"falconext: restart {req.attempt} from iteration {req.iteration} without nodes {req.exclude_nodes} "
          f"(checkpoint {req.checkpoint})", flush=True)
