"""``falconext ctl`` and the metrics endpoint against a real controller process loop and
a real, private Redis, without training: the test plays four ranks' heartbeats on the
controller's stream (what the node agents forward) and drives the real command line.

Bad input is checked here too: a directory that is not a run, a job that has ended or does
not answer, a wrong password, an access file others can read, plans and values of the
wrong shape; each is one line on stderr and a non-zero status, and changes nothing."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from falconext.ports import free_port
from falconext.cli import main
from falconext.config import FalconConfig
from falconext.control.bus import Bus
from falconext.control.client import CTL_STREAM
from falconext.protocol.messages import FailSlowReport, Heartbeat
from falconext.control.plane import ACCESS_FILE, write_private_json
from falconext.control.redis_server import start_redis
from falconext.control.service import run_controller

JOB = "ctltest"
ITER_S = {0: 0.41, 1: 0.42, 2: 0.43, 3: 0.44}
EST_S = {0: 0.40, 1: 0.405, 2: 0.41, 3: 0.415}


def ctl_process(run: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """``falconext ctl`` as an operator runs it: its own process."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "falconext.cli", "ctl", "--run", str(run), *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def ctl(run: Path, *args: str) -> subprocess.CompletedProcess:
    """The same command line in this process (a process start costs 0.4 s on the 2-core
    host); an exception that the command line does not turn into one line fails the test."""
    out, err = io.StringIO(), io.StringIO()
    argv = ["ctl", "--run", str(run), *args]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def one_line_error(proc: subprocess.CompletedProcess, code: int, *words: str) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def read_events(run: Path, type_: str | None = None) -> list[dict]:
    evs = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]
    return [e for e in evs if type_ is None or e["type"] == type_]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A run directory with access.json, a controller loop on a real Redis (metrics on),
    and four ranks' heartbeats every 0.1 s."""
    run = tmp_path_factory.mktemp("ctl") / "run"
    run.mkdir()
    redis = start_redis()
    port = free_port()
    cfg = FalconConfig(metrics_port=port, link_baseline_iteration=0, profile_timeout_s=1.0)
    write_private_json(str(run / ACCESS_FILE), {"job": JOB, "url": redis.url, "world": 4, "ended": None})
    stop = [False]
    ctl_thread = threading.Thread(target=run_controller,
                                  args=(redis.url, JOB, 4, str(run / "events.jsonl"), cfg, stop), daemon=True)
    ctl_thread.start()
    bus = Bus(redis.url, JOB)
    it = [0]
    sent: dict[int, float] = {}  # iteration -> the time its heartbeats carry

    def beats() -> None:
        while not stop[0]:
            it[0] += 1
            sent[it[0]] = now = time.time()
            for r in range(4):
                bus.post(CTL_STREAM, Heartbeat(r, r // 2, it[0], ITER_S[r], now, replica=r, mb_s=0.05, micro=4,
                                               role=r, stage=0, tp=1, pp=1, score_iteration=it[0] - 1,
                                               est_iter_s=EST_S[r], compute_s=0.3, wait_s=EST_S[r] - 0.3))
            time.sleep(0.1)

    feeder = threading.Thread(target=beats, daemon=True)
    feeder.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        proc = ctl(run, "status", "--json")
        if proc.returncode == 0 and len(json.loads(proc.stdout)["ranks"]) == 4:
            break
        time.sleep(0.2)
    yield {"run": run, "redis": redis, "bus": bus, "port": port, "it": it, "sent": sent}
    stop[0] = True
    feeder.join(5)
    ctl_thread.join(5)
    bus.close()
    redis.stop()


def test_access_file_is_private(job):
    st = os.stat(job["run"] / ACCESS_FILE)
    assert st.st_mode & 0o777 == 0o600


