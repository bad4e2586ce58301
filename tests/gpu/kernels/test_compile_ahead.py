"""Compiling a round's kernels ahead (gpu.kernels.launch.compiling_ahead,
GPUCache.precompile_insert): the variants an insert launches are compiled side by side and
nothing runs; the insert that follows compiles nothing and places what the torch twin does.

CUDA only: the interpreter compiles nothing, and without a GPU there is no Triton to ask.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from gpu.cache.gpu_cache import GPUCache
from gpu.cache.records import PreparedInsert
from gpu.kernels.tiles import DEFAULT_TILES
from hostcache.layout import EMPTY_KEY

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU "
                                 "(precompiling is for compiled kernels; the interpreter "
                                 "compiles nothing)")]

# NOTE: tiles no other test builds a cache with: the variants are new to this process
TILES = replace(DEFAULT_TILES, insert_block_k=DEFAULT_TILES.insert_block_k * 4,
                scatter_block_k=DEFAULT_TILES.scatter_block_k * 8)
DIM, WAYS, BUCKETS = 19, 4, 64
INSERT_KERNELS = ("_insert_last_kernel", "_insert_probe_kernel", "_insert_plan_kernel",
                  "_insert_decay_kernel", "_insert_apply_kernel", "_scatter_rows_kernel")


def _cache(backend: str) -> GPUCache:
    slot = 8 + 4 + DIM * 4
    return GPUCache(BUCKETS * WAYS * slot, DIM, torch.float32, "cuda", ways=WAYS,
                    backend=backend, tiles=TILES)


def _insert_variants() -> dict[str, int]:
    from gpu.kernels.launch import loaded_variants

    return {name.rsplit(".", 1)[-1]: n for name, n in loaded_variants().items()
            if name.rsplit(".", 1)[-1] in INSERT_KERNELS}


def test_precompiled_insert_compiles_each_kernel_and_the_insert_then_compiles_none() -> None:
    from gpu.kernels.launch import compiling_ahead

    n = 333
    cache, twin = _cache("triton"), _cache("torch")
    g = torch.Generator(device="cuda").manual_seed(5)
    keys = torch.randint(-1000, 1000, (n,), device="cuda", generator=g)
    keys[::7] = EMPTY_KEY  # NOTE: padding, as in a log that is not full
    values = torch.randn(n, DIM, device="cuda", generator=g)
    prep = PreparedInsert.empty(n, "cuda")
    before, stats = _insert_variants(), cache.stats()

    with compiling_ahead():
        cache.precompile_insert(prep, values)
    torch.cuda.synchronize()
    compiled = _insert_variants()
    # one new variant of every kernel the insert launches, and nothing ran
    assert {k: compiled.get(k, 0) - before.get(k, 0) for k in INSERT_KERNELS} == \
        dict.fromkeys(INSERT_KERNELS, 1)
    assert cache.stats() == stats
    assert not (cache.state()[0] != EMPTY_KEY).any()

    for step in range(3):  # the same buffers, other keys: a kept log's rounds
        cache.sort_insert_keys(keys, prep)
        cache.sort_insert_buckets(prep)
        cache.apply_insert(prep, values)
        twin.insert(keys, values, validate=False)
        for ours, theirs in zip(cache.state(), twin.state(), strict=True):
            assert torch.equal(ours, theirs), step
        keys = torch.where(keys == EMPTY_KEY, keys, keys + 700)  # some new, some kept
    assert _insert_variants() == compiled


def test_a_compile_that_fails_ahead_is_raised_by_the_first_launch() -> None:
    """A variant that does not compile is not an error of the precompile (logged): the
    launch that needs it raises Triton's error, as without precompiling."""
    from gpu.kernels.launch import DirectLaunch, compiling_ahead
    from tests.gpu.kernels.broken_kernel import broken

    launch = DirectLaunch(broken)
    x = torch.zeros(16, device="cuda")
    with compiling_ahead():
        launch.precompile((1,), (x, 16), {"BLOCK": 16})
    with pytest.raises(Exception, match="undefined_name"):
        launch((1,), (x, 16), {"BLOCK": 16}, ("broken",))
    assert torch.equal(x, torch.zeros(16, device="cuda"))
