"""A job without loop hooks: the calls are the clock (falconext/runtime/monitor.py), a
suspension traps the first call of the agreed iteration by its sequence number
(falconext/trace/trap.py Trap.at_seq), and a DP4 job whose loop never calls falconext
is detected, localized and suspended at the right iteration."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from falconext.config import FalconConfig
from falconext.protocol.eventlog import EventLog
from falconext.runtime.monitor import RankMonitor
from falconext.trace.trap import Trap
from falconext.trace.records import CallRecord

from jobs import CALLS_ONLY_ONSET, CALLS_ONLY_SLOW_RANK, calls_only_job, events

#: the job lane held for the whole module (conftest.py: alone): it reads the calls-only
#: job (tests/jobs.py), which runs with nothing beside it
ALONE = True

# --- the trap ---------------------------------------------------------------------------------


def test_a_trap_armed_at_a_sequence_number_lets_earlier_calls_pass_and_holds_that_one():
    trap = Trap()
    held_at: list[int] = []
    trap.arm(1.0, on_hold=lambda end: held_at.append(trap.seen + 1), at_seq=7)
    for seq in range(12):  # what a wrapper does: hold check, then the tracer numbers the call
        if trap.armed:
            trap._hold()
        trap.seen = seq
    assert held_at == [7]
    assert not trap.armed and trap.at_seq is None and trap.holds == 1


def test_release_cancels_a_trap_armed_at_a_call_not_reached_yet():
    trap = Trap()
    trap.arm(1.0, on_hold=lambda end: pytest.fail("released before the call"), at_seq=100)
    trap._hold()
    trap.release()
    assert not trap.armed and trap.at_seq is None


# --- the monitor's clock ----------------------------------------------------------------------

#: (op, bytes): a tensor-parallel forward and backward, then the gradient reduction
PATTERN = [("all_reduce", 4096), ("all_gather", 8192), ("all_reduce", 4096), ("broadcast", 64),
           ("reduce_scatter", 8192), ("all_reduce", 4096), ("all_reduce", 16384), ("all_gather", 8192),
           ("all_reduce", 4096), ("reduce_scatter", 8192), ("all_reduce", 1 << 20), ("all_reduce", 4)]


def _stream(iterations: int, insert_every: int = 10, seed: int = 0) -> tuple[list[CallRecord], dict[int, int], dict[int, float]]:
    """A rank's calls: twelve per iteration, a long pause (the optimizer step and the next
    forward) before each iteration, two timer barriers after every 10th (Megatron-LM's
    --log-interval). Returns the records, each iteration's first seq and true duration."""
    rng = np.random.default_rng(seed)
    recs, first, length = [], {}, {}
    t, seq = 1.0, 0
    for it in range(iterations):
        t_begin = t
        t += 0.2 * float(np.exp(0.02 * rng.standard_normal()))  # compute before the first call
        first[it] = seq
        for op, nbytes in PATTERN:
            recs.append(CallRecord(0, op, "dp:0,1", nbytes, t, None, t + 0.004, seq))
            seq += 1
            t += 0.01
        if insert_every and it % insert_every == insert_every - 1:
            for _ in range(2):
                recs.append(CallRecord(0, "barrier", "world:0,1", 0, t, None, t + 0.001, seq))
                seq += 1
                t += 0.002
        length[it] = t - t_begin
    return recs, first, length


def _monitor(tmp_path: Path, recs: list[CallRecord]) -> RankMonitor:
    tmp_path.mkdir(exist_ok=True)
    batches = [recs[i:i + 37] for i in range(0, len(recs), 37)]
    mon = RankMonitor(lambda: batches.pop(0) if batches else [], FalconConfig(), 0, None,
                      EventLog(str(tmp_path / "events.jsonl")), None)
    while batches:
        mon._process()
    return mon


