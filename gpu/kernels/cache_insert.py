# ruff: noqa: N803  (Triton convention: compile-time constants are UPPER_CASE parameters)
"""Triton kernels of the GPU cache's writes (``gpu.cache.gpu_cache.GPUCache.insert``, row scatters).

Loaded only through :func:`gpu.kernels.triton_access.kernel_module`, compiled for CUDA tensors or
interpreted for CPU tensors, like :mod:`gpu.kernels.cache_lookup` (the table layout is described
there; a key's slot is found with ``probe`` of :mod:`gpu.kernels.cache_probe`).

Insert without a host sync: the plan has no data-dependent shape. Every batch position
gets a target slot, and positions that write nothing target the *trash slot* one past the
table (``rows_all`` / the table tensors have ``slots + 1`` entries). Two sorts and six
launches make the same placements as ``gpu.cache.twin.plan_insert``. First what reads
nothing of the table (:func:`sort_keys`, :func:`sort_buckets`; a LinearUVM round runs it
on a side stream while lookups go on, :mod:`gpu.stacks.misses.split_round`):

1. a stable sort by key (as int32 for a linear table's rows);
2. :func:`_insert_last_kernel`: the last occurrence of each key gets its bucket as an
   int32 sort key, then a stable sort by bucket, and where each bucket's run starts;

then, in stream order (:func:`apply_insert`):

3. :func:`_insert_probe_kernel`: which keys the table holds (their slots, marked
   pinned), and :func:`_insert_plan_kernel`: each new key's way, from a snapshot of its
   bucket (reads only, so every program sees the same table);
4. :func:`_insert_decay_kernel`: clamp, and halve where due, the counters of buckets that
   take keys;
5. :func:`_insert_apply_kernel`: the new keys and counters; :func:`scatter_rows`: the rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu.cache.records import PreparedInsert
from gpu.cuda.devices import on_tensor_device
from gpu.kernels.launch import DirectLaunch
from gpu.kernels.tiles import Tiles
from gpu.kernels.triton_access import helper_module
from hostcache.layout import EMPTY_KEY

# NOTE: helpers decorated like this module's kernels (compiled or interpreted)
bucket_of = helper_module("key_hash").bucket_of
_parts = helper_module("cache_probe")
probe = _parts.probe
add_combine = _parts.add_combine
min_combine = _parts.min_combine


# NOTE: batch sizes and table sizes are not specialized (as in gpu.kernels.cache_lookup):
# a replica's sizes would otherwise compile variants its node's warm-up did not
@triton.jit(do_not_specialize=["n"])
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


@triton.jit(do_not_specialize=["n", "num_buckets"])
def _insert_last_kernel(
    ks_ptr, n, num_buckets, skey_ptr, EMPTY: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Insert step 2, over the batch sorted by key, reading nothing of the table: the last
    occurrence of each key sorts by its bucket (an int32 sort key: half the radix passes
    of int64); every other position, and the empty marker, after all buckets."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = offs < n
    k = tl.load(ks_ptr + offs, mask=kmask, other=EMPTY)
    nxt = tl.load(ks_ptr + offs + 1, mask=offs + 1 < n, other=EMPTY)
    is_last = kmask & ((offs + 1 >= n) | (nxt != k))
    # NOTE: the empty marker is never placed (a padded batch: gpu.stacks.misses.miss_log)
    keep = is_last & (k != EMPTY)
    tl.store(skey_ptr + offs,
             tl.where(keep, bucket_of(k, num_buckets), num_buckets).to(tl.int32),
             mask=kmask)


@triton.jit(do_not_specialize=["n", "num_buckets"])
def _insert_probe_kernel(
    sb_ptr, order_ptr, ks_ptr, n, tkeys_ptr, num_buckets, slot_ptr, mark_ptr,
    WAYS: tl.constexpr, EMPTY: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Insert step 3, over the batch sorted by bucket: which of its keys the table holds
    (their slot, marked pinned), -1 for the others."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = offs < n
    sb = tl.load(sb_ptr + offs, mask=kmask, other=num_buckets)
    valid = kmask & (sb < num_buckets)
    j = tl.load(order_ptr + offs, mask=valid, other=0)
    k = tl.load(ks_ptr + j, mask=valid, other=EMPTY)
    hit, slot = probe(tkeys_ptr, k, valid, num_buckets, WAYS, EMPTY)
    present = valid & hit
    tl.store(slot_ptr + offs, tl.where(present, slot, -1), mask=kmask)
    tl.store(mark_ptr + slot, tl.full([BLOCK_K], 1, tl.int8), mask=present)


@triton.jit(do_not_specialize=["n", "num_buckets", "trash"])
def _insert_plan_kernel(
    sb_ptr, start_ptr, order_ptr, ks_ptr, src_ptr, slot_ptr, mark_ptr, n, tkeys_ptr,
    counters_ptr, num_buckets, trash, key_target_ptr, new_keys_ptr, new_counters_ptr,
    row_target_ptr, row_src_ptr, decay_ptr, stats_ptr,
    CMAX: tl.constexpr, DECAY_AT: tl.constexpr, WAYS: tl.constexpr, EMPTY: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Insert step 3, then: over the batch sorted by bucket, each new key's way (reads only; the
    table is written by the next launches, so every program sees the same snapshot)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = offs < n
    sb = tl.load(sb_ptr + offs, mask=kmask, other=num_buckets)
    j = tl.load(order_ptr + offs, mask=kmask, other=0)
    k = tl.load(ks_ptr + j, mask=kmask, other=EMPTY)
    src = tl.load(src_ptr + j, mask=kmask, other=0)
    pslot = tl.load(slot_ptr + offs, mask=kmask, other=-1)
    present = kmask & (pslot >= 0)
    fresh = kmask & (sb < num_buckets) & (pslot < 0)
    # a new key's rank among the new keys of its bucket: its place in the bucket's run
    # less the keys the table holds before it there. Those are at most WAYS (each holds a
    # way of the bucket), so a run place past 2 * WAYS ranks past every way: counting the
    # held keys over the 2 * WAYS places before it is exact wherever the rank matters.
    run = offs - tl.load(start_ptr + offs, mask=kmask, other=0)
    held = tl.full([BLOCK_K], 0, tl.int64)
    for t in tl.static_range(1, 2 * WAYS + 1):
        before = kmask & (run >= t)
        held += (tl.load(slot_ptr + offs - t, mask=before, other=-1) >= 0).to(tl.int64)
    rank = run - held
    b = tl.where(fresh, sb, 0).to(tl.int64)
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
    pos = tl.reduce(before.to(tl.int32), 2, add_combine)
    avail = WAYS - tl.reduce(pinned.to(tl.int32), 1, add_combine)
    ok = fresh & (rank < avail)
    sel = pos == rank[:, None]
    pick = tl.reduce(tl.where(sel, w[None, :], WAYS), 1, min_combine)
    pick = tl.minimum(pick, WAYS - 1)
    chosen = w[None, :] == pick[:, None]
    victim = tl.reduce(tl.where(chosen, bkeys, 0), 1, add_combine)
    newc = tl.minimum(tl.reduce(tl.where(chosen, bc, 0), 1, add_combine) + 1, CMAX)
    new_slot = b * WAYS + pick
    tl.store(key_target_ptr + offs, tl.where(ok, new_slot, trash), mask=kmask)
    tl.store(new_keys_ptr + offs, k, mask=kmask)
    tl.store(new_counters_ptr + offs, newc, mask=kmask)
    tl.store(row_target_ptr + offs, tl.where(ok, new_slot, tl.where(present, pslot, trash)),
             mask=kmask)
    tl.store(row_src_ptr + offs, src, mask=kmask)
    # the first new key of a bucket that takes a way decays (and clamps) the bucket
    tl.store(decay_ptr + offs, (fresh & (rank == 0) & (avail > 0)).to(tl.int8), mask=kmask)
    placed = tl.reduce(ok.to(tl.int64), 0, add_combine)
    evicted = tl.reduce((ok & (victim != EMPTY)).to(tl.int64), 0, add_combine)
    dropped = tl.reduce((fresh & (ok == 0)).to(tl.int64), 0, add_combine)
    tl.atomic_add(stats_ptr, placed, sem="relaxed")
    tl.atomic_add(stats_ptr + 1, evicted, sem="relaxed")
    tl.atomic_add(stats_ptr + 2, dropped, sem="relaxed")


@triton.jit(do_not_specialize=["n"])
def _insert_decay_kernel(
    sb_ptr, decay_ptr, n, counters_ptr, CMAX: tl.constexpr, DECAY_AT: tl.constexpr,
    WAYS: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Insert step 4: clamp, and halve where due, the counters of buckets taking keys."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    m = (offs < n) & (tl.load(decay_ptr + offs, mask=offs < n, other=0) != 0)
    b = tl.load(sb_ptr + offs, mask=m, other=0).to(tl.int64)
    w = tl.arange(0, WAYS)
    bslots = (b * WAYS)[:, None] + w[None, :]
    bc = tl.minimum(tl.load(counters_ptr + bslots, mask=m[:, None], other=0), CMAX)
    old = tl.reduce(bc, 1, _max_combine) >= DECAY_AT
    bc = tl.where(old[:, None], bc >> 1, bc)
    tl.store(counters_ptr + bslots, bc, mask=m[:, None])


@triton.jit(do_not_specialize=["n", "trash"])
def _insert_apply_kernel(
    key_target_ptr, new_keys_ptr, new_counters_ptr, n, tkeys_ptr, counters_ptr, trash,
    BLOCK_K: tl.constexpr,
):
    """Insert step 5: the new keys and their counters (rows follow with scatter_rows)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = offs < n
    t = tl.load(key_target_ptr + offs, mask=kmask, other=trash)
    m = kmask & (t != trash)
    tl.store(tkeys_ptr + t, tl.load(new_keys_ptr + offs, mask=m), mask=m)
    tl.store(counters_ptr + t, tl.load(new_counters_ptr + offs, mask=m), mask=m)


