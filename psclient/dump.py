"""Dump a table's keys and rows to a ``.safetensors`` file or ``.npy`` arrays.

The rows are read chunk by chunk and streamed to the file (:mod:`psclient.formats`), so
memory holds one chunk (and, on Redis, the keys of one partition). On ``file://`` the dump
reads one LMDB read transaction: a snapshot of the table. On Redis each partition hash is
read with ``HSCAN``, which never blocks the server; a key written while the dump runs may
or may not be in it (as with any scan), and a key ``HSCAN`` returns twice is written once.

What is written loads back with :meth:`psclient.ParameterServer.load` (or ``psclient
load``): a safetensors file's ``keys`` tensor gives the keys; ``.npy`` rows take their keys
from the ``.keys.npy`` beside them (``keys=``/``--keys``).

A quantized table (``int8``, ``float8_e4m3fn``) is dumped as its stored bytes: ``weight``
is uint8 ``[N, row_bytes]`` (each row's payload and float32 parameters, as
:mod:`nvecache.common.quant` encodes them), and the metadata's ``dtype`` and ``dim`` name
the format. Loading it into a table of that format stores those bytes as they are, so the
round trip is bit for bit; dequantized float32 rows would not be (encoding an int8 row's
decoded values again moves its scale or bias by a rounding in about one row in ten).
:func:`nvecache.common.quant.decode` reads the rows of such a file.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from psclient.codec import be_bytes_to_keys
from psclient.errors import BadArgumentError, CorruptValueError
from psclient.formats import RowsWriter, keys_path_for, write_format

if TYPE_CHECKING:
    from psclient.base import ParameterServer

#: keys per HSCAN reply asked of Redis
_SCAN_COUNT = 4096


def _file_chunks(ps: Any) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    from psclient.file.mirror import scan_rows  # NOTE: file:// only: lmdb loads with it

    with ps._guard(), ps._env.begin(db=ps._rows) as txn:
        for keys, values in scan_rows(txn, ps._rows):
            yield be_bytes_to_keys(b"".join(keys)), _rows_of(ps, b"".join(values), len(values))


def _rows_of(ps: ParameterServer, raw: bytes, n: int) -> np.ndarray:
    row_bytes = ps.schema.row_bytes
    if len(raw) != n * row_bytes:
        raise CorruptValueError(f"table {ps.table!r}: a stored row is not {row_bytes} bytes "
                                "long; the table is damaged (drop it and load it again)")
    return np.frombuffer(raw, dtype=np.uint8).reshape(n, row_bytes)


class _Seen:
    """The keys written so far, as sorted runs merged like a binary counter (each key is
    merged about log2(N) times), to drop the keys HSCAN returns again."""

    def __init__(self) -> None:
        self._runs: list[np.ndarray] = []

    def fresh(self, keys: np.ndarray) -> np.ndarray:
        """Which of ``keys`` (distinct) were not seen before; records them."""
        new = np.ones(keys.size, dtype=bool)
        for run in self._runs:  # NOTE: O(log N) runs, each searched for the whole chunk
            at = np.minimum(np.searchsorted(run, keys), run.size - 1)
            new &= run[at] != keys
        add = np.sort(keys[new])
        while self._runs and self._runs[-1].size <= add.size:
            add = np.sort(np.concatenate([self._runs.pop(), add]))
        if add.size:
            self._runs.append(add)
        return new


def _redis_chunks(ps: Any) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    client = ps.client
    for part in ps.part_keys:
        seen = _Seen()
        cursor = 0
        while True:
            cursor, found = client.hscan(part, cursor, count=_SCAN_COUNT)
            if found:
                fields = list(found)
                if any(len(f) != 8 for f in fields):
                    raise CorruptValueError(f"table {ps.table!r}: partition {part!r} holds a "
                                            "field that is not a key; the table is damaged")
                keys = np.frombuffer(b"".join(fields), dtype="<i8").astype(np.int64)
                rows = _rows_of(ps, b"".join(found[f] for f in fields), len(fields))
                new = seen.fresh(keys)  # NOTE: HSCAN may return a key twice
                keys, rows = keys[new], rows[new]
                if keys.size:
                    yield keys, rows
            if int(cursor) == 0:
                break


def chunks(ps: ParameterServer) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Every ``(keys, raw rows)`` of the table, in chunks (keys int64, rows ``[n,
    row_bytes]`` uint8).

    Raises:
        BadArgumentError: the table's store cannot be scanned (a backend with no scan).
    """
    if hasattr(ps, "part_keys") and hasattr(ps, "client"):
        yield from _redis_chunks(ps)
    elif hasattr(ps, "_env") and hasattr(ps, "_rows"):
        yield from _file_chunks(ps)
    else:
        raise BadArgumentError(f"table {ps.table!r}: its store ({type(ps).__name__}) cannot be "
                               "dumped; dump a file:// or Redis table")


def dump_table(ps: ParameterServer, path: str | Path, *, keys_path: str | Path | None = None,
               format: str | None = None,  # noqa: A002
               progress: bool | None = None, cli: bool = False) -> int:
    """Write every key and row of ``ps``'s table to ``path``; returns the rows written.

    Args:
        path: a ``.safetensors`` file (rows as ``weight``, keys as ``keys``) or ``.npy``
            rows (keys to ``keys_path``, by default ``<name>.keys.npy`` beside it); a
            quantized table's rows as their stored bytes (module docstring).
        format: ``"safetensors"`` or ``"npy"``; default: by the suffix.
        progress: a progress bar on stderr; None: only where stderr is a terminal.
        cli: name the ``psclient`` command's flags in messages.

    Raises:
        BadArgumentError: an unknown format, or a path that cannot be written (nothing is
            left of the file: it is written beside and renamed into place).
    """
    flag = "--format" if cli else "format="
    try:
        fmt = write_format(path, format)
    except ValueError as e:
        raise BadArgumentError(f"{e} ({flag} safetensors or npy)") from None
    meta = {"table": ps.table, "dim": str(ps.dim), "dtype": ps.schema.dtype,
            "written_by": "psclient dump"}
    try:
        writer = RowsWriter(path, dim=ps.dim, dtype=ps.schema.dtype, fmt=fmt,
                            keys_path=keys_path, metadata=meta)
    except OSError as e:
        raise BadArgumentError(f"cannot write {str(path)!r}: {e.strerror or e}; write it to a "
                               "folder that exists and that you can write") from None
    total = ps.size()
    try:
        with writer, tqdm(total=total, unit="rows", unit_scale=True, desc=f"dump {ps.table}",
                          disable=None if progress is None else not progress) as bar:
            for keys, rows in chunks(ps):
                writer.write(keys, rows)
                bar.update(len(keys))
    except OSError as e:
        raise BadArgumentError(f"cannot write {str(path)!r}: {e.strerror or e}; nothing was "
                               "written (free space, or write it elsewhere)") from None
    return writer.rows


def default_keys_path(path: str | Path, fmt: str | None) -> Path | None:
    """Where ``.npy`` keys go when none is named (None for safetensors)."""
    with contextlib.suppress(ValueError):
        if write_format(path, fmt) == "npy":
            return keys_path_for(path)
    return None
