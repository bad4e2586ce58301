# ruff: noqa: N803  (Triton convention: compile-time constants are UPPER_CASE parameters)
"""Triton kernels of the GPU cache (``gpu.cache.GPUCache``).

Loaded only through :func:`gpu._triton.kernel_module`, compiled for CUDA tensors or
interpreted for CPU tensors. Table layout (structure of arrays, slot ``b * WAYS + w`` is
way ``w`` of bucket ``b``):

* ``tkeys``    int64 ``[slots]``, ``EMPTY`` where free;
* ``counters`` int32 ``[slots]``, the eviction-policy counter (hits, saturating);
* ``rows``     ``[slots, dim]`` contiguous;
* ``stats``    int64 ``[STAT_STRIPES]``, hit counts striped by program id (summed on read).

Probe: one key costs one load of its bucket's ``WAYS`` keys (64 bytes at 8 ways, loaded
as one ``[BLOCK_K, WAYS]`` tile), then the hit rows are gathered as a ``[BLOCK_K, dim]``
tile with wide loads. The bucket hash is ``hostcache.hashing.bucket_of`` written with the
same integer operations (wrapping int64 multiply, logical shift as arithmetic shift and
mask), so the CPU twin and these kernels agree bit for bit.

NOTE: hit counters are bumped with integer atomics. A saturating add is an add whose old
value is checked: an add that found the counter at or above ``CMAX`` is undone by a second
atomic. Undone adds never see a value under ``CMAX`` after a counted add reached it, so
the final counter is ``min(initial + hits, CMAX)`` whatever the order: the state equals
the twin's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hostcache import hashing

_M1: tl.constexpr = tl.constexpr(hashing.FMIX_M1)
_M2: tl.constexpr = tl.constexpr(hashing.FMIX_M2)
_MASK31: tl.constexpr = tl.constexpr(hashing.MASK31)
_I64MAX: tl.constexpr = tl.constexpr(hashing.INT64_MAX)


# NOTE: reductions use tl.reduce with our own combine functions instead of tl.min / tl.sum:
# those are @triton.jit functions of triton's standard library, decorated when triton was
# imported, so they would not switch to the interpreter with this module.
@triton.jit
def _min_combine(a, b):
    return tl.minimum(a, b)


@triton.jit
def _add_combine(a, b):
    return a + b


@triton.jit
def _bucket(keys, num_buckets):
    x = keys ^ ((keys >> 33) & _MASK31)
    x = x * _M1
    x = x ^ ((x >> 33) & _MASK31)
    x = x * _M2
    x = x ^ ((x >> 33) & _MASK31)
    x = x & _I64MAX
    return x % num_buckets


@triton.jit
def _probe(tkeys_ptr, keys, kmask, num_buckets, WAYS: tl.constexpr, EMPTY: tl.constexpr):
    """(hit, slot) of a [BLOCK_K] block of keys; slot is garbage where not hit."""
    b = _bucket(keys, num_buckets)
    w = tl.arange(0, WAYS)
    sk = tl.load(tkeys_ptr + (b * WAYS)[:, None] + w[None, :], mask=kmask[:, None], other=EMPTY)
    match = (sk == keys[:, None]) & (keys != EMPTY)[:, None] & kmask[:, None]
    way = tl.reduce(tl.where(match, w[None, :], WAYS), 1, _min_combine)
    hit = way < WAYS
    slot = b * WAYS + tl.where(hit, way, 0)
    return hit, slot


@triton.jit
def _bump(counters_ptr, slot, hit, CMAX: tl.constexpr):
    old = tl.atomic_add(counters_ptr + slot, 1, mask=hit, sem="relaxed")
    tl.atomic_add(counters_ptr + slot, -1, mask=hit & (old >= CMAX), sem="relaxed")


@triton.jit
def _lookup_kernel(
    keys_ptr, n, tkeys_ptr, counters_ptr, rows_ptr, stats_ptr, num_buckets,
    out_ptr, hit_ptr, slots_ptr, table_ptr, num_rows, dim,
    HAS_CACHE: tl.constexpr, GATHER: tl.constexpr, LINEAR: tl.constexpr,
    WRITE_SLOTS: tl.constexpr, COUNT: tl.constexpr, WAYS: tl.constexpr,
    EMPTY: tl.constexpr, CMAX: tl.constexpr, STAT_STRIPES: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = offs < n
    keys = tl.load(keys_ptr + offs, mask=kmask, other=EMPTY)
    if HAS_CACHE:
        hit, slot = _probe(tkeys_ptr, keys, kmask, num_buckets, WAYS, EMPTY)
    else:
        hit = offs < 0
        slot = offs * 0
    if COUNT:
        if HAS_CACHE:
            _bump(counters_ptr, slot, hit, CMAX)
            nhits = tl.reduce(hit.to(tl.int64), 0, _add_combine)
            tl.atomic_add(stats_ptr + pid % STAT_STRIPES, nhits)
    if WRITE_SLOTS:
        tl.store(slots_ptr + offs, tl.where(hit, slot, -1), mask=kmask)
    if GATHER:
        d = tl.arange(0, BLOCK_D)
        if EVEN_D:
            dmask = tl.full([BLOCK_D], 1, tl.int1)
        else:
            dmask = d < dim
        vals = tl.load(
            rows_ptr + slot[:, None] * dim + d[None, :], mask=hit[:, None] & dmask[None, :],
            other=0.0,
        )
        if LINEAR:
            inrange = kmask & (keys >= 0) & (keys < num_rows) & (hit == 0)
            tval = tl.load(
                table_ptr + keys[:, None] * dim + d[None, :],
                mask=inrange[:, None] & dmask[None, :], other=0.0,
            )
            vals = tl.where(hit[:, None], vals, tval)
        tl.store(out_ptr + offs[:, None] * dim + d[None, :], vals,
                 mask=kmask[:, None] & dmask[None, :])
    tl.store(hit_ptr + offs, hit.to(tl.int8), mask=kmask)


@triton.jit
def _pooled_kernel(
    keys_ptr, offsets_ptr, weights_ptr, miss_ptr, tkeys_ptr, counters_ptr, rows_ptr,
    stats_ptr, num_buckets, out_ptr, hit_ptr, table_ptr, num_rows, dim,
    HAS_CACHE: tl.constexpr, HAS_W: tl.constexpr, HAS_MISS: tl.constexpr,
    LINEAR: tl.constexpr, MEAN: tl.constexpr, WAYS: tl.constexpr, EMPTY: tl.constexpr,
    CMAX: tl.constexpr, STAT_STRIPES: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
):
    bag = tl.program_id(0)
    dchunk = tl.program_id(1)
    # NOTE: only the first dim chunk bumps counters, counts hits and writes ``hit``.
    first = tl.full([BLOCK_K], 0, tl.int32) + dchunk == 0
    start = tl.load(offsets_ptr + bag)
    end = tl.load(offsets_ptr + bag + 1)
    d = dchunk * BLOCK_D + tl.arange(0, BLOCK_D)
    if EVEN_D:
        dmask = tl.full([BLOCK_D], 1, tl.int1)  # dim is a multiple of BLOCK_D
    else:
        dmask = d < dim
    acc = tl.full([BLOCK_D], 0.0, tl.float32)
    nhits = tl.full([BLOCK_K], 0, tl.int64)
    for s in range(start, end, BLOCK_K):
        offs = s + tl.arange(0, BLOCK_K).to(tl.int64)
        kmask = offs < end
        keys = tl.load(keys_ptr + offs, mask=kmask, other=EMPTY)
        if HAS_CACHE:
            hit, slot = _probe(tkeys_ptr, keys, kmask, num_buckets, WAYS, EMPTY)
            _bump(counters_ptr, slot, hit & first, CMAX)
        else:
            hit = offs < 0
            slot = offs * 0
        nhits += hit.to(tl.int64)
        vals = tl.load(
            rows_ptr + slot[:, None] * dim + d[None, :], mask=hit[:, None] & dmask[None, :],
            other=0.0,
        ).to(tl.float32)
        if LINEAR:
            inrange = kmask & (keys >= 0) & (keys < num_rows) & (hit == 0)
            tval = tl.load(
                table_ptr + keys[:, None] * dim + d[None, :],
                mask=inrange[:, None] & dmask[None, :], other=0.0,
            ).to(tl.float32)
            vals = tl.where(hit[:, None], vals, tval)
        if HAS_MISS:
            mval = tl.load(
                miss_ptr + offs[:, None] * dim + d[None, :],
                mask=(kmask & (hit == 0))[:, None] & dmask[None, :], other=0.0,
            ).to(tl.float32)
            vals = tl.where(hit[:, None], vals, mval)
        if HAS_W:
            w = tl.load(weights_ptr + offs, mask=kmask, other=0.0).to(tl.float32)
            vals = vals * w[:, None]
        acc += tl.reduce(vals, 0, _add_combine)
        tl.store(hit_ptr + offs, hit.to(tl.int8), mask=kmask & first)
    if MEAN:
        acc = acc / tl.maximum(end - start, 1).to(tl.float32)
    tl.store(out_ptr + bag.to(tl.int64) * dim + d, acc.to(out_ptr.dtype.element_ty), mask=dmask)
    if HAS_CACHE:
        total = tl.reduce(nhits, 0, _add_combine)
        if dchunk == 0:
            tl.atomic_add(stats_ptr + bag % STAT_STRIPES, total)


@triton.jit
def _scatter_rows_kernel(
    rows_ptr, target_ptr, values_ptr, src_ptr, n, dim,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = offs < n
    target = tl.load(target_ptr + offs, mask=kmask, other=0)
    src = tl.load(src_ptr + offs, mask=kmask, other=0)
    d = tl.arange(0, BLOCK_D)
    m = kmask[:, None] & (d < dim)[None, :]
    vals = tl.load(values_ptr + src[:, None] * dim + d[None, :], mask=m)
    tl.store(rows_ptr + target[:, None] * dim + d[None, :], vals, mask=m)


# ---------------------------------------------------------------- launchers

#: tile sizes; the bench may override them (``--sweep``) to pick better ones per GPU.
CONFIG: dict[str, int] = {
    "lookup_block_k": 32,
    "lookup_warps": 4,
    "pooled_block_k": 64,
    "pooled_warps": 8,
    "pooled_block_d": 0,  # 0: the whole row in one program
    "scatter_block_k": 16,
}


def _block_d(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))


def lookup(
    keys: torch.Tensor, tkeys: torch.Tensor, counters: torch.Tensor, rows: torch.Tensor,
    stats: torch.Tensor, num_buckets: int, ways: int, *, empty: int, cmax: int,
    gather: bool, count: bool, want_slots: bool, table: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Probe (+ gather, + linear-table misses) of ``keys``: ``(values, hit, slots)``."""
    n = keys.numel()
    dim = rows.shape[1]
    out = torch.empty((n, dim), dtype=rows.dtype, device=keys.device) if gather else None
    hit = torch.empty(n, dtype=torch.bool, device=keys.device)
    slots = torch.empty(n, dtype=torch.int64, device=keys.device) if want_slots else None
    if n == 0:
        return out, hit, slots
    bk = CONFIG["lookup_block_k"]
    bd = _block_d(dim)
    linear = table is not None
    _lookup_kernel[(triton.cdiv(n, bk),)](
        keys, n, tkeys, counters, rows, stats, max(num_buckets, 1),
        out if out is not None else keys, hit.view(torch.int8),
        slots if slots is not None else keys, table if linear else rows,
        table.shape[0] if table is not None else 0, dim,
        HAS_CACHE=num_buckets > 0, GATHER=gather, LINEAR=linear, WRITE_SLOTS=want_slots,
        COUNT=count, WAYS=ways, EMPTY=empty, CMAX=cmax, STAT_STRIPES=stats.numel(),
        BLOCK_K=bk, BLOCK_D=bd, EVEN_D=bd == dim, num_warps=CONFIG["lookup_warps"],
    )
    return out, hit, slots


