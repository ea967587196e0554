"""The commands: controller -> ranks, and operator -> controller; and the validation plan
and shares a validation's suspension carries.

Each kind of command is its own frozen dataclass, named by its ``KIND``, and
:data:`Command` is their union: a receiver dispatches on the type (``match`` or
``isinstance``), never on a string. To the ranks: :class:`ProfileRequest`,
:class:`Share`, :class:`Suspend`, :class:`Go`, :class:`Release`, :class:`Resume`
(:data:`RankCommand`); from an operator (``falconext ctl``): :class:`ValidateRequest`,
:class:`MitigateRequest`, :class:`MuteRequest`, :class:`UnmuteRequest`,
:class:`SetRequest` (:data:`OperatorCommand`). An operator's command may carry an ``id``:
the controller then answers with a :class:`~falconext.protocol.messages.CommandReply` of
that id.

On the wire every command keeps one shape, the message type ``Command`` with the body
``{"kind", "deadline_s", "iteration", "args", "action", "validation", "share"}``
(:mod:`falconext.protocol.codec`): the fields of a command named in :data:`ENVELOPE` travel
at the top (a command without one sends the value given there), its other fields in
``args`` (an optional one left out while None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Union

from falconext.protocol.actions import MitigationAction
from falconext.protocol.base import MessageError


# --- a validation session's plan: one small part for every rank, one share per block of ranks --


@dataclass(frozen=True)
class ValidationPlan:
    """What every rank of a validation suspension needs alike (a
    :class:`Suspend`'s ``validation``): the benchmarks' sizes and how many GEMM and P2P rounds there are
    (every rank takes part in each round's barrier). Which rank runs a GEMM in which
    round, and its P2P pairs, come in :class:`Share` commands posted just
    before: the plan's size does not grow with the world.
    """

    scope: str
    roles: list[str]
    gemm_n: int
    gemm_repeats: int
    gemm_rounds: int
    validation_sweeps: int
    nbytes: int
    repeats: int
    p2p_rounds: int
    #: after reporting, the ranks stay held up to this long for the controller's verdict,
    #: a "resume" that may carry the mitigation to apply from the next iteration (0: they
    #: resume as soon as they have reported)
    verdict_wait_s: float = 0.0

    def check(self) -> None:
        """Round counts >= 0, at least one sweep, sizes >= 1 where there is work, a wait
        for the verdict of 0 to 300 s."""
        if not 0.0 <= self.verdict_wait_s <= 300.0:
            raise MessageError(f"ValidationPlan: verdict_wait_s must be in [0, 300], got {self.verdict_wait_s}")
        if self.gemm_rounds < 0 or self.p2p_rounds < 0 or self.validation_sweeps < 1:
            raise MessageError(f"ValidationPlan: rounds must be >= 0 and sweeps >= 1, got gemm_rounds "
                               f"{self.gemm_rounds}, p2p_rounds {self.p2p_rounds}, sweeps {self.validation_sweeps}")
        if (self.gemm_rounds and (self.gemm_n < 1 or self.gemm_repeats < 1)) or (
                self.p2p_rounds and (self.nbytes < 1 or self.repeats < 1)):
            raise MessageError("ValidationPlan: gemm_n, gemm_repeats, nbytes and repeats must be >= 1")


@dataclass(frozen=True)
class ValidationShare:
    """The part of a validation plan for the ranks ``first`` .. ``last`` (a
    :class:`Share`'s ``share``): ``gemm`` rows ``[first, last, round]`` (the ranks first..last run
    their GEMM in that round; a rank in no row runs none) and ``pairs`` rows
    ``[round, src, dst]`` (the P2P transfers they send or receive). A rank in the range with no row has nothing to run but the
    barriers.
    """

    first: int
    last: int
    gemm: list[list[int]]
    pairs: list[list[int]]

    def check(self) -> None:
        """first <= last; rows of the right length, ranks and rounds >= 0, no self-transfer."""
        if not 0 <= self.first <= self.last:
            raise MessageError(f"ValidationShare: expected 0 <= first <= last, got {self.first}..{self.last}")
        for i, row in enumerate(self.gemm):
            if len(row) != 3 or min(row) < 0 or row[0] > row[1]:
                raise MessageError(f"ValidationShare.gemm[{i}]: expected [first, last, round], got {row!r}")
        for i, row in enumerate(self.pairs):
            if len(row) != 3 or min(row) < 0 or row[1] == row[2]:
                raise MessageError(f"ValidationShare.pairs[{i}]: expected [round, src, dst], got {row!r}")


# --- controller -> ranks ------------------------------------------------------------------


@dataclass(frozen=True)
class ProfileRequest:
    """Send a ProfileData of your collective calls of the last ``window_s`` seconds, for
    session ``session``; ``deadline_s``: how long the controller waits for the profiles."""

    KIND: ClassVar[str] = "profile"

    session: int
    window_s: float
    deadline_s: float = 0.0


@dataclass(frozen=True)
class Share:
    """Some ranks' part (``share``) of session ``session``'s validation, posted before the
    session's :class:`Suspend`."""

    KIND: ClassVar[str] = "share"

    session: int
    share: ValidationShare


@dataclass(frozen=True)
class Suspend:
    """Trap at loop iteration ``iteration``, held at most ``deadline_s``; ``validation``:
    what to validate, or ``action``: the mitigation to apply from the next iteration once
    every rank agrees (a suspend with neither is refused by the ranks)."""

    KIND: ClassVar[str] = "suspend"

    session: int
    iteration: int
    deadline_s: float
    action: MitigationAction | None = None
    validation: ValidationPlan | None = None


@dataclass(frozen=True)
class Go:
    """Every rank is held for session ``session``: run the validation (or agree on the
    action) and go on."""

    KIND: ClassVar[str] = "go"

    session: int
    deadline_s: float = 0.0


@dataclass(frozen=True)
class Release:
    """Session ``session`` is off: a held rank goes on, a pending suspension is dropped."""

    KIND: ClassVar[str] = "release"

    session: int


@dataclass(frozen=True)
class Resume:
    """Ends a validation's wait for its verdict (session ``session``), with the ``action``
    to apply from the next iteration, or none."""

    KIND: ClassVar[str] = "resume"

    session: int
    deadline_s: float = 0.0
    action: MitigationAction | None = None


# --- operator -> controller -----------------------------------------------------------------


@dataclass(frozen=True)
class ValidateRequest:
    """Validate now (every rank, whatever the detectors say)."""

    KIND: ClassVar[str] = "validate"

    id: str | None = None


@dataclass(frozen=True)
class MitigateRequest:
    """Apply ``strategy`` (S2, S3, S4, or revert to the even micro-batch plan) now: S2 with
    the given ``plan`` (micro-batches per DP replica) or the balanced one, S3 with
    ``roles`` (the torch rank each process plays), S4 without ``exclude_nodes``. The
    controller checks them against the job (and refuses, saying why)."""

    KIND: ClassVar[str] = "mitigate"

    strategy: str
    plan: list[int] | None = None
    roles: list[int] | None = None
    exclude_nodes: list[int] | None = None
    id: str | None = None


@dataclass(frozen=True)
class MuteRequest:
    """Hold fail-slow reports and the planner until :class:`UnmuteRequest`."""

    KIND: ClassVar[str] = "mute"

    id: str | None = None


@dataclass(frozen=True)
class UnmuteRequest:
    """Detection and mitigation on again."""

    KIND: ClassVar[str] = "unmute"

    id: str | None = None


@dataclass(frozen=True)
class SetRequest:
    """Set the run-time settable threshold ``name`` to ``value`` (checked by the config)."""

    KIND: ClassVar[str] = "set"

    name: str
    value: Any
    id: str | None = None


@dataclass(frozen=True)
class TableRequest:
    """Every rank's row of the status (a large job's status lists only the slowest
    ``listed_ranks``), written to ``ranks.csv`` beside the job's events."""

    KIND: ClassVar[str] = "table"

    id: str | None = None


#: what the controller sends the ranks
RankCommand = Union[ProfileRequest, Share, Suspend, Go, Release, Resume]
#: what an operator sends the controller
OperatorCommand = Union[ValidateRequest, MitigateRequest, MuteRequest, UnmuteRequest, SetRequest, TableRequest]
#: every command
Command = Union[RankCommand, OperatorCommand]

#: the classes of :data:`RankCommand` and :data:`OperatorCommand`, for ``isinstance``
RANK_COMMANDS: tuple[type, ...] = (ProfileRequest, Share, Suspend, Go, Release, Resume)
OPERATOR_COMMANDS: tuple[type, ...] = (ValidateRequest, MitigateRequest, MuteRequest, UnmuteRequest, SetRequest,
                                       TableRequest)
#: every command class by its kind, as the wire names it
COMMAND_KINDS: dict[str, type] = {cls.KIND: cls for cls in RANK_COMMANDS + OPERATOR_COMMANDS}  # type: ignore[attr-defined]

#: the fields every command's wire body has besides ``kind`` and ``args``, with the value
#: sent (and required) for a command that has no such field
ENVELOPE: dict[str, Any] = {"deadline_s": 0.0, "iteration": None, "action": None, "validation": None, "share": None}
