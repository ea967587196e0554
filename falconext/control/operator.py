"""The operator desk: what operators (``falconext ctl``) may ask the controller, and what
they changed (:class:`OperatorDesk`).

Operators send :data:`OPERATOR_COMMANDS`: validate now, apply or revert a mitigation,
mute and unmute, set a threshold. Every one is an ``operator_command`` event naming the
command, its arguments, the time and whether it was accepted (a refusal says why), and,
when the command carries an ``id``, a :class:`CommandReply` (:meth:`OperatorDesk.record`).
While muted, the controller keeps tracking (heartbeats, scores, status) but starts no
episode on a fail-slow report (``fail_slow_muted``: it is held, and taken up at
``unmute`` if the rank has not reported its end meanwhile) and its planner neither
observes nor decides. What operators changed (mute, thresholds) is kept as plain data
that a restarted controller takes up again (:meth:`OperatorDesk.state`,
:meth:`OperatorDesk.restore`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection, Mapping

from falconext.config import ConfigError, FalconConfig, field_value
from falconext.protocol.actions import MicrobatchPlan, MitigationAction, Restart, TopologyChange
from falconext.protocol.codec import command_args
from falconext.protocol.commands import MitigateRequest, MuteRequest, OperatorCommand, UnmuteRequest, ValidateRequest
from falconext.protocol.messages import CommandReply, FailSlowReport, Heartbeat
from falconext.control.outputs import Output, event
from falconext.mitigate.microbatch import plan_microbatches
from falconext.mitigate.mitigation import replica_view_in
from falconext.model.roles import check_roles

def refusal(reason: str) -> Output:
    """The ``operator_ignored`` event that refuses an operator's command, saying why."""
    return event("operator_ignored", reason=reason)


@dataclass
class Taken:
    """What the desk made of an operator's command: the config after it, its events, the
    reply's text, and what the controller must do beyond the desk: start a validation
    (``validate``), apply an ``action``, take up the reports held while muted (``unmuted``)."""

    cfg: FalconConfig
    outputs: list[Output] = field(default_factory=list)
    text: str = ""
    validate: bool = False
    action: MitigationAction | None = None
    unmuted: list[FailSlowReport] | None = None


