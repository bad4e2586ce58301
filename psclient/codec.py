"""Argument checks and the vectorized conversions between tensors and stored bytes.

Every backend stores a row as its raw bytes, as the table's
:class:`~nvecache.common.rows.RowFormat` says (``TableSchema.row_bytes``: ``dim * itemsize``
bytes of the table's dtype, native little-endian, then the format's per-row parameters:
none for a plain dtype, a quantized format's float32 scale (and bias) after its one-byte
elements, :mod:`psclient.quantized`) and never pickles. Backends move *stored* rows:
``[N, dim]`` of a plain table's dtype, or a quantized table's uint8 ``[N, row_bytes]``
(:meth:`~psclient.schema.TableSchema.stored_view`). Keys are int64; each backend chooses its key
bytes (Redis: 8 little-endian bytes as a hash field; LMDB: 8 big-endian bytes of
``key ^ 2**63`` so that byte order is signed order).

NOTE: the functions here are the hot path of every lookup/insert: they work on whole
batches with numpy/torch ops and C-level ``map``/``tolist``; no Python loop per key.
"""

from __future__ import annotations

from itertools import repeat
from operator import is_not
from typing import TYPE_CHECKING

import numpy as np

from nvecache.common.finite import nonfinite_message, nonfinite_rows
from nvecache.common.fmix import fmix64
from nvecache.common.keys import RESERVED_KEY, RESERVED_KEY_RULE, key_problem
from nvecache.common.lazy import lazy_import
from psclient.errors import BadKeysError, BadValuesError, CorruptValueError, NonFiniteValuesError
from psclient.quantized import check_float_rows
from psclient.schema import TableSchema

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_import("torch", globals())

_SIGN = np.uint64(1 << 63)


def check_keys(keys: object) -> np.ndarray:
    """Validate keys (1-D int64 CPU tensor) and return them as a numpy int64 view.

    Raises:
        BadKeysError: not a tensor, wrong dtype, device or shape.
    """
    problem = key_problem(keys)
    if problem is not None:
        raise BadKeysError(f"keys {problem}")
    assert isinstance(keys, torch.Tensor)
    return keys.contiguous().numpy()


def check_values(values: object, n: int, schema: TableSchema) -> torch.Tensor:
    """Validate values against ``n`` keys and the schema; return them contiguous (a
    quantized table's: float rows of any plain dtype, which it encodes).

    Raises:
        BadValuesError: not a tensor, wrong dtype, device or shape.
    """
    if not isinstance(values, torch.Tensor):
        raise BadValuesError(f"values must be a torch.Tensor, got {type(values).__name__}")
    if schema.quantized:
        return check_float_rows(values, n, schema)
    if values.dtype != schema.torch_dtype:
        raise BadValuesError(
            f"values must be {schema.dtype} (the table's dtype), got {values.dtype}: "
            f"convert with values.to(torch.{schema.dtype})"
        )
    if values.device.type != "cpu":
        raise BadValuesError(f"values must be on the CPU, got {values.device}: use .cpu()")
    if tuple(values.shape) != (n, schema.dim):
        raise BadValuesError(
            f"values must have shape [{n}, {schema.dim}] (one row of dim {schema.dim} per key), "
            f"got {list(values.shape)}"
        )
    return values.contiguous()


def check_written(keys: np.ndarray, values: torch.Tensor, *, allow_nonfinite: bool,
                  allow: str = "allow_nonfinite=True") -> None:
    """What a write may store: never the reserved key; finite rows unless allowed.

    Args:
        keys: the write's keys (numpy int64, checked by :func:`check_keys`).
        values: its rows (checked by :func:`check_values`).
        allow_nonfinite: the caller lets NaN and infinite values be stored.
        allow: how the caller spells that opt-in, for the message.

    Raises:
        BadKeysError: a key is :data:`~nvecache.common.keys.RESERVED_KEY`.
        NonFiniteValuesError: a row holds a NaN or an infinity (says how many rows and the
            first one's key).
    """
    if keys.size and int(keys.min()) == RESERVED_KEY:
        raise BadKeysError(RESERVED_KEY_RULE)
    if not allow_nonfinite:
        bad = nonfinite_rows(values)
        if bad is not None:
            raise NonFiniteValuesError(nonfinite_message(bad, torch.from_numpy(keys),
                                                         allow=allow))


def row_bytes_list(values: torch.Tensor, order: np.ndarray | None = None) -> list[bytes]:
    """One ``bytes`` object per row of a contiguous ``[N, dim]`` tensor, optionally in
    ``order`` (the rows are copied once; reordering moves only references)."""
    n = values.shape[0]
    if n == 0:
        return []
    raw = values.view(torch.uint8).numpy().reshape(n, -1)
    rows = raw.view(f"V{raw.shape[1]}").ravel().tolist()
    if order is None:
        return rows
    obj = np.empty(n, dtype=object)
    obj[:] = rows
    return obj[order].tolist()


