# ruff: noqa: N803  (Triton convention: compile-time constants are UPPER_CASE parameters)
"""Triton kernels of the GPU cache's pooled lookups (``GPUCache.lookup_pooled``,
``lookup_linear_pooled``): probe + gather + pool per bag in one launch; and the layers'
pooled lookups bound to their table (:class:`BoundPooled`): a GPULayer's, the same kernel
with no cache, and a LinearUVM's, with its GPU cache in front.

Loaded only through :func:`gpu.kernels.triton_access.kernel_module`, compiled for CUDA tensors or
interpreted for CPU tensors, like :mod:`gpu.kernels.cache_lookup` (the table layout, the
counters and the linear-table misses are described there).

Each bag is split over several programs (:func:`pooled_split`) so that a few hundred bags
still fill the GPU; each program accumulates a ``[BLOCK_K, BLOCK_D]`` fp32 tile and reduces
it once, and a second launch sums the partial rows in a fixed order (deterministic).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from gpu.kernels.launch import BoundLaunch, DirectLaunch
from gpu.kernels.tiles import Tiles
from gpu.kernels.triton_access import helper_module
from nvecache.common.rows import RowFormat

# NOTE: the per-block device functions, decorated like this module's kernels (compiled or
# interpreted)
_parts = helper_module("cache_probe")
add_combine = _parts.add_combine
probe = _parts.probe
_bump = _parts.bump
_collect = _parts.collect
_stored = helper_module("stored_rows")
_load_rows = _stored.load_rows
_to_dtype = _stored.to_dtype
codec_constexprs = _stored.codec_constexprs


@triton.jit(do_not_specialize=["num_buckets", "num_rows", "cand_cap", "n"])
def _pooled_kernel(
    keys_ptr, offsets_ptr, weights_ptr, miss_ptr, tkeys_ptr, counters_ptr, rows_ptr,
    stats_ptr, num_buckets, out_ptr, part_ptr, hit_ptr, table_ptr, num_rows, tstride, dim,
    cand_ptr, cand_cap, err_ptr, crows_ptr, n, HAS_CACHE: tl.constexpr, HAS_W: tl.constexpr,
    HAS_MISS: tl.constexpr,
    COLLECT: tl.constexpr,
    LINEAR: tl.constexpr, MEAN: tl.constexpr, SPLIT: tl.constexpr, WAYS: tl.constexpr,
    EMPTY: tl.constexpr, STAT_STRIPES: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, COUNT: tl.constexpr, CMAX: tl.constexpr,
    CHECK: tl.constexpr, COLLECT_ROWS: tl.constexpr, QUANT: tl.constexpr, META: tl.constexpr,
    SEQ: tl.constexpr, HIT: tl.constexpr,
):
    bag = tl.program_id(0)
    split = tl.program_id(1)
    # NOTE: bounds clamped to the n keys (unchecked offsets, validate=False, read no key
    # or weight outside the batch: a bag past its end is cut there, a decreasing one empty)
    end = tl.minimum(tl.maximum(tl.load(offsets_ptr + bag + 1), 0), n)
    start = tl.minimum(tl.maximum(tl.load(offsets_ptr + bag), 0), end)
    d = tl.arange(0, BLOCK_D)
    if EVEN_D:
        dmask = tl.full([BLOCK_D], 1, tl.int1)  # dim is BLOCK_D
    else:
        dmask = d < dim
    # NOTE: accumulate a [BLOCK_K, BLOCK_D] tile in registers and reduce it across keys once
    # at the end: a reduction per step would cost a shared-memory round and a barrier.
    acc = tl.full([BLOCK_K, BLOCK_D], 0.0, tl.float32)
    nhits = tl.full([BLOCK_K], 0, tl.int64)
    # NOTE: a while loop, not range(start, end, step): Triton 3.6's interpreter cannot take
    # loaded values as range bounds.
    s = start + split * BLOCK_K
    offs = s + tl.arange(0, BLOCK_K).to(tl.int64)
    kmask = offs < end
    next_keys = tl.load(keys_ptr + offs, mask=kmask, other=EMPTY)
    while s < end:
        keys = next_keys
        s += SPLIT * BLOCK_K
        # NOTE: the next step's keys are loaded now, before this step's rows: the rows
        # wait on keys already here, and the next keys arrive while they are read (one
        # dependent load per step instead of two)
        next_offs = s + tl.arange(0, BLOCK_K).to(tl.int64)
        next_mask = next_offs < end
        next_keys = tl.load(keys_ptr + next_offs, mask=next_mask, other=EMPTY)
        if HAS_CACHE:
            hit, slot = probe(tkeys_ptr, keys, kmask, num_buckets, WAYS, EMPTY)
            vals = tl.load(
                rows_ptr + slot[:, None] * dim + d[None, :], mask=hit[:, None] & dmask[None, :],
                other=0.0,
            ).to(tl.float32)
            if LINEAR:
                inrange = kmask & (keys >= 0) & (keys < num_rows) & (hit == 0)
                # NOTE: a dequantized row in the cache's dtype first: what a hit reads
                tval = _to_dtype(_load_rows(table_ptr, keys, inrange, tstride, d, dmask,
                                            QUANT, META, 0, SEQ),
                                 rows_ptr.dtype.element_ty).to(tl.float32)
                vals = tl.where(hit[:, None], vals, tval)
            if HAS_MISS:
                mval = tl.load(
                    miss_ptr + offs[:, None] * dim + d[None, :],
                    mask=(kmask & (hit == 0))[:, None] & dmask[None, :], other=0.0,
                ).to(tl.float32)
                vals = tl.where(hit[:, None], vals, mval)
        else:
            hit = offs < 0
            slot = offs * 0
            if LINEAR:
                inrange = kmask & (keys >= 0) & (keys < num_rows)
                vals = _to_dtype(_load_rows(table_ptr, keys, inrange, tstride, d, dmask,
                                            QUANT, META, 0, SEQ),
                                 rows_ptr.dtype.element_ty).to(tl.float32)
            elif HAS_MISS:
                vals = tl.load(
                    miss_ptr + offs[:, None] * dim + d[None, :],
                    mask=kmask[:, None] & dmask[None, :], other=0.0,
                ).to(tl.float32)
            else:
                vals = tl.full([BLOCK_K, BLOCK_D], 0.0, tl.float32)
        if COLLECT:
            cpos, stored = _collect(cand_ptr, cand_cap, keys, offs,
                                    kmask & (hit == 0) & (keys >= 0) & (keys < num_rows))
            if COLLECT_ROWS:
                # NOTE: the rows as read (before any weight), in the cache's dtype
                tl.store(crows_ptr + cpos[:, None] * dim + d[None, :],
                         vals.to(crows_ptr.dtype.element_ty),
                         mask=stored[:, None] & dmask[None, :])
        if HAS_W:
            w = tl.load(weights_ptr + offs, mask=kmask, other=0.0).to(tl.float32)
            vals = vals * w[:, None]
        acc += vals
        if HIT:  # NOTE: a linear table's own lookups (BoundPooled) want no hit flags
            tl.store(hit_ptr + offs, hit.to(tl.int8), mask=kmask)
        if HAS_CACHE:
            if COUNT:
                _bump(counters_ptr, slot, hit, CMAX)
            nhits += hit.to(tl.int64)
        if CHECK:
            tl.store(err_ptr + offs * 0, keys, mask=kmask & ((keys < 0) | (keys >= num_rows)))
        offs, kmask = next_offs, next_mask
    res = tl.reduce(acc, 0, add_combine)
    if SPLIT == 1:
        if MEAN:
            res = res / tl.maximum(end - start, 1).to(tl.float32)
        tl.store(out_ptr + bag.to(tl.int64) * dim + d, res.to(out_ptr.dtype.element_ty),
                 mask=dmask)
    else:
        tl.store(part_ptr + (bag.to(tl.int64) * SPLIT + split) * dim + d, res, mask=dmask)
    if HAS_CACHE:
        total = tl.reduce(nhits, 0, add_combine)
        tl.atomic_add(stats_ptr + (bag * SPLIT + split) % STAT_STRIPES, total, sem="relaxed")


@triton.jit(do_not_specialize=["n"])
def _pool_finish_kernel(
    part_ptr, offsets_ptr, out_ptr, dim, n, MEAN: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
):
    """Sums the ``SPLIT`` fp32 partial rows of a bag in a fixed order (deterministic)."""
    bag = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    if EVEN_D:
        dmask = tl.full([BLOCK_D], 1, tl.int1)
    else:
        dmask = d < dim
    s = tl.arange(0, SPLIT)
    p = tl.load(part_ptr + (bag.to(tl.int64) * SPLIT + s)[:, None] * dim + d[None, :],
                mask=dmask[None, :], other=0.0)
    res = tl.reduce(p, 0, add_combine)
    if MEAN:
        end = tl.minimum(tl.maximum(tl.load(offsets_ptr + bag + 1), 0), n)  # as clamped
        start = tl.minimum(tl.maximum(tl.load(offsets_ptr + bag), 0), end)
        res = res / tl.maximum(end - start, 1).to(tl.float32)
    tl.store(out_ptr + bag.to(tl.int64) * dim + d, res.to(out_ptr.dtype.element_ty), mask=dmask)



# ---------------------------------------------------------------- launchers


# NOTE: plain integer helpers: triton.next_power_of_2 is a constexpr function in Triton 3.6
# and costs microseconds of host time per call.
def _block_d(dim: int) -> int:
    return max(16, 1 << (dim - 1).bit_length())


def _row_stride(table: torch.Tensor | None, dim: int) -> int:
    """Elements from one row of a linear table to the next (rows may be padded)."""
    return dim if table is None else table.stride(0)


def _cand_cap(candidates: torch.Tensor | None) -> int:
    return 0 if candidates is None else (candidates.numel() - 1) // 2


def pooled_block_k(tiles: Tiles, block_d: int) -> int:
    """Keys per pooled program for rows of ``block_d`` elements: ``tiles.pooled_block_k``,
    fewer where the tile would pass ``tiles.pooled_max_tile`` elements (at least 16)."""
    return min(tiles.pooled_block_k, max(16, tiles.pooled_max_tile // block_d))


def pooled_split(n: int, nbags: int, tiles: Tiles, block_d: int) -> int:
    """Programs per bag (a power of two) for rows of ``block_d`` elements: enough to fill
    the GPU, none idle on average."""
    per_bag = max(1, -(-n // max(nbags, 1)))  # average bag length, rounded up
    useful = -(-per_bag // pooled_block_k(tiles, block_d))  # key blocks of an average bag
    want = -(-tiles.pooled_programs // max(nbags, 1))
    split = max(1, min(useful, want, tiles.pooled_max_split))
    return 1 << (split.bit_length() - 1)


#: the pooled kernels launched directly, and their constexpr sets by key
_POOLED = DirectLaunch(_pooled_kernel)
_POOL_FINISH = DirectLaunch(_pool_finish_kernel)
_POOLED_CX: dict[tuple[object, ...], dict[str, object]] = {}


def pooled(
    keys: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
    miss_values: torch.Tensor | None, tkeys: torch.Tensor, counters: torch.Tensor,
    rows: torch.Tensor, stats: torch.Tensor, num_buckets: int, ways: int, *, mean: bool,
    empty: int, table: torch.Tensor | None = None, candidates: torch.Tensor | None = None,
    count: bool = True, cmax: int, out_dtype: torch.dtype | None = None,
    err: torch.Tensor | None = None, candidate_rows: torch.Tensor | None = None,
    tiles: Tiles, table_format: RowFormat | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Probe + gather + pool per bag, fused: ``(pooled [B, dim], hit [N])``; ``candidates``
    and ``candidate_rows`` as in ``gpu.kernels.cache_lookup.lookup``; ``out_dtype``: of
    ``pooled`` (default the rows' dtype; the sums are fp32 either way); ``tiles``: the
    cache's launch settings; ``table_format`` as in ``gpu.kernels.cache_lookup.lookup`` (a
    quantized table's rows are dequantized, rounded to the rows' dtype, then pooled).

    Each bag is split over ``pooled_split`` programs (key blocks dealt round robin); with
    more than one, the programs write fp32 partial rows and a second launch sums them in a
    fixed order, so results are deterministic. A program holds whole rows.
    """
    n = keys.numel()
    nbags = offsets.numel() - 1
    dim = rows.shape[1]
    dev = keys.device
    out = torch.empty((nbags, dim), dtype=out_dtype or rows.dtype, device=dev)
    hit = torch.empty(n, dtype=torch.bool, device=dev)
    if nbags == 0:
        return out, hit
    bd = _block_d(dim)
    split = pooled_split(n, nbags, tiles, bd)
    part = torch.empty((nbags, split, dim), dtype=torch.float32, device=dev) \
        if split > 1 else out
    linear = table is not None
    w = weights if weights is not None else rows
    mv = miss_values if miss_values is not None else rows
    # NOTE: the key names every constexpr and every tensor's element type (gpu.kernels.launch)
    cx, cxkey = _pooled_constexprs(
        (num_buckets > 0, weights is not None, miss_values is not None,
         candidates is not None, linear, mean, split, ways, empty, stats.numel(), bd,
         bd == dim, count, cmax, err is not None and linear, tiles, offsets.dtype,
         w.dtype, mv.dtype, rows.dtype, out.dtype,
         table.dtype if table is not None else None, candidate_rows is not None,
         table_format, True))
    _POOLED(
        (nbags, split),
        (keys, offsets, w, mv, tkeys, counters, rows, stats, max(num_buckets, 1), out, part,
         hit.view(torch.int8), table if linear else rows,
         table.shape[0] if table is not None else 0, _row_stride(table, dim), dim,
         candidates if candidates is not None else keys, _cand_cap(candidates),
         err if err is not None else keys,
         candidate_rows if candidate_rows is not None else rows, n),
        cx, cxkey)
    if split > 1:
        _POOL_FINISH((nbags,), (part, offsets, out, dim, n), *_finish_constexprs(
            mean, split, bd, dim, offsets.dtype, out.dtype))
    return out, hit


