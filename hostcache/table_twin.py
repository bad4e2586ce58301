"""The host cache's per-key loops as vectorized numpy: :mod:`hostcache.table_loops`' twin.

The same functions, arguments and results as the compiled loops (tests hold them equal),
serving a process's calls until its compiled loops are ready (:mod:`nvecache.common.loop_gate`;
:data:`GATE` hands out one or the other). Each pass of a compiled loop over the batch is
a numpy operation over it here: the same probe (a key's bucket by the same hash, its ways
in order, the first way holding it), the same placement and the same seqlock protocol.

NOTE: the seqlock here, as in the compiled loops. A reader (:func:`lookup`) loads every
slot's version, then the rows and keys, then the versions again: three numpy calls, one
pass each, with :func:`fence` between them. A writer makes the versions odd, writes, and
makes them even again, :func:`bump_versions` fencing before and after its pass. Separate
numpy calls are opaque to the C compiler (called through the interpreter), so it cannot
move a load or store from one pass into another; the hardware could. On x86 (TSO) it
cannot either: loads are not reordered with loads, nor stores with stores, and the lock
operations in :func:`fence` are locked instructions (full barriers) anyway. On ARM
(AArch64) :func:`fence` orders them: the release of a lock orders every earlier load and
store before it, a release followed by an acquire is observed in program order (RCsc),
and the acquire orders every later load and store after it, so each pass completes
before the next begins, as the compiled loops' ``seq_cst`` fences make it.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

from hostcache.layout import EMPTY_KEY
from nvecache.common.fmix import fmix64
from nvecache.common.loop_gate import LoopGate

_POS = np.uint64(0x7FFFFFFFFFFFFFFF)
_EMPTY = np.int64(EMPTY_KEY)
#: a way that must not be taken (its key is being written by the same insert)
PROTECTED = np.int64(np.iinfo(np.int32).max)


def fence() -> None:
    """A full barrier between two passes over shared memory (see the module's NOTE): an
    acquire, a release and an acquire of a new lock."""
    lock = threading.Lock()
    lock.acquire()
    lock.release()
    lock.acquire()


def buckets(keys: np.ndarray, num_buckets: int) -> np.ndarray:
    """The bucket of every key (``hostcache.hashing.bucket_of``)."""
    x = fmix64(keys) & _POS
    return (x % np.uint64(num_buckets)).view(np.int64)


def dedup_last(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(distinct keys ascending, each one's last position, each key's distinct index)``."""
    n = keys.shape[0]
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    start = np.ones(n, np.bool_)
    np.not_equal(ordered[1:], ordered[:-1], out=start[1:])
    end = np.ones(n, np.bool_)
    end[:-1] = start[1:]  # NOTE: a stable sort: a run's last element is the key's last position
    inverse = np.empty(n, np.int64)
    inverse[order] = np.cumsum(start) - 1
    return ordered[start], order[end].astype(np.int64), inverse


def _probe(bucket_keys: np.ndarray, keys: np.ndarray, bucket: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray]:
    """(slot, found): the first way of its bucket holding each key (way 0 where none)."""
    ways = bucket_keys.shape[1]
    same = bucket_keys[bucket] == keys[:, None]
    return bucket * ways + same.argmax(axis=1), same.any(axis=1)


def find(bucket_keys: np.ndarray, keys: np.ndarray, bucket: np.ndarray, slot: np.ndarray,
         found: np.ndarray) -> None:
    """Each key's slot (way 0 of its bucket where absent) and whether it is there."""
    slot[:], found[:] = _probe(bucket_keys, keys, bucket)


def lookup(tkeys: np.ndarray, bucket_keys: np.ndarray, versions: np.ndarray, raw: np.ndarray,
           policy: np.ndarray, num_buckets: int, keys: np.ndarray, out: np.ndarray,
           hit: np.ndarray, count: bool) -> int:
    """A whole lookup: each key's slot by its bucket's keys, then the seqlock window over
    every slot (versions, then rows and keys, then versions again, fenced apart), rows
    into ``out`` (a miss's row zeroed), each hit's policy counter bumped when ``count``.
    Returns how many hit."""
    nb = out.shape[1]
    slot, found = _probe(bucket_keys, keys, buckets(keys, num_buckets))
    fence()
    before = versions[slot]
    fence()
    if slot.size:
        np.take(raw[:, :nb], slot, axis=0, out=out, mode="clip")
    inside = tkeys[slot]
    fence()
    # NOTE: even before and unchanged after in one comparison (versions only grow)
    h = found & (inside == keys) & (versions[slot] == (before & -2))
    hit[:] = h
    out[~h] = 0
    hits = int(np.count_nonzero(h))
    if count and hits:
        np.add.at(policy, slot[h], np.int32(1))  # NOTE: once per hit, a repeated key too
    return hits


def _as_counter(weight: int) -> np.int32:
    """``weight`` as an int32 addend, wrapped as the compiled loops' int32 stores wrap."""
    return np.int64(weight).astype(np.int32)


def add_policy(policy: np.ndarray, slot: np.ndarray, found: np.ndarray, weight: int) -> None:
    """``weight`` more hits for every found key's slot (racy by design, like lookups')."""
    np.add.at(policy, slot[found], _as_counter(weight))


def bump_versions(versions: np.ndarray, slot: np.ndarray) -> None:
    """One more on each slot's version (once per occurrence), fenced before and after."""
    fence()
    np.add.at(versions, slot, np.int64(1))
    fence()


def read_slots(raw: np.ndarray, slot: np.ndarray, out: np.ndarray) -> None:
    """The rows of slots ``slot`` into ``out`` (uint8 ``[M, row_bytes]``), for a writer
    holding the lock."""
    out[:] = raw[slot, :out.shape[1]]


def write_slots(tkeys: np.ndarray, raw: np.ndarray, policy: np.ndarray, slot: np.ndarray,
                keys: np.ndarray, rows: np.ndarray, src: np.ndarray, new_policy: np.ndarray,
                with_rows: bool, with_policy: bool) -> None:
    """Slot ``slot[i]`` takes ``keys[i]``, row ``rows[src[i]]`` and counter
    ``new_policy[i]`` (each part only when asked for); slots are distinct."""
    tkeys[slot] = keys
    if with_rows:
        raw[slot, :rows.shape[1]] = rows[src]
    if with_policy:
        policy[slot] = new_policy


def plan_new(bucket_keys: np.ndarray, bucket_policy: np.ndarray, keys: np.ndarray, src: np.ndarray,
             bucket: np.ndarray, protected: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Where absent keys go (LFU-DA), as :func:`hostcache.table_loops.plan_new`: the
    ``r``-th new key of a bucket (in the order given) takes the bucket's ``r``-th way by
    (priority, way), never a protected one (``protected`` sorted).

    Returns ``(slots, keys, src, counters, buckets, filled)``.
    """
    ways = bucket_keys.shape[1]
    n = keys.shape[0]
    order = np.argsort(bucket, kind="stable")
    grouped = bucket[order]
    start = np.ones(n, np.bool_)
    np.not_equal(grouped[1:], grouped[:-1], out=start[1:])
    touched = grouped[start]
    group = np.cumsum(start) - 1
    rank = np.arange(n) - np.flatnonzero(start)[group]  # a key's place among its bucket's
    slots = touched[:, None] * ways + np.arange(ways)
    prio = np.where(bucket_keys[touched] == _EMPTY, np.int64(-1),
                    bucket_policy[touched].astype(np.int64))
    if protected.size:
        at = np.minimum(np.searchsorted(protected, slots), protected.size - 1)
        prio[protected[at] == slots] = PROTECTED
    way_order = np.argsort(prio, axis=1, kind="stable")  # NOTE: by (priority, way)
    ranked = np.take_along_axis(prio, way_order, axis=1)
    r = np.minimum(rank, ways - 1)
    p = ranked[group, r]
    placed = (rank < ways) & (p != PROTECTED)
    k = order[placed]
    p = p[placed]
    out_slot = grouped[placed] * ways + way_order[group[placed], r[placed]]
    counters = np.where(p < 0, np.int64(1), p + 1).astype(np.int32)
    return (out_slot.astype(np.int64), keys[k], src[k], counters, touched,
            int(np.count_nonzero(p < 0)))


def decay(bucket_policy: np.ndarray, bucket: np.ndarray, cap: int) -> None:
    """Halve every counter of each given bucket (distinct, as :func:`plan_new` gives
    them) where one of them passed ``cap``."""
    hot = bucket[(bucket_policy[bucket] > cap).any(axis=1)]
    bucket_policy[hot] >>= 1


#: the compiled loops once ready, this twin until then
GATE = LoopGate("hostcache.table_loops", sys.modules[__name__])
