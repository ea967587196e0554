"""Pick a TCP port that is free now, for a rendezvous or a private Redis."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` (IPv4, or IPv6 when it holds a colon) that the kernel just
    handed out and released. Another process may take it before the caller binds it, so
    a caller that must have it retries on "address in use". Raises OSError when ``host``
    cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
