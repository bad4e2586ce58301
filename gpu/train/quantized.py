"""Training over quantized tables (int8, float8_e4m3fn: :mod:`nvecache.common.quant`): which
optimizers may, and the deltas a step writes.

A quantized table stores each row as one-byte elements and per-row parameters. A training
layer reads its rows dequantized, as every lookup does (``layer.weight`` then stands for
the table as one zero broadcast to its shape: the stored bytes are not float rows), and
writes each step as float32 deltas through the table's ``accumulate``: the row decoded,
the delta added in float32 and the sum encoded with stochastic rounding
(:func:`nvecache.common.quant.encode_sum`). Unbiased, so steps smaller than half a
quantization step still move the rows on average, where rounding to nearest would drop
every one of them; a row after a step is within one quantization step of the same step
taken in float32 on the dequantized row (``quant.error_bound(..., stochastic=True)``).

The stateless optimizers train over them: a torch optimizer on ``layer.weight``'s sparse
gradient (``torch.optim.SGD``) and :class:`gpu.optim.SGD`. The stateful fused optimizers
(Adagrad, RowwiseAdagrad, Adam) keep their float32 state beside each row, as extra
elements of the stored row (:mod:`gpu.train.wide`): in a quantized table the state would
be quantized with the row, under the row's one scale, and Adagrad's growing sums or Adam's
moments would decide the weights' step size. They are refused with
:class:`~gpu.errors.BadArgumentError` (:func:`check_optimizer`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from gpu.errors import BadArgumentError
from gpu.optim.rules import Optimizer
from gpu.stacks.closed import close_all
from nvecache.common.rows import RowFormat


def is_quantized(table: Any) -> bool:
    """Whether ``table`` (any of a layer's tables, a GPULayer's own ``RowFormat``, or None)
    stores quantized rows: each of them says so in its ``quantized``."""
    return bool(getattr(table, "quantized", False))


def refusal(optimizer: Optimizer, table: Any = None) -> BadArgumentError:
    """The error refusing a stateful fused ``optimizer`` over a quantized table."""
    what = f" {type(table).__name__}" if table is not None else ""
    name = getattr(table, "table", None) or getattr(table, "name", None)
    named = f" {name!r}" if isinstance(name, str) else ""
    row_format = getattr(getattr(table, "geometry", None), "row_format", None)
    dtype = getattr(row_format, "dtype", None) or getattr(table, "dtype", None)
    fmt = f" ({str(dtype).removeprefix('torch.')})" if dtype is not None else ""
    if isinstance(table, RowFormat):  # NOTE: a GPULayer's own table (weight_dtype=)
        what, named, fmt = " own table of the layer", "", f" (weight_dtype={table.dtype})"
    return BadArgumentError(
        f"{type(optimizer).__name__} cannot train over the quantized{what}{named}{fmt}: it "
        "keeps float32 state beside each row, as extra elements of the stored row, which a "
        "quantized table would quantize with the row under its one scale. Train a "
        "quantized table with a stateless optimizer (gpu.optim.SGD, or torch.optim.SGD on "
        "layer.weight), or train over a float32 table and load its rows into a quantized "
        "one afterwards (psclient load --dtype int8, SharedMemBlock.write)")


def check_optimizer(optimizer: Optimizer | None, tables: Iterable[Any]) -> None:
    """Refuse a stateful fused ``optimizer`` (one with state columns) over any quantized
    one of ``tables``; a stateless one (None: a torch optimizer; :class:`gpu.optim.SGD`,
    whose ``state_cols`` are 0) trains over any.

    Raises:
        BadArgumentError: what to do instead (:func:`refusal`); nothing was opened.
    """
    if optimizer is None or optimizer.state_cols(1) == 0:
        return
    for table in tables:
        if is_quantized(table):
            raise refusal(optimizer, table)


def build_error(error: Exception, optimizer: Optimizer | None, dim: int,
                dtype: torch.dtype, owned: list[Any]) -> BadArgumentError | None:
    """What a layer raises when building its stack of rows with optimizer state failed
    with ``error`` (None: ``error`` itself, a layer without state): the refusal of a
    stateful optimizer over a quantized table the layer opened by name or URL (in
    ``owned``), else ``error`` explained by the width of rows with state."""
    if optimizer is None or optimizer.state_cols(dim) == 0:
        return None
    opened = [t for t in owned if is_quantized(t)]
    if opened:
        return refusal(optimizer, opened[0])
    return BadArgumentError(
        f"{error} (a layer trained with {type(optimizer).__name__} stores its state beside "
        f"each row: its tables have rows of optimizer.row_width({dim}, {dtype}) = "
        f"{optimizer.row_width(dim, dtype)} elements)")


def settle(optimizer: Optimizer | None, given: Iterable[Any], stack: Any,
           owned: list[Any]) -> bool:
    """After a layer's stack is built: whether any of its tables (those ``given``, those it
    opened by name or URL, ``owned``) is quantized; a stateful ``optimizer`` over one is
    refused, the stack and the tables the layer opened closed first.

    Raises:
        BadArgumentError: as :func:`check_optimizer`.
    """
    tables = [*given, *owned]
    try:
        check_optimizer(optimizer, tables)
    except BadArgumentError:
        stack.close()
        close_all(owned)
        raise
    return any(is_quantized(t) for t in tables)


def step_deltas(grad: torch.Tensor, alpha: float, skipped: torch.Tensor) -> torch.Tensor:
    """float32 ``alpha * grad`` per row, a row of ``grad`` holding NaN or an infinity
    zeroed (it adds nothing) and counted into ``skipped`` (on the device: no host sync)."""
    ok = torch.isfinite(grad).all(dim=1)
    skipped += (~ok).sum()
    return torch.where(ok[:, None], grad.float() * alpha, 0.0)
