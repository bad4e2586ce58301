"""The host cache's compiled loops against references: the placement of new keys
(``plan_new``) against the LFU-DA rules written out per key in Python, and its dedup against
the torch one a ``SharedMemBlock`` write uses."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hostcache import table_loops
from hostcache.layout import EMPTY_KEY


def reference(tkeys2: np.ndarray, policy2: np.ndarray, keys: list[int], src: list[int],
              bucket: list[int], protected: set[int]) -> tuple[list[tuple[int, ...]], int]:
    """The rules one key at a time: keys grouped by bucket (stable), the r-th new key of
    a bucket takes the r-th way by (priority, way) unless it is protected; priority -1 for
    an empty way, else the counter; the new counter is 1 or the victim's + 1."""
    ways = tkeys2.shape[1]
    placed, filled = [], 0
    for b in sorted(set(bucket)):
        mine = [i for i in range(len(keys)) if bucket[i] == b]
        prio = []
        for w in range(ways):
            s = b * ways + w
            p = -1 if tkeys2[b, w] == EMPTY_KEY else int(policy2[b, w])
            prio.append((int(table_loops.PROTECTED) if s in protected else p, w))
        prio.sort()
        for r, i in enumerate(mine):
            if r >= ways or prio[r][0] == table_loops.PROTECTED:
                continue
            p, w = prio[r]
            placed.append((b * ways + w, keys[i], src[i], 1 if p < 0 else p + 1))
            filled += p < 0
    return placed, filled


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([8, 16]), st.integers(1, 6), st.data())
def test_plan_new_follows_the_lfu_da_rules(ways: int, num_buckets: int,
                                           data: st.DataObject) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    slots = num_buckets * ways
    tkeys = np.where(rng.random(slots) < 0.4, EMPTY_KEY,
                     rng.integers(0, 1000, slots)).astype(np.int64)
    policy = rng.integers(0, 5, slots).astype(np.int32)  # ties between ways are common
    n = data.draw(st.integers(0, 3 * ways))
    keys = rng.integers(1000, 10**6, n).astype(np.int64)
    src = rng.permutation(n).astype(np.int64)
    bucket = rng.integers(0, num_buckets, n).astype(np.int64)
    protected = np.sort(rng.choice(slots, data.draw(st.integers(0, slots // 2)),
                                   replace=False)).astype(np.int64)
    slot, pkeys, psrc, pol, touched, filled = table_loops.plan_new(
        tkeys.reshape(num_buckets, ways), policy.reshape(num_buckets, ways), keys, src,
        bucket, protected)
    want, want_filled = reference(tkeys.reshape(num_buckets, ways),
                                  policy.reshape(num_buckets, ways), keys.tolist(),
                                  src.tolist(), bucket.tolist(), set(protected.tolist()))
    got = sorted(zip(slot.tolist(), pkeys.tolist(), psrc.tolist(), pol.tolist(), strict=True))
    assert got == sorted(want)
    assert filled == want_filled
    assert sorted(touched.tolist()) == sorted(set(bucket.tolist()))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-(1 << 63), (1 << 63) - 1) | st.integers(-3, 3), max_size=60))
def test_dedup_last_agrees_with_the_torch_one(keys: list[int]) -> None:
    """The host cache's compiled dedup and ``validate.dedup_last`` (which a
    ``SharedMemBlock`` write uses, so that process never loads numba) give one answer:
    distinct keys ascending, each one's last position, each key's distinct index."""
    import torch

    from hostcache.validate import dedup_last

    kn = np.array(keys, dtype=np.int64)
    got = table_loops.dedup_last(kn)
    want = dedup_last(torch.from_numpy(kn.copy()))
    for g, w in zip(got, want, strict=True):
        assert g.tolist() == w.tolist()


def test_lookup_keeps_its_seqlock_passes_fenced() -> None:
    """The lookup's seqlock window is one compiled loop: without its fences the compiler
    may merge the two loads of a slot's version (a torn row then reads as a hit). Compile
    it afresh (the cached build cannot be inspected) and count them in the code."""
    from numba import njit

    loop = njit(nogil=True, boundscheck=False)(table_loops.lookup.py_func)
    tkeys2 = np.full((1, 8), EMPTY_KEY, np.int64)
    out = np.zeros((1, 8), np.uint8)
    hit = np.ones(1, np.bool_)
    hits = loop(tkeys2.reshape(-1), tkeys2, np.zeros(8, np.int64),
                np.zeros((8, 16), np.uint8), np.zeros(8, np.int32), 1,
                np.arange(1, dtype=np.int64), out, hit, False)
    assert hits == 0 and not hit[0]
    ir = next(iter(loop.inspect_llvm().values()))
    assert sum("fence seq_cst" in line for line in ir.splitlines()) >= 3
