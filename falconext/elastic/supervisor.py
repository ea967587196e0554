"""One restart policy for every launcher that holds a whole job (``falconext train``,
``falconext train --net netns`` and ``falconext launch`` on one node).

Shaped like torch's ``SimpleElasticAgent``: the policy (how many restarts, when a run is
over, what a failure means, what is reported) is here; starting and stopping workers, and
getting the next attempt ready, are the launcher's (two callables). A job of several
launchers has no such loop of falconext's: each node's TorchElastic agent restarts its
workers (:mod:`falconext.elastic.restart`), with ``--max-restarts`` defaulting to the same
:data:`~falconext.elastic.restart.DEFAULT_MAX_RESTARTS`.

The rules, for one attempt after another:

- the workers ran and exited 0 without a restart request: the job is done (0);
- they exited 0 and left a request (``restart.json``, moved aside so it is acted on
  once): the next attempt starts, once the launcher has prepared it, unless the job has
  used its restarts (then one line, :class:`~falconext.inputs.InputError`);
- any other exit status: the job failed (one line naming where, as the launcher says).

Each attempt's end is an ``attempt_ended`` event (its exit status, the restart it asked
for, restarts left), posted to the job's controller when the job has one.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable

from falconext.control.shards import open_bus
from falconext.control.client import CTL_STREAM
from falconext.elastic.restart import DEFAULT_MAX_RESTARTS
from falconext.inputs import InputError
from falconext.mitigate.restart import LAUNCH_TIME_ENV, RESTART_FILE, CheckpointError, RestartRequest, read_request
from falconext.protocol.messages import RankEvent


@dataclass(frozen=True)
class AttemptEnd:
    """How one attempt's workers ended: the exit status and, when not 0, where (for the
    one-line error: "torchrun", "node 1's torchrun")."""

    code: int
    where: str = "torchrun"


def take_request(out: str) -> RestartRequest | None:
    """The ranks' restart request in run directory ``out``, if they left one, moved aside
    (``restart-<attempt>.json``) so it is acted on once; a broken one is an InputError."""
    path = os.path.join(out, RESTART_FILE)
    if not os.path.exists(path):
        return None
    try:
        req = read_request(path)
    except CheckpointError as exc:
        raise InputError(str(exc)) from None
    os.replace(path, os.path.join(out, f"restart-{req.attempt}.json"))
    return req


class Supervisor:
    """Runs a job's attempts under one restart policy (see the module).

    ``out``: the run directory the ranks leave their restart request in; ``env``: the
    workers' environment, whose :data:`LAUNCH_TIME_ENV` it keeps (a restart's cost is
    measured from its request); ``tell``: where events go (None: nowhere)."""

    def __init__(self, out: str, env: dict[str, str], max_restarts: int = DEFAULT_MAX_RESTARTS,
                 tell: Callable[..., None] | None = None) -> None:
        self.out = out
        self.env = env
        self.max_restarts = max_restarts
        self.tell = tell
        #: the attempt now running (0: the launch)
        self.attempt = 0

    def run(self, start: Callable[[int], AttemptEnd], prepare: Callable[[RestartRequest], None]) -> int:
        """Start attempt 0 with ``start(0)``; after each attempt, apply the policy:
        return 0 when the job is done, call ``prepare(request)`` and then
        ``start(attempt)`` for a restart, raise InputError with one line otherwise."""
        self.env[LAUNCH_TIME_ENV] = repr(time.time())
        while True:
            end = start(self.attempt)
            req = take_request(self.out) if end.code == 0 else None
            self._tell("attempt_ended", attempt=self.attempt, code=end.code,
                       restart=None if req is None else req.attempt, restarts_left=self.max_restarts - self.attempt)
            if end.code != 0:
                raise InputError(f"training failed ({end.where} exit status {end.code}); see the messages above")
            if req is None:
                return 0
            if req.attempt > self.max_restarts:
                raise InputError(f"the job asked for restart number {req.attempt}; "
                                 f"at most {self.max_restarts} are allowed")
            prepare(req)
            self.attempt = req.attempt
            self.env[LAUNCH_TIME_ENV] = repr(req.requested_at)  # the restart's cost runs from its request

    @classmethod
    def for_plane(cls, out: str, env: dict[str, str], plane: Any) -> "Supervisor":
        """A supervisor whose events go to ``plane``'s controller (None: a job without one)."""
        return cls(out, env, tell=plane_teller(plane.url, plane.job) if plane is not None else None)

    def _tell(self, type_: str, **fields: object) -> None:
        if self.tell is not None:
            self.tell(type_, **fields)


def plane_teller(url: str | None, job: str) -> Callable[..., None] | None:
    """A ``tell`` for :class:`Supervisor` (and a node's launcher) that posts each event to
    the job's controller over its Redis at ``url`` (best effort: the plane may be gone);
    None when the job has no plane."""
    if not url:
        return None

    def tell(type_: str, **fields: object) -> None:
        try:
            bus = open_bus(url, job)
            try:
                bus.post(CTL_STREAM, RankEvent(-1, type_, time.time(), dict(fields)))
            finally:
                bus.close()
        except Exception:  # noqa: BLE001 - an event lost with the plane is said nowhere else
            pass

    return tell
