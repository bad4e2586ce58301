"""One rule for a batch of keys (nvecache.common.keys), raised as each tier's own typed error."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import gpu
import hostcache
import psclient
from gpu.cache.gpu_cache import GPUCache
from nvecache.common.keys import key_problem
from tests.conftest import fresh_name

BAD = [
    ([1, 2], "torch.Tensor of int64"),
    (torch.tensor([1.0, 2.0]), "torch.int64"),
    (torch.zeros(2, 2, dtype=torch.int64), "1-D"),
    (torch.zeros(2, dtype=torch.int64, device="meta"), "must be on cpu"),
]


@pytest.mark.parametrize(("keys", "words"), BAD)
def test_key_problem_says_what_is_wrong_and_how_to_fix_it(keys: Any, words: str) -> None:
    problem = key_problem(keys)
    assert problem is not None and words in problem
    assert key_problem(torch.arange(3)) is None
    # a layer's input may have any shape
    assert key_problem(torch.zeros(2, 2, dtype=torch.int64), any_shape=True) is None


@pytest.fixture
def every_tier(tmp_path: Path) -> Iterator[list[tuple[type[Exception], Callable[[Any], Any]]]]:
    """(error type, lookup) of the parameter server, the host cache, the GPU cache and a
    layer, all on the CPU."""
    ps = psclient.connect(f"file://{tmp_path}/s", table="t", dim=2)
    hc = hostcache.HostCache.create(fresh_name(), capacity=16, dim=2)
    cache = GPUCache(1 << 12, 2, torch.float32, "cpu")
    layer = gpu.NVEmbedding(10, 2, torch.float32, gpu.LayerType.GPULayer, device="cpu")
    try:
        yield [(psclient.BadKeysError, ps.lookup), (hostcache.BadArgumentError, hc.lookup),
               (gpu.BadArgumentError, cache.lookup), (gpu.BadArgumentError, layer)]
    finally:
        ps.close()
        hc.close()
        hostcache.HostCache.unlink(hc.name)


# a layer takes keys of any shape: the 2-D case is not an error there
@pytest.mark.parametrize(("keys", "words"), [b for b in BAD if b[1] != "1-D"])
def test_every_tier_raises_the_rule_as_its_own_typed_error(
        every_tier: list[tuple[type[Exception], Callable[[Any], Any]]], keys: Any,
        words: str) -> None:
    for error, lookup in every_tier:
        with pytest.raises(error, match=words.replace(".", r"\.")):
            lookup(keys)
