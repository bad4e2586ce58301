"""The GPULayer stack: the whole table in GPU-accessible memory, no cache.

A lookup is one gather launch (:mod:`gpu.kernels.gather`), launched directly
(:class:`gpu.kernels.launch.DirectLaunch`) behind the table's read gate; keys are checked on the
device by default (:class:`gpu.stacks.key_flag.RangeCheck`). A table whose row elements are
not contiguous (a user's strided storage tensor) is read by torch's gathers instead,
with its keys checked on the host.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from gpu.cache.gpu_cache import GPUCache
from gpu.inputs import check_range
from gpu.kernels.triton_access import kernel_module
from gpu.layer_config import LayerStats, PoolingMode, TierStats
from gpu.stacks.key_flag import RangeCheck
from gpu.stacks.linear_tables import (
    add_user,
    registered_rows,
    remove_user,
    table_gate,
    write_linear,
    write_tensor,
)


class DeviceTable:
    """GPULayer: the table in device memory or any GPU-accessible memory; no cache."""

    layer_type = "GPULayer"

    def __init__(self, table: torch.Tensor | Any, dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.dim, self.dtype, self.device = dim, dtype, device
        self._block = None
        self._reg = None
        if isinstance(table, torch.Tensor):
            self.table = table
        else:  # a SharedMemBlock or DistMemBlock: one copy serves every process
            self._block = table
            self._reg, self.table = registered_rows(table, device)
            add_user(table, self)
        #: the table is host memory read over the host link (large batches are then visited
        #: in page order); a tensor or a DistMemBlock is read in batch order
        self._host = self._reg is not None
        self._lookups = 0
        self.num_rows = int(self.table.shape[0])
        #: the kernels read row ``key`` at ``key * stride(0)`` (rows may be padded, as a
        #: SharedMemBlock's are); a view whose row elements are not contiguous (a user's
        #: storage tensor) takes torch's gathers, its keys checked on the host
        fits = (self.table.stride(-1) == 1 or dim == 1) and (
            self.num_rows <= 1 or self.table.stride(0) >= dim)
        #: pooled lookups: the cache's fused pooled kernel over a zero-slot cache, whose
        #: backend choice (Triton on CUDA, or forced) is the gather's too
        pool = GPUCache(0, dim, dtype, device)
        triton = fits and pool.backend == "triton"
        self._pool = pool if triton else None
        self._gather = (kernel_module("gather", interpret=device.type != "cuda").gather
                        if triton else None)
        self.check = RangeCheck(device, self.num_rows)
        self._strided = self._gather is None
        #: the gather's bound launches (gpu.kernels.launch.BoundLaunch): table and flag bound once
        self._bound: dict[tuple[int, int], Any] = {}
        #: lookups hold its read side, writes its write side (no torn rows in this process)
        self._gate = table_gate(table, device)
        if self._gather is not None and device.type == "cuda":
            # NOTE: load (or compile) the kernel now, so that the first forward does not pay
            # it (bench/RESULTS.md, "Per-call path": first forward)
            probe = torch.zeros(1, dtype=torch.int64, device=device)
            self._gather(probe, self.table, self.check.flag.device_view, host_table=self._host,
                         bound=self._bound)

    @property
    def validate(self) -> bool:
        return self.check.on_host

    @validate.setter
    def validate(self, value: bool) -> None:
        # NOTE: torch's gathers assert on the device for a bad key: check those on the host
        self.check.set_validate(value or self._strided)

    def rows(self, keys: torch.Tensor) -> torch.Tensor:
        self.check(keys)
        self._lookups += keys.numel()
        with self._gate:
            if self._gather is not None:
                return self._gather(keys, self.table, self.check.err, host_table=self._host,
                                    bound=self._bound)
            with torch.no_grad():
                return self.table.index_select(0, keys)

    def pooled(self, keys: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
               mode: PoolingMode) -> torch.Tensor:
        if mode == "max" or self._pool is None:
            check_range(keys, self.num_rows)  # torch's gathers: checked on the host
            self._lookups += keys.numel()
            with self._gate, torch.no_grad():
                return F.embedding_bag(keys, self.table, offsets, mode=mode,
                                       per_sample_weights=weights, include_last_offset=True)
        self.check(keys)
        self._lookups += keys.numel()
        with self._gate:
            return self._pool.lookup_linear_pooled(
                keys, offsets, self.table, mode, weights, validate=False,
                err=self.check.err)[0]

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        self.check.flag.raise_pending()
        check_range(keys, self.num_rows, name="keys")
        if self._block is not None:
            write_linear(self._block, keys, values)  # gated, announced to other processes
        else:
            write_tensor(self._gate, self.table, keys, values)
        return torch.ones(keys.numel(), dtype=torch.bool, device=keys.device)

    def insert(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.update(keys, values)

    def erase(self, keys: torch.Tensor) -> None:
        check_range(keys, self.num_rows, name="keys")  # a linear table keeps its rows

    def clear(self) -> None:
        pass

    def flush(self) -> None:
        pass  # a lookup leaves no work behind

    def stats(self) -> LayerStats:
        return LayerStats(self.layer_type, TierStats(hits=self._lookups), None, None, 0)

    def close(self) -> None:
        """Let go of the table: its registration, its block's user record, the views and
        launches bound to it (a table this stack copied to the device is freed)."""
        if self._reg is not None:
            self._reg.close()
            self._reg = None
        remove_user(self._block, self)
        self._block = None
        self.table = self.table.new_empty((0, self.dim))
        self._bound.clear()
        self._pool = None
