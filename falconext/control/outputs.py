"""What the controller and its collaborators hand the I/O loop: an :class:`Output` to post
or to log, and the builders of the commands the controller posts to the ranks.

Every command the controller posts is built here (one place for the command's shape).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from falconext.protocol.commands import Command


@dataclass
class Output:
    """Something the I/O loop must do: post a message, or write an event."""

    #: "command" | "localized" | "event" | "reply" (a CommandReply for the operator) |
    #: "table" (every rank's status row, a list of dicts, for the run's ranks.csv)
    kind: str
    message: Any = None
    event: dict[str, Any] = field(default_factory=dict)


def event(type_: str, **fields: Any) -> Output:
    """An event of type ``type_`` with ``fields``, to be written to the event log."""
    return Output("event", event={"type": type_, **fields})


def post(command: Command) -> Output:
    """``command`` posted to every rank."""
    return Output("command", command)
