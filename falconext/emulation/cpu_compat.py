"""Run megatron-core's real training code on CPU with gloo (the test bed), and nothing more.

megatron-core targets GPUs: its pipeline schedules and P2P code create tensors with
``device="cuda"`` / ``torch.cuda.current_device()``, call ``torch.cuda.synchronize``, and
its tensor-parallel RNG tracker saves and restores CUDA RNG states. None of that is
essential to what the schedules compute, so on CPU (and only there: ``--device cpu``):

- a ``TorchFunctionMode`` rewrites CUDA device arguments (``"cuda"``, ``"cuda:N"``, a CUDA
  ``torch.device``, or a bare device index) to CPU, and makes ``Tensor.cuda()`` a no-op;
- ``torch.cuda.current_device`` answers 0 and ``synchronize`` does nothing; streams and
  events are one in-order CPU stream (:class:`CpuStream`) and host-time marks
  (:class:`CpuEvent`): megatron-core 0.19's gradient sync asks for the current stream;
- the RNG tracker's ``fork()`` becomes a plain context (one CPU RNG stream), and seeding
  seeds the CPU generator.

Everything else runs unmodified. ``enable()`` is idempotent; ``disable()`` undoes it.

``enable()`` imports megatron-core itself when nothing has yet (:func:`import_megatron_core`),
without compiling the few fusion kernels it decorates with ``torch.compile`` at import
time: on CPU they are never called with this layer's configuration, and preparing them
costs each rank 1.2 s of CPU (torch's dynamo and inductor) before its first iteration.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA placement requests to CPU for every torch function and tensor method."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = _CPU
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


#: torch functions that create tensors (the only ones that take a device)
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "rand", "randn", "randint",
              "randperm", "linspace", "eye", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like",
              "randn_like", "randint_like", "empty_strided", "tril_indices", "triu_indices")
_NEW_METHODS = ("new_zeros", "new_ones", "new_empty", "new_full", "new_tensor")


def _on_cpu(fn: Any) -> Any:
    """``fn`` with a CUDA ``device=`` keyword replaced by the CPU."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if device is not None and _is_cuda(device):
            kwargs["device"] = _CPU
        return fn(*args, **kwargs)

    return call


