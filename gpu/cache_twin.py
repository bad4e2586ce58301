"""The GPU cache's operations in plain torch ops: the CPU twin of ``gpu.cache_kernels``.

Every function here runs on any device (CPU, or CUDA when Triton is missing) and gives the
same results as the Triton kernels: gathers are bit-exact (rows are copied, never
computed), pooled sums agree to fp32 rounding (the summation order differs), and the
table state after any sequence of operations is identical.

The insert/update/erase bookkeeping (which key goes to which slot) lives here too and is
used by both backends, written with deterministic torch ops (sorted ``unique``, stable
sorts, integer scatters) so the CPU and CUDA tables end in the same state.

Eviction policy, per bucket (LFU with dynamic aging, "lfu-da"):

* a hit adds 1 to its slot's counter, saturating at :data:`COUNTER_MAX` (the Triton
  kernels add without saturating and the cache clamps lazily, with the same result:
  ``gpu.cache_kernels``);
* a new key takes a free way, else the way with the lowest counter (ties: lowest way), and
  starts at the victim's counter + 1 (a free way's counter is 0), so a newcomer competes
  with the bucket's current "age" instead of starting below every resident;
* decay: before new keys are placed in a bucket whose largest counter reached
  :data:`DECAY_AT`, that bucket's counters are halved, so old popularity fades.

Batch rules of ``insert``: duplicate keys keep their last occurrence; keys already present
are overwritten in place; new keys of one bucket are placed in ascending key order on the
ways in eviction order, never on a way holding a key of the same batch; new keys beyond
the bucket's free-or-evictable ways are dropped (insert is best effort).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hostcache.hashing import bucket_of
from hostcache.layout import EMPTY_KEY

#: saturation value of a slot's policy counter.
COUNTER_MAX = (1 << 30) - 1
#: a bucket whose largest counter reached this is halved before new keys are placed in it.
DECAY_AT = 1 << 20
#: hit counts are striped over this many int64 words to spread the atomics.
STAT_STRIPES = 64


def probe(
    tkeys: torch.Tensor, num_buckets: int, ways: int, keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hit bool [N], slot int64 [N])`` of every key; ``slot`` is -1 where not hit."""
    n = keys.numel()
    if num_buckets == 0 or n == 0:
        return (torch.zeros(n, dtype=torch.bool, device=keys.device),
                torch.full((n,), -1, dtype=torch.int64, device=keys.device))
    base = bucket_of(keys, num_buckets) * ways
    way = torch.arange(ways, device=keys.device)
    sk = tkeys[base[:, None] + way[None, :]]
    match = (sk == keys[:, None]) & (keys != EMPTY_KEY)[:, None]
    first = torch.where(match, way[None, :], ways).amin(dim=1)
    hit = first < ways
    return hit, torch.where(hit, base + first, -1)


def bump(counters: torch.Tensor, slot: torch.Tensor, hit: torch.Tensor) -> None:
    """Add one hit to every hit slot's counter, saturating at :data:`COUNTER_MAX`."""
    if slot.numel() == 0 or counters.numel() == 0:
        return
    idx = torch.where(hit, slot, 0)
    counters.index_add_(0, idx, hit.to(counters.dtype))
    counters[idx] = counters[idx].clamp_max(COUNTER_MAX)


def count_hits(stats: torch.Tensor, hit: torch.Tensor) -> None:
    """Add the number of hits to the striped hit counter (no host sync)."""
    stats[0] += hit.sum()


def gather(rows: torch.Tensor, slot: torch.Tensor, hit: torch.Tensor) -> torch.Tensor:
    """Rows at ``slot`` where ``hit``, zero rows elsewhere (bit-exact copies)."""
    if rows.shape[0] == 0:
        return torch.zeros((slot.numel(), rows.shape[1]), dtype=rows.dtype, device=rows.device)
    vals = rows[torch.where(hit, slot, 0)]
    return torch.where(hit[:, None], vals, torch.zeros((), dtype=rows.dtype, device=rows.device))


def gather_linear(
    rows: torch.Tensor, slot: torch.Tensor, hit: torch.Tensor, keys: torch.Tensor,
    table: torch.Tensor,
) -> torch.Tensor:
    """Hits from the cache rows, misses from row ``key`` of ``table``."""
    vals = gather(rows, slot, hit)
    miss = ~hit
    inrange = (keys >= 0) & (keys < table.shape[0])
    idx = torch.where(miss & inrange, keys, 0)
    if table.shape[0] == 0:
        return vals
    tvals = table[idx].to(vals.device)
    zero = torch.zeros((), dtype=vals.dtype, device=vals.device)
    tvals = torch.where((miss & inrange)[:, None], tvals, zero)
    return torch.where(hit[:, None], vals, tvals)


