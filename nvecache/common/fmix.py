"""murmur3's 64-bit finaliser (fmix64), the key hash of every tier, in numpy.

The host cache's buckets and the ``file://`` row mirror's home slots both start from it
(``hostcache.hashing`` for the bucket rule and the torch/Triton forms, bit for bit; the
compiled loops read :data:`M1` and :data:`M2` from here as numba constants). It lives here, in the
lowest tier, so that psclient and hostcache use one definition.

NOTE: changing a constant changes the host cache's shared-memory layout and the row
mirror's file format: bump ``hostcache.layout.LAYOUT_VERSION`` and the mirror's format.
"""

from __future__ import annotations

import numpy as np

#: fmix64's multipliers, as unsigned 64-bit integers
M1 = 0xFF51AFD7ED558CCD
M2 = 0xC4CEB9FE1A85EC53

_M1 = np.uint64(M1)
_M2 = np.uint64(M2)
_S33 = np.uint64(33)


def fmix64(keys: np.ndarray) -> np.ndarray:
    """fmix64 of int64 (or uint64) ``keys`` in numpy's wrapping uint64 arithmetic: a new
    uint64 array (logical shifts; every bit kept)."""
    x = keys.view(np.uint64)
    x = x ^ (x >> _S33)
    x *= _M1
    x ^= x >> _S33
    x *= _M2
    x ^= x >> _S33
    return x
