"""The rank host seam (falconext/runtime/host.py): one dispatcher applies the controller's
actions on whichever training loop hosts falconext, refusing and reporting alike."""

from __future__ import annotations

from typing import Any

from falconext.protocol.actions import MicrobatchPlan, Restart, TopologyChange
from falconext.runtime.host import PlanRefused, apply_action, versions


class Events:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def emit(self, kind: str, **fields: Any) -> None:
        self.lines.append((kind, fields))


class Loop:
    """A training loop's side of the seam: keeps what it was asked to do."""

    def __init__(self, process: int, announce: bool = True, refuse: str | None = None) -> None:
        self.process, self.announce, self.refuse = process, announce, refuse
        self.plan: list[int] | None = None
        self.calls: list[tuple[str, int]] = []

    def apply_plan(self, action: MicrobatchPlan, iteration: int) -> dict[str, Any] | None:
        if self.refuse:
            raise PlanRefused(self.refuse)
        self.plan = list(action.plan)
        return {"iteration": iteration + 1, "plan": self.plan} if self.announce else None

    def change_topology(self, action: TopologyChange, iteration: int) -> str:
        self.calls.append(("S3", iteration))
        return "switched"

    def restart(self, action: Restart, iteration: int) -> str:
        self.calls.append(("S4", iteration))
        return "request"


def test_a_plan_is_put_in_force_and_announced_where_the_host_announces_it() -> None:
    events, loop = Events(), Loop(0)
    assert apply_action(loop, MicrobatchPlan("S2", [3, 5]), 40, events) is None
    assert loop.plan == [3, 5]
    assert events.lines == [("plan_applied", {"iteration": 41, "plan": [3, 5]})]
    quiet_events, quiet = Events(), Loop(1, announce=False)
    apply_action(quiet, MicrobatchPlan("S2", [3, 5]), 40, quiet_events)
    assert quiet.plan == [3, 5] and quiet_events.lines == []


def test_a_refused_plan_is_one_control_error_and_training_goes_on_as_it_was() -> None:
    events, loop = Events(), Loop(2, refuse="the data loader does not draw from the planned sampler")
    assert apply_action(loop, MicrobatchPlan("S2", [3, 5]), 40, events) is None
    assert loop.plan is None
    assert events.lines == [("control_error", {"rank": 2, "error": "plan not applied: the data loader does not "
                                               "draw from the planned sampler"})]


def test_s3_and_s4_go_to_the_host_and_its_answer_comes_back() -> None:
    events, loop = Events(), Loop(0)
    assert apply_action(loop, TopologyChange([1, 0]), 50, events) == "switched"
    assert apply_action(loop, Restart([1], reason="slow"), 60, events) == "request"
    assert loop.calls == [("S3", 50), ("S4", 60)] and events.lines == []


def test_an_action_no_host_knows_is_named_in_one_line() -> None:
    class Other:
        pass

    events, loop = Events(), Loop(3)
    assert apply_action(loop, Other(), 7, events) is None  # type: ignore[arg-type]
    assert events.lines == [("control_error", {"rank": 3, "error": "not applied by this training loop: Other"})]


def test_versions_name_what_ran() -> None:
    v = versions()
    assert set(v) == {"python", "torch", "megatron-core", "falconext"} and all(v.values())
