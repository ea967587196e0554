"""Real rate-limited links between the test bed's virtual nodes (``falconext train --net netns``).

Each virtual node (ranks ``k * ranks_per_node ...``) gets its own network namespace.
A Linux bridge in the root namespace joins them through one veth pair per node::

    root namespace:  bridge fx<pid>-br 10.213.X.1/24
                       |- fx<pid>-v0  <veth>  fx<pid>-p0 10.213.X.10  (namespace fx<pid>-n0)
                       |- fx<pid>-v1  <veth>  fx<pid>-p1 10.213.X.11  (namespace fx<pid>-n1)
                       ...

Ranks of one node talk over their namespace's loopback (unshaped); traffic between
nodes crosses the veths. Only addresses inside the namespaces this module creates (and
the bridge's own address, where the job's private Redis listens) are ever used; the
subnet is a /24 under 10.213.0.0/16 that no address or route of the host overlaps.

Shaping (checked on this kernel, 2026-11: htb and tbf exist, netem does not; htb with a
u32 filter on the destination address works): each node's veth egress carries an ``htb``
qdisc with one class per peer node, each at the base link rate, and a u32 filter sending
packets for that peer's address into its class. Each class is a separate point-to-point
link of the base rate (a node sending to two peers at once may use twice the base rate,
as with one link per pair). Traffic that matches no filter (ARP, the control plane's
Redis on the bridge address) is not shaped: the qdisc has no default class. A link fault
between nodes a and b sets the class toward b on a's veth, and the class toward a on
b's veth, to base / factor; no other pair slows down. Measured here: 5 MB between two
namespaces took 0.105 s at 50 MB/s and 0.415 s with the class at 12.5 MB/s.

Command builders are pure (they return argv lists); :func:`run` is the one edge that
executes them, always with a deadline. Everything a run creates is named
``fx<pid>-...`` after the process that owns it, so :func:`cleanup_stale` can remove what a
killed run left behind.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from falconext.elastic.hosts import HARDWARE_NODE_ENV

#: name family of everything this module creates: ``fx<pid>-n<k>``, ``fx<pid>-br``, ...
PREFIX = "fx"
#: the /16 the per-run /24 comes from
SUPERNET = ipaddress.IPv4Network("10.213.0.0/16")
#: host part of node k's address is FIRST_HOST + k; the bridge is .1
FIRST_HOST = 10
#: node count that still fits the /24 and the 15-character interface names
MAX_NODES = 240
#: deadline of one ip/tc call, seconds
CMD_TIMEOUT_S = 10.0
#: htb class quantum, bytes: classes do not borrow, so it only has to stay within htb's
#: limits (the default rate / r2q exceeds them at tens of MB/s and makes tc warn)
QUANTUM = 60000
#: minor class id of the class toward peer node p is CLASS_BASE + p
CLASS_BASE = 0x10

# what the launcher tells each rank (read by LinkShaper.from_env)
ENV_NODE = HARDWARE_NODE_ENV  # this namespace's virtual node
ENV_DEV = "FALCON_NETNS_DEV"  # the veth inside this namespace
ENV_IPS = "FALCON_NETNS_IPS"  # comma-separated node addresses, node 0 first
ENV_RATE = "FALCON_NETNS_RATE"  # base inter-node link rate, bytes/s


class NetnsError(RuntimeError):
    """An ip/tc command failed or ran past its deadline; the message is one line."""


# -- naming and addresses (pure) ----------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """Names and addresses of one run's namespaces, bridge and veths."""

    tag: str  # e.g. "fx1234": PREFIX + owning pid
    subnet: ipaddress.IPv4Network
    nodes: int

    @property
    def bridge(self) -> str:
        """The name of the bridge that joins the virtual nodes' veths."""
        return f"{self.tag}-br"

    @property
    def bridge_ip(self) -> str:
        """The bridge's address: the subnet's first host address."""
        return str(self.subnet.network_address + 1)

    def ns(self, k: int) -> str:
        """Namespace of virtual node k."""
        return f"{self.tag}-n{k}"

    def veth_root(self, k: int) -> str:
        """Root-namespace end of node k's veth (a bridge port)."""
        return f"{self.tag}-v{k}"

    def veth_node(self, k: int) -> str:
        """Node k's end of its veth, inside its namespace."""
        return f"{self.tag}-p{k}"

    def node_ip(self, k: int) -> str:
        """Virtual node ``k``'s address in the subnet."""
        return str(self.subnet.network_address + FIRST_HOST + k)

    def ips(self) -> list[str]:
        """Every virtual node's address, in node order."""
        return [self.node_ip(k) for k in range(self.nodes)]

    def node_env(self, k: int, rate: float) -> dict[str, str]:
        """Environment for node k's torchrun: gloo on the veth, and what LinkShaper reads."""
        return {
            ENV_NODE: str(k),
            ENV_DEV: self.veth_node(k),
            ENV_IPS: ",".join(self.ips()),
            ENV_RATE: repr(float(rate)),
            "GLOO_SOCKET_IFNAME": self.veth_node(k),
        }


