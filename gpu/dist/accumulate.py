""":meth:`DistMemBlock.accumulate`, apart from :mod:`gpu.dist.distmem` (a mixin: the
block provides the attributes and methods used here)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from gpu.errors import BadArgumentError, NonFiniteValuesError
from nvecache.common.accumulate import add_at, check_deltas

if TYPE_CHECKING:
    from hostcache import SharedMemBlock
    from hostcache.gate import TableGate


class Accumulating:
    """The accumulate of :class:`gpu.DistMemBlock`."""

    dim: int
    dtype: torch.dtype
    _journal: SharedMemBlock

    if TYPE_CHECKING:
        @property
        def gate(self) -> TableGate: ...
        def view(self, device: Any = None) -> torch.Tensor: ...
        def invalidate(self, indices: torch.Tensor) -> None: ...
        def _rows(self, indices: torch.Tensor) -> torch.Tensor: ...

    def accumulate(self, indices: torch.Tensor, deltas: torch.Tensor, *,
                   allow_nonfinite: bool = False) -> None:
        """Add ``deltas`` (``[N, dim]``, the block's dtype or float32, on any device) to rows
        ``indices`` and announce them as :meth:`write` does.

        Duplicate indices have their deltas summed; float16/bfloat16 rows are added in
        float32 and rounded once (:mod:`nvecache.common.accumulate`). The read, add and
        write of the rows happen under this process's :attr:`gate` and the journal's
        node-wide writer lock, so no accumulate of another process of the node loses this
        one's addition, nor this one another's.

        Raises:
            BadArgumentError: bad indices or deltas; nothing is written.
            NonFiniteValuesError: a delta holds NaN or an infinity and not
                ``allow_nonfinite``; nothing is written.
        """
        idx = self._rows(indices)
        check_deltas(deltas, idx, self.dim, self.dtype, allow_nonfinite=allow_nonfinite,
                     errors=(BadArgumentError, NonFiniteValuesError), device=None,
                     key_word="index")
        v = self.view()
        with self.gate.writing(), self._journal.exclusive():
            idx = add_at(v, idx.to(v.device), deltas.to(v.device))
            if v.device.type == "cuda":
                torch.cuda.synchronize(v.device)  # the rows are in place before the news
        self.invalidate(idx)
