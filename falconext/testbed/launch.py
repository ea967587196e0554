"""``falconext train``: start the test-bed job under torchrun on this machine.

Checks the layout and the fault file before any process starts (a typo should not cost
a torchrun start-up), picks a free loopback port, runs ``-m falconext.testbed.train`` on every
rank, and returns its exit status. What the ranks write lands in ``--out``.

With ``--net netns`` (root) each virtual node gets a network namespace with a shaped veth
(:mod:`falconext.testbed.netns`) and its own torchrun inside it; the ranks meet over the
veths, the private Redis also listens on the bridge address, and the namespaces are
removed however the job ends.
"""

from __future__ import annotations

import argparse
import os
import json
import signal
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

from falconext.inputs import InputError
from falconext.control.plane import start_plane
from falconext.elastic.processes import stop_groups
from falconext.elastic.supervisor import AttemptEnd, Supervisor
from falconext.mitigate import restart
from falconext.model.device import DEFAULT_INTER_BANDWIDTH, MESSAGE_S, TESTBED_KNOBS
from falconext.model.faults import copy_faults, read_faults
from falconext.model.roles import check_roles
from falconext.ports import free_port
from falconext.testbed import netns
from falconext.testbed.options import check_train_arguments
from falconext.testbed.priority import raise_priority
from falconext.testbed.progress import Progress
from falconext.testbed.zygote import run_job


#: torchrun, with the ranks forked from one process that has imported torch and
#: megatron-core (:mod:`falconext.testbed.forkrun`): the same options and agent
TORCHRUN = [sys.executable, "-m", "falconext.testbed.forkrun"]


def torchrun_command(args: argparse.Namespace, argv_tail: list[str], port: int) -> list[str]:
    """The torchrun command line of one attempt: this machine's ranks running
    ``falconext.testbed.train`` with ``argv_tail``, rendezvous on loopback ``port``."""
    return [
        *TORCHRUN,
        "--nproc_per_node", str(args.nproc),
        "--master_addr", "127.0.0.1",
        "--master_port", str(port),
        "-m", "falconext.testbed.train", *argv_tail,
    ]


def rank_argv(args: argparse.Namespace) -> list[str]:
    """The per-rank command line: every option but the launcher's own."""
    out: list[str] = []
    for key, value in vars(args).items():
        if key in ("command", "nproc", "falcon_redis_url", "falcon_redis_url_file") or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if key in ("falcon", "report"):  # --X / --no-X switches
            out.append(flag if value else "--no-" + key)
        elif isinstance(value, tuple):  # a comma-separated list (--nvrx-report-s S,S)
            out += [flag, ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)]
        else:
            out += [flag, str(value)]
    return out


def testbed_knobs(args: argparse.Namespace) -> dict[str, float]:
    """The validation settings this test bed gets unless given on the command line."""
    knobs: dict[str, float] = dict(TESTBED_KNOBS.get(args.device, {}))
    if args.device == "emulated" or getattr(args, "net", "emulated") == "netns":
        rate = DEFAULT_INTER_BANDWIDTH if args.link_bandwidth is None else args.link_bandwidth
        knobs["falcon_p2p_bytes"] = max(4096, int(rate * MESSAGE_S))
    return knobs


