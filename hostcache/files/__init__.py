"""Save a shared table's keys and rows to a ``.safetensors`` file, and restore them.

A file holds the rows as ``weight`` (``[N, dim]``, the table's dtype) and their keys as
``keys`` (``[N]`` int64: a :class:`~hostcache.HostCache`'s cached keys, a
:class:`~hostcache.SharedMemBlock`'s row indices), and in its metadata the table's kind and
geometry (``kind``, ``dim``, ``dtype``, ``capacity``, ``ways``, ``policy``), so a restore
can create the table anew. It is the format ``psclient dump`` writes, so ``psclient load``
reads a saved table too. A quantized table's file holds its stored bytes (uint8, the
format and dim in the metadata), restored bit for bit (:mod:`hostcache.files.saved`);
:func:`load_rows` takes plain rows only.

:func:`save` reads the table chunk by chunk (a cache's rows through its seqlocked lookup,
never a torn row; keys evicted meanwhile are left out) and writes beside the destination,
renamed into place at the end: an error leaves the old file, or none. :func:`restore`
checks the whole file against the table (kind, dim, dtype, rows that fit, no NaN or
infinity) before its first write and then writes chunk by chunk, each write telling every
process's GPU cache to drop the rows as any update does; a table it created is removed
again if the restore fails.

:func:`load_rows` streams the rows of any file ``psclient load`` reads (a ``.safetensors``
tensor, ``.npy``, raw rows, or a ``torch.distributed.checkpoint`` directory) into a
:class:`~hostcache.SharedMemBlock`, row ``i`` of the file to row ``i`` of the block: each
chunk is read with ``preadv`` straight into the block's rows where the file stores them as
the block does (:mod:`psclient.read_into`; rows padded in the block go through one small
reused buffer), so the memory a load adds is that buffer, whatever the table's size. The
NaN/infinity check before the first write reads the file once more through the same
buffer. :func:`restore` of a DCP directory, and of a saved linear table, goes through it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from hostcache import layout, row_versions
from hostcache.cache import HostCache
from hostcache.errors import (
    BadArgumentError,
    GeometryMismatchError,
    NonFiniteValuesError,
    SegmentExistsError,
    SegmentNotFoundError,
)
from hostcache.files.saved import Saved, check_finite, check_fits, nonfinite_scan
from hostcache.memblock import SharedMemBlock
from hostcache.segment import attach as attach_segment
from nvecache.common.finite import nonfinite_rows
from psclient.errors import PSClientError
from psclient.formats import ROWS_NAME, RowsWriter

if TYPE_CHECKING:
    from tqdm import tqdm

    from hostcache.table import SharedTable
    from psclient.read_into import RowReader

#: rows read or written at a time
CHUNK_ROWS = 65536
#: bytes of the one buffer a load reads through where it cannot read into the table's rows
#: (the NaN/infinity check, padded rows): small enough to stay in the CPU's cache
STAGE_BYTES = 1 << 20
_KINDS: dict[str, type[HostCache] | type[SharedMemBlock]] = {"hostcache": HostCache,
                                                             "linear": SharedMemBlock}


def _kind(table: SharedTable) -> str:
    return layout.KIND_NAMES[table.geometry.kind]


def _chunks(table: SharedTable, chunk: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    if isinstance(table, SharedMemBlock):
        rows, versions = table.tensor, table.versions
        for a in range(0, table.num_rows, chunk):
            b = min(table.num_rows, a + chunk)
            idx = torch.arange(a, b, dtype=torch.int64)
            # NOTE: a quantized block's rows read under their versions (never torn by
            # another process's write), as a cache's rows are read seqlocked
            yield idx, (rows[a:b].contiguous() if versions is None
                        else row_versions.read_rows(rows, idx, versions, table.exclusive))
        return
    assert isinstance(table, HostCache)
    held = table._nkeys.copy()  # NOTE: one pass over the key slots; rows read seqlocked
    held = held[held != layout.EMPTY_KEY]
    width = table._codec.width  # NOTE: rows as stored (a quantized cache's: its bytes)
    for a in range(0, held.size, chunk):
        keys = torch.from_numpy(held[a:a + chunk])
        values = torch.empty(keys.numel(), width, dtype=torch.uint8)
        hit = table._read(keys, values, False)
        yield keys[hit], values[hit]


def _plain_only(table: SharedTable, what: str) -> None:
    if table.geometry.row_format.quantized:
        raise BadArgumentError(f"table {table.name!r} is quantized: not {what} yet (restore "
                               "a file `hostcache save` or `psclient dump` wrote of one)")


def _raw(rows: torch.Tensor) -> np.ndarray:
    return rows.contiguous().view(torch.uint8).numpy()


def open_table(name: str) -> SharedTable:
    """Attach the named table with the class of its kind.

    Raises:
        SegmentNotFoundError: no table of that name on this node.
    """
    try:
        mapping, geo = attach_segment(name)
    except SegmentNotFoundError as e:
        raise SegmentNotFoundError(f"no table named {name!r} on this node: `hostcache ls` "
                                   "lists them") from e
    mapping.close()
    return _KINDS[layout.KIND_NAMES[geo.kind]].attach(name)


def save(table: SharedTable | str, path: str | Path, *, chunk: int = CHUNK_ROWS) -> int:
    """Write ``table``'s keys and rows (a handle or a table name) to ``path``, a
    ``.safetensors`` file; returns the rows written.

    Raises:
        SegmentNotFoundError: no table of that name.
        BadArgumentError: ``path`` cannot be written (its folder is missing or read-only,
            the disk is full); nothing is left of the new file.
    """
    if isinstance(table, str):
        with open_table(table) as handle:
            return save(handle, path, chunk=chunk)
    geo = table.geometry
    meta = {"kind": _kind(table), "table": table.name, "dim": str(geo.dim),
            "dtype": geo.dtype_name, "capacity": str(geo.capacity), "ways": str(geo.ways),
            "policy": geo.policy, "written_by": "hostcache save"}
    try:
        with RowsWriter(path, dim=geo.dim, dtype=geo.dtype_name, fmt="safetensors",
                        metadata=meta) as writer:
            for keys, rows in _chunks(table, chunk):
                writer.write(keys.numpy(), _raw(rows))
    except OSError as e:
        raise BadArgumentError(f"cannot write {str(path)!r}: {e.strerror or e}; nothing was "
                               "written: save to a folder that exists and that you can "
                               "write") from None
    except ValueError as e:
        raise BadArgumentError(f"cannot write {str(path)!r}: {e}") from None
    return writer.rows


def _create(saved: Saved, name: str) -> SharedTable:
    meta = saved.meta
    if saved.kind() == "linear":
        rows = int(meta.get("capacity", 0)) or (int(saved.keys.max()) + 1 if saved.n else 1)
        return SharedMemBlock.create(name, num_rows=max(rows, 1), dim=saved.dim,
                                     dtype=saved.dtype)
    ways = int(meta.get("ways", 0)) or 8
    capacity = max(int(meta.get("capacity", 0)), saved.n, 1)
    return HostCache.create(name, capacity=capacity, dim=saved.dim, dtype=saved.dtype,
                            ways=ways, policy=meta.get("policy", "lfu-da"))


def restore(name: str, path: str | Path, *, create: bool = True, chunk: int = CHUNK_ROWS,
            allow_nonfinite: bool = False, tensor: str | None = None,
            progress: bool | None = None) -> SharedTable:
    """Write the rows saved in ``path`` into table ``name``; returns its handle (close it).

    The table is created from the file's geometry where it does not exist (and
    ``create``); an existing one must be of the same kind, dim and dtype, and hold the
    file's rows (a linear table: every saved row index; a cache: the capacity).

    ``path`` may also be a ``torch.distributed.checkpoint`` directory: its 2-D tensor
    ``tensor`` (a fully qualified name; may be left out where it holds one) is restored
    into a linear table of that many rows, row ``i`` to row ``i`` (:func:`load_rows`).
    A saved linear table whose keys are consecutive rows (what ``save`` writes) is streamed
    the same way, read straight into the table's rows; ``progress``: a tqdm bar on stderr
    for those (default: only when stderr is a terminal).

    Raises:
        BadArgumentError: no such file, or not a saved table.
        SegmentNotFoundError: no table ``name`` and not ``create``.
        GeometryMismatchError: the table does not fit the file; nothing was written.
        NonFiniteValuesError: a saved row holds NaN or an infinity and not
            ``allow_nonfinite`` (every row is read once before the first write); nothing
            was written.
    """
    if Path(path).is_dir():
        return _restore_dir(name, Path(path), create=create, chunk=chunk,
                            allow_nonfinite=allow_nonfinite, tensor=tensor, progress=progress)
    saved = Saved(Path(path))
    if saved.kind() not in _KINDS:
        raise BadArgumentError(f"{saved.what} is of table kind {saved.kind()!r}: a saved "
                               f"table is one of {', '.join(_KINDS)}")
    with _opened_or_created(name, create, lambda: _create(saved, name)) as table:
        check_fits(saved, table, name)
        first = _consecutive(saved.keys, chunk)
        if isinstance(table, SharedMemBlock) and first is not None and not saved.stored:
            _restore_span(table, saved, Path(path), first, chunk=chunk,
                          allow_nonfinite=allow_nonfinite, progress=progress)
            return table
        if not allow_nonfinite or saved.stored:
            check_finite(saved, chunk)
        for a in range(0, saved.n, chunk):
            b = min(saved.n, a + chunk)
            keys, rows = saved.keys[a:b], saved.rows[a:b]
            if isinstance(table, SharedMemBlock):  # NOTE: consecutive keys: one copy
                table.write(keys, rows, allow_nonfinite=True)  # NOTE: checked above, or allowed
            else:
                assert isinstance(table, HostCache)
                table.insert(keys, rows, allow_nonfinite=allow_nonfinite)
    return table


def _consecutive(keys: torch.Tensor, chunk: int) -> int | None:
    """The first of ``keys`` where they are ``k, k+1, ...`` (compared a chunk at a time),
    else None."""
    n = keys.numel()
    if n == 0:
        return None
    k0 = int(keys[0])
    if int(keys[-1]) - k0 != n - 1:
        return None
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        if not torch.equal(keys[a:b], torch.arange(k0 + a, k0 + b, dtype=torch.int64)):
            return None
    return k0


def _restore_span(block: SharedMemBlock, saved: Saved, path: Path, first: int, *,
                  chunk: int, allow_nonfinite: bool, progress: bool | None) -> None:
    """A saved linear table's rows (keys ``first, first+1, ...``) streamed into ``block``."""
    rows = _open_source(path, ROWS_NAME, "safetensors")

    def refuse(bad: int, at: int) -> BaseException:
        return NonFiniteValuesError(
            f"{saved.what}: {bad} of {saved.n} rows hold NaN or infinite values (the first: "
            f"key {first + at}); nothing was written: fix the file, or restore it anyway "
            "with allow_nonfinite=True (--allow-nonfinite)")

    _stream(block, rows, first, chunk=chunk, check=not allow_nonfinite, progress=progress,
            refuse=refuse)


