"""Multi-node jobs (issue 30): the pure rules behind one launcher per node, and the local
multi-node bed (``falconext nodes``) where this machine can make network namespaces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from falconext.protocol.eventlog import ForwardingEventLog
from falconext.protocol.base import MessageError
from falconext.protocol.codec import decode, encode
from falconext.protocol.messages import RankEvent
from falconext.elastic import join, rendezvous
from falconext.elastic.restart import NodeLeave, read_leave, write_leave
from falconext.mitigate.room import RestartRoom, shrink_floor
from falconext.inputs import InputError
from falconext.megatron_lm.hooks import plane_refusal
from falconext.megatron_lm.launcher import elastic_options, job_floor, shrink_floor_of
from falconext.model.device import DEFAULT_GFLOPS, host_gflops
from falconext.model.faults import on_hardware, parse_faults, placed
from falconext.testbed.nodes import mbps_to_bytes, substitute


# --- what torchrun's options say ---------------------------------------------------------

def test_torchrun_options_give_the_nodes_and_the_rendezvous() -> None:
    r = rendezvous.parse(["--nnodes", "2:3", "--nproc-per-node", "4", "--rdzv-backend", "c10d",
                          "--rdzv-endpoint", "10.0.0.1:29400", "--rdzv-id", "job7", "--node-rank", "2"])
    assert (r.min_nodes, r.max_nodes, r.nproc_per_node, r.node_rank) == (2, 3, 4, 2)
    assert (r.backend, r.endpoint_host, r.endpoint_port, r.rdzv_id) == ("c10d", "10.0.0.1", 29400, "job7")
    assert r.multi_node and r.elastic
    one = rendezvous.parse(["--nproc-per-node", "2"])
    assert not one.multi_node and one.max_nodes == 1
    static = rendezvous.parse(["--nnodes", "2", "--node-rank", "1", "--master-addr", "h0", "--master-port", "6000"])
    assert (static.backend, static.endpoint_host, static.endpoint_port) == ("static", "h0", 6000)
    assert rendezvous.split_endpoint("[fe80::1]:29400") == ("fe80::1", 29400)
    assert rendezvous.split_endpoint("head") == ("head", None)


@pytest.mark.parametrize("opts, problem", [
    (["--nnodes", "3:2"], "--nnodes"), (["--nnodes", "x"], "--nnodes"), (["--nnodes", "0"], "--nnodes"),
    (["--rdzv-conf", "is_host"], "--rdzv-conf"), (["--rdzv-endpoint", ":29400"], "--rdzv-endpoint"),
    (["--rdzv-endpoint", "h:port"], "--rdzv-endpoint"), (["--node-rank", "one"], "--node-rank"),
])
def test_bad_torchrun_options_are_one_line_errors(opts: list[str], problem: str) -> None:
    with pytest.raises(InputError, match=problem):
        rendezvous.parse(opts)


def test_exactly_one_node_hosts_the_plane() -> None:
    elastic = rendezvous.parse(["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h0:29400"])
    assert [rendezvous.hosts_plane(elastic, local) for local in (True, False)] == [True, False]
    static = [rendezvous.parse(["--nnodes", "2", "--node-rank", str(k), "--master-addr", "h0"]) for k in (0, 1)]
    assert [rendezvous.hosts_plane(r, local=False) for r in static] == [True, False]
    assert rendezvous.hosts_plane(rendezvous.parse([]), local=False)  # one launcher: always


def test_torchrun_is_told_which_node_hosts_the_store_and_from_which_address() -> None:
    opts = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.1.0.10:29400", "--rdzv-conf", "timeout=60"]
    r = rendezvous.parse(opts)
    assert rendezvous.torchrun_additions(r, opts, True, "10.1.0.10") == [
        "--rdzv-conf", "timeout=60,is_host=1", "--local-addr", "10.1.0.10"]
    assert rendezvous.torchrun_additions(r, opts, False, "10.1.0.11")[:2] == ["--rdzv-conf", "timeout=60,is_host=0"]
    given = opts[:-1] + ["is_host=0"] + ["--local-addr", "x"]
    assert rendezvous.torchrun_additions(rendezvous.parse(given), given, True, "10.1.0.10") == []


def test_this_machine_knows_its_own_addresses() -> None:
    assert rendezvous.is_local_address("127.0.0.1")
    assert not rendezvous.is_local_address("192.0.2.77")  # TEST-NET-1: nobody's
    assert rendezvous.address_toward("127.0.0.1", 29400) == "127.0.0.1"


# --- restarts: floor, room, leave files ----------------------------------------------------

def test_a_job_shrinks_only_as_far_as_its_global_batch_and_layout_allow() -> None:
    assert shrink_floor(2, 2, 1, 1, 32, 1) == 1  # DP4 -> DP2: 32 divides by 2
    assert shrink_floor(2, 2, 1, 1, 12, 4) == 2  # DP2 would need 12 % 8 == 0
    assert shrink_floor(4, 8, 4, 2, 384, 1) == 1  # TP4 x PP2 fills one node: DP1 runs 384
    assert shrink_floor(4, 8, 2, 8, 64, 1) == 2  # 16-way model parallel needs two 8-GPU nodes
    assert shrink_floor_of(["--global-batch-size", "32", "--micro-batch-size", "1"],
                           rendezvous.parse(["--nnodes", "2", "--nproc-per-node", "2"])) == 1
    # no --global-batch-size: Megatron's default grows with DP, so no shrink keeps it
    assert shrink_floor_of(["--micro-batch-size", "1"], rendezvous.parse(["--nnodes", "2", "--nproc-per-node", "2"])) == 2


def test_torchrun_gets_the_floor_and_restarts() -> None:
    r = rendezvous.parse(["--nnodes", "2:3", "--nproc-per-node", "2"])
    assert elastic_options(["--nnodes", "2:3", "--nproc-per-node", "2"], r, 1) == [
        "--nproc-per-node", "2", "--nnodes", "1:2", "--max-restarts", "3"]
    assert elastic_options(["--nnodes=2", "--max-restarts", "1"], rendezvous.parse(["--nnodes=2"]), 2) == [
        "--max-restarts", "1", "--nnodes", "2:2"]


def test_a_static_rendezvous_keeps_its_nodes_and_has_no_spares() -> None:
    """--master-addr/--master-port: torch's static rendezvous cannot lose a node, so the job
    neither shrinks nor excludes one (issue 52: the launcher passed --nnodes FLOOR:MIN and
    nothing refused an S4 without a node, on which the staying nodes would wait for the
    excluded one until torch timed out); the controller refuses such an S4 in one line."""
    args = ["--global-batch-size", "32", "--micro-batch-size", "1"]
    static = rendezvous.parse(["--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "h", "--master-port", "29500"])
    assert job_floor(args, static) == 2
    assert elastic_options(["--nnodes", "2", "--nproc-per-node", "2"], static, job_floor(args, static)) == [
        "--nproc-per-node", "2", "--nnodes", "2:2", "--max-restarts", "3"]
    why = RestartRoom(2, floor=job_floor(args, static), spares=0).refusal([1])
    assert why is not None and "below 2" in why
    assert RestartRoom(2, floor=job_floor(args, static), spares=0).refusal([]) is None  # in place: fine
    with pytest.raises(InputError, match="static rendezvous .* has no spares"):
        job_floor(args, rendezvous.parse(["--nnodes", "2:3", "--master-addr", "h", "--master-port", "1"]))
    c10d = rendezvous.parse(["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1"])
    assert job_floor(args, c10d) == 1  # an elastic job shrinks as far as its batch allows


def test_an_exclusion_the_job_cannot_absorb_is_refused_with_the_reason() -> None:
    assert RestartRoom(2, floor=0).refusal([1]) is None  # one launcher: it replaces nodes itself
    assert RestartRoom(2, floor=2, spares=1).refusal([1]) is None  # the spare fills in
    assert RestartRoom(2, floor=1, spares=0).refusal([1]) is None  # shrinks to one node
    why = RestartRoom(2, floor=2, spares=0).refusal([1])
    assert why is not None and "no spare" in why and "below 2" in why
    assert RestartRoom(3, floor=2, spares=1).refusal([1, 2]) is None  # one spare, one node fewer
    assert RestartRoom(3, floor=3, spares=1).refusal([1, 2]) is not None
    fixed = RestartRoom(2, floor=1, spares=1, fixed=(0,)).refusal([0])
    assert fixed is not None and "rendezvous store" in fixed
    assert RestartRoom(2, floor=2).refusal([]) is None


def test_a_leave_file_round_trips_and_a_broken_one_reads_as_none(tmp_path: Path) -> None:
    leave = NodeLeave("node1", 1, 57, "S4 without node 1: slow", 1.5)
    write_leave(str(tmp_path), leave)
    assert read_leave(str(tmp_path), "node1") == leave
    assert read_leave(str(tmp_path), "node2") is None
    (tmp_path / "nodes" / "node1" / "leave.json").write_text("{not json")
    assert read_leave(str(tmp_path), "node1") is None


# --- finding the plane, agreeing on it ------------------------------------------------------

def test_access_json_is_taken_only_for_this_rendezvous_and_while_the_job_runs() -> None:
    good = {"job": "j1", "url": "redis://:pw@10.0.0.1:7000/0", "rdzv_id": "t1", "ended": None, "flags": "ab"}
    got = join.check_access(good, "t1")
    assert isinstance(got, join.PlaneAccess) and (got.url, got.job, got.flags) == (good["url"], "j1", "ab")
    assert "this launcher's --rdzv-id is 't2'" in str(join.check_access(good, "t2"))
    assert "ended" in str(join.check_access(dict(good, ended=5.0), "t1"))
    assert "no access.json" in str(join.check_access(None, "t1"))
    assert "no job" in str(join.check_access(dict(good, job=""), "t1"))


def test_a_plane_that_never_comes_is_a_reason_after_the_deadline(tmp_path: Path) -> None:
    why = join.find_plane(str(tmp_path), "t1", deadline_s=0.3, poll_s=0.1)
    assert isinstance(why, str) and "access.json" in why
    (tmp_path / "access.json").write_text(json.dumps(
        {"job": "j", "url": "redis://:pw@127.0.0.1:1/0", "rdzv_id": "t1", "ended": None}))
    why = join.find_plane(str(tmp_path), "t1", deadline_s=0.3, poll_s=0.1)
    assert isinstance(why, str) and "127.0.0.1:1 does not answer" in why


def test_a_launcher_with_another_rdzv_id_is_refused_at_once_and_the_job_stops_with_it(
        tmp_path: Path, url: str) -> None:
    """A node given a --rdzv-id other than the running job's in the same --falcon-out (issue
    52: it waited out the plane's deadline and then torch's, or formed a second job sharing
    the folder) learns it at once; the job's launchers stop on its note, one line each."""
    import threading
    import time

    from falconext.elastic.node import NodeRun, run_node
    from falconext.elastic.restart import write_refusal

    running = {"job": "j", "url": url, "rdzv_id": "1234", "ended": None}
    (tmp_path / "access.json").write_text(json.dumps(running))
    t0 = time.monotonic()
    other = join.find_plane(str(tmp_path), "1235", deadline_s=30, poll_s=0.1)
    assert isinstance(other, join.OtherJob) and other.rdzv_id == "1234" and time.monotonic() - t0 < 5
    assert "belongs to a running job of rendezvous '1234'" in other.refusal(str(tmp_path), "1235")
    assert isinstance(join.find_plane(str(tmp_path), "1234", deadline_s=5, poll_s=0.1), join.PlaneAccess)
    # a job that died (its Redis gone) or ended leaves no running job behind
    assert join.running_other_job(dict(running, url="redis://:pw@127.0.0.1:1/0"), "1235") is None
    assert join.running_other_job(dict(running, ended=5.0), "1235") is None
    # the job's own launcher, its agent waiting in the rendezvous, stops on the refusal
    waiting = [sys.executable, "-c", "import time; time.sleep(60)"]
    threading.Timer(1.0, write_refusal, (str(tmp_path), "node1", other.refusal(str(tmp_path), "1235"))).start()
    t0 = time.monotonic()
    with pytest.raises(InputError, match="node node1 refused this job, so it cannot form: --falcon-out"):
        run_node(NodeRun("node0", str(tmp_path), waiting, dict(os.environ), url, "j", False))
    assert time.monotonic() - t0 < 15


