"""events.jsonl, the run's decision log.

On one machine ranks, agents and the controller append to it alike (each line one
``write``). In a job of several launchers (one per node, the run directory shared) only the
controller writes it: each rank keeps its node's own log (``nodes/<host>/events.jsonl``)
and forwards every record to the controller (:class:`ForwardingEventLog`), which appends it
with the rank's time."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Callable


class EventLog:
    """events.jsonl: one JSON object per line, appended atomically by any rank or thread."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def emit(self, type_: str, **fields: Any) -> dict[str, Any]:
        """Append ``{"time", "type": type_, **fields}`` as one line in a single ``write`` (whole
        lines, even with several writers) and return the record. ``fields`` must be JSON-able."""
        record = {"time": round(time.time(), 6), "type": type_, **fields}
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)
        return record

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` (already made, with its own ``time`` and ``type``) as one line."""
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)

    def close(self) -> None:
        """Close the file; a later :meth:`emit` raises OSError."""
        os.close(self._fd)


#: records a ForwardingEventLog keeps while it has nowhere to forward them yet
MAX_WAITING = 1000


class ForwardingEventLog(EventLog):
    """A rank's events in a job of several launchers: every record is written to this
    node's own log and handed to ``forward`` (set with :meth:`forward_to`, once the rank
    has a connection to the controller); records made before that wait, up to
    MAX_WAITING (older ones are then only in the node's log). ``forward`` must not block
    and must not raise (a rank's client queues the message)."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        super().__init__(path)
        self._forward: Callable[[dict[str, Any]], None] | None = None
        self._waiting: list[dict[str, Any]] = []

    def forward_to(self, forward: Callable[[dict[str, Any]], None] | None) -> None:
        """From now on hand every record to ``forward`` (None: keep them in this node's log
        only, and drop the waiting ones); the waiting records go first."""
        with self._lock:
            self._forward = forward
            waiting, self._waiting = self._waiting, []
        if forward is not None:
            for record in waiting:
                forward(record)

    def emit(self, type_: str, **fields: Any) -> dict[str, Any]:
        """Append the record to this node's log and forward it (or keep it until there is
        somewhere to forward it); returns the record."""
        record = super().emit(type_, **fields)
        with self._lock:
            forward = self._forward
            if forward is None:
                if len(self._waiting) < MAX_WAITING:
                    self._waiting.append(record)
                return record
        forward(record)
        return record
