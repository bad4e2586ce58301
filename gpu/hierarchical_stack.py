"""The Hierarchical stack: GPU cache -> shared ``HostCache`` -> parameter server.

A lookup probes the GPU cache; the misses, deduplicated, are read from the shared host
cache (on CUDA by a kernel over the registered table, :mod:`gpu.host_kernels`), then the
parameter server; rows from the parameter server enter the host cache with
``overwrite=False`` and a cursor check (``since``), so a concurrent ``update`` (PS first,
then the host cache, announced to every process) always wins; fetched rows wait for
their GPU admission round (:mod:`gpu.admission`). Fetches run outside the cache guard,
so one thread's misses never hold up another thread's hits.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .admission import PendingAdmissions
from .cached_stack import CachedStack
from .errors import KeyNotFoundError, StorageUnavailableError, StorageWriteError
from .layer_config import InsertPolicy, LayerStats, PoolingMode, TierStats
from .tier_config import TierConfig

logger = logging.getLogger(__name__)


class HierarchicalStack(CachedStack):
    """GPU cache -> shared HostCache -> parameter server (any of the last two optional)."""

    layer_type = "Hierarchical"

    def __init__(self, host_cache: Any, storage: Any, dim: int, dtype: torch.dtype,
                 device: torch.device, cache_bytes: int, policy: InsertPolicy,
                 default_row: torch.Tensor | None, config: TierConfig) -> None:
        super().__init__(dim, dtype, device, cache_bytes, config, host_cache)
        self.pending = PendingAdmissions(self.cache, self.guard, self.follower, self.budget,
                                         config)
        self.host = host_cache
        self.ps = storage
        self._policy = policy
        self._default = default_row
        self._reg = None
        if host_cache is not None:
            if device.type == "cuda":
                from .hostreg import register

                self._reg = register(host_cache, device)
        self._host = [0, 0, 0, 0]  # hits, misses, rows it placed, residents they evicted
        self._ps = [0, 0]  # found, missing

    def rows(self, keys: torch.Tensor) -> torch.Tensor:
        with self.guard:
            since = self.follower.sync()
            values, hit = self.cache.lookup(keys)
        if bool(hit.all()):
            return values
        miss = (~hit).nonzero().squeeze(1)
        ukeys, inverse = torch.unique(keys[miss], return_inverse=True)
        urows, cacheable = self._fetch(ukeys, since)
        values[miss] = urows[inverse]
        self.pending.offer(ukeys[cacheable], urows[cacheable], since, self._policy.gpu)
        return values

    def pooled(self, keys: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
               mode: PoolingMode) -> torch.Tensor:
        if mode == "max":
            return super().pooled(keys, offsets, weights, mode)
        with self.guard:
            since = self.follower.sync()
            # NOTE: fp32 sums out of the kernel, so that missed rows join them before the
            # one rounding to the table's dtype (as embedding_bag rounds once)
            out, hit = self.cache.lookup_pooled(keys, offsets, mode, weights, validate=False,
                                                out_dtype=torch.float32)
        if bool(hit.all()):
            return out.to(self.dtype)
        miss = (~hit).nonzero().squeeze(1)
        ukeys, inverse = torch.unique(keys[miss], return_inverse=True)
        urows, cacheable = self._fetch(ukeys, since)
        contrib = urows[inverse].float()
        if weights is not None:
            contrib = contrib * weights[miss, None].float()
        bag = torch.searchsorted(offsets, miss, right=True) - 1
        if mode == "mean":
            length = (offsets[1:] - offsets[:-1]).float()
            contrib = contrib / length[bag, None]
        out.index_add_(0, bag, contrib)
        self.pending.offer(ukeys[cacheable], urows[cacheable], since, self._policy.gpu)
        return out.to(self.dtype)

    def _host_lookup(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._reg is not None:
            from .host_kernels import hostcache_lookup

            values, hit = hostcache_lookup(self._reg, keys)
            hits = int(hit.sum())
            self.host.count_lookup(keys.numel(), hits)
            self._touch_host(keys, hit, hits)
            return values, hit
        return self.host.lookup(keys)

    def _touch_host(self, keys: torch.Tensor, hit: torch.Tensor, hits: int) -> None:
        """Report the GPU's host-cache hits to its eviction policy, as a CPU lookup does.

        A sample of at most ``host_touch_sample`` hit keys goes to the CPU, each counted
        ``hits / sample`` times: the policy sees the traffic without a full copy."""
        if hits == 0:
            return
        hk = keys[hit]
        weight = 1
        if hits > self.config.host_touch_sample:
            pick = torch.randint(0, hits, (self.config.host_touch_sample,), device=hk.device)
            hk, weight = hk[pick], max(1, round(hits / self.config.host_touch_sample))
        self.host.touch(hk.cpu(), weight)

    def _fetch(self, ukeys: torch.Tensor, since: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of distinct missed keys from the lower tiers: (rows, found).

        ``since`` is the ring cursor taken before anything was read: fills of keys
        announced after it are refused (their rows may predate the change)."""
        n = ukeys.numel()
        if self.host is not None:
            rows, found = self._host_lookup(ukeys)
            nh = int(found.sum())
            self._host[0] += nh
            self._host[1] += n - nh
        else:
            rows = torch.zeros(n, self.dim, dtype=self.dtype, device=self.device)
            found = torch.zeros(n, dtype=torch.bool, device=self.device)
        need = ~found
        if self.ps is not None and bool(need.any()):
            self._fetch_ps(ukeys, rows, found, need, since)
        missing = ~found
        if bool(missing.any()):
            if self._default is None:
                examples = ukeys[missing][:5].tolist()
                raise KeyNotFoundError(
                    f"{int(missing.sum())} keys are in no tier of this layer (e.g. {examples}); "
                    "load them into the parameter server, or pass default_row= to serve a "
                    "default row for missing keys"
                )
            rows[missing] = self._default
            self.default_rows += int(missing.sum())
        return rows, found

    def _fetch_ps(self, ukeys: torch.Tensor, rows: torch.Tensor, found: torch.Tensor,
                  need: torch.Tensor, since: int) -> None:
        from psclient import PSClientError

        need_keys = ukeys[need].cpu()
        try:
            values, ok = self.ps.lookup(need_keys)
        except PSClientError as e:
            if self._default is None:
                raise StorageUnavailableError(
                    f"the parameter server could not answer {need_keys.numel()} missed keys: "
                    f"{e}; cached rows are still served. Pass default_row= to serve a default "
                    "row for misses while it is down"
                ) from e
            logger.warning("parameter server unavailable (%s); serving default rows", e)
            return
        nf = int(ok.sum())
        self._ps[0] += nf
        self._ps[1] += need_keys.numel() - nf
        rows[need] = values.to(self.device)
        found[need] = ok.to(self.device)
        if self.host is not None and nf and self._policy.host > 0.0:
            admit = ok.clone()
            if self._policy.host < 1.0:
                admit &= torch.rand(admit.numel()) < self._policy.host
            if bool(admit.any()):
                done = self.host.insert(need_keys[admit], values[admit], overwrite=False,
                                        since=since)
                self._host[2] += done.written
                self._host[3] += done.evicted

    # -- writes -----------------------------------------------------------------------------

    def _write(self, op: str, keys: torch.Tensor, values: torch.Tensor | None) -> torch.Tensor:
        """Write the parameter server first (the source of truth), then the host cache."""
        from psclient import PSClientError

        ck = keys.cpu()
        cv = values.cpu() if values is not None else None
        found = torch.ones(ck.numel(), dtype=torch.bool)
        if self.ps is not None:
            try:
                if op == "update":
                    found = self.ps.update(ck, cv)
                elif op == "insert":
                    self.ps.insert(ck, cv)
                else:
                    self.ps.erase(ck)
            except PSClientError as e:
                raise StorageWriteError(
                    f"{op} of {ck.numel()} keys failed at the parameter server: {e}; no tier "
                    "was changed, retry when it is reachable"
                ) from e
        if self.host is not None:
            if op == "erase":
                self.host.erase(ck)
            elif self.ps is None and op == "update":
                found = self.host.update(ck, cv)
            else:  # write-through that announces every key to every process
                assert cv is not None
                self.host.update(ck[found], cv[found], insert_missing=True)
        with self.guard:
            self.pending.drop()
            self.follower.sync()
            if self.host is None:  # no ring to announce through: drop our own copies
                self.cache.erase(keys.to(self.device))
        return found.to(keys.device)

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return self._write("update", keys, values)

    def insert(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self._write("insert", keys, values)

    def erase(self, keys: torch.Tensor) -> None:
        self._write("erase", keys, None)

    def clear(self) -> None:
        """Drop every cached row (GPU cache, and the shared host cache for every process)."""
        if self.host is not None:
            self.host.clear()
        super().clear()

    def stats(self) -> LayerStats:
        host = TierStats(*self._host) if self.host is not None else None
        ps = TierStats(self._ps[0], self._ps[1]) if self.ps is not None else None
        node = self.host.stats() if self.host is not None else None
        return LayerStats(self.layer_type, self.gpu_stats(), host, ps, self.default_rows, node,
                          self.follower.invalidated_keys, self.follower.full_invalidations)

    def _drop_waiting(self) -> None:
        self.pending.drop()

    def close(self) -> None:
        self.pending.drop()
        if self._reg is not None:
            self._reg.close()
            self._reg = None

