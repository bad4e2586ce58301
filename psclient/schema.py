"""A table's schema: what is stored with every table, and how it is checked on open.

The schema is one msgpack map stored beside the table (a Redis string key, or a record in
the LMDB main database)::

    {"layout": LAYOUT_VERSION, "dim": int, "dtype": "float32", "partitions": int,
     "created": float unix time, "marked": true (Redis tables with existence markers)}

``dtype`` is the name of the row format: a plain dtype, or a quantized format (``int8``,
``float8_e4m3fn``: :data:`nvecache.common.rows.QUANTIZED`), whose rows are stored as
:mod:`nvecache.common.quant` encodes them. A psclient that predates quantized tables finds
an unknown dtype in such a record and refuses the table (``CorruptValueError``) instead of
reading its bytes as plain numbers.

The record never changes while the table lives (a layout-1 upgrade aside; its state,
``loading`` or ready, is kept beside it), so a reader that compares it with the one it
opened tells the same table from another one of the name.

Opening an existing table compares what the caller asked for with what is stored; a
difference is a :class:`SchemaMismatchError`, never a silent reinterpretation.
"""

from __future__ import annotations

import struct
import time
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import InitVar, dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import msgpack

from nvecache.common import rows
from nvecache.common.names import TABLE_NAME_RULE, is_table_name
from psclient.errors import BadArgumentError, CorruptValueError, SchemaMismatchError

if TYPE_CHECKING:
    import torch

#: Bump when the stored byte layout of rows, keys, partitions or the change feed changes.
#: 2: Redis writes rows and their change-feed record in one Lua step, one stream per
#: partition (layout-1 tables need `psclient upgrade`); file:// records commit times.
LAYOUT_VERSION = 2

#: Supported row dtypes: stored name -> bytes per element (the one list is
#: :data:`nvecache.common.rows.DTYPES`).
DTYPE_ITEMSIZES: Mapping[str, int] = rows.DTYPES


class _TorchDtypes(Mapping[str, "torch.dtype"]):
    """The stored dtype names -> torch dtypes; torch is imported on the first value read, so
    the names (``--dtype`` choices, a check of a stored name) cost no torch."""

    def __getitem__(self, name: str) -> torch.dtype:
        if name not in rows.DTYPES:
            raise KeyError(name)
        return rows.torch_dtype(name)

    def __contains__(self, name: object) -> bool:
        return name in rows.DTYPES

    def __iter__(self) -> Iterator[str]:
        return iter(rows.DTYPES)

    def __len__(self) -> int:
        return len(rows.DTYPES)

    def __repr__(self) -> str:
        return f"DTYPES({', '.join(rows.DTYPES)})"


#: Supported row dtypes by their stored name (torch dtypes).
DTYPES: Mapping[str, torch.dtype] = _TorchDtypes()


def dtype_name(dtype: torch.dtype | str, allowed: tuple[str, ...] | None = None) -> str:
    """The stored name of a supported dtype (``torch.float32`` or ``"fp32"`` -> ``"float32"``).

    Args:
        dtype: a torch dtype or a name (:func:`nvecache.common.rows.dtype_name` reads it).
        allowed: the names taken (default: the plain dtypes; ``rows.FORMATS`` adds the
            quantized formats, where a table may store them).

    Raises:
        BadArgumentError: the dtype is none of ``allowed`` (the message lists them).
    """
    try:
        return rows.dtype_name(dtype, allowed)
    except rows.RowFormatError as e:
        raise BadArgumentError(str(e)) from None


def check_table_name(table: object) -> str:
    """Validate a table name (the rule of :mod:`nvecache.common.names`) and return it."""
    if not is_table_name(table):
        raise BadArgumentError(f"bad table name {table!r}: use {TABLE_NAME_RULE}")
    return table


