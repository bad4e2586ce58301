"""Argument checks and the vectorized conversions between tensors and stored bytes.

Every backend stores a row as its raw bytes (``dim * itemsize`` bytes, the table's dtype,
native little-endian) and never pickles. Keys are int64; each backend chooses its key
bytes (Redis: 8 little-endian bytes as a hash field; LMDB: 8 big-endian bytes of
``key ^ 2**63`` so that byte order is signed order).

NOTE: the functions here are the hot path of every lookup/insert: they work on whole
batches with numpy/torch ops and C-level ``map``/``tolist``; no Python loop per key.
"""

from __future__ import annotations

import numpy as np
import torch

from .errors import BadKeysError, BadValuesError, CorruptValueError
from .keys import key_problem
from .schema import TableSchema

_SIGN = np.uint64(1 << 63)
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)


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
    """Validate values against ``n`` keys and the schema; return them contiguous.

    Raises:
        BadValuesError: not a tensor, wrong dtype, device or shape.
    """
    if not isinstance(values, torch.Tensor):
        raise BadValuesError(f"values must be a torch.Tensor, got {type(values).__name__}")
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
    x = keys.view(np.uint64).copy()
    x ^= x >> np.uint64(33)
    x *= _M1
    x ^= x >> np.uint64(33)
    x *= _M2
    x ^= x >> np.uint64(33)
    return (x % np.uint64(partitions)).astype(np.int64)


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


def assemble_rows(
    replies: list[bytes | None], order: np.ndarray, keys: np.ndarray, schema: TableSchema,
    table: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn one stored value (or ``None`` for a miss) per key into the lookup result.

    Args:
        replies: one stored value or ``None`` per key, in the order ``keys[order]``.
        order: the permutation the replies were fetched in.
        keys: the keys in the caller's order (for error messages).
        schema: the table schema (row length, dtype).
        table: table name for error messages.

    Returns:
        ``(values, found)`` in the caller's key order; missing rows are zeros.

    Raises:
        CorruptValueError: a stored value does not have the row length; names the key.
    """
    n = len(replies)
    obj = np.empty(n, dtype=object)
    obj[order] = replies
    found = obj != None  # noqa: E711 -- elementwise comparison on an object array
    obj[~found] = bytes(schema.row_bytes)  # NOTE: a miss reads as a zero row
    ordered = obj.tolist()
    lengths = np.fromiter(map(len, ordered), dtype=np.int64, count=n)
    bad = np.flatnonzero(lengths != schema.row_bytes)
    if bad.size:
        raise CorruptValueError(
            f"table {table!r}, key {int(keys[bad[0]])}: stored value has "
            f"{int(lengths[bad[0]])} bytes, expected {schema.row_bytes} (dim {schema.dim} x "
            f"{schema.dtype}); {bad.size} bad value(s) in this batch: rewrite them with "
            "insert() or drop the table"
        )
    # NOTE: one C-level copy of every row into a fresh array the returned tensor owns.
    flat = np.fromiter(ordered, dtype=f"V{schema.row_bytes}", count=n).view(np.uint8)
    values = torch.from_numpy(flat).view(schema.torch_dtype)
    return values.reshape(n, schema.dim), torch.from_numpy(found.astype(bool))
