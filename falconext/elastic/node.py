"""One node's ``falconext launch`` in a job of several launchers (one per node).

Every node runs the same command. The node that hosts the rendezvous starts the job's
control plane; the others find it (:mod:`falconext.elastic.join`). Each node then runs
torchrun, whose elastic agent does what TorchElastic does for any job: it meets the other
nodes' agents in a rendezvous round, starts the node's workers, and when they stop for a
restart (:data:`~falconext.elastic.restart.RESTART_EXIT`) starts them again in a new round.
This launcher adds three things around its agent, and no restart loop:

- **a spare waits outside the job**: a launcher given ``--node-rank K`` with ``K`` at least
  the job's node count is a spare. It waits until the job trains, then starts its agent,
  which torch keeps in the rendezvous's redundancy list until a round has room; meanwhile
  it keeps a ``spare:<host>`` key alive on the plane, so the controller knows a spare waits;
- **a node that is excluded leaves**: when the node's ranks leave ``nodes/<host>/leave.json``
  (an S4 without this node), the launcher stops its agent before it can join the next
  round, runs ``--falcon-on-exclude`` with the host's name, and exits 0 with one line;
- **the node that started the plane** stops it when its agent is done and writes the summary.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

from falconext.control.shards import open_bus
from falconext.control.service import SPARE_PREFIX
from falconext.elastic import restart
from falconext.elastic.join import read_access
from falconext.elastic.processes import stop_groups
from falconext.elastic.supervisor import plane_teller
from falconext.inputs import InputError

#: how often the launcher looks for its node's leave file and refreshes its spare key, seconds
POLL_S = 0.5
#: a spare's key lives this long unless refreshed
SPARE_TTL_S = 10.0
#: once a node's leave file is there, how long its ranks get to exit before the agent is stopped
LEAVE_GRACE_S = 5.0
#: a refusal written this long before this launcher started its agent still counts (the
#: launchers of one job start within moments of each other; older notes are other jobs')
REFUSAL_WINDOW_S = 120.0
#: how long a node whose agent failed without ever training waits for the job's end to be
#: marked (the head's launcher marks it once its own agent is done and the plane stopped)
JOB_END_WAIT_S = 30.0
#: how long the agent gets to stop after SIGTERM before SIGKILL, seconds (an agent waiting
#: in torch's exit barrier, a blocking store call, only sees SIGTERM when that returns)
STOP_GRACE_S = 5.0


@dataclass
class NodeRun:
    """What one node's launcher needs: its name, the run directory, torchrun's command
    line and environment, the plane's URL and job (None: no plane), whether this node is
    a spare, and the ``--falcon-on-exclude`` command (None: none) with its time limit."""

    name: str
    out: str
    cmd: list[str]
    env: dict[str, str]
    url: str | None
    job: str
    spare: bool
    on_exclude: str | None = None
    on_exclude_timeout_s: float = 60.0


def run_node(run: NodeRun) -> int:
    """Run this node's agent until the job is over for this node; returns 0 when the job
    succeeded or this node left it (excluded, or a spare the job never needed), else
    raises InputError with one line."""
    if run.spare:
        if not _wait_until_training(run):
            print(f"falconext: spare node {run.name}: the job ended before it was needed", flush=True)
            return 0
        print(f"falconext: spare node {run.name} waits in the rendezvous", flush=True)
    stop = threading.Event()
    keeper = threading.Thread(target=_keep_spare_key, args=(run, stop), daemon=True) if run.spare else None
    if keeper is not None:
        keeper.start()
    started = time.time()
    proc = subprocess.Popen(run.cmd, env=run.env, start_new_session=True)
    leave = None
    refused: list[tuple[str, str]] = []
    training = False
    try:
        while proc.poll() is None:
            leave = leave or restart.read_leave(run.out, run.name)
            if leave is not None:
                _stop_agent(proc)
                break
            # until the job trains, a launcher that refused it (another --rdzv-id) is a node
            # the rendezvous would wait for until torch's timeout: stop now, saying why
            training = training or _job_training(run)
            refused = [] if training else restart.refusals(run.out, started - REFUSAL_WINDOW_S)
            if refused:
                stop_groups([proc], STOP_GRACE_S)
                break
            time.sleep(POLL_S)
    except BaseException:
        _stop_agent(proc)
        raise
    finally:
        stop.set()
    code = proc.wait()
    if refused:
        host, why = refused[0]
        raise InputError(f"node {host} refused this job, so it cannot form: {why}")
    leave = leave or restart.read_leave(run.out, run.name)
    if leave is not None:
        restart.mark_left(run.out, run.name)  # the nodes that stay may go on to the next round
    _tell_plane(run, "agent_exited", host=run.name, code=code, left=leave is not None)
    if leave is not None:
        print(f"falconext: node {run.name} leaves the job at iteration {leave.iteration}: {leave.reason}", flush=True)
        if run.on_exclude:
            on_exclude(run, run.on_exclude.replace("{host}", shlex.quote(run.name)))
        return 0
    if code != 0:
        # a node whose ranks never trained (a spare, or the launcher the rendezvous kept
        # waiting) loses the c10d store when the job's head exits, a moment before that
        # head's launcher marks the job ended: wait for that mark before calling it a failure
        if not restart.joined(run.out, run.name) and _wait_job_ended(run, JOB_END_WAIT_S):
            print(f"falconext: {'spare ' if run.spare else ''}node {run.name}: the job ended before it was needed",
                  flush=True)
            return 0
        raise InputError(f"training failed on node {run.name} (torchrun exit status {code}); see the messages above")
    return 0


def _stop_agent(proc: subprocess.Popen) -> None:
    """Stop a leaving node's agent as soon as its workers are gone (at most LEAVE_GRACE_S
    for them to exit), with SIGKILL: it has nothing left to do, waits in torch's exit
    barrier (a blocking store call that defers SIGTERM), and must not join the next round.
    Workers still there after the grace are stopped with the agent
    (:func:`falconext.elastic.processes.stop_groups`: SIGTERM, SIGKILL after STOP_GRACE_S)."""
    stop = time.monotonic() + LEAVE_GRACE_S
    while proc.poll() is None and _children(proc.pid) != [] and time.monotonic() < stop:
        time.sleep(0.1)
    if proc.poll() is None and _children(proc.pid) == []:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
    stop_groups([proc], STOP_GRACE_S)


def _children(pid: int) -> list[int] | None:
    """The child processes of ``pid`` (Linux /proc), or None where that cannot be told
    (no such process, or a kernel without /proc/PID/task/TID/children)."""
    kids: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(k) for k in f.read().split()]
    except (OSError, ValueError):
        return None
    return kids


def _job_ended(run: NodeRun) -> bool:
    """Whether the job's plane says the job is over (access.json ended)."""
    data = read_access(run.out)
    return data is not None and data.get("ended") is not None


