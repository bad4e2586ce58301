""":meth:`DistMemBlock.read` and :meth:`DistMemBlock.write`, and how a block stores its
rows, apart from :mod:`gpu.dist.distmem` (a mixin: the block provides the attributes and
methods used here).

A block of a plain dtype (float32, float16, bfloat16) stores its rows ``dim`` elements
each, back to back. A quantized block (``dtype=torch.int8``: row-wise int8 with a float32
scale and bias; ``torch.float8_e4m3fn``: fp8 with a float32 scale;
:mod:`nvecache.common.quant`) stores each row's bytes (``row_format.stored_bytes``:
payload, then parameters) at a stride of ``row_format.stride`` bytes (16-byte aligned, as a
``hostcache.SharedMemBlock`` stores them: the layers read both alike, told the format by
``row_format``). Its :meth:`view` is the uint8 ``[num_rows, stride]`` range; writes take
float rows, rounded to nearest, or stored bytes as they are; reads return float32 rows,
dequantized; an accumulate adds in float32 and rounds stochastically
(:mod:`gpu.dist.accumulate`). All of it on the block's device, with torch ops.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from gpu.cache.twin import last_occurrence
from gpu.errors import BadArgumentError, NonFiniteValuesError
from nvecache.common import quant, rows
from nvecache.common.finite import nonfinite_rows

if TYPE_CHECKING:
    from hostcache.gate import TableGate

#: the dtypes a block stores: the layers' dtypes and the quantized formats
BLOCK_DTYPES: tuple[str, ...] = (*rows.LAYER_DTYPES, *rows.QUANTIZED)


def block_format(dtype: object, dim: int) -> rows.RowFormat:
    """How a block of ``dtype`` (one of :data:`BLOCK_DTYPES`) stores rows of ``dim``.

    Raises:
        BadArgumentError: another dtype, or a dim no table can hold.
    """
    name = None
    if isinstance(dtype, torch.dtype):
        try:
            name = rows.dtype_name(dtype, BLOCK_DTYPES)
        except rows.RowFormatError:
            pass
    if name is None:
        raise BadArgumentError(
            f"dtype must be one of {', '.join(f'torch.{n}' for n in BLOCK_DTYPES)}; got "
            f"{dtype!r}")
    try:
        return rows.RowFormat(name, dim)
    except rows.RowFormatError as e:
        raise BadArgumentError(str(e)) from None


class RowIO:
    """Reads and writes of :class:`gpu.DistMemBlock`'s rows."""

    num_rows: int
    dim: int
    dtype: torch.dtype
    _format: rows.RowFormat

    if TYPE_CHECKING:
        @property
        def gate(self) -> TableGate: ...
        def view(self, device: Any = None) -> torch.Tensor: ...
        def invalidate(self, indices: torch.Tensor) -> None: ...

    @property
    def row_format(self) -> rows.RowFormat:
        """How a row is stored (its format, bytes and stride): what a kernel reading
        :meth:`view` is told (as ``hostcache.SharedMemBlock.row_format``)."""
        return self._format

    @property
    def quantized(self) -> bool:
        """Whether the rows are stored quantized (reads dequantize them)."""
        return self._format.quantized

    def _rows(self, indices: torch.Tensor) -> torch.Tensor:
        if not isinstance(indices, torch.Tensor) or indices.dtype != torch.int64 \
                or indices.dim() != 1:
            raise BadArgumentError(f"indices must be a 1-D int64 tensor; got {indices!r:.80}")
        if indices.numel():
            lo, hi = torch.aminmax(indices)
            if int(lo) < 0 or int(hi) >= self.num_rows:
                raise BadArgumentError(f"indices must be in [0, {self.num_rows}); got values "
                                       f"in [{int(lo)}, {int(hi)}]")
        return indices

    def _stored(self, v: torch.Tensor) -> torch.Tensor:
        """The rows of view ``v`` as a write stores them: a quantized block's stored bytes
        ``[num_rows, stored_bytes]`` (the stride's padding left out)."""
        return v[:, :self._format.stored_bytes] if self.quantized else v

    def read(self, indices: torch.Tensor) -> torch.Tensor:
        """Rows ``indices`` (int64 [N]) as a tensor on the first device (a quantized
        block's: float32, dequantized)."""
        idx = self._rows(indices)
        v = self.view()
        got = self._stored(v).index_select(0, idx.to(v.device))
        return quant.decode(got, self._format) if self.quantized else got

    def write(self, indices: torch.Tensor, values: torch.Tensor) -> None:
        """Store rows and announce them in the journal (every layer over the block, in any
        process, drops its cached copies before its next lookup). Last write wins.

        ``values``: ``[N, dim]`` of the block's dtype, on any device; a quantized block's:
        float rows of any plain dtype (quantized here, rounded to nearest), or its stored
        bytes (uint8 ``[N, row_format.stored_bytes]``, stored as they are).

        Raises:
            BadArgumentError: bad indices or values; nothing is written.
            NonFiniteValuesError: (a quantized block) a row holds NaN or an infinity, or
                stored bytes decode to one: a quantized row must be finite; nothing is
                written.
        """
        idx = self._rows(indices)
        v = self.view()
        vals = self._to_store(idx, values, v.device)
        idx = idx.to(v.device)
        if idx.numel() > 1:  # duplicates: the last one wins (index_copy_ picks any)
            idx, last, _ = last_occurrence(idx)
            vals = vals.index_select(0, last)
        with self.gate.writing():
            self._stored(v).index_copy_(0, idx, vals)
            if v.device.type == "cuda":
                torch.cuda.synchronize(v.device)  # the rows are in place before the news
        self.invalidate(idx)

    def _to_store(self, idx: torch.Tensor, values: object, device: torch.device
                  ) -> torch.Tensor:
        """``values`` checked and as the block stores them, on ``device``."""
        n, fmt = idx.numel(), self._format
        if not self.quantized:
            if not isinstance(values, torch.Tensor) or values.dtype != self.dtype \
                    or values.shape != (n, self.dim):
                raise BadArgumentError(
                    f"values must be {self.dtype} of shape ({n}, {self.dim}); got "
                    f"{getattr(values, 'dtype', type(values).__name__)} "
                    f"{tuple(getattr(values, 'shape', ()))}")
            return values.to(device)
        raw = isinstance(values, torch.Tensor) and values.dtype == torch.uint8
        width = fmt.stored_bytes if raw else self.dim
        if (not isinstance(values, torch.Tensor) or values.shape != (n, width)
                or not (raw or rows.is_plain(values.dtype))):
            raise BadArgumentError(
                f"values of a {fmt.dtype} block must be float rows ({', '.join(rows.DTYPES)}) "
                f"of shape ({n}, {self.dim}), quantized here, or its stored bytes (uint8 "
                f"({n}, {fmt.stored_bytes})); got {getattr(values, 'dtype', type(values))} "
                f"{tuple(getattr(values, 'shape', ()))}")
        vals = values.to(device)
        check = quant.decode(vals, fmt) if raw else vals
        refuse_nonfinite(check, idx, "stored rows" if raw else "values")
        return vals.contiguous() if raw else quant.encode(vals, fmt)


def refuse_nonfinite(values: torch.Tensor, idx: torch.Tensor, what: str) -> None:
    """Refuse rows for a quantized block holding NaN or an infinity (whatever
    ``allow_nonfinite`` a caller passed: such a row cannot be encoded).

    Raises:
        NonFiniteValuesError: how many rows, the first one's index; nothing was written.
    """
    bad = nonfinite_rows(values)
    if bad is None:
        return
    pos = bad.nonzero()
    first = int(idx.reshape(-1)[int(pos[0, 0])])
    raise NonFiniteValuesError(
        f"{what}: {pos.shape[0]} row(s) hold NaN or infinite values (the first: index "
        f"{first}); nothing was written: a quantized block stores finite rows only, fix "
        "those rows")
