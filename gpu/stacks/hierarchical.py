"""The Hierarchical stack: GPU cache -> shared ``HostCache`` -> parameter server.

A lookup probes the GPU cache, and the probe lists each miss and its batch position (on
CUDA in pinned host memory, :mod:`gpu.stacks.misses.miss_list`: after one stream sync the host knows
what missed, with no reduction, search or copy on the device). The misses go down one path:
deduplicated on the host, read through the tiers below in order (the host cache, the
parameter server, the default row: :mod:`gpu.stacks.misses.resolver`) and sent to the device by
the read path chosen when the stack was built (:mod:`gpu.stacks.misses.read_paths`: on CUDA the
GPU reads the host cache itself for many misses). A row lookup places the rows with one
scatter; a pooled lookup adds them to the fp32 sums of its bags before the one rounding.
Fetched rows wait in a log on the device for their GPU admission round, which a warm
cache runs in three steps replayed from CUDA graphs (:mod:`gpu.stacks.misses.admission`). Fetches
run outside the cache guard, so one thread's misses never hold up another thread's hits.
The host-cache fills and the GPU's hit reports to the host cache's policy run on a worker
thread (:mod:`gpu.stacks.misses.host_filler`): the lookup returns without waiting for them.

Writes go through the parameter server first (the source of truth), then the host cache
(announced to every process, whose GPU caches then drop the keys); a write may name one
tier (:mod:`gpu.stacks.hierarchical_writes`).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from gpu.layer_config import InsertPolicy, LayerStats, PoolingMode
from gpu.stacks.cached import CachedStack
from gpu.stacks.hierarchical_writes import TierWrites
from gpu.stacks.misses.admission import PendingAdmissions
from gpu.stacks.misses.counters import MissCounters
from gpu.stacks.misses.host_filler import HostFiller
from gpu.stacks.misses.miss_list import MissList
from gpu.stacks.misses.read_paths import read_path
from gpu.stacks.misses.resolver import Resolver, touch_sample
from gpu.stacks.protocol import Tier
from gpu.tier_config import TierConfig

__all__ = ["HierarchicalStack", "ps_location", "touch_sample"]


def ps_location(ps: Any) -> str | None:
    """Where a parameter server's table is: its URL without a password
    (``ParameterServer.url``); None when the client does not tell."""
    url = getattr(ps, "url", None)  # NOTE: ParameterServer.url, without a password
    return url if isinstance(url, str) and url else None


class HierarchicalStack(TierWrites, CachedStack):
    """GPU cache -> shared HostCache -> parameter server (any of the last two optional).

    Tiers: ``"gpu"`` (this layer's GPU cache), ``"host"`` (the shared host cache) and
    ``"storage"`` (the parameter server), less the one it was built without.
    """

    layer_type = "Hierarchical"

    def __init__(self, host_cache: Any, storage: Any, dim: int, dtype: torch.dtype,
                 device: torch.device, cache_bytes: int, policy: InsertPolicy,
                 default_row: torch.Tensor | None, config: TierConfig) -> None:
        super().__init__(dim, dtype, device, cache_bytes, config, host_cache)
        self.pending = PendingAdmissions(self.cache, self.guard, self.follower, self.budget,
                                         config)
        #: a change applied to the cache reaches the rows waiting for admission too
        self.follower.on_change = self.pending.changed
        if device.type == "cuda" and self.cache.backend == "triton":
            # NOTE: the warm cache's round loaded and captured now, on the empty cache
            with self.cache.warming_up():
                self.pending.keep()
        self.host_cache = host_cache
        self.ps = storage
        have: dict[Tier, bool] = {"gpu": True, "host": host_cache is not None,
                                  "storage": storage is not None}
        self.tiers: tuple[Tier, ...] = tuple(t for t, there in have.items() if there)
        #: what lookups met below the GPU cache
        self.counts = MissCounters()
        #: host-cache fills and hit reports, off the lookups' path (gpu.stacks.misses.host_filler)
        self.filler = HostFiller("nvecache-host-fill", config.host_batch_keys,
                                 config.host_linger_s)
        self.resolver = Resolver(host_cache, storage, default_row, dtype, dim, policy,
                                 self.filler, config.host_touch_sample, self.counts)
        self._registration = None
        if host_cache is not None and device.type == "cuda":
            from gpu.cuda.registration import register

            self._registration = register(host_cache, device)
        #: the misses' way to the device, chosen once (gpu.stacks.misses.read_paths)
        self.reads = read_path(self.resolver, device, self.pending, policy.gpu,
                               self._registration, config.host_gpu_read_keys)
        self._lists = threading.local()  # each thread's MissList

    def _miss_list(self, n: int) -> MissList:
        """This thread's list of its lookup's misses (one per thread: lookups of several
        threads may be in flight at once), grown to ``n`` keys."""
        misses = getattr(self._lists, "misses", None)
        if misses is None:
            misses = self._lists.misses = MissList(self.device)
        misses.ensure(n)
        return misses

    def rows(self, keys: torch.Tensor) -> torch.Tensor:
        misses = self._miss_list(keys.numel())
        with self.guard:
            since = self.follower.sync()
            # NOTE: the layer checked the keys; each miss and its position are listed by
            # the lookup itself, on CUDA in pinned host memory (gpu.stacks.misses.miss_list)
            values = self.cache.serve(keys, misses)
            stream = self.guard.stream
        if stream is not None:
            # NOTE: the call's one host sync when every key hit: no reduction, no copy
            stream.synchronize()
        mkeys, mpos = misses.take()
        if mkeys.size == 0:
            return values
        rows, pos = self.reads.serve(mkeys, mpos, since)
        values.index_copy_(0, pos, rows)
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
        if bool(hit.all()):  # NOTE: the call's one host sync when every key hit
            return out.to(self.dtype)
        pos = (~hit).nonzero().squeeze(1)
        listed = torch.stack([keys.index_select(0, pos), pos]).cpu().numpy()
        # NOTE: the rows path's misses: each missed row, in the order listed
        rows, _ = self.reads.serve(listed[0], listed[1], since)
        add = rows.float()
        if weights is not None:
            add = add * weights.index_select(0, pos)[:, None].float()
        bag = torch.searchsorted(offsets, pos, right=True) - 1
        if mode == "mean":
            length = (offsets[1:] - offsets[:-1]).float()
            add = add / length.index_select(0, bag)[:, None]
        out.index_add_(0, bag, add)
        return out.to(self.dtype)

    def flush(self) -> None:
        """Finish the host-cache fills and hit reports of earlier lookups."""
        self.filler.drain()

    def clear(self) -> None:
        """Drop every cached row (GPU cache, and the shared host cache for every process)."""
        self.filler.drain()
        if self.host_cache is not None:
            self.host_cache.clear()
        super().clear()

    def stats(self) -> LayerStats:
        self.filler.drain()
        c = self.counts
        host = c.host() if self.host_cache is not None else None
        ps = c.storage() if self.ps is not None else None
        node = self.host_cache.stats() if self.host_cache is not None else None
        return LayerStats(self.layer_type, self.gpu_stats(), host, ps, c.default_rows, node,
                          self.follower.invalidated_keys, self.follower.full_invalidations)

    def table_names(self) -> dict[str, object]:
        """The tables this stack reads, by name (see
        :class:`gpu.stacks.protocol.NamedState`); no row is read."""
        names: dict[str, object] = {"dim": self.dim, "dtype": str(self.dtype)}
        if self.host_cache is not None:
            names["host_cache"] = self.host_cache.name
        if self.ps is not None:
            names["table"] = self.ps.table
            names["url"] = ps_location(self.ps)
        return names

    def table_label(self) -> str:
        """The tables as an error names them."""
        names = self.table_names()
        parts = [f"host cache {names['host_cache']!r}"] if "host_cache" in names else []
        if "table" in names:
            parts.append(f"parameter-server table {names['table']!r}")
        return " over ".join(parts)

    def write_rows(self, start: int, values: torch.Tensor) -> None:
        """Insert rows of keys ``start ..`` into every tier (the parameter server first)."""
        self.insert(torch.arange(start, start + values.shape[0]), values)

    def check_pending(self) -> None:
        """Nothing to raise: keys are checked before every lookup."""

    def _drop_waiting(self) -> None:
        self.pending.drop()

    def _settle(self) -> None:
        self.pending.settle()

    def close(self) -> None:
        self.filler.close()
        self.pending.close()
        if self._registration is not None:
            self._registration.close()
            self._registration = None
