"""The control plane around a real training job: operator validation, a suspension whose
controller never answers, a frozen then killed controller, and a Redis that dies and comes
back. One 4-rank run (TP1 x DP2 x PP2) on a Redis the test owns; the test plays operator
(and, once, a controller that sends "suspend" and dies) over the same bus."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

import pytest

from falconext.control.bus import Bus
from falconext.control.client import CMD_STREAM, CTL_STREAM, node_stream
from falconext.protocol.commands import Suspend, ValidateRequest, ValidationPlan
from falconext.control.redis_server import start_redis
from jobs import LANE, JobCache, host_paced

JOB = "e2e"
DEADLINE_S = 3.0


def read_events(out: Path) -> list[dict]:
    path = out / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(out: Path, pred, what: str, timeout: float = 30.0, proc=None) -> list[dict]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        evs = [e for e in read_events(out) if pred(e)]
        if evs:
            return evs
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def current_iteration(bus: Bus, timeout: float = 30.0) -> int:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        # the ranks' own posts to their nodes' agents (the controller trims the beats stream)
        beats = [m.iteration for _, m in bus.read([node_stream(0), node_stream(1)], block_ms=200, accept={"Heartbeat"})]
        if beats:
            return max(beats)
    raise AssertionError("no heartbeat from the ranks")


def _scenario(folder: Path) -> tuple[Path, dict[str, float]]:
    """The healthy PP2 job an operator validates, fed garbage, left suspended, whose
    controller hangs and dies and whose Redis dies and comes back; in the job lane."""
    out = folder / "run"
    folder.mkdir(parents=True, exist_ok=True)
    with LANE:
        redis = start_redis()
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", FALCON_REDIS_URL=redis.url, FALCON_JOB=JOB)
        cmd = [sys.executable, "-m", "falconext.cli", "train", "--no-report", "--nproc", "4", "--pp", "2", "--iters", "110",
               *host_paced(["--device-gflops", "4"]),
               "--out", str(out), "--falcon-suspend-deadline-s", str(DEADLINE_S)]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        marks: dict[str, float] = {}
        bus = Bus(redis.url, JOB)
        try:
            bus.seek(node_stream(0), "0-0")
            bus.seek(node_stream(1), "0-0")
            while current_iteration(bus) < 25:
                pass
            # 1. an operator asks for a validation of the healthy job
            assert bus.post(CTL_STREAM, ValidateRequest())
            wait_for(out, lambda e: e["type"] in ("localized", "localization_failed"), "operator validation", proc=proc)
            # 1b. garbage on both streams: dropped with a message, nothing else happens
            assert bus.post_raw(CMD_STREAM, {"m": "{not json"})
            assert bus.post_raw(CTL_STREAM, {"m": '{"v":1,"type":"Command","body":{"kind":"validate","deadline_s":NaN}}'})
            wait_for(out, lambda e: e["type"] == "message_dropped" and e.get("where") == "controller", "controller drop",
                     proc=proc)
            # 2. a controller that sends "suspend" and then dies: nobody ever says "go"
            plan = ValidationPlan("all", [], 64, 1, 0, 1, 1, 1, 0)  # nothing to run
            it = current_iteration(bus) + 4
            assert bus.post(CMD_STREAM, Suspend(1000, it, DEADLINE_S, validation=plan))
            wait_for(out, lambda e: e["type"] == "suspension" and e["session"] == 1000 and e["rank"] == 3,
                     "the orphaned suspension to expire", proc=proc)
            # 3. the controller hangs (SIGSTOP), then dies: the launcher restarts it
            pid = json.loads((out / "control.json").read_text())["pids"]["controller"]
            os.kill(pid, signal.SIGSTOP)
            wait_for(out, lambda e: e["type"] == "control_lost" and e["what"] == "controller", "controller loss", proc=proc)
            os.kill(pid, signal.SIGKILL)
            wait_for(out, lambda e: e["type"] == "control_restored" and e["what"] == "controller", "a new controller",
                     proc=proc)
            # 4. Redis dies and comes back
            marks["redis_down"] = time.time()
            redis.kill()
            wait_for(out, lambda e: e["type"] == "control_lost" and e["what"] == "redis", "redis loss", proc=proc)
            time.sleep(5.0)  # >= 5 iterations without Redis even at 0.6 s each
            redis.restart()
            marks["redis_up"] = time.time()
            wait_for(out, lambda e: e["type"] == "control_restored" and e["what"] == "redis", "redis back",
                     timeout=20, proc=proc)
            stdout, _ = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
            bus.close()
            redis.stop()
        assert proc.returncode == 0, stdout[-3000:]
        return out, marks


def control_scenario(jobs: JobCache) -> tuple[Path, dict[str, float]]:
    """The scenario's run, once per session (run ahead: conftest.py)."""
    return jobs.once("test_control_e2e scenario", _scenario)


