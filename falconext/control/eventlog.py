"""events.jsonl, the run's decision log: written by ranks, agents and the controller alike."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any


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

    def close(self) -> None:
        """Close the file; a later :meth:`emit` raises OSError."""
        os.close(self._fd)
