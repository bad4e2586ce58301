""":meth:`DistMemBlock.accumulate`, apart from :mod:`gpu.dist.distmem` (a mixin: the
block provides the attributes and methods used here)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from gpu.dist.rowio import refuse_nonfinite
from gpu.errors import BadArgumentError, NonFiniteValuesError
from nvecache.common import quant
from nvecache.common.accumulate import add_at, check_deltas, sum_duplicates

if TYPE_CHECKING:
    from hostcache import SharedMemBlock
    from hostcache.gate import TableGate
    from nvecache.common.rows import RowFormat


class Accumulating:
    """The accumulate of :class:`gpu.DistMemBlock`."""

    dim: int
    dtype: torch.dtype
    _journal: SharedMemBlock

    if TYPE_CHECKING:
        @property
        def gate(self) -> TableGate: ...
        @property
        def quantized(self) -> bool: ...
        @property
        def row_format(self) -> RowFormat: ...
        def view(self, device: Any = None) -> torch.Tensor: ...
        def invalidate(self, indices: torch.Tensor) -> None: ...
        def _rows(self, indices: torch.Tensor) -> torch.Tensor: ...
        def _stored(self, v: torch.Tensor) -> torch.Tensor: ...

    def accumulate(self, indices: torch.Tensor, deltas: torch.Tensor, *,
                   allow_nonfinite: bool = False) -> None:
        """Add ``deltas`` (``[N, dim]``, the block's dtype or float32, on any device; a
        quantized block's: float32) to rows ``indices`` and announce them as :meth:`write`
        does.

        Duplicate indices have their deltas summed; float16/bfloat16 rows are added in
        float32 and rounded once (:mod:`nvecache.common.accumulate`). A quantized block's
        rows are decoded, added to in float32 and encoded with stochastic rounding
        (:func:`nvecache.common.quant.encode_sum`, the rule of every quantized table's
        accumulate: deltas under half a step add up over many calls instead of rounding
        away; each element within one step of its sum), on the block's device. The read,
        add and write of the rows happen under this process's :attr:`gate` and the
        journal's node-wide writer lock, so no accumulate of another process of the node
        loses this one's addition, nor this one another's.

        Raises:
            BadArgumentError: bad indices or deltas; nothing is written.
            NonFiniteValuesError: a delta holds NaN or an infinity and not
                ``allow_nonfinite`` (a quantized block: whatever ``allow_nonfinite`` says,
                and a sum that overflows float32); nothing is written.
        """
        idx = self._rows(indices)
        q = self.quantized
        check_deltas(deltas, idx, self.dim, torch.float32 if q else self.dtype,
                     allow_nonfinite=allow_nonfinite and not q,
                     errors=(BadArgumentError, NonFiniteValuesError), device=None,
                     key_word="index")
        v = self.view()
        with self.gate.writing(), self._journal.exclusive():
            if q:
                idx = self._add_quantized(v, idx.to(v.device), deltas.to(v.device))
            else:
                idx = add_at(v, idx.to(v.device), deltas.to(v.device))
            if v.device.type == "cuda":
                torch.cuda.synchronize(v.device)  # the rows are in place before the news
        self.invalidate(idx)

    def _add_quantized(self, v: torch.Tensor, idx: torch.Tensor, deltas: torch.Tensor
                       ) -> torch.Tensor:
        """Deltas added to a quantized block's rows of view ``v`` (under the locks): each
        distinct row decoded, added in float32, encoded with stochastic rounding; a sum
        that is not finite leaves every row as it was. The distinct rows changed."""
        fmt = self.row_format
        stored = self._stored(v)
        uidx, sums, _ = sum_duplicates(idx, deltas, torch.float32)
        new = quant.decode(stored.index_select(0, uidx), fmt) + sums
        refuse_nonfinite(new, uidx, "rows plus deltas")
        stored.index_copy_(0, uidx, quant.encode_sum(new, fmt))
        return uidx
