"""What the controller and its collaborators hand the I/O loop: an :class:`Output` to post
or to log, and the builders of the commands the controller posts to the ranks.

Every command the controller posts is built here (one place for the command's shape).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from falconext.control.messages import Command


@dataclass
class Output:
    """Something the I/O loop must do: post a message, or write an event."""

    kind: str  # "command" | "localized" | "event" | "reply" (a CommandReply for the operator)
    message: Any = None
    event: dict[str, Any] = field(default_factory=dict)


def event(type_: str, **fields: Any) -> Output:
    """An event of type ``type_`` with ``fields``, to be written to the event log."""
    return Output("event", event={"type": type_, **fields})


def post(kind: str, deadline_s: float, session: int, **fields: Any) -> Output:
    """A command of ``kind`` for every rank, of ``session`` (``fields``: the command's
    other fields: iteration, action, validation, share)."""
    return Output("command", Command(kind, deadline_s, args={"session": session}, **fields))


def profile_command(deadline_s: float, session: int, window_s: float) -> Output:
    """Every rank sends its recent calls (the last ``window_s`` seconds) for ``session``."""
    return Output("command", Command("profile", deadline_s, args={"session": session, "window_s": window_s}))
