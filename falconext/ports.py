"""Pick a TCP port that is free now, for a rendezvous or a private Redis.

A port is taken from just below the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default): the kernel never
hands those out by itself, neither to a ``bind(0)`` nor as the source port of an
outgoing connection, so between the pick and the caller's bind only another explicit
bind can take it. Ports from the ephemeral range itself were taken in that window by
jobs running beside (a gloo pair's listener, a client's source port: EADDRINUSE in the
tests, 2026-11-27).
"""

from __future__ import annotations

import random
import socket

#: ports this process has handed out: never handed out twice (the first caller may not
#: have bound it yet)
_HANDED: set[tuple[str, int]] = set()
_TRIES = 64
#: how many ports below the ephemeral range are drawn from (never below 1024)
POOL = 12288
_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_rng = random.SystemRandom()


def ephemeral_range(path: str = _RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (first, last); Linux's default where the file
    cannot be read or parsed."""
    try:
        with open(path) as f:
            lo, hi = (int(v) for v in f.read().split())
    except (OSError, ValueError):
        return 32768, 60999
    return (lo, hi) if 0 < lo <= hi <= 65535 else (32768, 60999)


def _pool(path: str = _RANGE_FILE) -> range:
    """The ports to draw from: up to :data:`POOL` just below the ephemeral range (empty
    when the range starts at 1024 or lower)."""
    lo, _ = ephemeral_range(path)
    return range(max(1024, lo - POOL), lo)


def _bindable(family: int, host: str, port: int) -> bool:
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` (IPv4, or IPv6 when it holds a colon) that is free now,
    outside the kernel's ephemeral range where there is room below it (module
    docstring), and that this process has not handed out before. Another process may
    still bind it first, so a caller that must have it retries on "address in use".
    Raises OSError when ``host`` cannot be bound, or when no new port comes in 64 tries."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    pool = _pool()
    for _ in range(_TRIES):
        if pool:
            port = _rng.choice(pool)
            if (host, port) in _HANDED or not _bindable(family, host, port):
                continue
        else:  # no room below the ephemeral range: the kernel picks
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.bind((host, 0))
                port = int(sock.getsockname()[1])
            if (host, port) in _HANDED:
                continue
        _HANDED.add((host, port))
        return port
    raise OSError(f"free_port: no free port on {host} that was not handed out already in {_TRIES} tries")