def test_status_describes_the_job_in_process_and_in_its_own(job):
    """What ``ctl status`` answers, called here and as its own process (how fast: the
    benchmark examples/bench_ctl.py; here a deadline a hung command would miss)."""
    t0 = time.monotonic()
    proc = ctl(job["run"], "status")
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    assert took < 10.0, f"ctl status took {took:.2f} s to answer: hung?"
    own = ctl_process(job["run"], "status")
    assert own.returncode == 0 and own.stdout.splitlines()[0] == proc.stdout.splitlines()[0], own.stderr
    out = proc.stdout
    assert f"job {JOB}: 4 ranks on 2 node(s), TP1 x DP4 x PP1; controller tracking" in out
    assert "micro-batches per replica [4, 4, 4, 4] (even)" in out
    snap = json.loads(ctl(job["run"], "status", "--json").stdout)
    assert sorted(snap["ranks"]) == ["0", "1", "2", "3"]
    assert snap["ranks"]["3"]["iter_s"] == ITER_S[3] and snap["ranks"]["3"]["est_iter_s"] == EST_S[3]
    assert snap["ranks"]["3"]["score"] is not None
    # the heartbeat's age when the status was published (not a bound on how loaded the host is)
    row = snap["ranks"]["0"]
    assert row["age_s"] == pytest.approx(snap["time"] - job["sent"][row["iteration"]], abs=0.0015)
    assert 0 <= job["it"][0] - snap["ranks"]["0"]["iteration"] <= 25  # published every second, 10 beats a second


def test_status_all_gives_every_rank_s_row_a_large_job_s_status_leaves_out(job):
    """With listed_ranks 2 the status lists the 2 slowest of 4; ``status --all`` asks the
    controller for every rank's row, which it writes to ranks.csv in the run directory."""
    assert ctl(job["run"], "set", "listed_ranks", "2").returncode == 0
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            snap = json.loads(ctl(job["run"], "status", "--json").stdout)
            if len(snap["ranks"]) == 2:
                break
            time.sleep(0.2)
        assert len(snap["ranks"]) == 2 and snap["summary"]["ranks"] == 4
        proc = ctl(job["run"], "status", "--all")
        assert proc.returncode == 0, proc.stderr
        rows = list(csv.DictReader(io.StringIO(proc.stdout)))
        assert [int(r["rank"]) for r in rows] == [0, 1, 2, 3]
        assert [float(r["iter_s"]) for r in rows] == [ITER_S[r] for r in range(4)]
        assert [int(r["node"]) for r in rows] == [0, 0, 1, 1]
        assert all(r["score"] != "" for r in rows)  # scored against their peers, as the status does
        assert proc.stdout == (job["run"] / "ranks.csv").read_text()
        assert [e["command"] for e in read_events(job["run"], "operator_command")][-1] == "table"
    finally:
        assert ctl(job["run"], "set", "listed_ranks", "1024").returncode == 0


def test_metrics_scrape_parses_and_matches_the_heartbeats(job):
    time.sleep(1.2)  # a status round after the heartbeats above
    text = urllib.request.urlopen(f"http://127.0.0.1:{job['port']}/metrics", timeout=5).read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    loop = {s.labels["rank"]: s.value for s in fams["falconext_rank_iteration_seconds"].samples}
    est = {s.labels["rank"]: s.value for s in fams["falconext_rank_estimated_iteration_seconds"].samples}
    assert loop == {str(r): v for r, v in ITER_S.items()}
    assert est == {str(r): v for r, v in EST_S.items()}
    assert fams["falconext_job_iteration_seconds"].samples[0].value == max(ITER_S.values())
    state = {s.labels["state"]: s.value for s in fams["falconext_controller_state"].samples}
    assert state["tracking"] == 1.0 and sum(state.values()) == 1.0
    strategy = {s.labels["strategy"]: s.value for s in fams["falconext_strategy_in_force"].samples}
    assert strategy == {"S1": 1.0, "S2": 0.0, "S3": 0.0, "S4": 0.0}
    counts = {s.labels["type"]: s.value for s in fams["falconext_events"].samples if s.name == "falconext_events_total"}
    assert counts["controller_started"] == 1 and counts.get("rank_scores", 0) >= 1
    assert {s.labels["rank"] for s in fams["falconext_rank_score"].samples} == {"0", "1", "2", "3"}
    assert "falconext_suspension_pause_seconds" in fams and "falconext_controller_errors" in fams


