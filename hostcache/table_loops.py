"""The host cache's per-key loops, compiled by numba: probe, seqlock reads and writes, and
the placement of new keys.

A lookup of a few hundred keys (what a Hierarchical layer's misses ask of the host cache)
spent most of its time in the per-operation cost of many small torch operations;
as loops compiled once these cost about as much as the memory they touch
(bench/RESULTS.md, "Host cache (CPU)"), and they release the GIL, so a host-cache fill on
a worker thread no longer holds up the serving thread.

Rows are moved as raw bytes (``uint8 [slots, row_stride]`` views of the segment, the first
``row_bytes`` of each used), so one compiled variant serves every table dtype.

NOTE: the seqlock's steps are kept apart by barriers the compiler cannot move loads or
stores across: a reader (``lookup``) loads every slot's version, then the rows and keys,
then the versions again, one pass each with a fence between (``_fence``; without it the
compiler may merge the two loads of a version, or reorder the passes); a writer makes the
versions odd, writes, and makes them even again in separate compiled calls
(``bump_versions`` / ``write_slots`` / ``bump_versions``). Inside one pass the compiler
may reorder loads and stores of different arrays; x86 keeps each CPU's loads, and its
stores, in program order (``hostcache.layout`` states the protocol).

``buckets`` here is ``hostcache.hashing.bucket_of``'s fmix64, bit for bit, with its
constants from :mod:`nvecache.common.fmix` (tests/hostcache/test_table_loops.py holds them
equal).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

# NOTE: fmix64's multipliers, module-level ints that numba compiles in as constants
from nvecache.common.fmix import M1, M2

_S33 = np.uint64(33)
_POS = np.uint64(0x7FFFFFFFFFFFFFFF)
#: ``hostcache.layout.EMPTY_KEY`` (not imported: the compiling child process loads no torch)
_EMPTY = np.int64(-(1 << 63))
#: a way that must not be taken (its key is being written by the same insert)
PROTECTED = np.int64(np.iinfo(np.int32).max)

#: compiled once and cached beside this module; the GIL released inside
_jit = njit(cache=True, nogil=True, boundscheck=False)


@_jit
def _bucket(key: np.int64, num_buckets: np.uint64) -> np.int64:
    x = np.uint64(key)
    x ^= x >> _S33
    x *= M1
    x ^= x >> _S33
    x *= M2
    x ^= x >> _S33
    x &= _POS
    return np.int64(x % num_buckets)


@_jit
def buckets(keys: np.ndarray, num_buckets: int) -> np.ndarray:
    """The bucket of every key (``hostcache.hashing.bucket_of``)."""
    nbuckets = np.uint64(num_buckets)
    out = np.empty(keys.shape[0], np.int64)
    for i in range(keys.shape[0]):
        out[i] = _bucket(keys[i], nbuckets)
    return out


@_jit
def dedup_last(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(distinct keys ascending, each one's last position, each key's distinct index)``
    (``hostcache.validate.dedup_last``'s result)."""
    n = keys.shape[0]
    order = np.argsort(keys, kind="mergesort")
    ukeys = np.empty(n, np.int64)
    last = np.empty(n, np.int64)
    inverse = np.empty(n, np.int64)
    u = -1
    for j in range(n):
        i = order[j]
        if u < 0 or keys[i] != ukeys[u]:
            u += 1
            ukeys[u] = keys[i]
        last[u] = i  # NOTE: a stable sort: a run's last element is the key's last position
        inverse[i] = u
    return ukeys[:u + 1], last[:u + 1], inverse


@_jit
def find(bucket_keys: np.ndarray, keys: np.ndarray, bucket: np.ndarray, slot: np.ndarray,
         found: np.ndarray) -> None:
    """Each key's slot (way 0 of its bucket where absent) and whether it is there."""
    ways = bucket_keys.shape[1]
    for i in range(keys.shape[0]):
        b = bucket[i]
        k = keys[i]
        s = b * ways
        present = False
        for w in range(ways):
            if bucket_keys[b, w] == k:
                s += w
                present = True
                break
        slot[i] = s
        found[i] = present


