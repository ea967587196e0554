"""What a torchrun command line says about the job's nodes, and which node this launcher is.

Clusters start one ``falconext launch`` per node with the same torchrun options (``srun``
runs the same command everywhere). From those options alone (:func:`parse`, pure) each
launcher learns how many nodes the job wants (``--nnodes N`` or ``MIN:MAX``), how they meet
(``--rdzv-backend``/``--rdzv-endpoint`` or ``--master-addr``/``--master-port``), and, with
one look at this machine's addresses (:func:`is_local_address`), whether it is the node
that hosts the rendezvous: that node alone starts falconext's control plane.

torch's c10d rendezvous decides whether a node hosts its store by comparing the endpoint
with the machine's host name; a node whose cluster address is not what its host name
resolves to (a container, a second interface, the ``falconext nodes`` bed) would never host
it, and every node would wait for a store nobody started. :func:`torchrun_additions` says
so explicitly (``--rdzv-conf is_host=...``) and pins each node's ``--local-addr`` to the
address it reaches the endpoint from, which also orders the nodes' ranks by address.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import subprocess
from dataclasses import dataclass

from falconext.inputs import InputError, option as _opt


@dataclass(frozen=True)
class Rendezvous:
    """The multi-node part of a torchrun command line (pure data)."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    node_rank: int | None
    backend: str
    endpoint_host: str | None
    endpoint_port: int | None
    rdzv_id: str
    conf: dict[str, str]

    @property
    def multi_node(self) -> bool:
        """True when more than one launcher takes part (``--nnodes`` above 1)."""
        return self.max_nodes > 1

    @property
    def elastic(self) -> bool:
        """True for a dynamic rendezvous (c10d, etcd): nodes join and leave by round."""
        return self.backend != "static"


