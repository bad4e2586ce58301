"""The GPU cache's admission rounds keep a small cache's hot rows (gpu.stacks.misses.admission,
gpu.stacks.misses.miss_log).

Everything random is seeded: the Zipf key stream (its own generators) and the rounds'
sampling of miss occurrences (torch's default generator, seeded inside ``fork_rng``), so
every figure below is the same on every run. Asserted: bounds that follow from the rules
(a warm round admits at most its cap), and the hit-rate comparisons of these seeded runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from gpu import LayerType, NVEmbedding, TierConfig

ROWS = 1 << 17
DIM = 4
WARM, MEASURED = 30, 8


class ZipfKeys:
    """int64 keys in ``[0, rows)`` with P(rank r) ~ 1 / r**alpha, seeded."""

    def __init__(self, rows: int, alpha: float, seed: int) -> None:
        weights = torch.arange(1, rows + 1, dtype=torch.float64).pow(-alpha)
        self._cdf = torch.cumsum(weights, 0) / weights.sum()
        self._perm = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
        self._gen = torch.Generator().manual_seed(seed + 1)

    def sample(self, n: int) -> torch.Tensor:
        u = torch.rand(n, generator=self._gen, dtype=torch.float64)
        rank = torch.searchsorted(self._cdf, u).clamp_(max=self._perm.numel() - 1)
        return self._perm[rank]


@dataclass(frozen=True)
class Run:
    hit_rate: float  # over the measured lookups
    inserts: int  # keys the cache took during the measured lookups
    slots: int  # the cache's slots (an upper bound: rows * cache fraction)


def run(table: torch.Tensor, fraction: float, cache: float, batch: int,
        **tuning: float) -> Run:
    """A LinearUVM layer whose cache holds ``cache`` of the rows, behind Zipf 1.05 batches,
    with warm rounds capped at ``fraction`` of the slots."""
    slots = int(ROWS * cache)
    keys = ZipfKeys(ROWS, 1.05, seed=5)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the rounds' samples of miss occurrences (torch.randperm)
        layer = NVEmbedding(ROWS, DIM, torch.float32, LayerType.LinearUVM,
                            gpu_cache_size=slots * (8 + 4 + DIM * 4), storage=table,
                            device="cpu",
                            tuning=TierConfig(warm_round_fraction=fraction, **tuning))
        for _ in range(WARM):
            layer(keys.sample(batch))
        before = layer.stats().gpu
        for _ in range(MEASURED):
            layer(keys.sample(batch))
        after = layer.stats().gpu
    hits, misses = after.hits - before.hits, after.misses - before.misses
    return Run(hits / (hits + misses), after.inserts - before.inserts, slots)


@pytest.fixture
def table() -> torch.Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0))


def test_warm_cap_keeps_a_small_cache_hot_behind_large_batches(table) -> None:
    # a 1% cache, batches of 6% of the keys (a round after every lookup: 4x the slots)
    fraction = TierConfig().warm_round_fraction
    capped = run(table, fraction, 0.01, 8192)
    uncapped = run(table, 1.0, 0.01, 8192)
    # a lookup runs at most one round, and a warm round admits at most its cap
    assert capped.inserts <= MEASURED * max(1, int(capped.slots * fraction))
    assert uncapped.inserts > capped.inserts  # uncapped rounds do replace more
    assert capped.hit_rate > uncapped.hit_rate + 0.10, (capped, uncapped)


def test_warm_cap_changes_nothing_where_rounds_are_small(table) -> None:
    # a 10% cache, a round after every lookup: each round's misses stay under 1/8 of its
    # slots, so the cap never bites
    capped = run(table, TierConfig().warm_round_fraction, 0.1, 512, round_lookups=1)
    uncapped = run(table, 1.0, 0.1, 512, round_lookups=1)
    assert capped == uncapped
    assert 0.0 < capped.hit_rate < 1.0


def test_a_cache_fills_before_its_rounds_are_capped() -> None:
    """Zipf lookups repeat their hot keys, so the keys offered to a cache overstate what it
    takes: counted warm after one capacity's worth, a cache stayed below half full for
    eight capacities of keys (its warm rounds rare and capped); counted warm after
    ``warm_capacities`` (4) of them, it is nine tenths full by then."""
    rows, slots, batch = 20_000, 2048, 128  # batches below a round of their own
    table = torch.randn(rows, DIM)
    filled = {}
    for warm_capacities in (1.0, TierConfig().warm_capacities):
        keys = ZipfKeys(rows, 1.05, seed=1)
        layer = NVEmbedding(rows, DIM, torch.float32, LayerType.LinearUVM,
                            gpu_cache_size=slots * (8 + 4 + DIM * 4), storage=table,
                            device="cpu", tuning=TierConfig(warm_capacities=warm_capacities))
        for _ in range(8 * slots // batch):
            layer(keys.sample(batch))
        filled[warm_capacities] = int(layer.in_gpu_cache(torch.arange(rows)).sum()) / slots
        layer.close()
    assert TierConfig().warm_capacities > 1.0
    assert filled[1.0] < 0.5 and filled[TierConfig().warm_capacities] > 0.9, filled


def test_the_round_budget_counts_a_cache_warm_after_warm_capacities_of_keys() -> None:
    from gpu.cache.gpu_cache import GPUCache
    from gpu.stacks.misses.admission import RoundBudget

    cache = GPUCache(1024 * (8 + 4 + DIM * 4), DIM, torch.float32, torch.device("cpu"))
    budget = RoundBudget(cache, TierConfig(warm_capacities=2.5, warm_round_fraction=0.25))
    budget.admitted = 2 * cache.capacity
    assert not budget.warm and budget.cap() == cache.capacity
    budget.admitted = int(2.5 * cache.capacity)
    assert budget.warm and budget.cap() == cache.capacity // 4
    budget.reset()
    assert not budget.warm
    budget.make_warm()
    assert budget.warm