def pool(
    vals: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None, mean: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Sum / weighted sum / mean of ``vals`` rows over bags (fp32 accumulation)."""
    nbags = offsets.numel() - 1
    n = vals.shape[0]
    acc = vals.to(torch.float32)
    if weights is not None:
        acc = acc * weights.to(torch.float32)[:, None]
    pos = torch.arange(n, device=vals.device)
    bag = torch.searchsorted(offsets, pos, right=True) - 1
    out = torch.zeros((nbags, vals.shape[1]), dtype=torch.float32, device=vals.device)
    out.index_add_(0, bag, acc)
    if mean:
        lengths = (offsets[1:] - offsets[:-1]).clamp_min(1).to(torch.float32)
        out = out / lengths[:, None]
    return out.to(out_dtype)


def last_occurrence(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(unique sorted keys, index of each one's last occurrence, inverse)``."""
    uk, inv = torch.unique(keys, sorted=True, return_inverse=True)
    pos = torch.arange(keys.numel(), device=keys.device)
    last = torch.full((uk.numel(),), -1, dtype=torch.int64, device=keys.device)
    last.scatter_reduce_(0, inv, pos, reduce="amax", include_self=True)
    return uk, last, inv


@dataclass
class InsertPlan:
    """Where an insert batch goes. All index tensors are on the cache's device."""

    #: slots of keys already present, and the batch positions whose rows overwrite them.
    present_slots: torch.Tensor
    present_src: torch.Tensor
    #: slots new keys take, the keys, their batch positions and their starting counters.
    new_slots: torch.Tensor
    new_keys: torch.Tensor
    new_src: torch.Tensor
    new_counters: torch.Tensor
    #: buckets touched by new keys and their counters after decay ([Bt * ways]).
    decay_slots: torch.Tensor
    decay_counters: torch.Tensor
    evictions: int
    dropped: int


def plan_insert(
    tkeys: torch.Tensor, counters: torch.Tensor, num_buckets: int, ways: int,
    keys: torch.Tensor,
) -> InsertPlan:
    """Decide, deterministically, where every key of an insert batch goes."""
    dev = keys.device
    empty_i64 = torch.empty(0, dtype=torch.int64, device=dev)
    uk, last, _ = last_occurrence(keys)
    hit, slot = probe(tkeys, num_buckets, ways, uk)
    present_slots, present_src = slot[hit], last[hit]
    fresh = ~hit
    new_keys, new_src = uk[fresh], last[fresh]
    m = new_keys.numel()
    if m == 0 or num_buckets == 0:
        return InsertPlan(present_slots, present_src, empty_i64, empty_i64, empty_i64,
                          torch.empty(0, dtype=counters.dtype, device=dev), empty_i64,
                          torch.empty(0, dtype=counters.dtype, device=dev), 0, m)
    # NOTE: uk is sorted, and the stable sort by bucket keeps ascending keys inside a bucket.
    bucket = bucket_of(new_keys, num_buckets)
    order = torch.sort(bucket, stable=True).indices
    bucket, new_keys, new_src = bucket[order], new_keys[order], new_src[order]
    ubuckets, counts = torch.unique_consecutive(bucket, return_counts=True)
    group = torch.repeat_interleave(torch.arange(ubuckets.numel(), device=dev), counts)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(m, device=dev) - starts[group]

    way = torch.arange(ways, device=dev)
    bslots = ubuckets[:, None] * ways + way[None, :]
    bkeys = tkeys[bslots]
    # NOTE: clamped on read: the Triton kernels add hits without saturating (see
    # gpu.cache_kernels); a stored counter c stands for min(c, COUNTER_MAX).
    bcount = counters[bslots].clamp_max(COUNTER_MAX)
    old = bcount.amax(dim=1, keepdim=True) >= DECAY_AT
    bcount = torch.where(old, bcount >> 1, bcount)
    bpinned = torch.isin(bkeys, uk[hit])
    score = torch.where(bkeys == EMPTY_KEY, -1, bcount.to(torch.int64))
    score = torch.where(bpinned, 1 << 40, score)
    way_order = torch.sort(score, dim=1, stable=True).indices
    avail = ways - bpinned.sum(dim=1)
    ok = rank < avail[group]
    pick = way_order[group, rank.clamp_max(ways - 1)]
    g_ok, pick_ok = group[ok], pick[ok]
    new_slots = bslots[g_ok, pick_ok]
    victims = bkeys[g_ok, pick_ok]
    new_counters = (bcount[g_ok, pick_ok] + 1).clamp_max(COUNTER_MAX)
    evictions = int((victims != EMPTY_KEY).sum())
    placed = new_slots.numel()
    return InsertPlan(present_slots, present_src, new_slots, new_keys[ok], new_src[ok],
                      new_counters, bslots.reshape(-1), bcount.reshape(-1), evictions,
                      m - placed)


def plan_update(
    tkeys: torch.Tensor, num_buckets: int, ways: int, keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(slots, batch positions, present bool [N])`` of an update: last occurrence wins."""
    uk, last, inv = last_occurrence(keys)
    hit, slot = probe(tkeys, num_buckets, ways, uk)
    return slot[hit], last[hit], hit[inv]