def test_mute_holds_a_fail_slow_until_unmute(job):
    run, bus = job["run"], job["bus"]
    proc = ctl(run, "mute")
    assert proc.returncode == 0 and "muted" in proc.stdout, proc.stderr
    assert json.loads(ctl(run, "status", "--json").stdout)["muted"] is True
    bus.post(CTL_STREAM, FailSlowReport(2, 50, 60, 2.0, 0.4, time.time(), event_id=5))
    deadline = time.monotonic() + 5
    while not read_events(run, "fail_slow_muted") and time.monotonic() < deadline:
        time.sleep(0.1)
    (held,) = read_events(run, "fail_slow_muted")
    assert held["rank"] == 2
    assert not [e for e in read_events(run, "controller_state") if e["new"] == "profiling"]
    proc = ctl(run, "unmute")
    assert proc.returncode == 0 and "ranks [2] taken up" in proc.stdout, proc.stdout
    (prof,) = [e for e in read_events(run, "controller_state") if e["new"] == "profiling"]
    assert prof["trigger"] == "fail_slow"
    # no rank profiles (the test plays heartbeats only): the localization gives up after 1 s
    deadline = time.monotonic() + 10
    while not read_events(run, "localization_failed") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert read_events(run, "localization_failed")
    cmds = [e for e in read_events(run, "operator_command") if e["command"] in ("mute", "unmute")]
    assert [e["command"] for e in cmds] == ["mute", "unmute"] and all(e["accepted"] and e["at"] > 0 for e in cmds)


def test_set_changes_a_threshold_and_refuses_bad_ones(job):
    run = job["run"]
    proc = ctl(run, "set", "suspend_margin_iterations", "7")
    assert proc.returncode == 0 and proc.stdout.strip() == "suspend_margin_iterations: 3 -> 7", proc.stdout
    assert json.loads(ctl(run, "status", "--json").stdout)["config"]["suspend_margin_iterations"] == 7
    one_line_error(ctl(run, "set", "no_such_threshold", "1"), 2, "unknown threshold")
    one_line_error(ctl(run, "set", "suspend_tries", "two"), 2, "takes a int")
    one_line_error(ctl(run, "set", "suspend_tries", "0"), 1, "refused", "suspend_tries must be >= 1")
    one_line_error(ctl(run, "set", "bocd_threshold", "0.5"), 1, "refused", "read by the ranks")
    refused = [e for e in read_events(run, "operator_command") if e["command"] == "set" and not e["accepted"]]
    assert len(refused) == 2 and all(e["reason"] for e in refused)
    assert json.loads(ctl(run, "status", "--json").stdout)["config"] == {
        "suspend_margin_iterations": 7, "link_baseline_iteration": 0, "profile_timeout_s": 1.0,
        "metrics_port": job["port"]}


def test_validate_without_ranks_fails_with_the_reason(job):
    proc = ctl(job["run"], "validate", "--wait", "10")
    assert "validation started" in proc.stdout
    one_line_error(proc, 1, "failed", "no rank sent its profile in time")


def test_bad_plans_are_refused_and_change_nothing(job):
    run = job["run"]
    one_line_error(ctl(run, "force", "s2", "--plan", "4,4,4,-1"), 2, "negative")
    one_line_error(ctl(run, "force", "s2", "--plan", "4,x"), 2, "whole numbers")
    one_line_error(ctl_process(run, "force", "s2", "--plan", "8,8"), 1, "refused", "must give 4 replicas")
    one_line_error(ctl(run, "force", "s2", "--plan", "5,4,4,4"), 1, "refused", "16 in all")
    one_line_error(ctl(run, "force", "s2", "--roles", "0,1"), 2, "does not go with force s2")
    one_line_error(ctl(run, "force", "s3"), 2, "needs --roles")
    one_line_error(ctl(run, "force", "s3", "--roles", "0,1,1,3"), 1, "refused", "permutation")
    one_line_error(ctl(run, "force", "s4", "--exclude-nodes", "zero"), 2, "whole numbers")
    one_line_error(ctl(run, "force", "s5"), 2, "invalid choice")
    one_line_error(ctl(run, "validate", "--wait", "-1"), 2, "--wait must be >= 0")
    assert not read_events(run, "operator_mitigate")
    snap = json.loads(ctl(run, "status", "--json").stdout)
    assert snap["state"] == "tracking" and snap["plan"]["microbatches"] == [4, 4, 4, 4]


