"""Shared fixtures. Control-plane tests run against a real, private redis-server."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator

import pytest

from falconext.control.redis_cluster import RedisCluster, start_redis_cluster
from falconext.control.redis_server import RedisServer, start_redis
from falconext.control.shards import cluster_url, read_shards
from falconext.testbed.zygote import ZYGOTE_ENV
import jobs as jobs_module
from jobs import ISOLATED, LANE, JobCache, stop_jobs


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh password-protected Redis on a free loopback port, stopped afterwards."""
    server = start_redis()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    """A real Redis Cluster of 3 cluster-mode redis-servers, one per test module."""
    with start_redis_cluster(3) as c:
        yield c


@pytest.fixture
def url(cluster: RedisCluster) -> str:
    """The cluster's URL naming every shard, as the launcher hands it to the processes."""
    return cluster_url(cluster.url, read_shards(cluster.url))


@pytest.fixture(scope="session")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> JobCache:
    """Training jobs shared across test modules (tests/jobs.py)."""
    return JobCache(tmp_path_factory.mktemp("jobs"))


def _phase(module: object) -> int:
    """0: a module that times the wall clock (``RUN_FIRST``); 1: one that needs the job lane
    to itself (``ALONE``); then, beside the jobs run ahead, 2: the modules that read none
    of them, and 3: those that do (``AHEAD``)."""
    if getattr(module, "RUN_FIRST", False) is True:
        return 0
    if getattr(module, "ALONE", False) is True:
        return 1
    return 3 if getattr(module, "AHEAD", ()) else 2


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The phases in order (each module in its usual order within its phase): the jobs
    run ahead start with phase 2, whose tests run beside them, and the tests that read
    them come last, when most are done, so no test waits for the lane while a job it did
    not ask for runs to its end and the suite ends soon after its last job."""
    items.sort(key=lambda item: _phase(item.module))


#: set when the first test of the last phase starts: the jobs run ahead may start
_ahead_may_start = threading.Event()


@pytest.fixture(autouse=True)
def _start_the_jobs_ahead_with_the_last_phase(request: pytest.FixtureRequest, jobs: JobCache) -> None:
    """Before the first test of phase 2: the jobs that must run with nothing beside them
    (tests/jobs.py: ``ISOLATED``) that a module of the session runs ahead, one after
    another, while no test runs; then the jobs ahead may start."""
    if _phase(request.module) >= 2 and not _ahead_may_start.is_set():
        wanted = {id(m) for item in request.session.items if item.module is not None
                  for m in getattr(item.module, "AHEAD", ())}
        for make in ISOLATED:
            if id(make) in wanted:
                try:
                    make(jobs)
                except BaseException:  # noqa: BLE001  (reported to the tests that read the job)
                    pass
        _ahead_may_start.set()


@pytest.fixture(scope="session", autouse=True)
def jobs_ahead(request: pytest.FixtureRequest, zygote: str, jobs: JobCache) -> Iterator[None]:
    """The jobs the session's test modules read (each module's ``AHEAD``), run one after
    another in the background from the start, in the order the tests first need them,
    while the unit tests run beside them (jobs.LANE keeps it to one job at a time)."""
    makers: list = []
    seen: set[int] = set()
    for item in request.session.items:
        for make in getattr(item.module, "AHEAD", ()) if item.module is not None else ():
            if id(make) not in seen:
                seen.add(id(make))
                makers.append(make)
    jobs.prefetch(makers, after=_ahead_may_start)
    yield
    stop_jobs()  # before the zygote stops: a job run ahead for tests never reached ends now


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


@pytest.fixture(scope="module", autouse=True)
def alone(request: pytest.FixtureRequest) -> Iterator[None]:
    """A module that says ``ALONE`` (it drives jobs by hand, times real links, or reads a
    job that must run with nothing beside it) runs with the job lane held."""
    if getattr(request.module, "ALONE", False) is True:
        with LANE:
            yield
    else:
        yield


def pytest_terminal_summary(terminalreporter) -> None:
    """The host's pace, where an emulated job ran: the share of their named speed the
    emulated devices ran at (tests/jobs.py: host_factor)."""
    if jobs_module._factor:
        terminalreporter.write_line(f"emulated devices ran at {jobs_module._factor[0]:.2f} of their named speed "
                                    "on this host (tests/jobs.py: host_factor)")
