"""The rows a Hierarchical stack's tiers read when a tier below its GPU cache stores rows
quantized (int8, float8_e4m3fn): one rule, so that a lookup returns the same values
whichever tier answers it.

A quantized parameter server stores a row ``v`` written to it encoded, and its lookups
return it decoded in float32: ``ps(v) = decode_p(encode_p(v))``; a plain one's lookups
return ``v`` (its dtype is the layer's). A quantized host cache encodes what it is written
and its lookups decode in the reader's dtype (the CPU lookup and the GPU read kernel alike,
bit for bit). So with a quantized host cache every tier reads, in the layer's dtype,
``decode_h(encode_h(ps(v)))``:

- the host cache holds ``encode_h(ps(v))`` whoever wrote it: a write through every tier
  gives it ``ps(v)`` (:meth:`TierFormats.for_host`), a fill of a row the parameter server
  returned gives it those very rows encoded (:meth:`TierFormats.fetched`, whose stored
  bytes are the fill: encoded once), the node service's warm-up gives it the server's rows;
- a row fetched from the parameter server is returned decoded from those stored bytes, as
  the host cache would return it;
- the GPU cache admits what lookups returned, and a ``tier="gpu"`` insert writes it the
  rows a write through every tier would read back (:meth:`TierFormats.read`): a GPU cache
  never holds a row that no tier below it could hold.

With a plain host cache (or none) over a quantized parameter server, every tier reads
``ps(v)`` in the layer's dtype (the host cache is written those rows).

Rows holding NaN or an infinity cannot be quantized: a layer over a quantized tier refuses
to write them (``gpu.layers``); a plain parameter server's such row (written by another
client) is served as the server holds it and never offered to a quantized host cache.
"""

from __future__ import annotations

from typing import Any

import torch

from nvecache.common import quant
from nvecache.common.finite import nonfinite_rows
from nvecache.common.rows import RowFormat


class TierFormats:
    """The formats of the tiers below a GPU cache, and the rows they make each other read.

    Args:
        host_cache: The shared ``HostCache``, or None.
        ps: The ``ParameterServer``, or None.
        dtype: The layer's dtype (its rows' and its GPU cache's).
    """

    def __init__(self, host_cache: Any, ps: Any, dtype: torch.dtype) -> None:
        self.dtype = dtype
        #: the host cache's quantized format (None: plain, or no host cache)
        self.host: RowFormat | None = (host_cache.row_format if host_cache is not None
                                       and host_cache.quantized else None)
        #: the parameter server's quantized format (None: plain, or no parameter server)
        self.ps: RowFormat | None = (RowFormat(ps.dtype, ps.dim) if ps is not None
                                     and ps.quantized else None)
        #: whether a tier below the GPU cache stores rows quantized
        self.quantized = self.host is not None or self.ps is not None

    def from_ps(self, values: torch.Tensor) -> torch.Tensor:
        """What the parameter server's lookups return of rows ``values`` written to it
        (a quantized server's: decoded, float32; a plain one's: ``values``)."""
        if self.ps is None:
            return values
        return quant.decode(quant.encode(values, self.ps), self.ps)

    def for_host(self, values: torch.Tensor) -> torch.Tensor:
        """The rows the host cache is written by a write of ``values`` through every tier:
        what the parameter server returns of them; a plain host cache's in the layer's
        dtype (a quantized one encodes the server's rows themselves)."""
        rows = self.from_ps(values)
        return rows if self.host is not None else rows.to(self.dtype)

    def read(self, values: torch.Tensor) -> torch.Tensor:
        """What every tier reads, in the layer's dtype, after rows ``values`` (finite)
        were written through every tier."""
        rows = self.from_ps(values)
        if self.host is None:
            return rows.to(self.dtype)
        return quant.decode(quant.encode(rows, self.host), self.host, self.dtype)

    def host_rows(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows the parameter server returned (``values``) as the host cache is written
        them, and which of them it may hold (None: all; a quantized host cache holds no
        row with a NaN or an infinity)."""
        if self.host is None:
            return values.to(self.dtype), None
        bad = nonfinite_rows(values)
        return values, None if bad is None else ~bad

    def fetched(self, values: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Rows the parameter server returned (``values``, CPU) as a lookup returns them,
        in the layer's dtype; with a quantized host cache also their stored bytes (uint8
        ``[N, stored_bytes]``: what fills it) and which rows those bytes hold (None: all;
        a row with a NaN or an infinity is returned as the server holds it, in the
        layer's dtype, and its bytes are zeros, not to be filled)."""
        fmt = self.host
        if fmt is None:
            return (values if values.dtype == self.dtype else values.to(self.dtype)), None, None
        stored, bad = quant.encode_finite(values, fmt)
        if bad is None:
            return quant.decode(stored, fmt, self.dtype), stored, None
        good = ~bad
        rows = values.to(self.dtype, copy=True)
        rows[good] = quant.decode(stored[good], fmt, self.dtype)
        return rows, stored, good
