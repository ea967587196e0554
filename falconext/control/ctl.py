"""``falconext ctl --run DIR COMMAND``: see and steer a running job.

DIR is the run directory of ``falconext train`` (``--out``) or ``falconext launch``
(``--falcon-out``). Its ``access.json`` (mode 0600, written by the control plane) names
the job and its Redis URL; the password never appears on a command line. Reading goes
through the controller's status snapshot (a Redis key it refreshes every second) and
``events.jsonl``; commands go on the controller's ``ctl`` stream, each an operator
command (:data:`~falconext.protocol.commands.OperatorCommand`) with an id, and the
controller answers with a :class:`CommandReply` under that id. Every wait here has a deadline. A problem is one line (:class:`CtlError`):
a directory that is not a run, a job that has ended or does not answer, a password that
Redis refuses; a command the controller refuses is :class:`Refused`, with its reason.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import redis

from falconext.control.shards import home
from falconext.control.client import CONTROLLER_KEY, CTL_STREAM, STATUS_KEY, reply_key
from falconext.control.snapshot import TABLE_FILE
from falconext.protocol.base import MessageError
from falconext.protocol.codec import MAX_STATUS_BYTES, decode, encode
from falconext.protocol.commands import OperatorCommand
from falconext.protocol.messages import CommandReply, StatusSnapshot
from falconext.control.plane import ACCESS_FILE
from falconext.inputs import InputError

#: seconds a Redis call may take before the job counts as not answering
SOCKET_TIMEOUT_S = 1.0
#: a status snapshot older than this says the controller is not running
STALE_STATUS_S = 5.0
#: how long ``ctl`` waits for the controller's reply to a command
REPLY_TIMEOUT_S = 5.0
POLL_S = 0.05


class CtlError(InputError):
    """The run cannot be reached or read: one line, exit status 2."""


class Refused(Exception):
    """The controller refused the command (the reason is the message): exit status 1."""


@dataclass(frozen=True)
class Run:
    """A running job as ``access.json`` describes it."""

    dir: str
    job: str
    url: str
    world: int

    @property
    def events_path(self) -> str:
        """The run's event log (events.jsonl in its directory)."""
        return os.path.join(self.dir, "events.jsonl")


def read_table(run: Run) -> str:
    """The whole table the controller wrote on a ``table`` command (CSV text); CtlError
    when it is not there or not readable."""
    path = os.path.join(run.dir, TABLE_FILE)
    try:
        with open(path) as f:
            return f.read()
    except OSError as exc:
        raise CtlError(f"{path}: the controller's table cannot be read ({exc.strerror or exc})") from None


def open_run(directory: str) -> Run:
    """The running job of run directory ``directory``; CtlError when it is not a run, the
    job has ended, or the access file is not private or not readable."""
    if not os.path.isdir(directory):
        raise CtlError(f"{directory}: not a directory")
    path = os.path.join(directory, ACCESS_FILE)
    if not os.path.exists(path):
        raise CtlError(f"{directory}: not a falconext run with a control plane (no {ACCESS_FILE}; give the --out of "
                       "falconext train or the --falcon-out of falconext launch)")
    try:
        st = os.stat(path)
        with open(path) as f:
            info = json.load(f)
    except PermissionError:
        raise CtlError(f"{path}: no permission to read it (it belongs to the job's owner)") from None
    except (OSError, ValueError) as exc:
        raise CtlError(f"{path}: unreadable ({exc})") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CtlError(f"{path}: readable by others (mode {stat.S_IMODE(st.st_mode):o}); refusing to use its password")
    if not isinstance(info, dict) or not isinstance(info.get("job"), str):
        raise CtlError(f"{path}: not an access file (no job name)")
    if info.get("ended") is not None:
        ended = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["ended"])))
        raise CtlError(f"{directory}: the job has ended (at {ended})")
    if not isinstance(info.get("url"), str):
        raise CtlError(f"{path}: no Redis URL in it")
    return Run(directory, info["job"], info["url"], int(info.get("world") or 0))


