"""The lookup as an autograd function: rows out, the batch's gradient back to the layer's
:class:`~gpu.train.step.Trainer` (a fused optimizer's step) or to ``layer.weight`` as a
coalesced sparse gradient.

Pooling (sum, mean, max, per-sample weights) is torch's ``embedding_bag`` over the rows
this function returns, so its backward (bags expanded by offsets, mean divided, max routed
to the winning row, the weights' own gradient) is torch's kernel on each device; this
function then sums the rows' gradients per unique key.
"""

from __future__ import annotations

from typing import Any

import torch

from gpu.train.step import Trainer


class Lookup(torch.autograd.Function):
    """``Lookup.apply(weight, keys, read, trainer)``: ``read(keys)`` rows ``[N, dim]``."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, keys: torch.Tensor, read: Any,  # noqa: ARG004
                trainer: Trainer) -> torch.Tensor:
        # NOTE: forward with ctx, no setup_context: Function.apply binds a setup_context
        # function's signature on every call (inspect.signature: ~40 us a step)
        ctx.save_for_backward(keys)
        ctx.trainer = trainer
        return read(keys)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (keys,) = ctx.saved_tensors
        trainer: Trainer = ctx.trainer
        if trainer.optimizer is not None:
            trainer.fused(keys, grad)
            return None, None, None, None
        return trainer.sparse_grad(keys, grad), None, None, None
