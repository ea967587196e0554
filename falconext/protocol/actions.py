"""The mitigation actions: what every rank applies from the iteration after a suspension.

They travel inside a suspend or resume command (its ``action`` field), tagged on the wire by
``"kind"`` (each class's ``KIND``), and are decoded as strictly as the messages: exactly
the class's fields, each of its declared type. ``session`` is the suspension that
committed the action (0: none, e.g. an override from the command line).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Union

from falconext.protocol.base import MessageError


@dataclass(frozen=True)
class MicrobatchPlan:
    """S2 (or its revert to the even plan): micro-batches per DP replica.

    ``replica_mb_s`` is the compute seconds per micro-batch per replica the plan balanced
    (after the GEMM cap), ``measured_mb_s`` the heartbeats' figures where the cap changed
    them (None: not given, e.g. an operator's plan).
    """

    KIND: ClassVar[str] = "microbatches"
    STRATEGIES: ClassVar[tuple[str, ...]] = ("S2", "revert")

    strategy: str
    plan: list[int]
    session: int = 0
    replica_mb_s: list[float] | None = None
    measured_mb_s: list[float] | None = None

    def check(self) -> None:
        """The strategy is S2 or revert."""
        _check_strategy(self)


@dataclass(frozen=True)
class TopologyChange:
    """S3: the role (torch rank) each process plays from the next iteration.

    ``roles[p]`` is process p's role. The planner adds what its model predicted
    (``predicted_s``: iteration seconds before and after), the processes it ``moved``,
    ``why`` and the ``model_inputs``; an override from the command line is ``forced`` or
    has ``reason`` "forced"; a ``probe`` switches to the same roles to measure the
    switch's cost (its ``roles`` are ignored).
    """

    KIND: ClassVar[str] = "topology"
    STRATEGIES: ClassVar[tuple[str, ...]] = ("S3",)

    roles: list[int]
    strategy: str = "S3"
    session: int = 0
    predicted_s: list[float] | None = None
    moved: list[int] | None = None
    why: str | None = None
    model_inputs: str | None = None
    reason: str | None = None
    forced: bool = False
    probe: bool = False

    def check(self) -> None:
        """The strategy is S3."""
        _check_strategy(self)


@dataclass(frozen=True)
class Restart:
    """S4: every rank saves a checkpoint and the job restarts without ``exclude_nodes``."""

    KIND: ClassVar[str] = "restart"
    STRATEGIES: ClassVar[tuple[str, ...]] = ("S4",)

    exclude_nodes: list[int]
    reason: str = ""
    strategy: str = "S4"
    session: int = 0

    def check(self) -> None:
        """The strategy is S4 and the nodes are node numbers (>= 0)."""
        _check_strategy(self)
        bad = [n for n in self.exclude_nodes if n < 0]
        if bad:
            raise MessageError(f"Restart.exclude_nodes: node numbers are >= 0, got {bad}")


#: what a suspension may carry for every rank to apply
MitigationAction = Union[MicrobatchPlan, TopologyChange, Restart]


def action_details(action: MitigationAction) -> dict[str, Any]:
    """An action's fields for an event, as the untyped actions had them: all but the
    strategy and the session, leaving out those not given (None) and flags not set."""
    return {f.name: getattr(action, f.name) for f in fields(action)
            if f.name not in ("strategy", "session") and getattr(action, f.name) not in (None, False)}


def _check_strategy(action: Any) -> None:
    if action.strategy not in action.STRATEGIES:
        raise MessageError(f"{type(action).__name__}.strategy: expected one of {', '.join(action.STRATEGIES)}, "
                           f"got {action.strategy!r}")
