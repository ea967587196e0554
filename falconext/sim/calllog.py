"""Synthetic per-rank collective call logs of a Megatron-like job, with ground truth.

The iteration-time tracker must be judged against iteration times it cannot see: the
time the training loop began each iteration. This generator knows them because it
builds the log from them. It is an experiment tool, pure and seeded; nothing in the
detector may read it.

Model: all ranks begin iteration n together at ``starts[n]`` (the previous step's
gradient synchronisation and pipeline flush line them up). Each rank then walks its
call pattern: compute (jittered, stretched by any slowdown) before each call, the call
itself (latency + bytes / bandwidth), and after the last call the optimizer step.
The iteration ends when the slowest rank is done; evaluation and checkpoint-save
iterations append their calls and pauses before the next one begins, so they lengthen
the iteration they follow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from falconext.trace.records import CallRecord


@dataclass(frozen=True)
class CallSpec:
    """One call of a simulated iteration: op, group, bytes, and the compute before it (seconds)."""

    op: str
    group: str
    bytes: int
    #: seconds of compute on the rank between the previous call (or the iteration start)
    #: and this call
    compute_before: float


Pattern = Sequence[CallSpec]


@dataclass(frozen=True)
class Slowdown:
    """Compute on ``ranks`` (all when None) is stretched by ``factor`` in [first, stop)."""

    first: int
    stop: int
    factor: float
    ranks: tuple[int, ...] | None = None


@dataclass(frozen=True)
class CallLogSpec:
    """What to simulate: each rank's calls per iteration, the number of iterations, compute
    jitter, evaluations, checkpoints, periodic extra calls, injected slowdowns, a pattern
    change and the link model. Construction raises ValueError for an empty pattern or a
    negative or zero count."""

    #: rank -> the calls of one training iteration, in issue order
    patterns: Mapping[int, Pattern]
    iterations: int
    #: compute after an iteration's last call (optimizer step, data loading)
    step_compute: float = 0.05
    #: relative jitter of every compute segment (log-normal, mean 1)
    jitter: float = 0.02
    #: an evaluation follows every iteration n with (n + 1) % eval_every == 0; 0: never
    eval_every: int = 0
    #: rank -> calls of the evaluation (default: one small loss all-reduce)
    eval_patterns: Mapping[int, Pattern] | None = None
    eval_pause: float = 0.2
    #: a checkpoint save (pause, then a barrier) follows every checkpoint_every-th iteration
    checkpoint_every: int = 0
    checkpoint_pause: float = 0.5
    #: (N, calls): every rank issues the calls at the end of every N-th iteration, after
    #: its last call (Megatron-LM's --log-interval timer all-gather, a periodic metric)
    extra_every: tuple[tuple[int, Pattern], ...] = ()
    slowdowns: tuple[Slowdown, ...] = ()
    #: (iteration, patterns): from that iteration on every rank follows the new patterns
    pattern_change: tuple[int, Mapping[int, Pattern]] | None = None
    bandwidth: float = 25e9
    latency: float = 20e-6
    start_time: float = 1.0

    @property
    def n_ranks(self) -> int:
        """The number of ranks (one pattern each)."""
        return len(self.patterns)

    def __post_init__(self) -> None:
        if self.iterations < 1:
            raise ValueError("iterations must be >= 1")
        if not self.patterns or any(len(p) == 0 for p in self.patterns.values()):
            raise ValueError("every rank needs a non-empty pattern")
        if self.jitter < 0 or self.step_compute < 0:
            raise ValueError("jitter and step_compute must be >= 0")
        if any(every < 1 or not calls for every, calls in self.extra_every):
            raise ValueError("extra_every needs N >= 1 and at least one call")


@dataclass(frozen=True)
class CallLog:
    """A simulated run: every rank's call records and the ground truth (iteration starts and durations, the
    long iterations)."""

    spec: CallLogSpec
    #: all ranks' calls, interleaved by issue time; seq counts each rank's calls from 0
    records: list[CallRecord]
    #: rank -> start of each iteration, plus the end of the last one (iterations + 1)
    starts: dict[int, np.ndarray]
    #: rank -> true iteration durations, starts[n + 1] - starts[n]
    durations: dict[int, np.ndarray]
    #: iterations followed by an evaluation or a checkpoint save (they run long)
    special: np.ndarray = field(repr=False)

    def rank_records(self, rank: int) -> list[CallRecord]:
        """The records of ``rank``, in issue order (empty for an unknown rank)."""
        return [r for r in self.records if r.rank == rank]

    def iteration_at(self, rank: int, t: float) -> int:
        """True iteration n with starts[n] <= t < starts[n + 1]; -1 outside the run."""
        starts = self.starts[rank]
        n = int(np.searchsorted(starts, t, side="right")) - 1
        return n if 0 <= n < starts.size - 1 else -1


def generate(spec: CallLogSpec, seed: int | np.random.Generator = 0) -> CallLog:
    """Simulate ``spec`` with a seeded generator (an int seed or a Generator): the same
    spec and seed always give the same log. Every rank starts an iteration together
    and the iteration ends when the slowest is done (module docstring), so a slowdown
    on one rank lengthens every rank's iteration."""
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    ranks = sorted(spec.patterns)
    rows: list[tuple[float, int, CallRecord]] = []
    seqs = {r: 0 for r in ranks}
    starts = np.empty(spec.iterations + 1)
    special = np.zeros(spec.iterations, dtype=bool)
    t0 = spec.start_time

    def jittered(size: int) -> np.ndarray:
        sigma = spec.jitter
        return np.exp(sigma * rng.standard_normal(size) - 0.5 * sigma * sigma)

    def walk(rank: int, calls: Pattern, t: float, stretch: float) -> float:
        factors = jittered(len(calls))
        for call, factor in zip(calls, factors):
            t += call.compute_before * factor * stretch
            comm = spec.latency + call.bytes / spec.bandwidth
            record = CallRecord(
                rank, call.op, call.group, call.bytes, t, t, t + comm, seqs[rank]
            )
            seqs[rank] += 1
            rows.append((t, rank, record))
            t += comm
        return t

    for n in range(spec.iterations):
        starts[n] = t0
        patterns = spec.patterns
        if spec.pattern_change is not None and n >= spec.pattern_change[0]:
            patterns = spec.pattern_change[1]
        end = t0
        for rank in ranks:
            stretch = _stretch(spec.slowdowns, n, rank)
            t = walk(rank, patterns[rank], t0, stretch)
            for every, calls in spec.extra_every:
                if (n + 1) % every == 0:
                    t = walk(rank, calls, t, stretch)
            t += spec.step_compute * float(jittered(1)[0]) * stretch
            end = max(end, t)
        if spec.eval_every and (n + 1) % spec.eval_every == 0:
            special[n] = True
            eval_patterns = spec.eval_patterns or {
                r: [CallSpec("all_reduce", "eval", 4, 0.01)] for r in ranks
            }
            eval_end = end
            for rank in ranks:
                stretch = _stretch(spec.slowdowns, n, rank)
                eval_end = max(eval_end, walk(rank, eval_patterns.get(rank, ()), end, stretch))
            end = eval_end + spec.eval_pause
        if spec.checkpoint_every and (n + 1) % spec.checkpoint_every == 0:
            special[n] = True
            barrier = [CallSpec("barrier", "world", 4, spec.checkpoint_pause)]
            end = max(walk(rank, barrier, end, 1.0) for rank in ranks)
        t0 = end
    starts[spec.iterations] = t0

    rows.sort(key=lambda row: (row[0], row[1]))
    records = [row[2] for row in rows]
    durations = np.diff(starts)
    return CallLog(
        spec=spec,
        records=records,
        starts={r: starts.copy() for r in ranks},
        durations={r: durations.copy() for r in ranks},
        special=special,
    )


