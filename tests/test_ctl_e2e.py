"""An operator steers one running emulated-device job with ``falconext ctl`` (issue 16).

One DP4 job (4 micro-batches of 1 per replica, rank 1's device 3x slow from iteration 50
to 68, only S2 allowed) and one operator thread that acts at iteration milestones it
reads from ``ctl status``:

1. after the warm-up: ``ctl status`` (timed, in its own process; the other commands run
   in the test's process), ``ctl mute``, ``ctl validate`` (the verdict: nothing slow
   yet), a metrics scrape;
2. the fault comes and the ranks detect it: the muted controller holds it
   (``fail_slow_muted``) and starts no localization;
3. once the fault is over: ``ctl set suspend_margin_iterations 8``, then ``ctl force s2
   --plan 4,6,3,3``, which must suspend 8 iterations ahead and apply on every rank;
4. ``ctl set suspend_margin_iterations 3``, ``ctl revert``: the even plan again;
5. ``ctl unmute``.

The assertions are separate tests over what the job and the thread left behind.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from falconext.ports import free_port
from falconext.cli import main
from falconext.config import FalconConfig
from falconext.control import ctl as ctl_mod
from jobs import events, host_paced

ITERS = 105
#: 3x: detected even when other jobs share the 2-core host (a 2x one was missed at 30% CV);
#: from 50, well after the operator's validation pause (about iteration 27) has left the
#: detector's baseline
FAULT = {"kind": "compute", "rank": 1, "factor": 3.0, "start": 50, "end": 68}
PLAN = [4, 6, 3, 3]
EVEN = [4, 4, 4, 4]
MARGIN = 8

#: the job lane held for the whole module (conftest.py: alone):
#: it drives a job by hand (an operator steering it live), and its in-process ctl calls swap
#: sys.stdout, which a test running beside it would share, so it is not run ahead
ALONE = True


def ctl(run: Path, *args: str) -> subprocess.CompletedProcess:
    """``falconext ctl`` in a process of its own, as an operator runs it."""
    return subprocess.run([sys.executable, "-m", "falconext.cli", "ctl", "--run", str(run), *args],
                          capture_output=True, text=True, timeout=90, env=dict(os.environ, PYTHONWARNINGS="ignore"))


def ctl_here(run: Path, *args: str) -> subprocess.CompletedProcess:
    """The same command line in the test's process: a Python start costs 0.3 s of CPU,
    which the job's four ranks on two cores would feel as noise in their iteration times."""
    out, err = io.StringIO(), io.StringIO()
    argv = ["ctl", "--run", str(run), *args]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