def parse_nnodes(text: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` as (min, max); InputError naming the value otherwise."""
    parts = text.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        lo, hi = 0, -1
    if not 1 <= lo <= hi:
        raise InputError(f"--nnodes {text!r}: expected N or MIN:MAX with 1 <= MIN <= MAX")
    return lo, hi


def parse_conf(text: str | None) -> dict[str, str]:
    """``--rdzv-conf k1=v1,k2=v2`` as a dict; InputError for an item without ``=``."""
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise InputError(f"--rdzv-conf {text!r}: expected key=value pairs separated by commas")
        out[key.strip()] = value.strip()
    return out


def parse(opts: list[str]) -> Rendezvous:
    """The job's node layout from torchrun's options (canonical ``--dashed`` names, as
    :func:`falconext.megatron_lm.launcher.split_command` keeps them). Pure."""
    lo, hi = parse_nnodes(_opt(opts, "--nnodes") or "1")
    nproc_text = _opt(opts, "--nproc-per-node") or "1"
    try:
        nproc = int(nproc_text)
    except ValueError:
        raise InputError(f"--nproc-per-node {nproc_text!r}: falconext launch needs a number of processes") from None
    node_rank_text = _opt(opts, "--node-rank")
    try:
        node_rank = None if node_rank_text is None else int(node_rank_text)
    except ValueError:
        raise InputError(f"--node-rank {node_rank_text!r}: expected an integer") from None
    backend = _opt(opts, "--rdzv-backend") or "static"
    endpoint = _opt(opts, "--rdzv-endpoint")
    host: str | None
    port: int | None
    if endpoint:
        host, port = split_endpoint(endpoint)
    else:
        host = _opt(opts, "--master-addr")
        port_text = _opt(opts, "--master-port")
        port = int(port_text) if port_text and port_text.isdigit() else None
    if "--standalone" in opts:
        backend, host = "c10d", "localhost"
    return Rendezvous(lo, hi, nproc, node_rank, backend, host, port, _opt(opts, "--rdzv-id") or "none",
                      parse_conf(_opt(opts, "--rdzv-conf")))


def split_endpoint(endpoint: str) -> tuple[str, int | None]:
    """``host[:port]`` (``[v6]:port`` too) as (host, port or None)."""
    text = endpoint.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.lstrip(":")
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:
        host, port = text, ""
    if not host:
        raise InputError(f"--rdzv-endpoint {endpoint!r}: no host")
    if port and not port.isdigit():
        raise InputError(f"--rdzv-endpoint {endpoint!r}: the port must be a number")
    return host, (int(port) if port else None)


def is_local_address(host: str) -> bool:
    """Whether ``host`` names an address of this machine (one this process can bind)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


def address_toward(host: str, port: int | None) -> str | None:
    """The local address this machine reaches ``host`` from (no packet is sent), or None."""
    try:
        infos = socket.getaddrinfo(host, port or 9, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(addr)
                return s.getsockname()[0]
        except OSError:
            continue
    return None


#: where :func:`route_address` aims (TEST-NET-2: never sent to, only routed)
ROUTE_PROBE = "198.51.100.1"


def is_loopback(addr: str) -> bool:
    """Whether ``addr`` is a loopback address (127.0.0.0/8, ::1); False for a name."""
    try:
        return ipaddress.ip_address(addr.split("%")[0]).is_loopback
    except ValueError:
        return False


def route_address() -> str | None:
    """This machine's address on its default route (no packet is sent), or None."""
    return address_toward(ROUTE_PROBE, 9)


def global_addresses(timeout_s: float = 5.0) -> list[str]:
    """This machine's global IPv4 addresses (``ip -4 -o addr show scope global``), in the
    order ip lists them; [] where that cannot be told."""
    try:
        text = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True,
                              text=True, timeout=timeout_s).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return re.findall(r"\binet (\d+\.\d+\.\d+\.\d+)/", text)


def cluster_address(toward: str | None, given: str | None, route: str | None,
                    others: list[str]) -> tuple[str | None, str | None]:
    """The address this node serves the job from (the control plane's Redis, torchrun's
    ``--local-addr``), and a line saying why when it is not the one it reaches the
    endpoint from (pure). ``given``: the user's ``--local-addr``, which wins. Where the
    endpoint resolves to loopback here (Debian maps the host's own name to 127.0.1.1) the
    other nodes could not reach a loopback address: the address on the default route
    (``route``) is taken, else the first of ``others`` (the host's global addresses)."""
    if given:
        return given, None
    if toward is None or not is_loopback(toward):
        return toward, None
    pick = route if route and not is_loopback(route) else next((a for a in others if not is_loopback(a)), None)
    if pick is None:
        return toward, (f"this host reaches the rendezvous endpoint from {toward} (loopback) and has no other "
                        "address: the other nodes cannot reach its control plane (give --local-addr ADDR)")
    how = "on its default route" if pick == route else "its first global address"
    return pick, (f"this host reaches the rendezvous endpoint from {toward} (loopback: Debian maps a host's own "
                  f"name to 127.0.1.1); the control plane and torchrun's --local-addr use {pick}, this host's "
                  f"address {how} (--local-addr ADDR picks another)")


def hosts_plane(rdzv: Rendezvous, local: bool) -> bool:
    """Whether this launcher starts the job's control plane: the node given ``--node-rank
    0``, else the node that hosts the rendezvous endpoint (``local``: the endpoint is one of
    this machine's addresses). Exactly one node of a job answers True."""
    if not rdzv.multi_node:
        return True
    if rdzv.node_rank is not None and not rdzv.elastic:
        return rdzv.node_rank == 0
    return local


def torchrun_additions(rdzv: Rendezvous, opts: list[str], local: bool, local_addr: str | None) -> list[str]:
    """Options to add to torchrun's for a multi-node c10d job (none given by the user is
    overridden): ``--rdzv-conf is_host=`` from ``local``, and ``--local-addr``."""
    if not rdzv.multi_node or rdzv.backend != "c10d":
        return []
    extra: list[str] = []
    if "is_host" not in rdzv.conf:
        conf = dict(rdzv.conf, is_host="1" if local else "0")
        extra += ["--rdzv-conf", ",".join(f"{k}={v}" for k, v in conf.items())]
    if local_addr and _opt(opts, "--local-addr") is None:
        extra += ["--local-addr", local_addr]
    return extra
