"""A lookup's misses read off and deduplicated in numpy: :mod:`gpu.stacks.misses.miss_loops`' twin.

The same functions and results as the compiled loops (tests hold them equal), serving a
process's lookups until its compiled loops are ready (:mod:`nvecache.common.loop_gate`;
:data:`GATE` hands out one or the other).
"""

from __future__ import annotations

import sys

import numpy as np

from nvecache.common.loop_gate import LoopGate


def take_listed(pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(keys, positions)`` of the used prefix of ``[key, position]`` pairs (an unused
    pair's position is -1), copied out; the prefix is marked unused again."""
    n = pairs.shape[0]
    if n == 0 or pairs[0, 1] < 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    lo, hi = 0, n  # NOTE: pairs[lo] is used; pairs[hi] is not, or hi is the end
    while hi - lo > 1:  # a binary search: one step per halving, not per key
        mid = (lo + hi) // 2
        if pairs[mid, 1] < 0:
            hi = mid
        else:
            lo = mid
    keys = pairs[:hi, 0].copy()
    where = pairs[:hi, 1].copy()
    pairs[:hi, 1] = -1
    return keys, where


def dedup_first(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(distinct keys in order of first occurrence, each key's distinct index)``."""
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    order = np.argsort(first)  # NOTE: first positions are distinct: any sort is stable
    rank = np.empty(order.size, np.int64)
    rank[order] = np.arange(order.size)
    return keys[first[order]], rank[inverse.reshape(-1)]


#: the compiled loops once ready, this twin until then
GATE = LoopGate("gpu.stacks.misses.miss_loops", sys.modules[__name__])
