"""The emulated accelerator: its time model (pure) and the per-rank emulator (real torch).

The emulator must make a rank's compute and transfers take the device model's time,
multiply it by a fault's factor from the fault's first iteration (a step), and count the
real CPU work that overruns the device time instead of hiding it.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from falconext.ports import free_port
from falconext.model.device import DeviceModel, gemm_flops, gpt_forward_flops, ring_hop_bytes, ring_steps
from falconext.emulation.emulator import EmulatedDevice, sleep_until
from falconext.model.faults import compute_factor, link_factor, parse_faults

#: run first, before any job runs ahead (conftest.py: RUN_FIRST):
#: it times the emulated device's sleeps and transfers on the wall clock
RUN_FIRST = True


def test_gpt_flops_follow_the_layer_formula():
    # 24 b s h^2 + 4 b s^2 h per layer, logits only on the last stage, split by TP
    one = gpt_forward_flops(1, 64, 64, 1, 256, 1, last_stage=False)
    assert one == 24 * 64 * 64 * 64 + 4 * 64 * 64 * 64
    assert gpt_forward_flops(4, 64, 64, 1, 256, 1, False) == 4 * one
    assert gpt_forward_flops(4, 64, 64, 2, 256, 1, False) == 8 * one
    assert gpt_forward_flops(1, 64, 64, 1, 256, 1, True) == one + 2 * 64 * 64 * 256
    assert gpt_forward_flops(1, 64, 64, 1, 256, 2, False) == one / 2
    assert gemm_flops(256, 256, 256) == 2 * 256**3


def test_default_microbatch_takes_tens_of_milliseconds():
    m = DeviceModel()
    fwd = m.compute_s(gpt_forward_flops(4, 64, 64, 1, 256, 1, True))
    assert 0.005 <= fwd <= 0.05
    assert m.compute_s(1e9, factor=3.0) == pytest.approx(3 * m.compute_s(1e9))


def test_links_differ_within_and_between_nodes():
    m = DeviceModel(intra_bandwidth=1e9, inter_bandwidth=1e7, intra_latency_s=1e-5, inter_latency_s=1e-4)
    assert m.p2p_s(1e6, 0, 0) == pytest.approx(1e-5 + 1e-3)
    assert m.p2p_s(1e6, 0, 1) == pytest.approx(1e-4 + 0.1)
    assert m.p2p_s(1e6, 0, 1, factor=4) == pytest.approx(1e-4 + 0.4)
    assert m.p2p_s(0, 0, 1) == 0.0


def test_a_ring_is_as_slow_as_its_slowest_hop():
    m = DeviceModel(intra_bandwidth=1e9, inter_bandwidth=1e7, intra_latency_s=0.0, inter_latency_s=0.0)
    nbytes = 4e6
    # 4 members on 2 nodes: two hops cross nodes
    base = m.ring_s("all_reduce", nbytes, [0, 0, 1, 1])
    assert base == pytest.approx(ring_hop_bytes("all_reduce", nbytes, 4) / 1e7)
    assert ring_hop_bytes("all_reduce", nbytes, 4) == pytest.approx(1.5 * nbytes)
    assert ring_steps("all_reduce", 4) == 6 and ring_steps("all_gather", 4) == 3
    slowed = m.ring_s("all_reduce", nbytes, [0, 0, 1, 1], [1.0, 8.0, 1.0, 1.0])
    assert slowed == pytest.approx(8 * base)
    # a fault on an intra-node hop of a fast link barely matters here
    assert m.ring_s("all_reduce", nbytes, [0, 0, 1, 1], [8.0, 1.0, 1.0, 1.0]) == pytest.approx(base)
    assert m.ring_s("all_reduce", nbytes, [3]) == 0.0


@pytest.mark.parametrize("field", ["gflops", "intra_bandwidth", "inter_bandwidth"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_device_model_rejects_impossible_throughputs(field, value):
    with pytest.raises(ValueError, match=field):
        DeviceModel(**{field: value})


def test_fault_factors_are_steps_on_their_iterations():
    faults = parse_faults(
        [{"kind": "compute", "rank": 1, "factor": 3.0, "start": 10, "end": 20},
         {"kind": "link", "nodes": [0, 1], "factor": 4.0, "start": 5}],
        world_size=4, ranks_per_node=2,
    )
    assert [compute_factor(faults, 1, i) for i in (9, 10, 19, 20)] == [1.0, 3.0, 3.0, 1.0]
    assert compute_factor(faults, 0, 15) == 1.0
    assert link_factor(faults, 1, 0, 5) == 4.0 and link_factor(faults, 0, 1, 4) == 1.0
    assert link_factor(faults, 0, 0, 9) == 1.0


def test_sleep_until_reports_lateness():
    t = time.perf_counter()
    assert sleep_until(t - 0.5) >= 0.5
    assert sleep_until(time.perf_counter() + 0.02) == 0.0
    assert time.perf_counter() - t >= 0.02


class _Tiny(torch.nn.Module):
    """A model with a ``decoder``, as megatron-core's GPTModel has."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 8)
        self.decoder = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.decoder(self.embed(x))


