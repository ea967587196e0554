"""Shared fixtures. Control-plane tests run against a real, private redis-server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from falconext.control.redis_server import RedisServer, start_redis


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh password-protected Redis on a free loopback port, stopped afterwards."""
    server = start_redis()
    try:
        yield server
    finally:
        server.stop()