class Session:
    """One operator's connection to a job's Redis (auth checked at once)."""

    def __init__(self, run: Run) -> None:
        self.run = run
        url, self.prefix = home(run.url, run.job)  # the job's own keys (a cluster: shard 0)
        self._redis = redis
        self.client = redis.Redis.from_url(url, socket_timeout=SOCKET_TIMEOUT_S,
                                           socket_connect_timeout=SOCKET_TIMEOUT_S, health_check_interval=0)
        self._call(self.client.ping)

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        redis = self._redis
        try:
            return fn(*args, **kwargs)
        except redis.AuthenticationError as exc:
            raise CtlError(f"{self.run.dir}: Redis refused the password in {ACCESS_FILE} ({exc})") from None
        except redis.ResponseError as exc:
            if "WRONGPASS" in str(exc) or "NOAUTH" in str(exc):
                raise CtlError(f"{self.run.dir}: Redis refused the password in {ACCESS_FILE} ({exc})") from None
            raise CtlError(f"{self.run.dir}: Redis refused the request ({exc})") from None
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            raise CtlError(f"{self.run.dir}: the job is not running (its Redis does not answer: {exc})") from None

    def close(self) -> None:
        """Close the connection to the job's Redis (safe to call twice)."""
        self.client.close()

    def status(self) -> StatusSnapshot:
        """The controller's latest snapshot; CtlError when there is none or it is stale."""
        raw = self._call(self.client.get, self.prefix + STATUS_KEY)
        if raw is None:
            raise CtlError(f"{self.run.dir}: the job is not running (its controller publishes no status)")
        try:
            snap = decode(raw, accept={"StatusSnapshot"}, max_bytes=MAX_STATUS_BYTES)
        except MessageError as exc:
            raise CtlError(f"{self.run.dir}: the controller's status is malformed ({exc})") from None
        age = time.time() - snap.time
        if age > STALE_STATUS_S:
            raise CtlError(f"{self.run.dir}: the job is not running (its controller's status is {age:.0f} s old)")
        return snap

    def send(self, request: OperatorCommand, timeout_s: float = REPLY_TIMEOUT_S) -> CommandReply:
        """Post one operator command (with an id of its own) and wait (``timeout_s`` at
        most) for the reply; Refused when the controller refused it."""
        if not self._call(self.client.exists, self.prefix + CONTROLLER_KEY):
            raise CtlError(f"{self.run.dir}: the job is not running (no live controller)")
        cid = secrets.token_hex(8)
        cmd = replace(request, id=cid)
        self._call(self.client.xadd, self.prefix + CTL_STREAM, {"m": encode(cmd)}, maxlen=10000, approximate=True)
        deadline = time.monotonic() + timeout_s
        key = self.prefix + reply_key(cid)
        while time.monotonic() < deadline:
            raw = self._call(self.client.get, key)
            if raw is not None:
                try:
                    rep = decode(raw, accept={"CommandReply"})
                except MessageError as exc:
                    raise CtlError(f"{self.run.dir}: the controller's reply is malformed ({exc})") from None
                if not rep.ok:
                    raise Refused(f"refused: {rep.text}")
                return rep
            time.sleep(POLL_S)
        raise CtlError(f"{self.run.dir}: the controller did not answer {request.KIND!r} within {timeout_s:g} s")


# --- events.jsonl -------------------------------------------------------------------------


