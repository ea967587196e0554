"""The one way falconext builds a Redis client: no retries of its own.

redis-py's default retry policy backs off for seconds on a refused connection or AUTH.
falconext's callers poll or keep their own backoff (the Bus's reconnect, a server's
start-up PING loop), so a dead server must cost one timeout per call, nothing more.
"""

from __future__ import annotations

from typing import Any, Callable
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry


def redis_client(
    url: str,
    socket_timeout_s: float,
    connect_timeout_s: float | None = None,
    on_connect: Callable[[Any], None] | None = None,
) -> redis.Redis:
    """A client for ``url`` (``redis://:password@host:port/db``) that never retries:
    each command fails after at most ``socket_timeout_s`` (connecting: after
    ``connect_timeout_s``, by default the same) with a ``redis.RedisError``. No health
    check pings are sent. ``on_connect``, when given, replaces redis-py's connect hook
    and must call ``conn.on_connect()`` itself to authenticate. Connects lazily: building
    it never fails on a dead server."""
    extra: dict[str, Any] = {} if on_connect is None else {"redis_connect_func": on_connect}
    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s if connect_timeout_s is None else connect_timeout_s,
        health_check_interval=0,
        retry=Retry(NoBackoff(), 0),
        **extra,
    )


def where(url: str) -> str:
    """host:port of a redis:// URL, without its password (for messages)."""
    return urlsplit(url.split("#", 1)[0]).netloc.rpartition("@")[2] or "?"