def _wait_job_ended(run: NodeRun, deadline_s: float) -> bool:
    """Whether the job's plane says the job is over, waiting at most ``deadline_s`` for it
    (no plane: nothing to wait for, False)."""
    if run.url is None:
        return False
    end = time.monotonic() + deadline_s
    while not _job_ended(run):
        if time.monotonic() >= end:
            return False
        time.sleep(POLL_S)
    return True


def _wait_until_training(run: NodeRun) -> bool:
    """A spare waits until the job trains (its rank 0 wrote run.json after the plane
    started) and returns True, or False when the job ended first. Waits without a
    deadline, as a spare does: the job's own end releases it."""
    while True:
        if _job_ended(run):
            return False
        if _job_training(run):
            return True
        time.sleep(POLL_S)


def _job_training(run: NodeRun) -> bool:
    """Whether the job trains: its rank 0 wrote run.json after the plane started."""
    data = read_access(run.out)
    started = data.get("started") if data is not None else None
    try:
        with open(os.path.join(run.out, "run.json")) as f:
            clock = json.load(f).get("clock", {}).get("time")
    except (OSError, ValueError, AttributeError):
        clock = None
    return isinstance(started, (int, float)) and isinstance(clock, (int, float)) and clock >= started


def _keep_spare_key(run: NodeRun, stop: threading.Event) -> None:
    """Keep ``spare:<host>`` alive on the plane until this node's ranks train (or stop)."""
    if not run.url:
        return
    try:
        bus = open_bus(run.url, run.job)
    except Exception:  # noqa: BLE001 - no plane: nobody to tell
        return
    try:
        while not stop.is_set() and not restart.joined(run.out, run.name):
            bus.put(SPARE_PREFIX + run.name, "waiting", SPARE_TTL_S)
            stop.wait(SPARE_TTL_S / 3)
        bus.put(SPARE_PREFIX + run.name, "joined", 0.001)
    finally:
        bus.close()


def on_exclude(run: NodeRun, command: str) -> None:
    """Run ``--falcon-on-exclude``'s ``command`` (the host already in it) in a shell, at
    most ``on_exclude_timeout_s``; its status and output's tail go to the job's events
    (through the plane) and one line here. Never raises."""
    status: int | str
    try:
        done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=run.on_exclude_timeout_s)
        status, output = done.returncode, (done.stdout + done.stderr)[-2000:]
    except subprocess.TimeoutExpired as exc:
        status = "timeout"
        output = ((exc.stdout or b"") + (exc.stderr or b"")).decode(errors="replace")[-2000:] \
            if isinstance(exc.stdout, bytes) else str(exc.stdout or "")[-2000:]
    except OSError as exc:
        status, output = "error", str(exc)
    ok = status == 0
    print(f"falconext: --falcon-on-exclude for {run.name}: "
          + ("done" if ok else f"failed ({'timed out after %gs' % run.on_exclude_timeout_s if status == 'timeout' else f'status {status}'})"),
          flush=True)
    _tell_plane(run, "on_exclude", host=run.name, command=command, status=status, output=output)


def _tell_plane(run: NodeRun, type_: str, **fields: object) -> None:
    """Post one event for the job's events.jsonl to the controller (best effort)."""
    tell = plane_teller(run.url, run.job)
    if tell is not None:
        tell(type_, **fields)
