"""The Slurm bed's configuration (``launch/slurm_bed.sh``, issue 52): what it tells Slurm
and what its task prolog tells each task. The bed itself (daemons in namespaces) runs in
``tests/megatron_lm/test_slurm.py``."""

from __future__ import annotations

import ipaddress
import os
import subprocess

from falconext.testbed import netns
from falconext.testbed.slurm_bed import (
    MARK,
    BedNode,
    gres_conf,
    hosts_lines,
    idle_nodes,
    missing,
    slurm_conf,
    task_prolog,
    without_bed_lines,
)

LAYOUT = netns.Layout("fxslurm", ipaddress.IPv4Network("10.213.7.0/24"), 3)
NODES = [BedNode(f"node{k}", LAYOUT.node_ip(k)) for k in range(3)]


def test_slurm_conf_declares_each_node_at_its_address_in_one_partition() -> None:
    conf = slurm_conf("vm", LAYOUT.bridge_ip, NODES)
    assert conf.startswith(MARK)
    assert "SlurmctldHost=vm(10.213.7.1)" in conf.splitlines()
    for k in range(3):
        assert f"NodeName=node{k} NodeAddr=10.213.7.1{k} NodeHostname=node{k} CPUs=64 Gres=gpu:8 State=UNKNOWN" \
            in conf.splitlines()
    assert "PartitionName=bed Nodes=node0,node1,node2 Default=YES MaxTime=INFINITE State=UP" in conf.splitlines()
    # several slurmd on one machine: each its own spool, pid file and log
    assert "SlurmdSpoolDir=/run/falconext-slurm-bed/slurmd-%n" in conf.splitlines()
    assert "SlurmdPidFile=/run/falconext-slurm-bed/slurmd-%n.pid" in conf.splitlines()
    gres = gres_conf(NODES).splitlines()
    assert "NodeName=node1 Name=gpu File=/run/falconext-slurm-bed/gpu[0-7]" in gres


def test_the_task_prolog_tells_each_task_its_emulated_node(tmp_path) -> None:
    script = tmp_path / "prolog.sh"
    script.write_text(task_prolog(LAYOUT, [n.name for n in NODES], 50e6))
    for k in (0, 2):
        out = subprocess.run(["sh", str(script)], env={"SLURMD_NODENAME": f"node{k}", "PATH": os.environ["PATH"]},
                             capture_output=True, text=True, check=True).stdout.splitlines()
        assert f"export FALCON_NETNS_NODE={k}" in out
        assert f"export GLOO_SOCKET_IFNAME=fxslurm-p{k}" in out
        assert "export FALCON_NETNS_IPS=10.213.7.10,10.213.7.11,10.213.7.12" in out
        assert "export FALCONEXT_NODES_ON_HOST=3" in out
        assert not any("FALCONEXT_NODE_NAME" in line for line in out)  # the job sets it, as on a cluster
    other = subprocess.run(["sh", str(script)], env={"SLURMD_NODENAME": "elsewhere", "PATH": os.environ["PATH"]},
                           capture_output=True, text=True, check=True)
    assert other.stdout == ""


def test_hosts_lines_come_and_go_leaving_the_rest() -> None:
    before = "127.0.0.1 localhost\n10.0.0.5 login\n"
    added = before + "".join(line + "\n" for line in hosts_lines(NODES))
    assert "10.213.7.11\tnode1\t" in added
    assert without_bed_lines(added) == before


def test_sinfo_states_are_read_per_node() -> None:
    assert idle_nodes("node0 idle\nnode1 drained\nnode2 allocated\n") == {
        "node0": "idle", "node1": "drained", "node2": "allocated"}


def test_up_says_in_one_line_why_it_cannot_run() -> None:
    why = missing()
    if os.geteuid() != 0:
        assert why is not None and "root" in why
    elif why is not None:
        assert "\n" not in why


def test_each_node_resolves_its_own_name_to_127_0_1_1_as_debian_writes_it() -> None:
    from falconext.testbed.slurm_bed import node_hosts_file

    lines = node_hosts_file("node1", NODES).splitlines()
    assert "127.0.1.1\tnode1" in lines and "10.213.7.10\tnode0" in lines and "10.213.7.12\tnode2" in lines
    assert not any(line.endswith("\tnode1") and not line.startswith("127.") for line in lines)
