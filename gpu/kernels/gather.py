# ruff: noqa: N803  (Triton convention: compile-time constants are UPPER_CASE parameters)
"""Triton kernel of the GPULayer lookup: rows of a linear table by key, nothing else.

Loaded only through :func:`gpu.kernels.triton_access.kernel_module`. One launch per lookup, seven
runtime parameters, launched through :class:`gpu.kernels.launch.DirectLaunch`: a serving-size
lookup is bound by host time, not by this kernel. Keys outside ``[0, num_rows)`` read as
zero rows and, with ``CHECK``, are written to the layer's key-error flag
(:mod:`gpu.stacks.key_flag`). The table's rows may be padded (row ``k`` starts ``k * tstride``
elements in). Large batches over a table in host memory are visited in row (host page)
order, as the cache lookups are (``gpu.kernels.cache_lookup.page_order``). A quantized
table's rows are dequantized in the same load (:mod:`gpu.kernels.stored_rows`) and written
in the output's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu.kernels.launch import BoundLaunch, DirectLaunch
from gpu.kernels.tiles import DEFAULT_TILES, Tiles
from gpu.kernels.triton_access import helper_module
from nvecache.common.rows import RowFormat

# NOTE: the cache lookups' visit order (a torch function), from the same variant
_page_order = helper_module("cache_lookup").page_order
_stored = helper_module("stored_rows")
_load_rows = _stored.load_rows
_to_dtype = _stored.to_dtype
codec_constexprs = _stored.codec_constexprs


# NOTE: tstride specialized (whether it is a multiple of 16): a row of a table aligned to
# 16 bytes (nvecache.common.rows.ROW_ALIGN) is then read with 16-byte loads, where an
# unspecialized stride compiles to one load per element (LDG.E.U8 for int8 rows)
@triton.jit(do_not_specialize=["n", "num_rows"])
def _gather_kernel(
    keys_ptr, n, table_ptr, num_rows, tstride, out_ptr, err_ptr, order_ptr,
    DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, ORDERED: tl.constexpr,
    CHECK: tl.constexpr, QUANT: tl.constexpr, META: tl.constexpr, SEQ: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = offs < n
    if ORDERED:
        offs = tl.load(order_ptr + offs, mask=kmask, other=0).to(tl.int64)
    keys = tl.load(keys_ptr + offs, mask=kmask, other=0)
    inrange = kmask & (keys >= 0) & (keys < num_rows)
    d = tl.arange(0, BLOCK_D)
    dmask = d < DIM
    vals = _load_rows(table_ptr, keys, inrange, tstride, d, dmask, QUANT, META, 0, SEQ)
    tl.store(out_ptr + offs[:, None] * DIM + d[None, :],
             _to_dtype(vals, out_ptr.dtype.element_ty), mask=kmask[:, None] & dmask[None, :])
    if CHECK:
        bad = kmask & (inrange == 0)
        # NOTE: any one bad key of the block lands in the flag (a store over the host link,
        # made only when a key is bad)
        tl.store(err_ptr + offs * 0, keys, mask=bad)


_LAUNCH = DirectLaunch(_gather_kernel)
_CONSTEXPRS: dict[tuple[object, ...], dict[str, object]] = {}


def _block_d(dim: int) -> int:
    return max(16, 1 << (dim - 1).bit_length())


def gather(keys: torch.Tensor, table: torch.Tensor, err: torch.Tensor | None, *,
           host_table: bool, tiles: Tiles = DEFAULT_TILES, fmt: RowFormat | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``table[keys]`` with zero rows for keys outside the table (reported in ``err``, an
    int64 ``[1]`` flag, when given). ``tiles``: the launch settings (``gather_block_k``,
    ``gather_warps``, and ``linear_page_order``, from which a batch over a table in host
    memory (``host_table``) is visited in page order). ``fmt``: a quantized table's format
    (``table`` is then its stored bytes, ``[num_rows, >= fmt.stored_bytes]`` uint8; its rows
    come back dequantized); ``out_dtype``: the rows' dtype (default the table's; a
    quantized table's needs one). A caller looking up one table call after call binds it
    once instead (:class:`BoundRows`)."""
    n = keys.numel()
    dim = fmt.dim if fmt is not None and fmt.quantized else table.shape[1]
    dtype = out_dtype or table.dtype
    # NOTE: sizes as arguments, not a tuple: the cheaper parse
    out = torch.empty(n, dim, dtype=dtype, device=keys.device)
    if n == 0:
        return out
    order = None
    bk = tiles.gather_block_k
    if host_table and 0 < tiles.linear_page_order <= n:
        order = _page_order(keys, table.shape[0], 0)
    cx, key = _constexprs(dim, order is not None, err is not None, table.dtype, dtype, fmt,
                          tiles)
    _LAUNCH(((n + bk - 1) // bk,),
            (keys, n, table, table.shape[0], table.stride(0), out,
             err if err is not None else keys, order if order is not None else keys),
            cx, key)
    return out


class BoundRows:
    """``table[keys]`` of one table and key-error flag, bound once (a layer's lookups):
    the gather's launch with the table and flag resolved
    (:class:`~gpu.kernels.launch.BoundLaunch`), a call passing only the keys, their count
    and the output it allocates. Keys of any contiguous shape, rows ``[*keys.shape, dim]``,
    visited in batch order; a batch over a table in host memory large enough to be
    visited in page order takes :func:`gather`.

    Args:
        table, err, host_table, tiles, fmt: As for :func:`gather` (``err`` required).
        dtype: The rows' dtype.
        device: Where the keys and the rows are (the table's GPU).
    """

    def __init__(self, table: torch.Tensor, err: torch.Tensor, *, host_table: bool,
                 tiles: Tiles, fmt: RowFormat | None, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.dim = fmt.dim if fmt is not None and fmt.quantized else table.shape[1]
        cx, key = _constexprs(self.dim, False, True, table.dtype, dtype, fmt, tiles)
        # NOTE: placeholders of the parameters' types that the caller keeps (the flag for
        # the int64 ones): binding allocates nothing, so it may happen inside a CUDA graph
        # capture (torch.compile's reduce-overhead) without leaving a tensor in its pool
        self.launch = BoundLaunch(
            _LAUNCH, (err, 0, table, table.shape[0], table.stride(0), table, err, err),
            cx, key, _VARYING)
        self._call = self.launch.call
        self._table, self._err, self._tiles, self._fmt = table, err, tiles, fmt
        self._dtype, self._device, self._block = dtype, device, tiles.gather_block_k
        order = tiles.linear_page_order
        #: from how many keys a batch is visited in page order (never on a device table)
        self._ordered_from = order if host_table and order > 0 else 1 << 62

    def __call__(self, keys: torch.Tensor) -> torch.Tensor:
        n = keys.numel()
        if n >= self._ordered_from:
            return gather(keys.view(-1), self._table, self._err, host_table=True,
                          tiles=self._tiles, fmt=self._fmt,
                          out_dtype=self._dtype).view(*keys.shape, self.dim)
        if keys.dim() == 1:
            out = torch.empty(n, self.dim, dtype=self._dtype, device=self._device)
        else:
            out = torch.empty((*keys.shape, self.dim), dtype=self._dtype, device=self._device)
        if n:
            self._call((n + self._block - 1) // self._block, keys, n, out)
        return out


#: what a bound gather passes per call (parameter indices): keys, n, out
_VARYING = (0, 1, 5)


def _constexprs(dim: int, ordered: bool, check: bool, dtype: torch.dtype,
                out_dtype: torch.dtype, fmt: RowFormat | None, tiles: Tiles
                ) -> tuple[dict[str, object], tuple[object, ...]]:
    """A variant's constexprs (one dict per key, kept) and the key naming them with the
    table's and the output's dtypes (the pointers' element types) and the table's
    format."""
    key = (dim, ordered, check, dtype, out_dtype, fmt, tiles)
    cx = _CONSTEXPRS.get(key)
    if cx is None:
        cx = _CONSTEXPRS[key] = {"DIM": dim, "BLOCK_K": tiles.gather_block_k,
                                 "BLOCK_D": _block_d(dim), "ORDERED": ordered, "CHECK": check,
                                 "num_warps": tiles.gather_warps, **codec_constexprs(fmt)}
    return cx, key