def _pooled_constexprs(cxkey: tuple[Any, ...]) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """The pooled kernel's constexprs for ``cxkey`` (one dict per key, kept): whether
    there is a cache, weights, miss values, candidates; linear, mean, split, ways, empty,
    stat stripes, BLOCK_D, EVEN_D, count, cmax, check, tiles; the dtypes of the offsets,
    weights, miss values, cache rows, output and table; candidate rows, the table's
    format, and whether the hit flags are stored."""
    cx = _POOLED_CX.get(cxkey)
    if cx is None:
        bd, tiles = cxkey[10], cxkey[15]
        cx = _POOLED_CX[cxkey] = dict(
            HAS_CACHE=cxkey[0], HAS_W=cxkey[1], HAS_MISS=cxkey[2], COLLECT=cxkey[3],
            LINEAR=cxkey[4], MEAN=cxkey[5], SPLIT=cxkey[6], WAYS=cxkey[7], EMPTY=cxkey[8],
            STAT_STRIPES=cxkey[9], BLOCK_K=pooled_block_k(tiles, bd), BLOCK_D=bd,
            EVEN_D=cxkey[11], COUNT=cxkey[12], CMAX=cxkey[13], CHECK=cxkey[14],
            COLLECT_ROWS=cxkey[22], HIT=cxkey[24], num_warps=tiles.pooled_warps,
            **codec_constexprs(cxkey[23]))
    return cx, cxkey