@intrinsic
def _fence_ir(typingctx: Any) -> Any:
    """A sequentially consistent fence: no load or store of the compiled loop moves
    across it (the compiler treats it as touching all memory; on x86 an ``mfence``)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


_fence: Any = _fence_ir  # called without arguments inside the compiled loops


@_jit
def lookup(tkeys: np.ndarray, bucket_keys: np.ndarray, versions: np.ndarray, raw: np.ndarray,
           policy: np.ndarray, num_buckets: int, keys: np.ndarray, out: np.ndarray,
           hit: np.ndarray, count: bool) -> int:
    """A whole lookup in one call: each key's slot by its bucket's keys, then the seqlock
    window over every slot (versions, then rows and keys, then versions again, fenced
    apart), rows into ``out`` (uint8 ``[N, row_bytes]``; a miss's row zeroed), each hit's
    policy counter bumped when ``count`` (racy across processes by design: approximate
    frequencies). A hit (``hit``, bool ``[N]``): found, an even version unchanged across
    the window, the key still in place inside it. Returns how many hit."""
    n = keys.shape[0]
    ways = bucket_keys.shape[1]
    row_bytes = out.shape[1]
    nbuckets = np.uint64(num_buckets)
    slot = np.empty(n, np.int64)
    found = np.empty(n, np.bool_)
    before = np.empty(n, np.int64)
    inside = np.empty(n, np.int64)
    for i in range(n):
        b = _bucket(keys[i], nbuckets)
        s = b * ways
        present = False
        for w in range(ways):
            if bucket_keys[b, w] == keys[i]:
                s += w
                present = True
                break
        slot[i] = s
        found[i] = present
    _fence()
    for i in range(n):
        before[i] = versions[slot[i]]
    _fence()
    for i in range(n):
        s = slot[i]
        for j in range(row_bytes):
            out[i, j] = raw[s, j]
        inside[i] = tkeys[s]
    _fence()
    hits = 0
    for i in range(n):
        # NOTE: even before and unchanged after in one comparison (versions only grow)
        good = found[i] and inside[i] == keys[i] and versions[slot[i]] == (before[i] & -2)
        hit[i] = good
        if good:
            hits += 1
            if count:
                policy[slot[i]] += 1
        else:
            for j in range(row_bytes):
                out[i, j] = 0
    return hits


@_jit
def add_policy(policy: np.ndarray, slot: np.ndarray, found: np.ndarray, weight: int) -> None:
    """``weight`` more hits for every found key's slot (racy by design, like lookups')."""
    for i in range(slot.shape[0]):
        if found[i]:
            policy[slot[i]] += weight


@_jit
def bump_versions(versions: np.ndarray, slot: np.ndarray) -> None:
    for i in range(slot.shape[0]):
        versions[slot[i]] += 1


@_jit
def read_slots(raw: np.ndarray, slot: np.ndarray, out: np.ndarray) -> None:
    """The rows of slots ``slot`` into ``out`` (uint8 ``[M, row_bytes]``), for a writer
    holding the lock (no other writer moves them meanwhile)."""
    row_bytes = out.shape[1]
    for i in range(slot.shape[0]):
        s = slot[i]
        for j in range(row_bytes):
            out[i, j] = raw[s, j]


@_jit
def write_slots(tkeys: np.ndarray, raw: np.ndarray, policy: np.ndarray, slot: np.ndarray,
                keys: np.ndarray, rows: np.ndarray, src: np.ndarray, new_policy: np.ndarray,
                with_rows: bool, with_policy: bool) -> None:
    """Slot ``slot[i]`` takes ``keys[i]``, row ``rows[src[i]]`` (uint8 ``[M, row_bytes]``)
    and counter ``new_policy[i]`` (each part only when asked for); the caller made the
    versions odd first and makes them even after."""
    row_bytes = rows.shape[1]
    for i in range(slot.shape[0]):
        s = slot[i]
        tkeys[s] = keys[i]
        if with_rows:
            r = src[i]
            for j in range(row_bytes):
                raw[s, j] = rows[r, j]
        if with_policy:
            policy[s] = new_policy[i]


@_jit
def plan_new(bucket_keys: np.ndarray, bucket_policy: np.ndarray, keys: np.ndarray, src: np.ndarray,
             bucket: np.ndarray, protected: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Where absent keys go (LFU-DA): the ``r``-th new key of a bucket (in the order given)
    takes the bucket's ``r``-th way by (priority, way), priority -1 for an empty way, else
    its counter; a protected way (a key this insert also writes, ``protected`` sorted) is
    never taken, and keys past the bucket's ways are not placed. A placed key's counter is
    1 in an empty way, else the victim's + 1.

    Returns ``(slots, keys, src, counters, buckets, filled)``: the placed keys, the
    distinct buckets the keys fell in, and how many keys went into empty ways.
    """
    ways = bucket_keys.shape[1]
    n = keys.shape[0]
    order = np.argsort(bucket, kind="mergesort")
    out_slot = np.empty(n, np.int64)
    out_key = np.empty(n, np.int64)
    out_src = np.empty(n, np.int64)
    out_pol = np.empty(n, np.int32)
    prio = np.empty(ways, np.int64)
    way_order = np.empty(ways, np.int64)
    touched = np.empty(n, np.int64)
    ntouched = 0
    nplaced = 0
    filled = 0
    i = 0
    while i < n:
        b = bucket[order[i]]
        touched[ntouched] = b
        ntouched += 1
        for w in range(ways):
            s = b * ways + w
            if bucket_keys[b, w] == _EMPTY:
                p = np.int64(-1)
            else:
                p = np.int64(bucket_policy[b, w])
            at = np.searchsorted(protected, s)
            if at < protected.shape[0] and protected[at] == s:
                p = PROTECTED
            # NOTE: insertion by (priority, way): a stable sort of at most 16 ways
            j = w
            while j > 0 and prio[j - 1] > p:
                prio[j] = prio[j - 1]
                way_order[j] = way_order[j - 1]
                j -= 1
            prio[j] = p
            way_order[j] = w
        rank = 0
        while i < n and bucket[order[i]] == b:
            if rank < ways and prio[rank] != PROTECTED:
                k = order[i]
                out_slot[nplaced] = b * ways + way_order[rank]
                out_key[nplaced] = keys[k]
                out_src[nplaced] = src[k]
                if prio[rank] < 0:
                    out_pol[nplaced] = 1
                    filled += 1
                else:
                    out_pol[nplaced] = np.int32(prio[rank] + 1)
                nplaced += 1
            rank += 1
            i += 1
    return (out_slot[:nplaced], out_key[:nplaced], out_src[:nplaced], out_pol[:nplaced],
            touched[:ntouched], filled)