# ---------------------------------------------------------------- launchers

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block_d(dim: int) -> int:
    return max(16, 1 << (dim - 1).bit_length())


# NOTE: launched directly (gpu.kernels.launch): an admission round is five of these launches, and
# the JIT's per-call binding costs more than each launch
_LAST = DirectLaunch(_insert_last_kernel)
_PROBE = DirectLaunch(_insert_probe_kernel)
_PLAN = DirectLaunch(_insert_plan_kernel)
_DECAY = DirectLaunch(_insert_decay_kernel)
_APPLY = DirectLaunch(_insert_apply_kernel)
_SCATTER = DirectLaunch(_scatter_rows_kernel)
_CX: dict[tuple[object, ...], dict[str, object]] = {}


def _launch(launcher: DirectLaunch, grid: tuple[int, ...], args: tuple[object, ...],
            key: tuple[object, ...], **constexprs: object) -> None:
    cx = _CX.get(key)
    if cx is None:
        cx = _CX[key] = constexprs
    launcher(grid, args, cx, key)


@on_tensor_device
def scatter_rows(
    rows: torch.Tensor, target: torch.Tensor, values: torch.Tensor, src: torch.Tensor, *,
    tiles: Tiles,
) -> None:
    """``rows[target[i]] = values[src[i]]`` for distinct targets."""
    n = target.numel()
    if n == 0:
        return
    bk = tiles.scatter_block_k
    dim = rows.shape[1]
    _launch(_SCATTER, (_cdiv(n, bk),), (rows, target, values, src, n, dim),
            ("scatter", rows.dtype, values.dtype, bk, dim), BLOCK_K=bk, BLOCK_D=_block_d(dim))