def _stretch(slowdowns: Sequence[Slowdown], n: int, rank: int) -> float:
    factor = 1.0
    for s in slowdowns:
        if s.first <= n < s.stop and (s.ranks is None or rank in s.ranks):
            factor *= s.factor
    return factor


# --- ready-made patterns ----------------------------------------------------------------


def dp_only_patterns(
    n_ranks: int = 4,
    buckets: int = 4,
    bucket_bytes: int | Sequence[int] = 25_000_000,
    forward: float = 0.03,
    backward: float = 0.06,
) -> dict[int, list[CallSpec]]:
    """Data parallel only: gradient buckets all-reduced as the backward pass frees them.

    Buckets of equal size are one repeated call: the symbols have period 1 and only the
    gaps (the forward pass before the first bucket) show the iteration.
    """
    sizes = [bucket_bytes] * buckets if isinstance(bucket_bytes, int) else list(bucket_bytes)
    per_bucket = backward / len(sizes)
    pattern = [
        CallSpec("all_reduce", "dp", size, (forward if i == 0 else 0.0) + per_bucket)
        for i, size in enumerate(sizes)
    ]
    return {r: list(pattern) for r in range(n_ranks)}


def dp_only_spec(
    iterations: int = 60,
    n_ranks: int = 4,
    buckets: int = 4,
    bucket_bytes: int | Sequence[int] = 25_000_000,
    **spec: object,
) -> CallLogSpec:
    """A data-parallel-only job: ``buckets`` gradient all-reduces per iteration on ``n_ranks`` ranks;
    ``spec`` sets any other CallLogSpec field."""
    return CallLogSpec(
        patterns=dp_only_patterns(n_ranks, buckets, bucket_bytes),
        iterations=iterations,
        **spec,  # type: ignore[arg-type]
    )


