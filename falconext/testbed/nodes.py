"""``falconext nodes --count N [--link-mbps M] [--out DIR] -- CMD ...``: a multi-node job on one machine.

Runs ``CMD`` once per emulated node, each in its own network namespace on one bridge with
shaped links (:mod:`falconext.testbed.netns`, the machinery of ``falconext train --net
netns``), as ``srun`` runs one task per node. In ``CMD`` the words ``{node}`` (0..N-1),
``{addr}`` (that node's address) and ``{head}`` (node 0's address) are replaced per node.
Each node's output is streamed with its name in front (``[node1] ...``) and, with
``--out``, kept in ``DIR/node<k>.log``; ``DIR/nodes.json`` lists each node's address and
process id (a test or a user can kill one node to see the job survive it).

Each node's environment names it: ``FALCONEXT_NODE_NAME`` (``node<k>``: the host name a
real cluster would give; falconext's files and events name nodes by it) and
``FALCON_NETNS_NODE`` (``k``: the emulated hardware, which fault files may name), with
gloo bound to the node's veth. Every namespace is removed however the bed ends: the
commands' exit, Ctrl-C, SIGTERM, or a failure to start one of them. The bed's status is
the first failing node's (128 + the signal for one killed by a signal), 0 when every node
ends with 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, Sequence

from falconext.elastic.hosts import NODE_NAME_ENV, NODES_ON_HOST_ENV
from falconext.elastic.processes import stop_groups
from falconext.inputs import InputError
from falconext.testbed import netns

#: once every node's command has been asked to stop, how long before SIGKILL, seconds
STOP_GRACE_S = 15.0


def substitute(cmd: Sequence[str], node: int, addr: str, head: str) -> list[str]:
    """``cmd`` with ``{node}``, ``{addr}`` and ``{head}`` replaced in every word (pure);
    other braces are left as they are."""
    out = []
    for word in cmd:
        out.append(word.replace("{node}", str(node)).replace("{addr}", addr).replace("{head}", head))
    return out


def mbps_to_bytes(mbps: float) -> float:
    """Megabits per second as bytes per second; InputError for a rate that is not > 0."""
    if not mbps > 0 or mbps != mbps or mbps == float("inf"):
        raise InputError(f"--link-mbps must be a positive number, got {mbps}")
    return mbps * 1e6 / 8


@dataclass
class _Node:
    index: int
    name: str
    addr: str
    proc: subprocess.Popen
    pump: threading.Thread


def _pump(stream: IO[bytes], prefix: str, log: IO[bytes] | None) -> None:
    """Copy ``stream`` line by line to stdout with ``prefix`` in front (and to ``log``)."""
    for line in iter(stream.readline, b""):
        if log is not None:
            log.write(line)
            log.flush()
        try:
            sys.stdout.write(prefix + line.decode(errors="replace"))
            sys.stdout.flush()
        except (BrokenPipeError, ValueError):
            pass
    stream.close()
    if log is not None:
        log.close()


def run_nodes(count: int, cmd: Sequence[str], rate: float, out: str | None = None,
              timeout_s: float | None = None) -> int:
    """Run ``cmd`` on ``count`` emulated nodes (see the module); returns the bed's status.
    Raises InputError for what the bed cannot do here (no root, no namespaces, no command)."""
    # lazy: start-up time (redis; the CLI imports this module)
    from falconext.testbed.launch import _signals_raise, fold_exit_codes

    if not cmd:
        raise InputError("no command given (falconext nodes --count N -- CMD ...)")
    if count < 1:
        raise InputError(f"--count must be >= 1, got {count}")
    if os.geteuid() != 0:
        raise InputError("falconext nodes needs root (it creates network namespaces, veths and tc qdiscs)")
    reason = netns.available()
    if reason is not None:
        raise InputError(f"falconext nodes: network namespaces are not available here ({reason})")
    removed = netns.cleanup_stale()
    if removed:
        print(f"falconext nodes: removed {len(removed)} leftover(s) of killed runs", flush=True)
    if out:
        os.makedirs(out, exist_ok=True)
    nodes: list[_Node] = []
    network = None
    with _signals_raise():
        try:
            try:
                network = netns.Network.create(count, rate)
            except (netns.NetnsError, ValueError) as exc:
                raise InputError(f"falconext nodes: could not set up the node namespaces: {exc}") from None
            layout = network.layout
            head = layout.node_ip(0)
            for k in range(count):
                name = f"node{k}"
                argv = network.exec_argv(k, substitute(cmd, k, layout.node_ip(k), head))
                env = dict(os.environ, **layout.node_env(k, rate), **{NODE_NAME_ENV: name, NODES_ON_HOST_ENV: str(count)})
                env.setdefault("PYTHONUNBUFFERED", "1")
                proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
                log = open(os.path.join(out, f"{name}.log"), "wb") if out else None
                pump = threading.Thread(target=_pump, args=(proc.stdout, f"[{name}] ", log), daemon=True)
                pump.start()
                nodes.append(_Node(k, name, layout.node_ip(k), proc, pump))
            if out:
                _write_nodes(out, nodes, rate)
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while any(n.proc.poll() is None for n in nodes):
                if deadline is not None and time.monotonic() > deadline:
                    print(f"falconext nodes: --timeout {timeout_s:g} s passed; stopping every node", flush=True)
                    _stop(nodes)
                    return 124
                time.sleep(0.2)
            for n in nodes:
                n.pump.join(timeout=5)
            code, node = fold_exit_codes([n.proc.returncode for n in nodes])
            if code < 0:  # killed by a signal: the shell's convention, 128 + the signal
                print(f"falconext nodes: node{node} was killed by signal {-code}", flush=True)
                return 128 - code
            if code != 0:
                print(f"falconext nodes: node{node} exited with status {code}", flush=True)
            return code
        finally:
            _stop(nodes)
            if network is not None:
                network.close()


def _write_nodes(out: str, nodes: list[_Node], rate: float) -> None:
    info = {"link_bytes_per_s": rate,
            "nodes": [{"node": n.index, "name": n.name, "addr": n.addr, "pid": n.proc.pid} for n in nodes]}
    with open(os.path.join(out, "nodes.json"), "w") as f:
        json.dump(info, f, indent=2)


def _stop(nodes: list[_Node]) -> None:
    """Stop every node's still-running command (its whole process group): SIGTERM, SIGKILL
    after STOP_GRACE_S."""
    stop_groups([n.proc for n in nodes], STOP_GRACE_S)