@on_tensor_device
def sort_keys(keys: torch.Tensor, p: PreparedInsert, small: bool = False) -> None:
    """Insert step 1 (reads nothing of the table): ``keys`` copied into ``p.keys`` (unless
    they are its own: they may change meanwhile, a log that lookups keep appending to)
    and sorted, stably, into ``p.ks`` / ``p.src``. ``small``: every key is the empty
    marker or in ``[0, 2**31)`` (a linear table's rows), so they sort as int32, half the
    radix passes, with the same order."""
    if keys is not p.keys:
        p.keys.copy_(keys)
    if small:
        # NOTE: the empty marker (INT64_MIN) becomes -1: still first, as it sorts as int64
        p.skey.copy_(p.keys.clamp(min=-1))
        torch.sort(p.skey, stable=True, out=(p.sb, p.src))
        torch.index_select(p.keys, 0, p.src, out=p.ks)
    else:
        torch.sort(p.keys, stable=True, out=(p.ks, p.src))


@on_tensor_device
def sort_buckets(p: PreparedInsert, num_buckets: int, *, tiles: Tiles) -> None:
    """Insert step 2 (reads nothing of the table): each sorted position's bucket sort key
    (a launch), the batch sorted by it, and where each bucket's run starts."""
    n = p.ks.numel()
    # NOTE: bucket indices sort as int32 (a cache of 2**31 buckets would need 2**34 slots)
    assert num_buckets < 1 << 31
    bk = tiles.insert_block_k
    _launch(_LAST, (_cdiv(n, bk),), (p.ks, n, num_buckets, p.skey), ("last", bk),
            EMPTY=EMPTY_KEY, BLOCK_K=bk)
    torch.sort(p.skey, stable=True, out=(p.sb, p.order))
    torch.searchsorted(p.sb, p.sb, out=p.start)


