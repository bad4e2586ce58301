"""The GPULayer stack: the whole table in GPU-accessible memory, no cache.

A lookup is one gather launch (:mod:`gpu.kernels.gather`), launched directly
(:class:`gpu.kernels.launch.DirectLaunch`) behind the table's read gate; keys are checked on the
device by default (:class:`gpu.stacks.key_flag.RangeCheck`). A table whose row elements are
not contiguous (a user's strided storage tensor) is read by torch's gathers instead,
with its keys checked on the host. :class:`HostTable` (HostLayer) is the same stack over
host memory, its one tier named ``"storage"``.

A quantized table (a quantized block, or the layer's own table stored with
``weight_dtype=``: :mod:`gpu.stacks.quantized`) is read dequantized in the layer's dtype by
the same kernels, its format bound once here (``fmt=``, a constexpr of theirs), so a plain
table's call is the one it was; the torch paths (the CPU, max bags) decode the rows a call
reads.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from gpu.cache.backend import chosen_backend
from gpu.inputs import check_range
from gpu.kernels.triton_access import kernel_module
from gpu.layer_config import LayerStats, PoolingMode, TierStats
from gpu.stacks.cached import pool_rows
from gpu.stacks.linear_tables import LinearTable, add_occurrences
from gpu.stacks.protocol import Tier, linear_erase_error
from gpu.stacks.quantized import decoded
from gpu.tier_config import DEFAULT, TierConfig
from nvecache.common.rows import RowFormat


@functools.cache
def _row_add() -> Any:
    """The compiled training-write kernels (:mod:`gpu.kernels.row_add`)."""
    return kernel_module("row_add", interpret=False)


class DeviceTable(LinearTable):
    """GPULayer: the table in device memory or any GPU-accessible memory; no cache.

    Its one tier, ``"gpu"``, is the table, wherever its memory is.
    """

    layer_type = "GPULayer"
    tiers: tuple[Tier, ...] = ("gpu",)

    def __init__(self, table: torch.Tensor | Any, dim: int, dtype: torch.dtype,
                 device: torch.device, config: TierConfig = DEFAULT,
                 fmt: RowFormat | None = None) -> None:
        self.dim, self.dtype, self.device = dim, dtype, device
        #: the kernels' launch settings
        self._tiles = config.tiles
        self._open_table(table, device, fmt)
        self._lookups = 0
        #: the kernels read row ``key`` at ``key * stride(0)`` (rows may be padded, as a
        #: SharedMemBlock's are); a view whose row elements are not contiguous (a user's
        #: storage tensor) takes torch's gathers, its keys checked on the host
        width = self.table.shape[1]  # NOTE: a quantized table's: its stored bytes
        fits = (self.table.stride(-1) == 1 or width == 1) and (
            self.num_rows <= 1 or self.table.stride(0) >= width)
        #: the kernels: a GPU cache's backend choice (Triton on CUDA, or forced)
        triton = fits and chosen_backend(config.cache_backend, device) == "triton"
        interpret = device.type != "cuda"
        gather = kernel_module("gather", interpret=interpret).gather if triton else None
        #: the table's lookups; of a quantized table, with its format bound (NOTE: chosen
        #: here once: a plain table's call passes what it always did)
        self._gather = gather
        if self.fmt is not None and gather is not None:
            self._gather = functools.partial(gather, fmt=self.fmt, out_dtype=dtype)
        #: pooled lookups: the pooled kernel with no cache in front, bound to the table and
        #: key flag once (gpu.kernels.cache_pooled.BoundPooled)
        self._pooled: Any = kernel_module("cache_pooled", interpret=interpret).BoundPooled(
            self.table, self.check.flag.device_view, dim=dim, dtype=dtype,
            tiles=config.tiles, fmt=self.fmt, device=device) if triton else None
        self._host_checks = self._gather is None
        #: lookups with keys checked on the device (the default on CUDA): the gather with
        #: the table and key flag bound once (gpu.kernels.gather.BoundRows)
        self._bound: Any = None
        if self._gather is not None and device.type == "cuda":
            self._bound = kernel_module("gather", interpret=False).BoundRows(
                self.table, self.check.flag.device_view, host_table=self._host,
                tiles=self._tiles, fmt=self.fmt, dtype=dtype, device=device)
            # NOTE: load (or compile) the kernel now, so that the first forward does not pay
            # it (bench/RESULTS.md, "Per-call path": first forward)
            self._bound(torch.zeros(1, dtype=torch.int64, device=device))

    @property
    def rows_any_shape(self) -> bool:  # type: ignore[override]
        """Keys of any contiguous shape where the lookup is the bound gather (keys checked
        on the device, the default on CUDA)."""
        return self._bound is not None and not self.check.on_host

    def rows(self, keys: torch.Tensor) -> torch.Tensor:
        self.check(keys)
        self._lookups += keys.numel()
        with self._gate:
            if self._bound is not None and not self.check.on_host:
                return self._bound(keys)
            if self._gather is not None:
                return self._gather(keys, self.table, self.check.err, host_table=self._host,
                                    tiles=self._tiles)
            with torch.no_grad():
                if self.fmt is not None:  # NOTE: the torch path: only these rows decoded
                    return decoded(self.table, keys, self.fmt, self.dtype)
                return self.table.index_select(0, keys)

    def pooled(self, keys: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
               mode: PoolingMode) -> torch.Tensor:
        if mode == "max" or self._pooled is None:
            check_range(keys, self.num_rows)  # torch's gathers: checked on the host
            self._lookups += keys.numel()
            with self._gate, torch.no_grad():
                if self.fmt is not None:  # NOTE: the bag's rows decoded, then pooled
                    return pool_rows(decoded(self.table, keys, self.fmt, self.dtype),
                                     offsets, weights, mode)
                return F.embedding_bag(keys, self.table, offsets, mode=mode,
                                       per_sample_weights=weights, include_last_offset=True)
        self.check(keys)
        self._lookups += keys.numel()
        with self._gate:
            return self._pooled(keys, offsets, weights, mode == "mean", not self.check.on_host)

    def _in_place(self) -> bool:
        """Whether training steps write the table in place, without the gate's drains and
        syncs on CUDA: the layer's own plain table (no other process reads it; a quantized
        one's steps go through :meth:`accumulate` and :meth:`update`, which encode)."""
        return self._own is not None and not self._host and self.fmt is None

    def step_add(self, keys: torch.Tensor, grad: torch.Tensor, alpha: float,
                 skipped: torch.Tensor) -> None:
        """As :meth:`LinearTable.step_add`; on the layer's own float32 table it adds in
        place: on CUDA one kernel (:mod:`gpu.kernels.row_add`) queued on the current stream,
        ordered as a torch optimizer's step on a parameter is (a lookup on the same stream
        reads the new rows; another stream synchronizes first), no host sync; on the CPU
        its torch twin under the table's gate."""
        if not self._in_place() or self.dtype != torch.float32:
            super().step_add(keys, grad, alpha, skipped)
        elif self._gather is not None and self.device.type == "cuda":
            _row_add().add_rows(self.table, keys, grad.contiguous(), alpha, skipped)
        else:
            with self._gate.writing():
                add_occurrences(self.table, keys, grad, alpha, skipped)

    def step_write(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """As :meth:`LinearTable.step_write`; on the layer's own table in place (on CUDA
        one kernel), ordered as :meth:`step_add` is."""
        if not self._in_place():
            super().step_write(keys, rows)
        elif self._gather is not None and self.device.type == "cuda":
            _row_add().store_rows(self.table, keys, rows.contiguous())
        else:
            with self._gate.writing():
                self.table.index_copy_(0, keys, rows)

    def inline_args(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The table and key-error flag a lookup written as torch ops reads
        (:mod:`gpu.traced_lookup`), or None where it cannot be: a host table read by a
        GPU, a quantized table, or keys checked on the host before each CUDA lookup
        (``validate=True``)."""
        if self._host or self.fmt is not None or (
                self.check.on_host and self.device.type == "cuda"):
            return None  # NOTE: a quantized table is read by the kernels that decode it
        return self.table, self.check.flag.device_view

    def insert(self, keys: torch.Tensor, values: torch.Tensor,
               tier: Tier | None = None) -> None:
        self.update(keys, values)  # NOTE: every row exists: an insert is an update

    def erase(self, keys: torch.Tensor, tier: Tier | None = None) -> None:
        if tier is not None:
            raise linear_erase_error("a GPULayer's table")
        check_range(keys, self.num_rows, name="keys")  # a linear table keeps its rows

    def in_cache(self, keys: torch.Tensor) -> torch.Tensor:
        return torch.zeros(keys.numel(), dtype=torch.bool, device=keys.device)  # no cache

    def clear(self) -> None:
        pass

    def flush(self) -> None:
        pass  # a lookup leaves no work behind

    def stats(self) -> LayerStats:
        return LayerStats(self.layer_type, TierStats(hits=self._lookups), None, None, 0)

    def close(self) -> None:
        """Let go of the table: its registration, its block's user record, the views and
        launches bound to it (a table this stack copied to the device is freed)."""
        self._release_table()
        self._block = None
        self.table = self.table.new_empty((0, self.dim))
        self._bound = None
        self._pooled = None


class HostTable(DeviceTable):
    """HostLayer: the GPULayer's stack over host memory (a CPU tensor, registered in place
    on CUDA, or a ``SharedMemBlock``); no GPU cache.

    Its one tier is ``"storage"``, the host table: it has no GPU tier. Its lookups count
    as the storage tier's hits.
    """

    layer_type = "HostLayer"
    tiers: tuple[Tier, ...] = ("storage",)

    def erase(self, keys: torch.Tensor, tier: Tier | None = None) -> None:
        if tier is not None:
            raise linear_erase_error("a HostLayer's table")
        check_range(keys, self.num_rows, name="keys")

    def stats(self) -> LayerStats:
        return LayerStats(self.layer_type, TierStats(), None, TierStats(hits=self._lookups), 0)
