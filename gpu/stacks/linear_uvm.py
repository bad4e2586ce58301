"""The LinearUVM stack: a GPU cache in front of a linear host table read zero-copy.

A lookup is one kernel launch: hits from the cache, misses read from the registered
table (``SharedMemBlock``; or a ``DistMemBlock`` in GPU memory), and each miss logged on
the device for admission (:mod:`gpu.stacks.misses.miss_log`). Before it, the stack applies the
table's
change feed to the cache (:mod:`gpu.stacks.misses.change_follower`). No host sync, no allocation but
the output, and a Python path of a few microseconds: on CUDA the kernel is launched
directly (:mod:`gpu.kernels.launch`) and keys are checked on the device
(:mod:`gpu.stacks.key_flag`).

A quantized table (a quantized ``SharedMemBlock`` or ``DistMemBlock``) is read by the same
launch dequantized in the layer's dtype (its format bound once here, a constexpr of the
kernels); the GPU cache holds rows of the layer's dtype, and admission takes the rows the
lookup read, already dequantized (``MissCandidates.rows``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from gpu.inputs import check_range
from gpu.layer_config import InsertPolicy, PoolingMode
from gpu.stacks.cached import CachedStack
from gpu.stacks.linear_tables import LinearTable
from gpu.stacks.misses.miss_log import MissLog
from gpu.stacks.protocol import Tier, linear_erase_error
from gpu.tier_config import TierConfig


class LinearStack(LinearTable, CachedStack):
    """LinearUVM: GPU cache in front of a linear host table read zero-copy on misses.

    Tiers: ``"gpu"`` (this layer's GPU cache) and ``"storage"`` (the linear table).
    """

    layer_type = "LinearUVM"
    tiers: tuple[Tier, ...] = ("gpu", "storage")

    def __init__(self, storage: Any, dim: int, dtype: torch.dtype, device: torch.device,
                 cache_bytes: int, policy: InsertPolicy, config: TierConfig) -> None:
        feed = None if isinstance(storage, torch.Tensor) else storage
        CachedStack.__init__(self, dim, dtype, device, cache_bytes, config, feed)
        self._open_table(storage, device)
        #: the cache's linear lookups; of a quantized table, with its format bound (NOTE:
        #: chosen here once: a plain table's call passes what it always did)
        self._gather_linear: Any = self.cache.gather_linear
        if self.fmt is not None:
            self._gather_linear = functools.partial(self.cache.gather_linear,
                                                    table_format=self.fmt)
        self.log = MissLog(self.cache, self.budget, config, policy.gpu, self.num_rows,
                          self.guard)
        #: a change to the table makes logged rows stale: the log goes with the cache's
        self.follower.on_change = self.log.changed
        if device.type == "cuda" and self.cache.backend == "triton":
            self._warm_up()

    def _warm_up(self) -> None:
        """Load the lookup and admission kernels now, in the variants this stack's lookups
        and rounds launch (a round while the cache fills and one once it is warm), so that
        neither the first forward nor the first round pays it, and capture the warm
        cache's round into a CUDA graph (gpu.stacks.misses.miss_log). The cache is left empty, its
        statistics untouched."""
        if self.num_rows == 0 or not self.log.active:
            return
        key = torch.zeros(1, dtype=torch.int64, device=self.device)
        with self._gate, self.guard, self.cache.warming_up():
            for warm in (False, True):
                if warm:
                    self.budget.make_warm()
                self.log.drop()  # NOTE: a log sized for this budget
                self._gather_linear(key, self.table, candidates=self.log.candidates(1),
                                    host_table=self._host, err=self.check.err)
                self.log.round()
            self.log.keep()  # NOTE: warm rounds from a CUDA graph, captured now
            self.budget.reset()
            self.log.drop()

    def rows(self, keys: torch.Tensor) -> torch.Tensor:
        self.check(keys)
        with self._gate, self.guard:
            self.follower.sync()
            values = self._gather_linear(keys, self.table,
                                         candidates=self.log.candidates(keys.numel()),
                                         host_table=self._host, err=self.check.err)
            if self.log.active:
                self.log.logged(keys.numel())
        return values

    def pooled(self, keys: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
               mode: PoolingMode) -> torch.Tensor:
        if mode == "max":
            return super().pooled(keys, offsets, weights, mode)
        self.check(keys)
        with self._gate, self.guard:
            self.follower.sync()
            # NOTE: the launch bound to the table, the key flag and the cache's tables
            # (gpu.kernels.cache_pooled.BoundPooled)
            out = self.cache.pool_linear(keys, offsets, self.table, mode == "mean", weights,
                                         candidates=self.log.candidates(keys.numel()),
                                         err=self.check.flag.device_view,
                                         check=not self.check.on_host,
                                         table_format=self.fmt)
            if self.log.active:
                self.log.logged(keys.numel())
        return out

    def _drop_waiting(self) -> None:
        self.log.drop()

    def _settle(self) -> None:
        self.log.settle()

    def _written(self, keys: torch.Tensor) -> None:
        """A block's write was announced: every process's cache drops the keys (this one's
        now); a tensor has no feed: this cache drops them itself."""
        with self.guard:
            if self._block is not None:
                self.follower.sync()
            else:
                self.cache.erase(keys.to(self.device))
                self.log.drop()  # NOTE: logged rows may predate the write

    def insert(self, keys: torch.Tensor, values: torch.Tensor,
               tier: Tier | None = None) -> None:
        """``"gpu"``: into this GPU cache only; ``"storage"`` or every tier: write the
        linear table (every row exists), every process's cache drops the keys."""
        if tier == "gpu":
            check_range(keys, self.num_rows, name="keys")
            self.insert_cached(keys, values)
        else:
            self.update(keys, values)

    def erase(self, keys: torch.Tensor, tier: Tier | None = None) -> None:
        """Drop keys from this GPU cache (``"gpu"`` or every tier); the linear table keeps
        its rows."""
        if tier == "storage":
            raise linear_erase_error("a LinearUVM layer's storage")
        check_range(keys, self.num_rows, name="keys")
        self.erase_cached(keys)

    def flush(self) -> None:
        """Run the admission round now (what is logged goes in)."""
        with self._gate, self.guard:
            self.follower.sync()
            self.log.round()

    def close(self) -> None:
        with self.guard:
            self.log.close()
        self._release_table()
