"""What the cached layer stacks share: a GPU cache, its guard, the change-feed follower,
the admission budget and the counters. One subclass per cached layer type:
:mod:`gpu.stacks.linear_uvm` (LinearUVM) and :mod:`gpu.stacks.hierarchical`; each
implements :class:`gpu.stacks.protocol.LayerStack`."""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from gpu.cache.gpu_cache import GPUCache
from gpu.cache.guard import CacheGuard
from gpu.layer_config import LayerStats, PoolingMode, TierStats
from gpu.stacks.misses.admission import RoundBudget
from gpu.stacks.misses.change_follower import ChangeFollower
from gpu.stacks.protocol import Tier
from gpu.tier_config import TierConfig
from hostcache.ring import ChangeFeed


def pool_rows(
    rows: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None, mode: PoolingMode
) -> torch.Tensor:
    """Pool ``rows`` [N, dim] over bags ``offsets`` [B + 1] exactly as embedding_bag does."""
    idx = torch.arange(rows.shape[0], device=rows.device)
    return F.embedding_bag(
        idx, rows, offsets, mode=mode, per_sample_weights=weights, include_last_offset=True
    )


class CachedStack:
    """A GPU cache in front of lower tiers, following ``feed`` (a shared table) if any."""

    layer_type = "?"
    #: check offsets on the host (one sync each); linear tables also check their keys there
    #: (else on the device, gpu.stacks.key_flag). The CPU always checks.
    validate = False
    rows_any_shape = False

    def __init__(self, dim: int, dtype: torch.dtype, device: torch.device, cache_bytes: int,
                 config: TierConfig, feed: ChangeFeed | None) -> None:
        self.dim, self.dtype, self.device = dim, dtype, device
        self.config = config
        self.cache = GPUCache(cache_bytes, dim, dtype, device, backend=config.cache_backend,
                              tiles=config.tiles)
        self.guard = CacheGuard(device)
        self.budget = RoundBudget(self.cache, config)
        self.follower = ChangeFollower(feed, self.cache, self.budget.reset)
        self.default_rows = 0

    def rows(self, keys: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def pooled(self, keys: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
               mode: PoolingMode) -> torch.Tensor:
        return pool_rows(self.rows(keys), offsets, weights, mode)

    def _drop_waiting(self) -> None:
        """Forget admissions not yet made (overridden by stacks that keep any)."""

    def _settle(self) -> None:
        """Queue admissions already decided (caller holds the guard; overridden by stacks
        whose rounds complete at a later lookup)."""

    def check_pending(self) -> None:
        """Nothing is reported on the device (stacks whose kernels check keys override)."""

    def insert_cached(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write rows into this layer's GPU cache only (no lower tier is written); what
        waits for admission is dropped (it may hold older rows of these keys)."""
        with self.guard:
            self.follower.sync()
            self._drop_waiting()
            self.cache.insert(keys.to(self.device), values.to(self.device))

    def erase_cached(self, keys: torch.Tensor) -> None:
        """Drop keys from this layer's GPU cache only."""
        with self.guard:
            self._drop_waiting()
            self.cache.erase(keys.to(self.device))

    def erase(self, keys: torch.Tensor, tier: Tier | None = None) -> None:
        self.erase_cached(keys)

    def clear(self) -> None:
        with self.guard:
            self.follower.sync()
            self.cache.clear()
            self.budget.reset()  # NOTE: first: what waits is sized for the next budget
            self._drop_waiting()

    def in_cache(self, keys: torch.Tensor) -> torch.Tensor:
        """Whether each key is in this layer's GPU cache now (not counted as a lookup)."""
        with self.guard:
            self.follower.sync()
            self._settle()
            return self.cache.probe(keys.to(self.device), record=False) >= 0

    def gpu_stats(self) -> TierStats:
        with self.guard:
            self._settle()
        s = self.cache.stats()
        return TierStats(s.hits, s.misses, s.inserts, s.evictions)

    def stats(self) -> LayerStats:
        return LayerStats(self.layer_type, self.gpu_stats(), None, None, self.default_rows,
                          None, self.follower.invalidated_keys,
                          self.follower.full_invalidations)

    def close(self) -> None:
        pass
