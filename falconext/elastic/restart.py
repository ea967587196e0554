"""Restarts of a multi-node job through TorchElastic: the rules, as pure functions and data.

falconext keeps no restart loop of its own for a job of several launchers. An S4 "without
node X" stops every rank at the agreed iteration through Megatron-LM's exit path (its
checkpoint saved); then

- the ranks of the nodes that stay exit with :data:`RESTART_EXIT`, which their elastic
  agents read as a failed worker group: each agent restarts its workers in a new
  rendezvous round (``--max-restarts``, which falconext sets when the user did not), and
  the new workers resume with ``--load`` from the checkpoint;
- the ranks of node X exit 0 after the node's local rank 0 wrote ``nodes/<host>/leave.json``
  (:func:`leave_path`); node X's launcher sees it, stops its agent (so X never joins the
  next round), runs ``--falcon-on-exclude`` and exits 0 with one line saying why.

The next round forms with a spare node where one waits (its launcher joined after the
job started training; torch keeps it in the rendezvous's redundancy list, out of the
job, until a round has room), else with fewer nodes when the job can shrink with its
global batch unchanged (:func:`falconext.mitigate.room.shrink_floor`: torchrun is given
``--nnodes FLOOR:N``). The controller refuses an exclusion the job cannot absorb
(:class:`falconext.mitigate.room.RestartRoom`), so falconext never stops a job that could go on.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

#: a worker's exit status when it stops for a restart (EX_TEMPFAIL): its agent restarts it
RESTART_EXIT = 75
#: the restarts falconext lets TorchElastic make when the user gave no --max-restarts
DEFAULT_MAX_RESTARTS = 3
#: a leaving node's file, under the run directory's ``nodes/<host>/``
LEAVE_FILE = "leave.json"
#: written by a node's local rank 0 once its ranks train (a spare stops being one)
JOINED_FILE = "joined.json"


@dataclass(frozen=True)
class NodeLeave:
    """Why a node leaves the job (``nodes/<host>/leave.json``)."""

    host: str
    node: int
    iteration: int
    reason: str
    time: float


def leave_path(out: str, host: str) -> str:
    """Where node ``host``'s leave file is."""
    return os.path.join(out, "nodes", host, LEAVE_FILE)


def write_leave(out: str, leave: NodeLeave) -> None:
    """Write ``leave`` whole (a temporary file renamed), for the node's launcher to read."""
    path = leave_path(out, leave.host)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(asdict(leave), f)
    os.replace(tmp, path)


def read_leave(out: str, host: str) -> NodeLeave | None:
    """Node ``host``'s leave file, or None when there is none (or it is not one)."""
    try:
        with open(leave_path(out, host)) as f:
            data: Any = json.load(f)
        return NodeLeave(str(data["host"]), int(data["node"]), int(data["iteration"]), str(data["reason"]),
                         float(data["time"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def mark_joined(out: str, host: str) -> None:
    """Note that node ``host``'s ranks train (a spare that joined is one no longer)."""
    path = os.path.join(out, "nodes", host, JOINED_FILE)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"time": time.time()}, f)


def joined(out: str, host: str) -> bool:
    """Whether node ``host``'s ranks have trained in this job."""
    return os.path.exists(os.path.join(out, "nodes", host, JOINED_FILE))
