"""What falconext relies on in Megatron-LM, checked before anything is replaced.

Without a patch, falconext runs inside Megatron-LM by putting wrappers in place of a few
names that ``pretrain()`` and ``train()`` look up when they run. Each name, and the
parameters falconext calls it with, is listed in :data:`HOOK_POINTS`; :func:`check` reads
them all and returns every mismatch, so a Megatron-LM whose hook points changed is
refused as a whole (naming its version and the first mismatch), never half-patched.
:func:`s2_refusal` says why a job's settings would make S2 inexact.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
from dataclasses import dataclass
from typing import Any

#: Megatron-LM versions whose hook points were run for real with the launcher (docs/megatron-lm.md's
#: version table): core_v0.16.1 on Python 3.11, core_v0.19.0 (megatron-core 0.19.2) and main of
#: 2026-08-22 (its own megatron/core 0.20.0) on Python 3.12
RUN_TESTED = ("core_v0.16.1", "core_v0.19.x", "main (core_v0.20.0)")


@dataclass(frozen=True)
class HookPoint:
    """``module.name`` must exist, be callable, and take these parameters (in order)."""

    module: str
    name: str
    params: tuple[str, ...] = ()
    #: parameters that must be accepted, anywhere in the signature
    accepts: tuple[str, ...] = ()


HOOK_POINTS: tuple[HookPoint, ...] = (
    HookPoint("megatron.training.training", "get_forward_backward_func"),
    HookPoint("megatron.training.training", "build_pretraining_data_loader", ("dataset", "consumed_samples")),
    HookPoint("megatron.training.training", "initialize_megatron", accepts=("allow_no_cuda",)),
    HookPoint("megatron.training.training", "train_step", accepts=("forward_step_func", "forward_backward_func")),
    HookPoint("megatron.training.ft_integration", "on_training_step_start", ()),
    HookPoint("megatron.training.ft_integration", "on_training_step_end", ()),
    HookPoint("megatron.training.global_vars", "get_args", ()),
    HookPoint("megatron.training.datasets.data_samplers", "MegatronPretrainingSampler",
              accepts=("total_samples", "consumed_samples", "micro_batch_size", "data_parallel_rank")),
    HookPoint("megatron.core.pipeline_parallel", "get_forward_backward_func"),
)


class MegatronLMChanged(RuntimeError):
    """Megatron-LM's hook points are not what falconext was built against."""


def megatron_version() -> str:
    """``core_vX.Y.Z`` of the Megatron-LM being imported ("unknown" if unreadable)."""
    try:
        # lazy: run-time order (the Megatron-LM being imported: its checkout on sys.path)
        from megatron.core import package_info

        return "core_v" + package_info.__version__
    except Exception:
        return "unknown"


def problems(points: tuple[HookPoint, ...] = HOOK_POINTS) -> list[str]:
    """Every hook point that is missing or whose parameters changed (empty: all hold)."""
    found: list[str] = []
    for hp in points:
        where = f"{hp.module}.{hp.name}"
        try:
            obj = getattr(importlib.import_module(hp.module), hp.name)
        except (ImportError, AttributeError) as exc:
            found.append(f"{where} is missing ({exc.__class__.__name__})")
            continue
        if not callable(obj):
            found.append(f"{where} is not callable")
            continue
        try:
            sig = inspect.signature(obj)
        except (TypeError, ValueError):
            continue
        names = [p.name for p in sig.parameters.values() if p.name != "self"]
        if tuple(names[: len(hp.params)]) != hp.params:
            found.append(f"{where} takes ({', '.join(names)}), falconext expects ({', '.join(hp.params)})")
            continue
        missing = [a for a in hp.accepts if a not in names]
        if missing:
            found.append(f"{where} no longer takes {', '.join(missing)}")
    return found


def check() -> None:
    """Raise :class:`MegatronLMChanged` (one line) unless every hook point holds."""
    found = problems()
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise MegatronLMChanged(
            f"Megatron-LM {megatron_version()} is not supported by this falconext: {found[0]}{more}; "
            f"supported: {', '.join(RUN_TESTED)} (patches/megatron-lm for others)")


def s2_refusal(args: argparse.Namespace | Any) -> str | None:
    """Why S2 (uneven micro-batches per DP replica) could not be exact with these
    Megatron-LM settings, or None when it can."""
    if not getattr(args, "calculate_per_token_loss", False):
        return ("S2 needs --calculate-per-token-loss: without it each replica averages its loss over its own "
                "micro-batches, and an uneven plan would change the gradient")
    kind = getattr(args, "dataloader_type", "single")
    if kind not in (None, "single"):
        return f"S2 needs --dataloader-type single (got {kind}): it plans the samples of each global batch"
    if getattr(args, "rampup_batch_size", None):
        return "S2 cannot plan under --rampup-batch-size: the global batch changes while it ramps up"
    scope = getattr(args, "cuda_graph_scope", None) or []
    if getattr(args, "cuda_graph_impl", "none") == "local" and any("full_iteration" in str(s) for s in scope):
        return "S2 cannot change a full-iteration CUDA graph's micro-batch count"
    if getattr(args, "virtual_pipeline_model_parallel_size", None):
        return ("S2 does not plan interleaved pipeline schedules: each replica's micro-batch count must stay a "
                "multiple of the pipeline size there")
    if getattr(args, "hybrid_context_parallel", False):
        return ("S2 does not compose with hybrid context parallelism's scheduler: it already gives each DP rank "
                "its own micro-batch count (Megatron-LM's data_schedule)")
    if getattr(args, "rl_use_sequence_packing", False):
        return ("S2 does not compose with --rl-use-sequence-packing: the packer gives each DP rank its own "
                "micro-batch count")
    return None
