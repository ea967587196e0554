"""A warm parent for many test-bed jobs: ``forkrun`` started as a fork, not a fresh interpreter.

Every ``falconext train`` on one node runs ``python -m falconext.testbed.forkrun``, whose
first 3.6 s (of a 1-iteration job's 5.9 s, on the 2-core test host) go to importing torch
and megatron-core (:mod:`falconext.testbed.rankimports`). A suite that runs twenty jobs
pays that twenty times. The zygote imports them once and serves jobs over a Unix socket:
for each request it forks a *keeper*, which forks the job process itself, which runs
:func:`falconext.testbed.forkrun.main` on the request's arguments exactly as
``python -m falconext.testbed.forkrun`` would (the same torchrun parser, agent and forked
ranks), with the requester's standard streams, working directory, environment and
priority. The keeper reports the job's exit status to the requester, and when the
requester goes away first (killed, interrupted) it stops the job's whole process group:
a job never outlives the launcher that asked for it.

It is a speed-up and nothing else: :func:`run_job` answers None whenever the zygote
cannot serve a request (none named, not reachable, started with other start-up
settings), and the launcher then starts forkrun as a fresh process. Start one with
``python -m falconext.testbed.zygote SOCKET`` and name it to the launchers in
:data:`ZYGOTE_ENV` (the test suite does so for its session, ``tests/conftest.py``).

Protocol: the requester sends one message, a 4-byte big-endian length and a JSON object
``{"argv": [...], "env": {...}, "cwd": str, "nice": int}`` (nothing else accepted), with its
stdin, stdout and stderr passed along (SCM_RIGHTS); the keeper answers one line, ``ok
<exit status>`` (negative: killed by that signal) or ``refused <reason>``. Only a
process of the zygote's own user may connect (SO_PEERCRED), in a private folder.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import struct
import sys
import time
import traceback
from typing import Any

#: the environment variable that names a zygote's socket to ``falconext train``
ZYGOTE_ENV = "FALCONEXT_ZYGOTE"
#: settings read once at interpreter or torch start-up: a job whose environment sets them
#: differently from the zygote's is refused (its launcher then starts a fresh process)
STARTUP_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONWARNINGS", "PYTHONHASHSEED", "PYTHONPATH")
#: the largest request accepted (arguments and environment)
MAX_REQUEST = 1 << 20
#: how long a keeper lets a job's processes end after SIGTERM before SIGKILL
STOP_GRACE_S = 10.0
#: how long a requester waits to be connected and answered "accepted"
CONNECT_TIMEOUT_S = 5.0


class ZygoteError(ValueError):
    """A request that breaks the protocol (one line says how)."""


def parse_request(raw: bytes) -> dict[str, Any]:
    """The request in ``raw`` (JSON), checked field by field; raises ZygoteError naming
    the first problem."""
    try:
        req = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ZygoteError(f"request is not JSON: {exc}") from None
    if not isinstance(req, dict) or set(req) != {"argv", "env", "cwd", "nice"}:
        raise ZygoteError("request must be an object with exactly argv, env, cwd and nice")
    if not isinstance(req["argv"], list) or not all(isinstance(a, str) for a in req["argv"]):
        raise ZygoteError("argv must be a list of strings")
    env = req["env"]
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ZygoteError("env must map strings to strings")
    if not isinstance(req["cwd"], str) or not os.path.isabs(req["cwd"]):
        raise ZygoteError("cwd must be an absolute path")
    if isinstance(req["nice"], bool) or not isinstance(req["nice"], int) or not -20 <= req["nice"] <= 19:
        raise ZygoteError("nice must be an integer in [-20, 19]")
    return req


def startup_mismatch(env: dict[str, str], own: dict[str, str]) -> str | None:
    """The first start-up setting (:data:`STARTUP_ENV`) that ``env`` gives differently
    from ``own`` (the zygote's), as a reason; None when they agree."""
    for key in STARTUP_ENV:
        if env.get(key) != own.get(key):
            return f"{key} is {env.get(key)!r} for the job but {own.get(key)!r} in the zygote"
    return None


# --- the requester (the launcher) ----------------------------------------------------------


def run_job(argv: list[str], env: dict[str, str], path: str | None = None) -> int | None:
    """Run ``forkrun`` with ``argv`` in the zygote at ``path`` (default: the one named in
    :data:`ZYGOTE_ENV`) and wait for it: its exit status as subprocess reports one. None
    when no zygote serves the request (then run it as a fresh process); RuntimeError when
    the keeper went away without an exit status (the job may have run: it is not rerun).
    The job's output goes to this process's own stdout and stderr."""
    path = path or os.environ.get(ZYGOTE_ENV)
    if not path:
        return None
    req = json.dumps({"argv": list(argv), "env": dict(env), "cwd": os.getcwd(),
                      "nice": os.getpriority(os.PRIO_PROCESS, 0)}).encode()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            sock.settimeout(CONNECT_TIMEOUT_S)
            sock.connect(path)
            socket.send_fds(sock, [struct.pack(">I", len(req))], [0, 1, 2])
            sock.sendall(req)
        except OSError:
            return None  # not served: nothing ran
        sock.settimeout(None)  # the job's own length: its launcher's caller sets the deadline
        answer = b""
        try:
            while not answer.endswith(b"\n"):
                chunk = sock.recv(256)
                if not chunk:
                    break
                answer += chunk
        except OSError:
            pass
    finally:
        sock.close()
    word, _, rest = answer.decode(errors="replace").strip().partition(" ")
    if word == "ok" and rest.lstrip("-").isdigit():
        return int(rest)
    if word == "refused":
        return None  # a fresh process serves it
    # the job may have run: running it again would not be the same run
    raise RuntimeError(f"the zygote's keeper went away without the job's exit status (answer {answer!r})")


# --- the zygote ------------------------------------------------------------------------------


def serve(path: str) -> None:
    """Import what forkrun's agent and ranks import, then serve requests on the Unix
    socket ``path`` (its folder must be private) until SIGTERM or SIGINT."""
    # lazy: run-time order (importing forkrun turns the garbage collector off)
    from falconext.testbed import forkrun  # noqa: F401
    # lazy: start-up time (the launcher imports this module for run_job: no torch there)
    import falconext.testbed.rankimports  # noqa: F401
    import torch.distributed.launcher.api  # noqa: F401
    import torch.distributed.run  # noqa: F401

    own = {k: v for k, v in os.environ.items() if k in STARTUP_ENV}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(16)
    stop = False

    def _stop(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    gc.collect()
    gc.freeze()
    print(f"zygote: serving on {path}", flush=True)
    try:
        while not stop:
            try:
                ready, _, _ = select.select([listener], [], [], 0.5)
            except InterruptedError:
                continue
            _reap()
            if not ready:
                continue
            conn, _ = listener.accept()
            if os.fork() == 0:  # the keeper
                listener.close()
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                code = 1
                try:
                    code = _keep(conn, own)
                finally:
                    os._exit(code)
            conn.close()
    finally:
        listener.close()
        try:
            os.unlink(path)
        except OSError:
            pass


def _reap() -> None:
    """Collect keepers that have ended (no zombies)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _keep(conn: socket.socket, own: dict[str, str]) -> int:
    """One request, in its keeper: check it, fork the job, report its exit status; stop
    the job's process group when the requester goes away first."""
    conn.settimeout(CONNECT_TIMEOUT_S)
    try:
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
        if uid != os.getuid():
            raise ZygoteError(f"a process of user {uid} is not served")
        head, fds, _, _ = socket.recv_fds(conn, 4, 3)
        if len(head) != 4 or len(fds) != 3:
            raise ZygoteError("a request starts with its length and three standard streams")
        (n,) = struct.unpack(">I", head)
        if n > MAX_REQUEST:
            raise ZygoteError(f"request of {n} bytes is over {MAX_REQUEST}")
        raw = b""
        while len(raw) < n:
            chunk = conn.recv(n - len(raw))
            if not chunk:
                raise ZygoteError("request cut short")
            raw += chunk
        req = parse_request(raw)
        why = startup_mismatch(req["env"], own)
        if why is not None:
            raise ZygoteError(why)
    except (OSError, ZygoteError, struct.error) as exc:
        try:
            conn.sendall(f"refused {exc}\n".encode())
        except OSError:
            pass
        return 0
    pid = os.fork()
    if pid == 0:  # the job
        conn.close()
        _become_job(req, fds)
    for fd in fds:
        os.close(fd)
    conn.settimeout(None)
    status = _wait_or_stop(pid, conn)
    try:
        conn.sendall(f"ok {status}\n".encode())
    except OSError:
        pass
    return 0


def _become_job(req: dict[str, Any], fds: list[int]) -> None:
    """Turn this fork into ``python -m falconext.testbed.forkrun <argv>``; never returns."""
    code = 1
    try:
        os.setsid()  # its own process group: the keeper stops all of it at once
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
            os.close(fd)
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        os.setpriority(os.PRIO_PROCESS, 0, req["nice"])
        sys.argv = [sys.executable, *req["argv"]]
        # lazy: run-time order (importing forkrun turns the garbage collector off)
        from falconext.testbed import forkrun

        code = forkrun.main(list(req["argv"]))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001  (reported as the fresh process would)
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _wait_or_stop(pid: int, conn: socket.socket) -> int:
    """The job's exit status (negative: the signal that ended it), stopping its process
    group first if the requester hangs up before it ends."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        ready, _, _ = select.select([conn], [], [], 0.2)
        if ready and not conn.recv(1):  # the requester is gone
            return _stop_group(pid)


def _stop_group(pid: int) -> int:
    """SIGTERM to the job's process group, SIGKILL after :data:`STOP_GRACE_S`; its status."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    end = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.killpg(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    try:  # the group's other members (the ranks) too
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return os.waitstatus_to_exitcode(status)


def main(argv: list[str] | None = None) -> int:
    """``python -m falconext.testbed.zygote SOCKET``: serve until stopped."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m falconext.testbed.zygote SOCKET", file=sys.stderr)
        return 2
    serve(args[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