def test_events_human_and_json(job):
    run = job["run"]
    proc = ctl(run, "events")
    assert proc.returncode == 0
    assert any(" controller_started " in line and "world=4" in line for line in proc.stdout.splitlines())
    lines = ctl(run, "events", "--json").stdout.splitlines()
    assert json.loads(lines[0])["type"] == "controller_started"
    t0 = time.monotonic()
    proc = ctl(run, "events", "--follow", "--timeout", "1")
    assert proc.returncode == 0 and 1.0 <= time.monotonic() - t0 < 10


# --- runs that cannot be reached ------------------------------------------------------------


def test_not_a_run(tmp_path):
    one_line_error(ctl_process(tmp_path, "status"), 2, "not a falconext run")
    one_line_error(ctl(tmp_path / "missing", "status"), 2, "not a directory")
    one_line_error(ctl(tmp_path, "events"), 2, "not a falconext run")


def _copy_run(job, tmp_path: Path, **changes) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    info = json.loads((job["run"] / ACCESS_FILE).read_text())
    info.update(changes)
    write_private_json(str(run / ACCESS_FILE), info)
    return run


def test_an_ended_job(job, tmp_path):
    run = _copy_run(job, tmp_path, ended=time.time(), url=None)
    one_line_error(ctl(run, "status"), 2, "the job has ended")
    one_line_error(ctl(run, "mute"), 2, "the job has ended")


def test_a_wrong_password(job, tmp_path):
    redis = job["redis"]
    run = _copy_run(job, tmp_path, url=f"redis://:wrong@127.0.0.1:{redis.port}/0")
    one_line_error(ctl_process(run, "status"), 2, "Redis refused the password")
    one_line_error(ctl(run, "mute"), 2, "Redis refused the password")
    assert json.loads(ctl(job["run"], "status", "--json").stdout)["muted"] is False


def test_a_job_whose_redis_is_gone(job, tmp_path):
    run = _copy_run(job, tmp_path, url=f"redis://:pw@127.0.0.1:{free_port()}/0")
    one_line_error(ctl(run, "status"), 2, "not running")


def test_events_follow_stops_when_the_launcher_is_gone(job, tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    run = _copy_run(job, tmp_path, launcher_pid=int(gone.stdout))
    (run / "events.jsonl").write_text(json.dumps({"time": 1.0, "type": "x"}) + "\n")
    t0 = time.monotonic()
    proc = ctl(run, "events", "--follow", "--json")  # no --timeout: ends because the job did
    assert proc.returncode == 0 and json.loads(proc.stdout)["type"] == "x" and time.monotonic() - t0 < 5


def test_an_access_file_others_can_read(job, tmp_path):
    run = _copy_run(job, tmp_path)
    os.chmod(run / ACCESS_FILE, 0o644)
    one_line_error(ctl(run, "status"), 2, "readable by others")


# --- metrics without a server, and the example dashboard --------------------------------------


def _scrape(metrics) -> dict:
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics)
    return {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}


def _snapshot(**changes):
    from falconext.protocol.messages import StatusSnapshot

    ranks = {str(r): {"node": r // 2, "iteration": 90 + r, "iter_s": 0.5, "est_iter_s": 0.49, "score_iteration": 89,
                      "score": 0.01 * r, "late_s": 0.001 * r, "compute_ratio": 1.0, "replica": r, "micro": m,
                      "role": r, "stage": 0, "age_s": 0.1} for r, m in enumerate([4, 6, 3, 3])}
    base = dict(time=time.time(), job="j", world=4, state="tracking", session=3, muted=False, ranks=ranks,
                plan={"tp": 1, "pp": 1, "dp": 4, "nodes": 2, "microbatches": [4, 6, 3, 3], "even": False,
                      "roles": [0, 1, 2, 3]},
                planner={"current": "S2", "impact_s": 12.5, "slowdown_removed": 0.8})
    base.update(changes)
    return StatusSnapshot(**base)


