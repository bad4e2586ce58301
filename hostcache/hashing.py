"""The key hash shared by every tier (host cache on the CPU, GPU cache, Triton kernels).

The hash is murmur3's 64-bit finaliser written with operations that give the same bits in
torch on the CPU and in Triton on the GPU: wrapping int64 multiplication and a *logical*
right shift emulated by an arithmetic shift plus mask. The result is non-negative, so
``hash % num_buckets`` is a valid bucket index everywhere. CPU tensors are hashed with
numpy's uint64 arithmetic instead (the same bits: tests/hostcache/test_hashing.py): half
the operations, shifts logical natively and in place, so less per-operation overhead on a
lookup's few thousand keys (bench/RESULTS.md, "Host cache (CPU)").

NOTE: changing any constant here changes the shared-memory layout: bump
``hostcache.layout.LAYOUT_VERSION`` together with it.
"""

from __future__ import annotations

import numpy as np
import torch

from nvecache.common.fmix import M1, M2, fmix64

#: murmur3 fmix64 multipliers as signed int64 (two's complement of the unsigned constants).
FMIX_M1 = M1 - (1 << 64)
FMIX_M2 = M2 - (1 << 64)
#: (x >> 33) logical == (x >> 33 arithmetic) & MASK31
MASK31 = (1 << 31) - 1
INT64_MAX = (1 << 63) - 1


_U_POS = np.uint64(INT64_MAX)


def _fmix_torch(keys: torch.Tensor) -> torch.Tensor:
    x = keys ^ ((keys >> 33) & MASK31)
    x = x * FMIX_M1
    x = x ^ ((x >> 33) & MASK31)
    x = x * FMIX_M2
    x = x ^ ((x >> 33) & MASK31)
    return x & INT64_MAX


def _fmix_numpy(keys: torch.Tensor) -> np.ndarray:
    """fmix64 in numpy's wrapping uint64 arithmetic (logical shifts), cleared sign bit."""
    x = fmix64(keys.numpy())
    x &= _U_POS
    return x


def hash_keys(keys: torch.Tensor) -> torch.Tensor:
    """Hash int64 keys to non-negative int64 values, bit-identical to the Triton twin."""
    if keys.device.type == "cpu":
        return torch.from_numpy(_fmix_numpy(keys).view(np.int64))
    return _fmix_torch(keys)


def bucket_of(keys: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Bucket index in ``[0, num_buckets)`` of every key."""
    if keys.device.type == "cpu":
        return torch.from_numpy((_fmix_numpy(keys) % np.uint64(num_buckets)).view(np.int64))
    return _fmix_torch(keys) % num_buckets
