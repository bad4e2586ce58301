# ruff: noqa: N803  (Triton convention: compile-time constants are UPPER_CASE parameters)
"""Triton kernels of the GPU cache (``gpu.cache.GPUCache``).

Loaded only through :func:`gpu._triton.kernel_module`, compiled for CUDA tensors or
interpreted for CPU tensors. Table layout (structure of arrays, slot ``b * WAYS + w`` is
way ``w`` of bucket ``b``):

* ``tkeys``    int64 ``[slots]``, ``EMPTY`` where free;
* ``counters`` int32 ``[slots]``, the eviction-policy counter (hits; clamped lazily);
* ``rows``     ``[slots, dim]`` contiguous;
* ``stats``    int64 ``[STAT_STRIPES]``, hit counts striped by program id (summed on read).

Probe: one key costs one load of its bucket's ``WAYS`` keys (64 bytes at 8 ways, loaded
as one ``[BLOCK_K, WAYS]`` tile), then the hit rows are gathered as a ``[BLOCK_K, dim]``
tile with wide loads. The bucket hash is ``hostcache.hashing.bucket_of`` written with the
same integer operations (wrapping int64 multiply, logical shift as arithmetic shift and
mask), so the CPU twin and these kernels agree bit for bit.

Counters: a hit adds 1 to its slot's counter with a fire-and-forget atomic (the result is
unused, so it compiles to a ``red``: no warp waits for it), issued after the row loads and
stores. Same-address atomics serialize in L2, and a Zipf batch hits its hottest slots
thousands of times, so a slot whose counter already reads ``CMAX`` gets no atomic at all
(``CONFIG["skip_saturated"]``; the hot slots saturate within a few batches); summing equal
slots per block first (``lookup_agg`` / ``pooled_agg``) is a switch, off by default (H200:
slower than the skip). The kernels do not saturate: ``GPUCache`` clamps lazily.
Saturating adds of non-negative amounts compose,
``min(min(c + a, CMAX) + b, CMAX) == min(c + a + b, CMAX)``, so a stored counter ``c``
stands for ``min(c, CMAX)`` as long as it cannot overflow int32; the cache clamps every
counter it reads (insert planning, ``state()``) and clamps the whole array before the keys
counted since the last full clamp could push a counter past ``INT32_MAX``. The state is
therefore exactly the twin's ``min(initial + hits, CMAX)``, whatever the order of the adds.

Linear-table misses (``lookup(..., table=...)``, the LinearUVM path) are read in the probe
launch: a block of keys waits for its few host reads while other blocks gather hits from
device memory. The table's rows may be padded: row ``k`` starts ``k * table.stride(0)``
elements in (a ``SharedMemBlock`` rounds rows up to 16 bytes).

Small batches are visited in batch order. From ``CONFIG["linear_page_order"]`` keys a
batch over a table in host memory (0: never) is visited in row (= host page) order instead
(``page_order``: one int32 ``argsort``; each result still goes to its key's batch
position), so that neighbouring programs read neighbouring host pages. H200, 2026-12-01,
``bench_gpu_cache --only linear``, 4M-row table, 10% cache, Zipf 1.05, M keys/s (x zero-copy
``index_select``): batch order 334 (3.07x) / 278 (2.34x) / 277 (2.27x) at 64k / 256k / 1M
keys; page order 203 (1.87x) / 355 (2.99x) / 642 (5.25x); an earlier variant that read
only the misses, sorted, in a second launch after the probe: 172 / 298 / 544. No host sync
either way; the rows are the same bit for bit.

Pooled lookups split each bag over several programs (``pooled_split``) so that a few
hundred bags still fill the GPU; each program accumulates a ``[BLOCK_K, BLOCK_D]`` fp32
tile and reduces it once, and a second launch sums the partial rows in a fixed order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu.devices import on_tensor_device
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
def _bump(counters_ptr, slot, hit, BLOCK_K: tl.constexpr, AGG: tl.constexpr,
          SKIP_SAT: tl.constexpr, CMAX: tl.constexpr):
    """Add each hit to its slot's counter (fire-and-forget atomics).

    With ``AGG``, duplicates inside the block (Zipf batches repeat hot keys) are summed
    first, so a hot slot takes one atomic per block instead of one per key (same-address
    atomics serialize in L2), at the price of a ``[BLOCK_K, BLOCK_K]`` comparison.
    Fire-and-forget (``red``) either way. With ``SKIP_SAT``, a slot whose counter already
    reads ``CMAX`` or more takes no atomic at all (exact: the counter only grows during a
    launch, so a value read at ``CMAX`` stays saturated, and adds to it change nothing it
    stands for); a hot slot then costs one cached load per key instead of a serialized add.
    """
    if SKIP_SAT:
        c = tl.load(counters_ptr + slot, mask=hit, other=0)
        hit = hit & (c < CMAX)
    if AGG:
        i = tl.arange(0, BLOCK_K)
        same = (slot[:, None] == slot[None, :]) & hit[:, None] & hit[None, :]
        count = tl.reduce(same.to(tl.int32), 1, _add_combine)
        first = tl.reduce(tl.where(same, i[None, :], BLOCK_K), 1, _min_combine)
        tl.atomic_add(counters_ptr + slot, count, mask=hit & (first == i), sem="relaxed")
    else:
        tl.atomic_add(counters_ptr + slot, 1, mask=hit, sem="relaxed")


@triton.jit
def _collect(cand_ptr, cap, keys, offs, miss):
    """Append the ``miss`` keys of a block and their batch positions to the candidate
    buffer ``[count, keys[cap], positions[cap]]``: one atomic on the count per block; keys
    past ``cap`` are counted, not stored."""
    mi = miss.to(tl.int64)
    base = tl.atomic_add(cand_ptr, tl.reduce(mi, 0, _add_combine), sem="relaxed")
    pos = base + tl.associative_scan(mi, 0, _add_combine) - mi
    m = miss & (pos < cap)
    tl.store(cand_ptr + 1 + pos, keys, mask=m)
    tl.store(cand_ptr + 1 + cap + pos, offs, mask=m)


# NOTE: sizes that only bound masks are not specialized: a candidate capacity or batch
# size crossing a multiple of 16 would otherwise compile another variant (seconds) in the
# middle of serving.
@triton.jit(do_not_specialize=["n", "num_buckets", "num_rows", "cand_cap"])
def _lookup_kernel(
    keys_ptr, n, tkeys_ptr, counters_ptr, rows_ptr, stats_ptr, num_buckets,
    out_ptr, hit_ptr, slots_ptr, table_ptr, num_rows, tstride, dim, cand_ptr, cand_cap,
    order_ptr, HAS_CACHE: tl.constexpr, GATHER: tl.constexpr, LINEAR: tl.constexpr,
    WRITE_SLOTS: tl.constexpr, COUNT: tl.constexpr, COLLECT: tl.constexpr, WAYS: tl.constexpr,
    EMPTY: tl.constexpr, STAT_STRIPES: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, STREAM: tl.constexpr, AGG: tl.constexpr,
    SKIP_SAT: tl.constexpr, CMAX: tl.constexpr, ORDERED: tl.constexpr,
    WRITE_HIT: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = offs < n
    if ORDERED:
        # NOTE: visit the batch in the given order (host-page order, see page_order); every
        # result still goes to the key's own batch position
        offs = tl.load(order_ptr + offs, mask=kmask, other=0).to(tl.int64)
    keys = tl.load(keys_ptr + offs, mask=kmask, other=EMPTY)
    d = tl.arange(0, BLOCK_D)
    if EVEN_D:
        dmask = tl.full([BLOCK_D], 1, tl.int1)
    else:
        dmask = d < dim
    if HAS_CACHE:
        hit, slot = _probe(tkeys_ptr, keys, kmask, num_buckets, WAYS, EMPTY)
        if GATHER:
            vals = tl.load(rows_ptr + slot[:, None] * dim + d[None, :],
                           mask=hit[:, None] & dmask[None, :], other=0.0)
            if LINEAR:
                inrange = kmask & (keys >= 0) & (keys < num_rows) & (hit == 0)
                tval = tl.load(table_ptr + keys[:, None] * tstride + d[None, :],
                               mask=inrange[:, None] & dmask[None, :], other=0.0)
                vals = tl.where(hit[:, None], vals, tval)
    else:
        # NOTE: a disabled cache (the GPULayer path) is a plain gather: no probe load, no
        # cache-row load, no atomics.
        hit = offs < 0
        slot = offs * 0
        if GATHER:
            if LINEAR:
                inrange = kmask & (keys >= 0) & (keys < num_rows)
                vals = tl.load(table_ptr + keys[:, None] * tstride + d[None, :],
                               mask=inrange[:, None] & dmask[None, :], other=0.0)
            else:
                vals = tl.full([BLOCK_K, BLOCK_D], 0, rows_ptr.dtype.element_ty)
    if GATHER:
        optr = out_ptr + offs[:, None] * dim + d[None, :]
        omask = kmask[:, None] & dmask[None, :]
        if STREAM:
            tl.store(optr, vals, mask=omask, cache_modifier=".cs")
        else:
            tl.store(optr, vals, mask=omask)
    if WRITE_HIT:
        tl.store(hit_ptr + offs, hit.to(tl.int8), mask=kmask)
    if WRITE_SLOTS:
        tl.store(slots_ptr + offs, tl.where(hit, slot, -1), mask=kmask)
    if HAS_CACHE:
        if COUNT:
            # NOTE: fire-and-forget (result unused: a `red`, no round trip), issued after the
            # loads and stores so no warp waits on a contended hot slot; not saturated here
            # (see the module docstring for the lazy clamp).
            _bump(counters_ptr, slot, hit, BLOCK_K, AGG, SKIP_SAT, CMAX)
            nhits = tl.reduce(hit.to(tl.int64), 0, _add_combine)
            tl.atomic_add(stats_ptr + pid % STAT_STRIPES, nhits, sem="relaxed")
    if COLLECT:
        _collect(cand_ptr, cand_cap, keys, offs,
                 kmask & (hit == 0) & (keys >= 0) & (keys < num_rows))


@triton.jit(do_not_specialize=["num_buckets", "num_rows", "cand_cap"])
def _pooled_kernel(
    keys_ptr, offsets_ptr, weights_ptr, miss_ptr, tkeys_ptr, counters_ptr, rows_ptr,
    stats_ptr, num_buckets, out_ptr, part_ptr, hit_ptr, table_ptr, num_rows, tstride, dim,
    cand_ptr, cand_cap, HAS_CACHE: tl.constexpr, HAS_W: tl.constexpr, HAS_MISS: tl.constexpr,
    COLLECT: tl.constexpr,
    LINEAR: tl.constexpr, MEAN: tl.constexpr, SPLIT: tl.constexpr, WAYS: tl.constexpr,
    EMPTY: tl.constexpr, STAT_STRIPES: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, AGG: tl.constexpr, COUNT: tl.constexpr,
    SKIP_SAT: tl.constexpr, CMAX: tl.constexpr,
):
    bag = tl.program_id(0)
    split = tl.program_id(1)
    dchunk = tl.program_id(2)
    # NOTE: only the first dim chunk bumps counters, counts hits and writes ``hit``.
    first = tl.full([BLOCK_K], 0, tl.int32) + dchunk == 0
    start = tl.load(offsets_ptr + bag)
    end = tl.load(offsets_ptr + bag + 1)
    d = dchunk * BLOCK_D + tl.arange(0, BLOCK_D)
    if EVEN_D:
        dmask = tl.full([BLOCK_D], 1, tl.int1)  # dim is a multiple of BLOCK_D
    else:
        dmask = d < dim
    # NOTE: accumulate a [BLOCK_K, BLOCK_D] tile in registers and reduce it across keys once
    # at the end: a reduction per step would cost a shared-memory round and a barrier.
    acc = tl.full([BLOCK_K, BLOCK_D], 0.0, tl.float32)
    nhits = tl.full([BLOCK_K], 0, tl.int64)
    # NOTE: a while loop, not range(start, end, step): Triton 3.6's interpreter cannot take
    # loaded values as range bounds.
    s = start + split * BLOCK_K
    while s < end:
        offs = s + tl.arange(0, BLOCK_K).to(tl.int64)
        s += SPLIT * BLOCK_K
        kmask = offs < end
        keys = tl.load(keys_ptr + offs, mask=kmask, other=EMPTY)
        if HAS_CACHE:
            hit, slot = _probe(tkeys_ptr, keys, kmask, num_buckets, WAYS, EMPTY)
            vals = tl.load(
                rows_ptr + slot[:, None] * dim + d[None, :], mask=hit[:, None] & dmask[None, :],
                other=0.0,
            ).to(tl.float32)
            if LINEAR:
                inrange = kmask & (keys >= 0) & (keys < num_rows) & (hit == 0)
                tval = tl.load(
                    table_ptr + keys[:, None] * tstride + d[None, :],
                    mask=inrange[:, None] & dmask[None, :], other=0.0,
                ).to(tl.float32)
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
                vals = tl.load(
                    table_ptr + keys[:, None] * tstride + d[None, :],
                    mask=inrange[:, None] & dmask[None, :], other=0.0,
                ).to(tl.float32)
            elif HAS_MISS:
                vals = tl.load(
                    miss_ptr + offs[:, None] * dim + d[None, :],
                    mask=kmask[:, None] & dmask[None, :], other=0.0,
                ).to(tl.float32)
            else:
                vals = tl.full([BLOCK_K, BLOCK_D], 0.0, tl.float32)
        if HAS_W:
            w = tl.load(weights_ptr + offs, mask=kmask, other=0.0).to(tl.float32)
            vals = vals * w[:, None]
        acc += vals
        tl.store(hit_ptr + offs, hit.to(tl.int8), mask=kmask & first)
        if HAS_CACHE:
            if COUNT:
                _bump(counters_ptr, slot, hit & first, BLOCK_K, AGG, SKIP_SAT, CMAX)
            nhits += hit.to(tl.int64)
        if COLLECT:
            _collect(cand_ptr, cand_cap, keys, offs,
                     first & kmask & (hit == 0) & (keys >= 0) & (keys < num_rows))
    res = tl.reduce(acc, 0, _add_combine)
    if SPLIT == 1:
        if MEAN:
            res = res / tl.maximum(end - start, 1).to(tl.float32)
        tl.store(out_ptr + bag.to(tl.int64) * dim + d, res.to(out_ptr.dtype.element_ty),
                 mask=dmask)
    else:
        tl.store(part_ptr + (bag.to(tl.int64) * SPLIT + split) * dim + d, res, mask=dmask)
    if HAS_CACHE:
        total = tl.reduce(nhits, 0, _add_combine)
        if dchunk == 0:
            tl.atomic_add(stats_ptr + (bag * SPLIT + split) % STAT_STRIPES, total,
                          sem="relaxed")


@triton.jit
def _pool_finish_kernel(
    part_ptr, offsets_ptr, out_ptr, dim, MEAN: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
):
    """Sums the ``SPLIT`` fp32 partial rows of a bag in a fixed order (deterministic)."""
    bag = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    if EVEN_D:
        dmask = tl.full([BLOCK_D], 1, tl.int1)
    else:
        dmask = d < dim
    s = tl.arange(0, SPLIT)
    p = tl.load(part_ptr + (bag.to(tl.int64) * SPLIT + s)[:, None] * dim + d[None, :],
                mask=dmask[None, :], other=0.0)
    res = tl.reduce(p, 0, _add_combine)
    if MEAN:
        start = tl.load(offsets_ptr + bag)
        end = tl.load(offsets_ptr + bag + 1)
        res = res / tl.maximum(end - start, 1).to(tl.float32)
    tl.store(out_ptr + bag.to(tl.int64) * dim + d, res.to(out_ptr.dtype.element_ty), mask=dmask)


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


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _insert_probe_kernel(
    ks_ptr, n, tkeys_ptr, num_buckets, skey_ptr, slot_ptr, mark_ptr,
    WAYS: tl.constexpr, EMPTY: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Insert step 1, over the batch sorted by key: the last occurrence of each key is
    present (its slot; its slot marked pinned) or fresh (sort key = its bucket); every
    other position sorts after all buckets (``num_buckets``)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = offs < n
    k = tl.load(ks_ptr + offs, mask=kmask, other=EMPTY)
    nxt = tl.load(ks_ptr + offs + 1, mask=offs + 1 < n, other=EMPTY)
    is_last = kmask & ((offs + 1 >= n) | (nxt != k))
    hit, slot = _probe(tkeys_ptr, k, kmask, num_buckets, WAYS, EMPTY)
    present = is_last & hit
    fresh = is_last & (hit == 0)
    tl.store(skey_ptr + offs, tl.where(fresh, _bucket(k, num_buckets), num_buckets),
             mask=kmask)
    tl.store(slot_ptr + offs, tl.where(present, slot, -1), mask=kmask)
    tl.store(mark_ptr + slot, tl.full([BLOCK_K], 1, tl.int8), mask=present)


@triton.jit
def _insert_plan_kernel(
    sb_ptr, start_ptr, order_ptr, ks_ptr, src_ptr, slot_ptr, mark_ptr, n, tkeys_ptr,
    counters_ptr, num_buckets, trash, key_target_ptr, new_keys_ptr, new_counters_ptr,
    row_target_ptr, row_src_ptr, decay_ptr, stats_ptr,
    CMAX: tl.constexpr, DECAY_AT: tl.constexpr, WAYS: tl.constexpr, EMPTY: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Insert step 2, over the batch sorted by bucket: each new key's way (reads only; the
    table is written by the next launches, so every program sees the same snapshot)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = offs < n
    sb = tl.load(sb_ptr + offs, mask=kmask, other=num_buckets)
    rank = offs - tl.load(start_ptr + offs, mask=kmask, other=0)
    j = tl.load(order_ptr + offs, mask=kmask, other=0)
    k = tl.load(ks_ptr + j, mask=kmask, other=EMPTY)
    src = tl.load(src_ptr + j, mask=kmask, other=0)
    pslot = tl.load(slot_ptr + j, mask=kmask, other=-1)
    fresh = kmask & (sb < num_buckets)
    present = kmask & (pslot >= 0)
    b = tl.where(fresh, sb, 0)
    w = tl.arange(0, WAYS)
    bslots = (b * WAYS)[:, None] + w[None, :]
    fm = fresh[:, None]
    bkeys = tl.load(tkeys_ptr + bslots, mask=fm, other=EMPTY)
    bc = tl.minimum(tl.load(counters_ptr + bslots, mask=fm, other=0), CMAX)
    old = tl.reduce(bc, 1, _max_combine) >= DECAY_AT
    bc = tl.where(old[:, None], bc >> 1, bc)
    pinned = tl.load(mark_ptr + bslots, mask=fm, other=0) != 0
    score = tl.where(bkeys == EMPTY, -1, bc.to(tl.int64))
    score = tl.where(pinned, 1 << 40, score)
    # position of way w in a stable ascending sort of the scores
    sv = score[:, None, :]
    sw = score[:, :, None]
    before = (sv < sw) | ((sv == sw) & (w[None, None, :] < w[None, :, None]))
    pos = tl.reduce(before.to(tl.int32), 2, _add_combine)
    avail = WAYS - tl.reduce(pinned.to(tl.int32), 1, _add_combine)
    ok = fresh & (rank < avail)
    sel = pos == rank[:, None]
    pick = tl.reduce(tl.where(sel, w[None, :], WAYS), 1, _min_combine)
    pick = tl.minimum(pick, WAYS - 1)
    chosen = w[None, :] == pick[:, None]
    victim = tl.reduce(tl.where(chosen, bkeys, 0), 1, _add_combine)
    newc = tl.minimum(tl.reduce(tl.where(chosen, bc, 0), 1, _add_combine) + 1, CMAX)
    new_slot = b * WAYS + pick
    tl.store(key_target_ptr + offs, tl.where(ok, new_slot, trash), mask=kmask)
    tl.store(new_keys_ptr + offs, k, mask=kmask)
    tl.store(new_counters_ptr + offs, newc, mask=kmask)
    tl.store(row_target_ptr + offs, tl.where(ok, new_slot, tl.where(present, pslot, trash)),
             mask=kmask)
    tl.store(row_src_ptr + offs, src, mask=kmask)
    # the first new key of a bucket that takes a way decays (and clamps) the bucket
    tl.store(decay_ptr + offs, (fresh & (rank == 0) & (avail > 0)).to(tl.int8), mask=kmask)
    placed = tl.reduce(ok.to(tl.int64), 0, _add_combine)
    evicted = tl.reduce((ok & (victim != EMPTY)).to(tl.int64), 0, _add_combine)
    dropped = tl.reduce((fresh & (ok == 0)).to(tl.int64), 0, _add_combine)
    tl.atomic_add(stats_ptr, placed, sem="relaxed")
    tl.atomic_add(stats_ptr + 1, evicted, sem="relaxed")
    tl.atomic_add(stats_ptr + 2, dropped, sem="relaxed")


@triton.jit
def _insert_decay_kernel(
    sb_ptr, decay_ptr, n, counters_ptr, CMAX: tl.constexpr, DECAY_AT: tl.constexpr,
    WAYS: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Insert step 3: clamp, and halve where due, the counters of buckets taking keys."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    m = (offs < n) & (tl.load(decay_ptr + offs, mask=offs < n, other=0) != 0)
    b = tl.load(sb_ptr + offs, mask=m, other=0)
    w = tl.arange(0, WAYS)
    bslots = (b * WAYS)[:, None] + w[None, :]
    bc = tl.minimum(tl.load(counters_ptr + bslots, mask=m[:, None], other=0), CMAX)
    old = tl.reduce(bc, 1, _max_combine) >= DECAY_AT
    bc = tl.where(old[:, None], bc >> 1, bc)
    tl.store(counters_ptr + bslots, bc, mask=m[:, None])


@triton.jit
def _insert_apply_kernel(
    key_target_ptr, new_keys_ptr, new_counters_ptr, n, tkeys_ptr, counters_ptr, trash,
    BLOCK_K: tl.constexpr,
):
    """Insert step 4: the new keys and their counters (rows follow with scatter_rows)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = offs < n
    t = tl.load(key_target_ptr + offs, mask=kmask, other=trash)
    m = kmask & (t != trash)
    tl.store(tkeys_ptr + t, tl.load(new_keys_ptr + offs, mask=m), mask=m)
    tl.store(counters_ptr + t, tl.load(new_counters_ptr + offs, mask=m), mask=m)


