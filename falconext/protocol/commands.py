"""Controller -> ranks (and operator -> controller): the commands, and the validation plan
and shares a validation's suspension carries."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from falconext.protocol.actions import MitigationAction
from falconext.protocol.base import MessageError


# --- a validation session's plan: one small part for every rank, one share per block of ranks --


@dataclass(frozen=True)
class ValidationPlan:
    """What every rank of a validation suspension needs alike (a suspend Command's
    ``validation``): the benchmarks' sizes and how many GEMM and P2P rounds there are
    (every rank takes part in each round's barrier). Which rank runs a GEMM in which
    round, and its P2P pairs, come in :class:`ValidationShare` commands posted just
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
    """The part of a validation plan for the ranks ``first`` .. ``last`` (a "share"
    Command's ``share``): ``gemm`` rows ``[first, last, round]`` (the ranks first..last run
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


@dataclass(frozen=True)
class Command:
    """Controller -> ranks (and operator -> controller).

    kinds: ``profile`` (send ProfileData; args: session, window_s), ``share`` (args:
    session; ``share``: some ranks' part of that session's validation, posted before its
    suspend), ``suspend`` (trap at loop iteration ``iteration``, at most ``deadline_s``;
    args: session; ``validation``: what to validate, or ``action``: the mitigation to
    apply from the next iteration once every rank agrees), ``go`` and ``release``
    (args: session), ``resume`` (args: session; ends a validation's wait for its verdict,
    with the ``action`` to apply from the next iteration, or none), and from an operator
    (``falconext ctl``): ``validate``, ``mitigate`` (args: strategy S2|S3|S4|revert,
    optional plan, roles or exclude_nodes), ``mute``, ``unmute`` and ``set`` (args: name,
    value). An operator's command may carry ``args["id"]``: the controller then answers
    with a :class:`CommandReply` of that id.
    """

    kind: str
    deadline_s: float
    iteration: int | None = None
    args: dict[str, Any] = field(default_factory=dict)
    action: MitigationAction | None = None
    validation: ValidationPlan | None = None
    share: ValidationShare | None = None
