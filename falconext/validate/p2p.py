"""Point-to-point link benchmark over the disjoint passes of ``passes.py``.

Every rank of the group runs the same passes in the same order. A barrier opens each
pass, so passes never overlap and a pass measures only its own pairs; within a pass no
rank appears twice, so concurrent pairs do not share a rank and a slow rank cannot pass
for a slow link.

The receiver does the timing: it sees when each message has fully arrived, and the gap
between consecutive receive completions is the per-message time of the link in steady
state (the first gap starts at the end of the warm-up receive, so connection set-up and
first-touch costs stay out). The median of the gaps ignores one scheduling hiccup.

send/recv/barrier are parameters because the experiment harness passes the functions
from below its call tracer: validation traffic must not be recorded as training calls,
yet injected link delays must still apply. They default to torch.distributed's, looked
up at call time so that a harness patching torch.distributed is seen too. src/dst are
global ranks, as torch's send/recv take them even with a group.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from falconext.validate.passes import split_rounds

Pair = tuple[int, int]


def _check_passes(passes: Sequence[Sequence[Pair]], who: str) -> None:
    for i, p in enumerate(passes):
        seen: set[int] = set()
        for pair in p:
            if len(pair) != 2:
                raise ValueError(f"{who}: pass {i} holds {pair!r}, not a (src, dst) pair")
            src, dst = pair
            if src == dst:
                raise ValueError(f"{who}: pass {i} has rank {src} sending to itself")
            for r in (src, dst):
                if r in seen:
                    raise ValueError(f"{who}: rank {r} appears twice in pass {i}")
                seen.add(r)


def run_passes(
    passes: list[list[tuple[int, int]]],
    rank: int,
    nbytes: int,
    repeats: int = 5,
    *,
    group=None,
    send: Callable | None = None,
    recv: Callable | None = None,
    barrier: Callable | None = None,
    clock: Callable[[], float] = time.perf_counter,
    device: str = "cpu",
    sync: Callable[[], None] | None = None,
    concurrency: int = 0,
) -> list[tuple[int, int, float]]:
    """Run every pass; on a receiving rank return (src, dst, median seconds per message).

    Called collectively: every rank of ``group`` with the same ``passes``. Arguments are
    checked before the first barrier, so bad input fails on every rank alike instead of
    leaving some ranks waiting. ``device``/``sync`` are for NCCL, whose tensors live on the
    GPU and whose recv returns before the data has landed (pass torch.cuda.synchronize).

    ``concurrency`` > 0 runs each pass in rounds of at most that many pairs (a barrier
    before each): on a test bed whose ranks share a few cores, concurrent pairs compete
    for the CPU and a healthy link looks slow. 0 runs every pair of a pass at once.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
        raise ValueError(f"run_passes: nbytes must be an integer >= 1, got {nbytes!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"run_passes: repeats must be an integer >= 1, got {repeats!r}")
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 0:
        raise ValueError(f"run_passes: concurrency must be an integer >= 0, got {concurrency!r}")
    _check_passes(passes, "run_passes")
    send = dist.send if send is None else send
    recv = dist.recv if recv is None else recv
    barrier = dist.barrier if barrier is None else barrier

    buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    out: list[tuple[int, int, float]] = []
    for p in split_rounds(passes, concurrency):
        barrier(group=group)
        for src, dst in p:
            if rank == src:
                for _ in range(1 + repeats):
                    send(buf, dst, group=group)
            elif rank == dst:
                out.append((src, dst, _receive(recv, buf, src, group, repeats, clock, sync)))
    barrier(group=group)
    return out


def _receive(recv, buf, src: int, group, repeats: int, clock, sync) -> float:
    recv(buf, src, group=group)  # warm-up
    if sync is not None:
        sync()
    last = clock()
    gaps = []
    for _ in range(repeats):
        recv(buf, src, group=group)
        if sync is not None:
            sync()
        now = clock()
        gaps.append(now - last)
        last = now
    return float(statistics.median(gaps))