def prepare_insert(keys: torch.Tensor, num_buckets: int, *, tiles: Tiles) -> PreparedInsert:
    """Steps 1 and 2 of inserting ``keys`` (non-empty) into fresh buffers."""
    p = PreparedInsert.empty(keys.numel(), keys.device, keys)
    sort_keys(keys, p)
    sort_buckets(p, num_buckets, tiles=tiles)
    return p


@on_tensor_device
def apply_insert(
    p: PreparedInsert, values: torch.Tensor, tkeys: torch.Tensor, counters: torch.Tensor,
    rows_all: torch.Tensor, stats: torch.Tensor, num_buckets: int, ways: int, *, cmax: int,
    decay_at: int, tiles: Tiles,
) -> None:
    """The steps that read and write the table, in the caller's stream order: the same
    placements as ``gpu.cache.twin.plan_insert`` for the keys ``p`` was prepared from,
    whatever the table became since. ``rows_all`` has the trash row at index
    ``tkeys.numel()``; ``stats`` (int64 [3]) gains placed, evicted and dropped counts."""
    n = p.ks.numel()
    trash = tkeys.numel()
    bk = tiles.insert_block_k
    grid = (_cdiv(n, bk),)
    empty = EMPTY_KEY
    slot = torch.empty_like(p.ks)
    mark = torch.zeros(trash, dtype=torch.int8, device=tkeys.device)
    _launch(_PROBE, grid, (p.sb, p.order, p.ks, n, tkeys, num_buckets, slot, mark),
            ("probe", ways, bk), WAYS=ways, EMPTY=empty, BLOCK_K=bk)
    key_target = torch.empty_like(p.ks)
    new_keys = torch.empty_like(p.ks)
    new_counters = torch.empty(n, dtype=counters.dtype, device=tkeys.device)
    row_target = torch.empty_like(p.ks)
    row_src = torch.empty_like(p.ks)
    decay = torch.empty(n, dtype=torch.int8, device=tkeys.device)
    _launch(_PLAN, grid,
            (p.sb, p.start, p.order, p.ks, p.src, slot, mark, n, tkeys, counters,
             num_buckets, trash, key_target, new_keys, new_counters, row_target, row_src,
             decay, stats),
            ("plan", counters.dtype, cmax, decay_at, ways, bk),
            CMAX=cmax, DECAY_AT=decay_at, WAYS=ways, EMPTY=empty, BLOCK_K=bk)
    _launch(_DECAY, grid, (p.sb, decay, n, counters),
            ("decay", counters.dtype, cmax, decay_at, ways, bk),
            CMAX=cmax, DECAY_AT=decay_at, WAYS=ways, BLOCK_K=bk)
    _launch(_APPLY, grid, (key_target, new_keys, new_counters, n, tkeys, counters, trash),
            ("apply", counters.dtype, bk), BLOCK_K=bk)
    scatter_rows(rows_all, row_target, values, row_src, tiles=tiles)


@on_tensor_device
def insert(
    keys: torch.Tensor, values: torch.Tensor, tkeys: torch.Tensor, counters: torch.Tensor,
    rows_all: torch.Tensor, stats: torch.Tensor, num_buckets: int, ways: int, *, cmax: int,
    decay_at: int, tiles: Tiles,
) -> None:
    """Insert ``keys``/``values`` (non-empty) with no host sync: :func:`prepare_insert`
    then :func:`apply_insert`."""
    apply_insert(prepare_insert(keys, num_buckets, tiles=tiles), values, tkeys, counters,
                 rows_all, stats, num_buckets, ways, cmax=cmax, decay_at=decay_at, tiles=tiles)
