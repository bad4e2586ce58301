"""Rows of a ``torch.distributed.checkpoint`` (DCP) directory, read chunk by chunk.

A DCP directory holds a ``.metadata`` file (read with DCP's own
:class:`~torch.distributed.checkpoint.FileSystemReader`) and storage files; the metadata
names every tensor by its fully qualified name (``emb.weight``), its global shape and
dtype, and the stored pieces (one per rank's shard, each at an offset of the tensor) with
the storage file, byte offset and length of each.

DCP's own load reads a stored piece whole before it copies the part asked for, so a table
saved from one process would be read into memory at once. Here each piece is opened
instead: a piece written by ``torch.save`` (DCP's default) is a zip archive whose one
storage record holds the piece's bytes uncompressed; its shape, strides and storage offset
come from ``torch.load(..., map_location="meta")`` (no bytes read), the record's place
from the archive's directory, and the rows are then memory-mapped. A piece of raw bytes
(the safetensors serialization) is mapped as it is. Every piece's bytes are checked to lie
inside its storage file when the tensor is opened, so a truncated checkpoint is refused
before anything is read. Rows ``a..b`` are assembled from the pieces that hold them, into
a tensor the caller gives (:func:`open_dcp_reader`: a shared table's rows themselves) or a
new one (:func:`open_dcp`), so memory is bounded by the rows asked for: a piece of whole
rows stored back to back (a row shard, or a table saved from one process) is read with
``preadv`` straight into the destination; other pieces (column shards, a transposed
tensor) are copied from the mapping.

Pieces written through a storage transform (compression and other DCP extensions) are
refused with a message that says to save the checkpoint without them.
"""

from __future__ import annotations

import io
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from psclient.errors import BadArgumentError, BadValuesError
from psclient.read_into import pread_exact, raw_bytes

#: the file that makes a directory a DCP checkpoint
METADATA_FILE = ".metadata"
_ZIP_MAGIC = b"PK\x03\x04"
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # a zip local file header (30 bytes)


def _arg(cli: bool, api: str, flag: str) -> str:
    return flag if cli else api


def is_dcp_dir(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding a DCP checkpoint's ``.metadata``."""
    p = Path(path)
    return p.is_dir() and (p / METADATA_FILE).is_file()


class _Slice(io.RawIOBase):
    """Bytes ``offset..offset+length`` of a file, as a seekable file of their own."""

    def __init__(self, f: IO[bytes], offset: int, length: int) -> None:
        self._f, self._off, self._len, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._len}[whence]
        self._pos = max(0, min(self._len, base + pos))
        return self._pos

    def readinto(self, buf: Any) -> int:
        n = max(0, min(len(buf), self._len - self._pos))
        self._f.seek(self._off + self._pos)
        got = self._f.readinto(memoryview(buf)[:n]) or 0  # type: ignore[attr-defined]
        self._pos += got
        return got


