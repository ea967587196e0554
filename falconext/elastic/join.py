"""How the launchers of the job's other nodes find the control plane one node started.

The node that hosts the plane writes the run directory's ``access.json`` (mode 0600: the
Redis URL with its password, never on a command line) with the job's rendezvous id and
its launcher's flags digest. Every other node's launcher, given the same ``--falcon-out``
on a shared file system, waits for that file (:func:`find_plane`), checks that it is this
job's (same rendezvous id, not ended, Redis answering the password) and hands the URL to
its ranks through their environment. A node that cannot find or reach it within the
deadline trains on without the plane and says so once (its ranks tell the others, who then
train on without it too: :func:`falconext.megatron_lm.hooks.plane_refusal`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from urllib.parse import urlparse

import redis

from falconext.control.shards import home
from falconext.control.plane import ACCESS_FILE


@dataclass(frozen=True)
class PlaneAccess:
    """Where the job's control plane is: its Redis URL (with the password) and job name."""

    url: str
    job: str
    flags: str | None


def read_access(out: str) -> dict | None:
    """The run directory's access.json as a dict, or None when it is absent or unreadable."""
    try:
        with open(os.path.join(out, ACCESS_FILE)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def check_access(data: dict | None, rdzv_id: str) -> str | PlaneAccess:
    """The plane ``data`` (access.json) names for rendezvous ``rdzv_id``, or why it names
    none for this job (pure)."""
    if data is None:
        return "no access.json in the run directory yet"
    if data.get("rdzv_id") != rdzv_id:
        return f"access.json belongs to rendezvous {data.get('rdzv_id')!r}, this launcher's --rdzv-id is {rdzv_id!r}"
    if data.get("ended") is not None or not isinstance(data.get("url"), str):
        return "access.json is from a job that has ended"
    job = data.get("job")
    if not isinstance(job, str) or not job:
        return "access.json names no job"
    flags = data.get("flags")
    return PlaneAccess(data["url"], job, flags if isinstance(flags, str) else None)


def ping(url: str, timeout_s: float = 2.0) -> str | None:
    """None when the Redis at ``url`` answers an authenticated PING, else why not (one line)."""
    try:
        client = redis.Redis.from_url(home(url, "")[0], socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        try:
            client.ping()
        finally:
            client.close()
    except Exception as exc:  # noqa: BLE001 - any failure is "unreachable", said in one line
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
    return None


@dataclass(frozen=True)
class OtherJob:
    """access.json names a job that runs now (its Redis answers) under another rendezvous id."""

    rdzv_id: str

    def refusal(self, out: str, mine: str) -> str:
        """The one line a launcher given ``--rdzv-id mine`` stops with."""
        return (f"--falcon-out {out} belongs to a running job of rendezvous {self.rdzv_id!r}, and this launcher's "
                f"--rdzv-id is {mine!r}: every node of one job gives the same --rdzv-id, and two jobs never share "
                "a --falcon-out")


def running_other_job(data: dict | None, rdzv_id: str) -> OtherJob | None:
    """The job access.json ``data`` names when it runs now (not ended, its Redis answering)
    under a rendezvous id other than ``rdzv_id``; else None (absent, ended, this job's, or
    left by a job that died: its Redis does not answer)."""
    if data is None or data.get("ended") is not None or not isinstance(data.get("url"), str):
        return None
    if data.get("rdzv_id") == rdzv_id:
        return None
    return OtherJob(str(data.get("rdzv_id"))) if ping(data["url"]) is None else None


def find_plane(out: str, rdzv_id: str, deadline_s: float, poll_s: float = 0.5) -> PlaneAccess | OtherJob | str:
    """Wait at most ``deadline_s`` for this job's control plane in ``out``; the plane, the
    running job of another rendezvous id the run directory belongs to (at once: a node given
    the wrong ``--rdzv-id`` must not wait), or the last reason none was usable (one line,
    naming the address when Redis did not answer)."""
    end = time.monotonic() + deadline_s
    why = "no access.json in the run directory"
    while True:
        data = read_access(out)
        other = running_other_job(data, rdzv_id)
        if other is not None:
            return other
        found = check_access(data, rdzv_id)
        if isinstance(found, PlaneAccess):
            err = ping(found.url)
            if err is None:
                return found
            where = urlparse(found.url)
            why = f"the control plane's Redis at {where.hostname}:{where.port} does not answer ({err})"
        else:
            why = found
        if time.monotonic() >= end:
            return why
        time.sleep(poll_s)
