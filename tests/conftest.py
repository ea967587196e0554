"""Shared fixtures. Control-plane tests run against a real, private redis-server.

The order of a session: the unit tests first, then the modules that train jobs
(:data:`JOB_MODULES`). Meanwhile the jobs several modules share (tests/jobs.py) run in the
background, one at a time, from the session's start: a training job's ranks sleep
through much of their emulated device time, and the unit tests use the cores they leave.
The job modules begin once those are done, and run their own jobs one at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from falconext.control.redis_server import RedisServer, start_redis
from jobs import (
    JobCache,
    calls_only_job,
    forced_pp2_job,
    pp2_reference,
    s2_job,
    s2_reference,
    s3_link_job,
    tp2_pp2_reference,
)

#: the shared jobs each module reads, in the order its tests ask for them
SHARED_JOBS: dict[str, tuple[Callable[[JobCache], Path], ...]] = {
    "test_figures": (s2_job,),
    "test_mitigation_e2e": (s2_job, s2_reference, forced_pp2_job, pp2_reference),
    "test_nohook": (calls_only_job,),
    "test_scores": (calls_only_job,),
    "test_switch": (forced_pp2_job, pp2_reference, tp2_pp2_reference),
    "test_topology_e2e": (s3_link_job, pp2_reference),
    "test_train": (s2_job, s3_link_job, tp2_pp2_reference),
}
#: modules that train jobs (shared or their own): they run after the unit tests
JOB_MODULES = frozenset(SHARED_JOBS) | {
    "test_chaos", "test_control_e2e", "test_ctl_e2e", "test_gpu", "test_hooks", "test_netns",
    "test_pretrain_gpt", "test_patch_real",
}


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Unit tests first, job modules after (each keeps its order); note the shared jobs
    the selected modules need, in the order those modules will ask for them."""
    items.sort(key=lambda item: item.path.stem in JOB_MODULES)
    wanted: list[Callable[[JobCache], Path]] = []
    for stem in sorted({item.path.stem for item in items} & set(SHARED_JOBS)):
        wanted += [job for job in SHARED_JOBS[stem] if job not in wanted]
    config.stash[_PREFETCH] = wanted


_PREFETCH = pytest.StashKey[list]()


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


@pytest.fixture(scope="session")
def _shared_jobs(request: pytest.FixtureRequest, jobs: JobCache) -> Iterator[threading.Thread | None]:
    """The shared jobs the session's modules need, started in the background at once; at
    the session's end no further one starts, and the one under way is waited for."""
    wanted = request.config.stash.get(_PREFETCH, [])
    stop = threading.Event()
    thread = jobs.prefetch(*wanted, stop=stop) if wanted else None
    yield thread
    stop.set()
    if thread is not None:
        thread.join()


@pytest.fixture(scope="module", autouse=True)
def _jobs_one_at_a_time(request: pytest.FixtureRequest, _shared_jobs: threading.Thread | None) -> None:
    """A module that trains jobs begins once the shared jobs are done: its own jobs never
    share the host with them."""
    if _shared_jobs is not None and request.path.stem in JOB_MODULES:
        _shared_jobs.join()
