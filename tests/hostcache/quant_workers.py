"""Spawned workers of tests/hostcache/test_cache_quantized.py: a writer cycling a quantized
cache's rows through versions, and a reader counting rows that are not one whole version
(a payload read with another version's scale and bias)."""

from __future__ import annotations

from typing import Any

import torch

from hostcache import HostCache
from nvecache.common import quant

DIM = 24
VERSIONS = 4


def version_rows(keys: torch.Tensor, version: int) -> torch.Tensor:
    """Rows whose range and offset name their key and version (each version's scale and
    bias differ, so a torn read does not decode to any version's row)."""
    j = torch.arange(DIM, dtype=torch.float32)
    return keys.float()[:, None] + 1000.0 * version + j[None, :] * (version + 1)


def expected(keys: torch.Tensor, version: int, fmt: Any) -> torch.Tensor:
    return quant.decode(quant.encode(version_rows(keys, version), fmt), fmt)


def writer(name: str, keys: torch.Tensor, rounds: int, ready: Any, go: Any, out: Any
           ) -> None:
    with HostCache.attach(name) as hc:
        ready.set()
        go.wait()
        for r in range(rounds):
            hc.update(keys, version_rows(keys, r % VERSIONS))
        out.put(("writer", rounds))


def reader(name: str, keys: torch.Tensor, done: Any, ready: Any, go: Any, out: Any) -> None:
    with HostCache.attach(name) as hc:
        fmt = hc.geometry.row_format
        want = torch.stack([expected(keys, v, fmt) for v in range(VERSIONS)])  # [V, N, D]
        ready.set()
        go.wait()
        lookups = torn = 0
        while not done.is_set() or lookups < 50:
            values, hit = hc.lookup(keys)
            lookups += 1
            same = (values[None] == want).all(dim=2).any(dim=0)  # one whole version
            torn += int((hit & ~same).sum())
        out.put(("reader", lookups, torn))