@contextlib.contextmanager
def _opened_or_created(name: str, create: bool, make: Callable[[], SharedTable]
                       ) -> Iterator[SharedTable]:
    """Table ``name`` opened, or made by ``make()`` where there is none and ``create``; on
    an error inside the block, closed, and removed again if it was made here."""
    created = False
    try:
        table = open_table(name)
    except SegmentNotFoundError:
        if not create:
            raise
        try:
            table = make()
        except SegmentExistsError:  # NOTE: created by another process meanwhile
            table = open_table(name)
        else:
            created = True
    try:
        yield table
    except BaseException:
        table.close()
        if created:
            with contextlib.suppress(SegmentNotFoundError):
                SharedMemBlock.unlink(name)
        raise


def _open_source(path: str | Path, tensor: str | None, fmt: str | None,
                 dim: int | None = None, dtype: torch.dtype | None = None) -> RowReader:
    """``psclient``'s reader of a rows file; its errors raised as this package's."""
    from psclient.read_into import open_reader

    try:
        return open_reader(path, tensor, format=fmt, dim=dim, dtype=dtype)
    except PSClientError as e:
        raise BadArgumentError(str(e)) from None


def _stage(rows: RowReader, chunk: int) -> torch.Tensor:
    """The one buffer a load reads through: ``STAGE_BYTES`` of rows (at most ``chunk``)."""
    row_bytes = max(1, rows.dim * rows.dtype.itemsize)
    m = max(1, min(chunk, rows.n, STAGE_BYTES // row_bytes))
    return torch.empty(m, rows.dim, dtype=rows.dtype)


def _scan(rows: RowReader, stage: torch.Tensor, chunk: int, bar: tqdm) -> tuple[int, int]:
    """:func:`_nonfinite_scan` of every row of ``rows``: ``chunk`` rows at a time over a
    mapping of just them (no copy; unmapped before the next), else read through ``stage``."""
    def read(a: int, b: int) -> torch.Tensor:
        rows.read_into(a, stage[:b - a])
        return stage[:b - a]

    def mapped(a: int, b: int) -> torch.Tensor:
        view = rows.mapped(a, b)
        return view if view is not None else _nonfinite_scan_staged(read, a, b, stage)

    if rows.mapped(0, min(rows.n, 1)) is None:
        return nonfinite_scan(read, rows.n, stage.shape[0], bar)
    return nonfinite_scan(mapped, rows.n, chunk, bar)


def _nonfinite_scan_staged(read: Callable[[int, int], torch.Tensor], a: int, b: int,
                           stage: torch.Tensor) -> torch.Tensor:
    """Rows ``a..b`` that no one mapping holds (a piece boundary): a tensor flagging the
    rows of the span that hold NaN or an infinity as NaN rows, read through ``stage``."""
    out = torch.zeros(b - a, 1, dtype=stage.dtype)
    for i in range(a, b, stage.shape[0]):  # NOTE: per stage of rows, not per row
        j = min(b, i + stage.shape[0])
        bad = nonfinite_rows(read(i, j))
        if bad is not None:
            out[i - a:j - a][bad] = float("nan")
    return out


def _fill(block: SharedMemBlock, rows: RowReader, start: int, chunk: int,
          stage: torch.Tensor, bar: tqdm) -> None:
    """Rows ``0..n-1`` of ``rows`` to rows ``start..`` of ``block``, ``chunk`` rows a write,
    read straight into the block's rows (through ``stage`` where they are padded)."""
    for a in range(0, rows.n, chunk):
        b = min(rows.n, a + chunk)
        block.fill_range(start + a, b - a,
                         lambda i, out, a=a: rows.read_into(a + i, out),  # type: ignore[misc]
                         stage=stage)
        bar.update(b - a)


def _bar(n: int, desc: str, progress: bool | None) -> tqdm:
    from tqdm import tqdm

    return tqdm(total=n, unit="rows", unit_scale=True, desc=desc,
                disable=None if progress is None else not progress)


def _stream(block: SharedMemBlock, rows: RowReader, start: int, *, chunk: int, check: bool,
            progress: bool | None, refuse: Callable[[int, int], BaseException]) -> None:
    """Every row of ``rows`` into ``block`` from row ``start``; if ``check``, every row is
    read once first and ``refuse(bad, first)`` raised where any holds NaN or an infinity."""
    stage = _stage(rows, chunk)
    with _bar(rows.n, f"check {block.name}" if check else f"load {block.name}",
              progress) as bar:
        if check:
            bad, first = _scan(rows, stage, chunk, bar)
            if bad:
                raise refuse(bad, first)
            bar.reset(total=rows.n)
            bar.set_description(f"load {block.name}")
        _fill(block, rows, start, chunk, stage, bar)


def load_rows(block: SharedMemBlock, path: str | Path, *, tensor: str | None = None,
              format: str | None = None, chunk: int = CHUNK_ROWS,  # noqa: A002
              allow_nonfinite: bool = False, progress: bool | None = None) -> int:
    """Write the rows of a file into ``block``, row ``i`` of the file to row ``i``, ``chunk``
    rows a write, each read straight into the block's rows; returns the rows written.

    The memory a load adds is one buffer of ``STAGE_BYTES`` (at most ``chunk`` rows),
    whatever the file's size: the rows are read with ``preadv`` into the block (rows the
    block pads, and the NaN/infinity check, go through the buffer).

    Args:
        block: the linear table to write (its first rows; the rest are left as they are).
        path: a ``.safetensors`` / ``.npy`` file, raw rows (``.bin``/``.raw``, of the
            block's dim and dtype), or a ``torch.distributed.checkpoint`` directory.
        tensor: the tensor of a ``.safetensors`` file or DCP checkpoint (optional where
            there is one).
        format: ``npy``, ``safetensors``, ``raw`` or ``dcp``; default: by the name.
        chunk: rows written at a time (each under the block's writer lock, announced to
            every process's GPU cache).
        allow_nonfinite: write rows holding NaN or infinite values too; else every row is
            read once before the first write and such rows are refused.
        progress: a tqdm progress bar on stderr; default: only when stderr is a terminal.

    Raises:
        BadArgumentError: no such file, not a readable source, a file shorter than its
            header says (truncated), or a bad ``chunk``; nothing was written. A file
            truncated while it is being read stops the load there with this error (the rows
            written so far stay, announced).
        GeometryMismatchError: the rows are of another dim or dtype, or more than the
            block holds; nothing was written.
        NonFiniteValuesError: a row holds NaN or an infinity; nothing was written.
    """
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0:
        raise BadArgumentError(f"chunk must be a positive int, got {chunk!r}")
    _plain_only(block, "loaded from rows of a file")
    rows = _open_source(path, tensor, format, block.dim, block.dtype)
    if rows.dim != block.dim or rows.dtype != block.dtype or rows.n > block.num_rows:
        raise GeometryMismatchError(
            f"{rows.what} holds {rows.n} rows of dim {rows.dim}, "
            f"{str(rows.dtype).removeprefix('torch.')}; table {block.name!r} holds "
            f"{block.num_rows} rows of dim {block.dim}, {block.geometry.dtype_name}: load it "
            "into a table of that geometry")

    def refuse(bad: int, first: int) -> BaseException:
        return NonFiniteValuesError(
            f"{rows.what}: {bad} of {rows.n} rows hold NaN or infinite values (the "
            f"first: row {first}); nothing was written: fix the file, or load it anyway "
            "with allow_nonfinite=True")

    _stream(block, rows, 0, chunk=chunk, check=not allow_nonfinite, progress=progress,
            refuse=refuse)
    return rows.n


def _restore_dir(name: str, path: Path, *, create: bool, chunk: int, allow_nonfinite: bool,
                 tensor: str | None, progress: bool | None) -> SharedTable:
    rows = _open_source(path, tensor, "dcp")
    def make() -> SharedTable:
        return SharedMemBlock.create(name, num_rows=max(rows.n, 1), dim=rows.dim,
                                     dtype=rows.dtype)

    with _opened_or_created(name, create, make) as table:
        if not isinstance(table, SharedMemBlock):
            raise GeometryMismatchError(
                f"table {name!r} is a {_kind(table)} table; a DCP checkpoint's rows restore "
                "into a linear table: restore into another name (it is created)")
        load_rows(table, path, tensor=tensor, format="dcp", chunk=chunk,
                  allow_nonfinite=allow_nonfinite, progress=progress)
    return table
