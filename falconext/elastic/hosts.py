"""Which node a process runs on: its name, and on the emulated nodes bed the node (hardware)
it stands for and how many nodes share the machine. Environment names only; no I/O."""

from __future__ import annotations

import os
import socket

#: the environment variable naming a node (falconext's node name: the host name otherwise)
NODE_NAME_ENV = "FALCONEXT_NODE_NAME"
#: the number of emulated nodes sharing this machine (set by the bed: launchers pick the
#: emulated device's speed from the ranks all of them run on this host's cores)
NODES_ON_HOST_ENV = "FALCONEXT_NODES_ON_HOST"
#: the emulated node (its network namespace) a rank runs on, set by the bed's launcher
HARDWARE_NODE_ENV = "FALCON_NETNS_NODE"


def node_name(environ: dict[str, str] | None = None) -> str:
    """This node's name: ``FALCONEXT_NODE_NAME`` where the bed (or a user) set it, else the
    host name. Files and events name nodes by it."""
    env = os.environ if environ is None else environ
    return env.get(NODE_NAME_ENV) or socket.gethostname()
