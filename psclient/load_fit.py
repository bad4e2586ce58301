"""Whether a load's rows fit its table, and what the load stores of them.

A plain table takes rows of its ``dim`` and dtype (another dtype converted with
``convert``). A quantized table (``int8``, ``float8_e4m3fn``: docs/psclient.md,
"Quantized tables") takes either

- float rows ``[N, dim]`` of any plain dtype, quantized as they are inserted (``convert``
  casts rows of another kind, integers say, to float32 first); or
- its own stored bytes, uint8 ``[N, row_bytes]`` (payload and parameters, what ``psclient
  dump`` writes of such a table), inserted as they are: a dump loads back bit for bit.
  A ``.safetensors`` file says which format and dim its stored rows are (its ``dtype``
  and ``dim`` metadata, :attr:`psclient.loader.RowSource.stored`); they must be the
  table's. A tensor or ``.npy`` of uint8 rows of the table's ``row_bytes`` is taken as its
  stored bytes (nothing else says so).

:func:`check_rows` refuses what does not fit, before anything is written;
:func:`check_finite_rows` reads every row once as the load stores it and refuses NaN and
infinite values (always for a quantized table: such a row cannot be encoded).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from nvecache.common import quant
from nvecache.common.rows import DTYPES, FORMATS, RowFormat, RowFormatError, is_plain
from nvecache.common.rows import dtype_name as format_name
from psclient.errors import BadArgumentError, BadValuesError
from psclient.load_checks import scan_finite
from psclient.schema import dtype_name

if TYPE_CHECKING:
    from psclient.loader import KeySource, RowSource


def _arg(cli: bool, api: str, flag: str) -> str:
    return flag if cli else api


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def table_format(dtype: torch.dtype, dim: int) -> RowFormat:
    """The row format of a table of ``dim`` x ``dtype`` (a plain or quantized torch dtype).

    Raises:
        BadArgumentError: no table stores that dtype, or a dim out of range.
    """
    try:
        return RowFormat(format_name(dtype, FORMATS), dim)
    except RowFormatError as e:
        raise BadArgumentError(str(e)) from None


def stored_bytes(rows: RowSource, fmt: RowFormat) -> bool:
    """Whether ``rows`` are a quantized table's stored bytes for rows of ``fmt`` (uint8
    ``[N, fmt.stored_bytes]``, and of that format where the file says)."""
    return (fmt.quantized and rows.dtype == torch.uint8 and rows.dim == fmt.stored_bytes
            and (rows.stored is None or rows.stored == fmt))


def stored_what(fmt: RowFormat) -> str:
    """``the stored bytes of int8 rows of dim 13`` (for messages)."""
    return f"the stored bytes of {fmt.dtype} rows of dim {fmt.dim}"


def check_rows(rows: RowSource, dim: int, dtype: torch.dtype, *, table: str, convert: bool,
               cli: bool = False) -> None:
    """Check that ``rows`` fit a table of ``dim`` x ``dtype`` (a quantized format's torch
    dtype for a quantized table), converted if ``convert``.

    Raises:
        BadValuesError: another row length, or another dtype without ``convert`` (or one
            that cannot be converted to a float dtype); a quantized table's stored bytes
            given to a table of another format or dim.
    """
    fmt = table_format(dtype, dim)
    if rows.stored is not None and rows.stored != fmt:
        raise BadValuesError(
            f"{rows.what} holds {stored_what(rows.stored)} (a dump of a quantized table); "
            f"table {table!r} holds {fmt.dtype} rows of dim {dim}: load it into a table of "
            f"that format ({rows.stored.dtype}, dim {rows.stored.dim})")
    if stored_bytes(rows, fmt):
        return
    if rows.dim != dim:
        raise BadValuesError(
            f"{rows.what} holds rows of {rows.dim} elements, table {table!r} has dim {dim}: "
            "load rows of that length, or into another table"
        )
    if rows.dtype == dtype and not fmt.quantized:
        return
    if fmt.quantized and is_plain(rows.dtype):
        return  # NOTE: float rows: quantized as they are inserted
    if rows.dtype.is_complex or rows.dtype == torch.bool:
        raise BadValuesError(f"{rows.what} holds {_name(rows.dtype)} values; a table holds one of "
                             f"{', '.join(DTYPES)}" + (" (or quantizes them)" if fmt.quantized
                                                       else ""))
    if not convert:
        if fmt.quantized:
            raise BadValuesError(
                f"{rows.what} holds {_name(rows.dtype)} rows, table {table!r} quantizes float "
                f"rows ({fmt.dtype}): convert them on load with "
                f"{_arg(cli, 'convert=True', '--dtype ' + fmt.dtype)}")
        name = dtype_name(dtype)
        raise BadValuesError(
            f"{rows.what} holds {_name(rows.dtype)} rows, table {table!r} holds {name}: "
            f"convert them on load with {_arg(cli, 'convert=True', '--dtype ' + name)}"
        )


def stored_chunk(rows: RowSource, fmt: RowFormat) -> Callable[[torch.Tensor], torch.Tensor]:
    """What a load inserts of a chunk of ``rows`` (checked by :func:`check_rows`) into a
    table of ``fmt``: the table's dtype; a quantized table's stored bytes as they are, or
    its float rows as float32 (encoded by the insert)."""
    if stored_bytes(rows, fmt):
        return lambda chunk: chunk
    target = torch.float32 if fmt.quantized else fmt.torch_dtype
    return lambda chunk: chunk.to(target)


def check_finite_rows(rows: RowSource, dtype: torch.dtype, keys: KeySource | None, *,
                      batch_size: int = 65536, cli: bool = False,
                      dim: int | None = None) -> None:
    """Read every row of ``rows`` once, as ``dtype`` (what a load stores: a quantized
    table's float rows as float32, its stored bytes decoded), and refuse NaN and infinite
    values. ``dim``: the table's (default: the rows'; needed for stored bytes).

    Raises:
        NonFiniteValuesError: how many rows hold one, and the first one's key.
    """
    fmt = table_format(dtype, rows.dim if dim is None else dim)
    get: Callable[[int, int], torch.Tensor]
    if stored_bytes(rows, fmt):
        def get(a: int, b: int) -> torch.Tensor:
            return quant.decode(rows.get(a, b), fmt)
    else:
        cast = stored_chunk(rows, fmt)

        def get(a: int, b: int) -> torch.Tensor:
            return cast(rows.get(a, b))
    converted = None if rows.dtype == dtype or fmt.quantized else _name(dtype)
    scan_finite(rows.n, get,
                (lambda i: i) if keys is None else (lambda i: int(keys.get(i, i + 1)[0])),
                what=rows.what, converted=converted, batch_size=batch_size, cli=cli,
                quantized=fmt.quantized)