def _step(module, x):
    module(x).sum().backward()


def test_compute_takes_device_time_and_a_fault_is_a_step():
    # 2e7 FLOPs per forward at 1 GFLOP/s: 20 ms forward, 40 ms backward
    dev = EmulatedDevice(DeviceModel(gflops=1.0), process=1, ranks_per_node=1,
                         faults=parse_faults([{"kind": "compute", "rank": 1, "factor": 3.0, "start": 2}], 2, 1))
    module = _Tiny()
    x = torch.randn(4, 8)
    # one step before the device is attached: torch's first backward starts the autograd
    # engine (33 ms over the device's 60 in a fresh-clone CI run, 2026-11-27), a host cost
    # that is not the device's. The device time is a floor; the ceilings allow a loaded host
    # one healthy step (60 ms) of its own, less than a step charged twice or a wrong factor
    _step(module, x)
    dev.attach_model(module, 2e7)
    took = []
    for it in range(4):
        dev.iteration = it
        t0 = time.perf_counter()
        _step(module, x)
        took.append(time.perf_counter() - t0)
    assert dev.microbatch_s() == pytest.approx(0.06)
    for it in (0, 1):
        assert 0.06 <= took[it] < 0.06 + 0.06, took
    for it in (2, 3):  # exactly 3x from the fault's first iteration
        assert 0.18 <= took[it] < 0.18 + 0.06, took
    rec = dev.record()
    assert rec["iterations"]["1"]["compute_s"] == pytest.approx(0.06)
    assert rec["iterations"]["2"]["compute_s"] == pytest.approx(0.18)
    assert rec["iterations"]["2"]["factor"] == 3.0 and rec["iterations"]["1"]["factor"] == 1.0
    assert rec["iterations"]["3"]["windows"] == 2


def test_overruns_are_counted_not_hidden():
    dev = EmulatedDevice(DeviceModel(gflops=1e9), process=0, ranks_per_node=1)  # device time ~0
    module = _Tiny()
    dev.attach_model(module, 1.0)

    def slow_cpu(_mod, _inp, _out):
        time.sleep(0.01)  # the "real work" outlasts the device window

    module.decoder.register_forward_hook(slow_cpu)
    dev.iteration = 0
    _step(module, torch.randn(2, 8))
    rec = dev.record()
    assert rec["overruns"] >= 1 and rec["overrun_s"] >= 0.009


def test_matmul_is_real_and_slow_by_the_fault():
    faults = parse_faults([{"kind": "compute", "rank": 0, "factor": 4.0, "start": 1}], 1, 1)
    dev = EmulatedDevice(DeviceModel(gflops=0.1), process=0, ranks_per_node=1, faults=faults)
    a, b = torch.randn(100, 100), torch.randn(100, 100)  # 2e6 FLOPs: 20 ms healthy, 80 ms slowed
    dev.iteration = 0
    dev.matmul(a, b)  # the first matmul of a process pays torch's set-up in real time
    t0 = time.perf_counter()
    out = dev.matmul(a, b)
    healthy = time.perf_counter() - t0
    dev.iteration = 1
    t0 = time.perf_counter()
    dev.matmul(a, b)
    slow = time.perf_counter() - t0
    assert torch.allclose(out, a @ b)
    # the device time is a floor; the ceilings leave a loaded host tens of ms of slack
    assert 0.020 <= healthy < 0.050 and 0.080 <= slow < 0.150


