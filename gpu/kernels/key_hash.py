"""The host tier's key hash in Triton: ``hostcache.hashing.bucket_of``, bit for bit.

One home for the ``@triton.jit`` hash every kernel module uses (the GPU cache's probe and
insert, the host-tier reader's probe and sort keys), so the CPU tables, the CPU twins and
the kernels agree on every key's bucket. Written with the same integer operations as
``hostcache.hashing``: fmix64 with wrapping int64 multiplies, the logical right shift as
an arithmetic shift and a mask, the sign bit cleared, then ``% num_buckets``.

Like the kernel modules, this file is loaded only through :mod:`gpu.kernels.triton_access`: a kernel
module takes it from :func:`gpu.kernels.triton_access.helper_module`, so compiled kernels call the
compiled helpers and interpreted kernels the interpreted ones.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hostcache import hashing
from nvecache.common import fmix

# NOTE: fmix64's multipliers from their one home, as the signed int64 values the wrapping
# multiplies take
_M1: tl.constexpr = tl.constexpr(fmix.M1 - (1 << 64) if fmix.M1 >> 63 else fmix.M1)
_M2: tl.constexpr = tl.constexpr(fmix.M2 - (1 << 64) if fmix.M2 >> 63 else fmix.M2)
_MASK31: tl.constexpr = tl.constexpr(hashing.MASK31)
_INT64_MAX: tl.constexpr = tl.constexpr(hashing.INT64_MAX)


@triton.jit
def hash_keys(k):
    """``hostcache.hashing.hash_keys``: a non-negative int64 hash of every key of ``k``."""
    x = k ^ ((k >> 33) & _MASK31)
    x = x * _M1
    x = x ^ ((x >> 33) & _MASK31)
    x = x * _M2
    x = x ^ ((x >> 33) & _MASK31)
    return x & _INT64_MAX


@triton.jit
def bucket_of(k, num_buckets):
    """``hostcache.hashing.bucket_of``: the bucket of every key of ``k``."""
    return hash_keys(k) % num_buckets