def _piece(path: Path, offset: int, length: int, dtype: torch.dtype, sizes: list[int],
           what: str) -> tuple[np.ndarray, int | None]:
    """A stored piece of ``sizes`` x ``dtype``, memory-mapped (no bytes read), and the byte
    offset of its first row where its rows lie back to back (else None)."""
    itemsize = dtype.itemsize
    nbytes = itemsize * int(np.prod(sizes)) if sizes else itemsize
    np_dt = _raw(dtype)
    size = path.stat().st_size
    if offset + length > size:
        raise BadArgumentError(f"{what}: a stored piece cannot be read: storage file "
                               f"{str(path)!r} ends at byte {size}, before the piece's bytes "
                               f"{offset}..{offset + length}: the checkpoint is truncated "
                               "(copy it again)")
    with path.open("rb") as f:
        f.seek(offset)
        head = f.read(4)
        if head != _ZIP_MAGIC:
            if length != nbytes:
                raise BadArgumentError(
                    f"{what}: a stored piece of {length} bytes is neither a torch.save record nor "
                    f"{nbytes} raw bytes: save the checkpoint with DCP's FileSystemWriter")
            return np.memmap(path, dtype=np_dt, mode="r", offset=offset,
                             shape=tuple(sizes)), offset
        try:
            meta = torch.load(io.BufferedReader(_Slice(f, offset, length)),
                              map_location="meta", weights_only=True)
            with zipfile.ZipFile(io.BufferedReader(_Slice(f, offset, length))) as z:
                records = [i for i in z.infolist() if "/data/" in i.filename]
            if (not isinstance(meta, torch.Tensor) or len(records) != 1
                    or records[0].compress_type != zipfile.ZIP_STORED):
                raise ValueError("not one tensor over one stored record")
            info = records[0]
            f.seek(offset + info.header_offset)
            fields = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
        except (RuntimeError, ValueError, zipfile.BadZipFile, struct.error, OSError) as e:
            raise BadArgumentError(f"{what}: a stored piece cannot be read ({e}): the "
                                   "checkpoint is damaged, or not written by DCP") from e
    start = offset + info.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]
    if (meta.dtype != dtype or list(meta.shape) != list(sizes)
            or info.file_size < (meta.storage_offset() + 1) * itemsize
            or start + info.file_size > offset + length):
        raise BadArgumentError(f"{what}: a stored piece holds {list(meta.shape)} "
                               f"{meta.dtype}, the metadata says {list(sizes)} {dtype}: the "
                               "checkpoint is damaged")
    flat = np.memmap(path, dtype=np_dt, mode="r", offset=start,
                     shape=(info.file_size // itemsize,))
    view = np.lib.stride_tricks.as_strided(
        flat[meta.storage_offset():], shape=tuple(sizes),
        strides=tuple(s * itemsize for s in meta.stride()), writeable=False)
    packed = meta.is_contiguous()
    return view, start + meta.storage_offset() * itemsize if packed else None


def _raw(dtype: torch.dtype) -> np.dtype:
    """The unsigned integer of ``dtype``'s width: elements are moved as bits, viewed as
    ``dtype`` once read."""
    if dtype.itemsize not in (1, 2, 4, 8):
        raise BadValuesError(f"rows of {dtype} cannot be loaded")
    return np.dtype(f"<u{dtype.itemsize}")


def _candidates(md: Any) -> list[str]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return [k for k, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata) and len(v.size) == 2]


def open_dcp(path: str | Path, tensor: str | None, *, cli: bool = False
             ) -> tuple[int, int, torch.dtype, Callable[[int, int], torch.Tensor], str]:
    """Open the 2-D tensor ``tensor`` (its fully qualified name, e.g. ``emb.weight``; may be
    left out where the checkpoint holds one 2-D tensor) of the DCP checkpoint at ``path``.

    Returns:
        ``(rows, dim, dtype, get, what)``: ``get(a, b)`` reads rows ``a..b-1`` as a
        contiguous CPU tensor; ``what`` names the tensor in messages.

    Raises:
        BadArgumentError: ``path`` is not a DCP checkpoint directory, it has no tensor of
            that name (or several 2-D tensors and none named), or its pieces cannot be read
            (damaged, or a storage file shorter than the metadata says).
        BadValuesError: the named tensor is not 2-D.
    """
    n, dim, dtype, read_into, _, what = open_dcp_reader(path, tensor, cli=cli)

    def get(a: int, b: int) -> torch.Tensor:
        out = torch.empty(max(0, b - a), dim, dtype=dtype)
        read_into(a, out)
        return out

    return n, dim, dtype, get, what


def open_dcp_reader(path: str | Path, tensor: str | None, *, cli: bool = False
                    ) -> tuple[int, int, torch.dtype, Callable[[int, torch.Tensor], None],
                               Callable[[int, int], tuple[Path, int] | None], str]:
    """:func:`open_dcp`, with ``read_into(a, out)`` in place of ``get``: it reads rows
    ``a..a+len(out)-1`` into ``out`` (a contiguous CPU ``[m, dim]`` tensor of the dtype,
    e.g. a shared table's rows), allocating nothing of their size; and ``locate(a, b)``:
    the storage file and byte offset of rows ``a..b-1`` where one piece holds them back to
    back, else None. Returns ``(rows, dim, dtype, read_into, locate, what)``.

    Raises:
        As :func:`open_dcp`; ``read_into`` raises BadArgumentError where a storage file ends
        early (it was truncated after the tensor was opened).
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    root = Path(path)
    if root.is_file():
        raise BadArgumentError(
            f"{str(root)!r} is a file, not a DCP checkpoint directory: give the folder "
            "torch.distributed.checkpoint.save wrote")
    if not is_dcp_dir(root):
        raise BadArgumentError(
            f"{str(root)!r} is not a DCP checkpoint directory (no {METADATA_FILE} file in it): "
            "give the folder torch.distributed.checkpoint.save wrote")
    try:
        md = FileSystemReader(str(root)).read_metadata()
    except Exception as e:  # noqa: BLE001 -- DCP raises anything an unpickle can
        raise BadArgumentError(f"{str(root)!r}: its {METADATA_FILE} cannot be read ({e}): "
                               "the checkpoint is damaged or from another torch") from e
    tensors = _candidates(md)
    flag = _arg(cli, "tensor=NAME", "--tensor NAME")
    if tensor is None:
        if len(tensors) != 1:
            some = ", ".join(tensors[:8]) + (", ..." if len(tensors) > 8 else "")
            raise BadArgumentError(
                f"{str(root)!r} holds {len(tensors)} 2-D tensors"
                + (f" ({some})" if tensors else "")
                + (f": name one with {flag}" if tensors else ": there are no rows to load"))
        tensor = tensors[0]
    entry = md.state_dict_metadata.get(tensor)
    what = f"tensor {tensor!r} of DCP checkpoint {str(root)!r}"
    if not isinstance(entry, TensorStorageMetadata):
        some = ", ".join(tensors[:8]) + (", ..." if len(tensors) > 8 else "")
        raise BadArgumentError(f"DCP checkpoint {str(root)!r} has no tensor {tensor!r}; its "
                               f"2-D tensors: {some or 'none'}")
    if len(entry.size) != 2:
        raise BadValuesError(f"{what} is {list(entry.size)}, need [N, dim]")
    n, dim = int(entry.size[0]), int(entry.size[1])
    dtype = entry.properties.dtype
    pieces: list[tuple[int, int, int, int, np.ndarray, Path, int | None]] = []
    covered = 0
    for chunk in entry.chunks:
        info = md.storage_data.get(MetadataIndex(tensor, chunk.offsets))
        if info is None:
            raise BadArgumentError(f"{what}: the metadata lists a piece at {list(chunk.offsets)} "
                                   "with no storage: the checkpoint is damaged")
        if getattr(info, "transform_descriptors", None):
            raise BadArgumentError(
                f"{what} is stored through {list(info.transform_descriptors)}: save the "
                "checkpoint without storage extensions (FileSystemWriter's default) to load it")
        r0, c0 = int(chunk.offsets[0]), int(chunk.offsets[1])
        rows, cols = int(chunk.sizes[0]), int(chunk.sizes[1])
        covered += rows * cols
        file = root / info.relative_path
        arr, start = _piece(file, int(info.offset), int(info.length), dtype, [rows, cols], what)
        whole = start if (c0, cols) == (0, dim) else None  # NOTE: whole rows: read in place
        pieces.append((r0, r0 + rows, c0, c0 + cols, arr, file, whole))
    if covered != n * dim:
        raise BadArgumentError(f"{what}: its stored pieces hold {covered} of {n * dim} "
                               "elements: the checkpoint is incomplete")
    pieces.sort(key=lambda p: (p[0], p[2]))
    starts = np.array([p[0] for p in pieces], dtype=np.int64)
    v = _raw(dtype)
    row_bytes = dim * dtype.itemsize

    def read_into(a: int, out: torch.Tensor) -> None:
        b = a + out.shape[0]
        flat = raw_bytes(out)
        dest = flat.view(v).reshape(out.shape[0], dim)
        last = int(np.searchsorted(starts, b, side="left"))
        for r0, r1, c0, c1, arr, file, whole in pieces[:last]:  # NOTE: per piece, not per row
            lo, hi = max(a, r0), min(b, r1)
            if lo >= hi:
                continue
            if whole is None:
                dest[lo - a:hi - a, c0:c1] = arr[lo - r0:hi - r0]
                continue
            # NOTE: rows back to back: read into the destination (no mapping of the file)
            pread_exact(file, whole + (lo - r0) * row_bytes,
                        flat[(lo - a) * row_bytes:(hi - a) * row_bytes], what)

    def locate(a: int, b: int) -> tuple[Path, int] | None:
        at = int(np.searchsorted(starts, a, side="right")) - 1
        if at < 0:
            return None
        r0, r1, _, _, _, file, whole = pieces[at]
        if whole is None or b > r1:
            return None
        return file, whole + (a - r0) * row_bytes

    return n, dim, dtype, read_into, locate, what
