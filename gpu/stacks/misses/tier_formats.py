"""The rows a Hierarchical stack's tiers read when a tier below its GPU cache stores rows
quantized (int8, float8_e4m3fn): one rule, so that a lookup returns the same values
whichever tier answers it.

A quantized parameter server stores a row ``v`` written to it encoded, and its lookups
return it decoded in float32: ``ps(v) = decode_p(encode_p(v))``; a plain one's lookups
return ``v`` (its dtype is the layer's). A quantized host cache encodes what it is written
and its lookups decode in the reader's dtype (the CPU lookup and the GPU read kernel alike,
bit for bit).

A quantized host cache of the server's own format (:attr:`TierFormats.shared`) holds the
server's stored bytes themselves, so every tier reads ``decode(encode(v))`` in the layer's
dtype, the row rounded once:

- a fill takes the bytes the server's :meth:`lookup_stored` returns (decoded once for the
  lookup that fetched them, never encoded again: :meth:`TierFormats.fetch`);
- a write through every tier writes the host cache ``encode(v)``, the bytes the server
  stored of the same rows (:meth:`TierFormats.for_host`); an accumulate, the server's new
  stored bytes (:meth:`TierFormats.server_rows`); the node service's warm-up, the server's
  stored bytes too.

Any other quantized host cache reads ``decode_h(encode_h(ps(v)))``:

- the host cache holds ``encode_h(ps(v))`` whoever wrote it: a write through every tier
  gives it ``ps(v)`` (:meth:`TierFormats.for_host`), a fill of a row the parameter server
  returned gives it those very rows encoded (:meth:`TierFormats.fetch`, whose stored
  bytes are the fill: encoded once), the node service's warm-up gives it the server's rows;
- a row fetched from the parameter server is returned decoded from those stored bytes, as
  the host cache would return it.

Either way the GPU cache admits what lookups returned, and a ``tier="gpu"`` insert writes
it the rows a write through every tier would read back (:meth:`TierFormats.read`): a GPU
cache never holds a row that no tier below it could hold.

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
        #: the format the host cache and the parameter server share, both quantized (the
        #: host cache then holds the server's stored bytes); None: they do not
        self.shared: RowFormat | None = self.host if self.host == self.ps else None

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
        if self.shared is not None:
            return quant.encode(values, self.shared)
        rows = self.from_ps(values)
        return rows if self.host is not None else rows.to(self.dtype)

    def read(self, values: torch.Tensor) -> torch.Tensor:
        """What every tier reads, in the layer's dtype, after rows ``values`` (finite)
        were written through every tier."""
        if self.shared is not None:
            return quant.decode(quant.encode(values, self.shared), self.shared, self.dtype)
        rows = self.from_ps(values)
        if self.host is None:
            return rows.to(self.dtype)
        return quant.decode(quant.encode(rows, self.host), self.host, self.dtype)

    def server_rows(self, ps: Any, keys: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, found)``: the parameter server's rows of ``keys`` as the host cache is
        written them (a shared format's: the server's stored bytes), and which keys the
        server holds whose rows the host cache may hold (a quantized host cache holds no
        row with a NaN or an infinity).

        Raises:
            PSClientError: the server could not be read.
        """
        if self.shared is not None:
            return ps.lookup_stored(keys)
        values, found = ps.lookup(keys)
        if self.host is None:
            return values.to(self.dtype), found
        bad = nonfinite_rows(values)
        return values, found if bad is None else found & ~bad

    def fetch(self, ps: Any, keys: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The parameter server's rows of ``keys`` (CPU) for a lookup: ``(rows, found,
        fills, holds)``: ``rows`` as a lookup returns them, in the layer's dtype (zeros
        where not found); ``fills`` what fills the host cache (a quantized one's: stored
        bytes, uint8 ``[N, stored_bytes]``) and ``holds`` which of them it may hold (None:
        any it found; a row with a NaN or an infinity is returned as the server holds it,
        in the layer's dtype, and not filled).

        Raises:
            PSClientError: the server could not be read.
        """
        fmt = self.host
        if self.shared is not None:
            stored, found = ps.lookup_stored(keys)
            return quant.decode(stored, fmt, self.dtype), found, stored, None
        values, found = ps.lookup(keys)
        if fmt is None:
            rows = values if values.dtype == self.dtype else values.to(self.dtype)
            return rows, found, rows, None
        stored, bad = quant.encode_finite(values, fmt)
        if bad is None:
            return quant.decode(stored, fmt, self.dtype), found, stored, None
        good = ~bad
        rows = values.to(self.dtype, copy=True)
        rows[good] = quant.decode(stored[good], fmt, self.dtype)
        return rows, found, stored, good