def test_metrics_strategy_suspensions_and_reliability_counters():
    from falconext.control.metrics import JobMetrics

    m = JobMetrics()
    for ev in [{"type": "resumed", "pause_s": 0.5}, {"type": "resumed", "pause_s": 0.25},
               {"type": "message_dropped"}, {"type": "controller_redis", "connected": False},
               {"type": "controller_redis", "connected": True}, {"type": "mitigation_failed"}]:
        m.on_event(ev)
    fams = _scrape(m)
    assert "falconext_rank_iteration_seconds" not in fams  # no snapshot yet
    pause = {s.name: s.value for s in fams["falconext_suspension_pause_seconds"].samples}
    assert pause == {"falconext_suspension_pause_seconds_count": 2.0, "falconext_suspension_pause_seconds_sum": 0.75}
    assert fams["falconext_messages_dropped"].samples[0].value == 1.0
    assert fams["falconext_redis_disconnects"].samples[0].value == 1.0
    assert fams["falconext_mitigations_failed"].samples[0].value == 1.0
    m.on_snapshot(_snapshot())
    fams = _scrape(m)
    strategy = {s.labels["strategy"]: s.value for s in fams["falconext_strategy_in_force"].samples}
    assert strategy == {"S1": 0.0, "S2": 1.0, "S3": 0.0, "S4": 0.0}
    assert fams["falconext_slowdown_removed"].samples[0].value == 0.8
    assert fams["falconext_planner_impact_seconds"].samples[0].value == 12.5
    assert {s.labels["rank"]: s.value for s in fams["falconext_rank_microbatches"].samples} == {
        "0": 4.0, "1": 6.0, "2": 3.0, "3": 3.0}
    assert fams["falconext_job_iteration"].samples[0].value == 90.0
    # an operator's S3 without a planner: the roles say it
    m.on_snapshot(_snapshot(planner=None, plan={"microbatches": [4, 4, 4, 4], "even": True, "roles": [0, 2, 1, 3]}))
    strategy = {s.labels["strategy"]: s.value for s in _scrape(m)["falconext_strategy_in_force"].samples}
    assert strategy["S3"] == 1.0 and "falconext_slowdown_removed" not in _scrape(m)
    # after an S4 restart the restart is in force: its share served, the restarts counted
    m.on_snapshot(_snapshot(planner={"current": "S4", "healthy_s": 0.25, "slow_s": 0.5, "slowdown_removed": 0.96,
                                     "restarts": 1}, plan={"microbatches": [4, 4, 4, 4], "even": True}))
    fams = _scrape(m)
    strategy = {s.labels["strategy"]: s.value for s in fams["falconext_strategy_in_force"].samples}
    assert strategy["S4"] == 1.0 and fams["falconext_slowdown_removed"].samples[0].value == 0.96
    assert fams["falconext_restarts"].samples[0].value == 1.0


def test_example_dashboard_uses_only_metrics_the_controller_serves():
    import re

    from falconext.control.metrics import JobMetrics

    m = JobMetrics()
    m.on_event({"type": "resumed", "pause_s": 0.5})
    m.on_snapshot(_snapshot())
    served = {s.name for f in _scrape(m).values() for s in f.samples}
    path = Path(__file__).resolve().parents[1] / "examples" / "grafana" / "falconext-dashboard.json"
    dash = json.loads(path.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"\bfalconext_[a-z_]+", e)}
    assert len(dash["panels"]) >= 10 and used
    assert used <= served, sorted(used - served)


