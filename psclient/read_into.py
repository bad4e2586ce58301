"""Rows of a file read straight into a tensor the caller gives, a chunk at a time.

:func:`open_reader` opens what :func:`psclient.loader.open_rows` opens (a ``.safetensors``
tensor, ``.npy``, raw rows, a ``torch.distributed.checkpoint`` directory), with the same
checks and messages, and returns a :class:`RowReader`: ``read_into(a, out)`` fills ``out``
(a contiguous CPU ``[m, dim]`` tensor of the rows' dtype, such as a shared table's own
rows) with rows ``a..a+m-1``. Where the file stores the rows back to back as they are in
memory (a safetensors tensor, a C-ordered native-endian ``.npy``, raw rows, a DCP piece of
whole rows) the bytes go there with ``preadv``: no mapping of the file, no buffer of their
size, nothing allocated per chunk. Other layouts (a byte-swapped or Fortran-ordered
``.npy``, a DCP column shard) are copied in from the source's own chunk.

Every file is checked to hold the bytes its header names when it is opened, so a
truncated file is refused before any row is read.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from psclient.errors import BadArgumentError

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw_bytes(out: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor, as a writable 1-D uint8 array on its memory."""
    if out.device.type != "cpu" or not out.is_contiguous():
        raise BadArgumentError("rows are read into a contiguous CPU tensor; got one on "
                               f"{out.device} with strides {out.stride()}")
    return out.reshape(-1).view(_INT_OF_SIZE[out.element_size()]).numpy().view(np.uint8)


def pread_exact(path: Path, offset: int, dest: np.ndarray, what: str) -> None:
    """Bytes ``offset..offset+len(dest)`` of ``path`` into ``dest`` (uint8, writable), with
    ``preadv`` (a short read continues where it stopped).

    Raises:
        BadArgumentError: the file ends before the last byte (truncated meanwhile).
    """
    view = memoryview(dest)
    want = len(view)
    fd = os.open(path, os.O_RDONLY)
    try:
        got = 0
        while got < want:
            step = os.preadv(fd, [view[got:]], offset + got)
            if step <= 0:
                raise BadArgumentError(f"{what}: {str(path)!r} ends at byte {offset + got}, "
                                       f"before its rows end at {offset + want}: the file was "
                                       "truncated; write it again")
            got += step
    finally:
        os.close(fd)


#: where rows ``a..b`` lie as they are in memory: (file, byte offset), or None
Locate = Callable[[int, int], "tuple[Path, int] | None"]


def map_rows(path: Path, offset: int, n: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """``n`` rows at byte ``offset`` of ``path`` as a tensor over a private mapping of just
    those bytes (nothing copied; the mapping goes when the tensor does)."""
    gran = mmap.ALLOCATIONGRANULARITY
    base = offset - offset % gran
    nbytes = n * dim * dtype.itemsize
    with path.open("rb") as f:
        mm = mmap.mmap(f.fileno(), offset + nbytes - base, access=mmap.ACCESS_COPY,
                       offset=base)
    return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset - base
                            ).view(dtype).view(n, dim)


class RowReader:
    """Rows of a 2-D source: ``n`` rows of ``dim`` x ``dtype``, read into given tensors."""

    def __init__(self, n: int, dim: int, dtype: torch.dtype,
                 read_into: Callable[[int, torch.Tensor], None], what: str,
                 direct: bool, locate: Locate | None = None) -> None:
        #: rows, elements per row, row dtype
        self.n, self.dim, self.dtype = n, dim, dtype
        #: ``read_into(a, out)``: rows ``a..a+len(out)-1`` into ``out`` (contiguous, CPU)
        self.read_into = read_into
        #: how messages name the source
        self.what = what
        #: whether the bytes are read straight into ``out`` (else copied from a chunk)
        self.direct = direct
        self._locate = locate

    def mapped(self, a: int, b: int) -> torch.Tensor | None:
        """Rows ``a..b-1`` over a private mapping of the file (:func:`map_rows`: a read of
        them once, with no copy) where they lie in the file as in memory, else None."""
        at = self._locate(a, b) if self._locate is not None and b > a else None
        return None if at is None else map_rows(at[0], at[1], b - a, self.dim, self.dtype)

    def get(self, a: int, b: int) -> torch.Tensor:
        """Rows ``a..b-1`` as a new contiguous tensor."""
        out = torch.empty(max(0, b - a), self.dim, dtype=self.dtype)
        self.read_into(a, out)
        return out


