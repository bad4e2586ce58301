"""A lookup's misses on the host, in compiled loops (numba): read off the miss list and
deduplicated, each in one call.

A Hierarchical lookup that missed few keys spent more of its call in the
per-operation cost of numpy and torch (a binary search in Python, ``np.unique``'s sort)
than in the work itself (bench/RESULTS.md, "Hierarchical layer at serving sizes").
"""

from __future__ import annotations

import numpy as np
from numba import njit

_jit = njit(cache=True, nogil=True, boundscheck=False)
#: Fibonacci hashing's multiplier (2**64 / the golden ratio)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@_jit
def take_listed(pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(keys, positions)`` of the used prefix of ``[key, position]`` pairs (a position
    is never negative; an unused pair's is -1), copied out; the prefix is marked unused
    again."""
    n = pairs.shape[0]
    if n == 0 or pairs[0, 1] < 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    lo, hi = 0, n  # NOTE: pairs[lo] is used; pairs[hi] is not, or hi is the end
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if pairs[mid, 1] < 0:
            hi = mid
        else:
            lo = mid
    keys = np.empty(hi, np.int64)
    where = np.empty(hi, np.int64)
    for i in range(hi):
        keys[i] = pairs[i, 0]
        where[i] = pairs[i, 1]
        pairs[i, 1] = -1
    return keys, where


@_jit
def dedup_first(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(distinct keys in order of first occurrence, each key's distinct index)``: with
    no key repeated, the keys themselves and ``0..n-1``."""
    n = keys.shape[0]
    bits = 4
    while (1 << bits) < 2 * n:
        bits += 1
    shift = np.uint64(64 - bits)
    mask = (1 << bits) - 1
    table = np.full(1 << bits, -1, np.int64)  # open addressing: an index into ukeys
    ukeys = np.empty(n, np.int64)
    inverse = np.empty(n, np.int64)
    u = 0
    for i in range(n):
        k = keys[i]
        h = np.int64((np.uint64(k) * _GOLDEN) >> shift)
        while True:
            j = table[h]
            if j < 0:
                table[h] = u
                ukeys[u] = k
                inverse[i] = u
                u += 1
                break
            if ukeys[j] == k:
                inverse[i] = j
                break
            h = (h + 1) & mask
    return ukeys[:u], inverse


def warm_up() -> None:
    """Compile both loops (or load them from numba's cache) in the argument types a
    lookup's miss path calls them with; :mod:`nvecache.common.loop_gate` runs this in a child
    process, then here."""
    pairs = np.full((2, 2), -1, np.int64)
    pairs[0] = (7, 0)
    keys, _ = take_listed(pairs)
    dedup_first(keys)