def dist_opt_patterns(
    calls: int = 3,
    n_ranks: int = 4,
    grad_bytes: int = 50_000_000,
    forward_backward: float = 0.09,
) -> dict[int, list[CallSpec]]:
    """Data parallel with the distributed optimizer: the fewest calls per iteration a
    Megatron-LM job makes. In order: the gradients' reduce-scatter after the backward
    pass, the updated parameters' all-gather, the loss all-reduce, the gradient norm's
    all-reduce; ``calls`` (2 to 4) keeps the first ones (2: the loss all-reduce and one
    gradient all-reduce, a DDP job with one bucket)."""
    if not 2 <= calls <= 4:
        raise ValueError(f"calls must be 2, 3 or 4, got {calls}")
    if calls == 2:
        pattern = [CallSpec("all_reduce", "dp", 4, forward_backward), CallSpec("all_reduce", "dp", grad_bytes, 0.01)]
    else:
        pattern = [
            CallSpec("reduce_scatter", "dp", grad_bytes, forward_backward),
            CallSpec("all_gather", "dp", grad_bytes, 0.01),
            CallSpec("all_reduce", "dp", 4, 0.001),
            CallSpec("all_reduce", "mp", 8, 0.001),
        ][:calls]
    return {r: list(pattern) for r in range(n_ranks)}


def dist_opt_spec(iterations: int = 60, calls: int = 3, n_ranks: int = 4, **spec: object) -> CallLogSpec:
    """A data-parallel job with the distributed optimizer, ``calls`` per iteration
    (:func:`dist_opt_patterns`); ``spec`` sets any other CallLogSpec field."""
    return CallLogSpec(patterns=dist_opt_patterns(calls, n_ranks), iterations=iterations, **spec)  # type: ignore[arg-type]