def test_every_rank_uses_the_plane_or_none_does() -> None:
    ranks = [{"host": "n0", "plane": True, "flags": "a"}, {"host": "n1", "plane": True, "flags": "a"}]
    assert plane_refusal(ranks) is None
    cut = plane_refusal([ranks[0], dict(ranks[1], plane=False)])
    assert cut is not None and "n1 cannot reach" in cut
    odd = plane_refusal([ranks[0], ranks[0], dict(ranks[1], flags="b")])
    assert odd is not None and "node(s) n1 differ from those of n0" in odd


# --- events from many nodes --------------------------------------------------------------------

def test_a_rank_event_is_strictly_checked() -> None:
    ev = RankEvent.of(3, {"time": 2.5, "type": "fail_slow", "rank": 3, "onset": 60})
    assert decode(encode(ev)).record() == {"time": 2.5, "type": "fail_slow", "rank": 3, "onset": 60}
    for bad in (RankEvent(0, "Bad Type", 1.0, {}), RankEvent(0, "x", 1.0, {"time": 3})):
        with pytest.raises(MessageError):
            decode(encode(bad))


def test_a_forwarding_event_log_keeps_its_node_log_and_forwards_in_order(tmp_path: Path) -> None:
    log = ForwardingEventLog(str(tmp_path / "nodes" / "n0" / "events.jsonl"))
    log.emit("tracking_started", rank=0)
    sent: list[dict] = []
    log.forward_to(sent.append)
    log.emit("fail_slow", rank=0, onset=60)
    assert [r["type"] for r in sent] == ["tracking_started", "fail_slow"]
    lines = [json.loads(x) for x in (tmp_path / "nodes" / "n0" / "events.jsonl").read_text().splitlines()]
    assert [r["type"] for r in lines] == ["tracking_started", "fail_slow"]
    log.close()


