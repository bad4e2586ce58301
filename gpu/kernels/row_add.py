# ruff: noqa: N803  (Triton convention: compile-time constants are UPPER_CASE parameters)
"""Triton kernel of a training step's write to a linear table in device memory:
``table[keys[i]] += alpha * grad[i]`` for every occurrence of a float32 table, duplicates
added by atomics (no dedup first), a row whose gradient holds NaN or an infinity skipped
and counted; or, storing, ``table[keys[i]] = rows[i]`` for distinct keys.

Loaded only through :func:`gpu.kernels.triton_access.kernel_module`; the torch twins are
:func:`gpu.stacks.linear_tables.add_occurrences` and ``index_copy_``. Keys outside
``[0, num_rows)`` write nothing (the lookup that produced the gradient already reported
them). One launch per step, through :class:`gpu.kernels.launch.DirectLaunch`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu.kernels.launch import DirectLaunch

#: keys per program (rows of dim 128 in fp32: 32 KiB of gradient per program)
BLOCK_K = 64


@triton.jit
def _add(a, b):
    return a + b


@triton.jit(do_not_specialize=["n", "num_rows", "tstride"])
def _row_add_kernel(
    keys_ptr, n, grad_ptr, table_ptr, num_rows, tstride, skipped_ptr, alpha,
    DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, STORE: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = offs < n
    keys = tl.load(keys_ptr + offs, mask=kmask, other=0)
    d = tl.arange(0, BLOCK_D)
    dmask = d < DIM
    m2 = kmask[:, None] & dmask[None, :]
    g = tl.load(grad_ptr + offs[:, None] * DIM + d[None, :], mask=m2, other=0.0)
    inrange = kmask & (keys >= 0) & (keys < num_rows)
    dst = table_ptr + keys[:, None] * tstride + d[None, :]
    if STORE:
        tl.store(dst, g, mask=inrange[:, None] & dmask[None, :])
    else:
        g = g.to(tl.float32)
        # NOTE: x - x is 0 for a finite x, NaN for NaN or an infinity
        # NOTE: tl.reduce over a combine of this module, not tl.sum: the interpreted
        # variant runs only helpers decorated with it (gpu.kernels.triton_access)
        bad = tl.reduce(((g - g) != 0).to(tl.int32), 1, _add) > 0
        nbad = tl.reduce((bad & kmask).to(tl.int64), 0, _add)
        if nbad > 0:
            tl.atomic_add(skipped_ptr, nbad)
        ok = inrange & (bad == 0)
        tl.atomic_add(dst, g * alpha, mask=ok[:, None] & dmask[None, :], sem="relaxed")


_LAUNCH = DirectLaunch(_row_add_kernel)
_CONSTEXPRS: dict[tuple[int, bool], dict[str, object]] = {}


def _launch(table: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, alpha: float,
            skipped: torch.Tensor, store: bool) -> None:
    n = keys.numel()
    if n == 0:
        return
    dim = rows.shape[1]
    cx = _CONSTEXPRS.get((dim, store))
    if cx is None:
        cx = _CONSTEXPRS[(dim, store)] = {
            "DIM": dim, "BLOCK_K": BLOCK_K, "BLOCK_D": max(16, 1 << (dim - 1).bit_length()),
            "STORE": store, "num_warps": 4}
    _LAUNCH(((n + BLOCK_K - 1) // BLOCK_K,),
            (keys, n, rows, table, table.shape[0], table.stride(0), skipped, float(alpha)),
            cx, (dim, store, rows.dtype, table.dtype))


def add_rows(table: torch.Tensor, keys: torch.Tensor, grad: torch.Tensor, alpha: float,
             skipped: torch.Tensor) -> None:
    """Add ``alpha * grad[i]`` (``[N, dim]``, contiguous, any float dtype) to row
    ``keys[i]`` of the float32 ``table`` (rows ``stride(0)`` apart, elements contiguous),
    in place; rows of ``grad`` holding NaN or an infinity add nothing and are counted into
    ``skipped`` (an int64 scalar on the device)."""
    _launch(table, keys, grad, alpha, skipped, False)


def store_rows(table: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor) -> None:
    """``table[keys[i]] = rows[i]`` (distinct keys; ``rows`` contiguous, of the table's
    dtype), in place; keys outside the table write nothing."""
    _launch(table, keys, rows, 1.0, keys, True)
