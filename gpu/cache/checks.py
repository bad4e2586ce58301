"""Checks of what callers pass to a :class:`gpu.cache.gpu_cache.GPUCache`: typed errors naming the
argument and what to do."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu.cache.records import MissCandidates
from gpu.cuda.devices import same_device
from gpu.errors import BadArgumentError
from gpu.inputs import check_dtype, check_row_format
from nvecache.common import rows
from nvecache.common.keys import key_problem


def row_dtype(dtype: object, what: str = "dtype") -> torch.dtype:
    """A torch dtype a cache row may have (any stored dtype of ``nvecache.common.rows``)."""
    return check_dtype(dtype, name=what, allowed=tuple(rows.DTYPES))


def row_format_of(dtype: object, dim: int) -> rows.RowFormat:
    """The format of a cache's rows: any stored dtype of ``nvecache.common.rows``."""
    return check_row_format(dtype, dim, allowed=tuple(rows.DTYPES))


@dataclass(frozen=True)
class ArgumentChecks:
    """The checks of one cache's arguments against its row geometry and device."""

    #: row length in elements.
    dim: int
    #: row element type.
    dtype: torch.dtype
    #: the cache's device.
    device: torch.device

    def keys(self, keys: object, what: str = "keys") -> torch.Tensor:
        """1-D int64 keys on the cache's device (made contiguous)."""
        problem = key_problem(keys, device=self.device)
        if problem is not None:
            raise BadArgumentError(f"{what} {problem}")
        assert isinstance(keys, torch.Tensor)
        return keys.contiguous()

    def rows(self, values: object, n: int, what: str = "values") -> torch.Tensor:
        """``[n, dim]`` rows of the cache's dtype on its device (made contiguous)."""
        if not isinstance(values, torch.Tensor):
            raise BadArgumentError(
                f"{what} must be a torch.Tensor; got {type(values).__name__}")
        if tuple(values.shape) != (n, self.dim):
            raise BadArgumentError(
                f"{what} must have shape ({n}, {self.dim}); got {tuple(values.shape)}")
        if values.dtype != self.dtype:
            raise BadArgumentError(
                f"{what} must be {self.dtype}; got {values.dtype} (convert with .to())")
        if not same_device(values, self.device):
            raise BadArgumentError(
                f"{what} are on {values.device} but the cache is on {self.device}")
        return values.contiguous()

    def table(self, table: object, fmt: object = None) -> torch.Tensor:
        """A linear table ``[num_rows, dim]`` of the cache's dtype on its device, rows
        contiguous (possibly padded: any row stride ``>= dim``); of a quantized format
        ``fmt``, its stored bytes, uint8 ``[num_rows, fmt.stored_bytes]``."""
        quant = fmt is not None
        if quant and not (isinstance(fmt, rows.RowFormat) and fmt.quantized
                          and fmt.dim == self.dim):
            raise BadArgumentError(
                f"table_format must be a quantized nvecache.common.rows.RowFormat of dim "
                f"{self.dim} (or None for a table of the cache's dtype); got {fmt!r}")
        width = fmt.stored_bytes if isinstance(fmt, rows.RowFormat) else self.dim
        dtype = torch.uint8 if quant else self.dtype
        if not isinstance(table, torch.Tensor) or table.dim() != 2 \
                or table.shape[1] != width or table.dtype != dtype:
            got = (f"{table.dtype} {tuple(table.shape)}" if isinstance(table, torch.Tensor)
                   else type(table).__name__)
            what = "its stored bytes" if quant else "a tensor"
            raise BadArgumentError(
                f"table must be {what}, a [num_rows, {width}] {dtype} tensor; got {got}")
        if not same_device(table, self.device):
            raise BadArgumentError(
                f"table is on {table.device} but the cache is on {self.device}; on CUDA pass "
                "a zero-copy CUDA view of the registered host table")
        # NOTE: rows may be padded (a SharedMemBlock rounds them up to 16 bytes): the kernels
        # step by stride(0); only the elements of a row must be contiguous
        if table.shape[0] > 1 and table.stride(0) < width or (
                width > 1 and table.stride(1) != 1):
            raise BadArgumentError(
                f"table rows must each be contiguous and not overlap (strides (>= {width}, "
                f"1)); got strides {tuple(table.stride())}: pass table.contiguous()")
        if quant and (table.stride(0) % 4 or table.data_ptr() % 4):
            raise BadArgumentError(
                "a quantized table's rows must start on 4-byte boundaries (their float32 "
                f"parameters are read in place); got row stride {table.stride(0)} at address "
                f"{table.data_ptr():#x}: pass a SharedMemBlock's tensor")
        return table

    @staticmethod
    def linear_keys(keys: torch.Tensor, num_rows: int) -> None:
        """Every key in ``[0, num_rows)`` (one host sync)."""
        if keys.numel() and bool(((keys < 0) | (keys >= num_rows)).any()):
            raise BadArgumentError(
                f"keys of a linear table must lie in [0, {num_rows}); drop or remap the "
                "others before the lookup")

    def bags(
        self, n: int, offsets: object, mode: object, weights: object,
        miss_values: object, validate: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(offsets, weights, miss_values)`` of a pooled lookup of ``n`` keys, checked
        (``validate``: the offsets' values too, one host sync)."""
        if mode not in ("sum", "mean"):
            raise BadArgumentError(f"mode must be 'sum' or 'mean'; got {mode!r}")
        if not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int64 \
                or offsets.dim() != 1 or offsets.numel() < 1:
            raise BadArgumentError(
                "offsets must be a 1-D int64 tensor of B + 1 bag boundaries "
                "(include_last_offset semantics)")
        if not same_device(offsets, self.device):
            raise BadArgumentError(f"offsets are on {offsets.device}, not {self.device}")
        offsets = offsets.contiguous()
        if validate:
            bad = (offsets[0] != 0) | (offsets[-1] != n) | (offsets[1:] < offsets[:-1]).any()
            if bool(bad):
                raise BadArgumentError(
                    f"offsets must start at 0, end at len(keys) = {n} and never decrease")
        w: torch.Tensor | None = None
        if weights is not None:
            if mode != "sum":
                raise BadArgumentError("per_sample_weights are only supported with mode='sum'")
            if not isinstance(weights, torch.Tensor) or tuple(weights.shape) != (n,) \
                    or not weights.is_floating_point():
                raise BadArgumentError(
                    f"per_sample_weights must be a float tensor of shape ({n},)")
            if not same_device(weights, self.device):
                raise BadArgumentError(
                    f"per_sample_weights are on {weights.device}, not {self.device}")
            w = weights.contiguous()
        mv = None if miss_values is None else self.rows(miss_values, n, "miss_values")
        return offsets, w, mv

    def candidates(self, candidates: MissCandidates | None) -> MissCandidates | None:
        """A :class:`MissCandidates` on the cache's device, its rows (if any) of the
        cache's row shape and dtype (or None)."""
        if candidates is None:
            return None
        buf, rows = candidates.buffer, candidates.rows
        if (buf.dtype != torch.int64 or buf.dim() != 1 or buf.numel() % 2 != 1
                or not buf.is_contiguous() or not same_device(buf, self.device)):
            raise BadArgumentError(
                f"candidates must be a MissCandidates.empty(cap, {self.device}) buffer")
        if rows is not None and (
                tuple(rows.shape) != (candidates.cap, self.dim) or rows.dtype != self.dtype
                or not rows.is_contiguous() or not same_device(rows, self.device)):
            raise BadArgumentError(
                f"candidates' rows must be [cap, {self.dim}] {self.dtype} on {self.device}: "
                f"MissCandidates.empty(cap, {self.device}, dim={self.dim}, "
                f"dtype={self.dtype})")
        return candidates