def _at_offset(path: Path, start: int, row_bytes: int, what: str
               ) -> Callable[[int, torch.Tensor], None]:
    def read_into(a: int, out: torch.Tensor) -> None:
        if out.shape[0]:
            pread_exact(path, start + a * row_bytes, raw_bytes(out), what)

    return read_into


def _safetensors_start(path: Path, tensor: str | None, n: int, row_bytes: int,
                       what: str) -> int:
    """Where the rows of the tensor ``open_rows`` picked begin in the file (the same
    pick: the named one, the only one, or the one beside ``keys``)."""
    from psclient.loader import KEYS_TENSOR

    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        head = json.loads(f.read(size))
    names = [k for k in head if k != "__metadata__"]
    if tensor is None:
        rows = [k for k in names if k != KEYS_TENSOR]
        tensor = rows[0] if len(rows) == 1 else names[0]
    begin, end = (int(x) for x in head[tensor]["data_offsets"])
    start = 8 + size + begin
    if end - begin != n * row_bytes or start + n * row_bytes > path.stat().st_size:
        raise BadArgumentError(f"{what}: the file ends before its rows do (or its header "
                               "is damaged): the file was truncated; write it again")
    return start


def _npy_start(path: Path) -> tuple[int, bool]:
    """Where a ``.npy`` file's data begin, and whether its rows are C-ordered native bytes."""
    with path.open("rb") as f:
        version = np.lib.format.read_magic(f)
        dt: np.dtype
        if version == (1, 0):
            _, fortran, dt = np.lib.format.read_array_header_1_0(f)
        else:
            _, fortran, dt = np.lib.format.read_array_header_2_0(f)
        return f.tell(), not fortran and dt.isnative


def open_reader(source: str | Path, tensor: str | None = None, *,
                format: str | None = None,  # noqa: A002
                dim: int | None = None, dtype: torch.dtype | None = None,
                cli: bool = False) -> RowReader:
    """Open a rows file as :func:`psclient.loader.open_rows` does (the same arguments,
    checks and errors), to be read with :meth:`RowReader.read_into`.

    Raises:
        BadArgumentError: no such file, an unknown format, an unreadable or truncated file.
        BadValuesError: the rows are not 2-D, or a raw file is not whole rows.
    """
    from psclient.dcp_source import open_dcp_reader
    from psclient.loader import file_format, open_rows

    path = Path(source)
    if format == "dcp" or (format is None and path.is_dir()):
        n, width, dt, read_into, locate, what = open_dcp_reader(path, tensor, cli=cli)
        return RowReader(n, width, dt, read_into, what, direct=True, locate=locate)
    rows = open_rows(path, tensor, format=format, dim=dim, dtype=dtype, cli=cli)
    fmt = file_format(path, format, cli=cli)
    row_bytes = rows.dim * rows.dtype.itemsize
    start: int | None = None
    if fmt == "safetensors":
        start = _safetensors_start(path, tensor, rows.n, row_bytes, rows.what)
    elif fmt == "npy":
        at, packed = _npy_start(path)
        start = at if packed else None
    elif fmt == "raw":
        start = 0
    if start is None:
        def copied(a: int, out: torch.Tensor) -> None:
            out.copy_(rows.get(a, a + out.shape[0]))

        return RowReader(rows.n, rows.dim, rows.dtype, copied, rows.what, direct=False)
    at = start
    return RowReader(rows.n, rows.dim, rows.dtype, _at_offset(path, at, row_bytes, rows.what),
                     rows.what, direct=True, locate=lambda a, b: (path, at + a * row_bytes))
