"""The demo's request stream: ranking requests whose keys follow a Zipf popularity.

Popularity is the standard workload's (docs of bench/workloads.py): P(rank r) ~ 1/r**alpha
over the table, drawn by inverse CDF, ranks mapped to keys through a random permutation so
hot keys are spread over the key space. The permutation is the same in every replica (one
node serves one population of users and items); the draws differ per replica.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class ZipfKeys:
    """int64 keys in ``[0, num_keys)`` with P(rank r) ~ 1 / r**alpha.

    Args:
        num_keys: size of the key space.
        alpha: Zipf exponent (0 gives uniform keys).
        popularity_seed: seeds the rank -> key permutation (share it between replicas).
        seed: seeds the draws.
    """

    def __init__(self, num_keys: int, alpha: float, *, popularity_seed: int, seed: int) -> None:
        self.num_keys = num_keys
        ranks = torch.arange(1, num_keys + 1, dtype=torch.float64)
        weights = ranks.pow(-alpha)
        self._cdf = torch.cumsum(weights, 0) / weights.sum()
        perm_gen = torch.Generator().manual_seed(popularity_seed)
        self._perm = torch.randperm(num_keys, generator=perm_gen)
        self._gen = torch.Generator().manual_seed(seed)

    def sample(self, n: int) -> torch.Tensor:
        """``n`` keys (int64 [n])."""
        u = torch.rand(n, generator=self._gen, dtype=torch.float64)
        rank = torch.searchsorted(self._cdf, u).clamp_(max=self.num_keys - 1)
        return self._perm[rank]

    def top_share(self, k: int) -> float:
        """Probability mass of the ``k`` most popular keys (a cache's ideal hit rate)."""
        if k <= 0:
            return 0.0
        return float(self._cdf[min(k, self.num_keys) - 1])


@dataclass(frozen=True)
class Requests:
    """One batch of ranking requests, already in embedding-bag form.

    ``user_keys`` has one key per request (offsets ``0..B-1``); ``item_keys`` holds the B
    history bags followed by the B candidate items, with ``item_offsets`` [2B] marking the
    bags (a candidate is a bag of one).
    """

    user_keys: torch.Tensor
    user_offsets: torch.Tensor
    item_keys: torch.Tensor
    item_offsets: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.user_offsets.numel())

    @property
    def num_keys(self) -> int:
        return int(self.user_keys.numel() + self.item_keys.numel())

    def to(self, device: torch.device | str) -> Requests:
        return Requests(*(t.to(device, non_blocking=True) for t in (
            self.user_keys, self.user_offsets, self.item_keys, self.item_offsets)))


class RequestStream:
    """Batches of requests: a user, a bag of recently seen items, and one candidate item."""

    def __init__(self, num_users: int, num_items: int, alpha: float, *, batch: int,
                 history: int, popularity_seed: int, seed: int) -> None:
        self.batch = batch
        self.history = history
        self.users = ZipfKeys(num_users, alpha, popularity_seed=popularity_seed, seed=seed)
        self.items = ZipfKeys(num_items, alpha, popularity_seed=popularity_seed + 1,
                              seed=seed + 1)
        self._gen = torch.Generator().manual_seed(seed + 2)

    def next(self) -> Requests:
        """The next batch (all tensors on the CPU)."""
        b = self.batch
        lengths = torch.randint(1, 2 * self.history, (b,), generator=self._gen)
        n_hist = int(lengths.sum())
        items = self.items.sample(n_hist + b)  # the histories, then one candidate each
        starts = torch.zeros(2 * b, dtype=torch.int64)
        starts[1:b + 1] = torch.cumsum(lengths, 0)
        starts[b + 1:] = n_hist + torch.arange(1, b)
        return Requests(
            user_keys=self.users.sample(b),
            user_offsets=torch.arange(b, dtype=torch.int64),
            item_keys=items,
            item_offsets=starts,
        )
