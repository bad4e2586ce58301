"""The GPU cache's admission rounds keep a small cache's hot rows (gpu.tiers)."""

from __future__ import annotations

import pytest
import torch

from bench.bench_admission import hit_rate
from gpu import tiers


@pytest.fixture
def table() -> torch.Tensor:
    return torch.randn(1 << 17, 4, generator=torch.Generator().manual_seed(0))


def rate(table: torch.Tensor, fraction: float, cache: float, batch: int) -> float:
    old = tiers.WARM_ROUND_FRACTION
    tiers.WARM_ROUND_FRACTION = fraction
    try:
        return hit_rate(table, cache, batch, 1.0, warm=30, measured=8)
    finally:
        tiers.WARM_ROUND_FRACTION = old


def test_warm_cap_keeps_a_small_cache_hot_behind_large_batches(table) -> None:
    # a 1% cache, batches of 6% of the keys: uncapped rounds replace the whole cache
    capped = rate(table, tiers.WARM_ROUND_FRACTION, 0.01, 8192)
    uncapped = rate(table, 1.0, 0.01, 8192)
    assert capped > uncapped + 0.10, (capped, uncapped)


def test_warm_cap_changes_nothing_where_rounds_are_small(table) -> None:
    # a 10% cache: rounds stay under 1/8 of its slots, so the cap never bites
    assert rate(table, tiers.WARM_ROUND_FRACTION, 0.1, 512) == rate(table, 1.0, 0.1, 512)
