"""The NCCL hooks against real torch.distributed (gloo, several processes on CPU).

Each scenario runs this file as a script in ``world`` processes; every child installs a
tracer, runs real collectives (checking the data still arrives), and writes what it saw
as JSON for the parent test to assert on. Pure parts (trap arguments, record fields,
CUDA time conversion with fake events, install/uninstall bookkeeping) run in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import traceback
import types
from pathlib import Path
from typing import Any, Callable

import pytest
from wallclock import LOADED_HOST_SLACK_S

HERE = Path(__file__).resolve()
CHILD_TIMEOUT_S = 150

WRAPPED = (
    "all_reduce", "reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter",
    "all_gather_into_tensor", "_all_gather_base", "all_gather", "broadcast", "send", "recv",
    "isend", "irecv", "batch_isend_irecv", "all_to_all_single", "barrier", "_coalescing_manager",
)

#: run first, before any job runs ahead (conftest.py: RUN_FIRST):
#: it times real waits inside megatron-core's schedules
RUN_FIRST = True


# --------------------------------------------------------------------------- parent side


def _launch(scenario: str, world: int, tmp: Path) -> list[dict[str, Any]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs = []
    for rank in range(world):
        log = open(tmp / f"{scenario}.{rank}.log", "w")
        procs.append(subprocess.Popen(
            [sys.executable, str(HERE), scenario, str(rank), str(world), str(tmp)],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        ))
        log.close()
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
    results = []
    for rank in range(world):
        path = tmp / f"{scenario}.{rank}.json"
        log = (tmp / f"{scenario}.{rank}.log").read_text()[-4000:]
        if not path.exists():
            rc = procs[rank].returncode
            pytest.fail(f"{scenario} rank {rank} wrote no result (rc={rc}):\n{log}")
        data = json.loads(path.read_text())
        if "error" in data:
            pytest.fail(f"{scenario} rank {rank} failed:\n{data['error']}\n{log}")
        results.append(data)
    return results


@pytest.fixture(scope="module")
def ops_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _launch("ops", 2, tmp_path_factory.mktemp("ops"))


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    import megatron.core  # noqa: F401 -- a hard dependency: a broken install fails here, never skips
    return _launch("megatron", 2, tmp_path_factory.mktemp("megatron"))


def _labelled(result: dict[str, Any], part: str) -> dict[str, dict[str, Any]]:
    records, labels = result[part]["records"], result[part]["labels"]
    assert [r["op"] for r in records] == [lab.split(":")[0] for lab in labels], (labels, records)
    return dict(zip(labels, records))  # a repeated label keeps its last record


def test_data_still_arrives_through_the_wrappers(ops_run: list[dict[str, Any]]) -> None:
    for res in ops_run:
        failed = {k: v for k, v in res["checks"].items() if v is not True}
        assert not failed, failed
        assert res["errors"] == 0


def test_records_name_op_group_bytes_and_peer(ops_run: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(ops_run):
        other = 1 - rank
        recs = _labelled(res, "main")
        expect = {
            # label: (group id, bytes, peer)
            "all_reduce:f32": ("world:0,1", 16, None),
            "all_reduce:async": ("world:0,1", 64, None),
            "reduce_scatter:tensor": ("world:0,1", 16, None),
            "reduce_scatter:base": ("world:0,1", 16, None),
            "reduce_scatter:list": ("world:0,1", 16, None),
            "all_gather:tensor": ("world:0,1", 24, None),
            "all_gather:base": ("world:0,1", 24, None),
            "all_gather:list": ("world:0,1", 16, None),
            "broadcast:bf16": ("world:0,1", 10, None),
            "all_to_all:single": ("world:0,1", 32, None),
            "barrier:world": ("world:0,1", 0, None),
            "send:sync": ("world:0,1", 12, other),
            "recv:sync": ("world:0,1", 12, other),
            "send:async": ("world:0,1", 12, other),
            "recv:async": ("world:0,1", 12, other),
            "send:batch": ("world:0,1", 20, other),
            "recv:batch": ("world:0,1", 20, other),
            "send:c10d_batch": ("world:0,1", 8, other),
            "recv:c10d_batch": ("world:0,1", 8, other),
            "all_reduce:pair": ("g:0,1", 4, None),
            "all_reduce:pair_named": ("pair:0,1", 4, None),
            "all_reduce:solo": (f"g:{rank}", 4, None),
            "send:group_dst": ("pair:0,1", 4, other),
            "all_reduce:coalesced_b": ("world:0,1", 12, None),
            "all_reduce:traced_coalesced_async": ("g:0,1", 4, None),
            "recv:group_src": ("pair:0,1", 4, other),
        }
        assert set(expect) <= set(recs), sorted(set(expect) - set(recs))
        for label, (gid, nbytes, peer) in expect.items():
            r = recs[label]
            assert (r["group"], r["bytes"], r.get("peer")) == (gid, nbytes, peer), (label, r)
            assert r["rank"] == rank
        assert recs["all_reduce:f32"]["group_ranks"] == [0, 1]
        assert recs["all_reduce:pair_named"]["role"] == "pair"
        assert recs["all_reduce:f32"]["role"] == "world"
        assert "role" not in recs["all_reduce:pair"]


def test_seq_is_monotonic_and_times_are_ordered(ops_run: list[dict[str, Any]]) -> None:
    for res in ops_run:
        records = res["main"]["records"]
        seqs = [r["seq"] for r in records]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        assert seqs[0] == 0
        for r, label in zip(records, res["main"]["labels"]):
            assert r["t_start"] == r["t_issue"]  # CPU: the start is not observable
            if label.startswith("all_reduce:coalesced_"):
                assert "t_end" not in r  # unknown, not the time it was queued
            else:
                assert r["t_end"] >= r["t_issue"], r
        issues = [r["t_issue"] for r in records]
        assert issues == sorted(issues)


def test_async_ops_get_a_completion_time(ops_run: list[dict[str, Any]]) -> None:
    for res in ops_run:
        recs = _labelled(res, "main")
        # the wait-proxy (default; futures are tested below) for every kind of handle
        for label in ("all_reduce:async", "reduce_scatter:tensor", "send:async", "recv:async",
                      "send:batch", "recv:batch"):
            assert recs[label].get("t_end") is not None, label
        assert res["proxied"] == {"reduce_scatter_tensor": True, "isend": True, "all_reduce": True}


def test_coalesced_calls_complete_when_the_traced_manager_does(
    ops_run: list[dict[str, Any]],
) -> None:
    for res in ops_run:
        main = res["main"]
        pairs = list(zip(main["labels"], main["records"]))
        traced = [r for lab, r in pairs if "traced_coalesced" in lab]
        untraced = [r for lab, r in pairs if lab.startswith("all_reduce:coalesced_")]
        assert len(traced) == 4 and len(untraced) == 2
        assert all(r["t_end"] >= r["t_issue"] for r in traced)
        # one batch: both calls of a manager complete together
        assert traced[0]["t_end"] == traced[1]["t_end"] and traced[2]["t_end"] == traced[3]["t_end"]
        assert all("t_end" not in r for r in untraced)


def test_completion_futures_where_gloo_has_them(ops_run: list[dict[str, Any]]) -> None:
    for res in ops_run:
        fut = res["futures"]
        assert fut["all_reduce_proxied"] is False  # timed by the future callback
        assert fut["reduce_scatter_proxied"] is True  # gloo has no future here: proxy
        assert fut["data_ok"] is True
        assert [r["op"] for r in fut["records"]] == ["all_reduce", "reduce_scatter"]
        for r in fut["records"]:
            assert r["t_end"] >= r["t_issue"]


def test_group_ids_agree_across_ranks(ops_run: list[dict[str, Any]]) -> None:
    by_rank = [_labelled(res, "main") for res in ops_run]
    for label, rec in by_rank[0].items():
        if label != "all_reduce:solo":
            assert by_rank[1][label]["group"] == rec["group"], label
    for rec in by_rank[0].values():
        role, ranks = rec["group"].split(":")
        assert [int(r) for r in ranks.split(",")] == sorted(rec["group_ranks"])


def test_uninstall_restores_the_originals(ops_run: list[dict[str, Any]]) -> None:
    for res in ops_run:
        assert res["wrapped_during"] == sorted(WRAPPED)
        assert res["restored"] is True
        assert res["p2pop_accepts_wrapper"] is True


def test_incomplete_record_is_drained_after_the_timeout(ops_run: list[dict[str, Any]]) -> None:
    sender = ops_run[0]["pending"]
    assert sender["early"] == []  # the unwaited isend holds back the records behind it
    assert [r["op"] for r in sender["late"]] == ["send", "all_reduce"]
    assert "t_end" not in sender["late"][0]
    assert sender["late"][1]["t_end"] >= sender["late"][1]["t_issue"]


def test_ring_overflow_is_counted(ops_run: list[dict[str, Any]]) -> None:
    for res in ops_run:
        ov = res["overflow"]
        assert ov["dropped"] == 6
        assert ov["seqs"] == [0, 1, 2, 3]
        assert ov["after"] == [10]  # the gap in seq shows where calls were lost


def test_trap_holds_until_release(ops_run: list[dict[str, Any]]) -> None:
    trap = ops_run[0]["trap"]
    assert trap["held_seen"] is True
    assert 0.15 <= trap["released_pause"] <= 0.2 + LOADED_HOST_SLACK_S  # released after 0.2 s
    assert trap["released_expired"] == 0
    assert trap["issue_after_arm"] >= 0.15  # the call was issued only after the hold
    assert trap["sum_ok"] is True


def test_trap_deadline_lets_the_call_go(ops_run: list[dict[str, Any]]) -> None:
    trap = ops_run[0]["trap"]
    assert 0.25 <= trap["expired_pause"] <= 0.3 + LOADED_HOST_SLACK_S  # its 0.3 s deadline
    assert trap["expired"] == 1
    assert trap["holds"] == 2
    assert trap["armed_after"] is False
    assert trap["holds_after_unarmed"] == 2  # a disarmed trap lets the next call through


def test_cuda_event_path_with_fake_events(ops_run: list[dict[str, Any]]) -> None:
    for res in ops_run:
        recs = res["fake_cuda"]["records"]
        assert [r["op"] for r in recs] == ["all_reduce", "all_reduce", "send", "recv"]
        for r in recs:
            assert r["t_issue"] - 0.01 <= r["t_start"] <= r["t_end"], r
        assert res["fake_cuda"]["data_ok"] is True


def test_megatron_roles_name_parallel_state_groups(megatron_run: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(megatron_run):
        recs = _labelled(res, "main")
        assert recs["all_reduce:tp"]["group"] == "tp:0,1"
        assert recs["all_reduce:tp"]["role"] == "tp"
        assert recs["all_reduce:dp"]["group"] == f"dp:{rank}"
        # DDP's gradient group "with context parallel" is the DP group when CP == 1
        assert recs["all_reduce:dp_cp"]["group"] == f"dp:{rank}"
        assert recs["all_reduce:pp"]["group"] == f"pp:{rank}"
        assert recs["barrier:world"]["group"] == "world:0,1"
        assert recs["all_gather:alias"]["group"] == "tp:0,1"
        assert recs["all_gather:alias"]["bytes"] == 32
        assert recs["send:megatron_p2p"]["peer"] == 1 - rank
        assert recs["recv:megatron_p2p"]["group"] == "tp:0,1"
        assert res["checks"] == {"p2p_data": True, "alias_wrapped": True, "alias_restored": True}


# ------------------------------------------------------------------- in-process (pure)


def test_trap_requires_a_deadline() -> None:
    from falconext.trace.trap import Trap

    trap = Trap()
    with pytest.raises(TypeError):
        trap.arm()  # type: ignore[call-arg]
    for bad in (None, 0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            trap.arm(bad)  # type: ignore[arg-type]
    assert trap.armed is False
    trap.arm(1.0)
    assert trap.armed is True
    trap.release()
    assert trap.armed is False and trap.holds == 0


def test_install_is_exclusive_idempotent_and_reversible() -> None:
    import torch.distributed as dist

    from falconext.trace.hooks import CallTracer

    before = {n: getattr(dist, n) for n in WRAPPED if hasattr(dist, n)}
    probe = types.ModuleType("megatron._falconext_alias_probe")
    probe.gather = dist.all_gather_into_tensor  # an import-time alias, as Megatron makes
    probe.unrelated = len
    sys.modules[probe.__name__] = probe
    a, b = CallTracer(0), CallTracer(1)
    try:
        a.install()
        a.install()
        assert a.installed
        assert all(getattr(dist, n) is not f for n, f in before.items())
        assert probe.gather is dist.all_gather_into_tensor
        assert dist.isend == before["isend"] and hash(dist.isend) == hash(before["isend"])
        with pytest.raises(RuntimeError):
            b.install()
        late = types.ModuleType("megatron._falconext_late_probe")
        late.reduce = dist.all_reduce  # imported while the tracer was installed
        sys.modules[late.__name__] = late
        a.uninstall()
        a.uninstall()
        assert all(getattr(dist, n) is f for n, f in before.items())
        assert probe.gather is before["all_gather_into_tensor"]
        assert late.reduce is before["all_reduce"]
        assert probe.unrelated is len
        b.install()  # the slot is free again
        b.uninstall()
    finally:
        a.uninstall()
        b.uninstall()
        sys.modules.pop(probe.__name__, None)
        sys.modules.pop("megatron._falconext_late_probe", None)


def test_aliases_of_c10d_functions_are_rebound_above_a_lower_wrapper() -> None:
    import functools

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from falconext.trace.hooks import CallTracer

    base = c10d.all_gather_into_tensor
    calls: list[int] = []

    @functools.wraps(base)
    def below(*args: Any, **kwargs: Any) -> Any:  # e.g. the fault injector, installed first
        calls.append(1)
        return base(*args, **kwargs)

    saved = dist.all_gather_into_tensor
    probe = types.ModuleType("megatron._falconext_base_probe")
    probe.gather = base  # Megatron bound c10d's function at import time
    sys.modules[probe.__name__] = probe
    dist.all_gather_into_tensor = below
    tracer = CallTracer(0)
    try:
        tracer.install()
        assert probe.gather is dist.all_gather_into_tensor  # now traced (and injected)
        tracer.uninstall()
        assert probe.gather is base and dist.all_gather_into_tensor is below
    finally:
        tracer.uninstall()
        dist.all_gather_into_tensor = saved
        sys.modules.pop(probe.__name__, None)


def test_cuda_events_need_a_device() -> None:
    import torch

    from falconext.trace.hooks import CallTracer

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(RuntimeError):
        CallTracer(0, cuda_events=True)


class _FakeEvent:
    """A CUDA event stand-in: 'GPU time' is a fake clock value set when it executes."""

    def __init__(self, gpu: list[float]) -> None:
        self._gpu = gpu
        self.t: float | None = None
        self.records = 0

    def record(self, stream: object = None) -> None:
        self.t = None  # pending until the test lets the 'GPU' run it
        self.records += 1

    def run(self) -> None:
        self.t = self._gpu[0]

    def query(self) -> bool:
        return self.t is not None

    def elapsed_time(self, other: "_FakeEvent") -> float:
        assert self.t is not None and other.t is not None
        return (other.t - self.t) * 1000.0


def test_cuda_timing_resolves_off_thread_with_references() -> None:
    from falconext.trace.cuda_timing import CudaTiming

    host = [100.0]
    gpu = [5.0]  # the GPU clock is offset from the host clock by -95 s
    made: list[_FakeEvent] = []

    def factory() -> _FakeEvent:
        made.append(_FakeEvent(gpu))
        return made[-1]

    timing = CudaTiming(lambda: host[0], event_factory=factory, side_record=lambda ev: ev.record())
    ref = made[0]
    timing.maintain()
    assert not timing._refs  # the reference has not executed: nothing can be converted
    ref.run()  # executes at gpu 5.0 == host 100.0
    timing.maintain()
    # entry layout: seq, op, info, bytes, peer, t_issue, t_start, t_end, done, ev0, ev1
    entry = [0, "all_reduce", None, 4, None, 100.5, None, None, True, None, None]
    entry[9] = timing.record()
    entry[10] = timing.record()
    assert timing.resolve(entry) is None  # events recorded but not executed yet
    gpu[0] = 5.75
    entry[9].run()
    gpu[0] = 6.25
    entry[10].run()
    t_start, t_end = timing.resolve(entry)
    assert t_start == pytest.approx(100.75) and t_end == pytest.approx(101.25)
    assert len(timing._pool) == 2  # both events go back to the pool, none is created anew
    n = len(made)
    timing.record(), timing.record()
    assert len(made) == n
    # a newer reference converts later calls; earlier calls keep the older one
    host[0] = 200.0
    timing.recalibrate_s = 10.0
    timing.maintain()  # old reference is > 10 s old: a new one is recorded
    gpu[0] = 105.5
    made[-1].run()
    timing.maintain()
    ev = _FakeEvent(gpu)
    ev.t = 106.0
    assert timing.to_host(ev, 200.1) == pytest.approx(200.5)
    assert timing.to_host(ev, 150.0) == pytest.approx(201.0)


def test_record_optional_fields_round_trip() -> None:
    from falconext.trace.records import CallRecord, RecordError, parse_record

    rec = CallRecord(1, "send", "pp:1,3", 64, 1.0, 1.0, 1.5, 7, (3, 1), "pp", 3)
    d = rec.to_dict()
    assert d["group_ranks"] == [3, 1]
    assert parse_record(json.loads(json.dumps(d))) == rec
    plain = CallRecord(0, "all_reduce", "g", 4, 2.0)
    assert set(plain.to_dict()) == {"rank", "op", "group", "bytes", "t_issue"}
    assert parse_record(plain.to_dict()) == plain
    # the call log's line, written by hand, is json.dumps's to the byte (escapes included)
    odd = CallRecord(2, "all_reduce", 'tp:"0"\u00e9', 8, 2.000000001, None, 3.25, 9, None, "tp", None)
    for r in (rec, plain, odd):
        assert r.to_json() == json.dumps(r.to_dict(), separators=(",", ":"))
    with pytest.raises(RecordError, match="finite"):
        CallRecord(0, "all_reduce", "g", 4, float("nan")).to_json()
    for bad in ({"group_ranks": "0,1"}, {"group_ranks": [0, 0]}, {"role": ""}, {"peer": -1}):
        with pytest.raises(RecordError):
            parse_record({**plain.to_dict(), **bad})


# ------------------------------------------------------------------------- child side


def _records(tracer: Any) -> list[dict[str, Any]]:
    return [r.to_dict() for r in tracer.drain()]


def _scenario_ops(rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from falconext.trace.cuda_timing import CudaTiming
    from falconext.trace.hooks import CallTracer
    from falconext.trace.wrappers import TimedWork

    other = 1 - rank
    pair = dist.new_group([0, 1])
    pair_named = dist.new_group([0, 1])
    solo = [dist.new_group([r]) for r in range(world)]
    originals = {n: getattr(dist, n) for n in WRAPPED if hasattr(dist, n)}
    tracer = CallTracer(rank, roles=lambda g: "pair" if g is pair_named else None)
    tracer.install()
    wrapped = sorted(n for n, f in originals.items() if getattr(dist, n) is not f)
    out: dict[str, Any] = {"wrapped_during": wrapped}
    checks: dict[str, bool] = {}
    labels: list[str] = []
    proxied: dict[str, bool] = {}

    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    labels.append("all_reduce:f32")
    checks["all_reduce"] = t.tolist() == [3.0] * 4

    t = torch.full((8,), float(rank), dtype=torch.float64)
    w = dist.all_reduce(t, group=None, async_op=True)
    proxied["all_reduce"] = isinstance(w, TimedWork)
    w.wait()
    labels.append("all_reduce:async")
    checks["all_reduce_async"] = t.tolist() == [1.0] * 8

    inp = torch.arange(4, dtype=torch.float32) + 10 * rank
    res = torch.empty(2)
    w = dist.reduce_scatter_tensor(res, inp, async_op=True)
    proxied["reduce_scatter_tensor"] = isinstance(w, TimedWork)
    w.wait()
    labels.append("reduce_scatter:tensor")
    full = torch.arange(4, dtype=torch.float32) * 2 + 10
    checks["reduce_scatter_tensor"] = res.tolist() == full[2 * rank: 2 * rank + 2].tolist()

    res = torch.empty(2)
    dist._reduce_scatter_base(res, inp)
    labels.append("reduce_scatter:base")
    checks["reduce_scatter_base"] = res.tolist() == full[2 * rank: 2 * rank + 2].tolist()

    res = torch.empty(2)
    dist.reduce_scatter(res, [torch.full((2,), float(rank + 1)), torch.full((2,), 2.0 * (rank + 1))])
    labels.append("reduce_scatter:list")
    checks["reduce_scatter_list"] = res.tolist() == [3.0 * (rank + 1)] * 2

    gathered = torch.empty(6, dtype=torch.float32)
    dist.all_gather_into_tensor(gathered, torch.full((3,), float(rank)))
    labels.append("all_gather:tensor")
    checks["all_gather_into_tensor"] = gathered.tolist() == [0.0] * 3 + [1.0] * 3

    gathered = torch.empty(6, dtype=torch.float32)
    dist._all_gather_base(output_tensor=gathered, input_tensor=torch.full((3,), float(rank)))
    labels.append("all_gather:base")
    checks["all_gather_base"] = gathered.tolist() == [0.0] * 3 + [1.0] * 3

    parts = [torch.empty(2) for _ in range(world)]
    dist.all_gather(parts, torch.full((2,), float(rank)))
    labels.append("all_gather:list")
    checks["all_gather_list"] = [p.tolist() for p in parts] == [[0.0, 0.0], [1.0, 1.0]]

    t = torch.full((5,), float(rank + 7), dtype=torch.bfloat16)
    dist.broadcast(t, src=1)
    labels.append("broadcast:bf16")
    checks["broadcast"] = t.tolist() == [8.0] * 5

    a2a_in = torch.arange(8, dtype=torch.float32) + 100 * rank
    a2a_out = torch.empty(8)
    dist.all_to_all_single(a2a_out, a2a_in)
    labels.append("all_to_all:single")
    checks["all_to_all"] = a2a_out.tolist() == [
        *(torch.arange(4) + 4 * rank).tolist(), *(torch.arange(4) + 4 * rank + 100).tolist()
    ]

    dist.barrier()
    labels.append("barrier:world")

    # blocking send/recv, then isend/irecv (rank 0 sends first)
    mine, theirs = torch.full((3,), float(rank)), torch.empty(3)
    for step in ("sync", "async"):
        send = dist.send if step == "sync" else dist.isend
        recv = dist.recv if step == "sync" else dist.irecv
        if rank == 0:
            w1 = send(mine, 1)
            w2 = recv(theirs, 1)
            labels += [f"send:{step}", f"recv:{step}"]
        else:
            w2 = recv(theirs, 0)
            w1 = send(mine, 0)
            labels += [f"recv:{step}", f"send:{step}"]
        if step == "async":
            proxied["isend"] = isinstance(w1, TimedWork)
            w2.wait()
            w1.wait()
        checks[f"p2p_{step}"] = theirs.tolist() == [float(other)] * 3

    # Megatron's pattern: P2POp built from the (wrapped) torch.distributed.isend
    send_buf = torch.full((5,), float(rank + 1))
    recv_buf = torch.zeros(5)
    ops = [dist.P2POp(dist.isend, send_buf, other), dist.P2POp(dist.irecv, recv_buf, other)]
    out["p2pop_accepts_wrapper"] = True
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    labels += ["send:batch", "recv:batch"]
    checks["batch_both_directions"] = recv_buf.tolist() == [float(other + 1)] * 5
    # c10d tells sends from receives by identity: the wrapper must not be left in place
    checks["batch_ops_unwrapped"] = ops[0].op is c10d.isend and ops[1].op is c10d.irecv

    # the same P2POps handed to c10d's own batch_isend_irecv, bypassing our batch wrapper
    send_buf = torch.full((2,), float(rank + 20))
    recv_buf = torch.zeros(2)
    ops = [dist.P2POp(dist.irecv, recv_buf, other), dist.P2POp(dist.isend, send_buf, other)]
    for w in c10d.batch_isend_irecv(ops):
        w.wait()
    labels += ["recv:c10d_batch", "send:c10d_batch"]
    checks["c10d_batch"] = recv_buf.tolist() == [float(other + 20)] * 2

    for name, g in (("pair", pair), ("pair_named", pair_named), ("solo", solo[rank])):
        t = torch.ones(1)
        dist.all_reduce(t, group=g)
        labels.append(f"all_reduce:{name}")
        checks[f"subgroup_{name}"] = t.item() == (1.0 if name == "solo" else 2.0)

    # group-rank addressing: peer is reported as a global rank
    t = torch.full((1,), float(rank))
    if rank == 0:
        dist.send(t, group=pair_named, group_dst=1)
        labels.append("send:group_dst")
        dist.recv(t, group=pair_named, group_src=1)
        labels.append("recv:group_src")
    else:
        dist.recv(t, group=pair_named, group_src=0)
        labels.append("recv:group_src")
        dist.send(t, group=pair_named, group_dst=0)
        labels.append("send:group_dst")

    # inside _coalescing_manager (Megatron's DDP) calls are only queued until it exits;
    # c10d's own manager is invisible to the tracer: completion unknown
    a, b = torch.ones(2), torch.full((3,), 2.0)
    with c10d._coalescing_manager(async_ops=True) as cm:
        dist.all_reduce(a, async_op=True)
        dist.all_reduce(b, async_op=True)
    cm.wait()
    labels += ["all_reduce:coalesced_a", "all_reduce:coalesced_b"]
    checks["coalesced"] = a.tolist() == [2.0] * 2 and b.tolist() == [4.0] * 3
    # through torch.distributed (or Megatron's alias of it) the manager is traced
    for mode in ("sync", "async"):
        a, b = torch.ones(2), torch.ones(1)
        with dist._coalescing_manager(group=pair, async_ops=mode == "async") as cm:
            dist.all_reduce(a, group=pair, async_op=mode == "async")
            dist.all_reduce(b, group=pair, async_op=mode == "async")
        if mode == "async":
            checks["traced_coalesced_proxy"] = isinstance(cm.works[-1], TimedWork)
            cm.wait()
        labels += [f"all_reduce:traced_coalesced_{mode}"] * 2
        checks[f"traced_coalesced_{mode}"] = a.tolist() == [2.0] * 2 and b.tolist() == [2.0]
    dist.barrier()
    labels.append("barrier:after_coalesced")

    out["main"] = {"records": _records(tracer), "labels": labels}
    out["checks"] = checks
    out["proxied"] = proxied
    out["errors"] = tracer.errors

    # an isend never waited on holds back the records behind it until the timeout
    tracer.pending_timeout_s = 0.5
    buf = torch.ones(2)
    if rank == 0:
        w = dist.isend(buf, 1)
    else:
        dist.recv(buf, 0)
    dist.all_reduce(torch.ones(1))
    early = _records(tracer)
    time.sleep(0.7)
    late = _records(tracer)
    if rank == 0:
        w.wait()
        out["pending"] = {"early": early, "late": late}
    tracer.uninstall()
    out["restored"] = all(getattr(dist, n) is f for n, f in originals.items())

    # overflow: nothing drains a ring of 4
    small = CallTracer(rank, capacity=4)
    small.install()
    for _ in range(10):
        dist.barrier()
    out_ov = {"dropped": small.dropped, "seqs": [r.seq for r in small.drain()]}
    dist.barrier()
    out_ov["after"] = [r.seq for r in small.drain()]
    small.uninstall()
    out["overflow"] = out_ov

    out["futures"] = _futures_part(rank)
    out["trap"] = _trap_part(rank)
    out["fake_cuda"] = _fake_cuda_part(rank, CallTracer, CudaTiming)
    return out


def _futures_part(rank: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from falconext.trace.hooks import CallTracer
    from falconext.trace.wrappers import TimedWork

    tracer = CallTracer(rank, completion_futures=True)
    tracer.install()
    try:
        t = torch.ones(3)
        w1 = dist.all_reduce(t, async_op=True)
        w1.wait()
        res = torch.empty(1)
        w2 = dist.reduce_scatter_tensor(res, torch.ones(2), async_op=True)
        w2.wait()
    finally:
        tracer.uninstall()
    records: list[dict[str, Any]] = []
    deadline = time.monotonic() + 1.5  # the callback may run just after wait() returns
    while len(records) < 2 and time.monotonic() < deadline:
        records += _records(tracer)
        time.sleep(0.01)
    return {
        "all_reduce_proxied": isinstance(w1, TimedWork),
        "reduce_scatter_proxied": isinstance(w2, TimedWork),
        "data_ok": t.tolist() == [2.0] * 3 and res.tolist() == [2.0],
        "records": records,
    }


def _trap_part(rank: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from falconext.trace.hooks import CallTracer

    tracer = CallTracer(rank)
    tracer.install()
    result: dict[str, Any] = {}
    try:
        if rank == 0:
            trap = tracer.trap
            seen = threading.Event()

            def releaser() -> None:
                deadline = time.monotonic() + 5.0
                while not trap.held and time.monotonic() < deadline:
                    time.sleep(0.005)
                if trap.held:
                    seen.set()
                time.sleep(0.2)
                trap.release()

            trap.arm(deadline_s=10.0)
            armed_at = tracer._clock()
            th = threading.Thread(target=releaser)
            th.start()
            t = torch.ones(3)
            dist.all_reduce(t)
            th.join()
            rec = tracer.drain()[-1]
            result.update(
                held_seen=seen.is_set(), released_pause=trap.last_pause_s,
                released_expired=trap.expired, issue_after_arm=rec.t_issue - armed_at,
                sum_ok=t.tolist() == [2.0] * 3,
            )
            trap.arm(0.3)
            dist.all_reduce(torch.ones(1))
            result.update(expired_pause=trap.last_pause_s, expired=trap.expired,
                          holds=trap.holds, armed_after=trap.armed)
            dist.all_reduce(torch.ones(1))
            result["holds_after_unarmed"] = trap.holds
        else:
            for _ in range(3):
                dist.all_reduce(torch.ones(3 if _ == 0 else 1))
    finally:
        tracer.uninstall()
    return result


class _ClockEvent:
    """Fake CUDA event for the child: executes instantly, at the host clock."""

    def __init__(self) -> None:
        self.t = 0.0

    def record(self, stream: object = None) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: "_ClockEvent") -> float:
        return (other.t - self.t) * 1000.0


def _fake_cuda_part(
    rank: int, tracer_cls: Callable[..., Any], timing_cls: Callable[..., Any]
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    tracer = tracer_cls(rank)
    tracer._cuda = timing_cls(
        time.perf_counter, event_factory=_ClockEvent, side_record=lambda ev: ev.record()
    )
    tracer.install()
    try:
        t = torch.ones(2)
        dist.all_reduce(t)
        w = dist.all_reduce(t, async_op=True)
        w.wait()
        other = 1 - rank
        recv = torch.zeros(2)
        ops = [dist.P2POp(dist.isend, torch.full((2,), float(rank)), other),
               dist.P2POp(dist.irecv, recv, other)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        tracer._cuda.maintain()
        return {"records": _records(tracer),
                "data_ok": t.tolist() == [4.0, 4.0] and recv.tolist() == [float(other)] * 2}
    finally:
        tracer.uninstall()


def _scenario_megatron(rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    from falconext.trace.hooks import CallTracer, megatron_roles

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    original_alias = pgb.dist_all_gather_func
    original_cm = pgb._coalescing_manager  # DDP's gradient reduction goes through it
    tracer = CallTracer(rank, roles=megatron_roles())
    tracer.install()
    checks: dict[str, bool] = {}
    labels: list[str] = []
    try:
        checks["alias_wrapped"] = (pgb.dist_all_gather_func is not original_alias
                                   and pgb._coalescing_manager is dist._coalescing_manager
                                   and dist._coalescing_manager is not original_cm)
        for role, group in (("tp", ps.get_tensor_model_parallel_group()),
                            ("dp", ps.get_data_parallel_group()),
                            ("dp_cp", ps.get_data_parallel_group(with_context_parallel=True)),
                            ("pp", ps.get_pipeline_model_parallel_group())):
            dist.all_reduce(torch.ones(2), group=group)
            labels.append(f"all_reduce:{role}")
        dist.barrier()
        labels.append("barrier:world")
        out = torch.empty(8)
        pgb.dist_all_gather_func(out, torch.ones(4), group=ps.get_tensor_model_parallel_group())
        labels.append("all_gather:alias")
        other = 1 - rank
        recv = torch.zeros(3)
        reqs = p2p._batched_p2p_ops(
            tensor_send_prev=None, tensor_recv_prev=recv,
            tensor_send_next=torch.full((3,), float(rank + 5)), tensor_recv_next=None,
            group=ps.get_tensor_model_parallel_group(),
            prev_pipeline_rank=other, next_pipeline_rank=other,
        )
        for r in reqs:
            r.wait()
        labels += ["recv:megatron_p2p", "send:megatron_p2p"]
        checks["p2p_data"] = recv.tolist() == [float(other + 5)] * 3
    finally:
        tracer.uninstall()
    checks["alias_restored"] = (pgb.dist_all_gather_func is original_alias
                                and pgb._coalescing_manager is original_cm)
    records = _records(tracer)
    ps.destroy_model_parallel()
    return {"main": {"records": records, "labels": labels}, "checks": checks}


def _child(scenario: str, rank: int, world: int, tmp: Path) -> None:
    import datetime
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: dict[str, Any]
    try:
        store = dist.FileStore(str(tmp / f"{scenario}.store"), world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        try:
            result = {"ops": _scenario_ops, "megatron": _scenario_megatron}[scenario](rank, world)
        finally:
            dist.destroy_process_group()
    except BaseException:
        result = {"error": traceback.format_exc()}
    (tmp / f"{scenario}.{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
