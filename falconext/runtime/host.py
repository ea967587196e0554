"""The rank host: the seam between falconext's rank runtime and the training loop that runs it.

Two loops host falconext: the test bed's trainer (``falconext.testbed.train``) and
Megatron-LM's own loop (``falconext.megatron_lm.hooks``). At an iteration boundary the
runtime hands the loop the action every rank agreed on (:class:`MicrobatchPlan`,
:class:`TopologyChange`, :class:`Restart`); :func:`apply_action` is the one place that turns it
into a call on the host and into the events that say what happened, so both loops apply,
refuse and report alike. What differs is the host's business: how a plan is put in force
(the bed's trainer at once, Megatron-LM after the batches its data loader fetched ahead), and
whether a topology change is live (the bed) or a restart with new roles (Megatron-LM).
:func:`versions` is what both write into ``run.json``.
"""

from __future__ import annotations

import platform
from typing import Any, Protocol

import falconext
from falconext.protocol.actions import MicrobatchPlan, MitigationAction, Restart, TopologyChange


class PlanRefused(ValueError):
    """A micro-batch plan the host cannot apply (its message is one line, the reason)."""


class RankHost(Protocol):
    """What a training loop provides to apply the controller's actions on one process."""

    #: this process's index in the launch (events name it as ``rank``)
    process: int

    def apply_plan(self, action: MicrobatchPlan, iteration: int) -> dict[str, Any] | None:
        """Put ``action.plan`` in force from ``iteration`` (or the first iteration it can);
        the ``plan_applied`` event's fields, or None where this process does not announce
        it. Raises :class:`PlanRefused` when the plan cannot be applied."""
        ...

    def change_topology(self, action: TopologyChange, iteration: int) -> Any:
        """S3: play the new roles (live, or through a restart); what :func:`apply_action` returns."""
        ...

    def restart(self, action: Restart, iteration: int) -> Any:
        """S4: checkpoint and leave for a restart; what :func:`apply_action` returns."""
        ...


def apply_action(host: RankHost, action: MitigationAction, iteration: int, events: Any) -> Any:
    """Apply ``action`` at ``iteration`` on ``host`` (every process does, at the same boundary).
    A refused plan is a ``control_error`` event ("plan not applied: ...") and training goes on
    as it was; an applied one is a ``plan_applied`` event where the host announces it; an
    action no host knows is a ``control_error`` naming it. Returns what the host's
    ``change_topology`` or ``restart`` returned (None for a plan)."""
    if isinstance(action, MicrobatchPlan):
        try:
            fields = host.apply_plan(action, iteration)
        except PlanRefused as exc:  # agreed but impossible: every process refuses alike
            events.emit("control_error", rank=host.process, error=f"plan not applied: {exc}")
            return None
        if fields is not None:
            events.emit("plan_applied", **fields)
        return None
    if isinstance(action, TopologyChange):
        return host.change_topology(action, iteration)
    if isinstance(action, Restart):
        return host.restart(action, iteration)
    events.emit("control_error", rank=host.process, error=f"not applied by this training loop: {type(action).__name__}")
    return None


def versions() -> dict[str, str]:
    """What ran: Python, torch, megatron-core (the loaded one: a Megatron-LM checkout's where it
    is loaded), falconext."""
    import torch  # lazy: start-up time (the launcher imports megatron_lm.hooks: no torch there)

    try:
        from megatron.core import package_info  # lazy: run-time order (the loaded megatron-core, a checkout's)

        mcore = package_info.__version__
    except Exception:  # pragma: no cover - reported, not required
        mcore = "unknown"
    return {"python": platform.python_version(), "torch": torch.__version__, "megatron-core": mcore,
            "falconext": falconext.__version__}
