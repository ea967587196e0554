"""Command-line options of the training test bed, shared by ``falconext train`` (which
starts torchrun) and ``python -m falconext.testbed.train`` (what each torchrun process runs)."""

from __future__ import annotations

import argparse
import math
from urllib.parse import urlparse

from falconext.config import ConfigError, add_config_arguments, parse_microbatches, parse_topology
from falconext.control.client import redis_url_from_file
from falconext.model.roles import check_roles
from falconext.testbed.chaos import ChaosError, parse_chaos



def _report_intervals(text: str) -> tuple[float, ...]:
    """``--nvrx-report-s``: one interval in seconds or several, comma-separated (each
    checked finite and > 0 with the job's other arguments)."""
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, or several comma-separated, got {text!r}") from None
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"an interval is given twice in {text!r}")
    return values

def add_train_arguments(p: argparse.ArgumentParser, launcher: bool) -> None:
    """Add the test bed's training arguments (parallel sizes, batch, model shape, device,
    faults, chaos, falconext's ``--falcon*`` flags) to ``p``; ``launcher`` adds the
    launcher-only ones (``--nproc``). Checked afterwards by :func:`check_train_arguments`."""
    if launcher:
        p.add_argument("--nproc", type=int, default=4, help="processes (ranks) on this machine")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (DP = ranks / (TP x PP))")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument(
        "--device", choices=["emulated", "cpu", "cuda"], default="emulated",
        help="emulated: real training on CPU, device time from a device model (default); cpu: real CPU "
        "time; cuda: GPUs with NCCL",
    )
    p.add_argument("--device-gflops", type=float, default=None,
                   help="emulated device throughput, GFLOP/s (default: see falconext.model.device)")
    p.add_argument("--net", choices=["emulated", "netns"], default="emulated",
                   help="virtual links: emulated (a link model sets each transfer's time) or netns (one "
                   "network namespace per virtual node, real rate-limited veth links; needs root)")
    p.add_argument("--out", default="runs/latest", help="output directory")
    p.add_argument("--seed", type=int, default=1234)
    falcon = p.add_mutually_exclusive_group()
    falcon.add_argument("--falcon", dest="falcon", action="store_true", default=True, help="detection on (default)")
    falcon.add_argument("--no-falcon", dest="falcon", action="store_false", help="train without falconext")
    p.add_argument("--inject", default=None, help="JSON list of faults (experiment tool)")
    p.add_argument("--ranks-per-node", type=int, default=2, help="ranks per virtual node (link faults)")
    p.add_argument("--link-bandwidth", type=float, default=None,
                   help="inter-node link bytes/s (default: see falconext.model.device)")
    p.add_argument(
        "--falcon-redis-url", default=None,
        help="control-plane Redis without a password (redis://HOST:PORT/0); one with a password comes from "
        "--falcon-redis-url-file or $FALCON_REDIS_URL, never the command line; default: the launcher starts "
        "a private one on loopback",
    )
    p.add_argument("--falcon-redis-url-file", default=None,
                   help="a file holding the control-plane Redis URL (redis://:PASSWORD@HOST:PORT/0)")
    p.add_argument("--report", action=argparse.BooleanOptionalAction, default=True,
                   help="draw report.html and its figures at the end (falconext report DIR)")
    p.add_argument("--chaos", default=None, metavar="SPEC",
                   help="break the control plane on purpose: kill-redis@I, kill-controller@I, kill-agent:N@I, "
                   "drop:P, delay:MS, corrupt:P, comma-separated (falconext/testbed/chaos.py)")
    p.add_argument("--resume", default=None, help="resume from this falconext checkpoint directory (S4 restarts)")
    p.add_argument("--attempt", type=int, default=0, help="restart count of this job (set by the launcher)")
    p.add_argument("--bench-falcon-toggle", type=int, default=None, metavar="N",
                   help="benchmark: falconext off for N iterations, on for N, and so on (examples/bench_overhead.py)")
    p.add_argument("--nvrx-report-s", type=_report_intervals, default=None, metavar="S[,S...]",
                   help="benchmark: run NVIDIA nvidia-resiliency-ext's straggler detection beside falconext, a report "
                   "every S seconds (several: one detector per interval), written to nvrx.jsonl with its interval "
                   "(the nvrx extra; examples/compare_nvrx.py)")
    add_config_arguments(p)


def redis_url_from(args: argparse.Namespace) -> None:
    """``args.falcon_redis_url`` from ``--falcon-redis-url-file`` when given; a URL with a
    password on the command line (readable by every user in ``ps``) is refused."""
    given = getattr(args, "falcon_redis_url", None)
    if given and urlparse(given).password:
        raise ValueError("--falcon-redis-url: a password on the command line is visible to every user; "
                         "put the URL in $FALCON_REDIS_URL or a file given by --falcon-redis-url-file")
    path = getattr(args, "falcon_redis_url_file", None)
    if path:
        args.falcon_redis_url = redis_url_from_file(path)


def check_train_arguments(args: argparse.Namespace, world: int) -> None:
    """Reject impossible layouts up front, before any process starts."""
    redis_url_from(args)

    try:
        parse_chaos(getattr(args, "chaos", None), world, -(-world // max(1, args.ranks_per_node)))
    except ChaosError as exc:
        raise ValueError(str(exc)) from None
    for name in ("tp", "pp", "micro_batch_size", "global_batch_size", "iters", "hidden", "layers", "heads", "seq_len", "vocab", "ranks_per_node"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if world % (args.tp * args.pp):
        raise ValueError(f"{world} ranks are not divisible by TP {args.tp} x PP {args.pp}")
    dp = world // (args.tp * args.pp)
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} is not divisible by "
            f"--micro-batch-size {args.micro_batch_size} x DP {dp}"
        )
    try:
        forced = parse_microbatches(getattr(args, "falcon_force_microbatches", None) or "")
    except ConfigError as exc:
        raise ValueError(f"--falcon-force-microbatches: {exc}") from None
    total = args.global_batch_size // args.micro_batch_size
    if forced is not None and (len(forced) != dp or sum(forced) != total):
        raise ValueError(
            f"--falcon-force-microbatches {args.falcon_force_microbatches} must give {dp} DP replicas "
            f"{total} micro-batches in all (global batch {args.global_batch_size} / micro-batch "
            f"{args.micro_batch_size}); it gives {len(forced)} replicas {sum(forced)}"
        )
    try:
        topo = parse_topology(getattr(args, "falcon_force_topology", None) or "")
    except ConfigError as exc:
        raise ValueError(f"--falcon-force-topology: {exc}") from None
    if topo is not None:
        # lazy: start-up time (numpy; the CLI imports this module)
        from falconext.mitigate.topology import check_tp_in_nodes

        roles = check_roles(topo[1], world, "--falcon-force-topology roles")
        check_tp_in_nodes(roles, args.tp, args.ranks_per_node, "--falcon-force-topology")
    for nvrx in getattr(args, "nvrx_report_s", None) or ():
        if not (math.isfinite(nvrx) and nvrx > 0):
            raise ValueError(f"--nvrx-report-s must be a finite number > 0, got {nvrx!r}")
    for name in ("device_gflops", "link_bandwidth"):
        value = getattr(args, name, None)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0, got {value!r}")
    if args.layers % args.pp:
        raise ValueError(f"--layers {args.layers} is not divisible by --pp {args.pp}")
    if args.hidden % args.heads or args.heads % args.tp:
        raise ValueError("--hidden must be divisible by --heads, and --heads by --tp")
