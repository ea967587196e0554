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
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.fn()
        return grad, None


def on_backward(x: torch.Tensor, fn: Callable[[], None]) -> torch.Tensor:
    """``x`` unchanged (a view); ``fn()`` runs when the backward reaches this point,
    before the gradient flows on."""
    return _OnBackward.apply(x, fn)


def mark_layers_input(layers: torch.nn.Module, args: tuple, kwargs: dict, fn: Callable[[], None]):
    """In a forward pre-hook (``with_kwargs=True``) of megatron-core's transformer block:
    put an :func:`on_backward` mark on the block's input, so ``fn()`` runs when the
    backward has passed through every layer. Returns what the hook returns: new
    ``(args, kwargs)``, or None when nothing had to be replaced in them.

    The first pipeline stage's block gets its input as ``hidden_states``; a later stage's
    block ignores that argument and reads the tensor received from the previous stage,
    which the schedule hands over with ``set_input_tensor`` (``layers.input_tensor``): that
    one is marked in place. ``fn`` is not called at all when the input needs no gradient
    (a forward-only pass)."""
    if not getattr(layers, "pre_process", True):
        inp = getattr(layers, "input_tensor", None)
        if isinstance(inp, torch.Tensor) and inp.requires_grad:
            layers.input_tensor = on_backward(inp, fn)
        return None
    hs = kwargs.get("hidden_states", args[0] if args else None)
    if not isinstance(hs, torch.Tensor) or not hs.requires_grad:
        return None
    hs = on_backward(hs, fn)
    if "hidden_states" in kwargs:
        return args, dict(kwargs, hidden_states=hs)
    return (hs, *args[1:]), kwargs


def marks_layers_input(layers: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether :func:`mark_layers_input` would place a mark for this forward."""
    if not getattr(layers, "pre_process", True):
        inp = getattr(layers, "input_tensor", None)
        return isinstance(inp, torch.Tensor) and inp.requires_grad
    hs = kwargs.get("hidden_states", args[0] if args else None)
    return isinstance(hs, torch.Tensor) and hs.requires_grad
