"""The rank side's message builders (protocol/rank_side.py): what each promises, and that
the real ranks and the simulators build their messages with them (a change to what a
rank says is made once)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from falconext.protocol.codec import decode, encode
from falconext.protocol.messages import Heartbeat
from falconext.protocol.rank_side import (FAIL_SLOW, FAIL_SLOW_END, FAIL_SLOW_UPDATE, EventReports, beat_fields,
                                          beat_iter_s, beat_mb_s, fail_slow_report, heartbeat, held_ack, missed_ack,
                                          profile_data, resumed_ack, validation_result)


def test_the_heartbeats_windows():
    starts = [0.0, 1.0, 2.0, 3.0, 5.0, 7.0, 9.0]  # gaps 1, 1, 1, 2, 2, 2
    assert beat_iter_s(starts, 5) == 2.0  # the latest 5 gaps: 1, 2, 2, 2 and 1
    assert beat_iter_s(starts, 2) == 2.0
    assert beat_iter_s(starts[:3], 5) == 1.0  # three starts are enough
    assert beat_iter_s(starts[:2], 5) == 0.0 and beat_iter_s([], 5) == 0.0  # no heartbeat yet
    assert beat_iter_s(starts[:2], 1) == 1.0  # a window of one gap needs two starts
    assert beat_mb_s([0.3, 0.1, 0.2, 0.2]) == 0.2 and beat_mb_s([0.1, 0.2]) == 0.2  # the upper median
    assert beat_mb_s([]) == 0.0


def test_a_heartbeat_waits_for_an_iteration_time_and_carries_its_fields():
    role = {"role": 3, "stage": 1, "tp": 1, "pp": 2, "grad_bytes": 10, "act_bytes": 5}
    fields = beat_fields(replica=1, mb_s=0.2, micro=4, restart_s=9.0, switch_s=2.0, role=role)
    assert "score_iteration" not in fields  # no straggler sample: the heartbeat's defaults
    assert heartbeat(0, 0, -1, 0.5, 1.0, fields) is None and heartbeat(0, 0, 7, 0.0, 1.0, fields) is None
    beat = heartbeat(3, 1, 7, 0.5, 1.0, fields)
    assert isinstance(beat, Heartbeat) and decode(encode(beat)) == beat
    assert (beat.replica, beat.mb_s, beat.micro, beat.restart_s, beat.switch_s, beat.role, beat.stage) == (
        1, 0.2, 4, 9.0, 2.0, 3, 1)
    assert (beat.score_iteration, beat.into_s) == (-1, -1.0)
    scored = heartbeat(3, 1, 7, 0.5, 1.0, beat_fields(replica=1, mb_s=0.2, micro=4, restart_s=0.0, switch_s=0.0,
                                                       role={}, score_iteration=6, est_iter_s=0.5, compute_s=0.3,
                                                       wait_s=0.2, into_s=0.1))
    assert scored is not None and (scored.score_iteration, scored.compute_s, scored.into_s) == (6, 0.3, 0.1)


def test_a_detectors_first_sighting_and_end_are_reported_not_its_ladder_steps():
    reports = EventReports()
    first = reports.event_id(0, 0)
    assert reports.event_id(0, 0) == first and reports.event_id(0, 1) != first
    assert reports.event_id(1, 0) not in (first, reports.event_id(0, 1))  # a fresh detector's event 0
    assert reports.kind(first, ended=False) == FAIL_SLOW
    assert reports.kind(first, ended=False) == FAIL_SLOW_UPDATE  # the same fail-slow got slower
    assert reports.kind(first, ended=True) == FAIL_SLOW_END
    assert fail_slow_report(2, FAIL_SLOW_UPDATE, first, 10, 12, 1.5, 0.3, 5.0) is None
    assert fail_slow_report(2, FAIL_SLOW, first, None, 12, 1.5, 0.3, 5.0) is None  # no loop iteration
    rep = fail_slow_report(2, FAIL_SLOW, first, 10, None, 1.5, 0.3, 5.0, end=40)
    assert rep is not None and (rep.rank, rep.onset, rep.detected_at, rep.end, rep.event_id) == (2, 10, 10, None, first)
    ended = [fail_slow_report(2, FAIL_SLOW_END, first, 10, 12, 1.5, 0.3, 6.0, end, at)
             for end, at in ((40, 45), (None, 45), (None, None))]
    assert [r.end for r in ended if r is not None] == [40, 45, 10]  # its end, when confirmed, else the onset


def test_the_suspensions_acks_and_result():
    assert [a.status for a in (held_ack(1, 2, 30, 0.0), missed_ack(1, 2, 31, 0.0))] == ["held", "missed"]
    resumed = resumed_ack(1, 2, 30, 5.0, 1.5, False, True)
    assert (resumed.status, resumed.pause_s, resumed.expired, resumed.committed) == ("resumed", 1.5, False, True)
    res = validation_result(4, 2, None, [(0, 4, 0.01), [8, 4, 0.02]], "partial")
    assert res.links == [[0, 4, 0.01], [8, 4, 0.02]] and res.gemm_flops is None and res.error == "partial"
    assert decode(encode(res)) == res


def test_a_profile_sends_evenly_spaced_groups_as_spans():
    prof = profile_data(5, 3, {"dp0": "dp", "pp1": "pp"}, {"dp0": range(0, 16, 4), "pp1": [5, 1]},
                        {"dp0": [[0, 1.0, 2.0, 100]]})
    assert prof.spans == {"dp0": [0, 4, 4]} and prof.members == {"pp1": [5, 1]}
    assert list(prof.group_members()["dp0"]) == [0, 4, 8, 12]
    assert decode(encode(prof)) == prof


ROOT = Path(__file__).resolve().parent.parent / "falconext"
#: the modules that speak for ranks, real or simulated
RANK_SIDE = ["runtime/runtime.py", "runtime/monitor.py", "control/client.py", "validate/suspension.py",
             "experiments/des.py", "experiments/scale.py"]
BUILT = {"Heartbeat", "FailSlowReport", "SessionAck", "ValidationResult", "ProfileData"}


@pytest.mark.parametrize("path", RANK_SIDE)
def test_the_ranks_and_the_simulators_use_the_builders(path):
    """Each imports protocol/rank_side.py and constructs none of its messages itself."""
    tree = ast.parse((ROOT / path).read_text())
    imports = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "falconext.protocol.rank_side" in imports
    made = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and (
        (isinstance(n.func, ast.Name) and n.func.id in BUILT)
        or (isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name) and n.func.value.id in BUILT))]
    assert not made, f"{path} builds a rank's message itself at lines {made}"
