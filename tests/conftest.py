"""Shared fixtures. Control-plane tests run against a real, private redis-server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from falconext.control.redis_server import RedisServer, start_redis
from jobs import JobCache


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh password-protected Redis on a free loopback port, stopped afterwards."""
    server = start_redis()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> JobCache:
    """Training jobs shared across test modules (tests/jobs.py)."""
    return JobCache(tmp_path_factory.mktemp("jobs"))