_FINISH_CX: dict[tuple[Any, ...], dict[str, Any]] = {}


def _finish_constexprs(mean: bool, split: int, bd: int, dim: int, offsets_dtype: torch.dtype,
                       out_dtype: torch.dtype) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """The finishing kernel's constexprs (kept per key) and key."""
    key = (mean, split, bd, bd == dim, offsets_dtype, out_dtype)
    cx = _FINISH_CX.get(key)
    if cx is None:
        cx = _FINISH_CX[key] = dict(MEAN=mean, SPLIT=split, BLOCK_D=bd, EVEN_D=bd == dim,
                                    num_warps=4)
    return cx, key


#: what a bound pooled lookup passes per call (parameter indices): keys, offsets, weights,
#: out, part; with candidates, the buffer and its capacity; with candidate rows, those;
#: then n
_VARY_BAG, _VARY_CAND, _VARY_CROWS, _VARY_N = (0, 1, 2, 9, 10), (16, 17), (19,), (20,)


class PooledCache(NamedTuple):
    """A GPU cache's tables as the pooled kernel reads them (``gpu.cache.backend.CacheTables``
    and its constants), for a :class:`BoundPooled` with a cache in front of its table."""

    tkeys: torch.Tensor
    counters: torch.Tensor
    rows: torch.Tensor
    stats: torch.Tensor
    num_buckets: int
    ways: int
    empty: int
    cmax: int


