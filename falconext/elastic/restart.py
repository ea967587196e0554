"""Restarts of a multi-node job through TorchElastic: the rules, as pure functions and data.

falconext keeps no restart loop of its own for a job of several launchers. An S4 "without
node X" stops every rank at the agreed iteration through Megatron-LM's exit path (its
checkpoint saved); then

- the ranks of node X exit 0 after the node's local rank 0 wrote ``nodes/<host>/leave.json``
  (:func:`leave_path`); node X's launcher sees it, stops its agent (so X never joins the
  next round), notes that it has (``nodes/<host>/left.json``), runs
  ``--falcon-on-exclude`` and exits 0 with one line saying why;
- the ranks of the nodes that stay wait for that note (:func:`wait_left`), then exit
  with :data:`RESTART_EXIT`, which their elastic agents read as a failed worker group:
  each agent restarts its workers in a new rendezvous round (``--max-restarts``, which
  falconext sets when the user did not), and the new workers resume with ``--load`` from
  the checkpoint.

The next round forms with a spare node where one waits (its launcher joined after the
job started training; torch keeps it in the rendezvous's redundancy list, out of the
job, until a round has room), else with fewer nodes when the job can shrink with its
global batch unchanged (:func:`falconext.mitigate.room.shrink_floor`: torchrun is given
``--nnodes FLOOR:N``). The controller refuses an exclusion the job cannot absorb
(:class:`falconext.mitigate.room.RestartRoom`), so falconext never stops a job that could go on.
"""

from __future__ import annotations

import glob
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
#: written by a leaving node's launcher once its agent has stopped
LEFT_FILE = "left.json"


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


def _mark(out: str, host: str, name: str) -> None:
    path = os.path.join(out, "nodes", host, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"time": time.time()}, f)


#: written by a launcher that refused the job (another rendezvous id): the job's other
#: launchers stop rather than wait for it
REFUSED_FILE = "refused.json"


def write_refusal(out: str, host: str, reason: str) -> None:
    """Note that node ``host``'s launcher refused to join the job in ``out``, and why."""
    path = os.path.join(out, "nodes", host, REFUSED_FILE)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"host": host, "reason": reason, "time": time.time()}, f)
    os.replace(tmp, path)


def refusals(out: str, since: float) -> list[tuple[str, str]]:
    """(host, reason) of every launcher that refused the job in ``out`` at ``since`` or later."""
    found = []
    for path in sorted(glob.glob(os.path.join(out, "nodes", "*", REFUSED_FILE))):
        try:
            with open(path) as f:
                data: Any = json.load(f)
            if float(data["time"]) >= since:
                found.append((str(data["host"]), str(data["reason"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def mark_joined(out: str, host: str) -> None:
    """Note that node ``host``'s ranks train (a spare that joined is one no longer)."""
    _mark(out, host, JOINED_FILE)


def joined(out: str, host: str) -> bool:
    """Whether node ``host``'s ranks have trained in this job."""
    return os.path.exists(os.path.join(out, "nodes", host, JOINED_FILE))


def mark_left(out: str, host: str) -> None:
    """Note that leaving node ``host``'s agent has stopped (it can join no round)."""
    _mark(out, host, LEFT_FILE)


def wait_left(out: str, hosts: list[str], deadline_s: float, poll_s: float = 0.2) -> list[str]:
    """Wait until every leaving node of ``hosts`` has stopped its agent, at most
    ``deadline_s``; returns the hosts that had not by then (empty: all had).

    Why the ranks that stay wait for it before they exit for the restart: once they exit,
    their agents enter the next rendezvous round, and an agent whose workers still run
    restarts them to admit the nodes it sees waiting (TorchElastic's scale-up). The
    leaving node's agent, its workers still finishing their exit, would then take the
    place meant for a spare in the next round, and be stopped by its launcher a moment
    later, failing that round."""
    stop = time.monotonic() + deadline_s
    while True:
        missing = [h for h in hosts if not os.path.exists(os.path.join(out, "nodes", h, LEFT_FILE))]
        if not missing or time.monotonic() >= stop:
            return missing
        time.sleep(poll_s)
