# ruff: noqa: N803  (Triton convention: compile-time constants are UPPER_CASE parameters)
"""Triton kernels of the GPU cache's lookups (``gpu.cache.gpu_cache.GPUCache``).

Loaded only through :func:`gpu.kernels.triton_access.kernel_module`, compiled for CUDA tensors or
interpreted for CPU tensors. Table layout (structure of arrays, slot ``b * WAYS + w`` is
way ``w`` of bucket ``b``):

* ``tkeys``    int64 ``[slots]``, ``EMPTY`` where free;
* ``counters`` int32 ``[slots]``, the eviction-policy counter (hits; clamped lazily);
* ``rows``     ``[slots, dim]`` contiguous;
* ``stats``    int64 ``[STAT_STRIPES]``, hit counts striped by program id (summed on read).

Probe: one key costs one load of its bucket's ``WAYS`` keys (64 bytes at 8 ways, loaded
as one ``[BLOCK_K, WAYS]`` tile), then the hit rows are gathered as a ``[BLOCK_K, dim]``
tile with wide loads. The bucket hash is ``hostcache.hashing.bucket_of`` written with the
same integer operations (:mod:`gpu.kernels.key_hash`), so the CPU twin and these kernels agree
bit for bit.

Counters: a hit adds 1 to its slot's counter, unsaturated, with a fire-and-forget atomic
(none where the counter already reads ``CMAX``); ``GPUCache`` clamps lazily, so the state
is exactly the twin's (see :mod:`gpu.kernels.cache_probe`).

Linear-table misses (``lookup(..., table=...)``, the LinearUVM path) are read in the probe
launch: a block of keys waits for its few host reads while other blocks gather hits from
device memory. The table's rows may be padded: row ``k`` starts ``k * table.stride(0)``
elements in (a ``SharedMemBlock`` rounds rows up to 16 bytes).

Small batches are visited in batch order. From ``Tiles.linear_page_order`` keys (the
cache's :class:`gpu.kernels.tiles.Tiles`) a batch over a table in host memory (0: never) is
visited in row (= host page) order instead
(``page_order``: one int32 ``argsort``; each result still goes to its key's batch
position), so that neighbouring programs read neighbouring host pages: slower than batch
order for small batches, faster for large ones (bench/RESULTS.md, "GPU cache kernels",
"LinearUVM: batch order vs host-page order"). No host sync either way; the rows are the
same bit for bit. A page-ordered lookup that lists its misses (``candidates``) marks them
and lists them in a second launch after a scan of the marks, in batch order, as the twin
does: listed in visit order, a log that fills would hold every miss of one window of rows,
each distinct cold key once, instead of a sample of the miss occurrences in which often
missed keys are likelier (a large LinearUVM stream warmed more slowly that way).

The pooled lookups are in :mod:`gpu.kernels.cache_pooled`, the writes (insert, row
scatters) in :mod:`gpu.kernels.cache_insert`.
"""

from __future__ import annotations

from typing import Any

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


