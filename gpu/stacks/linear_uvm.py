"""The LinearUVM stack: a GPU cache in front of a linear host table read zero-copy.

A lookup is one kernel launch: hits from the cache, misses read from the registered
table (``SharedMemBlock``; or a ``DistMemBlock`` in GPU memory), and each miss logged on
the device for admission (:mod:`gpu.stacks.miss_log`). Before it, the stack applies the table's
change feed to the cache (:mod:`gpu.stacks.change_follower`). No host sync, no allocation but
the output, and a Python path of a few microseconds: on CUDA the kernel is launched
directly (:mod:`gpu.kernels.launch`) and keys are checked on the device
(:mod:`gpu.stacks.key_flag`).
"""

from __future__ import annotations

from typing import Any

import torch

from gpu.inputs import check_range
from gpu.layer_config import InsertPolicy, PoolingMode
from gpu.stacks.cached import CachedStack
from gpu.stacks.key_flag import RangeCheck
from gpu.stacks.linear_tables import (
    add_user,
    registered_rows,
    remove_user,
    table_gate,
    write_linear,
    write_tensor,
)
from gpu.stacks.miss_log import MissLog
from gpu.tier_config import TierConfig


class LinearStack(CachedStack):
    """LinearUVM: GPU cache in front of a linear host table read zero-copy on misses."""

    layer_type = "LinearUVM"

    def __init__(self, storage: Any, dim: int, dtype: torch.dtype, device: torch.device,
                 cache_bytes: int, policy: InsertPolicy, config: TierConfig) -> None:
        block = None if isinstance(storage, torch.Tensor) else storage
        super().__init__(dim, dtype, device, cache_bytes, config, block)
        self._block = block
        self._reg = None
        if block is None:
            self.table = storage
        else:
            self._reg, self.table = registered_rows(block, device)
            add_user(block, self)
        #: the table is host memory read over the host link (a DistMemBlock is GPU memory)
        self._host = self._reg is not None
        self.num_rows = int(self.table.shape[0])
        #: lookups hold its read side while they read table rows, writes its write side
        self._gate = table_gate(storage, device)
        self.check = RangeCheck(device, self.num_rows)
        self.log = MissLog(self.cache, self.budget, config, policy.gpu, self.num_rows,
                          self.guard)
        #: a change to the table makes logged rows stale: the log goes with the cache's
        self.follower.on_change = self.log.drop
        if device.type == "cuda" and self.cache.backend == "triton":
            self._warm_up()

    def _warm_up(self) -> None:
        """Load the lookup and admission kernels now, in the variants this stack's lookups
        and rounds launch (a round while the cache fills and one once it is warm), so that
        neither the first forward nor the first round pays it, and capture the warm
        cache's round into a CUDA graph (gpu.stacks.miss_log). The cache is left empty, its
        statistics untouched."""
        if self.num_rows == 0 or not self.log.active:
            return
        key = torch.zeros(1, dtype=torch.int64, device=self.device)
        with self._gate, self.guard, self.cache.warming_up():
            for warm in (False, True):
                if warm:
                    self.budget.make_warm()
                self.log.drop()  # NOTE: a log sized for this budget
                self.cache.gather_linear(key, self.table, candidates=self.log.candidates(1),
                                         host_table=self._host, err=self.check.err)
                self.log.round()
            self.log.keep()  # NOTE: warm rounds from a CUDA graph, captured now
            self.budget.reset()
            self.log.drop()

    @property
    def validate(self) -> bool:
        return self.check.on_host

    @validate.setter
    def validate(self, value: bool) -> None:
        self.check.set_validate(value)

    def rows(self, keys: torch.Tensor) -> torch.Tensor:
        self.check(keys)
        with self._gate, self.guard:
            self.follower.sync()
            values = self.cache.gather_linear(keys, self.table,
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
            out, _ = self.cache.lookup_linear_pooled(keys, offsets, self.table, mode, weights,
                                                     validate=False,
                                                     candidates=self.log.candidates(keys.numel()),
                                                     err=self.check.err)
            if self.log.active:
                self.log.logged(keys.numel())
        return out

    def _drop_waiting(self) -> None:
        self.log.drop()

    def _settle(self) -> None:
        self.log.settle()

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        self.check.flag.raise_pending()
        check_range(keys, self.num_rows, name="keys")
        if self._block is not None:
            write_linear(self._block, keys, values)  # gated, announced: every cache drops them
            with self.guard:
                self.follower.sync()
        else:
            write_tensor(self._gate, self.table, keys, values)
            with self.guard:
                self.cache.erase(keys.to(self.device))
                self.log.drop()  # NOTE: logged rows may predate the write
        return torch.ones(keys.numel(), dtype=torch.bool, device=keys.device)

    def insert(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.update(keys, values)

    def erase(self, keys: torch.Tensor) -> None:
        check_range(keys, self.num_rows, name="keys")
        super().erase(keys)

    def flush(self) -> None:
        """Run the admission round now (what is logged goes in)."""
        with self._gate, self.guard:
            self.follower.sync()
            self.log.round()

    def close(self) -> None:
        if self._reg is not None:
            self._reg.close()
            self._reg = None
        with self.guard:
            self.log.close()
        remove_user(self._block, self)
