"""The planner's typed state (mitigate/planner.py Planner.state) and the event dict built
from it (status), and the one factory of a complete Mitigation (mitigate/mitigation.py)."""

from __future__ import annotations

import collections
from dataclasses import asdict

import pytest

from falconext.protocol.messages import Heartbeat, Localized
from falconext.mitigate.mitigation import new_mitigation
from falconext.mitigate.planner import Candidate, Planner, Rise


def test_the_state_is_typed_and_status_is_the_same_as_plain_data():
    p = Planner("computation", 1.0, {"S2": 0.5, "S3": None, "S4": 10.0}, 100, settle_iterations=1,
                judge_iterations=2, rise_margin=0.1)
    st = p.state()
    assert st.candidates == (Candidate("S2", 0.5, "remaining"), Candidate("S3", None, "unavailable"),
                             Candidate("S4", 10.0, "remaining"))
    assert (st.current, st.next, st.pending, st.last_iteration, st.relocalizing) == ("S1", "S2", None, 99, None)
    d = p.observe(100, 1.6)
    assert d is not None and p.state().pending == "S2" and p.state().impact_s == pytest.approx(0.6)
    p.applied("S2", 101, 0.4)
    st = p.state()
    assert st.applied == ("S2",) and st.current == "S2" and st.candidates[0] == Candidate("S2", 0.4, "applied")
    rise = p.relocalize(103, 102, "a rank computes 2x its peers")
    assert rise is not None and rise.action == "relocalize"
    assert p.state().relocalizing == Rise(103, 1.6, 1.0, 100, 102, False)  # the level last seen, over healthy
    status = p.status()
    assert status["relocalizing"] == asdict(p.state().relocalizing)
    assert status["candidates"] == [asdict(c) for c in p.state().candidates]
    assert {k: v for k, v in status.items() if k not in ("candidates", "relocalizing", "applied", "judged")} == {
        k: v for k, v in asdict(p.state()).items() if k not in ("candidates", "relocalizing", "applied", "judged")}
    before = p.state()
    p.relocalized(False)
    assert before.relocalizing is not None and p.state().relocalizing is None  # a snapshot, not a view


def test_new_mitigation_builds_every_measurement_the_strategies_plan_with():
    beats = {r: Heartbeat(r, r // 2, 60, 0.5, 1.0, replica=r, mb_s=0.1 if r == 1 else 0.05, micro=4, role=r)
             for r in range(4)}
    history = {r: collections.deque([Heartbeat(r, r // 2, it, 0.25, 1.0, replica=r, mb_s=0.05, micro=4, role=r)
                                     for it in (48, 49, 50)]) for r in range(4)}
    links = {"links": {"0-1": 0.3}, "reference": 0.1}
    loc = Localized(gpus=[1], links=[[0, 1]], evidence={"gemm_gflops": {"0": 10, "1": 4, "2": 10, "3": 10},
                                                        "links": links})
    planner = Planner("computation", 0.25, {}, 50)
    mit = new_mitigation(planner, loc, beats, history, clean_before=50, lookback=5, line=0.1, nbytes=1000)
    assert mit.planner is planner and mit.root_cause == "computation"
    assert mit.gpus == [1] and mit.links == [[0, 1]] and mit.slow_replicas == {1}
    assert mit.healthy_mb_s == {r: 0.05 for r in range(4)} and mit.recovery_refs == {1: (1, 0.05)}
    assert mit.gpu_factors == {1: 2.5} and mit.link_excess == {(0, 1): pytest.approx(0.0002)}
    assert mit.net_s_per_byte == pytest.approx(0.0001)
    assert not mit.applied and mit.in_flight is None