#: the jobs this module reads, run ahead by the session (conftest.py)
AHEAD = (control_scenario,)


@pytest.fixture(scope="module")
def scenario(jobs):
    return control_scenario(jobs)


def test_operator_validation_of_a_healthy_job_names_nothing(scenario):
    out, _ = scenario
    # (host noise on the shared 2-core machine can also cause a real, reported fail-slow)
    (loc,) = [e for e in read_events(out) if e["type"] == "localized" and e["evidence"]["trigger"] == "operator"]
    assert loc["gpus"] == [] and loc["links"] == [], loc["evidence"]
    # whatever profiling suspected, validation ran and cleared it
    assert loc["evidence"]["gemm_gflops"] and not loc["evidence"]["missing"]


def test_corrupted_messages_are_dropped_and_named(scenario):
    out, _ = scenario
    evs = read_events(out)
    ranks = {e["rank"] for e in evs if e["type"] == "message_dropped" and "rank" in e}
    assert ranks == {0, 1, 2, 3}
    (ctl,) = [e for e in evs if e["type"] == "message_dropped" and e.get("where") == "controller"]
    assert "NaN" in ctl["error"]
    operator = [e for e in evs if e["type"] == "localized" and e["evidence"]["trigger"] == "operator"]
    assert len(operator) == 1  # the garbage "validate" did nothing


def test_a_suspension_nobody_ends_is_released_by_its_deadline(scenario):
    out, _ = scenario
    held = [e for e in read_events(out) if e["type"] == "suspension" and e["session"] == 1000]
    assert sorted(e["rank"] for e in held) == [0, 1, 2, 3]
    assert {e["outcome"] for e in held} == {"expired"}
    for e in held:
        assert DEADLINE_S - 0.1 <= e["pause_s"] <= DEADLINE_S + 1.0, e


def test_losing_the_controller_or_redis_is_logged_and_recovered(scenario):
    out, _ = scenario
    evs = read_events(out)
    for what in ("controller", "redis"):
        lost = {e["rank"] for e in evs if e["type"] == "control_lost" and e["what"] == what}
        back = {e["rank"] for e in evs if e["type"] == "control_restored" and e["what"] == what}
        assert lost == {0, 1, 2, 3} and back == {0, 1, 2, 3}, (what, lost, back)
    control = json.loads((out / "control.json").read_text())
    assert control["restarts"] == {"controller": 1}


def test_training_keeps_its_speed_without_redis(scenario):
    out, marks = scenario
    run = json.loads((out / "run.json").read_text())
    t0 = run["clock"]["time"]
    rows = [line.split(",") for line in (out / "iterations.csv").read_text().splitlines()[1:]]
    rank0 = sorted((int(r[1]), float(r[2])) for r in rows if r[0] == "0")
    t, down, before = t0, [], []
    for it, secs in rank0:
        if marks["redis_down"] + 0.5 <= t and t + secs <= marks["redis_up"]:
            down.append(secs)
        elif 20 <= it and t + secs < marks["redis_down"]:
            before.append(secs)
        t += secs
    assert len(down) >= 5 and len(before) >= 5, (len(down), len(before))
    # fail-open: docs/control-plane.md's "within 5%" is chaos_acceptance's figure (10 iterations after
    # the kill); this run, with the test's own checks beside it, measured 0.97 quiet and
    # 0.84 with two CPU hogs, and once 1.41 with other jobs' processes on the host
    # (2026-11-26): docs/control-plane.md states these, and the bound stays at 1.5x
    assert median(down) < 1.5 * median(before), (median(down), median(before))
