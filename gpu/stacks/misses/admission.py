"""Admission of fetched rows into a GPU cache, in rounds (the Hierarchical stack's).

A Hierarchical lookup fetches its misses' rows from the host cache or the parameter
server, on the host's knowledge of which keys missed. The rows wait here, already read,
until ``admit_keys`` keys (at most ``admit_fraction`` of the cache) or ``admit_batches``
lookups have gathered: an insert's host time hardly grows with its keys, so a cache that
mostly hits pays one insert per several lookups. When they go in, keys announced in the
shared table's change feed since the earliest of those lookups began are dropped (the
two-phase check: their rows may predate the change), and any write through the layer
drops everything waiting.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gpu.cache.gpu_cache import GPUCache
from gpu.cache.guard import CacheGuard
from gpu.stacks.misses.change_follower import ChangeFollower
from gpu.tier_config import TierConfig


class RoundBudget:
    """How many keys one admission round may bring into a cache: all its slots while it
    fills, ``warm_round_fraction`` of them once it has been offered ``warm_capacities``
    times as many keys as it has slots (a small cache then keeps its hot rows when lookups
    miss many cold keys). Offered keys repeat (a Zipf stream's hot keys), so one capacity's
    worth leaves the cache far from full: bench/RESULTS.md, "GPU-cache admission"."""

    def __init__(self, cache: GPUCache, config: TierConfig) -> None:
        self._cache = cache
        self._fraction = config.warm_round_fraction
        self._warm_at = config.warm_capacities * cache.capacity
        self.admitted = 0

    @property
    def warm(self) -> bool:
        return self.admitted >= self._warm_at

    def make_warm(self) -> None:
        """Count the cache as warm from now on (a layer loading its warm rounds' kernels)."""
        self.admitted = max(self.admitted, int(math.ceil(self._warm_at)))

    def cap(self) -> int:
        cap = self._cache.capacity
        return max(1, int(cap * self._fraction)) if self.warm else cap

    def reset(self) -> None:
        """The cache is empty again: fill it at full speed."""
        self.admitted = 0


class PendingAdmissions:
    """Rows read by lookups, waiting for their admission round."""

    def __init__(self, cache: GPUCache, guard: CacheGuard, follower: ChangeFollower,
                 budget: RoundBudget, config: TierConfig) -> None:
        self._cache, self._guard, self._follower = cache, guard, follower
        self._budget, self._config = budget, config
        #: (keys, rows, the CUDA stream that produced them, None on the CPU)
        self._pending: list[tuple[torch.Tensor, torch.Tensor, Any]] = []
        self._since: int | None = None
        self._waiting = 0

    @property
    def waiting(self) -> int:
        """Keys waiting for a round."""
        return self._waiting

    def offer(self, keys: torch.Tensor, rows: torch.Tensor, since: int, prob: float,
              stream: Any = None) -> None:
        """Queue fetched rows (read after feed cursor ``since``; on CUDA queued on
        ``stream``, the caller's) for admission with probability ``prob`` each; run a
        round if enough have gathered."""
        cache = self._cache
        if cache.capacity == 0 or keys.numel() == 0 or prob <= 0.0:
            return
        if prob < 1.0:
            keep = torch.rand(keys.numel(), device=keys.device) < prob
            keys, rows = keys[keep], rows[keep]
        if rows.is_cuda and stream is None:
            stream = torch.cuda.current_stream(rows.device)
        cfg = self._config
        with self._guard.lock:
            self._pending.append((keys, rows, stream))
            self._waiting += keys.shape[0]
            if self._since is None:
                self._since = since
            enough = min(cfg.admit_keys, max(1, int(cache.capacity * cfg.admit_fraction)))
            if self._waiting < enough and len(self._pending) < cfg.admit_batches:
                return
            pending, since = self._pending, self._since
            self._pending, self._since, self._waiting = [], None, 0
        self._round(pending, since)

    def _round(self, pending: list[tuple[torch.Tensor, torch.Tensor, Any]],
               since: int) -> None:
        if pending[0][1].is_cuda:
            stream = torch.cuda.current_stream(pending[0][1].device)
            waited: set[Any] = {stream}
            for k, r, producer in pending:
                if producer == stream:
                    continue  # NOTE: the common case: rows of this very stream, in order
                if producer not in waited:
                    # NOTE: another thread's rows, queued on its stream (maybe not yet
                    # computed): this stream waits for all that stream has queued by now
                    stream.wait_stream(producer)
                    waited.add(producer)
                # the caching allocator must not hand these blocks to their producing
                # stream again before this stream is done with them
                k.record_stream(stream)
                r.record_stream(stream)
        keys = torch.cat([k for k, _, _ in pending])
        rows = torch.cat([r for _, r, _ in pending])
        with self._guard:
            changed, overflowed = self._follower.changed_since(since)
            if overflowed:
                return
            if changed.numel():
                keep = ~torch.isin(keys, changed.to(keys.device))
                keys, rows = keys[keep], rows[keep]
            cap = self._budget.cap()
            if keys.numel() > cap:
                # NOTE: admit a random sample of the miss occurrences, so keys that missed
                # often are likelier in
                keep = torch.randperm(keys.numel(), device=keys.device)[:cap]
                keys, rows = keys[keep], rows[keep]
            self._budget.admitted += keys.numel()
            self._cache.insert(keys, rows, validate=False)

    def drop(self) -> None:
        """Forget every admission not yet made (a write made their rows stale)."""
        with self._guard.lock:
            self._pending, self._since, self._waiting = [], None, 0