class Operator:
    """The thread that plays operator; what it saw goes into ``seen``."""

    def __init__(self, run: Path, port: int, proc: subprocess.Popen) -> None:
        self.run, self.port, self.proc = run, port, proc
        self.seen: dict = {}
        self.error: str | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)

    def status(self):
        with_session = ctl_mod.Session(ctl_mod.open_run(str(self.run)))
        try:
            return with_session.status()
        finally:
            with_session.close()

    def status_from(self, it: int, timeout: float = 30):
        """The first status in which every rank's heartbeat is from iteration ``it`` on."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            snap = self.status()
            if min(r["iteration"] for r in snap.ranks.values()) >= it:
                return snap
            time.sleep(0.2)
        raise AssertionError(f"no status with every rank past iteration {it}")

    def iteration(self) -> int:
        return min(r["iteration"] for r in self.status().ranks.values())

    def wait_iteration(self, it: int, timeout: float = 120) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                now = self.iteration()
                if now >= it:
                    return now
            except (ctl_mod.CtlError, ValueError):
                pass  # not started yet
            time.sleep(0.2)
        raise AssertionError(f"the job never reached iteration {it}")

    def wait_event(self, type_: str, until_iteration: int) -> dict | None:
        """The first event of ``type_``, or None once the job is at ``until_iteration``."""
        while self.proc.poll() is None:
            found = events(self.run, type_) if (self.run / "events.jsonl").exists() else []
            if found:
                return found[0]
            if self.iteration() >= until_iteration:
                return None
            time.sleep(0.2)
        return None

    def do(self, name: str, *args: str, own_process: bool = False) -> subprocess.CompletedProcess:
        t0 = time.monotonic()
        proc = (ctl if own_process else ctl_here)(self.run, *args)
        self.seen[name] = {"rc": proc.returncode, "out": proc.stdout, "err": proc.stderr,
                           "took_s": time.monotonic() - t0}
        assert proc.returncode == 0, (name, proc.stdout, proc.stderr)
        return proc

    def _main(self) -> None:
        try:
            self.wait_iteration(22)
            self.do("status", "status", own_process=True)
            t0 = time.monotonic()
            self.status()
            self.seen["status_in_process_s"] = time.monotonic() - t0
            self.do("mute", "mute")
            self.do("validate", "validate")
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5).read().decode()
            self.seen["scrape"] = text
            # judged by test_mute_holds_detections_until_unmute; the steps after go on anyway
            self.seen["held"] = self.wait_event("fail_slow_muted", until_iteration=FAULT["end"] + 4)
            self.wait_iteration(FAULT["end"] + 4)
            self.do("set8", "set", "suspend_margin_iterations", str(MARGIN))
            self.seen["force_issued_at"] = self.iteration()
            done = self.do("force", "force", "s2", "--plan", ",".join(map(str, PLAN)))
            self.seen["status_forced"] = self.status_from(_applied_at(done.stdout) + 1)
            self.do("set3", "set", "suspend_margin_iterations", "3")
            done = self.do("revert", "revert")
            self.seen["status_reverted"] = self.status_from(_applied_at(done.stdout) + 1)
            self.do("unmute", "unmute")
        except BaseException:  # noqa: BLE001 - reported by the tests
            self.error = traceback.format_exc()


@pytest.fixture(scope="module")
def steered(tmp_path_factory):
    out = tmp_path_factory.mktemp("ctl_e2e") / "run"
    out.mkdir()
    inject = out.parent / "faults.json"
    inject.write_text(json.dumps([FAULT]))
    port = free_port()
    cmd = [sys.executable, "-m", "falconext.cli", "train", "--nproc", "4", "--out", str(out), "--device", "emulated",
           "--no-report", "--iters", str(ITERS), "--global-batch-size", "16", "--micro-batch-size", "1",
           *host_paced(["--falcon-mitigation-strategies", "S2", "--falcon-metrics-port", str(port), "--inject", str(inject)])]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    op = Operator(out, port, proc)
    op.thread.start()
    stdout, _ = proc.communicate(timeout=400)
    op.thread.join(30)
    (out / "stdout.txt").write_text(stdout)
    (out / "operator.json").write_text(json.dumps(  # what the operator saw, for a failure's reader
        {k: v for k, v in op.seen.items() if isinstance(v, (dict, str, int, float, type(None)))}, indent=1))
    assert proc.returncode == 0, stdout[-3000:]
    return out, op


#: the longest a ctl command may take here before it counts as hung (a deadline, not a
#: speed claim: the command's latency is measured by examples/bench_ctl.py)
DEADLINE_S = 10.0


def _ok(op: Operator) -> None:
    assert op.error is None, op.error


def mitigations(out: Path) -> list[dict]:
    return [e for e in events(out, "mitigation") if e.get("trigger") == "operator"]


def test_status_describes_the_running_job(steered):
    """What ``ctl status`` says of a running job, in its own process. How fast it answers
    is examples/bench_ctl.py's to measure; here only a deadline, wide enough for a loaded
    host, that a hung command would miss."""
    out, op = steered
    _ok(op)
    st = op.seen["status"]
    assert op.seen["status_in_process_s"] < DEADLINE_S, op.seen["status_in_process_s"]
    assert st["rc"] == 0 and st["took_s"] < DEADLINE_S, st
    assert "job " in st["out"] and "4 ranks on 2 node(s), TP1 x DP4 x PP1; controller tracking" in st["out"]
    assert "micro-batches per replica [4, 4, 4, 4] (even)" in st["out"]


def test_validate_prints_the_verdict(steered):
    out, op = steered
    _ok(op)
    v = op.seen["validate"]["out"].splitlines()
    assert v[0].startswith("validation started") and v[1].startswith("slow GPUs [], slow links []; GEMM GFLOP/s")
    (loc,) = [e for e in events(out, "localized") if e["evidence"]["trigger"] == "operator"]
    assert loc["gpus"] == [] and sorted(loc["evidence"]["gemm_gflops"]) == ["0", "1", "2", "3"]


def test_force_s2_applies_at_the_agreed_iteration_on_every_rank(steered):
    out, op = steered
    _ok(op)
    forced, reverted = mitigations(out)
    assert forced["strategy"] == "S2" and forced["plan"] == PLAN and "acks_lost" not in forced
    (state,) = [e for e in events(out, "controller_state")
                if e["new"] == "mitigating" and e["session"] <= forced["session"] and e["time"] <= forced["time"]][-1:]
    assert forced["iteration"] == state["iteration"] + 1
    applied = [e for e in events(out, "plan_applied")]
    assert [(e["iteration"], e["plan"]) for e in applied] == [(forced["iteration"], PLAN), (reverted["iteration"], EVEN)]
    # every rank runs its replica's share, as its own heartbeat says
    snap = op.seen["status_forced"]
    assert {r: row["micro"] for r, row in snap.ranks.items()} == {str(r): m for r, m in enumerate(PLAN)}
    assert snap.plan["microbatches"] == PLAN and snap.plan["even"] is False
    assert "S2 applied from iteration" in op.seen["force"]["out"]
    # the device each rank ran on says how many micro-batches it computed in every
    # iteration: the plan from the agreed iteration on every rank, the even one again
    # from the revert's
    for r in range(4):
        dev = json.loads((out / "ranks" / f"device-rank{r}.json").read_text())
        runs = {int(i): round(v["compute_s"] / (dev["microbatch_s"] * v["factor"]), 3)
                for i, v in dev["iterations"].items()}
        assert all(runs[i] == 4 for i in range(forced["iteration"] - 5, forced["iteration"])), (r, runs)
        assert all(runs[i] == PLAN[r] for i in range(forced["iteration"], reverted["iteration"])), (r, runs)
        assert all(runs[i] == 4 for i in range(reverted["iteration"], ITERS)), (r, runs)
    # iterations.csv: the replica with 6 micro-batches sets the pace: 6/4 of the even plan's
    # on a quiet host (1.5 measured); when other jobs load the 2-core host, the ranks' real
    # CPU work outlasts their device time and blurs it (1.12 seen), so only the direction
    # is held here
    times = _iteration_times(out)
    uneven = statistics.median(times[i] for i in range(forced["iteration"] + 1, reverted["iteration"]))
    back = statistics.median(times[i] for i in range(reverted["iteration"] + 1, ITERS))
    assert uneven > 1.05 * back, (uneven, back)


def test_revert_returns_to_the_even_plan(steered):
    out, op = steered
    _ok(op)
    forced, reverted = mitigations(out)
    assert reverted["strategy"] == "revert" and reverted["plan"] == EVEN and reverted["iteration"] > forced["iteration"]
    snap = op.seen["status_reverted"]
    assert {row["micro"] for row in snap.ranks.values()} == {4} and snap.plan["even"] is True


def test_set_changes_the_margin_of_the_next_suspension(steered):
    out, op = steered
    _ok(op)
    (s8, s3) = events(out, "threshold_set")
    assert (s8["name"], s8["old"], s8["new"]) == ("suspend_margin_iterations", 3, MARGIN)
    assert (s3["old"], s3["new"]) == (MARGIN, 3)
    forced, reverted = mitigations(out)
    states = [e for e in events(out, "controller_state") if e["new"] == "mitigating"]
    assert [e["margin"] for e in states] == [MARGIN, 3]
    # the forced plan's suspension lay at least MARGIN iterations past where the job was
    assert forced["iteration"] - 1 >= op.seen["force_issued_at"] + MARGIN


def test_mute_holds_detections_until_unmute(steered):
    out, op = steered
    _ok(op)
    evs = events(out)
    (mute,) = [e for e in evs if e["type"] == "operator_command" and e["command"] == "mute"]
    (unmute,) = [e for e in evs if e["type"] == "operator_command" and e["command"] == "unmute"]
    assert mute["accepted"] and unmute["accepted"] and mute["at"] < unmute["at"]
    # the ranks detected the fault; the muted controller held it instead of localizing it
    detected = [e for e in evs if e["type"] == "fail_slow" and mute["time"] < e["time"] < unmute["time"]]
    # no skip on a loaded host: the job's processes run ahead of other work (nice -10,
    # falconext/testbed/priority.py), so its devices keep their time beside it
    device = json.loads((out / "summary.json").read_text())["device"]
    assert detected, f"the ranks detected no fail-slow while muted (overrun share {device['worst_rank_overrun_share']})"
    held = [e for e in evs if e["type"] == "fail_slow_muted"]
    assert held and all(mute["time"] < e["time"] < unmute["time"] for e in held)
    started = [e for e in evs if e["type"] == "controller_state" and e.get("trigger") == "fail_slow"
               and mute["time"] < e["time"] < unmute["time"]]
    assert not started


def test_every_command_is_an_event(steered):
    out, op = steered
    _ok(op)
    cmds = [(e["command"], e["accepted"]) for e in events(out, "operator_command")]
    assert cmds == [("mute", True), ("validate", True), ("set", True), ("mitigate", True), ("set", True), ("mitigate", True),
                    ("unmute", True)]


def test_metrics_scrape_matches_the_estimates(steered):
    out, op = steered
    _ok(op)
    fams = {f.name: f for f in text_string_to_metric_families(op.seen["scrape"])}
    est = {s.labels["rank"]: s.value for s in fams["falconext_rank_estimated_iteration_seconds"].samples}
    upto = {s.labels["rank"]: int(s.value) for s in fams["falconext_rank_estimate_iteration"].samples}
    assert sorted(est) == ["0", "1", "2", "3"]
    rows = _estimates(out)
    for r, value in est.items():
        window = [rows[(int(r), i)] for i in range(upto[r] - 9, upto[r] + 1) if (int(r), i) in rows]
        assert len(window) >= 8, (r, upto[r])
        assert abs(value - statistics.median(window)) <= 0.02 * value, (r, value, window)
    # the loop's time: a heartbeat at iteration `at` carries the median of the rank's last
    # beat_iter_window whole iterations, at-w .. at-1, as the loop measured them (one later
    # where the next iteration began between the client's two reads). A 13-iteration
    # window held to 10% failed beside two CPU hogs (11.8%): it was not the heartbeat's
    w = FalconConfig().beat_iter_window
    loop = {s.labels["rank"]: s.value for s in fams["falconext_rank_iteration_seconds"].samples}
    at = {s.labels["rank"]: int(s.value) for s in fams["falconext_rank_iteration"].samples}
    measured = _rank_times(out)
    for r, value in loop.items():
        medians = [statistics.median(measured[(int(r), i)] for i in range(at[r] - w + k, at[r] + k)) for k in (0, 1)]
        assert min(abs(value - m) for m in medians) <= 1e-3 * value, (r, value, medians)


def test_progress_lines_and_the_summary(steered):
    out, _ = steered
    text = (out / "stdout.txt").read_text()
    lines = [x for x in text.splitlines() if x.startswith("falconext: progress: iteration ")]
    assert 3 <= len(lines) <= 40, lines  # every 10 iterations, 5 s, or a change (at most every 2 s)
    assert "s/iter, controller" in lines[-1] and "latest event:" in lines[-1]
    assert "median" in text and "s/iter" in text  # the run's own summary is still printed


def test_access_file_is_marked_ended(steered):
    out, _ = steered
    info = json.loads((out / "access.json").read_text())
    assert info["ended"] is not None and "url" not in info
    assert os.stat(out / "access.json").st_mode & 0o777 == 0o600
    proc = ctl(out, "status")
    assert proc.returncode == 2 and "the job has ended" in proc.stderr


def _applied_at(text: str) -> int:
    """The iteration ``ctl force`` / ``ctl revert`` said the plan applies from."""
    import re

    m = re.search(r"applied from iteration (\d+)", text)
    assert m, text
    return int(m.group(1))


def _iteration_times(out: Path) -> dict[int, float]:
    """iteration -> the slowest rank's loop time (every rank waits for it)."""
    import csv

    got: dict[int, float] = {}
    with open(out / "iterations.csv", newline="") as f:
        for row in csv.DictReader(f):
            it = int(row["iteration"])
            got[it] = max(got.get(it, 0.0), float(row["iter_time_s"]))
    return got


def _rank_times(out: Path) -> dict[tuple[int, int], float]:
    import csv

    with open(out / "iterations.csv", newline="") as f:
        return {(int(r["rank"]), int(r["iteration"])): float(r["iter_time_s"]) for r in csv.DictReader(f)}


def _estimates(out: Path) -> dict[tuple[int, int], float]:
    import csv

    with open(out / "estimates.csv", newline="") as f:
        return {(int(r["rank"]), int(r["iteration"])): float(r["iter_time_s"]) for r in csv.DictReader(f)}