class OperatorDesk:
    """Mute, the fail-slow reports held while muted, and the thresholds operators set.
    ``settable``: the names ``set`` may change (the others are read by the ranks or at
    start-up, and ``set`` refuses them rather than pretend)."""

    def __init__(self, settable: Collection[str]) -> None:
        """Not muted, nothing held, nothing set."""
        self.settable = settable
        #: operator's mute: no new episode, no planner decision (tracking goes on)
        self.muted = False
        #: fail-slow reports held while muted, by rank (taken up at unmute if still open)
        self.held: dict[int, FailSlowReport] = {}
        #: thresholds operators set at run time (name -> value), for a restarted controller
        self.settings: dict[str, Any] = {}

    def hold(self, rep: FailSlowReport, episode_open: bool) -> list[Output] | None:
        """A fail-slow report while muted with no episode open is held (a
        ``fail_slow_muted`` event, once per event); the end of one held is taken (nothing
        to take up). Returns None for a report the desk does not hold."""
        held = self.held.get(rep.rank)
        if rep.end is not None and held is not None and held.event_id == rep.event_id:
            del self.held[rep.rank]  # over while muted: nothing to take up
            return []
        if rep.end is None and self.muted and not episode_open:
            self.held[rep.rank] = rep
            if held is not None and held.event_id == rep.event_id:
                return []  # a ladder update of a fail-slow already held
            return [event("fail_slow_muted", rank=rep.rank, onset=rep.onset, event_id=rep.event_id,
                          slowdown=rep.slowdown)]
        return None

    def take(self, cmd: OperatorCommand, cfg: FalconConfig, busy: str | None, beats: Mapping[int, Heartbeat]) -> Taken:
        """One operator command (one of :data:`OPERATOR_COMMANDS`): ``validate`` and
        ``mitigate`` are refused while the controller is ``busy`` (why; None: it is not),
        and ``mitigate`` when its action is (:func:`operator_action`); ``mute``,
        ``unmute`` and ``set`` are the desk's own."""
        args = {k: v for k, v in command_args(cmd).items() if k != "id"}
        if isinstance(cmd, (ValidateRequest, MitigateRequest)) and busy is not None:
            return Taken(cfg, [refusal(busy)])
        if isinstance(cmd, ValidateRequest):
            return Taken(cfg, validate=True)
        if isinstance(cmd, MitigateRequest):
            action = operator_action(args, beats, cfg.max_microbatches_per_replica or None)
            if isinstance(action, str):
                return Taken(cfg, [refusal(action)])
            return Taken(cfg, [event("operator_mitigate", strategy=cmd.strategy)], action=action)
        if isinstance(cmd, MuteRequest):
            out, text = self.mute()
            return Taken(cfg, out, text)
        if isinstance(cmd, UnmuteRequest):
            held = self.unmute()
            if held is None:
                return Taken(cfg, [], "not muted")
            text = "unmuted" + (f"; fail-slow reports of ranks {[r.rank for r in held]} taken up" if held else "")
            return Taken(cfg, [event("unmuted", held=[r.rank for r in held])], text, unmuted=held)
        cfg, out, text = self.set_threshold(cfg, args)
        return Taken(cfg, out, text)

    def mute(self) -> tuple[list[Output], str]:
        """Mute (a ``muted`` event, unless already muted) and the reply's text."""
        text = "already muted" if self.muted else "muted: fail-slow reports are held, the planner waits"
        out = [] if self.muted else [event("muted")]
        self.muted = True
        return out, text

    def unmute(self) -> list[FailSlowReport] | None:
        """Unmute: the reports held meanwhile, oldest first (None: not muted)."""
        if not self.muted:
            return None
        self.muted = False
        held = sorted(self.held.values(), key=lambda r: (r.time, r.rank))
        self.held.clear()
        return held

    def set_threshold(self, cfg: FalconConfig, args: Mapping[str, Any]) -> tuple[FalconConfig, list[Output], str]:
        """``set``: one of the settable names (``args["name"]``) to a value of its type
        (``args["value"]``), checked by the config itself. Returns the config the next
        decision uses (``cfg`` itself when refused), the events and the reply's text."""
        name, value = args.get("name"), args.get("value")
        if not isinstance(name, str):
            return cfg, [refusal(f"set needs a threshold name, got {name!r}")], ""
        try:
            value = field_value(name, value)
            if name not in self.settable:
                raise ConfigError(f"{name} is read by the ranks or at start-up, not by the controller's decisions; "
                                  "set it with --falcon-" + name.replace("_", "-") + " when the job starts")
            new = cfg.replace(**{name: value})
        except ConfigError as exc:
            return cfg, [refusal(str(exc))], ""
        old = getattr(cfg, name)
        self.settings[name] = value
        return new, [event("threshold_set", name=name, old=old, new=value)], f"{name}: {old!r} -> {value!r}"

    def state(self) -> dict[str, Any]:
        """What operators changed (mute, thresholds set), as plain JSON data."""
        return {"muted": self.muted, "set": dict(self.settings)}

    def restore(self, cfg: FalconConfig, state: Any) -> tuple[FalconConfig, list[Output]]:
        """Take up a predecessor's :meth:`state` (checked like the commands were: what does
        not check out is left out and named in the event). Returns the config with the
        thresholds set, and the event."""
        if not isinstance(state, dict):
            return cfg, [event("operator_state_refused", reason=f"not an operator state: {state!r}")]
        skipped: dict[str, str] = {}
        settings = state.get("set") if isinstance(state.get("set"), dict) else {}
        for name, value in settings.items():
            cfg, out, _ = self.set_threshold(cfg, {"name": name, "value": value})
            refused = [o.event["reason"] for o in out if o.event.get("type") == "operator_ignored"]
            if refused:
                skipped[str(name)] = refused[0]
        self.muted = state.get("muted") is True
        return cfg, [event("operator_state_restored", muted=self.muted, set=dict(self.settings),
                           **({"skipped": skipped} if skipped else {}))]

    def record(self, cmd: OperatorCommand, now: float, out: list[Output], text: str, session: int) -> list[Output]:
        """The ``operator_command`` event for ``cmd`` (accepted unless ``out`` holds a
        refusal, whose reason it names), then ``out``, then, when the command carries an
        ``id``, the CommandReply (the refusal's reason, or ``text``)."""
        cid = cmd.id
        args = {k: v for k, v in command_args(cmd).items() if k != "id"}
        refused = next((o.event.get("reason") for o in out
                        if o.kind == "event" and o.event.get("type") == "operator_ignored"), None)
        record = event("operator_command", command=cmd.KIND, args=args, at=round(now, 3),
                       accepted=refused is None, **({"reason": refused} if refused is not None else {}),
                       **({"id": cid} if isinstance(cid, str) else {}))
        out = [record] + out
        if isinstance(cid, str) and cid:
            out.append(Output("reply", CommandReply(cid, cmd.KIND, refused is None,
                                                    str(refused) if refused is not None else text, now, session)))
        return out


def operator_action(args: Mapping[str, Any], beats: Mapping[int, Heartbeat],
                    max_per_replica: int | None) -> MitigationAction | str:
    """The action an operator's ``mitigate`` asks for, or why it is refused: S2 (a given
    ``plan``, or the balanced one from the heartbeats), ``revert`` (the even plan), S3 (a
    permutation ``roles`` of the ranks) or S4 (``exclude_nodes``)."""
    strategy = args.get("strategy")
    if strategy in ("S2", "revert"):
        view = replica_view_in(beats)
        if view is None:
            return "replica layout not known yet (no heartbeats)"
        n = len(view.plan)
        plan = args.get("plan")
        if strategy == "revert":
            plan = [view.total // n] * n
        elif plan is None:
            try:
                plan = plan_microbatches(view.times, view.total, max_per_replica)
            except ValueError as exc:
                return f"no plan: {exc}"
        if (not isinstance(plan, list) or len(plan) != n or sum(plan) != view.total
                or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in plan)):
            return f"plan {plan!r} must give {n} replicas >= 1 each, {view.total} in all"
        return MicrobatchPlan(strategy, plan)
    if strategy == "S3":
        roles = args.get("roles")
        try:
            return TopologyChange(list(check_roles(roles, len(beats))))
        except ValueError:
            return f"roles {roles!r} must be a permutation of the {len(beats)} ranks"
    if strategy == "S4":
        nodes = args.get("exclude_nodes", [])
        if not isinstance(nodes, list) or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in nodes):
            return f"exclude_nodes {nodes!r} must be node numbers"
        return Restart(nodes, reason="operator")
    return f"unknown strategy {strategy!r} (S2, S3, S4 or revert)"