def launch_training(args: argparse.Namespace) -> int:
    """``falconext train``: check the arguments, start the control plane, run torchrun
    (again after each S4 restart request), then write the summary and report; returns
    the exit status (2 for bad input, with one line)."""
    if args.nproc < 1:
        raise InputError("--nproc must be >= 1")
    try:
        check_train_arguments(args, args.nproc)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    if getattr(args, "nvrx_report_s", None) is not None:  # the benchmark extra is there, before anything starts
        # lazy: start-up time (testbed.nvrx imports torch: none in the launcher)
        from falconext.testbed.nvrx import check_available

        check_available()
    if args.inject:
        args.inject = copy_faults(args.inject, args.out)
        read_faults(args.inject, args.nproc, args.ranks_per_node)  # fail early, with a clear message
    if getattr(args, "net", "emulated") == "netns":
        _check_netns(args)

    why = raise_priority()  # every device: the CPU bed's timings are the host's, as easily stretched
    if why is not None:
        print(f"note: {why}", file=sys.stderr)
    for knob, value in testbed_knobs(args).items():
        if getattr(args, knob, None) is None:
            setattr(args, knob, value)
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    if getattr(args, "net", "emulated") == "netns":
        return _launch_netns(args, env)

    plane = start_plane(args, env)  # first: its Redis holds its port before torchrun's is picked
    progress = None
    if plane is not None and plane.url:
        progress = Progress(plane.url, plane.job, args.iters).start()
    try:
        return Supervisor.for_plane(args.out, env, plane).run(
            lambda _attempt: AttemptEnd(_run_torchrun(torchrun_command(args, rank_argv(args), free_port()), env)),
            lambda req: _prepare_restart(args, req))
    finally:
        if progress is not None:
            progress.stop()
        if plane is not None:
            plane.stop()


def _run_torchrun(cmd: list[str], env: dict[str, str]) -> int:
    """Run forkrun's command line ``cmd`` and return its exit status: forked from the
    zygote named in the environment when one serves it (:mod:`falconext.testbed.zygote`,
    the same run without importing torch again), otherwise as a fresh process."""
    code = run_job(cmd[len(TORCHRUN):], env) if cmd[:len(TORCHRUN)] == TORCHRUN else None
    return subprocess.run(cmd, env=env).returncode if code is None else code


def _prepare_restart(args: argparse.Namespace, req) -> None:
    """Relaunch from the checkpoint without the excluded nodes. On the test bed the
    excluded virtual node is replaced by a healthy one: its faults are dropped."""
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
    roles = restored_roles(req, args.nproc)
    if roles is not None:  # S3's layout outlives the restart: taken up again at the first iteration
        args.falcon_force_topology = f"{req.iteration}:{','.join(map(str, roles))}"
    print(f"falconext: restart {req.attempt} from iteration {req.iteration} without nodes {req.exclude_nodes} "
          f"(checkpoint {req.checkpoint})", flush=True)


def restored_roles(req, world: int) -> list[int] | None:
    """The roles (process -> role) a restart request says were in force, when they are
    not the launch's own; None otherwise. Raises InputError for roles that are not a
    permutation of the job's ranks."""
    roles = req.extra.get("roles")
    if roles is None:
        return None
    try:
        checked = list(check_roles(roles, world))
    except ValueError as exc:
        raise InputError(f"restart request: roles must be a permutation of 0..{world - 1}: {exc}") from None
    return None if checked == list(range(world)) else checked


# -- --net netns: one namespace and one torchrun per virtual node -----------------------------
#: TCP port of the rendezvous store in node 0's namespace (fresh per run, so free); attempt
#: a uses MASTER_PORT_BASE + a, so a restart never meets its predecessor's sockets
MASTER_PORT_BASE = 29500
#: once one node's torchrun failed, how long the others get to exit on their own, seconds
FAIL_GRACE_S = 20.0
#: how long a torchrun gets to exit after SIGTERM before SIGKILL, seconds
STOP_GRACE_S = 10.0


def _check_netns(args: argparse.Namespace) -> None:
    """Refuse what ``--net netns`` cannot do (one-line InputError), or fall back to the
    emulated link model, with a one-line notice, where this machine has no namespaces."""
    if os.geteuid() != 0:
        raise InputError("--net netns needs root (it creates network namespaces, veths and tc qdiscs); "
                         "run as root or use --net emulated")
    if args.nproc % args.ranks_per_node:
        raise InputError(f"--net netns needs --ranks-per-node ({args.ranks_per_node}) to divide --nproc "
                         f"({args.nproc}): every node namespace runs the same number of ranks")
    url = args.falcon_redis_url or os.environ.get("FALCON_REDIS_URL")
    if args.falcon and url and (urlparse(url).hostname or "") in ("127.0.0.1", "localhost", "::1"):
        raise InputError("--net netns: a control-plane Redis on loopback is unreachable from the node namespaces; "
                         "give one on another address, or no URL (the job then starts its own)")
    reason = netns.available()
    if reason is not None:
        print(f"falconext: --net netns not available ({reason}); using the emulated link model", flush=True)
        args.net = "emulated"


