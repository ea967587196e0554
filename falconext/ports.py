"""Pick a TCP port that is free now, for a rendezvous or a private Redis."""

from __future__ import annotations

import socket

#: ports this process has handed out: never handed out twice (the kernel may give a
#: released port again at once, and the first caller may not have bound it yet)
_HANDED: set[tuple[str, int]] = set()
_TRIES = 64


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` (IPv4, or IPv6 when it holds a colon) that the kernel just
    handed out and released, and that this process has not handed out before (the
    launcher picked torchrun's port, then Redis got the same one before torchrun bound
    it: EADDRINUSE in CI). Another process may still take it before the caller binds
    it, so a caller that must have it retries on "address in use". Raises OSError when
    ``host`` cannot be bound, or when no new port comes in 64 tries."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(_TRIES):
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if (host, port) not in _HANDED:
            _HANDED.add((host, port))
            return port
    raise OSError(f"free_port: no port on {host} that was not handed out already in {_TRIES} tries")
