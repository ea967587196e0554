"""Megatron-LM's own training code on a machine without CUDA (gloo, CPU tensors).

:mod:`falconext.emulation.cpu_compat` makes megatron-core's schedules run on CPU. Megatron-LM's
``megatron.training`` asks for more before its first iteration: ``torch.cuda`` calls at
start-up (``set_device``, ``device_count``, streams, events, RNG state for checkpoints),
``initialize_megatron`` asserting CUDA unless told ``allow_no_cuda``, fused-kernel and
dataset-helper builds, and a triton-only module on the import path. :func:`enable` answers
each of those with the CPU equivalent, before the training script is imported, and
:func:`script_flags` names the Megatron-LM flags a CPU run needs.

Only the placement and the start-up checks change; the model, the schedules, the optimizer
and the losses are Megatron-LM's own.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any

import torch

from falconext.emulation import cpu_compat

#: Megatron-LM flags a CPU run needs, with their values (None: a switch), added unless the
#: user gave them: local layers (no Transformer Engine), no fused CUDA kernels, no gradient
#: clipping (its multi-tensor kernels are CUDA-only), no rerun state machine, gloo
CPU_FLAGS: dict[str, str | None] = {
    "--transformer-impl": "local",
    "--distributed-backend": "gloo",
    "--clip-grad": "0",
    "--rerun-mode": "disabled",
    "--no-gradient-accumulation-fusion": None,
    "--no-bias-gelu-fusion": None,
    "--no-bias-dropout-fusion": None,
    "--no-masked-softmax-fusion": None,
    "--no-bias-swiglu-fusion": None,
    "--no-rope-fusion": None,
    "--no-persist-layer-norm": None,
}

#: what a flag's negation or alternative looks like, so a user's own choice is kept
_SAME_SETTING = {"--no-gradient-accumulation-fusion": ("--gradient-accumulation-fusion",)}


def script_flags(argv: list[str]) -> list[str]:
    """``argv`` with the CPU flags added that the user did not give (their values win)."""
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    out = list(argv)
    for flag, value in CPU_FLAGS.items():
        if flag in given or any(alt in given for alt in _SAME_SETTING.get(flag, ())):
            continue
        out += [flag] if value is None else [flag, value]
    return out


_saved: dict[str, Any] = {}


def enable() -> None:
    """Make this process able to run Megatron-LM's training code on CPU (idempotent).

    Must run before the training script imports ``megatron.training``.
    """
    if _saved:
        return

    cpu_compat.enable()
    cuda = torch.cuda
    names = ("set_device", "device_count", "get_rng_state", "set_rng_state", "empty_cache", "memory_allocated",
             "max_memory_allocated", "memory_reserved", "max_memory_reserved", "reset_peak_memory_stats",
             "get_device_name", "get_device_capability")
    _saved.update({n: getattr(cuda, n, None) for n in names})
    cuda.set_device = lambda *a, **k: None
    # one (emulated) device per process: Megatron builds its model-parallel groups only
    # when it sees a device
    cuda.device_count = lambda: 1
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: None
    cuda.empty_cache = lambda: None
    for n in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(cuda, n, lambda *a, **k: 0)
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    cuda.get_device_name = lambda *a, **k: "cpu"
    cuda.get_device_capability = lambda *a, **k: (0, 0)
    _stub_triton_only_modules()
    _patch_megatron_package()


def _stub_triton_only_modules() -> None:
    """The batch-invariant kernels module imports triton at import time; Megatron-LM's
    initialize imports one name from it, used only with ``--batch-invariant-mode``."""
    name = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
    try:
        import triton  # noqa: F401  # lazy: optional dependency (triton)
        return
    except ImportError:
        pass
    if name in sys.modules:
        return
    mod = types.ModuleType(name)
    mod.__doc__ = "falconext CPU stand-in: batch-invariant mode needs triton"

    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("--batch-invariant-mode needs triton and CUDA; not available on this machine")

    mod.enable_batch_invariant_mode = unavailable  # type: ignore[attr-defined]
    mod.disable_batch_invariant_mode = unavailable  # type: ignore[attr-defined]
    mod.is_batch_invariant_mode_enabled = lambda: False  # type: ignore[attr-defined]
    sys.modules[name] = mod


def _patch_megatron_package() -> None:
    """``model_parallel_cuda_manual_seed`` is re-exported by ``megatron.core.tensor_parallel``:
    the CPU seed goes there too (cpu_compat patched the defining module)."""
    # lazy: run-time order (after cpu_compat.enable imported megatron-core)
    import megatron.core.tensor_parallel as tp
    from megatron.core.tensor_parallel import random as mrandom

    tp.model_parallel_cuda_manual_seed = mrandom.model_parallel_cuda_manual_seed
    # Megatron-LM's checkpoint loader refuses an empty RNG-tracker state ("Unable to load
    # rng state"); on CPU the tracker tracks nothing (one CPU stream), so it reports that
    get_states = mrandom.CudaRNGStatesTracker.get_states

    def states(self: Any) -> dict:
        return get_states(self) or {CPU_RNG_STATE: torch.get_rng_state()}

    mrandom.CudaRNGStatesTracker.get_states = states  # type: ignore[method-assign]


#: the RNG-tracker state a CPU rank saves in Megatron-LM's checkpoints
CPU_RNG_STATE = "cpu-rng"


def patch_training_modules() -> None:
    """Once ``megatron.training`` is importable: no CUDA assertion, no kernel builds.

    ``initialize_megatron`` is looked up in ``megatron.training.training`` when ``pretrain``
    runs, so the wrapper there takes effect; the fused kernels are unused on CPU (the
    dataset helpers: ``rank.use_compiled_helpers``, on either device).
    """
    # lazy: run-time order (megatron.training: once the script's folder is on sys.path)
    import megatron.training.initialize as init
    import megatron.training.training as training

    try:  # Megatron-LM before core_v0.19 builds its fused kernels at start-up
        # lazy: run-time order (megatron.legacy: once the script's folder is on sys.path)
        import megatron.legacy.fused_kernels as fk
    except ImportError:  # core_v0.19 and later: no legacy package, nothing to build
        pass
    else:
        fk.load = lambda args: None
    original = init.initialize_megatron

    @functools.wraps(original)
    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    init.initialize_megatron = initialize_megatron
    training.initialize_megatron = initialize_megatron
