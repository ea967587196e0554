"""A real Slurm cluster on the emulated nodes bed: ``bash launch/slurm_bed.sh up|down|status``.

``up --nodes N`` makes N emulated nodes as ``falconext nodes`` does (a network namespace
each on one bridge, shaped links: :mod:`falconext.testbed.netns`), then runs Debian's
slurm-wlm on them: ``slurmctld`` in the root namespace, listening on the bridge's address,
and one ``slurmd`` per node inside the node's namespace and its own UTS namespace, with
the node's name as host name (``node0`` ...), so that ``sbatch`` and ``srun`` allocate bed
nodes as they would real ones. ``munged`` is started when none runs. Nodes are declared
with 64 CPUs and 8 GPUs each (a GPU count only: ranks run on the CPU), so that the
example batch script's ``#SBATCH`` lines fit. The node names resolve to their addresses
through lines added to ``/etc/hosts``; inside each node its own name resolves to 127.0.1.1,
as Debian writes a host's ``/etc/hosts`` (``/etc/netns/<ns>/hosts``, which ``ip netns exec``
mounts over it).

What the bed stands in for reaches the job's tasks through the cluster's ``TaskProlog``
(as a site's prolog sets a task's environment): the emulated hardware node
(``FALCON_NETNS_NODE``), the node's link for gloo and the link shaper, and how many nodes
share this machine. ``FALCONEXT_NODE_NAME`` is not set: the job sets it from
``SLURMD_NODENAME``, as on a real cluster.

Everything lives under :data:`STATE_DIR` and ``/etc/slurm`` (a ``slurm.conf`` that is not
the bed's is kept aside and put back by ``down``); the network is named ``fxslurm-...``,
which the nodes bed's clean-up of killed runs leaves alone. Only root can run it.
Rendering the configuration is pure (:func:`slurm_conf`, :func:`task_prolog`, ...); the
rest is the edge that runs daemons, always with deadlines.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Sequence

from falconext.elastic.hosts import NODES_ON_HOST_ENV
from falconext.inputs import InputError
from falconext.model.device import DEFAULT_INTER_BANDWIDTH
from falconext.testbed import netns
from falconext.testbed.nodes import mbps_to_bytes

#: the bed's own files: state.json, logs, spool folders, the task prolog
STATE_DIR = "/run/falconext-slurm-bed"
#: the daemons' logs (kept by ``down``, for a look after the fact)
LOG_DIR = "/var/log/falconext-slurm-bed"
#: where Slurm's commands look for their configuration
CONF_DIR = "/etc/slurm"
#: where ``ip netns exec`` finds a namespace's own /etc files
NETNS_ETC = "/etc/netns"
#: the network's name family (not ``fx<pid>``: it outlives the command that made it)
TAG = "fxslurm"
#: the first line of every file the bed writes; ``down`` removes only files that carry it
MARK = "# written by falconext's Slurm bed (launch/slurm_bed.sh); 'down' removes it"
#: the end of each line the bed adds to /etc/hosts
HOSTS_MARK = "# falconext-slurm-bed"
#: what each node declares: enough for the example batch script's #SBATCH lines
NODE_CPUS = 64
NODE_GPUS = 8
#: the partition every node is in
PARTITION = "bed"
#: how long ``up`` waits for every node to show idle, seconds
UP_DEADLINE_S = 20.0
#: how long a daemon gets to stop after SIGTERM, seconds
STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class BedNode:
    """One node of the bed: its Slurm name and address."""

    name: str
    addr: str


@dataclass(frozen=True)
class BedState:
    """What ``up`` made, kept in ``STATE_DIR/state.json`` for ``down`` and ``status``."""

    subnet: str
    nodes: list[BedNode]
    rate: float
    controller: str  # the host name slurmctld runs under
    started_munged: bool
    saved_conf: bool  # a slurm.conf that was not ours was kept aside

    @property
    def layout(self) -> netns.Layout:
        """The network's names and addresses."""
        return netns.Layout(TAG, ipaddress.IPv4Network(self.subnet), len(self.nodes))


# -- the configuration (pure) -----------------------------------------------------------------
def node_names(count: int) -> list[str]:
    """The nodes' names: ``node0`` ... (the nodes bed's names too)."""
    return [f"node{k}" for k in range(count)]