def test_without_loop_hooks_the_calls_number_the_iterations(tmp_path):
    recs, first, length = _stream(115)
    mon = _monitor(tmp_path, recs)
    assert mon.estimates, "no iteration was estimated"
    assert mon.tracked == max(mon.estimates)
    # every estimate carries the true iteration's number: its duration is that iteration's
    # (an anchor-to-anchor span is the iteration shifted by a call; inserted calls round away)
    errors = [abs(mon.estimates[n] - length[n]) / length[n] for n in mon.estimates]
    assert max(errors) < 0.05, max(errors)
    assert len(mon.estimates) >= 100
    # and the first call of a coming iteration is where the stream will put it (no
    # insertion comes before 119's end: one would move the prediction by its calls)
    assert mon.tracked == 114
    for k in range(mon.tracked + 1, mon.tracked + 5):
        more, first_more, _ = _stream(k + 1)
        assert mon.first_seq_of(k) == first_more[k], k


def test_numbers_never_go_back(tmp_path):
    recs, _, _ = _stream(80, insert_every=0)
    mon = _monitor(tmp_path, recs)
    seen = sorted(mon.estimates)
    assert seen == list(range(seen[0], seen[-1] + 1))


def test_loop_hooks_off_turns_mitigation_off():
    assert FalconConfig(loop_hooks=False).mitigation is False
    assert FalconConfig().mitigation is True


# --- a DP4 job whose loop never calls falconext ------------------------------------------------

FAULT_START = CALLS_ONLY_ONSET


@pytest.fixture(scope="module")
def nohook_run(jobs):
    """Emulated DP4, rank 2's device 1.5x slow from 35; --falcon-loop-hooks false: the
    trainer never calls falconext (tests/jobs.py calls_only_job)."""
    return calls_only_job(jobs)


def test_a_job_without_loop_hooks_is_detected_localized_and_suspended_at_the_agreed_iteration(nohook_run):
    assert all(e["loop_hooks"] is False for e in events(nohook_run, "tracking_started"))
    found = events(nohook_run, "fail_slow")
    assert found and all(isinstance(e["onset"], int) for e in found)
    assert all(FAULT_START - 2 <= e["onset"] <= FAULT_START + 2 for e in found), found
    starts = [e for e in events(nohook_run, "controller_state") if e.get("trigger") == "fail_slow"]
    assert starts, "the reports never reached the controller"
    assert events(nohook_run, "localized")[-1]["gpus"] == [CALLS_ONLY_SLOW_RANK]
    assert not events(nohook_run, "mitigation")
    # every rank held once per session, at the session's iteration in the loop's own count
    rows = list(csv.DictReader(open(nohook_run / "iterations.csv", newline="")))
    times = {(int(r["rank"]), int(r["iteration"])): float(r["iter_time_s"]) for r in rows}
    sessions = {e["session"]: e["iteration"] for e in events(nohook_run, "suspended")}
    assert sessions
    for sus in events(nohook_run, "suspension"):
        assert sus["outcome"] == "validated", sus
        it = sessions[sus["session"]]
        if sus["pause_s"] > 0.3:  # long enough to stand out of the iteration times
            neighbours = [times[(sus["rank"], k)] for k in (it - 2, it - 1, it + 1, it + 2)]
            assert times[(sus["rank"], it)] > max(neighbours) + 0.5 * sus["pause_s"], (sus, it)


# --- a long job's estimates leave memory -----------------------------------------------------


def test_the_monitor_hands_its_oldest_estimates_over_and_keeps_memory_bounded(tmp_path):
    from falconext.report.summary import EstimatesFile

    recs, _, length = _stream(115)
    (tmp_path / "ranks").mkdir()
    spilled = EstimatesFile(str(tmp_path), 0)
    batches = [recs[i:i + 37] for i in range(0, len(recs), 37)]
    mon = RankMonitor(lambda: batches.pop(0) if batches else [], FalconConfig(), 0, None,
                      EventLog(str(tmp_path / "events.jsonl")), None, spill=spilled.write)
    mon._keep = 8  # 2 x 8192 in a real job
    held = []
    while batches:
        mon._process()
        held.append(len(mon.estimates))
    assert max(held) <= 2 * mon._keep + 37  # one drained batch at most beyond the bound
    written = [int(r.split(",")[1]) for r in open(spilled.path).read().splitlines()]
    assert written == sorted(written) and set(written).isdisjoint(mon.estimates)
    whole = _monitor(tmp_path / "whole", recs)  # the same stream, nothing handed over
    assert sorted(written + list(mon.estimates)) == sorted(whole.estimates)
