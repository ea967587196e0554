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
