"""A lookup's miss loops in numpy (gpu.stacks.misses.miss_twin) against the compiled ones
(gpu.stacks.misses.miss_loops): the same misses read off a list (and the list emptied alike), the
same
distinct keys and indices, for random lists and batches (repeated keys, empty ones)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu.stacks.misses import miss_loops, miss_twin


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 300), st.data())
def test_reading_off_the_list_matches(seed: int, cap: int, data: st.DataObject) -> None:
    rng = np.random.default_rng(seed)
    used = data.draw(st.integers(0, cap))
    pairs = np.full((cap, 2), -1, np.int64)
    pairs[:used, 0] = rng.integers(-(2**63), 2**63 - 1, used, dtype=np.int64)
    pairs[:used, 1] = rng.integers(0, 10**6, used)
    pairs[used:, 0] = rng.integers(0, 9, cap - used)  # NOTE: stale keys of unused pairs
    lists = [pairs.copy(), pairs.copy()]
    got = [loops.take_listed(p) for loops, p in zip((miss_loops, miss_twin), lists,
                                                     strict=True)]
    for a, b in zip(got[0], got[1], strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(lists[0], lists[1])
    assert got[1][0].size == used


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 2000), st.sampled_from([3, 50, 2**62]))
def test_dedup_matches(seed: int, n: int, spread: int) -> None:
    rng = np.random.default_rng(seed)
    keys = rng.integers(-spread, spread, n).astype(np.int64)
    for a, b in zip(miss_loops.dedup_first(keys), miss_twin.dedup_first(keys), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