class EventTail:
    """``events.jsonl`` read from an offset: whole lines only, unparsable ones skipped."""

    def __init__(self, path: str, from_end: bool = False) -> None:
        self.path = path
        self.offset = os.path.getsize(path) if from_end and os.path.exists(path) else 0
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        """The events written since the last read (none while the log does not exist)."""
        if not os.path.exists(self.path):
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        data, self._partial = self._partial + data, b""
        lines = data.split(b"\n")
        self._partial = lines.pop()  # b"" when the data ended with a newline
        out = []
        for line in lines:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict):
                out.append(ev)
        return out

    def wait_for(self, pred: Callable[[dict[str, Any]], bool], timeout_s: float) -> dict[str, Any] | None:
        """The first new event that ``pred`` accepts, or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            for ev in self.read():
                if pred(ev):
                    return ev
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)


def format_event(ev: dict[str, Any]) -> str:
    """One line for people: the time, the type, then its fields (nested ones as JSON)."""
    t = ev.get("time")
    when = time.strftime("%H:%M:%S", time.localtime(t)) + f".{int((t % 1) * 1000):03d}" \
        if isinstance(t, (int, float)) else "?"
    parts = []
    for k, v in ev.items():
        if k in ("time", "type"):
            continue
        text = v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))
        if len(text) > 120:
            text = text[:117] + "..."
        parts.append(f"{k}={text}")
    return f"{when} {ev.get('type', '?'):<20} {' '.join(parts)}".rstrip()


def follow_events(directory: str, follow: bool, timeout_s: float | None) -> Iterator[dict[str, Any]]:
    """The run's events; with ``follow``, then new ones until the job ends (its access
    file says so, or its launcher is gone) or ``timeout_s`` passes."""
    path = os.path.join(directory, "events.jsonl")
    if not os.path.isdir(directory) or not (os.path.exists(path) or os.path.exists(os.path.join(directory, ACCESS_FILE))):
        raise CtlError(f"{directory}: not a falconext run (no events.jsonl)")
    tail = EventTail(path)
    yield from tail.read()
    if not follow:
        return
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while deadline is None or time.monotonic() < deadline:
        time.sleep(0.2)
        yield from tail.read()
        if _ended(directory):
            yield from tail.read()
            return


def _ended(directory: str) -> bool:
    """The job is over: its access file says so, is gone, or names a launcher that is no
    longer alive (a launcher killed outright marks nothing)."""
    try:
        with open(os.path.join(directory, ACCESS_FILE)) as f:
            info = json.load(f)
        if info.get("ended") is not None:
            return True
        pid = info.get("launcher_pid")
        if isinstance(pid, int) and pid > 0:
            os.kill(pid, 0)
        return False
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    except (OSError, ValueError, AttributeError):
        return True


# --- status for people ----------------------------------------------------------------------


def format_status(s: StatusSnapshot) -> str:
    """``ctl status`` as a few lines and a per-rank table."""
    p = s.plan
    shape = f"TP{p.get('tp') or '?'} x DP{p.get('dp') or '?'} x PP{p.get('pp') or '?'}"
    lines = [f"job {s.job}: {s.world} ranks on {p.get('nodes')} node(s), {shape}; controller {s.state}"
             f"{' (MUTED)' if s.muted else ''}, session {s.session}"]
    micro = p.get("microbatches")
    if micro is None and p.get("even") is not None:  # a large job: too many replicas to list
        micro = "even" if p["even"] else "uneven"
    lines.append(f"plan in force: micro-batches per replica {micro if micro is not None else 'unknown'}"
                 f"{' (even)' if p.get('even') and not isinstance(micro, str) else ''}; roles {_roles_line(p)}")
    if s.episode is not None:
        e = s.episode
        lines.append(f"episode: {e['trigger']} from iteration {e.get('onset')}, reported by ranks {e['reporters']}, "
                     f"localized {e['localized']}")
    pl = s.planner or {}
    restarts = f"; restarts so far {pl['restarts']}" if pl.get("restarts") else ""
    if s.planner is not None and "root_cause" not in pl and pl.get("current") == "S4":  # after a restart
        removed = pl.get("slowdown_removed")
        lines.append(f"planner: the restart (S4) is in force against a fail-slow of {pl.get('slow_s')} s/iter "
                     f"(healthy {pl.get('healthy_s')})"
                     + (f"; slowdown removed {removed}" if removed is not None else "") + restarts)
    elif s.planner is not None and "root_cause" in pl:
        removed = pl.get("slowdown_removed")
        lines.append(f"planner: {pl.get('root_cause')} fail-slow of GPUs {pl.get('gpus')} links {pl.get('links')}; "
                     f"in force {pl.get('current')}, slow impact so far {float(pl.get('impact_s') or 0):.2f} s, "
                     f"next {pl.get('next') or 'nothing'}"
                     + (f" (pending {pl['pending']})" if pl.get("pending") else "")
                     + (f"; slowdown removed {removed}" if removed is not None else "") + restarts)
    else:
        lines.append("planner: no fail-slow in hand (next: nothing)" + restarts)
    if s.config:
        lines.append("thresholds changed: " + ", ".join(f"{k}={v}" for k, v in sorted(s.config.items())))
    if s.last_event:
        lines.append("latest event: " + format_event(s.last_event))
    lines.append(f"{'rank':>4} {'node':>4} {'iter':>6} {'s/iter':>8} {'est s/it':>8} {'score':>7} {'late s':>8} "
                 f"{'replica':>7} {'micro':>5} {'role':>4} {'age s':>6}")
    if s.summary is not None and s.summary.get("listed", 0) < s.summary.get("ranks", 0):
        lines.append(f"the {s.summary['listed']} slowest of {s.summary['ranks']} ranks (by score); all ranks: "
                     f"iterations {s.summary['iteration_min']}..{s.summary['iteration_max']}, s/iter median "
                     f"{s.summary['iter_s_median']:.4f} max {s.summary['iter_s_max']:.4f}")
    for r, row in sorted(s.ranks.items(), key=lambda kv: int(kv[0])):
        score = "-" if row.get("score") is None else f"{row['score']:.3f}"
        late = "-" if row.get("late_s") is None else f"{row['late_s']:.4f}"
        lines.append(f"{r:>4} {row['node']:>4} {row['iteration']:>6} {row['iter_s']:>8.4f} {row['est_iter_s']:>8.4f} "
                     f"{score:>7} {late:>8} {row['replica']:>7} {row['micro']:>5} {row['role']:>4} {row['age_s']:>6.2f}")
    return "\n".join(lines)


def _roles_line(plan: dict[str, Any]) -> str:
    """The status's roles: listed (a small job), else whether they are the launch order."""
    if plan.get("roles") is not None or plan.get("roles_in_order") is None:
        return str(plan.get("roles"))
    return "in launch order" if plan["roles_in_order"] else "reordered (S3)"


def parse_counts(text: str, what: str) -> list[int]:
    """``"3,5,4"`` -> [3, 5, 4]: whole numbers >= 0 (the controller checks the rest:
    length, sum, at least one micro-batch each, a permutation)."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part.lstrip("-").isdigit():
            raise CtlError(f"{what} must be whole numbers separated by commas (e.g. 3,5,4,4), got {text!r}")
        n = int(part)
        if n < 0:
            raise CtlError(f"{what} must not hold a negative count, got {n} in {text!r}")
        out.append(n)
    return out
