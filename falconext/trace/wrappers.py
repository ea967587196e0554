"""The recording stand-ins for torch.distributed's functions, and their handles.

:class:`~falconext.trace.hooks.CallTracer` installs one wrapper per function: a
collective, a point-to-point call, ``batch_isend_irecv`` and ``_coalescing_manager``.
Each checks the trap, times the call on the host clock (or records CUDA events), calls
through and hands the record to the tracer; a bookkeeping failure is counted, never
passed to training. Async handles come back as :class:`TimedWork` proxies that note
their completion; :class:`P2PWrapper` makes a traced isend/irecv acceptable to
``P2POp``. Every wrapper has a twin that runs on the sampled entries of
:class:`~falconext.trace.cost.HookCost`.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from falconext.trace.entry import DONE, T_END

if TYPE_CHECKING:
    from falconext.trace.hooks import CallTracer


class OpSpec(NamedTuple):
    """Where one torch.distributed function keeps the arguments a record needs."""

    name: str  # attribute of torch.distributed
    op: str  # normalised op name in records
    tensor_pos: int | None  # the buffer counted in bytes (None: barrier)
    tensor_kw: str
    many: bool  # the buffer is a list of tensors (bytes summed)
    group_pos: int
    async_pos: int


# bytes = the full (unsharded) buffer: all_gather's output, reduce_scatter's input, the
# convention of nccl-tests, so a record's size does not depend on the group size
COLLECTIVES = (
    OpSpec("all_reduce", "all_reduce", 0, "tensor", False, 2, 3),
    OpSpec("reduce_scatter_tensor", "reduce_scatter", 1, "input", False, 3, 4),
    OpSpec("_reduce_scatter_base", "reduce_scatter", 1, "input", False, 3, 4),
    OpSpec("reduce_scatter", "reduce_scatter", 1, "input_list", True, 3, 4),
    OpSpec("all_gather_into_tensor", "all_gather", 0, "output_tensor", False, 2, 3),
    OpSpec("_all_gather_base", "all_gather", 0, "output_tensor", False, 2, 3),
    OpSpec("all_gather", "all_gather", 0, "tensor_list", True, 2, 3),
    OpSpec("broadcast", "broadcast", 0, "tensor", False, 2, 3),
    OpSpec("all_to_all_single", "all_to_all", 1, "input", False, 4, 5),
    OpSpec("barrier", "barrier", None, "", False, 0, 1),
)
# (attribute, op, peer keyword, group-rank peer keyword, async)
P2P_CALLS = (
    ("send", "send", "dst", "group_dst", False),
    ("recv", "recv", "src", "group_src", False),
    ("isend", "send", "dst", "group_dst", True),
    ("irecv", "recv", "src", "group_src", True),
)


def done_callback(entries: list[list], clock: Callable[[], float], _fut: Any) -> None:
    """Future callback (a backend thread, or inline if already complete)."""
    t = clock()
    for e in entries:
        e[T_END] = t
        e[DONE] = True


class TimedWork:
    """A Work handle that notes its completion time on the first successful wait.

    Everything but ``wait``/``is_completed`` is forwarded, so code that only waits on
    handles (Megatron's P2P communication) cannot tell it apart. It is not a
    ``torch.distributed.Work`` instance: a Python subclass of that pybind class costs
    ~2.6 us to create here, half the overhead budget.
    """

    __slots__ = ("_work", "_entries", "_tracer")

    def __init__(self, work: Any, entries: list[list], tracer: CallTracer) -> None:
        self._work = work
        self._entries: list[list] | None = entries
        self._tracer = tracer

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        """Wait on the handle as the original does and return what it returns; the first
        successful wait marks the call complete (host time, or an end event on GPU)."""
        cost = self._tracer.cost
        cost.left -= 1
        if cost.left <= 0:
            return cost.run(self._sampled_wait, (cost.timed(self._work.wait), args, kwargs), {})
        result = self._work.wait(*args, **kwargs)
        entries = self._entries
        if entries is not None:
            self._entries = None
            self._tracer._finish(entries)
        return result

    def _sampled_wait(self, wait: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """:meth:`wait` on a timed entry: ``wait`` is the handle's own, timed apart."""
        result = wait(*args, **kwargs)
        entries = self._entries
        if entries is not None:
            self._entries = None
            self._tracer._finish(entries)
        return result

    def is_completed(self) -> bool:
        """The handle's own answer; the first True marks the call complete on CPU (on GPU the
        end event waits for :meth:`wait`)."""
        done = self._work.is_completed()
        # on GPU "completed" says nothing about the current stream: the end event is
        # recorded at wait(), when that stream is made to wait for the transfer
        if done and self._entries is not None and self._tracer._cuda is None:
            entries, self._entries = self._entries, None
            self._tracer._finish(entries)
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)

    def __repr__(self) -> str:
        return f"TimedWork({self._work!r})"


