"""A table's rows between the API and the store: a plain table's are their own bytes; a
quantized table's (``int8``, ``float8_e4m3fn``: :data:`nvecache.common.rows.QUANTIZED`)
are encoded on the way in and decoded on the way out by :mod:`nvecache.common.quant`.

What a quantized table does, as a :class:`hostcache.SharedMemBlock` of that format does:

- writes (``insert``, ``update``, a load's float rows) take float rows ``[N, dim]`` of any
  plain dtype and store ``quant.encode(rows)``, ``row_bytes`` of payload and parameters;
- rows holding NaN or an infinity cannot be encoded (a row's range is its scale): they are
  refused with :class:`~psclient.errors.NonFiniteValuesError` whatever ``allow_nonfinite``
  says, and nothing is written;
- lookups return ``quant.decode(stored)`` as float32 (a missing key's row of zero bytes
  reads as zeros, as on a plain table);
- accumulate decodes a row, adds the float32 sum of its deltas, and encodes the result
  with stochastic rounding (:func:`add_rows`, :func:`nvecache.common.quant.encode_sum`),
  in the backend's atomic step per row: unbiased, so deltas under half the row's
  quantization step add up over many calls instead of rounding away (each element within
  one step of the sum, not half of one), and a sum that is no longer finite (a float32
  overflow) is refused like a non-finite row;
- a load may also give a quantized table's stored bytes themselves (uint8 ``[N,
  row_bytes]``, what ``psclient dump`` writes of it): they are stored as they are, once
  their decoded rows are seen to be finite (:func:`check_stored`).

Everything here works on whole batches (no Python loop per row).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from nvecache.common import rows
from nvecache.common.accumulate import added
from nvecache.common.finite import nonfinite_rows
from nvecache.common.lazy import lazy_import
from psclient.errors import BadValuesError, NonFiniteValuesError

if TYPE_CHECKING:
    import torch

    from nvecache.common import quant
    from psclient.schema import TableSchema
else:  # NOTE: the codec imports torch: both load when rows are first handled
    torch = lazy_import("torch", globals())
    quant = lazy_import("nvecache.common.quant", globals())

#: what every refusal of a quantized table's non-finite rows says to do
FINITE_ONLY = "a quantized table stores finite rows only (allow_nonfinite does not apply)"


def check_float_rows(values: torch.Tensor, n: int, schema: TableSchema) -> torch.Tensor:
    """A quantized table's rows to write: ``[n, dim]`` CPU of a plain float dtype,
    contiguous.

    Raises:
        BadValuesError: another dtype, device or shape.
    """
    if not rows.is_plain(values.dtype):
        raise BadValuesError(
            f"values must be float rows ({', '.join(rows.DTYPES)}) for a {schema.dtype} "
            f"table, which quantizes them; got {values.dtype}: convert with "
            "values.to(torch.float32)")
    if values.device.type != "cpu":
        raise BadValuesError(f"values must be on the CPU, got {values.device}: use .cpu()")
    if tuple(values.shape) != (n, schema.dim):
        raise BadValuesError(
            f"values must have shape [{n}, {schema.dim}] (one row of dim {schema.dim} per key), "
            f"got {list(values.shape)}")
    return values.contiguous()


def nonfinite_error(bad: torch.Tensor, keys: np.ndarray, what: str = "values"
                    ) -> NonFiniteValuesError:
    """The refusal of rows holding NaN or an infinity (``bad``: which) for a quantized
    table: how many, the first one's key, and that nothing was written."""
    pos = torch.nonzero(bad)[:, 0]
    return NonFiniteValuesError(
        f"{what}: {pos.numel()} row(s) hold NaN or infinite values (the first: key "
        f"{int(keys[int(pos[0])])}); nothing was written: {FINITE_ONLY}, fix those rows")


def refuse_nonfinite(keys: np.ndarray, values: torch.Tensor, what: str = "values") -> None:
    """Refuse rows holding NaN or an infinity for a quantized table (whatever
    ``allow_nonfinite`` the caller passed).

    Raises:
        NonFiniteValuesError: how many rows, the first one's key.
    """
    bad = nonfinite_rows(values)
    if bad is not None:
        raise nonfinite_error(bad, keys, what)


def encode_rows(keys: np.ndarray, values: torch.Tensor, schema: TableSchema,
                what: str = "values", *, summed: bool = False) -> torch.Tensor:
    """Checked float rows as a quantized table stores them: uint8 ``[N, row_bytes]``,
    rounded to nearest (a write), or, ``summed``, stochastically (an accumulate's sums:
    :func:`nvecache.common.quant.encode_sum`).

    Raises:
        NonFiniteValuesError: a row holds NaN or an infinity (:func:`refuse_nonfinite`),
            or its range is too wide for float32 parameters (an int8 row from near
            ``-3.4e38`` to near ``3.4e38``: its scale would overflow).
    """
    refuse_nonfinite(keys, values, what)
    fmt = schema.row_format
    stored = quant.encode_sum(values, fmt) if summed else quant.encode(values, fmt)
    wide = ~torch.isfinite(quant.parameters(stored, schema.row_format)).all(dim=1)
    if bool(wide.any()):
        pos = torch.nonzero(wide)[:, 0]
        raise NonFiniteValuesError(
            f"{what}: {pos.numel()} row(s) span a range float32 cannot hold (the first: key "
            f"{int(keys[int(pos[0])])}): their quantization parameters would not be finite; "
            f"nothing was written: {FINITE_ONLY}, fix those rows")
    return stored


def decode_rows(stored: torch.Tensor, schema: TableSchema) -> torch.Tensor:
    """What a lookup returns of stored rows: a quantized table's decoded to float32
    ``[N, dim]``; a plain table's as they are."""
    return quant.decode(stored, schema.row_format) if schema.quantized else stored


def add_rows(stored: torch.Tensor, sums: torch.Tensor, schema: TableSchema,
             keys: np.ndarray) -> torch.Tensor:
    """Stored rows plus their summed deltas (``sums``, the accumulator dtype), as stored
    rows: a plain table's added and rounded once (:func:`nvecache.common.accumulate.added`);
    a quantized table's decoded, added in float32 and encoded again with stochastic
    rounding (:func:`nvecache.common.quant.encode_sum`: deltas under half a step are not
    lost, each element within one step of the sum).

    Raises:
        NonFiniteValuesError: (quantized) a sum is not finite (float32 overflow): no row
            of ``keys`` may be written.
    """
    if not schema.quantized:
        return added(stored, sums)
    return encode_rows(keys, quant.decode(stored, schema.row_format) + sums, schema,
                       "rows plus deltas", summed=True)


def check_stored(keys: np.ndarray, raw: torch.Tensor, schema: TableSchema) -> torch.Tensor:
    """A quantized table's stored bytes given as they are (uint8 ``[N, row_bytes]``, a
    dump's rows), contiguous, once their decoded rows are seen to be finite.

    Raises:
        BadValuesError: not uint8 rows of the table's ``row_bytes``, or not a quantized
            table.
        NonFiniteValuesError: a row's parameters or payload decode to NaN or an infinity.
    """
    rb = schema.row_bytes
    if (not schema.quantized or raw.dtype != torch.uint8 or raw.dim() != 2
            or raw.shape[1] != rb or raw.shape[0] != keys.size):
        raise BadValuesError(
            f"stored rows must be uint8 [{keys.size}, {rb}] for a quantized table "
            f"({schema.dtype}, dim {schema.dim}); got {raw.dtype} {list(raw.shape)}")
    raw = raw.contiguous()
    refuse_nonfinite(keys, quant.decode(raw, schema.row_format), "stored rows")
    return raw