def _to_on_cpu(to: Any) -> Any:
    """``Tensor.to`` with a CUDA device (positional or keyword) replaced by the CPU."""

    @functools.wraps(to)
    def call(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args and _is_cuda(args[0]):
            args = (_CPU, *args[1:])
        device = kwargs.get("device")
        if device is not None and _is_cuda(device):
            kwargs["device"] = _CPU
        return to(self, *args, **kwargs)

    return call


class _Factories:
    """The fast way to the same end as :class:`_CudaToCpu`: only the calls that take a
    device (tensor factories, ``Tensor.to``, ``Tensor.new_*``, ``Tensor.cuda``) are
    wrapped, instead of every torch call passing through a mode (600 per micro-batch
    there, about a third of a test-bed rank's CPU)."""

    def __init__(self) -> None:
        self.saved: list[tuple[Any, str, Any]] = []

    def _swap(self, owner: Any, name: str, new: Any) -> None:
        self.saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    def __enter__(self) -> "_Factories":
        for name in _FACTORIES:
            if hasattr(torch, name):
                self._swap(torch, name, _on_cpu(getattr(torch, name)))
        for name in _NEW_METHODS:
            self._swap(torch.Tensor, name, _on_cpu(getattr(torch.Tensor, name)))
        self._swap(torch.Tensor, "to", _to_on_cpu(torch.Tensor.to))
        self._swap(torch.Tensor, "cuda", lambda self, *a, **k: self)
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, old in reversed(self.saved):
            setattr(owner, name, old)
        self.saved.clear()


_state: dict[str, Any] = {}


def _no_compile(model: Any = None, **_: Any) -> Any:
    """``torch.compile`` while megatron-core is imported: the function, unchanged (also
    in the decorator-factory form ``torch.compile(**options)``)."""
    return model if model is not None else (lambda fn: fn)


def import_megatron_core() -> None:
    """Import megatron-core with ``torch.compile`` a no-op during the import only, so the
    functions it decorates at import time (its ``jit_fuser``) stay plain Python: same
    results, and no dynamo/inductor import. Nothing is done when megatron-core is already
    imported; ``torch.compile`` is restored whatever the import raises."""
    if "megatron.core" in sys.modules:
        return
    compile_ = torch.compile
    torch.compile = _no_compile  # type: ignore[assignment]
    try:
        import megatron.core  # noqa: F401  # lazy: run-time order (megatron-core with torch.compile off)
    finally:
        torch.compile = compile_  # type: ignore[assignment]


class CpuStream:
    """``torch.cuda.Stream`` on CPU: one in-order stream, nothing to wait for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        """Nothing to wait for: one in-order stream."""

    def wait_event(self, event: Any) -> None:
        """Nothing to wait for: events are recorded when reached."""

    def synchronize(self) -> None:
        """Nothing outstanding on CPU."""

    def record_event(self, event: Any = None) -> "CpuEvent":
        """``event`` (a new :class:`CpuEvent` when None), as recorded on this stream."""
        return event or CpuEvent()

    def __enter__(self) -> "CpuStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class CpuEvent:
    """``torch.cuda.Event`` on CPU: records host time."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._t = 0.0

    def record(self, stream: Any = None) -> None:
        """Mark the host time now."""
        self._t = time.perf_counter()

    def synchronize(self) -> None:
        """Nothing outstanding on CPU."""

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for on CPU."""

    def query(self) -> bool:
        """Always complete."""
        return True

    def elapsed_time(self, end: "CpuEvent") -> float:
        """Milliseconds of host time from this mark to ``end``'s."""
        return (end._t - self._t) * 1000.0


#: the ``torch.cuda`` names :func:`enable` stands in for with :class:`CpuStream` and :class:`CpuEvent`
STREAM_NAMES = ("Stream", "Event", "current_stream", "default_stream", "stream", "set_stream")


def enable(fast: bool = False) -> None:
    """Apply the CPU compatibility layer to this process (idempotent); imports
    megatron-core first if nothing has (:func:`import_megatron_core`). ``fast``: rewrite
    CUDA placements only where tensors are made (:class:`_Factories`, what the test bed's
    trainer needs); otherwise a mode sees every torch call (:class:`_CudaToCpu`, for code
    such as Megatron-LM's training loop that may place tensors in ways nobody listed)."""
    if _state:
        return
    import_megatron_core()
    from megatron.core.tensor_parallel import random as mrandom  # lazy: run-time order (after import_megatron_core)

    mode = _Factories() if fast else _CudaToCpu()
    mode.__enter__()
    saved = {
        "mode": mode,
        "current_device": torch.cuda.current_device,
        "synchronize": torch.cuda.synchronize,
        "fork": mrandom.CudaRNGStatesTracker.fork,
        "add": mrandom.CudaRNGStatesTracker.add,
        "manual_seed": mrandom.model_parallel_cuda_manual_seed,
        "streams": {n: getattr(torch.cuda, n, None) for n in STREAM_NAMES},
    }
    torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    shared = CpuStream()
    torch.cuda.Stream = CpuStream  # type: ignore[assignment,misc]
    torch.cuda.Event = CpuEvent  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda *a, **k: shared  # type: ignore[assignment]
    torch.cuda.default_stream = lambda *a, **k: shared  # type: ignore[assignment]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.set_stream = lambda *a, **k: None  # type: ignore[assignment]

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):  # noqa: ARG001 - same signature
        yield

    def add(self, name: str, seed: int) -> None:  # noqa: ARG001
        self.states_[name] = None
        self.seeds_.add(seed)

    def manual_seed(seed: int, *args: Any, **kwargs: Any) -> None:  # noqa: ARG001
        torch.manual_seed(seed)

    mrandom.CudaRNGStatesTracker.fork = fork  # type: ignore[method-assign]
    mrandom.CudaRNGStatesTracker.add = add  # type: ignore[method-assign]
    mrandom.model_parallel_cuda_manual_seed = manual_seed  # type: ignore[assignment]
    _state.update(saved)


def disable() -> None:
    """Undo :func:`enable` (tests use it to leave the process as they found it)."""
    if not _state:
        return
    from megatron.core.tensor_parallel import random as mrandom  # lazy: run-time order (after import_megatron_core)

    _state["mode"].__exit__(None, None, None)
    torch.cuda.current_device = _state["current_device"]  # type: ignore[assignment]
    torch.cuda.synchronize = _state["synchronize"]  # type: ignore[assignment]
    for name, value in _state["streams"].items():
        setattr(torch.cuda, name, value)
    mrandom.CudaRNGStatesTracker.fork = _state["fork"]  # type: ignore[method-assign]
    mrandom.CudaRNGStatesTracker.add = _state["add"]  # type: ignore[method-assign]
    mrandom.model_parallel_cuda_manual_seed = _state["manual_seed"]  # type: ignore[assignment]
    _state.clear()


def enabled() -> bool:
    """True while the CPU stand-ins are installed (between :func:`enable` and :func:`disable`)."""
    return bool(_state)