def pooled(
    keys: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
    miss_values: torch.Tensor | None, tkeys: torch.Tensor, counters: torch.Tensor,
    rows: torch.Tensor, stats: torch.Tensor, num_buckets: int, ways: int, *, mean: bool,
    empty: int, cmax: int, table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Probe + gather + pool per bag, fused: ``(pooled [B, dim], hit [N])``."""
    n = keys.numel()
    nbags = offsets.numel() - 1
    dim = rows.shape[1]
    out = torch.empty((nbags, dim), dtype=rows.dtype, device=keys.device)
    hit = torch.empty(n, dtype=torch.bool, device=keys.device)
    if nbags == 0:
        return out, hit
    bd = CONFIG["pooled_block_d"] or _block_d(dim)
    bd = min(bd, _block_d(dim))
    linear = table is not None
    _pooled_kernel[(nbags, triton.cdiv(dim, bd))](
        keys, offsets, weights if weights is not None else rows,
        miss_values if miss_values is not None else rows, tkeys, counters, rows, stats,
        max(num_buckets, 1), out, hit.view(torch.int8), table if linear else rows,
        table.shape[0] if table is not None else 0, dim,
        HAS_CACHE=num_buckets > 0, HAS_W=weights is not None,
        HAS_MISS=miss_values is not None, LINEAR=linear, MEAN=mean, WAYS=ways, EMPTY=empty,
        CMAX=cmax, STAT_STRIPES=stats.numel(), BLOCK_K=CONFIG["pooled_block_k"],
        BLOCK_D=bd, EVEN_D=dim % bd == 0, num_warps=CONFIG["pooled_warps"],
    )
    return out, hit


def scatter_rows(
    rows: torch.Tensor, target: torch.Tensor, values: torch.Tensor, src: torch.Tensor
) -> None:
    """``rows[target[i]] = values[src[i]]`` for distinct targets."""
    n = target.numel()
    if n == 0:
        return
    bk = CONFIG["scatter_block_k"]
    _scatter_rows_kernel[(triton.cdiv(n, bk),)](
        rows, target, values, src, n, rows.shape[1], BLOCK_K=bk, BLOCK_D=_block_d(rows.shape[1]),
    )
