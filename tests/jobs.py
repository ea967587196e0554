"""Running ``falconext train`` from the tests, and reading what a run wrote.

One place for the test modules that train real jobs (test_train, test_mitigation_e2e,
test_topology_e2e, test_switch): the command line, the environment (one thread per
rank, on the 2-core test host), the fault file, and the readers of events and losses.

Jobs that several modules need (a faulty DP4 run that S2 mitigates, an undisturbed
reference) are run once per session through :class:`JobCache` (the ``jobs`` fixture of
conftest.py): the same arguments give the same run. A reference may be longer than the
run it is compared with; the constant learning rate makes its first iterations the same.
"""

from __future__ import annotations

import csv
import json
import statistics
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import promserver
from falconext.config import FalconConfig
from falconext.model.device import BACKWARD_PER_FORWARD, DEFAULT_GFLOPS, gpt_forward_flops
from falconext.ports import free_port
from falconext.testbed.zygote import ZYGOTE_ENV


def launch(out: Path, *args: str, nproc: int = 4, faults: list | None = None,
           timeout: int = 500, device: str = "cpu", report: bool = False,
           fresh: bool = False) -> subprocess.CompletedProcess:
    """Run one job; the caller judges the exit status. ``device``: the test bed's
    ``--device`` (the tests not yet moved to the emulated device keep the CPU bed);
    ``report``: draw its figures at the end (1.5 s a job: only where a test reads them);
    ``fresh``: start its ranks' parent as a fresh interpreter, not from the session's
    zygote (conftest.py), where a start's real cost is part of what is tested (S4's
    price is a restart's measured start-up, and a restart on a cluster starts fresh
    processes)."""
    if device == "emulated":
        args = host_paced(args)
    cmd = [sys.executable, "-m", "falconext.cli", "train", "--nproc", str(nproc), "--out", str(out),
           "--device", device, "--report" if report else "--no-report", *args]
    if faults is not None:
        inject = out.parent / f"{out.name}-faults.json"
        inject.write_text(json.dumps(faults))
        cmd += ["--inject", str(inject)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if fresh:
        env.pop(ZYGOTE_ENV, None)
    with LANE:
        if _stopping.is_set():
            raise RuntimeError("the session is over: no more jobs")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        _running.add(proc)
        try:
            out_text, err_text = proc.communicate(timeout=timeout)
        except BaseException:
            proc.kill()
            proc.communicate()
            raise
        finally:
            _running.discard(proc)
        return subprocess.CompletedProcess(cmd, proc.returncode, out_text, err_text)


#: the emulated device must be slower than the host's real work, or its times are the
#: host's and not a GPU's: the suite's device speeds (DEFAULT_GFLOPS, the ``--device-gflops``
#: its jobs name) were chosen on a 2-core host that ran the S2 job's real work inside
#: its device time with a few percent to spare; a slower host (a 2-core AMD EPYC ran the
#: same work 1.45x slower, 2026-11-28) overran them by 35-70% and its ranks' times were
#: no longer a GPU's (a 2x straggler read 1.43x). So every emulated job of the session
#: runs its device at host_factor() times the speed it names: the CPU bed's time for the
#: S2 job's iteration (DP4, 8 micro-batches of the default GPT per replica, all real
#: work, no device), against that iteration's device time at DEFAULT_GFLOPS, kept under
#: KEEP_UP of it (1 on a host fast enough, never above)
KEEP_UP = 0.85
CALIBRATION = ("--iters", "12", "--global-batch-size", "32", "--micro-batch-size", "1", "--no-falcon")
_factor: list[float] = []
_factor_lock = threading.Lock()


def calibration_factor(cpu_iter_s: float, device_iter_s: float) -> float:
    """The share of its named speed at which an emulated device stays KEEP_UP ahead of a
    host whose CPU bed takes ``cpu_iter_s`` for an iteration the device takes
    ``device_iter_s`` for at that speed: at most 1, rounded down to 0.01 (pure)."""
    if not (cpu_iter_s > 0 and device_iter_s > 0):
        raise ValueError(f"calibration: iteration times must be > 0, got {cpu_iter_s!r} and {device_iter_s!r}")
    return min(1.0, int(100 * KEEP_UP * device_iter_s / cpu_iter_s) / 100)


def host_factor() -> float:
    """:func:`calibration_factor` of this host, measured once per session by a 12-iteration
    CPU-bed run of the S2 job's shape in the job lane (its median over iterations 4-11 of
    the slowest rank's time), and printed at the end of the session (conftest.py)."""
    with LANE, _factor_lock:
        if not _factor:
            out = Path(tempfile.mkdtemp(prefix="falconext-calibration-")) / "run"
            proc = launch(out, *CALIBRATION, nproc=4, device="cpu")
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            per_it: dict[int, float] = {}
            with open(out / "iterations.csv", newline="") as f:
                for row in csv.DictReader(f):
                    it = int(row["iteration"])
                    per_it[it] = max(per_it.get(it, 0.0), float(row["iter_time_s"]))
            times = sorted(t for it, t in per_it.items() if it >= 4)
            flops = 8 * (1 + BACKWARD_PER_FORWARD) * gpt_forward_flops(4, 64, 64, 1, 256, 1, last_stage=True)
            _factor.append(calibration_factor(times[len(times) // 2], flops / (DEFAULT_GFLOPS * 1e9)))
        return _factor[0]


def host_paced(args: tuple[str, ...] | list[str]) -> list[str]:
    """An emulated job's arguments with its ``--device-gflops`` (DEFAULT_GFLOPS when it
    names none) times :func:`host_factor`."""
    rest = list(args)
    gflops = DEFAULT_GFLOPS
    if "--device-gflops" in rest:
        i = rest.index("--device-gflops")
        gflops = float(rest[i + 1])
        del rest[i:i + 2]
    return [*rest, "--device-gflops", f"{gflops * host_factor():.4g}"]


#: the jobs running now, and whether the session has ended (stop_jobs)
_running: set[subprocess.Popen] = set()
_stopping = threading.Event()


def stop_jobs() -> None:
    """The session is over: no job starts any more, and a running one (one run ahead
    whose tests were not reached) is stopped; its launcher stops its ranks; the S2 job's
    Prometheus stops."""
    _stopping.set()
    for proc in list(_running):
        proc.terminate()
    server = S2_PROMETHEUS.pop("server", None)
    if server is not None:
        server.stop()


def train(out: Path, *args: str, nproc: int = 4, faults: list | None = None, timeout: int = 500,
          device: str = "cpu", report: bool = False, fresh: bool = False) -> Path:
    """Run one job that must succeed (:func:`launch`); its output is kept in ``stdout.txt``."""
    proc = launch(out, *args, nproc=nproc, faults=faults, timeout=timeout, device=device, report=report,
                  fresh=fresh)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (out / "stdout.txt").write_text(proc.stdout)
    return out


def events(out: Path, type_: str | None = None) -> list[dict]:
    evs = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines() if line.strip()]
    return [e for e in evs if type_ is None or e["type"] == type_]


def losses_by_rank(out: Path) -> dict[int, dict[int, float]]:
    """iteration -> {rank: loss}: last-stage ranks report the global-batch loss."""
    found: dict[int, dict[int, float]] = {}
    with open(out / "iterations.csv", newline="") as f:
        for row in csv.DictReader(f):
            if row["loss"]:
                found.setdefault(int(row["iteration"]), {})[int(row["rank"])] = float(row["loss"])
    return found


def losses(out: Path) -> dict[int, float]:
    """iteration -> the global-batch loss, which every reporting rank must agree on."""
    got: dict[int, float] = {}
    for it, by_rank in losses_by_rank(out).items():
        assert len(set(by_rank.values())) == 1, f"two losses for iteration {it}: {by_rank}"
        got[it] = next(iter(by_rank.values()))
    return got


#: what a healthy job must not raise: a detection, a suspicion, a localization, a decision
QUIET = ("fail_slow", "straggler_suspected", "localized", "localization_failed", "mitigation_decision",
         "mitigation", "episode_end")


#: what a live falconext never raises: its own code failing on a rank, in a rank's control
#: thread or in the controller (each leaves training alone, so a run with one can look quiet)
FAILURES = ("monitor_error", "control_error", "controller_error")
#: the share of rank-iterations a live run estimates from the calls (the trackers lock
#: within their warm-up: measured 0.97 on the 60-iteration PP2 job, 2026-12-02)
MIN_COVERAGE = 0.8


def assert_live(out: Path, min_coverage: float = MIN_COVERAGE) -> None:
    """falconext was alive in run ``out``, not merely silent: every rank of the run's
    topology found its period from its calls, the estimates cover at least
    ``min_coverage`` of the rank-iterations, the controller started and answered (it
    scored the ranks from their heartbeats: ``rank_scores``), and nothing of
    :data:`FAILURES` was raised. A dead falconext (a refused control plane, a controller
    failing on every step, trackers that never lock) raises none of :data:`QUIET` either."""
    evs = events(out)
    failures = [e for e in evs if e["type"] in FAILURES]
    assert failures == [], failures[:5]
    world = int(json.loads((out / "run.json").read_text())["topology"]["world"])
    locked = {int(e["rank"]) for e in evs if e["type"] == "period"}
    assert locked >= set(range(world)), f"ranks that never found their period: {sorted(set(range(world)) - locked)}"
    coverage = json.loads((out / "summary.json").read_text())["estimates"]["coverage"]
    assert coverage >= min_coverage, f"estimates cover {coverage:.0%} of the rank-iterations (< {min_coverage:.0%})"
    kinds = {e["type"] for e in evs}
    assert "controller_started" in kinds, "the controller never started"
    assert "rank_scores" in kinds, "the controller never scored the ranks (it did not answer)"


#: the iterations before a fail-slow's onset its rise is measured against
RISE_BEFORE = 20


def job_rise(out: Path, onset: int, until: int) -> float:
    """The job's iteration time over iterations ``onset``..``until`` against the
    :data:`RISE_BEFORE` before: medians of the slowest rank's time per iteration, as the
    training loop's own timer measured it (iterations.csv), not falconext's estimates."""
    job: dict[int, float] = {}
    with open(out / "iterations.csv", newline="") as f:
        for row in csv.DictReader(f):
            it = int(row["iteration"])
            job[it] = max(job.get(it, 0.0), float(row["iter_time_s"]))
    before = [job[i] for i in range(onset - RISE_BEFORE, onset) if i in job]
    during = [job[i] for i in range(onset, until + 1) if i in job]
    if not before or not during:
        return 1.0
    return statistics.median(during) / statistics.median(before)


def cleared_sessions(evs: list[dict]) -> set[int]:
    """The sessions whose validation blamed nothing: a ``localized`` naming no GPU and no
    link, with its session in its evidence."""
    return {e["evidence"]["session"] for e in evs
            if e["type"] == "localized" and not e["gpus"] and not e["links"] and "session" in e.get("evidence", {})}


def unexplained(out: Path, quiet: tuple[str, ...] = QUIET) -> list[dict]:
    """The events of ``quiet`` a fault-free run raised that its own timings do not explain.

    A ``fail_slow`` is explained where the whole job did slow down: its :func:`job_rise`
    from onset to detection reads at least 1 + ``min_slowdown`` (the paper's 10% jitter
    line; this 2-core host slows every rank by 15-25% for tens of iterations now and then,
    and a detector that missed it would be wrong). Then so is what validating it raised,
    where validation found nothing to blame (``localized`` naming no GPU and no link, its
    session's ``episode_end`` and suspension). Nothing else is: a suspicion of one rank
    (the fast path, the score trigger), a GPU or a link named, a mitigation. Prints each
    explained fail-slow."""
    evs = [e for e in events(out) if e["type"] in quiet]
    slows = [e for e in evs if e["type"] == "fail_slow" and e.get("end") is None]
    rises = {(e["rank"], e["event_id"]): job_rise(out, int(e["onset"]), int(e["detected_at"])) for e in slows}
    line = 1.0 + FalconConfig().min_slowdown
    if not slows or min(rises.values()) < line:
        return evs
    print(f"{out.name}: the job slowed by {max(rises.values()):.2f}x, detected as fail_slow: "
          + ", ".join(f"rank {r} onset {e['onset']} at {e['detected_at']}" for (r, _), e in zip(rises, slows)))
    cleared = cleared_sessions(evs)
    return [e for e in evs if not (e["type"] == "fail_slow" or e.get("session") in cleared
                                   or (e["type"] == "localized" and e.get("evidence", {}).get("session") in cleared))]


def before_the_fault(out: Path, start: int, margin: int = 5) -> list[dict]:
    """What run ``out`` reported before its fault (``start``; onsets more than ``margin``
    iterations earlier) that its own timings do not explain: a ``fail_slow`` whose onset
    the whole job's slowing explains (:func:`job_rise` from it to the fault at least 1 +
    ``min_slowdown``: the host slowed every rank, and the detector merged that with the
    fault) passes; a suspicion of one rank never does."""
    line = 1.0 + FalconConfig().min_slowdown
    early = [e for e in events(out) if e["type"] in ("fail_slow", "straggler_suspected")
             and (e.get("onset") or 0) < start - margin]
    return [e for e in early if e["type"] != "fail_slow" or job_rise(out, int(e["onset"]), start - 1) < line]


def assert_quiet(out: Path) -> None:
    """A fault-free run raised nothing of :data:`QUIET` that the job's own timings do not
    explain (:func:`unexplained`), its only suspensions were the link baseline's of a
    multi-node job and those of a job-wide slowdown's validation (named by their session),
    and falconext was alive all along (:func:`assert_live`); prints the worst rank's
    overrun of its device time (a host too loaded for the device's speed)."""
    device = json.loads((out / "summary.json").read_text())["device"]
    print(f"{out.name}: worst rank's overrun share {device['worst_rank_overrun_share']:.1%}")
    assert_live(out)
    raised = unexplained(out)
    assert raised == [], raised
    allowed = {e["session"] for e in events(out, "link_baseline")} | cleared_sessions(events(out))
    held = {e["session"] for e in events(out, "suspension")} | {e["session"] for e in events(out, "suspended")}
    assert held <= allowed, (held, allowed)


#: iterations.csv holds losses to 6 decimals: two runs that learn the same agree to the last
#: digit, give or take one rounding of it (a float-rounding difference that straddles a
#: rounding boundary); the losses here are over 1, so this is under 1e-6 relative
LOSS_DIGIT = 1e-6


def assert_same_trajectory(a: dict[int, float], b: dict[int, float], iters: int) -> float:
    """Iterations 0..iters-1 of run ``a`` and reference ``b`` (which may have run longer):
    every loss equal to the printed digit (within one :data:`LOSS_DIGIT`); returns the worst
    relative difference."""
    assert sorted(a) == list(range(iters)) and set(range(iters)) <= set(b), (sorted(a), sorted(b))
    off = {i: abs(a[i] - b[i]) for i in range(iters)}
    assert max(off.values()) <= LOSS_DIGIT * (1 + 1e-6), {i: (a[i], b[i]) for i, d in off.items() if d > LOSS_DIGIT}
    return max(off[i] / abs(b[i]) for i in range(iters))


#: one job at a time: every test-bed job of the session runs in this lane (launch takes
#: it; a test that drives a job by hand takes it too), so the jobs that the session runs
#: ahead (JobCache.prefetch) never share the 2-core host with another job, only with
#: unit tests, which a job's raised priority (falconext.testbed.priority) keeps off its
#: device time
class _Lane:
    """A re-entrant lock where a test waiting for it goes before the jobs run ahead (the
    thread named ``jobs-ahead``), so that a test never waits behind the rest of the queue."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._owner: int | None = None
        self._depth = 0
        self._tests_waiting = 0

    def __enter__(self) -> "_Lane":
        me, ahead = threading.get_ident(), threading.current_thread().name == AHEAD_THREAD
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return self
            self._tests_waiting += not ahead
            try:
                while self._owner is not None or (ahead and self._tests_waiting):
                    self._cond.wait()
            finally:
                self._tests_waiting -= not ahead
            self._owner, self._depth = me, 1
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cond.notify_all()


#: the background thread of JobCache.prefetch
AHEAD_THREAD = "jobs-ahead"
LANE = _Lane()


class JobCache:
    """Jobs run at most once per session: the same arguments return the same run,
    whichever thread asks first (a second caller waits for the first's run)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self._runs: dict[str, Any] = {}
        self._running: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self._count = 0
        self._ahead: threading.Thread | None = None

    def train(self, *args: str, nproc: int = 4, faults: list | None = None, device: str = "cpu",
              report: bool = False, fresh: bool = False) -> Path:
        """:func:`train`'s run of these arguments, run now unless it ran or runs already."""
        return self.once(self.key(args, nproc, faults, device, report, fresh),
                         lambda out: train(out, *args, nproc=nproc, faults=faults, device=device,
                                           report=report, fresh=fresh))

    @staticmethod
    def key(args: tuple[str, ...] | list[str], nproc: int = 4, faults: list | None = None, device: str = "cpu",
            report: bool = False, fresh: bool = False) -> str:
        """The cache key of a :meth:`train` run (also for a plain job run through
        :meth:`once` with more around it, such as the S2 job's Prometheus)."""
        return json.dumps([list(args), nproc, faults, device, report, fresh])

    def once(self, key: str, run: Callable[[Path], Any]) -> Any:
        """``run(folder)``'s result for ``key``, run now (in a new folder of the cache)
        unless it ran or runs already; a run that failed fails every caller. For jobs a
        test drives by hand (a scenario), as :meth:`train` is for plain ones."""
        with self._lock:
            done = self._runs.get(key)
            wait = self._running.get(key)
            if done is None and wait is None:
                wait = self._running[key] = threading.Event()
                out, mine = self.base / f"job{self._count}", True
                self._count += 1
            else:
                mine = False
        if mine:
            try:
                result = run(out)
            except BaseException as exc:  # noqa: BLE001  (every caller of this job sees it fail)
                result = exc
            with self._lock:
                self._runs[key] = result
                self._running.pop(key).set()
        elif done is None:
            wait.wait()
        result = self._runs[key]
        if isinstance(result, BaseException):
            raise AssertionError(f"shared job {key[:300]} failed: {str(result)[-3000:]}") from result
        return result

    def prefetch(self, makers: list, after: threading.Event | None = None) -> None:
        """Run the jobs ``makers`` make (functions of this cache, as below) one after
        another in a background thread, once ``after`` is set, while the session's other
        tests go on; a test that needs one first runs or waits for it as usual. Failures
        surface in the tests."""
        if self._ahead is not None or not makers:
            return

        def ahead() -> None:
            while after is not None and not after.wait(1.0):
                if _stopping.is_set():
                    return
            for make in makers:
                if _stopping.is_set():
                    return
                try:
                    make(self)
                except BaseException:  # noqa: BLE001  (reported to the tests that use the job)
                    pass

        self._ahead = threading.Thread(target=ahead, name=AHEAD_THREAD, daemon=True)
        self._ahead.start()


# --- jobs shared by several modules -----------------------------------------------------------

#: the S2 job's fault: tracking leaves out 20 warm-up iterations and BOCD wants a
#: baseline before the onset, so it starts at 45
S2_FAULT_START = 45
S2_ITERS = 100
S2_JOB = ("--iters", str(S2_ITERS), "--global-batch-size", "32", "--micro-batch-size", "1")


#: the S2 job serves its controller's Prometheus metrics here, scraped every second from
#: before its start to the session's end by a real Prometheus where one is installed
#: (tests/promserver.py; test_prometheus reads it): chosen once, so every caller's
#: arguments, and so the job, are the same
S2_METRICS_PORT = free_port()
#: the Prometheus scraping the S2 job (one, once it started), its reason where none could
#: start, and the job's wall-clock span
S2_PROMETHEUS: dict[str, Any] = {}


def s2_job(jobs: JobCache) -> Path:
    """Emulated DP4, 8 micro-batches per replica, rank 1 computing 2x slower from
    iteration 45 on; only S2 allowed (test_mitigation_e2e's S2 run, test_train's
    detection and localization of a compute fault, test_prometheus's scraped job)."""
    args = (*S2_JOB, "--falcon-mitigation-strategies", "S2", "--falcon-metrics-port", str(S2_METRICS_PORT))
    faults = [{"kind": "compute", "rank": 1, "factor": 2.0, "start": S2_FAULT_START}]

    def run(out: Path) -> Path:
        if promserver.WHY_NOT is not None:
            S2_PROMETHEUS["why_not"] = promserver.WHY_NOT
        else:
            try:
                S2_PROMETHEUS["server"] = promserver.Prometheus(out.parent / f"{out.name}-prometheus", S2_METRICS_PORT)
            except RuntimeError as exc:  # installed, and failed to start: a failure, not a skip
                S2_PROMETHEUS["error"] = str(exc)
        started = time.time()
        done = train(out, *args, faults=faults, device="emulated", report=True)
        S2_PROMETHEUS["span"] = (started, time.time())
        return done

    return jobs.once(JobCache.key(args, faults=faults, device="emulated", report=True), run)


def s2_reference(jobs: JobCache) -> Path:
    """What the S2 job learns undisturbed: the same job without falconext, on the CPU bed
    (device time changes no number, and the CPU bed runs it in a third of the time)."""
    return jobs.train(*S2_JOB, "--no-falcon")


#: jobs run with nothing beside them (conftest.py: before phase 2 starts, no test runs
#: while they do), where a module reads them: the S2 job's plan is made of the forward
#: times its ranks measure, and beside the unit tests (two fresh-clone runs, 2026-11-27)
#: its healthy replicas' devices overran by up to 50% in bursts (26-28% of device time
#: in all), the plan came out [7, 6, 8, 11] for a 2x straggler whose best is [9, 5, 9, 9],
#: and a burst just before the fault put its detected onset 5 iterations early. The unit
#: tests still finish inside the jobs' time after it (the lane is the suite's critical path)
ISOLATED = (s2_job,)


#: the calls-only job's fault: rank 2's device 1.5x slow from iteration 35
CALLS_ONLY_SLOW_RANK, CALLS_ONLY_ONSET = 2, 35


#: not run ahead (conftest.py): read from the calls alone, its detection and scores move
#: with the host's speed, and beside the unit tests (2026-11-26) its onset came 2-4
#: iterations late and the slow rank's compute ratio read 1.15 for a 1.5x fault.
#: A 1 GFLOP/s device: at the default 2 its four ranks' CPU work overran the device by
#: 18-20% even alone, healthy iterations spread 4-8% (bursts to 1.3x on every rank), and
#: the 1.5x fault (1.25x on the iteration) sat at the edge of three healthy spreads: one
#: run in five confirmed it 2-3 iterations late on two ranks (2026-11-27, replayed from
#: the run's calls); at 1 GFLOP/s the overrun is 7.6% and the spread 0.5-1.3%
def calls_only_job(jobs: JobCache) -> Path:
    """Emulated DP4 on 1 GFLOP/s devices, 4 micro-batches per replica, rank 2 1.5x slow
    from 35, and --falcon-loop-hooks false: the trainer never calls falconext, which has
    only the calls (mitigation is off without the loop). test_nohook's detection,
    localization and suspension without loop hooks, and test_scores' per-rank scores,
    read it."""
    return jobs.train("--iters", "75", "--global-batch-size", "16", "--micro-batch-size", "1",
                      "--device-gflops", "1", "--falcon-loop-hooks", "false", "--falcon-score-interval-s", "3",
                      faults=[{"kind": "compute", "rank": CALLS_ONLY_SLOW_RANK, "factor": 1.5,
                               "start": CALLS_ONLY_ONSET}],
                      device="emulated")


#: TP1 x DP2 x PP2 on four one-rank nodes, 16 samples per global batch
PP2_JOB = ("--pp", "2", "--global-batch-size", "16", "--ranks-per-node", "1")
PP2_REFERENCE_ITERS = 105  # the longest run compared with it: test_topology_e2e's


def pp2_reference(jobs: JobCache) -> Path:
    """PP2_JOB undisturbed for PP2_REFERENCE_ITERS iterations on the CPU bed: the reference of the S3
    runs, of forced topology switches and of forced uneven micro-batch plans."""
    return jobs.train(*PP2_JOB, "--iters", str(PP2_REFERENCE_ITERS), "--no-falcon")


#: the S3 link job: from iteration 45 the link 0-1 (x8) carries stage 0's DP gradient
#: all-reduce and 0-2 (x3) replica 0's pipeline messages (test_topology_e2e explains why)
S3_LINK_FAULT_START = 45
S3_LINK_FAULTS = [{"kind": "link", "nodes": [0, 1], "factor": 8.0, "start": S3_LINK_FAULT_START},
                  {"kind": "link", "nodes": [0, 2], "factor": 3.0, "start": S3_LINK_FAULT_START}]


def s3_link_job(jobs: JobCache) -> Path:
    """Emulated PP2_JOB for PP2_REFERENCE_ITERS iterations with two congested links, only S3
    allowed; links at 10 MB/s so that DP gradients weigh (47 ms a ring), a 4 GFLOP/s
    device. test_topology_e2e's S3 run, and test_train's detection and localization of
    link faults."""
    return jobs.train(*PP2_JOB, "--iters", str(PP2_REFERENCE_ITERS), "--link-bandwidth", "10e6",
                      "--device-gflops", "4", "--falcon-mitigation-strategies", "S3",
                      faults=S3_LINK_FAULTS, device="emulated")


#: the forced PP2 job: an uneven plan from the start, and a 4-cycle of roles at iteration 10
FORCED_PLAN, FORCED_SWITCH_AT, FORCED_ROLES = [3, 5], 10, [1, 2, 3, 0]


def forced_pp2_job(jobs: JobCache) -> Path:
    """PP2_JOB for 20 iterations on the CPU bed with both of an operator's forced changes:
    replicas 0 and 1 run 3 and 5 micro-batches (--falcon-force-microbatches) and, at
    iteration 10, every process hands its role on (--falcon-force-topology); falconext
    traces and tracks throughout, automatic mitigation off. test_switch's live switch and
    test_mitigation_e2e's uneven 1F1B plan, both against the shared PP2 reference."""
    return jobs.train(*PP2_JOB, "--iters", "20", "--falcon-mitigation", "false",
                      "--falcon-force-microbatches", ",".join(map(str, FORCED_PLAN)),
                      "--falcon-force-topology", f"{FORCED_SWITCH_AT}:{','.join(map(str, FORCED_ROLES))}")


#: TP2 x DP1 x PP2 on two nodes of two ranks (a TP group within a node)
TP2_PP2_JOB = ("--tp", "2", "--pp", "2", "--ranks-per-node", "2")
TP2_PP2_REFERENCE_ITERS = 10


def tp2_pp2_reference(jobs: JobCache) -> Path:
    """TP2_PP2_JOB undisturbed for 10 iterations, without falconext: tensor parallelism
    trains (test_train), and the reference of moving TP blocks between nodes (test_switch)."""
    return jobs.train(*TP2_PP2_JOB, "--iters", str(TP2_PP2_REFERENCE_ITERS), "--no-falcon")
