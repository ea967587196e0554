"""A private Redis for one training job or one test: random password, no persistence.

The control plane needs a broker that every rank can reach, but nothing else on the
machine should be able to read or inject its messages. So each job gets its own
``redis-server`` with a fresh random password, no snapshots or AOF (a restart starts
from empty streams, which the :class:`~falconext.control.bus.Bus` is written to
survive), and by default a loopback-only bind. A multi-node job passes the cluster
interface's address as ``bind`` explicitly; nothing widens the bind on its own.

The password is fed to ``redis-server -`` on stdin rather than on the command line, so
it shows up neither in ``ps`` nor in a config file on disk.
"""

from __future__ import annotations

import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

import redis

from falconext.control.redis_client import redis_client
from falconext.ports import free_port

LOG_NAME = "redis.log"


class RedisUnavailable(RuntimeError):
    """redis-server is missing, exited at start, or did not answer in time."""


class RedisServer:
    """One running ``redis-server`` process that this Python process owns."""

    def __init__(self, binary: str, port: int, password: str, bind: str, ready_timeout_s: float,
                 cluster: bool = False) -> None:
        self.port = port
        #: a Redis Cluster node (falconext.control.redis_cluster): cluster mode on, its
        #: cluster state in its own folder (kept across restart(), so it rejoins as itself)
        self.cluster = cluster
        self.bus_port: int | None = None  # a cluster node's bus port, chosen at its first start
        self.password = password
        self.bind = bind
        # Clients connect to the first bound address; a wildcard bind is reached on loopback.
        first = bind.split()[0]
        self.host = "127.0.0.1" if first in ("0.0.0.0", "*", "::", "::*") else first
        host_in_url = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"redis://:{quote(password, safe='')}@{host_in_url}:{port}/0"
        self.ready_timeout_s = ready_timeout_s
        self._binary = binary
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The server's process id, or None before :meth:`start`."""
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> Path | None:
        """The server's log file, or None before :meth:`start` made its directory."""
        return self._dir / LOG_NAME if self._dir is not None else None

    def alive(self) -> bool:
        """True while the process this object started is running."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Launch the process and return once an authenticated PING succeeds."""
        if self.alive():
            raise RuntimeError(f"redis-server on port {self.port} is already running (pid {self.pid})")
        if self._dir is None or not self._dir.is_dir():
            self._dir = Path(tempfile.mkdtemp(prefix="falcon-redis-"))
        args = [
            self._binary,
            "-",  # read the rest of the config (the password) from stdin
            "--port", str(self.port),
            "--bind", *self.bind.split(),
            "--protected-mode", "yes",
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--loglevel", "warning",
            "--dir", str(self._dir),
        ]  # fmt: skip
        if self.cluster:
            if self.bus_port is None:
                self.bus_port = free_port(self.host)
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-port", str(self.bus_port),
                     "--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no"]
        with open(self._dir / LOG_NAME, "ab") as log:
            self._proc = subprocess.Popen(
                args, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, cwd=self._dir
            )
        assert self._proc.stdin is not None
        try:
            quoted = _config_quote(self.password)
            config = f'requirepass "{quoted}"\n' + (f'masterauth "{quoted}"\n' if self.cluster else "")
            self._proc.stdin.write(config.encode())
            self._proc.stdin.close()
        except BrokenPipeError:
            pass  # it exited already; _wait_ready reports why from the log
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        client = redis_client(self.url, 0.5)  # this loop polls: no retries of its own
        try:
            while True:
                assert self._proc is not None
                if self._proc.poll() is not None:
                    raise RedisUnavailable(
                        f"redis-server exited with status {self._proc.returncode} at start on {self.bind} port "
                        f"{self.port}; log tail:\n{self.log_tail()}"
                    )
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    self._terminate(signal.SIGKILL)
                    raise RedisUnavailable(
                        f"redis-server on {self.bind} port {self.port} did not answer PING within "
                        f"{self.ready_timeout_s:g} s; log tail:\n{self.log_tail()}"
                    )
                time.sleep(0.01)
        finally:
            client.close()

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the server's log, or ``(no log)`` / ``(empty log)``."""
        path = self.log_path
        if path is None or not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) or "(empty log)"

    def _terminate(self, sig: signal.Signals, wait_s: float = 10.0) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def stop(self) -> None:
        """Shut down cleanly and delete the working directory; safe to call twice."""
        self._terminate(signal.SIGTERM)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def kill(self) -> None:
        """SIGKILL, as a crash would: for tests of clients facing a dead Redis."""
        self._terminate(signal.SIGKILL)

    def restart(self) -> None:
        """Come back on the same port and password (empty: nothing is persisted)."""
        self._terminate(signal.SIGTERM)
        self.start()

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"RedisServer(host={self.host!r}, port={self.port}, pid={self.pid}, alive={self.alive()})"


def start_redis(
    port: int | None = None,
    password: str | None = None,
    bind: str = "127.0.0.1",
    ready_timeout_s: float = 10.0,
    cluster: bool = False,
) -> RedisServer:
    """Start a private redis-server and wait until it answers an authenticated PING.

    ``bind`` stays on loopback unless the caller passes another address (for a
    multi-node job, the cluster interface's address, never a public one). With
    ``port=None`` a free port is picked; since another process could take it before
    Redis binds, that case is retried on a fresh port a few times. ``cluster``: a node
    of a Redis Cluster, started empty (falconext.control.redis_cluster joins it).
    """
    binary = shutil.which("redis-server")
    if binary is None:
        raise RedisUnavailable("redis-server not found on PATH; run launch/setup.sh (apt install redis-server)")
    if password is None:
        password = secrets.token_urlsafe(24)
    _config_quote(password)  # reject an unusable password before starting anything
    attempts = 3 if port is None else 1
    for attempt in range(attempts):
        server = RedisServer(binary, port if port is not None else free_port(bind.split()[0]), password, bind, ready_timeout_s,
                             cluster)
        try:
            server.start()
            return server
        except RedisUnavailable as exc:
            server.stop()
            if attempt + 1 == attempts or "Address already in use" not in str(exc):
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def _config_quote(password: str) -> str:
    """Escape for a double-quoted redis.conf string; control characters are refused."""
    if not password:
        raise ValueError("Redis password must not be empty")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in password):
        raise ValueError("Redis password must not contain control characters (newlines, tabs, ...)")
    return password.replace("\\", "\\\\").replace('"', '\\"')


__all__ = ["RedisServer", "RedisUnavailable", "start_redis"]
