"""Megatron-LM's own ``pretrain_gpt.py`` as a multi-node job: one ``falconext launch`` per
emulated node (``falconext nodes``: a network namespace each, shaped links), meeting through
torch's c10d rendezvous, as ``srun`` would start them on a cluster.

Skipped unless ``MEGATRON_LM_PATH`` names a core_v0.16.1 checkout and this machine can make
network namespaces (root). What is asserted is issue 30's first acceptance item: a 2x
compute fault on node 1's local rank 0 from iteration 60; one controller for the job;
found from the calls (``fail_slow``, or the fast path's suspicion) with onset within 5 of 60,
within 15; localized to global rank 2;
S2 applied on both nodes, removing on the emulated devices' records between 0.8 of the
best plan's share and that share.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

MLM = os.environ.get("MEGATRON_LM_PATH")
pytestmark = pytest.mark.skipif(not MLM, reason="MEGATRON_LM_PATH is not set (a Megatron-LM core_v0.16.1 checkout)")

from test_pretrain_gpt import (LOSS_REL, TINY_GPT, assert_report_shows_restart, events, first_naming,  # noqa: E402
                               pretrain_script)


@pytest.fixture(scope="module")
def script() -> str:
    from falconext.testbed import netns

    path = pretrain_script()
    if os.geteuid() != 0:
        pytest.skip("falconext nodes needs root (network namespaces)")
    why = netns.available()
    if why is not None:
        pytest.skip(f"network namespaces are not available here: {why}")
    return path


def nodes(count: int, launch_args: list[str], bed_out: Path, timeout: float = 600) -> str:
    """``falconext nodes --count COUNT -- falconext launch LAUNCH_ARGS``; its output (it must succeed)."""
    cmd = [sys.executable, "-m", "falconext.cli", "nodes", "--count", str(count), "--out", str(bed_out), "--",
           sys.executable, "-m", "falconext.cli", "launch", *launch_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        tails = "".join(f"\n--- {log.name} (last 3000 characters) ---\n{log.read_text(errors='replace')[-3000:]}"
                        for log in sorted(bed_out.glob("node*.log")))
        pytest.fail(f"falconext nodes exited with status {proc.returncode}{tails}\n--- the bed's own output ---\n"
                    f"{out[-2000:]}", pytrace=False)
    return out


def test_two_nodes_one_job_detect_localize_and_rebalance(script: str, tmp_path: Path) -> None:
    faults = tmp_path / "fault.json"
    faults.write_text(json.dumps([{"kind": "compute", "node": 1, "local_rank": 0, "factor": 2.0, "start": 60}]))
    out = tmp_path / "out"
    output = nodes(2, ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", "{head}:29400", "--rdzv-id", "t1", script, *TINY_GPT,
                       "--global-batch-size", "32", "--train-iters", "110", "--log-interval", "10",
                       "--falcon", "--falcon-out", str(out), "--falcon-inject", str(faults)], tmp_path / "bed")
    evs = events(out)
    # one control plane: one controller, and only the node hosting the rendezvous started one
    assert [e["type"] for e in evs].count("controller_started") == 1
    assert not (out / "nodes" / "node1" / "controller.log").exists()
    # the device speed was picked for 4 ranks on this host and said once per node
    assert output.count("falconext: emulated device at") == 2, output[-3000:]
    first = first_naming(evs)  # from the calls alone: the ranks' detector or the fast path
    assert abs(first["onset"] - 60) <= 5, first
    assert first["at"] - 60 <= 15, first
    localized = [e for e in evs if e["type"] == "localized"]
    assert localized and localized[0]["gpus"] == [2], localized
    applied = [e for e in evs if e["type"] == "plan_applied"]
    assert {e["host"] for e in applied} == {"node0", "node1"}, applied
    plan = applied[0]["plan"]
    assert all(e["plan"] == plan for e in applied) and plan[2] < min(plan[0], plan[1], plan[3]), applied
    # on the emulated devices' records (the wall clock's healthy time carries four ranks
    # on two cores: 80-90% by it, above any plan's reach, on 2026-11-27): of one 2x
    # replica of four with 8 micro-batches each, the best plan leaves 10 of 8 -> 16 units,
    # 0.75; the planner's plan gets at least 0.8 of that, and no figure passes it
    summary = json.loads((out / "summary.json").read_text())
    assert summary["timing"] == "device" and summary["slowdown_removed_max"] == 0.75, summary
    removed = summary["s2_slowdown_removed"]  # S2's alone, before any restart
    print(f"two nodes: S2 removed {removed} on the devices' records "
          f"({summary['wall_clock']['s2_slowdown_removed']} by the wall clock) of at most 0.75; "
          f"overrun share {summary['device']['overrun_share']}")
    assert removed is not None and 0.8 * 0.75 <= removed <= 0.75 + 1e-3, summary
    assert summary["slowdown_removed"] <= summary["slowdown_removed_ceiling"] + 1e-3, summary
    # the fault is named where it was: node 1's local rank 0 ran as global rank 2
    run = json.loads((out / "run.json").read_text())
    assert run["faults"] == [{"kind": "compute", "factor": 2.0, "start": 60, "end": None, "rank": 2, "node": 1,
                              "local_rank": 0}]
    # each node kept its own log of its ranks' events; the controller's has them all
    for host in ("node0", "node1"):
        node_log = [json.loads(x) for x in (out / "nodes" / host / "events.jsonl").read_text().splitlines()]
        assert any(e["type"] == "tracking_started" for e in node_log)
    assert {e["rank"] for e in evs if e["type"] == "tracking_started"} == {0, 1, 2, 3}


#: the restart tests' job: RESTART_ITERS iterations of the tiny GPT on 2 nodes of 2 ranks
#: (DP4), so that DP2 (one node) keeps the global batch. A 3x fault from 40 with S4 only
#: restarted at 53-54. Under Slurm (a 2x fault from 40, S2 then S4) the ski rental buys S4
#: once the slowdown has cost as much as a restart (about 16 s): at the bed's default
#: device speed S2's best plan left 8-15% by the wall clock (the host's own work does not
#: slow), so S4 came at 129 on one run and not by 180 on the next (2026-12-03); the
#: Slurm test runs its device at half that speed (tests/megatron_lm/test_slurm.py), and S4
#: came at 56, resumed at 60 (2026-12-03). 110 leaves iterations on the spare to measure
#: and compare
RESTART_ITERS = 110


def restart_job(iters: int) -> list[str]:
    """The restart tests' job trained for ``iters`` iterations (the uninterrupted run's
    first ``iters``)."""
    return [*TINY_GPT, "--global-batch-size", "32", "--train-iters", str(iters), "--log-interval", "10"]


RESTART_JOB = restart_job(RESTART_ITERS)


def assert_resumed_exactly(output: str, plain_output: str, resumed_at: int, until: int | None = None) -> None:
    """Every ``lm loss`` Megatron logged after the resume at step ``resumed_at`` (0-based;
    logged as iteration ``resumed_at + 1``) equals the uninterrupted run's (relative LOSS_REL),
    but the line that averages the resumed first iteration: Megatron logs that iteration
    without resetting its accumulators (training_log's should_reset), so the next log line
    after it averages it with the iterations since. Every ``grad norm`` logged from the
    resumed first iteration on (one iteration's, never averaged) is equal. A restarted job
    shorter than the uninterrupted one (``until``: its ``--train-iters``, which it must have
    logged) is compared up to its end."""
    from test_pretrain_gpt import grad_norms, losses

    plain, restarted = losses(plain_output), losses(output)
    last = max(plain) if until is None else until
    assert until is None or until in restarted, (sorted(restarted), until)
    first = resumed_at + 1
    averaged = min(it for it in plain if it > first)
    after = [it for it in plain if averaged < it <= last]
    assert after and all(it in restarted for it in after), (sorted(restarted), after)
    for it in after:
        assert restarted[it] == pytest.approx(plain[it], rel=LOSS_REL), it
    ours, theirs = grad_norms(output), grad_norms(plain_output)
    logged = [it for it in theirs if first <= it <= last]
    assert all(ours.get(it) == theirs[it] for it in logged), [(it, ours.get(it), theirs[it]) for it in logged]


def s4_job(script: str, tmp_path: Path, count: int, rdzv_id: str, *extra: str) -> tuple[str, Path]:
    """The restart tests' job on ``count`` launchers (``--nnodes 2:3``, node rank = bed node),
    a 3x compute fault on node 1's local rank 0 from iteration 40, S4 only; its output and
    run directory."""
    faults = tmp_path / "fault.json"
    faults.write_text(json.dumps([{"kind": "compute", "node": 1, "local_rank": 0, "factor": 3.0, "start": 40}]))
    out = tmp_path / "out"
    output = nodes(count, ["--nnodes", "2:3", "--node-rank", "{node}", "--nproc-per-node", "2", "--rdzv-backend",
                           "c10d", "--rdzv-endpoint", "{head}:29400", "--rdzv-id", rdzv_id, script, *RESTART_JOB,
                           "--falcon", "--falcon-out", str(out), "--falcon-inject", str(faults),
                           "--falcon-mitigation-strategies", "S4", *extra], tmp_path / "bed", timeout=900)
    return output, out



@pytest.mark.long
@pytest.mark.slurm_covers
def test_a_spare_node_replaces_a_bad_one(script: str, uninterrupted_dp4: str, tmp_path: Path) -> None:
    """Three launchers for a 2-node job (--nnodes 2:3, node 2 a spare); a 3x compute fault on
    node 1 from iteration 40; S4 only. Node 1 leaves (its launcher exits 0 saying why, its
    drain hook runs), and the job resumes from Megatron's checkpoint on nodes 0 and 2.
    Where the Slurm bed runs, tests/megatron_lm/test_slurm.py holds all of this on a real
    Slurm (the example batch script, S2 then S4, the spare, the drain, the same training):
    this one is not collected there (conftest.py says so), which keeps about 5 minutes
    out of CI's core_v0.16.1 leg."""
    output, out = s4_job(script, tmp_path, 3, "spare", "--falcon-on-exclude", "echo drained {host}")
    evs = events(out)
    assert "[node2] falconext: spare node node2 waits in the rendezvous" in output
    excluded = [e for e in evs if e["type"] == "excluded"]
    assert [(e["host"], e["node"]) for e in excluded] == [("node1", 1)], excluded
    assert f"[node1] falconext: node node1 leaves the job at iteration {excluded[0]['iteration']}" in output
    hook = [e for e in evs if e["type"] == "on_exclude"]
    assert [(e["host"], e["status"], e["output"].strip()) for e in hook] == [("node1", 0, "drained node1")]
    # the next round: nodes 0 and 2, four ranks, from the checkpoint of the agreed iteration
    joined = [e for e in evs if e["type"] == "node_joined"]
    assert {e["host"] for e in joined if e["attempt"] == 0} == {"node0", "node1"}
    assert {e["host"] for e in joined if e["attempt"] == 1} == {"node0", "node2"}
    assert {e["world"] for e in joined} == {4}
    resumed = [e for e in evs if e["type"] == "restart_requested"][0]["resume_at"]
    assert (out / "checkpoint" / f"iter_{resumed:07d}").is_dir()
    assert_resumed_exactly(output, uninterrupted_dp4, resumed)
    assert_report_shows_restart(out, resumed)
    # back to the healthy speed on the spare, within 1% (docs/multinode.md), on the
    # emulated devices' records: the wall clock's figure carries the bed's own load
    summary = json.loads((out / "summary.json").read_text())
    assert summary["timing"] == "device", summary
    print(f"spare: mitigated / healthy {summary['mitigated_iter_s'] / summary['healthy_iter_s']:.4f} on the devices' "
          f"records, {summary['wall_clock']['mitigated_iter_s'] / summary['wall_clock']['healthy_iter_s']:.4f} "
          f"by the wall clock")
    assert summary["mitigated_iter_s"] == pytest.approx(summary["healthy_iter_s"], rel=0.01), summary


@pytest.mark.long
def test_without_a_spare_the_job_shrinks_with_its_global_batch(script: str, uninterrupted_dp4: str, tmp_path: Path) -> None:
    """The spare test's job with two launchers and no spare: node 1 leaves, and the job
    goes on on node 0 alone as DP2 (16 micro-batches per replica instead of 8), training
    what the uninterrupted DP4 run trains."""
    output, out = s4_job(script, tmp_path, 2, "shrink")
    evs = events(out)
    assert [(e["host"], e["node"]) for e in evs if e["type"] == "excluded"] == [("node1", 1)]
    joined = [e for e in evs if e["type"] == "node_joined"]
    assert [(e["host"], e["world"]) for e in joined if e["attempt"] == 1] == [("node0", 2)]
    resumed = [e for e in evs if e["type"] == "restart_requested"][0]["resume_at"]
    assert_resumed_exactly(output, uninterrupted_dp4, resumed, until=RESTART_ITERS)
    run = json.loads((out / "run-r1.json").read_text())
    assert run["topology"]["dp"] == 2 and run["args"]["global_batch_size"] == 32


@pytest.mark.long
def test_an_exclusion_the_job_cannot_absorb_is_refused_and_training_goes_on(script: str, tmp_path: Path) -> None:
    """Two launchers and no --global-batch-size (Megatron's default grows with DP, so no
    smaller job trains the same batch): no spare, no shrink. S4 is refused with the reason,
    and the job trains to its end on the slow node."""
    faults = tmp_path / "fault.json"
    faults.write_text(json.dumps([{"kind": "compute", "node": 1, "local_rank": 0, "factor": 3.0, "start": 30}]))
    out = tmp_path / "out"
    tiny = [a for a in TINY_GPT]
    tiny[tiny.index("--micro-batch-size") + 1] = "8"  # Megatron's default global batch: 8 x DP4 = 32
    job = [*tiny, "--train-iters", "70", "--log-interval", "10"]  # S4 is refused by about 40
    nodes(2, ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "{head}:29400",
              "--rdzv-id", "stuck", script, *job, "--falcon", "--falcon-out", str(out), "--falcon-inject", str(faults),
              "--falcon-mitigation-strategies", "S4"], tmp_path / "bed", timeout=900)
    evs = events(out)
    failed = [e for e in evs if e["type"] == "mitigation_failed" and e["strategy"] == "S4"]
    assert failed and "no spare node waits and the job cannot shrink below 2" in failed[0]["reason"], \
        [e for e in evs if e["type"].startswith("mitigation")]
    assert not [e for e in evs if e["type"] in ("restart_requested", "excluded")]
    assert json.loads((out / "summary.json").read_text())["iterations"] == 70


#: the lost-node test's job: the new round starts again from iteration 0 (no checkpoint yet)
#: and its fault from 60 is named by about 64 and rebalanced by about 70 (the fast path)
LOST_ITERS = 100
LOST_JOB = [*TINY_GPT, "--global-batch-size", "32", "--train-iters", str(LOST_ITERS), "--log-interval", "10"]


@pytest.mark.long
def test_a_node_lost_outright_is_replaced_and_a_later_fault_still_handled(script: str, tmp_path: Path) -> None:
    """Three launchers (node 2 a spare); node 1 is lost outright at iteration 25 (every
    process in its namespace killed with SIGKILL, as a power loss would). TorchElastic's
    next round forms with the spare, the job starts again (no checkpoint was saved yet),
    the controller forgets the lost round, and a 2x fault on node 0's local rank 1 from
    iteration 60 of the new round is detected, localized and rebalanced."""
    import signal
    import time

    from falconext.testbed import netns

    faults = tmp_path / "fault.json"
    faults.write_text(json.dumps([{"kind": "compute", "node": 0, "local_rank": 1, "factor": 2.0, "start": 60}]))
    out, bed = tmp_path / "out", tmp_path / "bed"
    cmd = [sys.executable, "-m", "falconext.cli", "nodes", "--count", "3", "--out", str(bed), "--",
           sys.executable, "-m", "falconext.cli", "launch", "--nnodes", "2:3", "--node-rank", "{node}",
           "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "{head}:29400", "--rdzv-id", "lost",
           script, *LOST_JOB, "--falcon", "--falcon-out", str(out), "--falcon-inject", str(faults),
           "--falcon-mitigation-strategies", "S2"]
    log = tmp_path / "bed.out"
    with open(log, "w") as sink:  # a pipe nobody reads would stall the bed once full
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while "iteration       20/" not in (bed / "node1.log").read_text(errors="replace") if (bed / "node1.log").exists() \
                else True:
            assert time.monotonic() < deadline and proc.poll() is None, "the job never reached iteration 20"
            time.sleep(1)
        ns = f"{netns.PREFIX}{proc.pid}-n1"
        pids = [int(p) for p in netns.run(["ip", "netns", "pids", ns]).stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = log.read_text(errors="replace")
    assert proc.returncode == 128 + signal.SIGKILL, output[-3000:]  # node 1's status: it was killed
    assert "falconext nodes: node1 was killed by signal 9" in output
    evs = events(out)
    joined = [e for e in evs if e["type"] == "node_joined"]
    rounds = list(dict.fromkeys(e["round_id"] for e in joined))  # in the order they came
    assert len(rounds) == 2, joined
    assert {e["host"] for e in joined if e["round_id"] == rounds[1]} == {"node0", "node2"}, joined
    first_restart = min(e["time"] for e in joined if e["round_id"] == rounds[1])
    after = [e for e in evs if e["time"] >= first_restart]
    localized = [e for e in after if e["type"] == "localized"]
    assert localized and localized[0]["gpus"] == [1], [e["type"] for e in after]
    assert any(e["type"] == "plan_applied" for e in after)
    assert json.loads((out / "summary.json").read_text())["iterations"] >= LOST_ITERS


#: the S3 test's job: a pipeline of two stages on two nodes of two ranks (TP1 x DP2 x PP2),
#: small enough in hidden size and vocabulary that its activations, not its gradients, are
#: what crosses the nodes: Megatron's order puts stage 0 on node 0 and stage 1 on node 1,
#: so both pipelines cross the link between them
S3_JOB = [("--hidden-size", "32"), ("--seq-length", "256"), ("--max-position-embeddings", "256"),
          ("--vocab-size", "256")]


@pytest.mark.long
def test_s3_across_nodes_puts_each_pipeline_inside_a_node(script: str, tmp_path: Path) -> None:
    """TP1 x DP2 x PP2 on two launchers; the link between the nodes congested 30x from
    iteration 45; S3 only, tree validation forced (gloo runs rings). The link is localized
    with the trees validated, S3 restarts the job with each pipeline inside a node (torch
    ranks moved between the nodes: RANK set from the plan, LOCAL_RANK and the device left
    alone), the iteration time drops, and the training is the uninterrupted run's."""
    from test_pretrain_gpt import launch

    tiny = list(TINY_GPT)
    for flag, value in S3_JOB:
        tiny[tiny.index(flag) + 1] = value
    # 120: the link is for BOCD+V (no fast path), found by about 56, and the planner's ski
    # rental buys S3 (14.7 s) once the slowdown has cost as much: S3 at about 92 (100 ended first)
    job = [*tiny, "--pipeline-model-parallel-size", "2", "--global-batch-size", "32", "--train-iters", "120",
           "--log-interval", "10"]
    faults = tmp_path / "fault.json"
    faults.write_text(json.dumps([{"kind": "link", "nodes": [0, 1], "factor": 30.0, "start": 45}]))
    out = tmp_path / "out"
    output = nodes(2, ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                       "{head}:29400", "--rdzv-id", "s3", script, *job, "--falcon", "--falcon-out", str(out),
                       "--falcon-inject", str(faults), "--falcon-mitigation-strategies", "S3",
                       "--falcon-validation-trees", "on", "--falcon-p2p-bytes", "65536"], tmp_path / "bed", timeout=900)
    evs = events(out)
    localized = [e for e in evs if e["type"] == "localized"]
    assert localized and localized[0]["links"] == [[0, 1]] and localized[0]["gpus"] == [], localized
    assert localized[0]["evidence"]["tree_groups"] >= 1  # the groups across the link had their trees validated
    requested = [e for e in evs if e["type"] == "restart_requested"]
    assert [e["strategy"] for e in requested] == ["S3"], requested
    roles = requested[0]["roles"]
    # each pipeline (its DP index: rank % 2) is played by the processes of one node
    process_of = {rank: p for p, rank in enumerate(roles)}
    assert all(process_of[d] // 2 == process_of[d + 2] // 2 for d in (0, 1)), roles
    assert process_of[0] // 2 == 0  # rank 0 stays on the node whose agent serves the workers' store
    topology = json.loads((out / "run-r1.json").read_text())["topology"]
    assert {r["rank"]: (r["process"], r["host"]) for r in topology["ranks"]} == \
        {rank: (p, f"node{p // 2}") for rank, p in process_of.items()}
    joined = [e for e in evs if e["type"] == "node_joined" and e["attempt"] == 1]
    assert sorted(e["host"] for e in joined) == ["node0", "node1"]
    # faster, by the wall clock (a pipeline's iteration is its schedule's critical path,
    # which the devices' records do not hold: report/summary.py), printed beside the
    # planner's prediction
    summary = json.loads((out / "summary.json").read_text())
    assert summary["timing"] == "wall_clock", summary
    s3 = [e for e in evs if e["type"] == "mitigation" and e.get("strategy") == "S3"]
    print(f"S3 across nodes: {summary['slow_iter_s']} -> {summary['mitigated_iter_s']} s/iter "
          f"(healthy {summary['healthy_iter_s']}), predicted {s3[0].get('predicted_s') if s3 else None}")
    assert summary["mitigated_iter_s"] < summary["slow_iter_s"], summary
    # the same training: the job without fault or falconext, on one launcher, uninterrupted
    assert_resumed_exactly(output, launch(script, job, nproc=4), requested[0]["resume_at"])
