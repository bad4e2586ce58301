"""An exact LRU cache simulator: the slow reference the host cache's policy is judged by."""

from __future__ import annotations

from collections import OrderedDict

import torch


class ExactLRU:
    """Counts hits of an exact LRU of ``capacity`` keys over a key stream, in order."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[int, None] = OrderedDict()
        self.hits = 0
        self.lookups = 0

    def access(self, keys: torch.Tensor) -> None:
        # NOTE: a per-key loop on purpose: this is the reference simulator, not a hot path
        cache = self._keys
        for k in keys.tolist():
            self.lookups += 1
            if k in cache:
                self.hits += 1
                cache.move_to_end(k)
            else:
                cache[k] = None
                if len(cache) > self.capacity:
                    cache.popitem(last=False)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0
