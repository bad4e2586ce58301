"""gpu/kernels/key_hash.py: the one Triton copy of the host tier's key hash, and how every
kernel module gets it (the same variant, compiled or interpreted, as its own kernels)."""

from __future__ import annotations

import pytest
import torch

from gpu.kernels.triton_access import kernel_module, triton_available
from hostcache import hashing

needs_triton = pytest.mark.skipif(
    not triton_available(), reason="needs the triton package (`pip install triton`); "
    "its CPU interpreter runs the kernels on CPU tensors")

#: (kernel module, its name for a helper, the helper's module, the helper's name)
HELPERS = [
    ("host_tier", "bucket_of", "key_hash", "bucket_of"),
    ("host_tier", "hash_keys", "key_hash", "hash_keys"),
    ("cache_probe", "bucket_of", "key_hash", "bucket_of"),
    ("cache_insert", "bucket_of", "key_hash", "bucket_of"),
    ("cache_insert", "probe", "cache_probe", "probe"),
    ("cache_lookup", "probe", "cache_probe", "probe"),
]


@needs_triton
@pytest.mark.parametrize("interpret", [True, False])
@pytest.mark.parametrize(("stem", "name", "helper_stem", "helper_name"), HELPERS)
def test_kernel_modules_call_helpers_of_their_own_variant(
        stem: str, name: str, helper_stem: str, helper_name: str, interpret: bool) -> None:
    """A compiled kernel module calls compiled helpers, an interpreted one interpreted
    helpers: the one copy of each, decorated the same way as the caller."""
    helper = getattr(kernel_module(helper_stem, interpret=interpret), helper_name)
    assert getattr(kernel_module(stem, interpret=interpret), name) is helper
    other = getattr(kernel_module(helper_stem, interpret=not interpret), helper_name)
    assert type(other) is not type(helper)  # the two variants are different decorations


@needs_triton
def test_interpreted_hash_is_hostcache_hashing_bit_for_bit() -> None:
    keys = torch.cat([
        torch.randint(-(2**63), 2**63 - 1, (2000,), generator=torch.Generator().manual_seed(0)),
        torch.tensor([0, 1, -1, 2**63 - 1, -(2**63) + 1, -(2**63), 2**32, -(2**32)]),
    ])
    host_tier = kernel_module("host_tier", interpret=True)
    for num_buckets in (1, 7, 1000, 2**31 + 11, 2**40 + 3):
        out = torch.empty_like(keys)
        host_tier.bucket_kernel[(-(-keys.numel() // 1024),)](
            keys, out, keys.numel(), num_buckets, BLOCK=1024)
        assert torch.equal(out, hashing.bucket_of(keys, num_buckets))
