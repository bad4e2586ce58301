"""Rows as a shared table stores them: a plain table's rows are their own bytes; a quantized
table's (int8, float8_e4m3fn) are encoded on the way in and decoded on the way out
(:mod:`nvecache.common.quant`).

:class:`RowBytes` is what a table's writes and reads share: which rows a write takes (the
table's dtype; a quantized table, float rows of any plain dtype), the NaN/infinity rule (a
quantized table stores finite rows only, whatever ``allow_nonfinite`` says: a row's range
is its scale), the bytes stored, and the rows a read returns (a quantized table's in
float32). A quantized table's writes also take its stored bytes themselves (uint8
``[N, stored_bytes]``, as its ``tensor`` holds them and a saved file or a parameter
server's dump of it holds them), stored as they are once they decode to finite rows: a
round trip through a file is bit for bit.

Writes round a quantized row to nearest; an accumulate (:meth:`RowBytes.added`) stores a
decoded row plus its deltas with stochastic rounding (:func:`nvecache.common.quant.encode_sum`),
so that repeated deltas under half a step add up instead of rounding away.
"""

from __future__ import annotations

import numpy as np
import torch

from hostcache.errors import NonFiniteValuesError
from hostcache.validate import check_finite, check_values
from nvecache.common import quant, rows
from nvecache.common.finite import nonfinite_rows


class RowBytes:
    """One table's rows between torch and its stored bytes."""

    def __init__(self, fmt: rows.RowFormat) -> None:
        self.fmt = fmt
        self.quantized = fmt.quantized
        #: the table's dtype (a quantized one's: its format's)
        self.dtype = fmt.torch_dtype
        #: bytes of a row as the table stores it (payload, and a quantized row's parameters)
        self.width = fmt.stored_bytes if fmt.quantized else fmt.row_bytes
        #: the dtype of the rows a read returns
        self.out_dtype = torch.float32 if fmt.quantized else self.dtype

    def checked(self, values: object, n: int) -> torch.Tensor:
        """Rows to write: ``[n, dim]`` CPU of the table's dtype; of a quantized table, of
        any plain float dtype."""
        if self.quantized and isinstance(values, torch.Tensor) and rows.is_plain(values.dtype):
            return check_values(values, n, self.fmt.dim, values.dtype)
        return check_values(values, n, self.fmt.dim,
                            torch.float32 if self.quantized else self.dtype)

    def finite(self, values: torch.Tensor, keys: torch.Tensor, *, allow_nonfinite: bool,
               key_word: str = "key") -> None:
        """Refuse rows holding NaN or an infinity (unless allowed, and never for a quantized
        table) with :class:`NonFiniteValuesError`."""
        if not self.quantized:
            check_finite(values, keys, allow_nonfinite=allow_nonfinite, key_word=key_word)
            return
        bad = nonfinite_rows(values)
        if bad is not None:
            pos = bad.nonzero()
            raise NonFiniteValuesError(
                f"values: {pos.shape[0]} row(s) hold NaN or infinite values (the first: "
                f"{key_word} {int(keys.reshape(-1)[int(pos[0, 0])])}); nothing was written: "
                "a quantized table stores finite rows only, fix those rows")

    def accept(self, values: object, keys: torch.Tensor, *, allow_nonfinite: bool,
               key_word: str = "key") -> torch.Tensor:
        """What a write of ``values`` for ``keys`` stores, checked (:meth:`checked`,
        :meth:`finite`) and encoded; of a quantized table, uint8 stored bytes are taken as
        they are, if they decode to finite rows.

        Raises:
            BadArgumentError: values of another dtype, device or shape.
            NonFiniteValuesError: a row holds NaN or an infinity (see :meth:`finite`).
        """
        n = keys.numel()
        if self.quantized and isinstance(values, torch.Tensor) and values.dtype == torch.uint8:
            stored = check_values(values, n, self.width, torch.uint8,
                                  what="stored rows (uint8)")
            self.finite(self.rows(stored), keys, allow_nonfinite=False, key_word=key_word)
            return stored
        rows_in = self.checked(values, n)
        self.finite(rows_in, keys, allow_nonfinite=allow_nonfinite, key_word=key_word)
        return self.stored(rows_in)

    def stored(self, values: torch.Tensor) -> torch.Tensor:
        """Checked, finite rows as the table stores them (quantized: uint8, encoded)."""
        return quant.encode(values, self.fmt) if self.quantized else values

    def added(self, stored: torch.Tensor, sums: torch.Tensor, keys: torch.Tensor, *,
              key_word: str = "key") -> torch.Tensor:
        """The stored bytes of a quantized table's rows ``stored`` (uint8 ``[U, width]``)
        plus their summed float32 deltas ``sums``: decoded, added in float32 and encoded
        with stochastic rounding (:func:`nvecache.common.quant.encode_sum`: unbiased, so
        deltas under half a step are not lost; each element within one step of the sum).

        Raises:
            NonFiniteValuesError: a sum is not finite (float32 overflow), naming the first
                of ``keys``; the caller writes nothing.
        """
        new = self.rows(stored) + sums
        self.finite(new, keys, allow_nonfinite=False, key_word=key_word)
        return quant.encode_sum(new, self.fmt)

    @staticmethod
    def raw(stored: torch.Tensor) -> np.ndarray:
        """uint8 ``[N, width]`` numpy bytes of stored rows (:meth:`accept`'s), for the
        compiled loops."""
        return stored.contiguous().view(torch.uint8).numpy()

    def rows(self, stored: torch.Tensor) -> torch.Tensor:
        """The rows of stored bytes (``[N, width]``, uint8 for a quantized table; a plain
        table's are its rows already)."""
        return quant.decode(stored, self.fmt) if self.quantized else stored
