"""A GPULayer's lookup as plain torch ops, for the compilers that run it from C++.

Within :func:`binding` (while ``gpu.export`` traces a model for an AOTInductor package), a
GPULayer bound to a table and a key-error flag does not call the :mod:`gpu.ops` custom op:
its forward is written as ``aten`` ops over the table (a gather, or an ``embedding_bag``
for sum and mean bags), so Inductor compiles the lookup into the package with the rest of
the model and a call runs no Python per lookup. The table and the flag are inputs of the
traced graph (not constants: the package holds no copy of the rows, and the loading
process passes the tables of the layers it built).

Keys are checked as the layer's kernels check them by default: a key outside
``[0, num_rows)`` reads as a zero row (a bag sums it as zero and counts it). The flag is
not written in the graph: :attr:`Bound.flag` is the flag's new value (an out-of-range key
of the call, unless the flag already held one), an output of the traced graph that the
caller writes into the layer's :class:`gpu.stacks.key_flag.KeyErrorFlag`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F  # noqa: N812

_bound = threading.local()


class Bound:
    """A layer's table and key-error flag within :func:`binding`; ``flag`` follows the
    lookups traced so far."""

    def __init__(self, table: torch.Tensor, flag: torch.Tensor) -> None:
        self.table, self.flag = table, flag

    def _checked(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``keys`` with the out-of-range ones as row 0, and which were in range."""
        over = keys >= self.table.shape[0]
        under = keys < 0
        valid = ~(over | under)
        # NOTE: reductions, not an index by argmax (a data-dependent read): the largest key
        # past the end, else the most negative key, else 0 (no bad key; a 0 appended so
        # that no keys reduce too)
        high = F.pad(torch.where(over, keys, 0), (0, 1)).amax().reshape(1)
        low = F.pad(torch.where(under, keys, 0), (0, 1)).amin().reshape(1)
        seen = torch.where(high != 0, high, low)
        self.flag = torch.where(self.flag != 0, self.flag, seen)
        return torch.where(valid, keys, 0), valid

    def rows(self, keys: torch.Tensor) -> torch.Tensor:
        """Rows ``[N, dim]`` of flat int64 ``keys``."""
        safe, valid = self._checked(keys)
        return torch.where(valid[:, None], F.embedding(safe, self.table), 0)

    def pooled(self, keys: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
               mode: str) -> torch.Tensor:
        """Sum or mean of the rows of each bag (``offsets``: ``[B + 1]``, last included)."""
        safe, valid = self._checked(keys)
        scale = valid.to(self.table.dtype) if weights is None else weights * valid
        out = F.embedding_bag(safe, self.table, offsets, mode="sum", per_sample_weights=scale,
                              include_last_offset=True)
        if mode == "mean":
            sizes = (offsets[1:] - offsets[:-1]).clamp(min=1)
            out = out / sizes.to(out.dtype)[:, None]
        return out


@contextlib.contextmanager
def binding(layers: dict[int, Bound]) -> Iterator[None]:
    """Within: the layers whose ``id()`` is a key of ``layers`` look up as torch ops."""
    before = getattr(_bound, "layers", None)
    _bound.layers = layers
    try:
        yield
    finally:
        _bound.layers = before


def bound(layer: object) -> Bound | None:
    """``layer``'s :class:`Bound` within :func:`binding`, else None."""
    layers = getattr(_bound, "layers", None)
    return None if layers is None else layers.get(id(layer))