class BoundPooled:
    """Pooled lookups of one linear table, bound once: the pooled kernel with the table,
    key-error flag, stand-ins and (for a LinearUVM) a GPU cache's tables resolved
    (:class:`~gpu.kernels.launch.BoundLaunch`, one per variant: split, mean, weights,
    offsets' dtype, key check, candidates), a call passing only the bag's tensors, the
    miss candidates' buffers and the output it allocates. No hit flags are stored.

    With no ``cache`` (a GPULayer's table) every key is a read of ``table``, dequantized
    where ``fmt`` is quantized; with one, hits are read from the cache (its counters
    bumped, its hits counted) and misses from ``table``, listed in the candidates a call
    passes. Results are those of :func:`pooled` with ``table=`` and the same cache.

    Args:
        table: The table (``[num_rows, >= dim]``; a quantized one's stored bytes).
        err: The int64 ``[1]`` key-error flag the kernel writes when a call checks.
        dim, dtype: The rows' width and the output's dtype (sums are fp32); with a
            ``cache``, its rows' dtype.
        tiles: The launch settings.
        fmt: The table's format (None: plain rows).
        device: Where the keys, the table's reads and the output are.
        cache: The GPU cache in front of ``table`` (None: none).
    """

    def __init__(self, table: torch.Tensor, err: torch.Tensor, *, dim: int,
                 dtype: torch.dtype, tiles: Tiles, fmt: RowFormat | None,
                 device: torch.device, cache: PooledCache | None = None) -> None:
        self.dim, self._dtype, self._device = dim, dtype, device
        self._table, self._err, self._tiles, self._fmt = table, err, tiles, fmt
        self._cache = cache
        self._bd = _block_d(dim)
        #: stand-ins and the rows' dtype: no cache's (never read), or the cache's rows
        self._rows = torch.zeros(1, dim, dtype=dtype, device=device) if cache is None \
            else cache.rows
        self._stats = torch.zeros(1, dtype=torch.int64, device=device)
        self._launches: dict[tuple[Any, ...], tuple[Any, Any]] = {}

    def __call__(self, keys: torch.Tensor, offsets: torch.Tensor,
                 weights: torch.Tensor | None, mean: bool, check: bool,
                 candidates: torch.Tensor | None = None,
                 candidate_rows: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, dim]`` pooled rows of the bags ``offsets`` (``[B + 1]`` bounds) of flat
        ``keys``; ``check``: report keys outside the table in the flag (else the caller
        checked them); ``candidates``, ``candidate_rows``: as for :func:`pooled` (only with
        a cache)."""
        nbags = offsets.numel() - 1
        out = torch.empty(nbags, self.dim, dtype=self._dtype, device=self._device)
        if nbags <= 0:
            return out
        n = keys.numel()
        split = pooled_split(n, nbags, self._tiles, self._bd)
        wkey = None if weights is None else weights.dtype
        lkey = (split, mean, wkey, offsets.dtype, check, candidates is not None,
                candidate_rows is not None)
        bound = self._launches.get(lkey)
        if bound is None:
            bound = self._launches[lkey] = self._bind(lkey, weights, offsets)
        part = out if split == 1 else torch.empty((nbags, split, self.dim),
                                                  dtype=torch.float32, device=self._device)
        w = weights if weights is not None else self._rows
        if candidates is None:
            bound[0].call(nbags, split, keys, offsets, w, out, part, n)
        elif candidate_rows is None:
            bound[0].call(nbags, split, keys, offsets, w, out, part, candidates,
                          _cand_cap(candidates), n)
        else:
            bound[0].call(nbags, split, keys, offsets, w, out, part, candidates,
                          _cand_cap(candidates), candidate_rows, n)
        if split > 1:
            bound[1].call(nbags, part, offsets, out, n)
        return out

    def _bind(self, lkey: tuple[Any, ...], weights: torch.Tensor | None,
              offsets: torch.Tensor) -> tuple[Any, Any]:
        split, mean, _, _, check, collect, crows = lkey
        t, rows, dim, bd, c = self._table, self._rows, self.dim, self._bd, self._cache
        if (collect or crows) and c is None:
            raise ValueError("miss candidates need a cache in front of the table")
        # NOTE: placeholders of this object's where a call passes its own tensors (keys,
        # offsets, weights, out, part, candidates): a binding keeps none of a caller's
        # tensors alive
        i64 = self._stats
        offs, w = self._stand_in(offsets), self._stand_in(weights) if weights is not None \
            else rows
        probed = c is not None and c.num_buckets > 0  # NOTE: a cache of no slots: none
        cx, cxkey = _pooled_constexprs(
            (probed, weights is not None, False, collect, True, mean, split,
             c.ways if c else 1, c.empty if c else 0, c.stats.numel() if c else 1, bd,
             bd == dim, probed, c.cmax if c else 0, check, self._tiles, offs.dtype,
             w.dtype, rows.dtype, rows.dtype, self._dtype, t.dtype, crows, self._fmt,
             False))
        # NOTE: the others fixed: the cache's tables (or stand-ins), the table, the flag
        main = BoundLaunch(
            _POOLED,
            (i64, offs, w, rows, c.tkeys if c else i64, c.counters if c else i64, rows,
             c.stats if c else i64, max(c.num_buckets, 1) if c else 1, rows, rows, i64, t,
             t.shape[0], _row_stride(t, dim), dim, i64, 0, self._err, rows, 0),
            cx, cxkey, _VARY_BAG + (_VARY_CAND if collect else ()) + (
                _VARY_CROWS if crows else ()) + _VARY_N, grid_dims=2)
        finish = None
        if split > 1:
            fcx, fkey = _finish_constexprs(mean, split, bd, dim, offs.dtype, self._dtype)
            finish = BoundLaunch(_POOL_FINISH, (rows, offs, rows, dim, 0), fcx, fkey,
                                 (0, 1, 2, 4))
        return main, finish

    def _stand_in(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor of ``t``'s dtype held by this object (the layer's offsets are int64
        and its weights of its dtype: no allocation, so binding may happen inside a CUDA
        graph capture without leaving a tensor in its pool)."""
        if t.dtype == torch.int64:
            return self._stats
        if t.dtype == self._rows.dtype:
            return self._rows
        return torch.zeros(1, dtype=t.dtype, device=self._device)
