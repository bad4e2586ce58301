"""The key hash: CPU (numpy, and the host cache's compiled loops) and torch paths give the
same bits as murmur3's fmix64.

The hash decides where a key lives in shared memory, for every process and for the GPU
kernels: a path that disagrees in one bit puts keys where no other reader looks.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hostcache import table_loops
from hostcache.hashing import _fmix_torch, bucket_of, hash_keys

U64 = (1 << 64) - 1
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def fmix64(key: int) -> int:
    """murmur3's fmix64 on Python integers (the reference), sign bit cleared."""
    x = key & U64
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & U64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & U64
    x ^= x >> 33
    return x & INT64_MAX


EDGES = [0, 1, -1, 2, INT64_MIN, INT64_MAX, INT64_MIN + 1, INT64_MAX - 1, 1 << 32, -(1 << 32),
         0x7FFF_FFFF, 0x8000_0000, 123456789012345]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(INT64_MIN, INT64_MAX), min_size=0, max_size=300),
       st.integers(1, 1 << 40))
def test_both_paths_match_the_reference(keys: list[int], num_buckets: int) -> None:
    t = torch.tensor(keys + EDGES, dtype=torch.int64)
    want = [fmix64(k) for k in keys + EDGES]
    assert hash_keys(t).tolist() == want  # the CPU path (numpy)
    assert _fmix_torch(t).tolist() == want  # the torch path (CUDA tensors, the GPU twin)
    assert bucket_of(t, num_buckets).tolist() == [h % num_buckets for h in want]
    assert (_fmix_torch(t) % num_buckets).tolist() == [h % num_buckets for h in want]
    # the host cache's compiled probe (hostcache.table_loops)
    assert table_loops.buckets(t.numpy(), num_buckets).tolist() == [
        h % num_buckets for h in want]


def test_strided_and_empty_input_and_the_result_dtype() -> None:
    base = torch.arange(-50, 50, dtype=torch.int64) * 7919
    strided = base[::3]
    assert not strided.is_contiguous()
    got = hash_keys(strided)
    assert got.dtype == torch.int64 and got.tolist() == [fmix64(k) for k in strided.tolist()]
    assert bucket_of(strided, 97).tolist() == [fmix64(k) % 97 for k in strided.tolist()]
    empty = torch.empty(0, dtype=torch.int64)
    assert hash_keys(empty).shape == (0,) and bucket_of(empty, 8).dtype == torch.int64
    # the input is left as it was (the numpy path works on a view of it)
    assert torch.equal(base, torch.arange(-50, 50, dtype=torch.int64) * 7919)