def _link_worker(rank: int, port: int, factor: float, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    faults = parse_faults([{"kind": "link", "nodes": [0, 1], "factor": factor, "start": 1}], 2, 1)
    model = DeviceModel(inter_bandwidth=1e7, inter_latency_s=0.0)
    dev = EmulatedDevice(model, rank, ranks_per_node=1, faults=faults)
    dev.install()
    try:
        t = torch.zeros(50_000)  # 200 kB: 20 ms per message, an all-reduce of 2 moves 200 kB per hop
        out = {}
        for it in (0, 1):
            dev.iteration = it
            torch.distributed.barrier()
            t0 = time.perf_counter()
            torch.distributed.all_reduce(t)
            out[f"all_reduce{it}"] = time.perf_counter() - t0
            torch.distributed.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                torch.distributed.send(t, 1)
            else:
                torch.distributed.recv(t, 0)
            out[f"p2p{it}"] = time.perf_counter() - t0
            torch.distributed.barrier()
            t0 = time.perf_counter()
            op = torch.distributed.isend if rank == 0 else torch.distributed.irecv
            for w in torch.distributed.batch_isend_irecv([torch.distributed.P2POp(op, t, 1 - rank)]):
                w.wait()
            out[f"batch{it}"] = time.perf_counter() - t0
        out["link_s"] = dev.record()["iterations"]["1"]["link_s"]
        q.put((rank, out))
    finally:
        dev.uninstall()
        torch.distributed.destroy_process_group()


def test_transfers_take_the_link_model_time_and_a_link_fault_slows_them():
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_link_worker, args=(r, port, 4.0, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    for rank, out in got.items():
        # healthy: 20 ms (all-reduce of 2: (2-1)/2 * 2 * 200 kB per hop = 200 kB), slowed 4x
        assert 0.02 <= out["all_reduce0"] < 0.045, out
        assert 0.08 <= out["all_reduce1"] < 0.11, out
        assert 0.02 <= out["p2p0"] < 0.045 and 0.08 <= out["p2p1"] < 0.11, out
        assert 0.02 <= out["batch0"] < 0.045 and 0.08 <= out["batch1"] < 0.11, out
        assert out["link_s"] == pytest.approx(0.24, rel=0.01)


def test_s2_ceiling_is_the_optimal_integer_plan_on_true_times():
    from falconext.report.device import s2_ceiling

    # one 2x replica of four, 16 micro-batches each: the best plan leaves 19 of 16 -> 32
    got = s2_ceiling([1.0] * 4, [1.0, 2.0, 1.0, 1.0], 64)
    assert got["plan"][1] == 9 and sorted(got["plan"]) == [9, 18, 18, 19]
    assert got["removed_max"] == pytest.approx(13 / 16)
    # two replicas, one 2x: f / (f + 1) of the slowdown at best
    assert s2_ceiling([1.0, 1.0], [1.0, 2.0], 24)["removed_max"] == pytest.approx(2 / 3)
    assert s2_ceiling([1.0, 1.0], [1.0, 1.0], 24) is None
    with pytest.raises(ValueError):
        s2_ceiling([1.0], [1.0, 2.0], 4)


def _emulated_run(out, wall: dict[int, float], device: dict[int, float], mitigation_at: int) -> None:
    """A finished DP2 run on disk: rank 1 2x slow from iteration 10 (0.1 s per
    micro-batch healthy, 8 micro-batches), S2 [5, 3] at ``mitigation_at``; each
    iteration's loop time ``wall``, its device time ``device`` (rank 1's; rank 0 idles)."""
    import json

    from falconext.report.device import write_device_record

    (out / "ranks").mkdir(parents=True)
    roles = [{"rank": r, "dp_rank": r, "pp_rank": 0, "tp_rank": 0} for r in range(2)]
    (out / "run.json").write_text(json.dumps({
        "topology": {"world": 2, "dp": 2, "ranks_per_node": 1, "ranks": roles},
        "faults": [{"kind": "compute", "rank": 1, "factor": 2.0, "start": 10, "end": None}],
        "args": {"global_batch_size": 8, "micro_batch_size": 1}, "falcon_config": {}}))
    for r in range(2):
        (out / "ranks" / f"iterations-{r}.csv").write_text(
            "".join(f"{r},{it},{secs:.6f},1.0\n" for it, secs in wall.items()))
        its = {str(it): {"compute_s": secs if r == 1 else 0.01, "link_s": 0.0} for it, secs in device.items()}
        write_device_record(str(out), r, {"microbatch_s": 0.1, "windows": 1, "closed": 1, "overruns": 0,
                                          "overrun_s": 0.0, "model": {"gflops": 1.0}, "iterations": its})
    (out / "events.jsonl").write_text(json.dumps(
        {"type": "mitigation", "strategy": "S2", "iteration": mitigation_at, "plan": [5, 3], "trigger": "planner"}) + "\n")


def test_an_emulated_runs_slowdown_is_measured_on_its_devices_not_the_hosts_clock(tmp_path):
    """The wall clock's healthy time carries the host's own work (here 0.5 s for a 0.4 s
    device iteration), which puts its share of the slowdown removed above what any plan
    reaches (0.71 of a 0.5 ceiling); the summary's figures are the devices' (exactly the
    best plan's 0.5), the wall clock's stay beside them, marked as a measuring error."""
    from falconext.report.summary import finalize, format_summary

    slow_from, fix = 10, 20
    device = {it: 0.4 if it < slow_from else 0.8 if it < fix else 0.6 for it in range(40)}
    wall = {it: 0.5 if it < slow_from else 0.85 if it < fix else 0.6 for it in range(40)}
    _emulated_run(tmp_path, wall, device, fix)
    s = finalize(str(tmp_path))
    assert s["timing"] == "device"
    assert (s["healthy_iter_s"], s["slow_iter_s"], s["mitigated_iter_s"]) == (0.4, 0.8, 0.6)
    assert s["slowdown_removed"] == s["s2_slowdown_removed"] == s["slowdown_removed_max"] == 0.5
    assert s["slowdown_removed_ceiling"] == 0.5 and s["s2_best_plan"] in ([5, 3], [6, 2])
    assert s["wall_clock"]["slowdown_removed"] == pytest.approx(0.7143, abs=1e-4)
    text = format_summary(s)
    assert "on the emulated devices' time: healthy 0.4 s/iter, slow 0.8, mitigated 0.6: " \
           "slowdown removed 0.5 of at most 0.5\n" in text, text
    wall_line = next(line for line in text.splitlines() if "by this host's wall clock" in line)
    assert "removed 0.7143 (above what any plan can reach" in wall_line, wall_line


def test_device_times_take_each_iterations_slowest_process_and_a_restarts_records(tmp_path):
    from falconext.report.device import device_iteration_times, write_device_record

    (tmp_path / "ranks").mkdir()
    write_device_record(str(tmp_path), 0, {"iterations": {"0": {"compute_s": 0.2, "link_s": 0.1},
                                                          "1": {"compute_s": 0.2, "link_s": 0.0}}})
    write_device_record(str(tmp_path), 1, {"iterations": {"0": {"compute_s": 0.1, "link_s": 0.1}}})
    assert device_iteration_times(str(tmp_path), 2) == {0: pytest.approx(0.3)}  # 1: rank 1 never ran it
    write_device_record(str(tmp_path), 1, {"iterations": {"1": {"compute_s": 0.5, "link_s": 0.0}}}, "-r1")
    assert device_iteration_times(str(tmp_path), 2) == {0: pytest.approx(0.3), 1: pytest.approx(0.5)}
    assert device_iteration_times(str(tmp_path), 3) is None  # rank 2 has no record


def test_a_link_fault_on_real_links_is_measured_on_the_wall_clock(tmp_path):
    """Real links (network namespaces) leave no link time in the device records: a link
    fault's slowdown is only on the wall clock, so the summary keeps the wall clock's."""
    import json

    from falconext.report.summary import finalize

    device = {it: 0.4 for it in range(40)}  # what the devices saw: nothing slow
    wall = {it: 0.5 if it < 10 else 0.9 if it < 20 else 0.6 for it in range(40)}
    _emulated_run(tmp_path, wall, device, 20)
    run = json.loads((tmp_path / "run.json").read_text())
    run["faults"] = [{"kind": "link", "nodes": [0, 1], "factor": 30.0, "start": 10, "end": None}]
    (tmp_path / "run.json").write_text(json.dumps(run))
    for r in range(2):
        path = tmp_path / "ranks" / f"device-rank{r}.json"
        path.write_text(json.dumps(dict(json.loads(path.read_text()), real_links=True)))
    s = finalize(str(tmp_path))
    assert s["timing"] == "wall_clock" and s["device"]["real_links"] and "wall_clock" not in s
    assert (s["healthy_iter_s"], s["slow_iter_s"], s["mitigated_iter_s"]) == (0.5, 0.9, 0.6)


def test_a_pipelines_slowdown_is_measured_on_the_wall_clock(tmp_path):
    """A pipeline's iteration is its schedule's critical path, bubbles included, which no
    process's busy time on its device holds: the summary keeps the wall clock's."""
    import json

    from falconext.report.summary import finalize

    device = {it: 0.4 if it < 10 else 0.8 if it < 20 else 0.6 for it in range(40)}
    wall = {it: 0.5 if it < 10 else 0.9 if it < 20 else 0.6 for it in range(40)}
    _emulated_run(tmp_path, wall, device, 20)
    run = json.loads((tmp_path / "run.json").read_text())
    run["topology"]["pp"] = 2
    (tmp_path / "run.json").write_text(json.dumps(run))
    s = finalize(str(tmp_path))
    assert s["timing"] == "wall_clock" and "wall_clock" not in s
    assert (s["healthy_iter_s"], s["slow_iter_s"], s["mitigated_iter_s"]) == (0.5, 0.9, 0.6)
