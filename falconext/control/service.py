"""The control plane's processes: ``python -m falconext.control.service controller|agent``.

The launcher starts one controller per job and one agent per node. The Redis URL (it
holds the password) comes from ``$FALCON_REDIS_URL``, never from the command line,
where any user of the machine could read it. Both loops are thin: the logic is in
:mod:`falconext.control.controller` and :mod:`falconext.control.agent`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from falconext.config import add_config_arguments, config_from_args
from falconext.control.bus import Bus
from falconext.control.client import CMD_STREAM, CONTROLLER_KEY, CTL_STREAM, LOCALIZED_STREAM, REDIS_URL_ENV
from falconext.control.controller import Controller
from falconext.control.eventlog import EventLog


def run_controller(url: str, job: str, world: int | None, events_path: str, cfg, stop: list[bool]) -> None:
    """Run the controller of job ``job`` on the bus at ``url`` until ``stop[0]`` turns True,
    appending its decisions to ``events_path``. A lost Redis is logged as an event and
    waited out (fail-open); a malformed message is dropped and counted, never fatal."""
    events = EventLog(events_path)
    lost = False

    def on_state(ok: bool, why: str) -> None:
        nonlocal lost
        if ok == lost:
            lost = not ok
            events.emit("controller_redis", connected=ok, reason=why)

    bus = Bus(url, job, on_state=on_state)
    # sessions of a restarted controller must not be taken for its predecessor's
    ctl = Controller(cfg, world, first_session=10_000 * (1 + int(time.time()) % 100_000))
    step = guarded(events)
    events.emit("controller_started", pid=os.getpid(), world=world)
    next_beat = 0.0
    dropped = 0
    try:
        while not stop[0]:
            if time.monotonic() >= next_beat:
                bus.beat(CONTROLLER_KEY, cfg.controller_timeout_s)
                next_beat = time.monotonic() + cfg.heartbeat_s
            outputs = []
            for _, msg in bus.read([CTL_STREAM], block_ms=100):
                outputs += step(ctl.handle, msg, time.time())
            outputs += step(ctl.tick, time.time())
            if bus.dropped > dropped:  # one event a round, however many: a burst must not flood the log
                events.emit("message_dropped", where="controller", count=bus.dropped - dropped, dropped=bus.dropped,
                            error=bus.errors[-1] if bus.errors else "")
                dropped = bus.dropped
            for out in outputs:
                if out.kind == "command":
                    bus.post(CMD_STREAM, out.message)
                elif out.kind == "localized":
                    bus.post(LOCALIZED_STREAM, out.message)
                else:
                    ev = dict(out.event)
                    events.emit(ev.pop("type"), **ev)
    finally:
        bus.close()
        events.close()


def guarded(events: EventLog):
    """A caller of controller steps (``handle``, ``tick``) that turns an exception into a
    ``controller_error`` event and no output, never the end of the controller; the
    caller's ``errors`` counts them."""

    def call(step, *args):
        try:
            return step(*args)
        except Exception as exc:  # a message or a state the controller cannot handle
            call.errors += 1
            events.emit("controller_error", error=repr(exc), errors=call.errors)
            return []

    call.errors = 0
    return call


def run_agent(url: str, job: str, node: int, stop: list[bool], ranks: set[int] | None = None) -> None:
    """Run node ``node``'s agent on the bus at ``url`` until ``stop[0]`` turns True,
    printing each change of its dropped and refused counts. ``ranks``: the ranks of this
    node (None: accept every rank)."""
    from falconext.control.agent import NodeAgent
    from falconext.validate.health import gpu_health

    agent = NodeAgent(Bus(url, job), node, gpu_health, ranks)
    said = (0, 0)
    while not stop[0]:
        agent.step()
        counts = (agent.bus.dropped, agent.refused)
        if counts != said:  # its log (agent<N>.log) says what it refused, as it happens
            errors = agent.bus.errors
            print(f"agent {node}: dropped {counts[0]} malformed message(s), refused {counts[1]} from other "
                  f"nodes' ranks; latest: {errors[-1] if errors else ''}", flush=True)
            said = counts
    agent.bus.close()


def watch_parent(stop: list[bool], every_s: float = 0.5) -> threading.Thread:
    """Set ``stop[0]`` once this process's parent (the launcher that supervises it) is
    gone, so a launcher killed with SIGKILL leaves no controller or agent behind; checked
    every ``every_s`` by a daemon thread, which it returns."""
    parent = os.getppid()

    def watch() -> None:
        while not stop[0]:
            if os.getppid() != parent:
                stop[0] = True
                return
            time.sleep(every_s)

    thread = threading.Thread(target=watch, name="falconext-parent-watch", daemon=True)
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> int:
    """Run a controller or an agent as its own process (the launcher's child) until SIGTERM
    or SIGINT; returns 0. The Redis URL comes from the environment, never argv; without
    it, prints one line and returns 2."""
    p = argparse.ArgumentParser(prog="falconext.control.service", description=__doc__.splitlines()[0])
    p.add_argument("role", choices=["controller", "agent"])
    p.add_argument("--job", required=True)
    p.add_argument("--world", type=int, default=None, help="ranks in the job (controller)")
    p.add_argument("--events", default=None, help="events.jsonl to append to (controller)")
    p.add_argument("--node", type=int, default=0, help="this agent's node")
    p.add_argument("--ranks", default=None, help="the ranks on this agent's node, comma-separated (agent)")
    add_config_arguments(p)
    args = p.parse_args(argv)
    url = os.environ.get(REDIS_URL_ENV)
    if not url:
        print(f"falconext.control.service: error: ${REDIS_URL_ENV} is not set", file=sys.stderr)
        return 2
    stop = [False]

    def _stop(*_):
        stop[0] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    watch_parent(stop)
    if args.role == "controller":
        if not args.events:
            print("falconext.control.service: error: the controller needs --events", file=sys.stderr)
            return 2
        run_controller(url, args.job, args.world, args.events, config_from_args(args), stop)
    else:
        try:
            ranks = None if args.ranks is None else {int(r) for r in args.ranks.split(",") if r.strip()}
        except ValueError:
            print(f"falconext.control.service: error: --ranks {args.ranks!r} is not a list of ranks", file=sys.stderr)
            return 2
        run_agent(url, args.job, args.node, stop, ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
