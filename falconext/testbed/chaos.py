"""Chaos mode: break falconext's own machinery on purpose, to show that training does not care.

``--chaos SPEC`` (``falconext train``) takes comma-separated actions:

- ``kill-redis@I``, ``kill-controller@I``, ``kill-agent:N@I``, ``kill-shard:K@I``: at loop
  iteration I, rank 0 sends SIGKILL to the control plane's Redis server, controller, node
  N's agent, or shard K of its Redis Cluster (``--falcon-redis-shards``; their pids are in
  the run's ``control.json``); the launcher's supervisor brings them back;
- ``drop:P``: each message a rank posts to the bus is lost with probability P;
- ``delay:MS``: each post waits MS milliseconds first (on the rank's control thread);
- ``corrupt:P``: each post is replaced, with probability P, by a damaged copy (cut short,
  a byte changed, or not JSON at all), which readers must refuse.

Every action taken is an event (``chaos``), so a run says what was done to it. Only the
control plane is attacked: the training, its collectives and the emulated device are
untouched, and detection never reads any of this.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
from dataclasses import dataclass
from typing import Any, Callable

KILL_TARGETS = ("redis", "controller", "agent", "shard")
_KILL = re.compile(r"^kill-(redis|controller|agent|shard)(?::(\d+))?@(\d+)$")
#: the kills that name a number: a node's agent, a cluster's shard
_NUMBERED = ("agent", "shard")


class ChaosError(ValueError):
    """A chaos specification that cannot be carried out; the message names the part."""


@dataclass(frozen=True)
class Kill:
    """One chaos kill: the control-plane process ``target`` (redis, controller, the agent of
    node ``node``, or shard ``node`` of a Redis Cluster) dies at ``iteration``."""

    target: str  # redis | controller | agent | shard
    iteration: int
    node: int | None = None  # agents and shards only

    @property
    def name(self) -> str:
        """The process's name in the control plane: ``redis``, ``controller``, ``agent<N>``
        or ``shard<K>``."""
        return "redis" if self.target == "redis" else self.target + (str(self.node) if self.node is not None else "")


@dataclass(frozen=True)
class ChaosSpec:
    """A chaos experiment: the kills, and the share of bus posts dropped, their delay (ms)
    and the share corrupted, drawn from ``seed``. The empty spec does nothing."""

    kills: tuple[Kill, ...] = ()
    drop: float = 0.0
    delay_ms: float = 0.0
    corrupt: float = 0.0
    seed: int = 0

    @property
    def bus(self) -> bool:
        """Whether posts to the bus are attacked."""
        return bool(self.drop or self.delay_ms or self.corrupt)

    def to_text(self) -> str:
        """The spec in ``--chaos`` syntax, which :func:`parse_chaos` reads back to an equal spec (empty for
        no chaos)."""
        parts = [f"kill-{k.target}{'' if k.node is None else f':{k.node}'}@{k.iteration}" for k in self.kills]
        parts += [f"{name}:{value:g}" for name, value in (("drop", self.drop), ("delay", self.delay_ms),
                                                           ("corrupt", self.corrupt)) if value]
        return ",".join(parts)


def parse_chaos(text: str | None, world: int | None = None, nodes: int | None = None) -> ChaosSpec:
    """A :class:`ChaosSpec` from ``--chaos`` text (empty or None: no chaos); a part that is
    not understood, a probability outside [0, 1], or an agent that does not exist is a
    :class:`ChaosError` naming it."""
    kills: list[Kill] = []
    values = {"drop": 0.0, "delay": 0.0, "corrupt": 0.0}
    for part in (p.strip() for p in (text or "").split(",")):
        if not part:
            continue
        m = _KILL.match(part)
        if m:
            target, node, it = m.group(1), m.group(2), int(m.group(3))
            if (node is not None) != (target in _NUMBERED):
                raise ChaosError(f"--chaos {part!r}: a number goes with kill-agent:N@I and kill-shard:K@I only")
            if target == "agent" and nodes is not None and int(node) >= nodes:
                raise ChaosError(f"--chaos {part!r}: the job has {nodes} node(s), 0..{nodes - 1}")
            kills.append(Kill(target, it, None if node is None else int(node)))
            continue
        name, sep, value = part.partition(":")
        if not sep or name not in values:
            raise ChaosError(f"--chaos {part!r}: expected kill-redis@I, kill-controller@I, kill-agent:N@I, "
                             "kill-shard:K@I, drop:P, delay:MS or corrupt:P")
        try:
            number = float(value.removesuffix("ms"))
        except ValueError:
            raise ChaosError(f"--chaos {part!r}: {value!r} is not a number") from None
        if name in ("drop", "corrupt") and not 0.0 <= number <= 1.0:
            raise ChaosError(f"--chaos {part!r}: a probability is in [0, 1]")
        if name == "delay" and not 0.0 <= number <= 10_000.0:
            raise ChaosError(f"--chaos {part!r}: a delay is 0 to 10000 ms")
        values[name] = number
    return ChaosSpec(tuple(kills), values["drop"], values["delay"], values["corrupt"])


def kill_now(kill: Kill, out: str) -> dict[str, Any]:
    """SIGKILL the process ``kill`` names, from the run's ``control.json``; the event's
    fields (``pid`` None: the process was not found, nothing was done)."""
    try:
        with open(os.path.join(out, "control.json")) as f:
            info = json.load(f)
    except (OSError, ValueError) as exc:
        return {"action": f"kill-{kill.name}", "pid": None, "error": f"control.json: {exc}"}
    if kill.target == "shard":
        shards = info.get("redis_shards") or []
        pid = shards[kill.node].get("pid") if kill.node is not None and kill.node < len(shards) else None
        if pid is None:
            return {"action": f"kill-{kill.name}", "pid": None,
                    "error": f"the control plane has {len(shards)} shards (--falcon-redis-shards)"}
    else:
        pid = info.get("redis_pid") if kill.target == "redis" else (info.get("pids") or {}).get(kill.name)
    fields: dict[str, Any] = {"action": f"kill-{kill.name}", "pid": pid}
    if isinstance(pid, int) and pid > 0:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError as exc:
            fields["error"] = str(exc)
    return fields


class BusChaos:
    """What happens to each message a rank posts (drop, delay, corrupt), drawn from a seeded
    generator; ``emit(type, **fields)`` records each action."""

    def __init__(self, spec: ChaosSpec, rank: int, emit: Callable[..., Any]) -> None:
        self.spec = spec
        self.rank = rank
        self.emit = emit
        self._rng = random.Random(spec.seed * 1_000_003 + rank)
        self.dropped = self.corrupted = 0
        if spec.delay_ms:  # every post is delayed: one event says so, not one per message
            emit("chaos", rank=rank, action="delay", delay_ms=spec.delay_ms)

    def fate(self, kind: str) -> str:
        """``drop``, ``corrupt`` or ``post`` for the next message of type ``kind``."""
        s = self.spec
        if s.drop and self._rng.random() < s.drop:
            self.dropped += 1
            self.emit("chaos", rank=self.rank, action="drop", message=kind, count=self.dropped)
            return "drop"
        if s.corrupt and self._rng.random() < s.corrupt:
            self.corrupted += 1
            self.emit("chaos", rank=self.rank, action="corrupt", message=kind, count=self.corrupted)
            return "corrupt"
        return "post"

    def damage(self, data: str) -> str:
        """A copy of an encoded message that no strict reader may accept."""
        how = self._rng.randrange(3)
        if how == 0:
            return data[: self._rng.randrange(1, max(2, len(data) - 1))]  # cut short
        if how == 1:
            return data.replace('"body":{', '"body":{"bogus":1,', 1)  # a field nobody declared
        return "".join(chr(self._rng.randrange(33, 127)) for _ in range(min(len(data), 64)))


__all__ = ["BusChaos", "ChaosError", "ChaosSpec", "Kill", "kill_now", "parse_chaos"]
