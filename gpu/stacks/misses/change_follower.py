"""A GPU cache following the change feed of the shared table behind it.

Before each lookup the stack applies what was announced since its cursor: those keys
leave its GPU cache, and a follower that fell behind the ring (or saw the table cleared)
clears the whole cache. Every lookup does this first, so a row that went stale in the
cache (a write announced after the row was read) is gone before any later lookup.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gpu.cache.gpu_cache import GPUCache
from hostcache.ring import ChangeFeed


class ChangeFollower:
    """The cursor of one cache in one shared table's change feed (or no feed: a no-op).

    Args:
        table: The shared table (``SharedMemBlock``, ``HostCache``) or None.
        cache: The GPU cache to keep consistent.
        on_clear: Called when the whole cache was dropped.

    ``on_change`` (settable, None by default) is called after every change applied, with
    the keys on the cache's device, or None when the whole cache was dropped: what the
    stack keeps beside the cache (rows logged for admission) is as stale as the cache was.
    """

    def __init__(self, table: ChangeFeed | None, cache: GPUCache,
                 on_clear: Callable[[], None]) -> None:
        self.table = table
        self._cache = cache
        self._on_clear = on_clear
        self.cursor = table.change_cursor if table is not None else 0
        self.invalidated_keys = 0
        self.full_invalidations = 0
        self.on_change: Callable[[torch.Tensor | None], None] | None = None

    def sync(self) -> int:
        """Apply the changes announced since the cursor (caller holds the cache guard);
        returns the new cursor."""
        table = self.table
        if table is None:
            return 0
        if table.change_cursor == self.cursor:  # NOTE: the common case: one header read
            return self.cursor
        keys, cursor, overflowed = table.changes_since(self.cursor)
        changed = None
        if overflowed:
            self._cache.clear()
            self._on_clear()
            self.full_invalidations += 1
        elif keys.numel():
            changed = keys.to(self._cache.device)
            self._cache.erase(changed)
            self.invalidated_keys += int(keys.numel())
        if (overflowed or changed is not None) and self.on_change is not None:
            self.on_change(changed)
        self.cursor = cursor
        return cursor

    def changed_since(self, since: int) -> tuple[torch.Tensor, bool]:
        """Keys announced after ``since`` and whether the feed overflowed meanwhile."""
        if self.table is None:
            return torch.empty(0, dtype=torch.int64), False
        keys, _, overflowed = self.table.changes_since(since)
        return keys, overflowed