def node_torchrun_command(args: argparse.Namespace, argv_tail: list[str], nodes: int, node: int,
                          master_addr: str, port: int) -> list[str]:
    """Node ``node``'s torchrun (run inside its namespace): ranks_per_node local ranks of an
    ``nodes``-node job whose rendezvous store is at ``master_addr:port``."""
    return [
        *TORCHRUN,
        "--nnodes", str(nodes),
        "--node_rank", str(node),
        "--nproc_per_node", str(args.ranks_per_node),
        "--master_addr", master_addr,
        "--master_port", str(port),
        "-m", "falconext.testbed.train", *argv_tail,
    ]


def fold_exit_codes(codes: list[int | None]) -> tuple[int, int | None]:
    """One exit status for the job from its nodes' (None: still running or killed by us
    after another failed): the first failing node's status and that node, or (0, None)."""
    for node, code in enumerate(codes):
        if code not in (0, None):
            return code, node
    return 0, None


def _launch_netns(args: argparse.Namespace, env: dict[str, str]) -> int:
    """The ``--net netns`` job: namespaces up, control plane on the bridge address, one
    torchrun per node, the S4 restart loop, and everything removed however it ends."""
    removed = netns.cleanup_stale()
    if removed:
        print(f"falconext: removed {len(removed)} leftover(s) of killed netns runs: {' '.join(removed)}", flush=True)
    nodes = args.nproc // args.ranks_per_node
    rate = DEFAULT_INTER_BANDWIDTH if args.link_bandwidth is None else args.link_bandwidth
    network = plane = None
    with _signals_raise():
        try:
            try:
                network = netns.Network.create(nodes, rate)
            except (netns.NetnsError, ValueError) as exc:
                raise InputError(f"--net netns: could not set up the node namespaces: {exc}") from None
            plane = start_plane(args, env, redis_bind=f"{network.layout.bridge_ip} 127.0.0.1")
            net = network

            def start(attempt: int) -> AttemptEnd:
                code, node = _run_nodes(args, env, net, MASTER_PORT_BASE + attempt)
                return AttemptEnd(code, f"node {node}'s torchrun")

            def prepare(req) -> None:
                _prepare_restart(args, req)
                net.reshape()  # every link back to the base rate

            return Supervisor.for_plane(args.out, env, plane).run(start, prepare)
        finally:
            if plane is not None:
                plane.stop()
            if network is not None:
                network.close()


def _run_nodes(args: argparse.Namespace, env: dict[str, str], network, port: int) -> tuple[int, int | None]:
    """Start every node's torchrun in its namespace, wait for all, fold their statuses.
    A node that fails gives the others FAIL_GRACE_S to exit before they are stopped."""
    layout = network.layout
    tail = rank_argv(args)
    procs: list[subprocess.Popen] = []
    try:
        for k in range(layout.nodes):
            argv = network.exec_argv(k, node_torchrun_command(args, tail, layout.nodes, k, layout.node_ip(0), port))
            procs.append(subprocess.Popen(argv, env=dict(env, **layout.node_env(k, network.rate)),
                                          start_new_session=True))
        failed_at = None
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                return fold_exit_codes(codes)
            if failed_at is None and any(c not in (0, None) for c in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > FAIL_GRACE_S:
                stop_groups(procs)
                return fold_exit_codes(codes)
            time.sleep(0.2)
    finally:
        stop_groups(procs)


class _signals_raise:
    """While active (main thread only), SIGTERM raises SystemExit(143) like SIGINT raises
    KeyboardInterrupt, so the launcher's finally blocks stop the torchruns and remove the
    namespaces. The previous handlers come back on exit."""

    def __enter__(self) -> "_signals_raise":
        self._old = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._raise)
        return self

    @staticmethod
    def _raise(signum: int, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second SIGTERM must not cut the clean-up short
        raise SystemExit(128 + signum)

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
