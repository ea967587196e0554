"""``--net netns``: namespaces per virtual node, shaped veths, link faults, clean-up.

The command builders, the address plan, the exit-code fold and LinkShaper's bookkeeping
are tested as pure functions. The rest needs root and working namespaces (skipped
otherwise): a measured TCP transfer between namespaces before and during a link fault,
clean-up after SIGKILL and SIGTERM, and short ``falconext train --net netns`` jobs. The
transfers use only the addresses of the namespaces the test creates.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from falconext.inputs import InputError
from falconext.testbed import launch, netns
from falconext.model.faults import Fault
from jobs import host_paced

NET = ipaddress.IPv4Network("10.213.7.0/24")

#: the job lane held for the whole module (conftest.py: alone):
#: its jobs and rate checks run over real network namespaces, timed by the kernel
ALONE = True


def layout(nodes: int = 3) -> netns.Layout:
    return netns.Layout("fx4194304", NET, nodes)


# -- pure ----------------------------------------------------------------------------------------
def test_layout_names_fit_interface_limits_and_addresses_stay_in_the_subnet() -> None:
    lay = layout(netns.MAX_NODES)
    names = [lay.bridge] + [f(k) for k in range(lay.nodes) for f in (lay.veth_root, lay.veth_node)]
    assert max(len(n) for n in names) <= 15  # IFNAMSIZ - 1
    assert len(set(names)) == len(names)
    assert lay.bridge_ip == "10.213.7.1"
    assert lay.ips()[:2] == ["10.213.7.10", "10.213.7.11"]
    assert all(ipaddress.IPv4Address(ip) in NET for ip in lay.ips() + [lay.bridge_ip])
    env = layout(2).node_env(1, 50e6)
    assert env == {
        netns.ENV_NODE: "1", netns.ENV_DEV: "fx4194304-p1", netns.ENV_IPS: "10.213.7.10,10.213.7.11",
        netns.ENV_RATE: "50000000.0", "GLOO_SOCKET_IFNAME": "fx4194304-p1",
    }


def test_subnet_avoids_every_host_network_and_rejects_bad_node_counts() -> None:
    text = ("2: eth0    inet 10.213.0.5/24 brd 10.213.0.255 scope global eth0\n"
            "10.213.1.0/24 dev x proto kernel\ndefault via 192.0.2.1 dev eth0\n10.213.2.7 dev y\n")
    taken = netns.parse_networks(text)
    assert ipaddress.IPv4Network("0.0.0.0/0") not in taken
    assert netns.make_layout(2, pid=0, taken=taken).subnet == ipaddress.IPv4Network("10.213.3.0/24")
    assert netns.make_layout(2, pid=300, taken=taken).subnet == ipaddress.IPv4Network("10.213.44.0/24")
    with pytest.raises(netns.NetnsError, match="no free /24"):
        netns.free_subnet([ipaddress.IPv4Network("10.0.0.0/8")])
    for bad in (0, netns.MAX_NODES + 1):
        with pytest.raises(ValueError, match="virtual nodes"):
            netns.make_layout(bad, pid=1, taken=[])


def test_shaping_is_one_htb_class_and_destination_filter_per_peer() -> None:
    cmds = netns.shaping_commands(layout(3), 1, 50e6, netns="fx4194304-n1")
    assert cmds[0] == ["tc", "-n", "fx4194304-n1", "qdisc", "add", "dev", "fx4194304-p1", "root", "handle", "1:",
                       "htb"]
    classes = [c for c in cmds if c[3] == "class"]
    filters = [c for c in cmds if c[3] == "filter"]
    assert [c[c.index("classid") + 1] for c in classes] == ["1:10", "1:12"]  # peers 0 and 2, hex minors
    assert all(c[c.index("rate") + 1] == "400000000bit" for c in classes)
    assert [(c[c.index("dst") + 1], c[-1]) for c in filters] == [("10.213.7.10/32", "1:10"), ("10.213.7.12/32", "1:12")]
    assert netns.class_rate_command("d", 2, 12.5e6) == [
        "tc", "class", "change", "dev", "d", "parent", "1:", "classid", "1:12", "htb", "rate", "100000000bit",
        "quantum", str(netns.QUANTUM)]
    assert netns.class_id(240) == "1:100"
    with pytest.raises(ValueError):
        netns.rate_arg(0)


def test_setup_and_teardown_name_only_the_runs_own_objects() -> None:
    lay = layout(2)
    made = netns.setup_commands(lay)
    assert ["ip", "netns", "add", "fx4194304-n1"] in made
    assert ["ip", "-n", "fx4194304-n0", "link", "set", "lo", "up"] in made
    assert ["ip", "-n", "fx4194304-n1", "addr", "add", "10.213.7.11/24", "dev", "fx4194304-p1"] in made
    gone = netns.teardown_commands(lay)
    assert ["ip", "netns", "del", "fx4194304-n0"] in gone and ["ip", "link", "del", "fx4194304-br"] in gone
    assert all(any(a.startswith("fx4194304-") for a in argv) for argv in made + gone)
    assert netns.netns_exec("ns", ["tc", "x"]) == ["ip", "netns", "exec", "ns", "tc", "x"]


def test_stale_names_are_those_of_dead_owners_only() -> None:
    ns, links = netns.stale_names(
        ["fx11-n0", "fx11-n1", "fx22-n0", "fx33-q", "other", "fx44-n0x"],
        ["fx11-br", "fx11-v0", "fx22-v0", "eth0", "fx11-vx", "fx33-qa", "fxz-br"],
        alive=lambda pid: pid == 22,
    )
    assert ns == ["fx11-n0", "fx11-n1", "fx33-q"]
    assert links == ["fx11-br", "fx11-v0", "fx33-qa"]


def test_fold_exit_codes_reports_the_first_failing_node() -> None:
    assert launch.fold_exit_codes([0, 0]) == (0, None)
    assert launch.fold_exit_codes([0, None, 3, 1]) == (3, 2)
    assert launch.fold_exit_codes([-9, 1]) == (-9, 0)


def test_node_torchrun_command() -> None:
    args = argparse.Namespace(ranks_per_node=2)
    cmd = launch.node_torchrun_command(args, ["--iters", "3"], 2, 1, "10.213.7.10", 29501)
    assert cmd[1:] == ["-m", "falconext.testbed.forkrun", "--nnodes", "2", "--node_rank", "1", "--nproc_per_node", "2",
                       "--master_addr", "10.213.7.10", "--master_port", "29501", "-m", "falconext.testbed.train",
                       "--iters", "3"]


def link(a: int, b: int, factor: float, start: int, end: int | None = None) -> Fault:
    return Fault("link", factor, start, end, nodes=(a, b))


def test_link_shaper_changes_only_the_faulty_peers_class_when_the_fault_set_changes() -> None:
    calls: list[list[str]] = []
    faults = [link(1, 0, 4.0, 2, 5), link(0, 1, 2.0, 4), link(1, 2, 3.0, 0), Fault("compute", 3.0, 0, None, rank=0)]
    shaper = netns.LinkShaper(faults, 0, True, 40e6, ["a", "b", "c"], "dev0", runner=lambda argv: calls.append(argv))
    for it in range(7):
        shaper.set_iteration(it)
    assert shaper.changes == [(2, 1, 4.0), (4, 1, 8.0), (5, 1, 2.0)]
    assert [c[c.index("classid") + 1] for c in calls] == ["1:11"] * 3
    assert [c[c.index("rate") + 1] for c in calls] == ["80000000bit", "40000000bit", "160000000bit"]
    shaper.close()
    assert calls[-1][calls[-1].index("rate") + 1] == "320000000bit" and shaper.factors == {1: 1.0, 2: 1.0}
    shaper.close()
    assert len(calls) == 4  # nothing left to restore


def test_link_shaper_non_leader_runs_nothing_and_from_env() -> None:
    calls: list[list[str]] = []
    env = layout(2).node_env(1, 50e6)
    assert netns.LinkShaper.from_env([], environ={}) is None
    leader = netns.LinkShaper.from_env([link(0, 1, 4.0, 0)], environ=dict(env, LOCAL_RANK="0"))
    assert (leader.node, leader.leader, leader.base_rate, leader.dev) == (1, True, 50e6, "fx4194304-p1")
    other = netns.LinkShaper([link(0, 1, 4.0, 0)], 1, False, 50e6, ["a", "b"], "d",
                             runner=lambda argv: calls.append(argv))
    other.set_iteration(0)
    assert calls == [] and other.factors == {0: 4.0}
    with pytest.raises(netns.NetnsError, match="FALCON_NETNS"):
        netns.LinkShaper.from_env([], environ=dict(env, FALCON_NETNS_RATE="fast"))


def launcher_args(**kw) -> argparse.Namespace:
    base = dict(nproc=4, ranks_per_node=2, falcon=False, falcon_redis_url=None, net="netns")
    return argparse.Namespace(**dict(base, **kw))


def test_netns_without_root_is_a_one_line_error(monkeypatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(InputError, match="--net netns needs root") as exc:
        launch._check_netns(launcher_args())
    assert "\n" not in str(exc.value)


def test_netns_refuses_uneven_nodes_and_loopback_redis(monkeypatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns, "available", lambda: None)
    with pytest.raises(InputError, match=r"--ranks-per-node \(3\) to divide --nproc \(4\)"):
        launch._check_netns(launcher_args(ranks_per_node=3))
    with pytest.raises(InputError, match="loopback is unreachable"):
        launch._check_netns(launcher_args(falcon=True, falcon_redis_url="redis://:pw@127.0.0.1:6379/0"))
    args = launcher_args()
    launch._check_netns(args)
    assert args.net == "netns"


def test_netns_unavailable_falls_back_with_one_line(monkeypatch, capsys) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns, "available", lambda: "'ip netns add' failed: Operation not permitted")
    args = launcher_args()
    launch._check_netns(args)
    assert args.net == "emulated"
    assert capsys.readouterr().out == ("falconext: --net netns not available ('ip netns add' failed: Operation not "
                                       "permitted); using the emulated link model\n")


# -- real namespaces ------------------------------------------------------------------------------
REASON = netns.available()
real = pytest.mark.skipif(REASON is not None, reason=f"--net netns not available: {REASON}")

TRANSFER = textwrap.dedent("""
    import socket, sys, time
    mode, host, port, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if mode == "server":
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port)); s.listen(1); s.settimeout(10); print("ready", flush=True)
        c, _ = s.accept(); c.settimeout(10); got, t0 = 0, None
        while got < n:
            b = c.recv(1 << 16)
            if not b: break
            t0 = t0 or time.monotonic(); got += len(b)
        t1 = time.monotonic(); c.sendall(b"k"); print(got, t1 - t0, flush=True)
    else:
        c = socket.create_connection((host, port), timeout=10); buf = b"x" * (1 << 16); sent = 0
        while sent < n: c.sendall(buf); sent += len(buf)
        c.recv(1)
