"""free_port never hands the same port out twice in a process (CI: torchrun's port, picked
first and not yet bound, was handed to Redis next, and torchrun failed with EADDRINUSE)."""

from __future__ import annotations

import socket

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


def test_a_port_the_kernel_gives_again_is_not_handed_out_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_HANDED", set())
    monkeypatch.setattr(socket, "socket", _Sock)
    _Sock.script = [45771, 45771, 45771, 40002]
    assert ports.free_port() == 45771
    assert ports.free_port() == 40002  # the kernel gave 45771 back twice: skipped
    _Sock.script = [45771] * ports._TRIES
    with pytest.raises(OSError, match="no port"):
        ports.free_port()


def test_real_ports_are_distinct_and_bindable() -> None:
    got = {ports.free_port() for _ in range(20)}
    assert len(got) == 20
    with socket.socket() as s:
        s.bind(("127.0.0.1", got.pop()))