def make_layout(nodes: int, pid: int, taken: Iterable[ipaddress.IPv4Network]) -> Layout:
    """The layout for ``nodes`` nodes owned by ``pid``, on the first /24 of SUPERNET
    (searching from one derived from the pid) that overlaps none of ``taken``."""
    if not 1 <= nodes <= MAX_NODES:
        raise ValueError(f"--net netns supports 1 to {MAX_NODES} virtual nodes, got {nodes}")
    return Layout(f"{PREFIX}{pid}", free_subnet(list(taken), start=pid), nodes)


def free_subnet(taken: Sequence[ipaddress.IPv4Network], start: int = 0) -> ipaddress.IPv4Network:
    """A /24 of SUPERNET overlapping none of ``taken`` (search starts at ``start`` mod 256)."""
    subnets = list(SUPERNET.subnets(new_prefix=24))
    for i in range(len(subnets)):
        net = subnets[(start + i) % len(subnets)]
        if not any(net.overlaps(t) for t in taken):
            return net
    raise NetnsError(f"no free /24 left in {SUPERNET} for the node namespaces")


def parse_networks(text: str) -> list[ipaddress.IPv4Network]:
    """Every IPv4 prefix in ``ip -4 -o addr`` / ``ip -4 route`` output ('default' is 0.0.0.0/0
    and is ignored: it overlaps everything without claiming it)."""
    nets = []
    for m in re.finditer(r"(?<![\d.])(\d{1,3}(?:\.\d{1,3}){3})(/\d{1,2})?(?![\d.])", text):
        try:
            nets.append(ipaddress.IPv4Network(m.group(1) + (m.group(2) or "/32"), strict=False))
        except ValueError:
            continue
    return [n for n in nets if n.prefixlen > 0]


# -- command builders (pure) --------------------------------------------------------------
def rate_arg(bytes_per_s: float) -> str:
    """A tc rate in bits/s (tc's 'bps' means bytes/s, so bits are spelled out)."""
    if not bytes_per_s > 0:
        raise ValueError(f"link rate must be > 0 bytes/s, got {bytes_per_s!r}")
    return f"{max(8, round(bytes_per_s * 8))}bit"


def class_id(peer: int) -> str:
    """htb class of the link toward node ``peer`` (tc reads the minor in hex)."""
    return f"1:{CLASS_BASE + peer:x}"


def setup_commands(layout: Layout) -> list[list[str]]:
    """Create the bridge, the namespaces and the veths, addressed and up."""
    cmds = [
        ["ip", "link", "add", layout.bridge, "type", "bridge"],
        ["ip", "addr", "add", f"{layout.bridge_ip}/{layout.subnet.prefixlen}", "dev", layout.bridge],
        ["ip", "link", "set", layout.bridge, "up"],
    ]
    for k in range(layout.nodes):
        ns, vr, vn = layout.ns(k), layout.veth_root(k), layout.veth_node(k)
        cmds += [
            ["ip", "netns", "add", ns],
            ["ip", "link", "add", vr, "type", "veth", "peer", "name", vn],
            ["ip", "link", "set", vn, "netns", ns],
            ["ip", "link", "set", vr, "master", layout.bridge],
            ["ip", "link", "set", vr, "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", ns, "addr", "add", f"{layout.node_ip(k)}/{layout.subnet.prefixlen}", "dev", vn],
            ["ip", "-n", ns, "link", "set", vn, "up"],
        ]
    return cmds


def tc_prefix(netns: str | None) -> list[str]:
    """``tc``, aimed at ``netns`` when given (a rank inside the namespace passes None)."""
    return ["tc"] if netns is None else ["tc", "-n", netns]