# NOTE: sizes that only bound masks are not specialized: a candidate capacity or batch
# size crossing a multiple of 16 would otherwise compile another variant (seconds) in the
# middle of serving.
@triton.jit(do_not_specialize=["n", "num_buckets", "num_rows", "cand_cap"])
def _lookup_kernel(
    keys_ptr, n, tkeys_ptr, counters_ptr, rows_ptr, stats_ptr, num_buckets,
    out_ptr, hit_ptr, slots_ptr, table_ptr, num_rows, tstride, dim, cand_ptr, cand_cap,
    order_ptr, err_ptr, crows_ptr, miss_ptr, mark_ptr, HAS_CACHE: tl.constexpr,
    GATHER: tl.constexpr, LINEAR: tl.constexpr, WRITE_SLOTS: tl.constexpr, COUNT: tl.constexpr,
    COLLECT: tl.constexpr, WAYS: tl.constexpr,
    EMPTY: tl.constexpr, STAT_STRIPES: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, CMAX: tl.constexpr, ORDERED: tl.constexpr,
    WRITE_HIT: tl.constexpr, CHECK: tl.constexpr, COLLECT_ROWS: tl.constexpr,
    LIST_MISSES: tl.constexpr, MARK_MISSES: tl.constexpr, QUANT: tl.constexpr,
    META: tl.constexpr, SEQ: tl.constexpr,
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
        hit, slot = probe(tkeys_ptr, keys, kmask, num_buckets, WAYS, EMPTY)
        if GATHER:
            vals = tl.load(rows_ptr + slot[:, None] * dim + d[None, :],
                           mask=hit[:, None] & dmask[None, :], other=0.0)
            if LINEAR:
                inrange = kmask & (keys >= 0) & (keys < num_rows) & (hit == 0)
                tval = _to_dtype(_load_rows(table_ptr, keys, inrange, tstride, d, dmask,
                                            QUANT, META, 0, SEQ),
                                 rows_ptr.dtype.element_ty)
                vals = tl.where(hit[:, None], vals, tval)
    else:
        # NOTE: a disabled cache (the GPULayer path) is a plain gather: no probe load, no
        # cache-row load, no atomics.
        hit = offs < 0
        slot = offs * 0
        if GATHER:
            if LINEAR:
                inrange = kmask & (keys >= 0) & (keys < num_rows)
                vals = _to_dtype(_load_rows(table_ptr, keys, inrange, tstride, d, dmask,
                                            QUANT, META, 0, SEQ),
                                 rows_ptr.dtype.element_ty)
            else:
                vals = tl.full([BLOCK_K, BLOCK_D], 0, rows_ptr.dtype.element_ty)
    if GATHER:
        tl.store(out_ptr + offs[:, None] * dim + d[None, :], vals,
                 mask=kmask[:, None] & dmask[None, :])
    if WRITE_HIT:
        tl.store(hit_ptr + offs, hit.to(tl.int8), mask=kmask)
    if WRITE_SLOTS:
        tl.store(slots_ptr + offs, tl.where(hit, slot, -1), mask=kmask)
    if HAS_CACHE:
        if COUNT:
            # NOTE: fire-and-forget (result unused: a `red`, no round trip), issued after the
            # loads and stores so no warp waits on a contended hot slot; not saturated here
            # (see the module docstring for the lazy clamp).
            _bump(counters_ptr, slot, hit, CMAX)
            nhits = tl.reduce(hit.to(tl.int64), 0, add_combine)
            tl.atomic_add(stats_ptr + pid % STAT_STRIPES, nhits, sem="relaxed")
    if COLLECT:
        cpos, stored = _collect(cand_ptr, cand_cap, keys, offs,
                                kmask & (hit == 0) & (keys >= 0) & (keys < num_rows))
        if COLLECT_ROWS:
            # NOTE: the row just read from the table, so that the admission round need
            # not read it again (over the host link)
            tl.store(crows_ptr + cpos[:, None] * dim + d[None, :], vals,
                     mask=stored[:, None] & dmask[None, :])
    if MARK_MISSES:
        # NOTE: a page-ordered lookup lists its misses afterwards, in batch order
        # (_collect_ordered_kernel): here each position only says whether it is one
        tl.store(mark_ptr + offs,
                 (kmask & (hit == 0) & (keys >= 0) & (keys < num_rows)).to(tl.int8),
                 mask=kmask)
    if CHECK:
        # NOTE: a key outside the linear table lands in the layer's key-error flag (a
        # store over the host link, made only when a key is bad: gpu.stacks.key_flag)
        tl.store(err_ptr + offs * 0, keys, mask=kmask & ((keys < 0) | (keys >= num_rows)))
    if LIST_MISSES:
        # NOTE: each miss and its position as a pair in the caller's list in pinned host
        # memory (gpu.stacks.misses.miss_list): the pairs reserved with an atomic on a device
        # counter
        # that only grows (cand_ptr; cand_cap is its value before this lookup), stored over
        # the host link, by programs that met a miss only
        miss = kmask & (hit == 0)
        mi = miss.to(tl.int64)
        nmiss = tl.reduce(mi, 0, add_combine)
        base = tl.atomic_add(cand_ptr, nmiss, mask=nmiss > 0, sem="relaxed") - cand_cap
        at = 2 * (base + tl.associative_scan(mi, 0, add_combine) - mi)
        tl.store(miss_ptr + at, keys, mask=miss)
        tl.store(miss_ptr + at + 1, offs, mask=miss)


@triton.jit(do_not_specialize=["n", "cand_cap"])
def _collect_ordered_kernel(
    keys_ptr, mark_ptr, rank_ptr, out_ptr, cand_ptr, cand_cap, crows_ptr, n, dim,
    ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
):
    """The misses a page-ordered lookup marked, listed in batch order after the ones
    already in the candidate buffer (``rank``: the inclusive count of marks up to each
    position), with the rows the lookup wrote to ``out``; the count is raised by the
    caller afterwards (every program reads it here)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = offs < n
    base = tl.load(cand_ptr)
    pos = base + tl.load(rank_ptr + offs, mask=kmask, other=0).to(tl.int64) - 1
    m = kmask & (tl.load(mark_ptr + offs, mask=kmask, other=0) != 0) & (pos < cand_cap)
    keys = tl.load(keys_ptr + offs, mask=m, other=0)
    tl.store(cand_ptr + 1 + pos, keys, mask=m)
    tl.store(cand_ptr + 1 + cand_cap + pos, offs, mask=m)
    if ROWS:
        d = tl.arange(0, BLOCK_D)
        if EVEN_D:
            dmask = tl.full([BLOCK_D], 1, tl.int1)
        else:
            dmask = d < dim
        rm = m[:, None] & dmask[None, :]
        vals = tl.load(out_ptr + offs[:, None] * dim + d[None, :], mask=rm)
        tl.store(crows_ptr + pos[:, None] * dim + d[None, :], vals, mask=rm)


# ---------------------------------------------------------------- launchers

#: the lookup kernel launched directly (gpu.kernels.launch), and its constexpr sets by key
_LOOKUP = DirectLaunch(_lookup_kernel)
_LOOKUP_CX: dict[tuple[object, ...], dict[str, object]] = {}
#: the batch-order listing of a page-ordered lookup's misses, and its constexpr sets
_COLLECT = DirectLaunch(_collect_ordered_kernel)
_COLLECT_CX: dict[tuple[object, ...], dict[str, object]] = {}
_COLLECT_BLOCK_K = 32


_INT32_MAX = (1 << 31) - 1


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


def lookup(
    keys: torch.Tensor, tkeys: torch.Tensor, counters: torch.Tensor, rows: torch.Tensor,
    stats: torch.Tensor, num_buckets: int, ways: int, *, empty: int, gather: bool,
    count: bool, want_slots: bool, table: torch.Tensor | None = None,
    candidates: torch.Tensor | None = None, host_table: bool = True, cmax: int,
    rotate: int = 0, err: torch.Tensor | None = None, want_hit: bool = True,
    candidate_rows: torch.Tensor | None = None,
    misses: tuple[torch.Tensor, int, torch.Tensor] | None = None,
    bound: dict[tuple[Any, ...], BoundLaunch] | None = None, tiles: Tiles,
    table_format: RowFormat | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Probe (+ gather, + linear-table misses) of ``keys``: ``(values, hit, slots)``.

    Hit slots' counters get one unsaturated add per key (the caller clamps lazily), none
    where a counter already reads ``cmax``.
    ``candidates``: a zeroed int64 buffer ``[1 + 2 * cap]`` (see ``cache.MissCandidates``)
    that receives the in-range misses of a linear lookup (count, keys, batch positions).
    ``host_table``: the linear table lives in host memory, so large batches are visited
    in host-page order (a table in GPU memory never is); ``rotate`` shifts where that order
    starts (see :func:`page_order`). ``err``: the layer's key-error flag (int64 ``[1]``,
    ``gpu.stacks.key_flag``) that receives a key outside the linear table. ``want_hit=False``:
    no hit flags (None returned). ``candidate_rows``: ``[cap, dim]`` rows of ``rows``'
    dtype that receive the row read for each listed miss (with ``candidates``, a linear
    gather). ``misses``: ``(counter, start, pairs)`` of a
    :class:`gpu.stacks.misses.miss_list.MissList`
    that receives every miss and its batch position (not with ``candidates``). ``bound``:
    the cache's own store of bound launches (:class:`~gpu.kernels.launch.BoundLaunch`) for
    gathers visited in batch order, keyed by what the call passes; ``table`` and ``err``
    are then the caller's own, the same objects call after call (a layer's stack).
    ``tiles``: the cache's launch settings. ``table_format``: a quantized table's format
    (``table`` is then its stored bytes, uint8 ``[num_rows, >= stored_bytes]``; its misses
    come back dequantized in the rows' dtype, :mod:`gpu.kernels.stored_rows`).
    """
    n = keys.numel()
    dim = rows.shape[1]
    dev = keys.device
    out = torch.empty(n, dim, dtype=rows.dtype, device=dev) if gather else None
    assert misses is None or candidates is None, "misses and candidates share slots"
    hit = torch.empty(n, dtype=torch.bool, device=dev) if want_hit else None
    slots = torch.empty(n, dtype=torch.int64, device=dev) if want_slots else None
    if n == 0:
        return out, hit, slots
    if bound is not None and out is not None and slots is None and not (
            table is not None and host_table and 0 < tiles.linear_page_order <= n):
        # NOTE: a serving-size gather: the cache's tables, the layer's table and key flag
        # bound once; the launcher takes only what changes (gpu.kernels.launch.BoundLaunch)
        flags = hit.view(torch.int8) if hit is not None else None
        bkey = (flags is not None, count, id(table), candidates is not None,
                candidate_rows is not None, id(err), misses is not None, tiles)
        launch = bound.get(bkey)
        if launch is None:
            if len(bound) >= 16:  # NOTE: a caller passing new tables: bounded
                bound.clear()
            launch = bound[bkey] = _bind_lookup(
                tkeys, counters, rows, stats, num_buckets, ways, empty, count, table,
                cmax, err, flags is not None, candidates is not None,
                candidate_rows is not None, misses is not None, tiles, table_format)
        # NOTE: only what the variant uses varies, in _bind_lookup's order
        given: list[Any] = [keys, n, out]
        if flags is not None:
            given.append(flags)
        if candidates is not None:
            given += (candidates, _cand_cap(candidates))
        if candidate_rows is not None:
            given.append(candidate_rows)
        if misses is not None:
            given += misses
        launch.call(_cdiv(n, tiles.lookup_block_k), *given)
        return out, hit, None
    bd = _block_d(dim)
    linear = table is not None
    order = _visit_order(keys, table, host_table, rotate, tiles) if gather else None
    # NOTE: a page-ordered lookup marks its misses and lists them after, in batch order:
    # listed in visit order, a log that fills would hold every miss of a window of rows
    # (each distinct cold key once) instead of a sample of the miss occurrences
    later = candidates is not None and order is not None
    marks = torch.empty(n, dtype=torch.int8, device=dev) if later else None
    cx, cxkey = _lookup_constexprs(
        num_buckets > 0, gather, linear, want_slots, count,
        candidates is not None and not later, ways, empty, stats.numel(), bd, cmax,
        order is not None, want_hit, err is not None and linear, dim, rows.dtype, tiles,
        candidate_rows is not None and not later, misses is not None, later, table_format)
    _LOOKUP(
        (_cdiv(n, tiles.lookup_block_k),),
        (keys, n, tkeys, counters, rows, stats, max(num_buckets, 1),
         out if out is not None else keys, hit.view(torch.int8) if hit is not None else keys,
         slots if slots is not None else keys, table if linear else rows,
         table.shape[0] if table is not None else 0, _row_stride(table, dim), dim,
         candidates if candidates is not None else (misses[0] if misses else keys),
         _cand_cap(candidates) if misses is None else misses[1],
         order if order is not None else keys, err if err is not None else keys,
         candidate_rows if candidate_rows is not None else rows,
         misses[2] if misses is not None else keys, marks if marks is not None else keys),
        cx, cxkey)
    if marks is not None:
        assert candidates is not None and out is not None
        _collect_ordered(keys, marks, out, candidates, candidate_rows)
    return out, hit, slots


def _lookup_constexprs(
    has_cache: bool, gather: bool, linear: bool, want_slots: bool, count: bool,
    collect: bool, ways: int, empty: int, stripes: int, bd: int, cmax: int, ordered: bool,
    want_hit: bool, check: bool, dim: int, dtype: torch.dtype, tiles: Tiles,
    collect_rows: bool, list_misses: bool, mark_misses: bool, fmt: RowFormat | None,
) -> tuple[dict[str, object], tuple[object, ...]]:
    """The lookup kernel's constexprs for one variant and the key that names them (one
    dict per key, kept: gpu.kernels.launch.DirectLaunch compares them by identity first)."""
    cxkey = (has_cache, gather, linear, want_slots, count, collect, ways, empty, stripes, bd,
             cmax, ordered, want_hit, check, bd == dim, dtype, tiles, collect_rows,
             list_misses, mark_misses, fmt)
    cx = _LOOKUP_CX.get(cxkey)
    if cx is None:
        cx = _LOOKUP_CX[cxkey] = dict(
            HAS_CACHE=has_cache, GATHER=gather, LINEAR=linear, WRITE_SLOTS=want_slots,
            COUNT=count, COLLECT=collect, WAYS=ways, EMPTY=empty, STAT_STRIPES=stripes,
            BLOCK_K=tiles.lookup_block_k, BLOCK_D=bd, EVEN_D=bd == dim, CMAX=cmax,
            ORDERED=ordered, WRITE_HIT=want_hit, CHECK=check, COLLECT_ROWS=collect_rows,
            LIST_MISSES=list_misses, MARK_MISSES=mark_misses, num_warps=tiles.lookup_warps,
            **codec_constexprs(fmt))
    return cx, cxkey


#: what a bound lookup passes per call (parameter indices of _lookup_kernel): keys, n and
#: out always; hit flags, candidates and their capacity, candidate rows, a miss list's
#: counter, start and pairs (in the candidates' slots and the last) where the variant uses
#: them (the others stay bound to placeholders)
_VARY_ALWAYS, _VARY_HIT, _VARY_CAND, _VARY_CROWS, _VARY_LIST = (0, 1, 7), (8,), (14, 15), \
    (18,), (14, 15, 19)


def _bind_lookup(tkeys: torch.Tensor, counters: torch.Tensor, rows: torch.Tensor,
                 stats: torch.Tensor, num_buckets: int, ways: int, empty: int, count: bool,
                 table: torch.Tensor | None, cmax: int, err: torch.Tensor | None,
                 want_hit: bool, has_cand: bool, has_crows: bool,
                 has_list: bool, tiles: Tiles, fmt: RowFormat | None) -> BoundLaunch:
    """A gather in batch order with this cache's tables bound (the varying arguments'
    slots hold placeholders until a call gives them)."""
    dim = rows.shape[1]
    linear = table is not None
    cx, cxkey = _lookup_constexprs(
        num_buckets > 0, True, linear, False, count, has_cand, ways, empty, stats.numel(),
        _block_d(dim), cmax, False, want_hit, err is not None and linear, dim, rows.dtype,
        tiles, has_crows, has_list, False, fmt)
    args = (tkeys, 0, tkeys, counters, rows, stats, max(num_buckets, 1), rows, tkeys, tkeys,
            table if linear else rows, table.shape[0] if table is not None else 0,
            _row_stride(table, dim), dim, tkeys, 0, tkeys, err if err is not None else tkeys,
            rows, tkeys, tkeys)
    varying = _VARY_ALWAYS + (_VARY_HIT if want_hit else ()) + (
        _VARY_CAND if has_cand else ()) + (_VARY_CROWS if has_crows else ()) + (
        _VARY_LIST if has_list else ())
    return BoundLaunch(_LOOKUP, args, cx, cxkey, varying)


def _collect_ordered(keys: torch.Tensor, marks: torch.Tensor, out: torch.Tensor,
                     candidates: torch.Tensor, candidate_rows: torch.Tensor | None) -> None:
    """List a page-ordered lookup's marked misses in batch order (the twin's
    ``collect_misses``): a scan of the marks, one launch, then the count raised."""
    n, dim = keys.numel(), out.shape[1]
    rank = torch.cumsum(marks, 0, dtype=torch.int32 if n < _INT32_MAX else torch.int64)
    bd = _block_d(dim)
    key = (candidate_rows is not None, bd, bd == dim, out.dtype)
    cx = _COLLECT_CX.get(key)
    if cx is None:
        cx = _COLLECT_CX[key] = dict(ROWS=key[0], BLOCK_K=_COLLECT_BLOCK_K, BLOCK_D=bd,
                                     EVEN_D=key[2])
    _COLLECT(
        (_cdiv(n, _COLLECT_BLOCK_K),),
        (keys, marks, rank, out, candidates, _cand_cap(candidates),
         candidate_rows if candidate_rows is not None else out, n, dim),
        cx, key)
    candidates[:1] += rank[-1:]


def _visit_order(keys: torch.Tensor, table: torch.Tensor | None, host_table: bool,
                 rotate: int, tiles: Tiles) -> torch.Tensor | None:
    """The order a lookup visits its batch in: None (batch order), or page order for a
    batch of ``tiles.linear_page_order`` keys or more over a table in host memory."""
    from_n = tiles.linear_page_order
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