# ---------------------------------------------------------------- launchers

#: tile sizes; the bench may override them (``--sweep``) to pick better ones per GPU.
CONFIG: dict[str, int] = {
    "lookup_block_k": 16,
    "lookup_warps": 4,
    "lookup_stream": 0,  # 1: store gathered rows with .cs (streaming, evict first)
    "lookup_agg": 0,  # 1: one counter atomic per distinct slot of a block (see _bump)
    # from this many keys a batch over a host table is visited in page order (page_order;
    # 0: never)
    "linear_page_order": 1 << 17,
    "pooled_block_k": 64,
    "pooled_warps": 8,
    "pooled_block_d": 0,  # 0: the whole row in one program
    "pooled_programs": 256,  # split bags over about this many programs in all
    "pooled_max_split": 64,
    "pooled_agg": 0,
    "skip_saturated": 1,  # 1: no counter atomic for a slot already at cmax (see _bump)
    "scatter_block_k": 16,
    "insert_block_k": 32,
}
if triton.knobs.runtime.interpret:
    # NOTE: the interpreter runs a block's [BLOCK_K, BLOCK_K] duplicate-slot comparison in
    # numpy: small blocks keep the CPU tests fast (and cover many programs per launch).
    CONFIG.update(lookup_block_k=8, pooled_block_k=8, insert_block_k=8)


