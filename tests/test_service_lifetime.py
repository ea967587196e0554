"""The controller and node agents end with the launcher that supervises them: a launcher
killed with SIGKILL (no clean-up runs) must not leave them polling Redis for ever."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from falconext.control.client import REDIS_URL_ENV


@pytest.mark.parametrize("role", ["agent", "controller"])
def test_a_service_ends_when_its_launcher_is_killed(redis_server, tmp_path, role):
    # a stand-in launcher: starts the service, prints its pid, then waits to be killed
    argv = [sys.executable, "-m", "falconext.control.service", role, "--job", "life", "--events",
            str(tmp_path / "events.jsonl"), "--world", "2"]
    launcher = textwrap.dedent(f"""
        import os, subprocess, sys, time
        child = subprocess.Popen({argv!r}, env=dict(os.environ, FALCONEXT_PARENT_PID=str(os.getpid())))
        print(child.pid, flush=True)
        time.sleep(600)
    """)
    env = dict(os.environ, **{REDIS_URL_ENV: redis_server.url})
    parent = subprocess.Popen([sys.executable, "-c", launcher], env=env, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        time.sleep(1.5)  # the service is up and polling
        os.kill(child, 0)
        parent.kill()
        parent.wait(timeout=10)
        if not _ends_within(child, 10):
            pytest.fail(f"the {role} outlived its launcher by 10 s")
    finally:
        try:
            os.kill(child, 9)
        except ProcessLookupError:
            pass


def _ends_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` ends (is gone, or a zombie) within ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # an exited child of a dead parent is reaped by init; until then it is a zombie
        if _state(pid) == "Z":
            return True
        time.sleep(0.1)
    return False


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "?"


def test_a_launcher_killed_before_its_service_has_started_is_seen_gone(redis_server, tmp_path):
    """The launcher names itself to the service (FALCONEXT_PARENT_PID, as the control
    plane does): one killed at once, before the service's imports are over (when the
    parent it would see is already init), still ends it."""
    argv = [sys.executable, "-m", "falconext.control.service", "agent", "--job", "life", "--world", "2"]
    launcher = textwrap.dedent(f"""
        import os, subprocess
        child = subprocess.Popen({argv!r}, env=dict(os.environ, FALCONEXT_PARENT_PID=str(os.getpid())))
        print(child.pid, flush=True)
    """)  # ends as soon as it has started the service
    env = dict(os.environ, **{REDIS_URL_ENV: redis_server.url})
    parent = subprocess.Popen([sys.executable, "-c", launcher], env=env, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.wait(timeout=10)
    try:
        if not _ends_within(child, 20):
            pytest.fail("the agent outlived a launcher that died before it had started")
    finally:
        try:
            os.kill(child, 9)
        except ProcessLookupError:
            pass
