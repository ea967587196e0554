"""What the NCCL hooks cost the training thread per intercepted call (CPU, gloo).

1. Wrapper alone: the tracer wraps a no-op stand-in for a torch.distributed function
   (installed before the tracer, which wraps whatever it finds), so the difference from
   calling the no-op directly is the bookkeeping alone, free of gloo's noise. Measured
   for a sync call and for an async call whose handle is waited on (the Work proxy).
2. Real gloo calls on a one-process group (FileStore): blocks of calls alternate
   between plain and traced, and the median of the paired differences is reported, so
   drift and block order hit both sides alike. A gloo call takes ~100 us and hands off to
   gloo's worker thread; on a small VM the paired differences spread over +-10 us (the
   IQR column, and the plain-vs-plain noise floor row), so these rows can only bound
   the cost; row 1 is the figure to hold to the budget.
3. The analysis thread's cost in drain() per record.

Then the share of an iteration: added us/call x ``--calls-per-iter`` / ``--iter-time``.
Figures only; the target (<= 5 us added per call) is for the reader to compare.

    python examples/bench_hooks.py --iter-time 0.15 --calls-per-iter 100
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from typing import Any, Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from falconext.trace.hooks import CallTracer  # noqa: E402


class _Handle:
    """Stands in for a Work handle: completed at once, no future (as gloo's P2P)."""

    def wait(self, timeout: Any = None) -> bool:
        return True


_HANDLE = _Handle()


def _noop_sync(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
    return None


def _noop_async(
    output: Any, input: Any, op: Any = None, group: Any = None, async_op: bool = False
) -> Any:
    return _HANDLE if async_op else None


def per_call_us(call: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def paired(make_call: Callable[[], Callable[[], Any]], tracer: CallTracer | None, calls: int,
           blocks: int) -> tuple[float, float, float, float]:
    """(plain, traced, median and IQR of traced - plain) per call in us, over block pairs.

    The order within a pair alternates (plain first, then traced first) because the
    second block of a pair runs measurably slower here whatever it holds.
    ``tracer=None`` compares plain with plain: the noise floor of the difference.
    """

    def traced_block() -> float:
        if tracer is None:
            return per_call_us(make_call(), calls)
        tracer.install()
        try:
            return per_call_us(make_call(), calls)
        finally:
            tracer.uninstall()
            tracer.drain()

    plain, traced, diffs = [], [], []
    for i in range(blocks):
        if i % 2 == 0:
            a = per_call_us(make_call(), calls)
            b = traced_block()
        else:
            b = traced_block()
            a = per_call_us(make_call(), calls)
        plain.append(a)
        traced.append(b)
        diffs.append(b - a)
    q1, _, q3 = statistics.quantiles(diffs, n=4)
    return statistics.median(plain), statistics.median(traced), statistics.median(diffs), q3 - q1


def wrapper_alone(name: str, stub: Callable[..., Any], call: Callable[[], Any], tracer: CallTracer,
                  calls: int, blocks: int) -> tuple[float, float, float, float]:
    """Measure ``call`` with torch.distributed.<name> replaced by ``stub``."""
    real = getattr(dist, name)
    setattr(dist, name, stub)
    try:
        return paired(lambda: call, tracer, calls, blocks)
    finally:
        setattr(dist, name, real)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000, help="calls per block")
    ap.add_argument("--blocks", type=int, default=31, help="plain/traced block pairs")
    ap.add_argument("--iter-time", type=float, default=0.15, help="seconds per training iteration")
    ap.add_argument("--calls-per-iter", type=int, default=100,
                    help="intercepted calls per iteration")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            run(args)
        finally:
            dist.destroy_process_group()


def run(args: argparse.Namespace) -> None:
    tracer = CallTracer(0, capacity=max(65536, args.calls * 8))
    with_futures = CallTracer(0, capacity=max(65536, args.calls * 8), completion_futures=True)
    tiny = torch.ones(4)
    out = torch.empty(4)
    rows: list[tuple[str, tuple[float, float, float, float]]] = []

    def show(name: str, figures: tuple[float, float, float, float]) -> None:
        rows.append((name, figures))
        plain, traced, added, iqr = figures
        print(f"  {name:<44} {plain:9.2f} {traced:9.2f} {added:+9.2f} {iqr:9.2f}")

    print(f"per call: medians over {args.blocks} plain/traced block pairs"
          f" of {args.calls} calls (us)")
    print(f"  {'':<44} {'plain':>9} {'traced':>9} {'added':>9} {'IQR':>9}")
    show("wrapper alone: sync all_reduce", wrapper_alone(
        "all_reduce", _noop_sync, lambda: dist.all_reduce(tiny), tracer, args.calls * 10,
        args.blocks))
    show("wrapper alone: async reduce_scatter + wait", wrapper_alone(
        "reduce_scatter_tensor", _noop_async,
        lambda: dist.reduce_scatter_tensor(out, tiny, async_op=True).wait(),
        tracer, args.calls * 10, args.blocks))

    def sync_all_reduce() -> Callable[[], Any]:
        f = dist.all_reduce
        return lambda: f(tiny)

    def async_all_reduce() -> Callable[[], Any]:
        f = dist.all_reduce
        return lambda: f(tiny, async_op=True).wait()

    def async_reduce_scatter() -> Callable[[], Any]:
        f = dist.reduce_scatter_tensor
        return lambda: f(out, tiny, async_op=True).wait()

    def barrier() -> Callable[[], Any]:
        f = dist.barrier
        return lambda: f()

    show("gloo all_reduce, plain vs plain (noise floor)",
         paired(sync_all_reduce, None, args.calls, args.blocks))
    show("gloo all_reduce (sync)", paired(sync_all_reduce, tracer, args.calls, args.blocks))
    show("gloo all_reduce async + wait (proxy)",
         paired(async_all_reduce, tracer, args.calls, args.blocks))
    show("gloo all_reduce async + wait (future callback)",
         paired(async_all_reduce, with_futures, args.calls, args.blocks))
    show("gloo reduce_scatter async + wait (proxy)",
         paired(async_reduce_scatter, tracer, args.calls, args.blocks))
    show("gloo barrier", paired(barrier, tracer, args.calls, args.blocks))

    tracer.install()
    try:
        for _ in range(args.calls * 10):
            dist.all_reduce(tiny)
    finally:
        tracer.uninstall()
    start = time.perf_counter()
    n = len(tracer.drain())
    drain_us = (time.perf_counter() - start) / max(n, 1) * 1e6
    start = time.perf_counter()
    for _ in range(20):
        tracer.install()
        tracer.uninstall()
    install_ms = (time.perf_counter() - start) / 20 * 1e3

    print(f"\ndrain(): {drain_us:.2f} us per record on the analysis thread ({n} records)")
    print(f"install()+uninstall(): {install_ms:.2f} ms (scans loaded megatron modules for aliases)")
    print(f"errors swallowed: {tracer.errors + with_futures.errors}, dropped: {tracer.dropped}")
    iter_us = args.iter_time * 1e6
    print(f"\nshare of a {args.iter_time:g} s iteration"
          f" with {args.calls_per_iter} intercepted calls:")
    for name, (_, _, added, _) in rows:
        share = max(added, 0.0) * args.calls_per_iter / iter_us * 100
        print(f"  {name:<44} {added:+7.2f} us/call -> {share:.4f} %")


if __name__ == "__main__":
    main()
