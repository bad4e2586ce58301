"""Streaming writers of keys and rows: a ``.safetensors`` file, or ``.npy`` arrays.

A table is written chunk by chunk without knowing its row count beforehand (a store may
grow while it is read): the rows go to a temporary file beside the destination behind a
header reserved for the largest count, the keys to a second temporary file, and
:meth:`RowsWriter.commit` appends the keys (safetensors), writes the header with the count
(padded with spaces, as both formats allow) and renames the files into place. A writer
that is not committed (an error, an interrupt) removes its temporary files: a destination
is either the old file or the whole new one, never half-written.

A safetensors file holds the rows as ``weight`` (``[N, dim]``, the table's dtype) and the
keys as ``keys`` (``[N]`` int64), and ``__metadata__`` strings the caller gives (the
table's name, kind, geometry). ``.npy`` has no bfloat16: such rows are written as float32,
which holds every bfloat16 value exactly. Rows of a quantized format
(:data:`nvecache.common.rows.QUANTIZED`) are written as their stored bytes, uint8 ``[N,
stored_bytes]`` (payload and parameters, as :mod:`nvecache.common.quant` encodes them):
re-encoding their decoded values would not give the same bytes back, so a file of them
loads back bit for bit; the metadata (``dtype``, ``dim``) says how to read them.

Nothing here needs torch: rows are given as numpy arrays (bfloat16 rows as their raw
16-bit patterns, ``uint16``/``int16``), so the writers serve the host tier as well.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import numpy as np

from nvecache.common import rows

#: what a writer writes
WRITE_FORMATS = ("safetensors", "npy")
#: safetensors' dtype names of the table dtypes (nvecache.common.rows) and of the keys
ST_DTYPES = {**{name: rows.safetensors_dtype(name) for name in rows.DTYPES}, "int64": "I64"}
#: the tensor names of a written safetensors file
ROWS_NAME, KEYS_NAME = "weight", "keys"
_NPY_MAGIC = b"\x93NUMPY\x01\x00"
_BIG = 10**20  # NOTE: more digits than any count: the reserved header fits every count
#: the .npy element of each dtype written (numpy has no bfloat16: its rows go as float32)
_NP = {**{name: rows.numpy_dtype(name).str for name in rows.DTYPES}, "bfloat16": "<f4",
       "int64": "<i8"}


def write_format(path: str | Path, fmt: str | None) -> str:
    """``fmt``, or the one ``path``'s suffix names (``.safetensors``, ``.npy``).

    Raises:
        ValueError: an unknown format, or a suffix that names none (the message says what
            to do).
    """
    if fmt is None:
        fmt = Path(path).suffix.lower().removeprefix(".")
        if fmt not in WRITE_FORMATS:
            raise ValueError(f"cannot tell the format to write {str(path)!r} in: name it "
                             ".safetensors or .npy, or say the format")
    if fmt not in WRITE_FORMATS:
        raise ValueError(f"unknown file format {fmt!r}: write one of {', '.join(WRITE_FORMATS)}")
    return fmt


def keys_path_for(path: str | Path) -> Path:
    """Where the keys of rows written to ``path`` as ``.npy`` go by default:
    ``rows.npy`` -> ``rows.keys.npy``."""
    p = Path(path)
    return p.with_name(p.name.removesuffix(p.suffix) + ".keys.npy")


def stored_width(dtype: str, dim: int) -> int:
    """Elements of a row as a file holds it: ``dim``, or a quantized format's stored bytes
    (uint8)."""
    fmt = rows.RowFormat(dtype, dim)
    return fmt.stored_bytes if fmt.quantized else dim


def _element(dtype: str, npy: bool) -> str:
    """The element type rows of ``dtype`` are written in: a safetensors dtype name, or a
    ``.npy`` descr (a quantized format's: its stored bytes, uint8)."""
    if dtype in rows.QUANTIZED:
        return "|u1" if npy else "U8"
    return _NP[dtype] if npy else ST_DTYPES[dtype]


def _st_header(n: int, dim: int, dtype: str, meta: dict[str, str], reserve: int = 0) -> bytes:
    fmt = rows.RowFormat(dtype, dim)
    width = stored_width(dtype, dim)
    row_bytes = fmt.stored_bytes
    head: dict[str, object] = {}
    if meta:
        head["__metadata__"] = meta
    head[ROWS_NAME] = {"dtype": _element(dtype, False), "shape": [n, width],
                       "data_offsets": [0, n * row_bytes]}
    head[KEYS_NAME] = {"dtype": "I64", "shape": [n],
                       "data_offsets": [n * row_bytes, n * row_bytes + 8 * n]}
    text = json.dumps(head, separators=(",", ":")).encode()
    size = max(reserve, -(-len(text) // 8) * 8)
    return size.to_bytes(8, "little") + text.ljust(size, b" ")


def _npy_header(shape: tuple[int, ...], descr: str, reserve: int = 0) -> bytes:
    text = repr({"descr": descr, "fortran_order": False, "shape": shape}).encode()
    size = max(reserve, -(-(len(_NPY_MAGIC) + 2 + len(text) + 1) // 64) * 64)
    body = size - len(_NPY_MAGIC) - 2
    return _NPY_MAGIC + body.to_bytes(2, "little") + text.ljust(body - 1, b" ") + b"\n"


def _temp(dest: Path) -> tuple[BinaryIO, str]:
    """A new file beside ``dest`` with the permissions a new file gets (the umask's)."""
    name = str(dest.parent / f".{dest.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    return os.fdopen(fd, "w+b"), name


class RowsWriter:
    """Writes keys and rows of ``dim`` x ``dtype`` to ``path`` chunk by chunk.

    Use as a context manager: leaving the block normally commits (:meth:`commit`), an
    exception discards every temporary file. ``keys_path`` is where ``.npy`` keys go
    (default :func:`keys_path_for`); a safetensors file holds its keys.

    ``dtype`` is a plain dtype or a quantized format (rows written as their stored bytes,
    module docstring).

    Raises (on creation):
        OSError: the destination's folder does not exist or cannot be written.
        ValueError: an unknown format or dtype.
    """

    def __init__(self, path: str | Path, *, dim: int, dtype: str, fmt: str | None = None,
                 keys_path: str | Path | None = None,
                 metadata: dict[str, str] | None = None) -> None:
        if (dtype not in ST_DTYPES or dtype == "int64") and dtype not in rows.QUANTIZED:
            raise ValueError(f"rows of dtype {dtype!r} cannot be written")
        self.path = Path(path)
        self.fmt = write_format(path, fmt)
        self.dim, self.dtype = dim, dtype
        #: elements of a written row (a quantized format's: its stored bytes)
        self.width = stored_width(dtype, dim)
        self.keys_path = (None if self.fmt == "safetensors"
                          else Path(keys_path) if keys_path is not None
                          else keys_path_for(path))
        self.meta = dict(metadata or {})
        #: rows written so far
        self.rows = 0
        self._done = False
        self._files: list[tuple[BinaryIO, str]] = []
        try:
            self._rows_f, self._rows_tmp = self._open(self.path)
            self._keys_f, self._keys_tmp = self._open(self.keys_path or self.path)
        except BaseException:
            self.discard()
            raise
        if self.fmt == "safetensors":
            self._reserve = len(_st_header(_BIG, dim, dtype, self.meta))
            self._keys_reserve = 0
        else:
            self._reserve = len(_npy_header((_BIG, self.width), _element(dtype, True)))
            self._keys_reserve = len(_npy_header((_BIG,), "<i8"))
        self._rows_f.write(b"\0" * self._reserve)
        self._keys_f.write(b"\0" * self._keys_reserve)

    def _open(self, dest: Path) -> tuple[BinaryIO, str]:
        pair = _temp(dest)
        self._files.append(pair)
        return pair

    def write(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Append ``keys`` (int64, ``[n]``) and their ``rows`` (``[n, dim]`` of the dtype, or
        ``[n, row_bytes]`` uint8 raw rows; bfloat16 as its 16-bit patterns; a quantized
        format's stored bytes, ``[n, stored_bytes]`` uint8)."""
        keys = np.ascontiguousarray(keys, dtype="<i8")
        if keys.size == 0:
            return
        raw = np.ascontiguousarray(rows)
        if self.fmt == "npy" and self.dtype == "bfloat16":
            bits = raw.view(np.uint16).reshape(len(keys), self.dim).astype(np.uint32) << 16
            raw = bits.view("<f4")
        self._rows_f.write(raw.data.cast("B"))
        self._keys_f.write(keys.data.cast("B"))
        self.rows += len(keys)

    def commit(self) -> None:
        """Write the headers and rename the files into place (keys first, then the rows)."""
        n = self.rows
        if self.fmt == "safetensors":
            self._keys_f.flush()
            self._keys_f.seek(0)
            shutil.copyfileobj(self._keys_f, self._rows_f, 1 << 22)
            head = _st_header(n, self.dim, self.dtype, self.meta, self._reserve - 8)
        else:
            head = _npy_header((n, self.width), _element(self.dtype, True), self._reserve)
            self._keys_f.seek(0)
            self._keys_f.write(_npy_header((n,), "<i8", self._keys_reserve))
        self._rows_f.seek(0)
        self._rows_f.write(head)
        for f, _ in self._files:
            f.flush()
            os.fsync(f.fileno())
            f.close()
        if self.keys_path is not None:
            os.replace(self._keys_tmp, self.keys_path)
        os.replace(self._rows_tmp, self.path)
        self._done = True
        self.discard()

    def discard(self) -> None:
        """Close and remove every temporary file (nothing is left of an uncommitted write)."""
        for f, name in self._files:
            with contextlib.suppress(OSError):
                f.close()
            with contextlib.suppress(OSError):  # NOTE: a renamed one is gone already
                os.unlink(name)
        self._files = []

    def __enter__(self) -> RowsWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is None:
            try:
                self.commit()
            finally:
                self.discard()
        else:
            self.discard()