def shaping_commands(layout: Layout, k: int, rate: float, netns: str | None = None) -> list[list[str]]:
    """Node k's egress shaping: an htb root with one class per peer at ``rate`` bytes/s,
    and a u32 filter per peer on its destination address. Assumes no root qdisc yet
    (see :func:`unshape_command`)."""
    tc, dev = tc_prefix(netns), layout.veth_node(k)
    cmds = [tc + ["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb"]]
    for p in range(layout.nodes):
        if p == k:
            continue
        cmds.append(tc + ["class", "add", "dev", dev, "parent", "1:", "classid", class_id(p), "htb",
                          "rate", rate_arg(rate), "quantum", str(QUANTUM)])
        cmds.append(tc + ["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                          "match", "ip", "dst", f"{layout.node_ip(p)}/32", "flowid", class_id(p)])
    return cmds


def unshape_command(dev: str, netns: str | None = None) -> list[str]:
    """Remove a device's root qdisc (and with it every class and filter)."""
    return tc_prefix(netns) + ["qdisc", "del", "dev", dev, "root"]


def class_rate_command(dev: str, peer: int, rate: float, netns: str | None = None) -> list[str]:
    """Set the rate of the class toward node ``peer`` on ``dev`` to ``rate`` bytes/s."""
    return tc_prefix(netns) + ["class", "change", "dev", dev, "parent", "1:", "classid", class_id(peer), "htb",
                               "rate", rate_arg(rate), "quantum", str(QUANTUM)]


def teardown_commands(layout: Layout) -> list[list[str]]:
    """Delete what :func:`setup_commands` made. Deleting a namespace destroys the veth end
    inside it and so the pair; the root ends are deleted too in case a namespace was never
    made. Each command may fail harmlessly (already gone)."""
    cmds = [["ip", "netns", "del", layout.ns(k)] for k in range(layout.nodes)]
    cmds += [["ip", "link", "del", layout.veth_root(k)] for k in range(layout.nodes)]
    cmds.append(["ip", "link", "del", layout.bridge])
    return cmds


def netns_exec(ns: str, argv: Sequence[str]) -> list[str]:
    """Run ``argv`` inside namespace ``ns``."""
    return ["ip", "netns", "exec", ns, *argv]


# -- the edge: running commands -------------------------------------------------------------
def run(argv: Sequence[str], timeout_s: float = CMD_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
    """Run one ip/tc command with a deadline. With ``check``, a failure or a timeout
    raises :class:`NetnsError` naming the command and the first line of its stderr."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        if check:
            raise NetnsError(f"'{' '.join(argv)}' did not finish within {timeout_s:g} s") from None
        return subprocess.CompletedProcess(list(argv), -1, "", "timeout")
    except OSError as exc:
        if check:
            raise NetnsError(f"'{' '.join(argv)}' could not start ({exc.strerror})") from None
        return subprocess.CompletedProcess(list(argv), -1, "", str(exc))
    if check and proc.returncode != 0:
        first = (proc.stderr or proc.stdout or "").strip().splitlines()
        raise NetnsError(f"'{' '.join(argv)}' failed: {first[0] if first else f'exit status {proc.returncode}'}")
    return proc


def available() -> str | None:
    """None when this machine can build the netns test bed (root; ip and tc; a namespace,
    a bridge, a veth and an htb class can be made), else a one-line reason."""
    if os.geteuid() != 0:
        return "not root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' not found on PATH (iproute2)"
    probe = Layout(f"{PREFIX}{os.getpid()}", ipaddress.IPv4Network("10.213.255.0/24"), 0)
    ns, br, va, vb = f"{probe.tag}-q", f"{probe.tag}-qb", f"{probe.tag}-qa", f"{probe.tag}-qz"
    steps = [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", br, "type", "bridge"],
        ["ip", "link", "add", va, "type", "veth", "peer", "name", vb],
        ["ip", "link", "set", vb, "netns", ns],
        ["tc", "-n", ns, "qdisc", "add", "dev", vb, "root", "handle", "1:", "htb"],
        ["tc", "-n", ns, "class", "add", "dev", vb, "parent", "1:", "classid", class_id(1), "htb",
         "rate", rate_arg(1e6), "quantum", str(QUANTUM)],
        ["tc", "-n", ns, "filter", "add", "dev", vb, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
         "match", "ip", "dst", "10.213.255.11/32", "flowid", class_id(1)],
    ]
    try:
        for argv in steps:
            run(argv)
        return None
    except NetnsError as exc:
        return str(exc)
    finally:
        for argv in (["ip", "netns", "del", ns], ["ip", "link", "del", va], ["ip", "link", "del", br]):
            run(argv, check=False)


def host_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 prefix the host has an address in or a route to."""
    text = run(["ip", "-4", "-o", "addr", "show"]).stdout + run(["ip", "-4", "route", "show", "table", "all"]).stdout
    return parse_networks(text)


class Network:
    """One run's namespaces, bridge and shaped veths; :meth:`close` removes them all and
    is safe to call twice. Use as a context manager, or call :meth:`close` in a finally."""

    def __init__(self, layout: Layout, rate: float, runner: Callable[..., Any] = run) -> None:
        self.layout = layout
        self.rate = rate
        self._run = runner
        self._closed = True

    @classmethod
    def create(cls, nodes: int, rate: float, pid: int | None = None) -> "Network":
        """Set up a fresh network for ``nodes`` nodes at ``rate`` bytes/s per link; on any
        failure whatever was made is removed before the error propagates."""
        layout = make_layout(nodes, os.getpid() if pid is None else pid, host_networks())
        net = cls(layout, rate)
        net._closed = False
        try:
            for argv in setup_commands(layout):
                net._run(argv)
            net.reshape()
        except BaseException:
            net.close()
            raise
        return net

    def reshape(self) -> None:
        """(Re)install every node's shaping at the base rate: a fresh start for each attempt."""
        for k in range(self.layout.nodes):
            self._run(unshape_command(self.layout.veth_node(k), self.layout.ns(k)), check=False)
            for argv in shaping_commands(self.layout, k, self.rate, self.layout.ns(k)):
                self._run(argv)

    def exec_argv(self, k: int, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside virtual node ``k``'s namespace (``ip netns exec``)."""
        return netns_exec(self.layout.ns(k), argv)

    def close(self) -> None:
        """Kill anything still running inside the namespaces, then delete them, the veths
        and the bridge."""
        if self._closed:
            return
        self._closed = True
        remove_layout(self.layout, self._run)

    def __enter__(self) -> "Network":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def remove_layout(layout: Layout, runner: Callable[..., Any] = run) -> None:
    """Kill the processes left in the layout's namespaces and delete everything it names."""
    for k in range(layout.nodes):
        kill_namespace_pids(layout.ns(k), runner)
    for argv in teardown_commands(layout):
        runner(argv, check=False)


def kill_namespace_pids(ns: str, runner: Callable[..., Any] = run) -> None:
    """SIGKILL every process inside ``ns`` (a namespace outlives its deletion while a
    process still runs in it, and so would its veth)."""
    proc = runner(["ip", "netns", "pids", ns], check=False)
    for word in (getattr(proc, "stdout", "") or "").split():
        if word.isdigit() and int(word) != os.getpid():
            try:
                os.kill(int(word), 9)
            except OSError:
                pass


# -- leftovers of killed runs ------------------------------------------------------------------
def stale_names(ns_names: Iterable[str], link_names: Iterable[str], alive: Callable[[int], bool],
                prefix: str = PREFIX) -> tuple[list[str], list[str]]:
    """The namespaces and root links among the given names that belong to a run whose
    owning pid is no longer alive (names ``<prefix><pid>-n<k>``, ``-br``, ``-v<k>``, ``-q*``)."""
    ns_re = re.compile(rf"^{re.escape(prefix)}(\d+)-(?:n\d+|q)$")
    link_re = re.compile(rf"^{re.escape(prefix)}(\d+)-(?:br|v\d+|qa|qb)$")
    dead_ns = [n for n in ns_names if (m := ns_re.match(n)) and not alive(int(m.group(1)))]
    dead_links = [n for n in link_names if (m := link_re.match(n)) and not alive(int(m.group(1)))]
    return dead_ns, dead_links


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces() -> list[str]:
    """Names of the network namespaces ``ip netns`` knows."""
    out = run(["ip", "netns", "list"], check=False).stdout or ""
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def list_links() -> list[str]:
    """Names of the root namespace's links (a veth shows as ``name@peer``)."""
    out = run(["ip", "-o", "link", "show"], check=False).stdout or ""
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Remove namespaces, veths and bridges named ``<prefix><pid>-...`` whose owning pid no
    longer exists (a run killed with SIGKILL); returns what was removed."""
    dead_ns, dead_links = stale_names(list_namespaces(), list_links(), pid_alive, prefix)
    for ns in dead_ns:
        kill_namespace_pids(ns)
        run(["ip", "netns", "del", ns], check=False)
    # veth root ends go with their namespace; list again so only real leftovers are deleted
    _, dead_links = stale_names([], list_links(), pid_alive, prefix)
    for link in dead_links:
        run(["ip", "link", "del", link], check=False)
    return dead_ns + dead_links


def leftovers(tag: str) -> list[str]:
    """Namespaces and root links whose names start with ``tag + '-'`` (for tests and checks)."""
    return [n for n in list_namespaces() + list_links() if n.startswith(tag + "-")]


# -- inside a rank: applying link faults ------------------------------------------------------
class LinkShaper:
    """Applies the link faults of one virtual node to its veth's per-peer htb classes.

    Call :meth:`set_iteration` at the top of every training iteration: when the factor of
    a link from this node changes, the class toward that peer is set to base / factor
    (the peer's own leader slows the other direction). Only the node's leader (local
    rank 0) runs tc; the others keep the bookkeeping only. :meth:`close` restores the base
    rate on every class it changed (the namespace may serve a restarted attempt).
    """

    def __init__(
        self,
        faults: Sequence[Any],
        node: int,
        leader: bool,
        base_rate: float,
        node_ips: Sequence[str],
        dev: str,
        runner: Callable[..., Any] = run,
    ) -> None:
        if not 0 <= node < len(node_ips):
            raise ValueError(f"node {node} is not one of the {len(node_ips)} nodes")
        rate_arg(base_rate)  # reject a bad rate now
        self.faults = [f for f in faults if getattr(f, "kind", None) == "link" and node in (f.nodes or ())]
        self.node = node
        self.leader = leader
        self.base_rate = float(base_rate)
        self.peers = [p for p in range(len(node_ips)) if p != node]
        self.dev = dev
        self._run = runner
        self.factors: dict[int, float] = {p: 1.0 for p in self.peers}
        self.changes: list[tuple[int, int, float]] = []  # (iteration, peer, factor) applied

    @classmethod
    def from_env(cls, faults: Sequence[Any], environ: Mapping[str, str] | None = None) -> "LinkShaper | None":
        """The shaper the launcher's FALCON_NETNS_* variables describe (leader: LOCAL_RANK
        0), or None when this rank does not run in a node namespace."""
        env = os.environ if environ is None else environ
        if ENV_NODE not in env:
            return None
        try:
            return cls(faults, int(env[ENV_NODE]), int(env.get("LOCAL_RANK", "0")) == 0, float(env[ENV_RATE]),
                       env[ENV_IPS].split(","), env[ENV_DEV])
        except (KeyError, ValueError) as exc:
            raise NetnsError(f"bad FALCON_NETNS_* environment: {exc}") from None

    def wanted(self, iteration: int) -> dict[int, float]:
        """Each peer's link factor at ``iteration`` (product of the active faults on it)."""
        out = {p: 1.0 for p in self.peers}
        for f in self.faults:
            if f.active(iteration):
                peer = f.nodes[0] if f.nodes[1] == self.node else f.nodes[1]
                if peer in out:
                    out[peer] *= float(f.factor)
        return out

    def set_iteration(self, it: int) -> None:
        """Bring the classes in line with the faults active at iteration ``it``."""
        if not self.faults:
            return
        for peer, factor in self.wanted(it).items():
            if factor != self.factors[peer]:
                self._apply(peer, factor)
                self.factors[peer] = factor
                self.changes.append((it, peer, factor))

    def _apply(self, peer: int, factor: float) -> None:
        if self.leader:
            self._run(class_rate_command(self.dev, peer, self.base_rate / factor))

    def close(self) -> None:
        """Restore the base rate where a fault changed it; best effort, never raises."""
        for peer, factor in self.factors.items():
            if factor != 1.0:
                try:
                    self._apply(peer, 1.0)
                except NetnsError as exc:
                    print(f"falconext: could not restore link {self.node}-{peer}: {exc}", file=sys.stderr)
                self.factors[peer] = 1.0


__all__ = [
    "ENV_DEV", "ENV_IPS", "ENV_NODE", "ENV_RATE", "Layout", "LinkShaper", "Network", "NetnsError", "available",
    "cleanup_stale", "make_layout", "run",
]