def test_progress_line_rates():
    from falconext.testbed.progress import Progress, progress_line

    snap = _snapshot(last_event={"type": "mitigation", "strategy": "S2", "time": 0.0}, state="mitigating", muted=True)
    line = progress_line(snap, 95)
    assert line.startswith("falconext: progress: iteration 90/95, 0.500 s/iter, controller mitigating (muted), "
                           "latest event: mitigation S2 (")
    out = io.StringIO()
    p = Progress("redis://unused", "j", 95, stream=out, tty=False)

    def at(it: int, t: float, **changes) -> bool:
        ranks = {r: dict(row, iteration=it) for r, row in _snapshot().ranks.items()}
        return p.show(_snapshot(ranks=ranks, **changes), t)

    assert at(10, 0.0)  # the first
    assert not at(15, 1.0)  # neither 10 iterations nor 5 s
    assert at(20, 1.5)  # 10 iterations
    assert at(21, 6.6)  # 5 s
    assert not at(22, 7.0, state="profiling")  # a change, but within 2 s of the last line
    assert at(22, 8.7, state="profiling")
    assert len(out.getvalue().splitlines()) == 4
    tty = io.StringIO()
    p = Progress("redis://unused", "j", 95, stream=tty, tty=True)
    assert p.show(snap, 0.0) and p.show(snap, 0.1)  # a terminal: rewritten in place, always
    assert tty.getvalue().count("\r") == 2 and "\n" not in tty.getvalue()
    last = {r: dict(row, iteration=94) for r, row in snap.ranks.items()}
    assert p.show(_snapshot(ranks=last), 0.2) and tty.getvalue().endswith("\n")  # ended before the summary
    assert not p.show(_snapshot(ranks=last), 0.3)


def test_a_restarted_controller_keeps_mute_and_thresholds(tmp_path):
    """The supervisor restarts a controller that died: what operators changed survives."""
    redis = start_redis()
    run = tmp_path / "run"
    run.mkdir()
    write_private_json(str(run / ACCESS_FILE), {"job": "restart", "url": redis.url, "world": 4, "ended": None})
    cfg = FalconConfig(link_baseline_iteration=0)

    def controller() -> tuple[list[bool], threading.Thread]:
        stop = [False]
        t = threading.Thread(target=run_controller, args=(redis.url, "restart", 4, str(run / "events.jsonl"), cfg, stop),
                             daemon=True)
        t.start()
        return stop, t

    def wait(pred, what: str) -> None:
        deadline = time.monotonic() + 10
        while not pred():
            assert time.monotonic() < deadline, what
            time.sleep(0.1)

    try:
        stop, t = controller()
        wait(lambda: ctl(run, "status").returncode == 0, "a first status")
        assert ctl(run, "mute").returncode == 0
        assert ctl(run, "set", "suspend_margin_iterations", "5").returncode == 0
        stop[0] = True
        t.join(5)
        stop, t = controller()
        wait(lambda: (run / "events.jsonl").exists() and read_events(run, "operator_state_restored"), "a restore")
        (ev,) = read_events(run, "operator_state_restored")
        assert ev["muted"] is True and ev["set"] == {"suspend_margin_iterations": 5}
        time.sleep(1.2)  # the new controller's status round
        snap = json.loads(ctl(run, "status", "--json").stdout)
        assert snap["muted"] is True and snap["config"]["suspend_margin_iterations"] == 5
        assert ctl(run, "unmute").returncode == 0
        stop[0] = True
        t.join(5)
    finally:
        redis.stop()


def test_a_command_reported_done_shows_in_the_next_status(tmp_path):
    """The controller writes the status a command left before it replies: with the
    snapshot's rate limit at its tightest (a snapshot may cost at most 1e-6 of the time,
    so the periodic refresh waits for hours), ``ctl mute`` then ``ctl status`` agree."""
    run = tmp_path / "run"
    run.mkdir()
    redis = start_redis()
    cfg = FalconConfig(status_max_share=1e-6, link_baseline_iteration=0)
    write_private_json(str(run / ACCESS_FILE), {"job": JOB, "url": redis.url, "world": 4, "ended": None})
    stop = [False]
    loop = threading.Thread(target=run_controller, args=(redis.url, JOB, 4, str(run / "events.jsonl"), cfg, stop),
                            daemon=True)
    loop.start()
    try:
        deadline = time.monotonic() + 10
        while ctl(run, "status", "--json").returncode != 0:
            assert time.monotonic() < deadline, "the controller wrote no status"
            time.sleep(0.1)
        for command, muted in [("mute", True), ("unmute", False), ("mute", True)]:
            assert ctl(run, command).returncode == 0
            assert json.loads(ctl(run, "status", "--json").stdout)["muted"] is muted, command
    finally:
        stop[0] = True
        loop.join(5)
        redis.stop()
