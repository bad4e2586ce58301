"""The GPU cache's operations in plain torch ops: the CPU twin of ``gpu.kernels.cache_lookup``.

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
  ``gpu.kernels.cache_lookup``);
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
from hostcache.row_versions import is_versioned, read_rows, versions_in, wait_of
from nvecache.common import quant
from nvecache.common.rows import RowFormat

#: saturation value of a slot's policy counter. Low enough that the hottest slots of a
#: skewed stream saturate within a few batches: the kernels then skip their counter atomics
#: (same-address adds serialize in L2; the gain: bench/RESULTS.md, "GPU cache kernels"),
#: and eviction only needs to tell hot from cold within a bucket.
COUNTER_MAX = (1 << 16) - 1
#: a bucket whose largest counter reached this is halved before new keys are placed in it
#: (so a bucket holding a saturated slot ages whenever new keys come in).
DECAY_AT = COUNTER_MAX
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
    bucket = bucket_of(keys, num_buckets)
    sk = tkeys.view(-1, ways).index_select(0, bucket)
    match = (sk == keys[:, None]) & (keys != EMPTY_KEY)[:, None]
    first = _first_way(match, ways)
    hit = first < ways
    return hit, torch.where(hit, bucket * ways + first, -1)


def _first_way(match: torch.Tensor, ways: int) -> torch.Tensor:
    """The lowest matching way of each row of a ``[N, ways]`` bool match (``ways`` where
    none matched).

    NOTE: with 8 ways a row's 8 bools are read as one int64 (way ``w`` is bit ``8 w``);
    its lowest set bit, through a float exponent, is the way: a few passes over ``N``
    words instead of a masked ``amin`` over ``[N, 8]`` (the twin's probe spent most of
    its time there on the CPU).
    """
    if ways == 8 and match.is_contiguous() and match.device.type == "cpu":
        bits = match.view(torch.uint8).view(torch.int64).squeeze(1)
        low = bits & -bits
        way = (torch.frexp(low.to(torch.float64))[1] - 1) >> 3
        return torch.where(bits != 0, way, ways)
    way = torch.arange(ways, device=match.device)
    return torch.where(match, way[None, :], ways).amin(dim=1)


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
    vals = rows.index_select(0, torch.where(hit, slot, 0))
    if vals.device.type == "cpu":
        # NOTE: index_fill_ of the missed rows: a broadcast masked_fill_ over [N, dim]
        # was slower on the CPU (on CUDA the nonzero would cost a host sync)
        return vals.index_fill_(0, (~hit).nonzero().squeeze(1), 0)
    return vals.masked_fill_(~hit[:, None], 0)


def gather_linear(
    rows: torch.Tensor, slot: torch.Tensor, hit: torch.Tensor, keys: torch.Tensor,
    table: torch.Tensor, fmt: RowFormat | None = None,
) -> torch.Tensor:
    """Hits from the cache rows, misses from row ``key`` of ``table`` (of a quantized
    table, ``fmt``: its stored bytes, dequantized in the rows' dtype)."""
    vals = gather(rows, slot, hit)
    miss = ~hit
    inrange = (keys >= 0) & (keys < table.shape[0])
    idx = torch.where(miss & inrange, keys, 0)
    if table.shape[0] == 0:
        return vals
    # NOTE: a versioned format's rows (a quantized SharedMemBlock) under their versions
    if fmt is not None and is_versioned(fmt):
        tvals = read_rows(table, idx, versions_in(table, fmt.stored_bytes), wait_of(fmt))
    else:
        tvals = table[idx]
    if fmt is not None and fmt.quantized:
        tvals = quant.decode(tvals, fmt, vals.dtype)
    tvals = tvals.to(vals.device)
    zero = torch.zeros((), dtype=vals.dtype, device=vals.device)
    tvals = torch.where((miss & inrange)[:, None], tvals, zero)
    return torch.where(hit[:, None], vals, tvals)


def collect_misses(cand: torch.Tensor, keys: torch.Tensor, hit: torch.Tensor,
                   num_rows: int, vals: torch.Tensor | None = None,
                   cand_rows: torch.Tensor | None = None) -> None:
    """The twin of the kernels' candidate collection (``cache.MissCandidates``): count the
    in-range misses into ``cand[0]``, the first ``cap`` of them (batch order) and their
    positions after it; their rows of ``vals`` into ``cand_rows`` where given."""
    cap = (cand.numel() - 1) // 2
    pos = (~hit & (keys >= 0) & (keys < num_rows)).nonzero().squeeze(1)
    base = int(cand[0])
    cand[0] += pos.numel()
    pos = pos[:max(0, cap - base)]
    m = pos.numel()
    cand[1 + base:1 + base + m] = keys[pos]
    cand[1 + cap + base:1 + cap + base + m] = pos
    if cand_rows is not None and vals is not None:
        cand_rows[base:base + m] = vals[pos]


def list_misses(counter: torch.Tensor, start: int, pairs: torch.Tensor, keys: torch.Tensor,
                hit: torch.Tensor) -> None:
    """The twin of the kernels' miss listing (``gpu.stacks.misses.miss_list``): every miss and its
    batch
    position as ``[key, position]`` pairs of ``pairs`` from pair ``counter - start``, in
    batch order; ``counter`` grows by their count."""
    pos = (~hit).nonzero().squeeze(1)
    base = int(counter[0]) - start
    counter += pos.numel()
    at = pairs.view(-1, 2)[base:base + pos.numel()]
    at[:, 0] = keys[pos].to(at.device)
    at[:, 1] = pos.to(at.device)


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
    """Where an insert batch goes, as full-length tensors with no data-dependent shape.

    Planning makes no host sync (no boolean indexing, no ``unique``): every tensor has one
    entry per batch key (``decay_*``: per key and way), and an entry that writes nothing
    targets the *trash slot* ``capacity``, one slot past the table that the cache keeps
    for this purpose (its contents are meaningless). Entries that write a real slot never
    collide, except ``decay_*`` entries of one bucket, which write identical values.
    """

    #: slot whose row each batch position writes (present keys: their slot; placed new
    #: keys: the slot they take; trash otherwise) and the batch position of that row.
    row_target: torch.Tensor
    row_src: torch.Tensor
    #: slot each placed new key takes (trash otherwise), the key, its starting counter.
    key_target: torch.Tensor
    new_keys: torch.Tensor
    new_counters: torch.Tensor
    #: the touched buckets' counters after decay ([N * ways]; trash where not touched).
    decay_target: torch.Tensor
    decay_values: torch.Tensor
    #: 0-d int64 tensors: new keys placed, residents evicted, new keys dropped.
    placed: torch.Tensor
    evictions: torch.Tensor
    dropped: torch.Tensor


def plan_insert(
    tkeys: torch.Tensor, counters: torch.Tensor, num_buckets: int, ways: int,
    keys: torch.Tensor,
) -> InsertPlan:
    """Decide, deterministically and without a host sync, where every key goes.

    ``num_buckets`` must be positive and ``keys`` non-empty (the caller returns early).
    """
    dev = keys.device
    n = keys.numel()
    trash = tkeys.numel()
    # last occurrence of each key: a stable sort keeps equal keys in batch order
    ks, src = torch.sort(keys, stable=True)
    is_last = torch.ones(n, dtype=torch.bool, device=dev)
    is_last[:-1] = ks[1:] != ks[:-1]
    hit, slot = probe(tkeys, num_buckets, ways, ks)
    present = is_last & hit
    fresh = is_last & ~hit & (ks != EMPTY_KEY)  # the empty marker is never placed
    # new keys by bucket; ascending keys inside a bucket (ks is sorted, the sort is stable)
    skey = torch.where(fresh, bucket_of(ks, num_buckets), num_buckets)
    sb, order = torch.sort(skey, stable=True)
    ks, src, slot = ks[order], src[order], slot[order]
    present, fresh = present[order], fresh[order]
    rank = torch.arange(n, device=dev) - torch.searchsorted(sb, sb)
    bucket = torch.where(fresh, sb, 0)
    way = torch.arange(ways, device=dev)
    bslots = bucket[:, None] * ways + way[None, :]
    bkeys = tkeys[bslots]
    # NOTE: clamped on read: the Triton kernels add hits without saturating (see
    # gpu.kernels.cache_lookup); a stored counter c stands for min(c, COUNTER_MAX).
    bcount = counters[bslots].clamp_max(COUNTER_MAX)
    old = bcount.amax(dim=1, keepdim=True) >= DECAY_AT
    bcount = torch.where(old, bcount >> 1, bcount)
    # a way holding a key of this batch is pinned: never a victim
    mark = torch.zeros(trash + 1, dtype=torch.bool, device=dev)
    mark[torch.where(present, slot, trash)] = True
    mark[trash] = False
    bpinned = mark[bslots]
    score = torch.where(bkeys == EMPTY_KEY, -1, bcount.to(torch.int64))
    score = torch.where(bpinned, 1 << 40, score)
    way_order = torch.sort(score, dim=1, stable=True).indices
    avail = ways - bpinned.sum(dim=1)
    ok = fresh & (rank < avail)
    pick = way_order.gather(1, rank.clamp(0, ways - 1)[:, None])
    new_slot = bucket * ways + pick.squeeze(1)
    victim = bkeys.gather(1, pick).squeeze(1)
    new_counters = (bcount.gather(1, pick).squeeze(1) + 1).clamp_max(COUNTER_MAX)
    key_target = torch.where(ok, new_slot, trash)
    row_target = torch.where(ok, new_slot, torch.where(present, slot, trash))
    # a bucket decays when a new key is placed in it (every fresh row of it has one avail)
    decay_target = torch.where((fresh & (avail > 0))[:, None], bslots, trash).reshape(-1)
    placed = ok.sum()
    return InsertPlan(row_target, src, key_target, ks, new_counters, decay_target,
                      bcount.reshape(-1), placed, (ok & (victim != EMPTY_KEY)).sum(),
                      fresh.sum() - placed)


def plan_update(
    tkeys: torch.Tensor, num_buckets: int, ways: int, keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(slots, batch positions, present bool [N])`` of an update: last occurrence wins."""
    uk, last, inv = last_occurrence(keys)
    hit, slot = probe(tkeys, num_buckets, ways, uk)
    return slot[hit], last[hit], hit[inv]
