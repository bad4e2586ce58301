# ruff: noqa: N803  (Triton convention: compile-time constants are UPPER_CASE parameters)
"""The GPU cache's per-block device functions, shared by its kernel modules.

``probe`` (where a block of keys lives), ``bump`` (policy counters of the hits) and
``collect`` (list a block's misses), with the ``tl.reduce`` combine functions, called from
the lookup kernels (:mod:`gpu.kernels.cache_lookup`) and the insert kernels
(:mod:`gpu.kernels.cache_insert`). Loaded only through :mod:`gpu.kernels.triton_access`,
like them: a kernel module takes this one from
:func:`gpu.kernels.triton_access.helper_module`, so its kernels call helpers decorated the
same way (compiled or interpreted).

Counters: a hit adds 1 to its slot's counter with a fire-and-forget atomic (the result is
unused, so it compiles to a ``red``: no warp waits for it), issued after the row loads and
stores. Same-address atomics serialize in L2, and a Zipf batch hits its hottest slots
thousands of times, so a slot whose counter already reads ``CMAX`` gets no atomic at all
(the hot slots saturate within a few batches). Summing equal slots per block first lost
to that skip by measurement and is gone (bench/RESULTS.md, "GPU cache kernels").

The kernels do not saturate: ``GPUCache`` clamps lazily. Saturating adds of non-negative
amounts compose, ``min(min(c + a, CMAX) + b, CMAX) == min(c + a + b, CMAX)``, so a stored
counter ``c`` stands for ``min(c, CMAX)`` as long as it cannot overflow int32; the cache
clamps every counter it reads (insert planning, ``state()``) and clamps the whole array
before the keys counted since the last full clamp could push a counter past
``INT32_MAX``. The state is therefore exactly the twin's ``min(initial + hits, CMAX)``,
whatever the order of the adds.
"""

from __future__ import annotations

import triton
import triton.language as tl

from gpu.kernels.triton_access import helper_module

# NOTE: the host tier's hash, decorated like this module (compiled or interpreted)
bucket_of = helper_module("key_hash").bucket_of


# NOTE: reductions use tl.reduce with our own combine functions instead of tl.min / tl.sum:
# those are @triton.jit functions of triton's standard library, decorated when triton was
# imported, so they would not switch to the interpreter with this module.
@triton.jit
def min_combine(a, b):
    return tl.minimum(a, b)


@triton.jit
def add_combine(a, b):
    return a + b


@triton.jit
def probe(tkeys_ptr, keys, kmask, num_buckets, WAYS: tl.constexpr, EMPTY: tl.constexpr):
    """(hit, slot) of a [BLOCK_K] block of keys; slot is garbage where not hit."""
    b = bucket_of(keys, num_buckets)
    w = tl.arange(0, WAYS)
    sk = tl.load(tkeys_ptr + (b * WAYS)[:, None] + w[None, :], mask=kmask[:, None], other=EMPTY)
    match = (sk == keys[:, None]) & (keys != EMPTY)[:, None] & kmask[:, None]
    way = tl.reduce(tl.where(match, w[None, :], WAYS), 1, min_combine)
    hit = way < WAYS
    slot = b * WAYS + tl.where(hit, way, 0)
    return hit, slot


@triton.jit
def bump(counters_ptr, slot, hit, CMAX: tl.constexpr):
    """Add each hit to its slot's counter (fire-and-forget atomics, ``red``).

    A slot whose counter already reads ``CMAX`` or more takes no atomic at all (exact: the
    counter only grows during a launch, so a value read at ``CMAX`` stays saturated, and
    adds to it change nothing it stands for); a hot slot then costs one cached load per key
    instead of a serialized add.
    """
    c = tl.load(counters_ptr + slot, mask=hit, other=0)
    tl.atomic_add(counters_ptr + slot, 1, mask=hit & (c < CMAX), sem="relaxed")


@triton.jit
def collect(cand_ptr, cap, keys, offs, miss):
    """Append the ``miss`` keys of a block and their batch positions to the candidate
    buffer ``[count, keys[cap], positions[cap]]``: one atomic on the count per block; keys
    past ``cap`` are counted, not stored. Returns ``(pos, stored)``: each key's place in
    the buffer and whether it went there."""
    mi = miss.to(tl.int64)
    base = tl.atomic_add(cand_ptr, tl.reduce(mi, 0, add_combine), sem="relaxed")
    pos = base + tl.associative_scan(mi, 0, add_combine) - mi
    m = miss & (pos < cap)
    tl.store(cand_ptr + 1 + pos, keys, mask=m)
    tl.store(cand_ptr + 1 + cap + pos, offs, mask=m)
    return pos, m