@_jit
def decay(bucket_policy: np.ndarray, bucket: np.ndarray, cap: int) -> None:
    """Halve every counter of each given bucket where one of them passed ``cap``."""
    ways = bucket_policy.shape[1]
    for i in range(bucket.shape[0]):
        b = bucket[i]
        hot = False
        for w in range(ways):
            if bucket_policy[b, w] > cap:
                hot = True
        if hot:
            for w in range(ways):
                bucket_policy[b, w] >>= 1


_warm = False
_warm_lock = threading.Lock()


def warm_up() -> None:
    """Compile every loop (or load it from numba's cache beside this module) once per
    process, in the argument types the host cache calls them with;
    :mod:`nvecache.common.loop_gate` runs this in a child process, then here, while
    :mod:`hostcache.table_twin` serves."""
    global _warm
    if _warm:
        return
    with _warm_lock:
        if _warm:
            return
        ways = 8
        bucket_keys = np.full((1, ways), _EMPTY, np.int64)
        tkeys = bucket_keys.reshape(-1)
        bucket_policy = np.zeros((1, ways), np.int32)
        policy = bucket_policy.reshape(-1)
        versions = np.zeros(ways, np.int64)
        raw = np.zeros((ways, 16), np.uint8)
        keys = np.arange(1, dtype=np.int64)
        slot = np.zeros(1, np.int64)
        found = np.zeros(1, np.bool_)
        out = np.zeros((1, 8), np.uint8)
        dedup_last(keys)
        bucket = buckets(keys, 1)
        find(bucket_keys, keys, bucket, slot, found)
        lookup(tkeys, bucket_keys, versions, raw, policy, 1, keys, out, found, False)
        add_policy(policy, slot, found, 1)
        read_slots(raw, slot, out)
        none = np.zeros(0, np.int64)
        plan = plan_new(bucket_keys, bucket_policy, none, none, none, none)
        bump_versions(versions, plan[0])
        write_slots(tkeys, raw, policy, plan[0], plan[1], out, plan[2], plan[3], True, True)
        decay(bucket_policy, plan[4], 1 << 30)
        _warm = True