# --- faults that follow the hardware -------------------------------------------------------------

def test_a_fault_named_by_hardware_follows_it_across_renumbering() -> None:
    faults = parse_faults([{"kind": "compute", "node": 1, "local_rank": 0, "factor": 2.0, "start": 60}], 4, 2)
    assert faults[0].rank == 2  # where it is before anyone knows better
    # node 1's local rank 0 now runs as process 0, node 2 (a spare) as process 2
    assert on_hardware(faults, 0, 1, 0)[0].rank == 0
    assert on_hardware(faults, 2, 2, 0)[0].rank == -1
    assert placed(faults, {(0, 0): 0, (0, 1): 1, (2, 0): 2, (2, 1): 3}) == []  # node 1 left
    assert placed(faults, {(1, 0): 2})[0].rank == 2
    with pytest.raises(InputError, match="node must be in"):
        parse_faults([{"kind": "compute", "node": 3, "factor": 2.0}], 4, 2, hardware_nodes=3)
    with pytest.raises(InputError, match="local_rank"):
        parse_faults([{"kind": "compute", "node": 1, "local_rank": 2, "factor": 2.0}], 4, 2)


# --- the bed ----------------------------------------------------------------------------------------

def test_the_bed_substitutes_per_node_and_reads_rates() -> None:
    assert substitute(["x{node}", "--a", "{addr}:{head}", "{other}"], 2, "10.0.0.12", "10.0.0.10") == [
        "x2", "--a", "10.0.0.12:10.0.0.10", "{other}"]
    assert mbps_to_bytes(400) == 50e6
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InputError, match="--link-mbps"):
            mbps_to_bytes(bad)


