"""Marks in a model's autograd graph: identity in the forward, a callback when the
backward pass reaches them. The fault injector and the emulated device use them to find
where a micro-batch's backward starts (at the model's output) and where its pass through
the transformer layers ends (at their input)."""

from __future__ import annotations

from typing import Callable

import torch


class _OnBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn):  # type: ignore[override]
        ctx.fn = fn
        # a copy, not a view: megatron-core's pipeline schedule frees each stage's output
        # in place once sent (deallocate_output_tensor) and refuses a view of another tensor
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.fn()
        return grad, None


def on_backward(x: torch.Tensor, fn: Callable[[], None]) -> torch.Tensor:
    """``x``'s values (a copy); ``fn()`` runs when the backward reaches this point,
    before the gradient flows on."""
    return _OnBackward.apply(x, fn)


def _layers_input(layers: torch.nn.Module, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The tensor megatron-core's transformer block will read as its input in this
    forward, if it needs a gradient. The first pipeline stage's block gets it as
    ``hidden_states``; a later stage's block ignores that argument and reads the tensor
    received from the previous stage, which the schedule hands over with
    ``set_input_tensor`` (``layers.input_tensor``)."""
    if getattr(layers, "pre_process", True):
        x = kwargs.get("hidden_states", args[0] if args else None)
    else:
        x = getattr(layers, "input_tensor", None)
    return x if isinstance(x, torch.Tensor) and x.requires_grad else None


def marks_layers_input(layers: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether :func:`mark_layers_input` would place a mark for this forward."""
    return _layers_input(layers, args, kwargs) is not None


def mark_layers_input(layers: torch.nn.Module, args: tuple, kwargs: dict, fn: Callable[[], None]):
    """In a forward pre-hook (``with_kwargs=True``) of megatron-core's transformer block:
    put an :func:`on_backward` mark on the block's input (:func:`_layers_input`), so
    ``fn()`` runs when the backward has passed through every layer. Returns what the hook
    returns: new ``(args, kwargs)``, or None when nothing had to be replaced in them (a
    later stage's received tensor is marked in place). ``fn`` is not called at all when
    the input needs no gradient (a forward-only pass)."""
    x = _layers_input(layers, args, kwargs)
    if x is None:
        return None
    marked = on_backward(x, fn)
    if not getattr(layers, "pre_process", True):
        layers.input_tensor = marked
        return None
    if "hidden_states" in kwargs:
        return args, dict(kwargs, hidden_states=marked)
    return (marked, *args[1:]), kwargs
