"""Shared fixtures. Control-plane tests run against a real, private redis-server."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest

from falconext.control.redis_server import RedisServer, start_redis
from falconext.testbed.zygote import ZYGOTE_ENV
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


@pytest.fixture(scope="session", autouse=True)
def zygote() -> Iterator[str]:
    """One warm parent for every test-bed job of the session (falconext.testbed.zygote):
    started now, importing torch while the first tests run, and named to the launchers
    through the environment (a job started before it listens runs as a fresh process)."""
    folder = tempfile.mkdtemp(prefix="falconext-zygote-")  # private (0700)
    path = os.path.join(folder, "sock")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")  # as tests/jobs.py runs jobs
    proc = subprocess.Popen([sys.executable, "-m", "falconext.testbed.zygote", path], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ[ZYGOTE_ENV] = path
    try:
        yield path
    finally:
        os.environ.pop(ZYGOTE_ENV, None)
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(folder, ignore_errors=True)
