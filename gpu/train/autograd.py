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

from gpu.train.step import Trainer, sum_by_key


class Lookup(torch.autograd.Function):
    """``Lookup.apply(weight, keys, read, trainer)``: ``read(keys)`` rows ``[N, dim]``."""

    @staticmethod
    def forward(weight: torch.Tensor, keys: torch.Tensor, read: Any,  # noqa: ARG004
                trainer: Trainer) -> torch.Tensor:
        return read(keys)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        weight, keys, _, trainer = inputs
        ctx.save_for_backward(keys)
        ctx.trainer = trainer
        ctx.weight_meta = (weight.shape, weight.device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (keys,) = ctx.saved_tensors
        trainer: Trainer = ctx.trainer
        if trainer.optimizer is not None:
            trainer.fused(keys, grad)
            return None, None, None, None
        uniq, summed = sum_by_key(keys, grad)
        shape, device = ctx.weight_meta
        sparse = torch.sparse_coo_tensor(
            uniq.unsqueeze(0).to(device), summed.to(trainer.dtype).to(device), shape,
            is_coalesced=True, check_invariants=False)
        trainer.last_grad = sparse._indices().data_ptr()
        return sparse, None, None, None
