"""The emulated accelerator's time model (pure): how long a device and a link would take.

``--device emulated`` keeps the computation real (megatron-core on CPU tensors over
gloo) and takes only the *time* from here, so that every rank behaves like one that owns
its GPU: a micro-batch's forward and backward take the FLOPs of this rank's pipeline
stage at the device's throughput, a transfer takes latency plus bytes over the link's
bandwidth, and a fault multiplies those times by its factor from its first iteration on
(a step, no feedback from the host's load). Nothing in the pipeline (detect/, profile/,
validate/, mitigate/, control/, runtime/) reads this module: they see collective calls
and their timings, as on a GPU cluster.

The FLOP count is Megatron's usual estimate for a GPT layer (dense matmuls and
attention scores, forward): ``24 b s h^2 + 4 b s^2 h`` per layer, plus the logits
``2 b s h V`` on the last stage, divided by TP; a backward costs two forwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: defaults: a micro-batch of the test bed's default GPT (4 layers, hidden 64, sequence
#: 64, vocab 256, micro-batch 1) takes about 16 ms forward and 32 ms backward, tens of
#: milliseconds as on a GPU, while its real CPU work is about 10 ms (measured on the
#: 2-core machine) -- so four ranks on two cores still finish their CPU work inside the
#: device time and sleep for the rest
DEFAULT_GFLOPS = 2.0
#: ranks one core keeps inside their device time at DEFAULT_GFLOPS (two ranks on the
#: 2-core machine); more ranks per core get a proportionally slower device: 16 ranks on
#: 2 cores at 2 GFLOP/s overran the host (iteration CoV 14%), at 0.25 GFLOP/s 0.96%
RANKS_PER_CORE = 1.0


def host_gflops(cores: int, ranks_on_host: int) -> float:
    """The emulated device speed for ``ranks_on_host`` ranks sharing ``cores`` cores:
    DEFAULT_GFLOPS while each core has at most RANKS_PER_CORE ranks, slower in proportion
    beyond (pure)."""
    if cores < 1 or ranks_on_host < 1:
        return DEFAULT_GFLOPS
    return DEFAULT_GFLOPS * min(1.0, RANKS_PER_CORE * cores / ranks_on_host)


#: links: a node's internal links (NVLink-like) are fast, the network between nodes is
#: the bottleneck; 50 MB/s makes the default model's DP all-reduce over nodes a few
#: percent of an iteration, as on a real cluster
DEFAULT_INTRA_BANDWIDTH = 2e9
DEFAULT_INTER_BANDWIDTH = 50e6
DEFAULT_INTRA_LATENCY_S = 20e-6
DEFAULT_INTER_LATENCY_S = 200e-6
#: a backward takes this many forwards
BACKWARD_PER_FORWARD = 2.0


@dataclass(frozen=True)
class DeviceModel:
    """Throughput of one emulated device and the two kinds of links between devices."""

    gflops: float = DEFAULT_GFLOPS
    intra_bandwidth: float = DEFAULT_INTRA_BANDWIDTH
    inter_bandwidth: float = DEFAULT_INTER_BANDWIDTH
    intra_latency_s: float = DEFAULT_INTRA_LATENCY_S
    inter_latency_s: float = DEFAULT_INTER_LATENCY_S

    def __post_init__(self) -> None:
        for name in ("gflops", "intra_bandwidth", "inter_bandwidth"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"device model: {name} must be a finite number > 0, got {v!r}")
        for name in ("intra_latency_s", "inter_latency_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"device model: {name} must be a finite number >= 0, got {v!r}")

    def compute_s(self, flops: float, factor: float = 1.0) -> float:
        """Seconds this device takes for ``flops`` when slowed by ``factor``."""
        return factor * flops / (self.gflops * 1e9)

    def link(self, node_a: int, node_b: int) -> tuple[float, float]:
        """(bandwidth bytes/s, latency s) of the healthy link between two nodes."""
        if node_a == node_b:
            return self.intra_bandwidth, self.intra_latency_s
        return self.inter_bandwidth, self.inter_latency_s

    def p2p_s(self, nbytes: float, node_a: int, node_b: int, factor: float = 1.0) -> float:
        """Seconds one message of ``nbytes`` takes from a device on ``node_a`` to one on
        ``node_b``, over a link slowed by ``factor`` (its bandwidth divided by it)."""
        if nbytes <= 0:
            return 0.0
        bw, lat = self.link(node_a, node_b)
        return lat + factor * nbytes / bw

    def ring_s(self, op: str, nbytes: float, nodes: list[int], factors: list[float] | None = None) -> float:
        """Seconds a ring collective ``op`` of ``nbytes`` (the full tensor) takes over
        members on ``nodes`` (in ring order). ``factors[i]`` slows the hop from member i
        to member i + 1. The ring moves in lock step, so its slowest hop sets the pace;
        every member gets the same answer (they all wait for the last chunk)."""
        n = len(nodes)
        if n <= 1 or nbytes <= 0:
            return 0.0
        factors = factors or [1.0] * n
        steps, per_hop = ring_steps(op, n), ring_hop_bytes(op, nbytes, n)
        worst = 0.0
        for i in range(n):
            bw, lat = self.link(nodes[i], nodes[(i + 1) % n])
            worst = max(worst, lat * steps + factors[i] * per_hop / bw)
        return worst


def ring_steps(op: str, n: int) -> int:
    """Sequential steps of the ring algorithm for ``op`` over ``n`` members."""
    if n <= 1:
        return 0
    return 2 * (n - 1) if op == "all_reduce" else n - 1


def ring_hop_bytes(op: str, nbytes: float, n: int) -> float:
    """Bytes each ring hop carries in all for ``op`` on a tensor of ``nbytes``: an
    all-reduce sends 2 (n-1)/n of it, reduce-scatter and all-gather (n-1)/n, anything
    else (broadcast, a barrier's token) the whole of it once."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n * nbytes
    if op in ("reduce_scatter", "all_gather"):
        return (n - 1) / n * nbytes
    return float(nbytes)


def gpt_forward_flops(
    layers: int, hidden: int, seq_len: int, micro_batch: int, vocab: int, tp: int, last_stage: bool
) -> float:
    """Forward FLOPs of one micro-batch through ``layers`` GPT layers on one TP rank
    (plus the logits on the last pipeline stage)."""
    b, s, h = micro_batch, seq_len, hidden
    flops = layers * (24.0 * b * s * h * h + 4.0 * b * s * s * h)
    if last_stage:
        flops += 2.0 * b * s * h * vocab
    return flops / tp


def gemm_flops(m: int, k: int, n: int) -> float:
    """FLOPs of an (m x k) @ (k x n) matmul."""
    return 2.0 * m * k * n


#: validation settings for the CPU test bed, unless given on the command line: its
#: ranks share the host's cores (one benchmark at a time), and its loopback messages
#: pick up milliseconds of scheduling noise (see FalconConfig)
CPU_TESTBED = {
    "falcon_gemm_concurrency": 1,
    "falcon_p2p_concurrency": 1,
    "falcon_validation_min_link_excess_s": 0.005,
}

#: validation settings for the emulated device, unless given on the command line: each
#: rank owns its (emulated) device, so benchmarks run side by side, and device time is
#: exact, so a few GEMM repeats suffice; the 5 ms floor keeps real loopback noise from
#: naming a link on a loaded host. Messages: see MESSAGE_S.
EMULATED_TESTBED = {
    "falcon_gemm_repeats": 10,
    "falcon_validation_min_link_excess_s": 0.005,
}
TESTBED_KNOBS = {"cpu": CPU_TESTBED, "emulated": EMULATED_TESTBED}

#: over the emulated links or real ones (``--net netns``) a validation message lasts this
#: long at the network's base rate (1 MB at the default 50 MB/s): long enough that a
#: link's congestion stands far above the milliseconds of real loopback or TCP noise,
#: short enough that the sweeps over a congested link end well inside the controller's
#: validation deadline (1 MB messages over a 5 or 10 MB/s network took 0.8 s each under
#: a fault, and the results came after the deadline)
MESSAGE_S = 0.02