@dataclass(frozen=True)
class TableSchema:
    """The geometry stored with a table.

    ``formats`` (not a field) is the whitelist ``dtype`` is checked against: the plain
    dtypes by default; a table's own record (:meth:`decode`) and a table being created pass
    :data:`nvecache.common.rows.FORMATS`, so a quantized format is taken only there.
    """

    #: elements per row
    dim: int
    #: stored row format's name: a plain dtype (a key of :data:`DTYPES`) or a quantized
    #: format (a key of :data:`nvecache.common.rows.QUANTIZED`)
    dtype: str
    #: number of partitions the keys are spread over (fixed at creation)
    partitions: int = 1
    #: byte-layout version of the backend that created the table
    layout: int = LAYOUT_VERSION
    #: creation time, seconds since the epoch
    created: float = field(default_factory=time.time, compare=False)
    #: Redis: the table was created with an existence marker in every partition's slot
    #: (writes check it); a table created before markers gets them on its first write
    marked: bool = field(default=False, compare=False)
    #: the dtype names taken (default: the plain ones); not stored, not compared
    formats: InitVar[tuple[str, ...] | None] = None

    def __post_init__(self, formats: tuple[str, ...] | None) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim <= 0:
            raise BadArgumentError(f"dim must be a positive int, got {self.dim!r}")
        allowed = tuple(rows.DTYPES) if formats is None else formats
        if self.dtype not in allowed:
            raise BadArgumentError(
                f"unsupported dtype {self.dtype!r}: use one of {', '.join(allowed)}")
        if not isinstance(self.partitions, int) or not 1 <= self.partitions <= 16384:
            raise BadArgumentError(
                f"partitions must be an int in [1, 16384], got {self.partitions!r}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The row dtype as a torch dtype (a quantized format's: its payload's,
        ``torch.int8`` or ``torch.float8_e4m3fn``)."""
        return rows.torch_dtype(self.dtype)

    @property
    def quantized(self) -> bool:
        """Whether rows are stored quantized: writes take float rows and encode them,
        lookups decode them to float32 (:mod:`nvecache.common.quant`)."""
        return self.row_format.quantized

    @property
    def value_dtype(self) -> torch.dtype:
        """The dtype of the rows a lookup returns: float32 for a quantized table, else the
        table's dtype."""
        return rows.torch_dtype("float32") if self.quantized else self.torch_dtype

    def stored_view(self, raw: torch.Tensor, n: int) -> torch.Tensor:
        """``n`` stored rows from their bytes (a contiguous uint8 tensor, ``n * row_bytes``
        of them): ``[n, dim]`` of the dtype, or for a quantized table ``[n, row_bytes]``
        uint8 (what :func:`nvecache.common.quant.decode` reads). A view, no copy."""
        if self.quantized:
            return raw.reshape(n, self.row_bytes)
        return raw.view(self.torch_dtype).reshape(n, self.dim)

    @property
    def incarnation(self) -> str:
        """8 hex digits naming this table among tables of the same name created before it
        (from the creation time): change-feed cursors carry it, so a cursor of a dropped
        table is not read against its successor."""
        return format(zlib.crc32(struct.pack("<d", self.created)), "08x")

    @property
    def token(self) -> str:
        """This table's creation time, exactly (``repr``): the value of its existence markers,
        which writes compare, and which orders two tables of one name by age."""
        return repr(float(self.created))

    @cached_property
    def row_format(self) -> rows.RowFormat:
        """How the table's rows are stored (:class:`nvecache.common.rows.RowFormat`)."""
        return rows.RowFormat(self.dtype, self.dim)

    @property
    def row_bytes(self) -> int:
        """Bytes of one stored row (its value in the store: payload and per-row parameters)."""
        return self.row_format.stored_bytes

    def encode(self) -> bytes:
        """The msgpack record stored with the table."""
        rec = {"layout": self.layout, "dim": self.dim, "dtype": self.dtype,
               "partitions": self.partitions, "created": self.created}
        if self.marked:  # NOTE: only then: an unmarked table's record stays as it was
            rec["marked"] = True
        return msgpack.packb(rec)

    @classmethod
    def decode(cls, raw: bytes, table: str) -> TableSchema:
        """Parse a stored schema record.

        Raises:
            CorruptValueError: the record is not a valid schema.
        """
        try:
            rec = msgpack.unpackb(raw)
            return cls(dim=rec["dim"], dtype=rec["dtype"], partitions=rec["partitions"],
                       layout=rec["layout"], created=rec.get("created", 0.0),
                       marked=rec.get("marked", False) is True, formats=rows.FORMATS)
        except (ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
            raise CorruptValueError(
                f"table {table!r}: the stored schema record is unreadable ({e}); "
                "drop the table (psclient drop) and load it again"
            ) from e

    def check(self, table: str, *, dim: int | None, dtype: str | None,
              partitions: int | None) -> None:
        """Compare this stored schema with what a caller asked for.

        Raises:
            SchemaMismatchError: layout version, dim, dtype or partitions differ.
        """
        if self.layout != LAYOUT_VERSION:
            raise SchemaMismatchError(
                f"table {table!r} was written with layout version {self.layout}, this psclient "
                f"reads version {LAYOUT_VERSION}: use a matching psclient or reload the table"
            )
        asked = {"dim": dim, "dtype": dtype, "partitions": partitions}
        stored = {"dim": self.dim, "dtype": self.dtype, "partitions": self.partitions}
        diff = [f"{k}={asked[k]!r} (stored {stored[k]!r})" for k in asked
                if asked[k] is not None and asked[k] != stored[k]]
        if diff:
            raise SchemaMismatchError(
                f"table {table!r} exists with dim={self.dim}, dtype={self.dtype}, "
                f"partitions={self.partitions}; asked for {', '.join(diff)}: connect without "
                "dim/dtype to use the stored schema, or drop the table first"
            )