""")


def transfer_s(tmp_path: Path, net: netns.Network, src: int, dst: int, nbytes: int, port: int) -> float:
    """Seconds node ``dst`` took to receive ``nbytes`` from node ``src`` (first to last byte)."""
    script = tmp_path / "transfer.py"
    script.write_text(TRANSFER)
    ip = net.layout.node_ip(dst)
    server = subprocess.Popen(net.exec_argv(dst, [sys.executable, str(script), "server", ip, str(port), str(nbytes)]),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        subprocess.run(net.exec_argv(src, [sys.executable, str(script), "client", ip, str(port), str(nbytes)]),
                       check=True, timeout=20)
        out, _ = server.communicate(timeout=20)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=5)
    got, seconds = out.split()
    assert int(got) >= nbytes
    return float(seconds)


def wait_gone(tag: str, timeout_s: float = 5.0) -> list[str]:
    """Leftovers named after ``tag`` once they are gone or the deadline passed (the kernel
    frees a deleted namespace, and with it its veth, asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while (left := netns.leftovers(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@real
def test_link_fault_slows_only_its_link_by_its_factor(tmp_path: Path) -> None:
    rate, nbytes = 25e6, 3_000_000  # 0.12 s at the base rate
    net = netns.Network.create(3, rate)
    tag = net.layout.tag
    try:
        assert len(netns.leftovers(tag)) == 3 + 1 + 3  # namespaces, bridge, root veth ends
        base = transfer_s(tmp_path, net, 0, 1, nbytes, 5001)
        run_in_ns0 = lambda argv, **kw: netns.run(net.exec_argv(0, argv), **kw)  # noqa: E731 (a leader in ns 0)
        shaper = netns.LinkShaper([link(0, 1, 4.0, 3)], 0, True, rate, net.layout.ips(), net.layout.veth_node(0),
                                  runner=run_in_ns0)
        shaper.set_iteration(2)
        assert shaper.changes == []
        shaper.set_iteration(3)
        slow = transfer_s(tmp_path, net, 0, 1, nbytes, 5002)
        other = transfer_s(tmp_path, net, 0, 2, nbytes, 5003)
        shaper.close()
        again = transfer_s(tmp_path, net, 0, 1, nbytes, 5004)
    finally:
        net.close()
    print(f"3 MB at 25 MB/s: base {base:.3f} s, link fault x4 {slow:.3f} s, other link {other:.3f} s, "
          f"restored {again:.3f} s")
    # real transfers through the kernel's shaper, on the wall clock: bounds as ratios, wide
    # enough for a loaded host, narrow enough that a fault not applied (1x) or not lifted fails
    assert 0.6 * nbytes / rate < base < 2.0 * nbytes / rate
    assert 2.5 < slow / base < 6.0
    assert other < 2.0 * base and again < 2.0 * base
    assert wait_gone(tag) == []


@real
def test_cleanup_stale_removes_what_a_killed_run_left() -> None:
    code = ("import sys, time; from falconext.testbed import netns; "
            "n = netns.Network.create(2, 1e7); print(n.layout.tag, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        tag = proc.stdout.readline().strip()
        assert tag == f"fx{proc.pid}" and len(netns.leftovers(tag)) == 5
        assert not any(n.startswith(tag + "-") for n in netns.cleanup_stale())  # its owner is alive
    finally:
        proc.kill()
        proc.wait(timeout=10)
    removed = netns.cleanup_stale()
    assert f"{tag}-n0" in removed and f"{tag}-br" in removed
    assert wait_gone(tag) == []


def train_cmd(out: Path, *extra: str, nproc: int = 4, ranks_per_node: int = 2) -> list[str]:
    return [sys.executable, "-m", "falconext.cli", "train", "--no-report", "--device", "cpu", "--net", "netns", "--nproc", str(nproc),
            "--ranks-per-node", str(ranks_per_node), "--tp", "1", "--pp", "2", "--global-batch-size", "8",
            "--micro-batch-size", "1", "--out", str(out), *extra]


@real
@pytest.mark.parametrize("falcon", [False, True], ids=["no-falcon", "falcon"])
def test_train_over_namespaces_finishes_and_leaves_nothing(tmp_path: Path, falcon: bool) -> None:
    """The job the issue names, without falconext; and a shorter one with it, whose ranks
    (one per node, to halve the start-up) must reach the private Redis over the bridge."""
    out = tmp_path / "run"
    if falcon:
        cmd, ranks = train_cmd(out, "--iters", "8", nproc=2, ranks_per_node=1), 2
    else:
        cmd, ranks = train_cmd(out, "--iters", "12", "--no-falcon"), 4
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 0, stderr[-3000:]
    assert "not available" not in stdout
    assert json.loads((out / "summary.json").read_text())
    assert json.loads((out / "run.json").read_text())["args"]["net"] == "netns"
    if falcon:
        events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
        started = [e for e in events if e["type"] == "tracking_started"]
        assert len(started) == ranks and all(e["control"] for e in started)
        # a rank that cannot reach Redis says so at once (checked: with Redis on loopback only, both did)
        assert [e for e in events if e["type"] == "control_lost"] == []
    assert wait_gone(f"fx{proc.pid}") == []


@real
def test_sigterm_to_the_launcher_removes_the_namespaces(tmp_path: Path) -> None:
    proc = subprocess.Popen(train_cmd(tmp_path / "run", "--iters", "200", "--no-falcon"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tag = f"fx{proc.pid}"
    try:
        deadline = time.monotonic() + 30
        while not any(n == f"{tag}-n1" for n in netns.list_namespaces()):
            assert proc.poll() is None and time.monotonic() < deadline, "the namespaces never came up"
            time.sleep(0.1)
        time.sleep(1.0)  # let the torchruns start inside them
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert wait_gone(tag) == []


@pytest.fixture(scope="module")
def congested(tmp_path_factory) -> tuple[list[dict], dict]:
    """TP1 x DP2 x PP2 on two nodes of two ranks over real rate-limited links (5 MB/s);
    from iteration 45 the one network link is 4x slower: (events, summary)."""
    if REASON is not None:
        pytest.skip(f"--net netns not available: {REASON}")
    tmp_path = tmp_path_factory.mktemp("congested")
    out = tmp_path / "run"
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps([{"kind": "link", "nodes": [0, 1], "factor": 4.0, "start": 45}]))
    cmd = [sys.executable, "-m", "falconext.cli", "train", "--no-report", "--device", "emulated", "--net", "netns", "--nproc", "4",
           "--ranks-per-node", "2", "--tp", "1", "--pp", "2", "--layers", "2", "--hidden", "32", "--seq-len", "256",
           "--global-batch-size", "16", "--micro-batch-size", "1", "--link-bandwidth", "5e6", "--iters", "100",
           *host_paced(["--falcon-mitigation-strategies", "S3", "--inject", str(faults), "--out", str(out)])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    return events, json.loads((out / "summary.json").read_text())


#: the congested job (a minute over real links, with the job lane held) runs in the long
#: leg of .ci/run (python3 -m pytest -q -m long), not in the README's main suite
@real
@pytest.mark.long
def test_a_congested_node_link_is_localized_and_s3_moves_the_pipeline_off_it(congested) -> None:
    """A two-node job has no peer link to judge its one link against, so the controller
    measured it healthy early on (the link baseline); the P2P passes must name it against
    that, and S3 must give the processes roles that keep each pipeline inside a node (the
    job's activations, 8 micro-batches of 256 tokens, weigh more than its gradients), and
    the job must get faster."""
    events, summary = congested
    (base,) = [e for e in events if e["type"] == "link_baseline"]
    assert base["kept"] and list(base["links"]) == ["0-1"] and base["links"]["0-1"] > 0
    (loc,) = [e for e in events if e["type"] == "localized" and e["evidence"]["trigger"] == "fail_slow"]
    assert loc["links"] == [[0, 1]] and loc["gpus"] == [], loc["evidence"]
    assert loc["evidence"]["links"]["reference_from"] == "baseline"
    (s3,) = [e for e in events if e["type"] == "mitigation" and e["strategy"] in ("S2", "S3", "S4")]
    assert s3["strategy"] == "S3" and s3["iteration"] > 45
    roles = s3["roles"]  # torch rank d + 2 p plays replica d of stage p; node = process // 2
    process_of = {r: p for p, r in enumerate(roles)}
    pipelines = [{process_of[d] // 2, process_of[d + 2] // 2} for d in range(2)]
    assert all(len(nodes) == 1 for nodes in pipelines), roles  # no pipeline message crosses the link
    assert summary["mitigated_iter_s"] < summary["slow_iter_s"], summary


@real
@pytest.mark.long
def test_s3_over_real_links_is_held_to_its_model(congested) -> None:
    """The model that chose S3's layout predicts both layouts' iterations within 15% of
    what the job then measured over real TCP links, and the job gets faster by at least
    half the fraction predicted. Two causes made the model overestimate the congested
    layout (0.65 s predicted, 0.56 s measured): validation measured the link with two
    pairs crossing it at once, each at half the link's rate, so the excess per byte was
    doubled (validation now keeps one transfer per link and direction at a time); and the
    healthy network's own time per byte was left out, so moving the DP rings onto the link
    cost only its excess (now priced, with the rings of both stages sharing the link as
    the pipeline drains)."""
    events, summary = congested
    (s3,) = [e for e in events if e["type"] == "mitigation" and e["strategy"] in ("S2", "S3", "S4")]
    before, after = s3["predicted_s"]
    slow, mitigated = summary["slow_iter_s"], summary["mitigated_iter_s"]
    print(f"predicted {before:.3f} -> {after:.3f} s, measured {slow:.3f} -> {mitigated:.3f} s")
    assert abs(before - slow) <= 0.15 * slow, (before, slow, s3.get("model_inputs"))
    assert abs(after - mitigated) <= 0.15 * mitigated, (after, mitigated, s3.get("model_inputs"))
    assert (slow - mitigated) / slow >= 0.5 * (before - after) / before, summary
