"""falconext's overhead as cost: CPU accounting, the on/off toggle, the summary's figures.

In-process and fast: a one-process gloo group stands in for a job, stand-ins replace the
torch.distributed functions under the tracer, a fake clock makes the hook estimator exact.
No assertion on speed; what is checked is that each figure measures what it claims.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist

from falconext.config import FalconConfig
from falconext.protocol.eventlog import EventLog
from falconext.protocol.commands import Suspend, ValidationPlan
from falconext.protocol.messages import SessionAck
from falconext.runtime.monitor import RankMonitor
from falconext.report import summary as report
from falconext.trace.hooks import CallTracer, HookCost


def _burn(seconds: float) -> None:
    """Keep this thread on a core for ``seconds`` of its own CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A one-process gloo group (what the tracer's group lookups need)."""
    if dist.is_initialized():
        yield
        return
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Stubbed:
    """torch.distributed.<name> replaced by ``stub`` for the duration (below a tracer)."""

    def __init__(self, name: str, stub: Any) -> None:
        self.name, self.stub = name, stub

    def __enter__(self) -> None:
        self.real = getattr(dist, self.name)
        setattr(dist, self.name, self.stub)

    def __exit__(self, *exc: Any) -> None:
        setattr(dist, self.name, self.real)


# --------------------------------------------------------------------------- hook cost


class _FakeClock:
    """Each read advances the clock by ``tick``; ``advance`` adds work."""

    def __init__(self, tick: float) -> None:
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _entries(cost: HookCost, clock: _FakeClock, n: int, body_s: float, inner_s: float) -> None:
    """``n`` wrapper entries, as a wrapper makes them: each costs ``body_s`` of its own
    around a wrapped call of ``inner_s``."""
    wrapped = cost.timed(lambda: clock.advance(inner_s))

    def sampled() -> None:
        clock.advance(body_s)
        wrapped()

    for _ in range(n):
        cost.left -= 1
        if cost.left <= 0:
            cost.run(sampled, (), {})


def test_hook_cost_estimate_scales_with_the_call_count_and_excludes_the_wrapped_call() -> None:
    clock = _FakeClock(tick=1.0)
    cost = HookCost(every=4, clock=clock, calibration=5)
    # an empty timed entry reads 3 ticks (t0 to t1) minus the inner call's 1 tick
    assert cost.bias_s == pytest.approx(2.0)
    assert (cost.calls, cost.samples, cost.seconds()) == (0, 0, 0.0)
    _entries(cost, clock, 1000, body_s=5.0, inner_s=100.0)
    assert cost.calls == 1000
    assert 1000 / 8 < cost.samples < 1000 / 2  # about one entry in four timed
    assert cost.seconds() == pytest.approx(5.0 * 1000)  # the 100 s inner calls are not in it
    _entries(cost, clock, 3000, body_s=5.0, inner_s=100.0)
    assert cost.calls == 4000
    assert cost.seconds() == pytest.approx(5.0 * 4000)
    assert cost.per_call_s() == pytest.approx(5.0)


def test_hook_cost_counts_entries_nested_in_a_timed_one() -> None:
    clock = _FakeClock(tick=0.0)
    cost = HookCost(every=1, clock=clock, calibration=0)

    def outer() -> None:
        _entries(cost, clock, 3, body_s=1.0, inner_s=0.0)  # entries made inside a timed entry

    cost.left -= 1
    assert cost.left <= 0
    cost.run(outer, (), {})
    assert cost.calls == 4
    assert cost.samples == 1  # the outer one: nested entries are not timed apart


def test_hook_cost_of_a_real_tracer_leaves_out_the_wrapped_call(world: None) -> None:
    """A wrapped call burning 2 ms of CPU must not show up in the hook figure."""
    calls = []

    def slow_all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        calls.append(1)
        _burn(0.002)

    tracer = CallTracer(0, sample_every=1)
    x = torch.ones(4)
    with _Stubbed("all_reduce", slow_all_reduce):
        tracer.install()
        try:
            for _ in range(20):
                dist.all_reduce(x)
        finally:
            tracer.uninstall()
    assert len(calls) == 20 and len(tracer.drain()) == 20
    assert tracer.cost.calls == 20 and tracer.cost.samples == 20
    assert 0.0 < tracer.cost.per_call_s() < 0.0005  # the wrapper's own us, not the 2 ms call


def test_proxy_waits_are_hook_entries(world: None) -> None:
    class Handle:
        def wait(self, timeout: Any = None) -> bool:
            return True

    def reduce_scatter(output: Any, input: Any, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
        return Handle() if async_op else None

    tracer = CallTracer(0, sample_every=1)
    x = torch.ones(4)
    with _Stubbed("reduce_scatter_tensor", reduce_scatter):
        tracer.install()
        try:
            for _ in range(5):
                dist.reduce_scatter_tensor(x, x, async_op=True).wait()
        finally:
            tracer.uninstall()
    records = tracer.drain()
    assert len(records) == 5 and all(r.t_end is not None for r in records)
    assert tracer.cost.calls == 10 and tracer.cost.samples == 10  # the call and its wait


# --------------------------------------------------------------------------- threads


def _monitor(tmp_path: Path, drain: Any, name: str) -> RankMonitor:
    events = EventLog(str(tmp_path / f"{name}.jsonl"))
    return RankMonitor(drain, FalconConfig(), 0, [], events, None, interval_s=0.01)


def test_monitor_cpu_reads_the_work_its_thread_does(tmp_path: Path) -> None:
    rounds = {"busy": 0, "idle": 0}

    def busy_drain() -> list:
        rounds["busy"] += 1
        _burn(0.003)
        return []

    def idle_drain() -> list:
        rounds["idle"] += 1
        return []

    busy, idle = _monitor(tmp_path, busy_drain, "busy"), _monitor(tmp_path, idle_drain, "idle")
    busy.start()
    idle.start()
    time.sleep(0.4)
    busy.stop()
    idle.stop()
    assert rounds["busy"] >= 5
    assert busy.cpu_seconds() >= 0.8 * 0.003 * rounds["busy"]  # each round burnt 3 ms
    assert busy.cpu_seconds() > 5 * idle.cpu_seconds()


def test_a_paused_monitor_does_not_drain(tmp_path: Path) -> None:
    drains = []
    mon = _monitor(tmp_path, lambda: drains.append(1) or [], "paused")
    mon.pause(True)
    mon.start()
    time.sleep(0.1)
    assert drains == []
    mon.pause(False)
    time.sleep(0.1)
    mon.stop()
    assert len(drains) >= 2


def test_client_thread_reads_its_cpu_clock() -> None:
    from falconext.control.client import RankClient

    class Runtime:
        def iteration(self) -> int:
            return -1

        def iter_s(self) -> float:
            return 0.0

    client = RankClient("redis://127.0.0.1:1/0", "job", 0, 0, FalconConfig(), Runtime(), lambda *a, **k: None)
    assert client.cpu_seconds() == 0.0
    client.start()
    time.sleep(0.3)
    client.stop()
    assert client.cpu_seconds() > 0.0


# --------------------------------------------------------------------------- set_enabled


class _FakeClient:
    """Records what the runtime posts to the control plane."""

    def __init__(self) -> None:
        self.posted: list[Any] = []

    def post(self, msg: Any) -> None:
        self.posted.append(msg)

    def cpu_seconds(self) -> float:
        return 0.0

    def stop(self) -> None:
        pass


@pytest.fixture
def runtime(world: None, tmp_path: Path) -> Iterator[Any]:
    from falconext.runtime.runtime import FalconRuntime

    (tmp_path / "calls").mkdir()
    events = EventLog(str(tmp_path / "events.jsonl"))
    rt = FalconRuntime(FalconConfig(control_plane=False), 0, 0, str(tmp_path), events, [])
    rt.client = _FakeClient()
    try:
        yield rt
    finally:
        rt.close()
        events.close()


def test_set_enabled_removes_and_reinstalls_the_tracer(runtime: Any) -> None:
    traced = dist.all_reduce
    assert runtime.tracer.installed and runtime.enabled
    runtime.before_iteration(0)
    runtime.set_enabled(False)
    assert not runtime.tracer.installed and dist.all_reduce is not traced
    assert runtime.monitor._paused and runtime.iter_s() == 0.0
    runtime.set_enabled(False)  # idempotent: nothing changes, nothing recorded
    assert runtime.toggles == [(0, False)]
    runtime.before_iteration(1)
    runtime.before_iteration(2)
    runtime.set_enabled(True)
    assert runtime.tracer.installed and not runtime.monitor._paused
    runtime.set_enabled(True)
    assert runtime.toggles == [(0, False), (2, True)]
    assert runtime.iterations_on == 1  # iteration 2, in the state it was left in
    dist.all_reduce(torch.ones(2))
    dist.barrier()
    assert runtime.tracer.cost.calls == 2


def test_turning_off_drops_an_armed_suspension_as_missed(runtime: Any) -> None:
    class Pending:
        iteration, session = 5, 7

        def run(self, end: float) -> None:
            raise AssertionError("a dropped suspension must not run")

    runtime._pending = Pending()
    runtime.before_iteration(5)
    assert runtime.tracer.trap.armed
    runtime.set_enabled(False)
    assert not runtime.tracer.trap.armed
    assert [(m.session, m.status) for m in runtime.client.posted if isinstance(m, SessionAck)] == [(7, "missed")]
    # while off, a suspend command is answered "missed" at once and nothing is armed
    nothing = ValidationPlan("all", [], 64, 1, 0, 1, 1, 1, 0)
    cmd = Suspend(8, 9, 4.0, validation=nothing)
    assert runtime.schedule(cmd) == 5
    runtime._pending = Pending()  # one that slipped in as falconext turned off
    runtime.before_iteration(6)
    assert not runtime.tracer.trap.armed and runtime._pending is None
    runtime.set_enabled(True)
    dist.barrier()  # nothing is held
    assert runtime.tracer.trap.holds == 0


def test_runtime_overhead_by_component(runtime: Any) -> None:
    runtime.before_iteration(0)
    for _ in range(10):
        dist.barrier()
    o = runtime.overhead()
    assert set(o["cpu_s"]) == {"hooks", "suspension", "monitor", "client", "total"}
    assert o["cpu_s"]["total"] == pytest.approx(sum(v for k, v in o["cpu_s"].items() if k != "total"), abs=1e-5)
    assert o["hook_calls"] == 10 and o["iterations"] == 1 and o["toggles"] == []
    json.dumps(o)


# --------------------------------------------------------------------------- summary


def _rank_files(out: Path, rank: int, times: list[float], overhead: dict[str, Any] | None, suffix: str = "",
                first: int = 0) -> None:
    measured = [(first + i, t, 1.0) for i, t in enumerate(times)]
    report.write_rank_files(str(out), rank, measured, {}, suffix, overhead=overhead)


def _overhead(rank: int, total: float, iterations: int, toggles: list | None = None) -> dict[str, Any]:
    return {"rank": rank, "cpu_s": {"hooks": total / 4, "monitor": total / 2, "client": total / 4, "suspension": 0.0,
                                    "total": total},
            "cpu_off_s": {"total": 0.5}, "iterations": iterations, "hook_calls": 30 * iterations,
            "hook_samples": iterations // 2, "toggles": toggles or []}


def test_finalize_puts_overhead_in_the_summary(tmp_path: Path) -> None:
    (tmp_path / "ranks").mkdir()
    (tmp_path / "run.json").write_text(json.dumps({"faults": [], "falcon_config": {}}))
    times = [1.0] + [0.5] * 9  # iteration 0 is warm-up
    _rank_files(tmp_path, 0, times, _overhead(0, 0.02, 10))
    _rank_files(tmp_path, 1, times, _overhead(1, 0.04, 10))
    summary = report.finalize(str(tmp_path))
    o = json.loads((tmp_path / "summary.json").read_text())["overhead"]
    assert o == summary["overhead"]
    assert o["per_iteration_s"]["total"] == {"mean": pytest.approx(0.003), "max": pytest.approx(0.004)}
    assert o["per_iteration_s"]["monitor"]["max"] == pytest.approx(0.002)
    assert o["ranks"]["1"]["total"] == pytest.approx(0.004) and o["ranks"]["1"]["hook_calls"] == 300
    assert o["iter_s"] == 0.5
    assert o["cpu_share"] == {"mean": pytest.approx(0.006), "max": pytest.approx(0.008)}
    assert o["toggle"] is None
    line = [ln for ln in report.format_summary(summary).splitlines() if "falconext CPU" in ln]
    assert len(line) == 1 and "0.60% mean, 0.80% max" in line[0]


def test_finalize_adds_up_attempts_and_splits_toggled_iterations(tmp_path: Path) -> None:
    (tmp_path / "ranks").mkdir()
    (tmp_path / "run.json").write_text(json.dumps({"faults": [], "falcon_config": {}}))
    toggles = [[0, False], [4, True], [8, False]]
    times = [1.0, 0.4, 0.4, 0.4, 9.0, 0.5, 0.5, 0.5, 9.0, 0.4]  # the toggles' own iterations pay extra
    _rank_files(tmp_path, 0, times, _overhead(0, 0.02, 4, toggles))
    _rank_files(tmp_path, 0, [0.5, 0.5], _overhead(0, 0.01, 2, [[10, True]]), suffix="-r1", first=10)
    o = report.finalize(str(tmp_path))["overhead"]
    assert o["ranks"]["0"]["iterations"] == 6 and o["ranks"]["0"]["off_total_s"] == pytest.approx(1.0)
    assert o["per_iteration_s"]["total"]["mean"] == pytest.approx(0.005)
    assert o["toggle"] == {"on_iter_s": 0.5, "off_iter_s": 0.4, "on_off_ratio": 1.25, "on_iterations": 4,
                           "off_iterations": 4}


def test_toggle_split_leaves_out_warm_up_and_each_phase_start() -> None:
    times = {it: float(it) for it in range(12)}
    on, off = report.toggle_split(times, [[2, False], [6, True]], skip=1, first=1)
    assert on == [1.0, 7.0, 8.0, 9.0, 10.0, 11.0]
    assert off == [3.0, 4.0, 5.0]


def test_no_overhead_files_no_overhead(tmp_path: Path) -> None:
    (tmp_path / "ranks").mkdir()
    (tmp_path / "run.json").write_text(json.dumps({"faults": [], "falcon_config": None}))
    _rank_files(tmp_path, 0, [1.0, 0.5], None)
    assert report.finalize(str(tmp_path))["overhead"] is None
    assert not any(os.path.basename(p).startswith("overhead") for p in os.listdir(tmp_path / "ranks"))