def slurm_conf(controller: str, controller_addr: str, nodes: Sequence[BedNode], state_dir: str = STATE_DIR,
               log_dir: str = LOG_DIR) -> str:
    """The cluster's ``slurm.conf``: one controller, the nodes, one partition holding them
    all; no accounting database; process tracking by process group (no cgroup needed)."""
    names = ",".join(n.name for n in nodes)
    lines = [
        MARK,
        "ClusterName=falconext-bed",
        f"SlurmctldHost={controller}({controller_addr})",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"StateSaveLocation={state_dir}/slurmctld",
        f"SlurmdSpoolDir={state_dir}/slurmd-%n",
        f"SlurmctldPidFile={state_dir}/slurmctld.pid",
        f"SlurmdPidFile={state_dir}/slurmd-%n.pid",
        f"SlurmctldLogFile={log_dir}/slurmctld.log",
        f"SlurmdLogFile={log_dir}/slurmd-%n.log",
        "SlurmctldPort=6817",
        "SlurmdPort=6818",
        "ProctrackType=proctrack/pgid",
        "TaskPlugin=task/none",
        f"TaskProlog={state_dir}/task_prolog.sh",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "GresTypes=gpu",
        "SchedulerType=sched/backfill",
        "ReturnToService=2",
        "SlurmdParameters=config_overrides",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "JobAcctGatherType=jobacct_gather/none",
        "MpiDefault=none",
        "SlurmdTimeout=300",
        "InactiveLimit=0",
        "KillWait=30",
        "MinJobAge=3600",
    ]
    for n in nodes:
        lines.append(f"NodeName={n.name} NodeAddr={n.addr} NodeHostname={n.name} CPUs={NODE_CPUS} "
                     f"Gres=gpu:{NODE_GPUS} State=UNKNOWN")
    lines.append(f"PartitionName={PARTITION} Nodes={names} Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def gres_conf(nodes: Sequence[BedNode], state_dir: str = STATE_DIR) -> str:
    """``gres.conf``: each node's GPUs, as the bed's stand-in device files (Slurm drops a
    GPU without one; ranks run on the CPU)."""
    lines = [MARK, "AutoDetect=off"]
    lines += [f"NodeName={n.name} Name=gpu File={state_dir}/gpu[0-{NODE_GPUS - 1}]" for n in nodes]
    return "\n".join(lines) + "\n"


def cgroup_conf() -> str:
    """``cgroup.conf``: this machine mounts cgroup v1 (nothing of the bed uses cgroups)."""
    return f"{MARK}\nCgroupPlugin=cgroup/v1\nIgnoreSystemd=yes\n"


def task_prolog(layout: netns.Layout, names: Sequence[str], rate: float) -> str:
    """The ``TaskProlog`` script: for the node a task runs on (``SLURMD_NODENAME``), the
    ``export`` lines Slurm adds to the task's environment (the emulated hardware node, its
    link, how many nodes share this machine)."""
    lines = ["#!/bin/sh", MARK, 'case "$SLURMD_NODENAME" in']
    for k, name in enumerate(names):
        env = dict(layout.node_env(k, rate), **{NODES_ON_HOST_ENV: str(len(names))})
        exports = "; ".join(f"echo export {key}={value}" for key, value in env.items())
        lines.append(f"  {name}) {exports} ;;")
    lines += ["esac", "exit 0"]
    return "\n".join(lines) + "\n"


def hosts_lines(nodes: Sequence[BedNode]) -> list[str]:
    """The lines ``/etc/hosts`` gets: each node's address and name."""
    return [f"{n.addr}\t{n.name}\t{HOSTS_MARK}" for n in nodes]


def node_hosts_file(name: str, nodes: Sequence[BedNode]) -> str:
    """Node ``name``'s own ``/etc/hosts`` (``ip netns exec`` mounts ``/etc/netns/<ns>/hosts``
    over it): as Debian writes one, its own name on 127.0.1.1, and the other nodes at their
    addresses (as a site's DNS would give them)."""
    lines = [MARK, "127.0.0.1\tlocalhost", f"127.0.1.1\t{name}"]
    lines += [f"{n.addr}\t{n.name}" for n in nodes if n.name != name]
    return "\n".join(lines) + "\n"


def without_bed_lines(text: str) -> str:
    """``/etc/hosts`` text without the lines the bed added."""
    return "".join(line for line in text.splitlines(keepends=True) if not line.rstrip().endswith(HOSTS_MARK))


def idle_nodes(sinfo_output: str) -> dict[str, str]:
    """Each node's state from ``sinfo -h -N -o '%N %T'`` output."""
    states = {}
    for line in sinfo_output.splitlines():
        words = line.split()
        if len(words) >= 2:
            states[words[0]] = words[1].lower()
    return states


# -- the edge -------------------------------------------------------------------------------------
def _state_path() -> str:
    return os.path.join(STATE_DIR, "state.json")


def read_state() -> BedState | None:
    """The running bed's state, or None when no bed is up."""
    try:
        with open(_state_path()) as f:
            raw = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise InputError(f"slurm bed: {_state_path()} is unreadable ({exc}): run 'down' to clear it") from None
    return BedState(subnet=raw["subnet"], nodes=[BedNode(**n) for n in raw["nodes"]], rate=raw["rate"],
                    controller=raw["controller"], started_munged=raw["started_munged"], saved_conf=raw["saved_conf"])


def _write(path: str, text: str, mode: int = 0o644) -> None:
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)


