"""Key streams of the standard workload (../shared/BENCHMARKS.md): Zipf by inverse CDF over
the table, then a random permutation so hot keys are spread over the key space."""

from __future__ import annotations

import torch


class ZipfKeys:
    """Draws int64 keys in ``[0, num_keys)`` with P(rank r) ~ 1 / r**alpha (alpha 0: uniform)."""

    def __init__(self, num_keys: int, alpha: float, *, seed: int = 0) -> None:
        self.num_keys = num_keys
        self.alpha = alpha
        self._gen = torch.Generator().manual_seed(seed)
        ranks = torch.arange(1, num_keys + 1, dtype=torch.float64)
        weights = ranks.pow(-alpha)
        self._cdf = torch.cumsum(weights, 0) / weights.sum()
        self._perm = torch.randperm(num_keys, generator=self._gen)

    def sample(self, n: int) -> torch.Tensor:
        u = torch.rand(n, generator=self._gen, dtype=torch.float64)
        rank = torch.searchsorted(self._cdf, u).clamp_(max=self.num_keys - 1)
        return self._perm[rank]