def test_the_device_slows_for_more_ranks_than_cores() -> None:
    assert host_gflops(2, 2) == DEFAULT_GFLOPS
    assert host_gflops(2, 4) == DEFAULT_GFLOPS / 2
    assert host_gflops(2, 16) == 0.25
    assert host_gflops(0, 4) == DEFAULT_GFLOPS


def _netns_why() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    from falconext.testbed import netns

    return netns.available()


@pytest.mark.skipif(_netns_why() is not None, reason=f"falconext nodes: {_netns_why()}")
def test_falconext_nodes_runs_the_command_per_node_and_removes_everything(tmp_path: Path) -> None:
    from falconext.testbed import netns

    script = ("echo addr={addr} head={head} name=$FALCONEXT_NODE_NAME hw=$FALCON_NETNS_NODE "
              "share=$FALCONEXT_NODES_ON_HOST; ip -4 -o addr show | grep -c {addr}; exit {node}")
    proc = subprocess.run([sys.executable, "-m", "falconext.cli", "nodes", "--count", "3", "--out", str(tmp_path),
                           "--", "sh", "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # node1's status: the first that failed
    info = json.loads((tmp_path / "nodes.json").read_text())
    addrs = [n["addr"] for n in info["nodes"]]
    for k in range(3):
        line = f"[node{k}] addr={addrs[k]} head={addrs[0]} name=node{k} hw={k} share=3"
        assert line in proc.stdout, proc.stdout
        assert (tmp_path / f"node{k}.log").read_text().splitlines()[1] == "1"  # its own address, inside
    assert "node1 exited with status 1" in proc.stdout
    assert not [n for n in netns.list_namespaces() if any(str(p["pid"]) in n for p in info["nodes"])]
    assert not netns.leftovers(f"{netns.PREFIX}{info['nodes'][0]['pid']}")


def test_falconext_nodes_refuses_what_it_cannot_do() -> None:
    proc = subprocess.run([sys.executable, "-m", "falconext.cli", "nodes", "--count", "2"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no command given" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "falconext.cli", "nodes", "--count", "0", "--", "true"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--count must be >= 1" in proc.stderr


# --- the controller's view of a multi-node job -------------------------------------------------

def test_the_controller_knows_the_nodes_spares_and_rounds_of_a_multi_node_job() -> None:
    from falconext.config import FalconConfig
    from falconext.control.controller import Controller
    from falconext.protocol.messages import Heartbeat
    from falconext.control.service import take_node

    ctl = Controller(FalconConfig(restart_floor_nodes=2), world=4)
    for rank in range(4):
        ctl.handle(Heartbeat(rank, rank // 2, 10, 0.5, 100.0), 100.0)
    ctl.plane_host = "h0"
    for node, host in ((0, "h0"), (1, "h1")):
        take_node(ctl, {"node": node, "host": host, "world": 4, "round_id": "r@a:1"})
    take_node(ctl, {"node": "x", "host": 3, "world": True, "round_id": "r@b:2"})  # malformed: ignored
    assert ctl.node_hosts == {0: "h0", 1: "h1"}
    room = ctl.restart_room()
    assert (room.nodes, room.floor, room.spares, room.fixed) == (2, 2, 0, (0,))
    assert room.refusal([1]) is not None  # no spare, no shrink below 2
    ctl.spares = 1
    assert ctl.restart_room().refusal([1]) is None
    assert "rendezvous store" in str(ctl.restart_room().refusal([0]))
    # a new round, here of 2 ranks on one node: the ranks' state goes
    take_node(ctl, {"node": 0, "host": "h0", "world": 2, "round_id": "r@a:2"})
    assert ctl.rounds == 1 and ctl.world == 2 and ctl.beats == {} and ctl.history == {}
    assert ctl.node_hosts == {0: "h0"}
    # the next round: a spare first as node 1, then node 0 (whichever comes first): one round
    take_node(ctl, {"node": 1, "host": "h2", "world": 4, "round_id": "r@a:3"})
    take_node(ctl, {"node": 0, "host": "h0", "world": 4, "round_id": "r@a:3"})
    assert ctl.rounds == 2 and ctl.node_hosts == {0: "h0", 1: "h2"}


def test_an_s4_the_job_cannot_absorb_is_not_started() -> None:
    from types import SimpleNamespace

    from falconext.mitigate.mitigation import action_for

    mit = SimpleNamespace(gpus=[2], links=[], planner=SimpleNamespace(status=lambda: {"healthy_s": 0.8}))
    d = SimpleNamespace(action="apply", strategy="S4", reason="slow")

    def beats(iter_s: float) -> dict:
        return {r: SimpleNamespace(node=r // 2, iter_s=iter_s) for r in range(4)}

    why = action_for(mit, d, beats(2.4), None, RestartRoom(2, floor=2, spares=0))  # type: ignore[arg-type]
    assert isinstance(why, str) and "no spare" in why
    act = action_for(mit, d, beats(2.4), None, RestartRoom(2, floor=2, spares=1))  # type: ignore[arg-type]
    assert act.exclude_nodes == [1]  # type: ignore[union-attr]
    # no spare, but the job can shrink to one node: worth it against a 3x slow node (2.4 s
    # now, about 1.6 s on one node), not against a mild one (1.3 s now)
    act = action_for(mit, d, beats(2.4), None, RestartRoom(2, floor=1, spares=0))  # type: ignore[arg-type]
    assert act.exclude_nodes == [1]  # type: ignore[union-attr]
    why = action_for(mit, d, beats(1.3), None, RestartRoom(2, floor=1, spares=0))  # type: ignore[arg-type]
    assert isinstance(why, str) and "shrink to 1 node(s) and train at about 1.600 s" in why
    # with a spare the job is back at its healthy time, whatever the level
    act = action_for(mit, d, beats(1.3), None, RestartRoom(2, floor=1, spares=1))  # type: ignore[arg-type]
    assert act.exclude_nodes == [1]  # type: ignore[union-attr]


def test_s3_across_nodes_keeps_rank_0_on_the_stores_node_with_the_same_work() -> None:
    """TP1 x DP2 x PP2 on two nodes of two: the plan "each pipeline inside a node" may hand
    rank 0 to a process of node 1; relabelling DP replicas brings it back to node 0 and
    leaves each pipeline on the same processes. A plan whose node 0 plays no first stage
    cannot be relabelled."""
    from falconext.mitigate.topology import rank0_on_first_node

    def pipelines(roles: list[int]) -> set[frozenset[int]]:  # the processes of each pipeline (dp index)
        return {frozenset(p for p, r in enumerate(roles) if r % 2 == d) for d in (0, 1)}

    planned = [1, 3, 0, 2]  # node 0 (processes 0, 1) runs pipeline 1, node 1 pipeline 0
    anchored = rank0_on_first_node(planned, 1, 2, 2)
    assert anchored == [0, 2, 1, 3] and pipelines(anchored) == pipelines(planned)
    assert [r // 2 for r in anchored] == [r // 2 for r in planned]  # every process keeps its stage
    assert rank0_on_first_node([0, 2, 1, 3], 1, 2, 2) == [0, 2, 1, 3]
    assert rank0_on_first_node([2, 0, 3, 1], 1, 2, 2) == [2, 0, 3, 1]  # rank 0 on node 0 already
    assert rank0_on_first_node([2, 3, 0, 1], 1, 2, 2) is None  # node 0 holds only the last stage
    # TP2: the TP index is relabelled too, TP groups stay whole
    assert rank0_on_first_node([2, 3, 0, 1], 2, 1, 2) is None
    assert rank0_on_first_node([1, 0, 2, 3], 2, 1, 2) == [1, 0, 2, 3]
    assert rank0_on_first_node([3, 2, 1, 0, 5, 4, 7, 6], 2, 2, 2) == [0, 1, 2, 3, 6, 7, 4, 5]


def test_an_s3_restart_hands_each_process_its_planned_rank_the_same_on_every_node() -> None:
    from falconext.megatron_lm.hooks import ROLES_ENV
    from falconext.megatron_lm.rank import resumed_roles

    extra = {"strategy": "S3", "roles": [0, 2, 1, 3], "hosts": ["node0", "node1"]}
    seen = {}
    for group in (0, 1):
        for local in (0, 1):
            env = {"WORLD_SIZE": "4", "RANK": str(2 * group + local), "GROUP_RANK": str(group),
                   "LOCAL_RANK": str(local), "FALCONEXT_NODE_NAME": f"node{group}"}
            assert resumed_roles(extra, env) is None
            seen[2 * group + local] = int(env["RANK"])
            assert json.loads(env[ROLES_ENV]) == [0, 2, 1, 3] and env["LOCAL_RANK"] == str(local)
    assert seen == {0: 0, 1: 2, 2: 1, 3: 3}
    # another host at node index 1 (a spare took it): the same roles, and a line saying so
    env = {"WORLD_SIZE": "4", "RANK": "2", "GROUP_RANK": "1", "LOCAL_RANK": "0", "FALCONEXT_NODE_NAME": "node2"}
    assert "node2 plays the S3 roles planned for node index 1 (host node1)" in (resumed_roles(extra, env) or "")
    assert env["RANK"] == "1"
    # a round of another size (a shrink since): roles off on every process, process 0 says so
    env = {"WORLD_SIZE": "2", "RANK": "0", "GROUP_RANK": "0", "LOCAL_RANK": "0"}
    assert "planned for 4 ranks, this round has 2" in (resumed_roles(extra, env) or "")
    assert env["RANK"] == "0" and ROLES_ENV not in env
    # no roles (an S4): nothing changes; broken roles: one line, nothing changes
    env = {"WORLD_SIZE": "4", "RANK": "3"}
    assert resumed_roles({"strategy": "S4"}, env) is None and env == {"WORLD_SIZE": "4", "RANK": "3"}
    assert "not a permutation" in (resumed_roles({"roles": [0, 0, 1, 2]}, env) or "") and env["RANK"] == "3"


def test_the_nodes_that_stay_wait_for_the_leaving_nodes_agent_with_a_deadline(tmp_path: Path) -> None:
    import threading
    import time

    from falconext.elastic.restart import mark_left, wait_left

    out = str(tmp_path)
    assert wait_left(out, [], 5.0) == []
    t0 = time.monotonic()
    assert wait_left(out, ["node1"], 0.3, poll_s=0.05) == ["node1"]  # never left: the deadline ends the wait
    assert 0.3 <= time.monotonic() - t0 < 2.0
    timer = threading.Timer(0.3, mark_left, (out, "node1"))
    timer.start()
    t0 = time.monotonic()
    try:
        assert wait_left(out, ["node1"], 10.0, poll_s=0.05) == []
    finally:
        timer.join()
    assert time.monotonic() - t0 < 5.0


def test_one_supervisor_restarts_on_request_up_to_its_limit_and_reports_each_attempt(tmp_path: Path) -> None:
    """The restart policy every single-launcher job runs under: a request restarts (once
    prepared), no request ends the job, a failure is one line naming where, and a request
    past the limit is refused. Each attempt's end is an event."""
    from falconext.elastic.supervisor import AttemptEnd, Supervisor
    from falconext.mitigate.restart import LAUNCH_TIME_ENV, RestartRequest, write_request

    out = str(tmp_path)
    told: list[tuple[str, dict]] = []

    def job(asks: int, fail_at: int | None = None, limit: int = 3) -> tuple[Supervisor, list[int]]:
        started: list[int] = []
        prepared: list[int] = []
        env: dict[str, str] = {}
        sup = Supervisor(out, env, max_restarts=limit, tell=lambda t, **f: told.append((t, f)))

        def start(attempt: int) -> AttemptEnd:
            started.append(attempt)
            if attempt == fail_at:
                return AttemptEnd(1, "node 1's torchrun")
            if attempt < asks:
                write_request(out, RestartRequest(10 * (attempt + 1), [], "ckpt", requested_at=1000.0 + attempt,
                                                  attempt=attempt + 1))
            return AttemptEnd(0)

        def prepare(req: RestartRequest) -> None:
            prepared.append(req.attempt)
            assert env[LAUNCH_TIME_ENV] != repr(req.requested_at)  # still the previous attempt's

        assert sup.run(start, prepare) == 0
        assert prepared == list(range(1, asks + 1)) and env[LAUNCH_TIME_ENV] == repr(1000.0 + asks - 1)
        return sup, started

    sup, started = job(2)
    assert started == [0, 1, 2] and sup.attempt == 2
    assert [(t, f["attempt"], f["code"], f["restart"]) for t, f in told] == \
        [("attempt_ended", 0, 0, 1), ("attempt_ended", 1, 0, 2), ("attempt_ended", 2, 0, None)]
    assert not os.path.exists(os.path.join(out, "restart.json"))  # each request acted on once
    assert os.path.exists(os.path.join(out, "restart-2.json"))
    with pytest.raises(InputError, match=r"training failed \(node 1's torchrun exit status 1\)"):
        job(3, fail_at=1)
    with pytest.raises(InputError, match="restart number 2; at most 1 are allowed"):
        job(3, limit=1)


def test_an_exclude_hook_that_fails_or_hangs_is_one_line_and_bounded(tmp_path: Path, capsys) -> None:
    import time

    from falconext.elastic.node import NodeRun, on_exclude

    run = NodeRun("node1", str(tmp_path), [], {}, None, "job", False, "unused", on_exclude_timeout_s=0.5)
    on_exclude(run, "echo drained node1")
    on_exclude(run, "echo no such node >&2; exit 3")
    t0 = time.monotonic()
    on_exclude(run, "sleep 30")
    assert time.monotonic() - t0 < 5.0
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["falconext: --falcon-on-exclude for node1: done",
                     "falconext: --falcon-on-exclude for node1: failed (status 3)",
                     "falconext: --falcon-on-exclude for node1: failed (timed out after 0.5s)"]


@pytest.mark.parametrize("spare", [True, False], ids=["spare", "kept-waiting-by-arrival-order"])
def test_a_node_never_needed_ends_0_when_its_agent_loses_the_store_at_the_jobs_end(
        tmp_path: Path, url: str, spare: bool, capsys) -> None:
    """A spare (or the launcher the rendezvous kept waiting) whose agent fails because the
    job's head exited ends 0 saying so, though the job's end is marked a moment after its
    agent failed (issue 52: it said 'training failed' and failed a Slurm job that trained to
    the end); a node whose ranks trained still fails."""
    import threading
    import time

    from falconext.control.plane import ACCESS_FILE
    from falconext.elastic.node import NodeRun, run_node
    from falconext.elastic.restart import mark_joined

    started = time.time()
    access = tmp_path / ACCESS_FILE
    access.write_text(json.dumps({"rdzv_id": "j", "url": url, "job": "job", "started": started, "ended": None}))
    (tmp_path / "run.json").write_text(json.dumps({"clock": {"time": started + 1}}))

    def head_marks_the_end() -> None:
        time.sleep(1.5)
        access.write_text(json.dumps({"rdzv_id": "j", "job": "job", "started": started, "ended": time.time()}))

    lost_store = [sys.executable, "-c", "import sys; sys.exit(1)"]
    run = NodeRun("node2", str(tmp_path), lost_store, dict(os.environ), url, "job", spare)
    marker = threading.Thread(target=head_marks_the_end)
    marker.start()
    assert run_node(run) == 0
    marker.join()
    said = "spare node node2" if spare else "node node2"
    assert f"falconext: {said}: the job ended before it was needed" in capsys.readouterr().out
    mark_joined(str(tmp_path), "node2")  # its ranks trained: the same failure is one
    with pytest.raises(InputError, match="training failed on node node2"):
        run_node(NodeRun("node2", str(tmp_path), lost_store, dict(os.environ), url, "job", False))


def test_hosts_of_two_sizes_give_the_same_flags_digest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The digest that tells a node with other --falcon* flags to train without the plane
    leaves out what each launcher picks from its own host (issue 52: the CPU device's speed,
    from the core count, made two hosts of different sizes read as "flags differ")."""
    from falconext.elastic.hosts import NODES_ON_HOST_ENV
    from falconext.inputs import option
    from falconext.megatron_lm.hooks import flags_digest
    from falconext.megatron_lm.launcher import _prepare, split_command

    seen = []
    for sharing, user in (("1", []), ("2", []), ("2", ["--falcon-bocd-threshold", "0.7"])):
        monkeypatch.setenv(NODES_ON_HOST_ENV, sharing)  # as many ranks on fewer cores: a smaller host
        plan = split_command(["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                              "h:1", "train.py", "--global-batch-size", "8", "--falcon", "--falcon-out",
                              str(tmp_path / f"out{len(seen)}"), *user])
        job = _prepare(plan, rendezvous.parse(plan.torchrun), hosts=False)
        seen.append((option(job.flags, "--falcon-device-gflops"), flags_digest(json.dumps(job.flags))))
    if seen[0][0] is not None:  # the emulated device (no CUDA): each host picked its own speed
        assert seen[0][0] != seen[1][0], seen
    assert seen[0][1] == seen[1][1], seen
    assert seen[2][1] != seen[1][1], seen  # a flag the user gave differently still shows


def test_a_host_whose_name_maps_to_loopback_serves_the_job_from_its_cluster_address() -> None:
    """Debian maps a host's own name to 127.0.1.1: the head node reached its own endpoint
    from loopback, and bound the plane's Redis and torchrun's --local-addr there, where no
    other node can reach (issue 52). Its default route's address is taken, saying so."""
    addr, why = rendezvous.cluster_address("127.0.1.1", None, "10.1.2.3", ["10.1.2.3", "10.9.9.9"])
    assert addr == "10.1.2.3" and why is not None and "127.0.1.1" in why and "10.1.2.3" in why
    addr, _ = rendezvous.cluster_address("127.0.1.1", None, None, ["127.0.0.5", "10.9.9.9"])
    assert addr == "10.9.9.9"  # no default route (a namespace): the first global address
    assert rendezvous.cluster_address("127.0.1.1", "10.7.7.7", "10.1.2.3", []) == ("10.7.7.7", None)  # --local-addr
    assert rendezvous.cluster_address("10.213.0.10", None, "10.1.2.3", []) == ("10.213.0.10", None)
    addr, why = rendezvous.cluster_address("127.0.1.1", None, None, [])
    assert addr == "127.0.1.1" and why is not None and "cannot reach" in why
    # this machine: what the launcher reads to choose
    assert all(not rendezvous.is_loopback(a) for a in rendezvous.global_addresses())
    route = rendezvous.route_address()
    assert route is None or not rendezvous.is_loopback(route)