def pipeline_patterns(
    tp: int = 2,
    pp: int = 4,
    dp: int = 1,
    micro_batches: int = 8,
    layers_per_stage: int = 2,
    layer_ops: Sequence[str] = ("all_reduce", "all_reduce"),
    layer_group: str = "tp",
    activation_bytes: int = 4 << 20,
    layer_forward: float = 0.004,
    buckets: int = 2,
    bucket_bytes: int = 50_000_000,
    forward_only: bool = False,
) -> dict[int, list[CallSpec]]:
    """1F1B-like schedule per rank (Megatron rank order: tp fastest, then dp, then pp).

    Stage s runs min(pp - s - 1, M) warm-up forwards, then alternates forward and
    backward, then drains the backwards. First stages only send activations and
    receive gradients, middle ones do both, and the last stage also all-reduces each
    micro-batch's loss, so call counts per iteration differ from stage to stage.
    ``forward_only`` gives the evaluation schedule (forwards, no gradients).
    """
    patterns: dict[int, list[CallSpec]] = {}
    step = layer_forward / len(layer_ops)
    for s in range(pp):
        for d in range(dp):
            for i in range(tp):
                rank = s * tp * dp + d * tp + i
                lay = f"{layer_group}{s}.{d}"
                pipe = f"pp{d}.{i}"
                first, last = s == 0, s == pp - 1

                def forward() -> list[CallSpec]:
                    calls = [] if first else [CallSpec("recv", pipe, activation_bytes, 0.001)]
                    for _ in range(layers_per_stage):
                        calls += [CallSpec(op, lay, activation_bytes, step) for op in layer_ops]
                    if not last:
                        calls.append(CallSpec("send", pipe, activation_bytes, 0.0005))
                    else:
                        calls.append(CallSpec("all_reduce", f"dp{s}.{i}", 4, 0.0005))
                    return calls

                def backward() -> list[CallSpec]:
                    calls = [] if last else [CallSpec("recv", pipe, activation_bytes, 0.0005)]
                    for _ in range(layers_per_stage):
                        calls += [
                            CallSpec(op, lay, activation_bytes, 2 * step)
                            for op in reversed(layer_ops)
                        ]
                    if not first:
                        calls.append(CallSpec("send", pipe, activation_bytes, 0.001))
                    return calls

                calls: list[CallSpec] = []
                if forward_only:
                    for _ in range(micro_batches):
                        calls += forward()
                    patterns[rank] = calls
                    continue
                warmup = min(pp - s - 1, micro_batches)
                for _ in range(warmup):
                    calls += forward()
                for _ in range(micro_batches - warmup):
                    calls += forward() + backward()
                for _ in range(warmup):
                    calls += backward()
                if pp > 1 and (first or last):
                    calls.append(CallSpec("all_reduce", f"embd{d}.{i}", 1 << 20, 0.001))
                if dp > 1:
                    calls += [
                        CallSpec("all_reduce", f"dp{s}.{i}", bucket_bytes, 0.002)
                        for _ in range(buckets)
                    ]
                calls.append(CallSpec("all_reduce", f"mp{d}", 8, 0.002))  # grad norm
                patterns[rank] = calls
    return patterns


def tp_pp_spec(
    iterations: int = 40,
    tp: int = 2,
    pp: int = 4,
    dp: int = 1,
    micro_batches: int = 8,
    layers_per_stage: int = 2,
    eval_micro_batches: int = 2,
    **spec: object,
) -> CallLogSpec:
    """A TP x PP (x DP) job on a 1F1B-like schedule, with evaluation iterations of
    ``eval_micro_batches`` forward-only micro-batches; ``spec`` sets any other
    CallLogSpec field."""
    shape = dict(tp=tp, pp=pp, dp=dp, layers_per_stage=layers_per_stage)
    return CallLogSpec(
        patterns=pipeline_patterns(micro_batches=micro_batches, **shape),  # type: ignore[arg-type]
        eval_patterns=pipeline_patterns(
            micro_batches=eval_micro_batches, forward_only=True, **shape  # type: ignore[arg-type]
        ),
        iterations=iterations,
        **spec,  # type: ignore[arg-type]
    )


def long_period_spec(
    iterations: int = 12,
    pp: int = 2,
    micro_batches: int = 8,
    layers_per_stage: int = 64,
    **spec: object,
) -> CallLogSpec:
    """A deep mixture-of-experts stage: two all-to-alls per layer and pass, > 2000 calls
    per iteration on every rank (2064 on the first of two stages with the defaults)."""
    shape = dict(
        tp=1,
        pp=pp,
        layers_per_stage=layers_per_stage,
        layer_ops=("all_to_all", "all_to_all"),
        layer_group="ep",
        layer_forward=0.0005,
    )
    return CallLogSpec(
        patterns=pipeline_patterns(micro_batches=micro_batches, **shape),  # type: ignore[arg-type]
        eval_patterns=pipeline_patterns(
            micro_batches=1, forward_only=True, **shape  # type: ignore[arg-type]
        ),
        iterations=iterations,
        **spec,  # type: ignore[arg-type]
    )
