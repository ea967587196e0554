"""free_port: below the kernel's ephemeral range (a port from the range was taken by a job
running beside before the test's workers bound it: EADDRINUSE, 2026-11-27), never the same
port twice in a process (CI: torchrun's port, picked first and not yet bound, was handed to
Redis next), and never one that is in use."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from falconext import ports


class _Sock:
    """A socket whose bind(0) gets the next port of a script."""

    script: list[int] = []

    def __init__(self, *args) -> None:
        self.port = 0

    def __enter__(self) -> "_Sock":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def bind(self, addr) -> None:
        self.port = _Sock.script.pop(0)

    def getsockname(self):
        return ("127.0.0.1", self.port)


def test_without_room_below_the_range_a_port_the_kernel_gives_again_is_not_handed_out_twice(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_pool", lambda: range(0))  # the ephemeral range starts at 1024
    monkeypatch.setattr(ports, "_HANDED", set())
    monkeypatch.setattr(socket, "socket", _Sock)
    _Sock.script = [45771, 45771, 45771, 40002]
    assert ports.free_port() == 45771
    assert ports.free_port() == 40002  # the kernel gave 45771 back twice: skipped
    _Sock.script = [45771] * ports._TRIES
    with pytest.raises(OSError, match="no free port"):
        ports.free_port()


def test_the_range_is_read_from_the_kernel_and_a_bad_file_means_linux_s_default(tmp_path: Path) -> None:
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ports.ephemeral_range(str(f)) == (40000, 50000)
    assert ports._pool(str(f)) == range(40000 - ports.POOL, 40000)
    f.write_text("2000 1000\n")
    assert ports.ephemeral_range(str(f)) == (32768, 60999)
    f.write_text("nonsense")
    assert ports.ephemeral_range(str(f)) == (32768, 60999)
    assert ports.ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)
    f.write_text("1500 60999")
    assert ports._pool(str(f)) == range(1024, 1500)


def test_real_ports_are_below_the_ephemeral_range_distinct_and_bindable() -> None:
    lo, _ = ports.ephemeral_range()
    got = {ports.free_port() for _ in range(20)}
    assert len(got) == 20
    assert all(lo - ports.POOL <= p < lo for p in got), sorted(got)
    with socket.socket() as s:
        s.bind(("127.0.0.1", got.pop()))


def test_a_port_in_use_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_HANDED", set())
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        taken = busy.getsockname()[1]
        with socket.socket() as other:
            other.bind(("127.0.0.1", 0))
            free = other.getsockname()[1]
        picks = iter([taken, taken, free])
        monkeypatch.setattr(ports, "_pool", lambda: range(1024, 65536))
        monkeypatch.setattr(ports._rng, "choice", lambda pool: next(picks))
        got = ports.free_port()
    assert got == free