def le_key_bytes(keys: np.ndarray) -> list[bytes]:
    """8 little-endian bytes per key (the Redis hash field)."""
    return np.ascontiguousarray(keys, dtype="<i8").view("V8").tolist()


def be_key_bytes(keys: np.ndarray) -> list[bytes]:
    """8 big-endian bytes of ``key ^ 2**63`` per key: byte order equals signed order (LMDB)."""
    return (keys.view(np.uint64) ^ _SIGN).astype(">u8").view("V8").tolist()


def be_bytes_to_keys(raw: bytes) -> np.ndarray:
    """Inverse of :func:`be_key_bytes` over a concatenation of 8-byte keys."""
    return (np.frombuffer(raw, dtype=">u8").astype(np.uint64) ^ _SIGN).view(np.int64)


def partition_of(keys: np.ndarray, partitions: int) -> np.ndarray:
    """Partition of every key: murmur3 fmix64 of the key, modulo ``partitions``.

    NOTE: part of the stored layout (``LAYOUT_VERSION``): changing it moves every key.
    """
    return (fmix64(keys) % np.uint64(partitions)).astype(np.int64)


def group_by_partition(keys: np.ndarray, partitions: int) -> tuple[np.ndarray, np.ndarray]:
    """Order keys by partition.

    Returns:
        ``(order, bounds)``: ``keys[order]`` is grouped by partition; partition ``p``
        holds positions ``bounds[p]:bounds[p + 1]`` of that order.
    """
    part = partition_of(keys, partitions)
    # NOTE: numpy sorts 16-bit integers stably by radix, far faster than int64 (see
    # bench/RESULTS.md, "Parameter server clients"); partition counts are far below 2**16.
    small = part.astype(np.uint16) if partitions <= 1 << 16 else part
    order = np.argsort(small, kind="stable")
    bounds = np.zeros(partitions + 1, dtype=np.int64)
    np.cumsum(np.bincount(part, minlength=partitions), out=bounds[1:])
    return order, bounds


def _corrupt(table: str, key: int, length: int, schema: TableSchema, count: int
             ) -> CorruptValueError:
    return CorruptValueError(
        f"table {table!r}, key {key}: stored value has {length} bytes, expected "
        f"{schema.row_bytes} (dim {schema.dim} x {schema.dtype}); {count} bad value(s) in "
        "this batch: rewrite them with insert() or drop the table"
    )


def first_of_runs(sorted_keys: np.ndarray) -> np.ndarray:
    """bool ``[N]``: which positions of a sorted key array start a run of equal keys
    (``sorted_keys[first]`` are the distinct keys)."""
    first = np.ones(sorted_keys.size, dtype=bool)
    np.not_equal(sorted_keys[1:], sorted_keys[:-1], out=first[1:])
    return first


def assemble_distinct_rows(
    replies: list[bytes], miss: bytes, order: np.ndarray, first: np.ndarray,
    distinct: np.ndarray, schema: TableSchema, table: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The lookup result from one stored value per *distinct* key.

    Args:
        replies: one stored value per distinct key, in the order of ``distinct``; the
            ``miss`` object itself (told apart by identity) where the key is missing.
        miss: a row of zeros (``row_bytes`` long) standing for a miss: it is what a missing
            key reads as.
        order: the permutation that sorts the caller's keys (``keys[order]``).
        first: :func:`first_of_runs` of ``keys[order]``.
        distinct: ``keys[order][first]`` (for error messages).
        schema: the table schema (row length, dtype).
        table: table name for error messages.

    Returns:
        ``(values, found)`` in the caller's key order, the stored rows
        (:meth:`TableSchema.stored_view`); missing rows are zeros.

    Raises:
        CorruptValueError: a stored value does not have the row length; names the key.

    NOTE: C-level passes (``is_not``, ``len``), the references permuted to the caller's
    order by numpy, then one copy of every row into the array the returned tensor owns
    (no temporary copy of the rows: a second 4 MB buffer per 8k-row batch costs more in
    page faults than the copy, bench/RESULTS.md, "Parameter server clients").
    """
    n, m, rb = order.size, len(replies), schema.row_bytes
    hit = np.fromiter(map(is_not, replies, repeat(miss)), dtype=bool, count=m)
    lengths = np.fromiter(map(len, replies), dtype=np.int64, count=m)
    bad = np.flatnonzero(lengths != rb)
    if bad.size:
        raise _corrupt(table, int(distinct[bad[0]]), int(lengths[bad[0]]), schema, bad.size)
    obj = np.empty(n, dtype=object)
    found = np.empty(n, dtype=bool)
    if m == n:  # NOTE: no duplicates: each reply goes to one place
        obj[order] = replies
        found[order] = hit
    else:
        run = np.cumsum(first) - 1  # sorted position -> its distinct key
        objs = np.empty(m, dtype=object)
        objs[:] = replies
        obj[order] = objs[run]
        found[order] = hit[run]
    flat = np.fromiter(obj.tolist(), dtype=f"V{rb}", count=n).view(np.uint8)
    return schema.stored_view(torch.from_numpy(flat), n), torch.from_numpy(found)