class P2PWrapper:
    """isend/irecv stand-in that compares equal to the function it wraps.

    ``P2POp(op, ...)`` accepts only ``op in [isend, irecv]`` of c10d's own module, and
    Megatron builds ``P2POp(torch.distributed.isend, ...)``: equality (not identity) lets
    our wrapper through. ``batch_isend_irecv`` then tells sends from receives by
    identity, so our batch wrapper puts the unwrapped function back into each P2POp.
    """

    def __init__(self, traced: Callable[..., Any], wrapped: Any, base: Any) -> None:
        self._call = traced
        self.__wrapped__ = wrapped
        #: c10d's own function, the one P2POp and batch_isend_irecv compare against
        self._base = base
        self.__name__ = getattr(wrapped, "__name__", "p2p")
        self.__qualname__ = getattr(wrapped, "__qualname__", self.__name__)
        self.__doc__ = getattr(wrapped, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __eq__(self, other: object) -> bool:
        return other is self or other is self.__wrapped__ or other is self._base

    def __hash__(self) -> int:
        return hash(self._base)

    def __repr__(self) -> str:
        return f"<traced {self.__name__}>"


def reaches(fn: Any, target: Any) -> bool:
    """Is ``fn`` the ``target`` function or a wrapper (``__wrapped__`` chain) around it?

    Not "unwrap to the innermost": c10d's own collectives are themselves decorated, and
    c10d compares against the decorated module attribute.
    """
    for _ in range(16):
        if fn is target:
            return True
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return False
    return False


def collective_wrapper(
    tracer: CallTracer, spec: OpSpec, orig: Callable[..., Any]
) -> Callable[..., Any]:
    """The traced ``orig``; its twin that runs on sampled entries times ``orig`` apart."""
    sampled = _collective_traced(tracer, spec, tracer.cost.timed(orig), None)
    return _collective_traced(tracer, spec, orig, sampled)


def _collective_traced(tracer: CallTracer, spec: OpSpec, orig: Callable[..., Any],
                       sampled: Callable[..., Any] | None) -> Callable[..., Any]:
    """Records one call; ``sampled``: the twin a timed entry runs (None: this is it)."""
    trap, clock, track, cuda, cost = tracer.trap, tracer._clock, tracer._track, tracer._cuda, tracer.cost
    run = cost.run
    op, tpos, tkw, many = spec.op, spec.tensor_pos, spec.tensor_kw, spec.many
    gpos, apos = spec.group_pos, spec.async_pos

    def traced(*args: Any, **kwargs: Any) -> Any:
        if trap.armed:
            trap._hold()
        if sampled is not None:
            cost.left -= 1
            if cost.left <= 0:
                return run(sampled, args, kwargs)
        ev0 = cuda.record() if cuda is not None else None
        t_issue = clock()
        out = orig(*args, **kwargs)
        t_ret = clock()
        try:
            n = len(args)
            if tpos is None:
                nbytes = 0
            else:
                t = args[tpos] if n > tpos else kwargs[tkw]
                nbytes = sum(x.nbytes for x in t) if many else t.nbytes
            group = args[gpos] if n > gpos else kwargs.get("group")
            is_async = args[apos] if n > apos else kwargs.get("async_op", False)
            return track(op, group, nbytes, None, None, t_issue, t_ret, out, is_async, ev0)
        except Exception:
            tracer._fail()
            return out

    functools.update_wrapper(traced, orig)
    return traced


def p2p_wrapper(tracer: CallTracer, name: str, op: str, peer_kw: str, gpeer_kw: str,
                 is_async: bool, orig: Callable[..., Any]) -> Callable[..., Any]:
    """The traced ``orig``; its twin that runs on sampled entries times ``orig`` apart."""
    sampled = _p2p_traced(tracer, name, op, peer_kw, gpeer_kw, is_async, tracer.cost.timed(orig), None)
    return _p2p_traced(tracer, name, op, peer_kw, gpeer_kw, is_async, orig, sampled)


def _p2p_traced(tracer: CallTracer, name: str, op: str, peer_kw: str, gpeer_kw: str, is_async: bool,
                orig: Callable[..., Any], sampled: Callable[..., Any] | None) -> Callable[..., Any]:
    """Records one call; ``sampled``: the twin a timed entry runs (None: this is it)."""
    trap, clock, track, cuda, cost = tracer.trap, tracer._clock, tracer._track, tracer._cuda, tracer.cost
    run = cost.run
    # c10d's own batch_isend_irecv, handed a P2POp holding this wrapper, mistakes the send
    # for a receive and passes ``group_src``: translate instead of failing
    fix_src = name == "isend"
    sync_recv = name == "recv"

    def traced(*args: Any, **kwargs: Any) -> Any:
        if trap.armed:
            trap._hold()
        if sampled is not None:
            cost.left -= 1
            if cost.left <= 0:
                return run(sampled, args, kwargs)
        if fix_src and "group_src" in kwargs:
            kwargs["group_dst"] = kwargs.pop("group_src")
        ev0 = cuda.record() if cuda is not None else None
        t_issue = clock()
        out = orig(*args, **kwargs)
        t_ret = clock()
        try:
            n = len(args)
            tensor = args[0] if n else kwargs["tensor"]
            group = args[2] if n > 2 else kwargs.get("group")
            peer = args[1] if n > 1 else kwargs.get(peer_kw)
            gpeer = kwargs.get(gpeer_kw) if peer is None else None
            if sync_recv and peer is None and type(out) is int:
                peer = out  # recv from any source returns the sender
            return track(op, group, tensor.nbytes, peer, gpeer, t_issue, t_ret, out, is_async, ev0)
        except Exception:
            tracer._fail()
            return out

    functools.update_wrapper(traced, orig)
    return traced


def batch_wrapper(tracer: CallTracer, orig: Callable[..., Any]) -> Callable[..., Any]:
    """The traced ``orig``; its twin that runs on sampled entries times ``orig`` apart."""
    sampled = _batch_traced(tracer, tracer.cost.timed(orig), None)
    return _batch_traced(tracer, orig, sampled)


def _batch_traced(tracer: CallTracer, orig: Callable[..., Any],
                  sampled: Callable[..., Any] | None) -> Callable[..., Any]:
    """Records one batch; ``sampled``: the twin a timed entry runs (None: this is it)."""
    trap, clock, cuda, cost = tracer.trap, tracer._clock, tracer._cuda, tracer.cost
    run = cost.run

    def traced(p2p_op_list: Any) -> Any:
        if trap.armed:
            trap._hold()
        if sampled is not None:
            cost.left -= 1
            if cost.left <= 0:
                return run(sampled, (p2p_op_list,), {})
        evs = None
        try:
            for p in p2p_op_list:
                fn = getattr(p, "op", None)
                if isinstance(fn, P2PWrapper):
                    p.op = fn._base  # c10d compares with ``is`` against its own isend
            if cuda is not None:
                evs = [cuda.record() for _ in p2p_op_list]
        except TypeError:
            pass  # not a list: the original rejects it with its own message
        t_issue = clock()
        works = orig(p2p_op_list)
        t_ret = clock()
        try:
            return tracer._track_batch(p2p_op_list, works, t_issue, t_ret, evs)
        except Exception:
            tracer._fail()
            return works

    functools.update_wrapper(traced, orig)
    return traced


def coalescing_wrapper(tracer: CallTracer, orig: Callable[..., Any]) -> Callable[..., Any]:
    """``_coalescing_manager`` that tells the tracer when its queued calls really ran."""

    cost = tracer.cost
    cpu = time.thread_time

    @contextlib.contextmanager
    def traced(group: Any = None, device: Any = None, async_ops: bool = False) -> Any:
        # lazy: start-up time (falconext.trace is torch-free: the CLI imports it)
        from torch.distributed import distributed_c10d as c10d

        cost.left -= 1
        timed = cost.left <= 0 and not cost._busy  # sampled: our code before and after, timed
        if timed:
            cost.restart()  # the calls queued inside are entries of their own
        t0 = cpu() if timed else 0.0
        pg = group if group is not None else c10d._get_default_group()
        entries: list[list] = []
        tracer._open_batches[pg] = entries
        spent = cpu() - t0 if timed else 0.0
        try:
            with orig(group, device, async_ops) as cm:
                yield cm
        finally:
            t1 = cpu() if timed else 0.0
            tracer._open_batches.pop(pg, None)
        if entries:
            try:
                tracer._close_batch(entries, cm, async_ops)
            except Exception:
                tracer._fail()
        if timed:
            cost.add_sample(spent + cpu() - t1)

    functools.update_wrapper(traced, orig)
    return traced