# NOTE: plain integer helpers: triton.cdiv / triton.next_power_of_2 are constexpr
# functions in Triton 3.6 and cost microseconds of host time per call.
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block_d(dim: int) -> int:
    return max(16, 1 << (dim - 1).bit_length())


def _row_stride(table: torch.Tensor | None, dim: int) -> int:
    """Elements from one row of a linear table to the next (its rows may be padded, as a
    ``SharedMemBlock``'s are to 16 bytes; elements within a row are contiguous)."""
    return dim if table is None else table.stride(0)


def _cand_cap(candidates: torch.Tensor | None) -> int:
    return 0 if candidates is None else (candidates.numel() - 1) // 2


@on_tensor_device
def lookup(
    keys: torch.Tensor, tkeys: torch.Tensor, counters: torch.Tensor, rows: torch.Tensor,
    stats: torch.Tensor, num_buckets: int, ways: int, *, empty: int, gather: bool,
    count: bool, want_slots: bool, table: torch.Tensor | None = None,
    candidates: torch.Tensor | None = None, host_table: bool = True, cmax: int,
    rotate: int = 0,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Probe (+ gather, + linear-table misses) of ``keys``: ``(values, hit, slots)``.

    Hit slots' counters get one unsaturated add per key (the caller clamps lazily), none
    where a counter already reads ``cmax`` (with ``CONFIG["skip_saturated"]``).
    ``candidates``: a zeroed int64 buffer ``[1 + 2 * cap]`` (see ``cache.MissCandidates``)
    that receives the in-range misses of a linear lookup (count, keys, batch positions).
    ``host_table``: the linear table lives in host memory, so large batches are visited
    in host-page order (a table in GPU memory never is); ``rotate`` shifts where that order
    starts (see :func:`page_order`).
    """
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
    order = _visit_order(keys, table, host_table, rotate) if gather else None
    _lookup_kernel[(_cdiv(n, bk),)](
        keys, n, tkeys, counters, rows, stats, max(num_buckets, 1),
        out if out is not None else keys, hit.view(torch.int8),
        slots if slots is not None else keys, table if linear else rows,
        table.shape[0] if table is not None else 0, _row_stride(table, dim), dim,
        candidates if candidates is not None else keys, _cand_cap(candidates),
        order if order is not None else keys,
        HAS_CACHE=num_buckets > 0, GATHER=gather, LINEAR=linear, WRITE_SLOTS=want_slots,
        COUNT=count, COLLECT=candidates is not None, WAYS=ways,
        EMPTY=empty, STAT_STRIPES=stats.numel(),
        BLOCK_K=bk, BLOCK_D=bd, EVEN_D=bd == dim, STREAM=bool(CONFIG["lookup_stream"]),
        AGG=bool(CONFIG["lookup_agg"]), SKIP_SAT=bool(CONFIG["skip_saturated"]),
        CMAX=cmax, ORDERED=order is not None, WRITE_HIT=True,
        num_warps=CONFIG["lookup_warps"],
    )
    return out, hit, slots


@on_tensor_device
def gather(keys: torch.Tensor, table: torch.Tensor, *, host_table: bool) -> torch.Tensor:
    """Rows ``table[keys]`` (zero rows for keys outside the table): the GPULayer lookup.

    The lookup kernel with no cache to probe and no hit flags to write, launched with as
    little host work as possible (a 64k-key call is bound by it); large batches over a
    host table are visited in page order, as in :func:`lookup`.
    """
    n = keys.numel()
    dim = table.shape[1]
    out = torch.empty((n, dim), dtype=table.dtype, device=keys.device)
    if n == 0:
        return out
    bk = CONFIG["lookup_block_k"]
    bd = _block_d(dim)
    order = _visit_order(keys, table, host_table, 0)
    _lookup_kernel[(_cdiv(n, bk),)](
        keys, n, keys, keys, table, keys, 1, out, keys, keys, table, table.shape[0],
        table.stride(0), dim, keys, 0, order if order is not None else keys,
        HAS_CACHE=False, GATHER=True, LINEAR=True, WRITE_SLOTS=False, COUNT=False,
        COLLECT=False, WAYS=1, EMPTY=0, STAT_STRIPES=1, BLOCK_K=bk, BLOCK_D=bd,
        EVEN_D=bd == dim, STREAM=bool(CONFIG["lookup_stream"]), AGG=False, SKIP_SAT=False,
        CMAX=0, ORDERED=order is not None, WRITE_HIT=False,
        num_warps=CONFIG["lookup_warps"],
    )
    return out


def _visit_order(keys: torch.Tensor, table: torch.Tensor | None, host_table: bool,
                 rotate: int) -> torch.Tensor | None:
    """The order a lookup visits its batch in: None (batch order), or page order for a
    batch of ``CONFIG["linear_page_order"]`` keys or more over a table in host memory."""
    from_n = CONFIG["linear_page_order"]
    if table is None or not host_table or not 0 < from_n <= keys.numel():
        return None
    return page_order(keys, table.shape[0], rotate)


def page_order(keys: torch.Tensor, num_rows: int, rotate: int) -> torch.Tensor:
    """Batch positions in the order of the keys' rows in a linear table of ``num_rows``
    rows, starting at row ``rotate`` and wrapping around (keys outside the table land
    anywhere: the kernel masks them). Neighbouring programs then read neighbouring host
    pages. The rotation matters when a lookup lists only its first misses
    (``candidates``): from row 0 every time, the low rows' misses would always be the
    ones admitted."""
    r = (keys - rotate) % max(num_rows, 1)
    if num_rows <= 1 << 31:
        r = r.to(torch.int32)  # half the radix passes
    return torch.argsort(r)


def pooled_split(n: int, nbags: int, dchunks: int) -> int:
    """Programs per bag (a power of two): enough to fill the GPU, none idle on average."""
    bk = CONFIG["pooled_block_k"]
    per_bag = max(1, -(-n // max(nbags, 1)))  # average bag length, rounded up
    useful = -(-per_bag // bk)  # key blocks of an average bag
    want = -(-CONFIG["pooled_programs"] // max(nbags * dchunks, 1))
    split = max(1, min(useful, want, CONFIG["pooled_max_split"]))
    return 1 << (split.bit_length() - 1)


@on_tensor_device
def pooled(
    keys: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
    miss_values: torch.Tensor | None, tkeys: torch.Tensor, counters: torch.Tensor,
    rows: torch.Tensor, stats: torch.Tensor, num_buckets: int, ways: int, *, mean: bool,
    empty: int, table: torch.Tensor | None = None, candidates: torch.Tensor | None = None,
    count: bool = True, cmax: int, out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Probe + gather + pool per bag, fused: ``(pooled [B, dim], hit [N])``; ``candidates``
    as in :func:`lookup`; ``out_dtype``: of ``pooled`` (default the rows' dtype; the sums
    are fp32 either way).

    Each bag is split over ``pooled_split`` programs (key blocks dealt round robin); with
    more than one, the programs write fp32 partial rows and a second launch sums them in a
    fixed order, so results are deterministic.
    """
    n = keys.numel()
    nbags = offsets.numel() - 1
    dim = rows.shape[1]
    out = torch.empty((nbags, dim), dtype=out_dtype or rows.dtype, device=keys.device)
    hit = torch.empty(n, dtype=torch.bool, device=keys.device)
    if nbags == 0:
        return out, hit
    bd = CONFIG["pooled_block_d"] or _block_d(dim)
    bd = min(bd, _block_d(dim))
    nd = _cdiv(dim, bd)
    split = pooled_split(n, nbags, nd)
    part = (torch.empty((nbags, split, dim), dtype=torch.float32, device=keys.device)
            if split > 1 else out)
    linear = table is not None
    even_d = dim % bd == 0
    _pooled_kernel[(nbags, split, nd)](
        keys, offsets, weights if weights is not None else rows,
        miss_values if miss_values is not None else rows, tkeys, counters, rows, stats,
        max(num_buckets, 1), out, part, hit.view(torch.int8), table if linear else rows,
        table.shape[0] if table is not None else 0, _row_stride(table, dim), dim,
        candidates if candidates is not None else keys, _cand_cap(candidates),
        HAS_CACHE=num_buckets > 0, HAS_W=weights is not None,
        HAS_MISS=miss_values is not None,
        COLLECT=candidates is not None, LINEAR=linear, MEAN=mean,
        SPLIT=split, WAYS=ways,
        EMPTY=empty, STAT_STRIPES=stats.numel(), BLOCK_K=CONFIG["pooled_block_k"],
        BLOCK_D=bd, EVEN_D=even_d, AGG=bool(CONFIG["pooled_agg"]), COUNT=count,
        SKIP_SAT=bool(CONFIG["skip_saturated"]), CMAX=cmax,
        num_warps=CONFIG["pooled_warps"],
    )
    if split > 1:
        _pool_finish_kernel[(nbags, nd)](
            part, offsets, out, dim, MEAN=mean, SPLIT=split, BLOCK_D=bd, EVEN_D=even_d,
            num_warps=4,
        )
    return out, hit


@on_tensor_device
def scatter_rows(
    rows: torch.Tensor, target: torch.Tensor, values: torch.Tensor, src: torch.Tensor
) -> None:
    """``rows[target[i]] = values[src[i]]`` for distinct targets."""
    n = target.numel()
    if n == 0:
        return
    bk = CONFIG["scatter_block_k"]
    _scatter_rows_kernel[(_cdiv(n, bk),)](
        rows, target, values, src, n, rows.shape[1], BLOCK_K=bk, BLOCK_D=_block_d(rows.shape[1]),
    )


@on_tensor_device
def insert(
    keys: torch.Tensor, values: torch.Tensor, tkeys: torch.Tensor, counters: torch.Tensor,
    rows_all: torch.Tensor, stats: torch.Tensor, num_buckets: int, ways: int, *, empty: int,
    cmax: int, decay_at: int,
) -> None:
    """Insert ``keys``/``values`` (non-empty) with no host sync: the same placements as
    ``gpu.cache_twin.plan_insert`` in two sorts and five launches. ``rows_all`` has the
    trash row at index ``tkeys.numel()``; ``stats`` (int64 [3]) gains placed, evicted
    and dropped counts."""
    n = keys.numel()
    trash = tkeys.numel()
    bk = CONFIG["insert_block_k"]
    grid = (_cdiv(n, bk),)
    ks, src = torch.sort(keys, stable=True)
    skey = torch.empty_like(ks)
    slot = torch.empty_like(ks)
    mark = torch.zeros(trash, dtype=torch.int8, device=keys.device)
    _insert_probe_kernel[grid](ks, n, tkeys, num_buckets, skey, slot, mark, WAYS=ways,
                               EMPTY=empty, BLOCK_K=bk)
    sb, order = torch.sort(skey, stable=True)
    start = torch.searchsorted(sb, sb)
    key_target = torch.empty_like(ks)
    new_keys = torch.empty_like(ks)
    new_counters = torch.empty(n, dtype=counters.dtype, device=keys.device)
    row_target = torch.empty_like(ks)
    row_src = torch.empty_like(ks)
    decay = torch.empty(n, dtype=torch.int8, device=keys.device)
    _insert_plan_kernel[grid](
        sb, start, order, ks, src, slot, mark, n, tkeys, counters, num_buckets, trash,
        key_target, new_keys, new_counters, row_target, row_src, decay, stats,
        CMAX=cmax, DECAY_AT=decay_at, WAYS=ways, EMPTY=empty, BLOCK_K=bk)
    _insert_decay_kernel[grid](sb, decay, n, counters, CMAX=cmax, DECAY_AT=decay_at,
                               WAYS=ways, BLOCK_K=bk)
    _insert_apply_kernel[grid](key_target, new_keys, new_counters, n, tkeys, counters, trash,
                               BLOCK_K=bk)
    scatter_rows(rows_all, row_target, values, row_src)
