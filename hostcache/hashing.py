"""The key hash shared by every tier (host cache on the CPU, GPU cache, Triton kernels).

The hash is murmur3's 64-bit finaliser written with operations that give the same bits in
torch on the CPU and in Triton on the GPU: wrapping int64 multiplication and a *logical*
right shift emulated by an arithmetic shift plus mask. The result is non-negative, so
``hash % num_buckets`` is a valid bucket index everywhere.

NOTE: changing any constant here changes the shared-memory layout: bump
``hostcache.layout.LAYOUT_VERSION`` together with it.
"""

from __future__ import annotations

import torch

#: murmur3 fmix64 multipliers as signed int64 (two's complement of the unsigned constants).
FMIX_M1 = 0xFF51AFD7ED558CCD - (1 << 64)
FMIX_M2 = 0xC4CEB9FE1A85EC53 - (1 << 64)
#: (x >> 33) logical == (x >> 33 arithmetic) & MASK31
MASK31 = (1 << 31) - 1
INT64_MAX = (1 << 63) - 1


def hash_keys(keys: torch.Tensor) -> torch.Tensor:
    """Hash int64 keys to non-negative int64 values, bit-identical to the Triton twin."""
    x = keys ^ ((keys >> 33) & MASK31)
    x = x * FMIX_M1
    x = x ^ ((x >> 33) & MASK31)
    x = x * FMIX_M2
    x = x ^ ((x >> 33) & MASK31)
    return x & INT64_MAX


def bucket_of(keys: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Bucket index in ``[0, num_buckets)`` of every key."""
    return hash_keys(keys) % num_buckets