def _ours(path: str) -> bool:
    try:
        with open(path) as f:
            return MARK in f.read(400)
    except OSError:
        return False


def _run(argv: Sequence[str], timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise InputError(f"slurm bed: '{' '.join(argv)}' did not finish within {timeout_s:g} s") from None


def _check(proc: subprocess.CompletedProcess, what: str) -> None:
    if proc.returncode != 0:
        first = (proc.stderr or proc.stdout or "").strip().splitlines()
        raise InputError(f"slurm bed: {what} failed: {first[-1] if first else f'exit status {proc.returncode}'}")


def missing() -> str | None:
    """None when this machine can run the bed, else a one-line reason."""
    if os.geteuid() != 0:
        return "it needs root (network namespaces, Slurm's daemons)"
    for tool in ("slurmctld", "slurmd", "munged", "sinfo", "unshare"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed (apt-get install slurm-wlm munge)"
    why = netns.available()
    return None if why is None else f"network namespaces are not available here ({why})"


MUNGE_SOCKET = "/run/munge/munge.socket.2"


def _munged_running() -> bool:
    return _run(["pgrep", "-x", "munged"]).returncode == 0 and os.path.exists(MUNGE_SOCKET)


def up(count: int, rate: float) -> BedState:
    """Bring the cluster up (see the module); on any failure what was made is taken down."""
    why = missing()
    if why is not None:
        raise InputError(f"slurm bed: {why}")
    if count < 1:
        raise InputError(f"slurm bed: --nodes must be >= 1, got {count}")
    if read_state() is not None:
        raise InputError("slurm bed: a bed is already up (bash launch/slurm_bed.sh down first)")
    layout = netns.Layout(TAG, netns.free_subnet(netns.host_networks()), count)
    names = node_names(count)
    nodes = [BedNode(name, layout.node_ip(k)) for k, name in enumerate(names)]
    shutil.rmtree(STATE_DIR, ignore_errors=True)  # what a bed killed before 'down' left
    os.makedirs(STATE_DIR, exist_ok=True)
    os.makedirs(CONF_DIR, exist_ok=True)
    shutil.rmtree(LOG_DIR, ignore_errors=True)
    os.makedirs(LOG_DIR, exist_ok=True)
    conf = os.path.join(CONF_DIR, "slurm.conf")
    saved = os.path.exists(conf) and not _ours(conf)
    started_munged = not _munged_running()
    state = BedState(str(layout.subnet), nodes, rate, os.uname().nodename.split(".")[0], started_munged, saved)
    _write(_state_path(), json.dumps(asdict(state), indent=2))
    try:
        for argv in netns.setup_commands(layout):
            netns.run(argv)
        for k in range(count):
            for argv in netns.shaping_commands(layout, k, rate, layout.ns(k)):
                netns.run(argv)
        if saved:
            os.replace(conf, conf + ".falconext-saved")
        _write(conf, slurm_conf(state.controller, layout.bridge_ip, nodes))
        _write(os.path.join(CONF_DIR, "gres.conf"), gres_conf(nodes))
        _write(os.path.join(CONF_DIR, "cgroup.conf"), cgroup_conf())
        _write(os.path.join(STATE_DIR, "task_prolog.sh"), task_prolog(layout, names, rate), 0o755)
        for i in range(NODE_GPUS):  # character devices with /dev/null's numbers: harmless
            os.mknod(os.path.join(STATE_DIR, f"gpu{i}"), stat.S_IFCHR | 0o666, os.makedev(1, 3))
        for name in names:
            os.makedirs(os.path.join(STATE_DIR, f"slurmd-{name}"), exist_ok=True)
        with open("/etc/hosts") as f:
            hosts = without_bed_lines(f.read())
        _write("/etc/hosts", hosts + "".join(line + "\n" for line in hosts_lines(nodes)))
        for k, name in enumerate(names):  # each node's own, as Debian writes it
            os.makedirs(os.path.join(NETNS_ETC, layout.ns(k)), exist_ok=True)
            _write(os.path.join(NETNS_ETC, layout.ns(k), "hosts"), node_hosts_file(name, nodes))
        if started_munged:
            os.makedirs("/run/munge", exist_ok=True)
            _check(_run(["munged", "--force"]), "starting munged")
            deadline = time.monotonic() + STOP_GRACE_S
            while time.monotonic() < deadline and not os.path.exists(MUNGE_SOCKET):
                time.sleep(0.1)
        _check(_run(["slurmctld", "-c"]), "starting slurmctld")
        for k, name in enumerate(names):
            # slurmd forks into the background inside the node's namespaces, which it keeps
            argv = netns.netns_exec(layout.ns(k), ["unshare", "--uts", "sh", "-c",
                                                   f"hostname {name} && exec slurmd -N {name}"])
            _check(_run(argv), f"starting slurmd on {name}")
        _wait_idle(names)
    except BaseException:
        down(quiet=True)
        raise
    return state


def _wait_idle(names: Sequence[str]) -> None:
    deadline = time.monotonic() + UP_DEADLINE_S
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        proc = _run(["sinfo", "-h", "-N", "-o", "%N %T"], timeout_s=10)
        states = idle_nodes(proc.stdout) if proc.returncode == 0 else {}
        if all(states.get(n) == "idle" for n in names):
            return
        time.sleep(1.0)
    reasons = _run(["sinfo", "-h", "-R", "-o", "%N: %E"], timeout_s=10).stdout.strip().replace("\n", "; ")
    raise InputError(f"slurm bed: the nodes did not come up idle within {UP_DEADLINE_S:g} s "
                     f"(sinfo: {states or 'no answer'}{'; ' + reasons if reasons else ''}; logs in {LOG_DIR})")


def _stop_pidfile(path: str) -> None:
    try:
        with open(path) as f:
            pid = int(f.read().strip() or 0)
    except (OSError, ValueError):
        return
    if pid <= 0:
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and netns.pid_alive(pid):
        time.sleep(0.1)
    if netns.pid_alive(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def down(quiet: bool = False) -> None:
    """Take the bed down: jobs cancelled, daemons stopped, the network, hosts lines and
    configuration removed (a slurm.conf kept aside put back). Safe to run twice."""
    state = read_state()
    if state is None:
        if not quiet:
            print("slurm bed: no bed is up", flush=True)
        return
    if shutil.which("scancel"):
        try:
            _run(["scancel", "--full", "--partition", PARTITION], timeout_s=10)
        except InputError:
            pass  # no controller answers: its jobs go with the nodes' namespaces
    for node in state.nodes:
        _stop_pidfile(os.path.join(STATE_DIR, f"slurmd-{node.name}.pid"))
    _stop_pidfile(os.path.join(STATE_DIR, "slurmctld.pid"))
    netns.remove_layout(state.layout)
    for k in range(len(state.nodes)):
        shutil.rmtree(os.path.join(NETNS_ETC, state.layout.ns(k)), ignore_errors=True)
    if state.started_munged:
        subprocess.run(["pkill", "-x", "munged"], timeout=10, check=False)
        deadline = time.monotonic() + STOP_GRACE_S  # gone before a next 'up' looks for one
        while time.monotonic() < deadline and _run(["pgrep", "-x", "munged"]).returncode == 0:
            time.sleep(0.1)
    try:
        with open("/etc/hosts") as f:
            hosts = f.read()
        _write("/etc/hosts", without_bed_lines(hosts))
    except OSError:
        pass
    for name in ("slurm.conf", "gres.conf", "cgroup.conf"):
        path = os.path.join(CONF_DIR, name)
        if _ours(path):
            os.remove(path)
    saved = os.path.join(CONF_DIR, "slurm.conf.falconext-saved")
    if state.saved_conf and os.path.exists(saved):
        os.replace(saved, os.path.join(CONF_DIR, "slurm.conf"))
    shutil.rmtree(STATE_DIR, ignore_errors=True)
    if not quiet:
        print("slurm bed: down", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``up [--nodes N] [--link-mbps M]``, ``down`` or ``status``; errors in one line."""
    p = argparse.ArgumentParser(prog="launch/slurm_bed.sh", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="start the cluster: N emulated nodes, slurmctld, one slurmd each")
    u.add_argument("--nodes", type=int, default=3, help="how many nodes (default 3: two to train, a spare)")
    u.add_argument("--link-mbps", type=float, default=None,
                   help="each link between two nodes, megabits/s (default: the emulated network's 400)")
    sub.add_parser("down", help="stop the cluster and remove everything it made")
    sub.add_parser("status", help="say whether a bed is up, and sinfo")
    args = p.parse_args(argv)
    try:
        if args.cmd == "up":
            rate = DEFAULT_INTER_BANDWIDTH if args.link_mbps is None else mbps_to_bytes(args.link_mbps)
            state = up(args.nodes, rate)
            print(f"slurm bed: up: {len(state.nodes)} nodes ("
                  + ", ".join(f"{n.name} {n.addr}" for n in state.nodes)
                  + f"), partition '{PARTITION}', controller {state.controller}; logs in {LOG_DIR}", flush=True)
        elif args.cmd == "down":
            down()
        else:
            state = read_state()
            if state is None:
                print("slurm bed: no bed is up", flush=True)
                return 1
            print(_run(["sinfo"], timeout_s=10).stdout, end="", flush=True)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
