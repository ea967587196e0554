"""S3 in a real training job (torchrun, gloo, real Redis), end to end.

TP1 x DP2 x PP2 on four virtual nodes (one rank each), so every DP group and every
pipeline crosses a node link. Only S3 is allowed, and both runs must learn exactly what
an undisturbed run of the same job learns.

* ``s3``: from iteration 45 the link between nodes 0 and 1, which carries the DP
  gradient all-reduce of stage 0, is 4x congested. It must be detected, localized to
  that link, and the planner must give processes new roles so the link no longer
  carries DP traffic, live (no restart), removing at least half of the slowdown.
* ``consolidate``: from 45, processes 0 (stage 0 of replica 0) and 3 (stage 1 of
  replica 1) compute 2x slower. Both must be localized, and S3 must put them into one
  pipeline stage; the iteration time drops, as the planner's model predicted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_mitigation_e2e import assert_same_trajectory, events, losses, train

FAULT_START = 45
ITERS = 130
JOB = ["--pp", "2", "--iters", str(ITERS), "--global-batch-size", "16", "--ranks-per-node", "1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("topology")
    link = {"kind": "link", "nodes": [0, 1], "factor": 4.0, "start": FAULT_START}
    return {
        "s3": train(base / "s3", 4, *JOB, "--falcon-mitigation-strategies", "S3", faults=[link]),
        "consolidate": train(base / "consolidate", 4, *JOB, "--falcon-mitigation-strategies", "S3",
                             faults=[{"kind": "compute", "rank": r, "factor": 2.0, "start": FAULT_START} for r in (0, 3)]),
        "ref": train(base / "ref", 4, *JOB, "--no-falcon"),
    }


def dp_groups(roles: list[int]) -> list[set[int]]:
    """Processes of each DP group (TP1: torch ranks 2s and 2s+1 are stage s's replicas)."""
    process_of = {r: p for p, r in enumerate(roles)}
    return [{process_of[2 * s], process_of[2 * s + 1]} for s in range(2)]


def test_link_fault_is_moved_off_the_dp_path(runs):
    out = runs["s3"]
    (loc,) = [e for e in events(out, "localized") if e["evidence"]["trigger"] == "fail_slow"]
    assert loc["gpus"] == [] and loc["links"] == [[0, 1]], loc["evidence"]
    applied = [e for e in events(out, "mitigation") if e["strategy"] in ("S2", "S3", "S4")]
    assert [e["strategy"] for e in applied] == ["S3"], applied
    roles = applied[0]["roles"]
    assert {0, 1} in dp_groups(list(range(4)))  # before: processes 0 and 1 all-reduce over the link
    assert {0, 1} not in dp_groups(roles), roles  # after: no DP group spans nodes 0 and 1
    switched = [e for e in events(out, "topology_switch") if not e["probe"]]
    assert sorted(e["rank"] for e in switched) == [0, 1, 2, 3]
    assert {e["iteration"] for e in switched} == {applied[0]["iteration"]}
    assert all(e["roles"] == roles for e in switched)
    assert events(out, "restarted") == []  # live: the processes never restarted


def test_s3_removes_half_the_slowdown_and_reports_its_pause(runs):
    summary = json.loads((runs["s3"] / "summary.json").read_text())
    assert summary["slowdown_removed"] is not None and summary["slowdown_removed"] >= 0.5, summary
    switches = summary["mitigation"]["switches"]
    probe, real = switches[0], switches[-1]
    assert probe["probe"] and not real["probe"] and real["moved_bytes"] > 0
    assert 0 < real["pause_s"] < 30
    # the planner's cost for S3 came from the probe's measured pause
    (decision,) = [d for d in summary["mitigation"]["decisions"] if d["strategy"] == "S3"]
    assert decision["overhead_s"] >= probe["pause_s"]
    assert real["disk_restart_s"] is None or real["shorter_than_disk"] > 0
    print(f"S3: removed {summary['slowdown_removed']}, pause {real['pause_s']} s, "
          f"disk restart {real['disk_restart_s']} s")


def test_s3_keeps_what_the_model_learns(runs):
    assert_same_trajectory(losses(runs["s3"]), losses(runs["ref"]), ITERS)


def stage_of(roles: list[int], process: int) -> int:
    return roles[process] // 2  # TP1 x DP2: torch ranks 2s, 2s+1 are stage s


def test_two_stragglers_in_different_stages_are_consolidated(runs):
    out = runs["consolidate"]
    (loc,) = [e for e in events(out, "localized") if e["evidence"]["trigger"] == "fail_slow"]
    assert loc["gpus"] == [0, 3] and loc["links"] == [], loc["evidence"]
    assert stage_of([0, 1, 2, 3], 0) != stage_of([0, 1, 2, 3], 3)
    applied = [e for e in events(out, "mitigation") if e["strategy"] in ("S2", "S3", "S4")]
    assert [e["strategy"] for e in applied] == ["S3"], applied
    roles = applied[0]["roles"]
    assert stage_of(roles, 0) == stage_of(roles, 3), roles
    before, after = applied[0]["predicted_s"]
    assert after < before
    summary = json.loads((out / "summary.json").read_text())
    slow, mitigated = summary["slow_iter_s"], summary["mitigated_iter_s"]
    assert mitigated < 0.97 * slow, summary  # the model predicted about 12% on this host
    print(f"consolidation: predicted {before} -> {after} s/iter, measured {slow} -> {mitigated}")
    assert_same_trajectory(losses(out), losses(runs["ref"]), ITERS)
