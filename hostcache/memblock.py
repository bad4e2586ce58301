"""``SharedMemBlock``: a linear embedding table in POSIX shared memory.

The seed's "linear table": row ``i`` at ``rows_off + i * row_stride``, shared by every
process of the node, for the LinearUVM layer type (each process registers it with CUDA and
its GPU kernels gather rows by index). Writes made through :meth:`write` (and
:meth:`accumulate`) append the row indices to the table's invalidation ring, so every
process's GPU cache drops them; writes made straight into :attr:`tensor` are invisible to
those caches (call :meth:`write`, or :meth:`invalidate` after writing, as the seed's
read-after-write section says).

A table may store its rows quantized (``dtype=torch.int8``: row-wise int8 with a float32
scale and bias; ``torch.float8_e4m3fn``: fp8 with a float32 scale;
:mod:`nvecache.common.quant`): its writes take float rows and quantize them, its reads
return them dequantized as float32 (its writes also take its stored bytes as they are),
and :attr:`tensor` is then each row's stored bytes. Its rows carry seqlock versions
(:mod:`hostcache.row_versions`): its writes and reads, and the layers' kernels, never
decode one write's payload with another write's scale or bias, whichever process wrote.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, Self

import torch

from hostcache import layout, row_versions
from hostcache.errors import BadArgumentError, NonFiniteValuesError
from hostcache.gate import TableGate, gate_for
from hostcache.row_bytes import RowBytes
from hostcache.segment import Mapping, check_mode
from hostcache.table import C_HITS, C_LOOKUPS, C_UPDATES, SharedTable
from hostcache.table_files import TableFiles
from hostcache.validate import check_indices, check_keys, dedup_last
from nvecache.common.accumulate import add_at, check_deltas, sum_duplicates
from nvecache.common.rows import RowFormat


def _check_span(start: object, n: int, num_rows: int) -> int:
    """``start`` as the first of ``n`` rows that all fit in ``[0, num_rows)``."""
    try:
        if isinstance(start, bool):
            raise TypeError
        start = operator.index(start)  # type: ignore[arg-type]
    except TypeError:
        raise BadArgumentError(f"start must be an int (the first row written); got "
                               f"{type(start).__name__}") from None
    if start < 0 or start + n > num_rows:
        raise BadArgumentError(f"rows {start}..{start + n - 1} do not fit: indices must be in "
                               f"[0, {num_rows}); write at most {max(0, num_rows - start)} "
                               "rows from there")
    return start


def _span(first: int, n: int) -> torch.Tensor:
    return torch.arange(first, first + n, dtype=torch.int64)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of two CPU tensors overlap."""
    def span(t: torch.Tensor) -> tuple[int, int]:
        extent = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
        return t.data_ptr(), t.data_ptr() + (extent + 1) * t.element_size()

    if a.numel() == 0 or b.numel() == 0:
        return False
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


class SharedMemBlock(TableFiles, SharedTable):
    """A ``[num_rows, dim]`` table every process of the node maps."""

    KIND = layout.KIND_LINEAR

    @classmethod
    def create(
        cls,
        name: str,
        *,
        num_rows: int,
        dim: int,
        dtype: torch.dtype = torch.float32,
        ring_capacity: int = layout.DEFAULT_RING_CAPACITY,
        mode: int = 0o600,
        overcommit: bool = False,
    ) -> Self:
        """Create the named linear table (rows start zeroed; a quantized one's read as
        zeros too).

        ``dtype``: a plain dtype, or a quantized format (``torch.int8``,
        ``torch.float8_e4m3fn``), recorded in the table's header.

        ``overcommit=True`` creates it even if it is larger than the free space of
        ``/dev/shm`` (the segment is sparse; writing past the free space kills the writer).

        Raises:
            SegmentExistsError: a table of that name exists.
            BadArgumentError: an argument is out of range.
            SharedMemoryFullError: ``/dev/shm`` has no room for it (and not ``overcommit``).
        """
        check_mode(mode)
        geo = layout.plan(
            layout.KIND_LINEAR, capacity=num_rows, dim=dim, dtype=dtype,
            ring_capacity=ring_capacity)
        return cls._create_segment(name, geo, mode, overcommit)

    @classmethod
    def attach(
        cls,
        name: str,
        *,
        num_rows: int | None = None,
        dim: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> Self:
        """Attach the named linear table; geometry comes from its header (a given
        ``dtype`` other than the one it records, a quantized format included, is a
        ``GeometryMismatchError``)."""
        return cls._attach_segment(name, capacity=num_rows, dim=dim, dtype=dtype)

    def _map_views(self, mapping: Mapping, geo: layout.Geometry) -> None:
        raw = mapping.tensor(geo.rows_off, geo.capacity * geo.row_stride, torch.uint8)
        fmt = geo.row_format
        #: the rows between torch and their stored bytes (a quantized table's encoded)
        self._codec = RowBytes(fmt)
        stored = raw.view(geo.capacity, geo.row_stride)
        self._rows = (stored[:, :fmt.stored_bytes] if fmt.quantized
                      else stored[:, : geo.row_bytes].view(geo.dtype))
        #: a quantized table's per-row seqlock versions, the 4 bytes after each row's
        #: stored bytes (None: a plain table)
        self._versions = (row_versions.versions_in(stored, fmt.stored_bytes)
                          if geo.row_versions else None)

    def _drop_views(self) -> None:
        self._rows = torch.empty(0)
        self._versions = None

    @property
    def num_rows(self) -> int:
        """Rows of the table."""
        return self.geometry.capacity

    @property
    def dim(self) -> int:
        """Elements per row."""
        return self.geometry.dim

    @property
    def dtype(self) -> torch.dtype:
        """Element type of the rows (a quantized table's: its format's, ``torch.int8`` or
        ``torch.float8_e4m3fn``)."""
        return self.geometry.dtype

    @property
    def row_format(self) -> RowFormat:
        """How a row is stored (its format, bytes and stride): what a kernel reading
        :attr:`tensor` is told."""
        return self.geometry.row_format

    @property
    def quantized(self) -> bool:
        """Whether the rows are stored quantized (reads dequantize them)."""
        return self.geometry.row_format.quantized

    @property
    def read_format(self) -> RowFormat:
        """The row format a kernel reading :attr:`tensor` is told: of a quantized table, a
        :class:`~hostcache.row_versions.VersionedFormat` (its rows read under their seqlock
        versions, which follow each row's stored bytes)."""
        fmt = self.geometry.row_format
        return row_versions.VersionedFormat.of(fmt, self._writing) if fmt.quantized else fmt

    @property
    def versions(self) -> torch.Tensor | None:
        """int32 ``[num_rows]`` seqlock versions of a quantized table's rows (even: stable,
        odd: being written; :mod:`hostcache.row_versions`), None for a plain table."""
        self._live()
        return self._versions

    @property
    def tensor(self) -> torch.Tensor:
        """CPU view ``[num_rows, dim]`` on the shared pages (row stride may be padded); of a
        quantized table, ``[num_rows, stored_bytes]`` uint8: each row's payload and its
        parameters (:mod:`nvecache.common.quant` reads them)."""
        self._live()
        return self._rows

    @property
    def gate(self) -> TableGate:
        """This process's read/write gate of the table (shared by every handle of it in this
        process): lookups hold its read side, :meth:`write` its write side."""
        return gate_for(("shm", self.name))

    def read(self, indices: torch.Tensor) -> torch.Tensor:
        """Rows at ``indices`` (int64 CPU [N], each in ``[0, num_rows)``): ``[N, dim]``."""
        idx = check_indices(indices, self.num_rows)
        self._live()
        c = self._counters
        c[C_LOOKUPS] += 1
        c[C_HITS] += idx.numel()
        with self.gate:
            if self._versions is not None:
                got = row_versions.read_rows(self._rows, idx, self._versions, self._writing)
            else:
                got = self._rows.index_select(0, idx)
        return self._codec.rows(got)

    def write(self, indices: torch.Tensor, values: torch.Tensor, *,
              allow_nonfinite: bool = False) -> None:
        """Write rows and tell every process's GPU cache to drop them (last duplicate wins).
        A quantized table takes float rows, or its stored bytes (uint8
        ``[N, stored_bytes]``, as :attr:`tensor` holds them).

        In this process the write waits for lookups in flight (:attr:`gate`), so none
        returns a row half old, half new; writes from other processes are not gated.

        Raises:
            BadArgumentError: bad indices or values; nothing is written.
            NonFiniteValuesError: a row holds NaN or an infinity and not
                ``allow_nonfinite``; nothing is written.
        """
        idx = check_indices(indices, self.num_rows)
        values = self._codec.accept(values, idx, allow_nonfinite=allow_nonfinite,
                                    key_word="index")
        n = idx.numel()
        if n == 0:
            return
        first = int(idx[0])
        if int(idx[-1]) - first == n - 1 and torch.equal(idx, _span(first, n)):
            self._copy_span(first, values)  # NOTE: consecutive rows: no dedup, one copy
            return
        with self.gate.writing(), self._writing():
            uidx, last, _ = dedup_last(idx)
            self._store_at(uidx, values, last)
            self.ring.append(uidx)
            self._counters[C_UPDATES] += uidx.numel()

    def write_range(self, start: int, values: torch.Tensor, *,
                    allow_nonfinite: bool = False) -> None:
        """Write ``values`` (``[N, dim]``) to rows ``start .. start + N - 1``: what
        :meth:`write` of ``torch.arange(start, start + N)`` does (the same gate, writer lock,
        announcement to every process's GPU cache and checks), in one copy.

        Raises:
            BadArgumentError: ``start`` is not an int, the rows do not fit in
                ``[0, num_rows)``, or bad values; nothing is written.
            NonFiniteValuesError: a row holds NaN or an infinity and not
                ``allow_nonfinite``; nothing is written.
        """
        n = int(values.shape[0]) if isinstance(values, torch.Tensor) and values.dim() else 0
        at = start if isinstance(start, int) and not isinstance(start, bool) else 0
        # NOTE: the values are checked first, their rows named by index
        stored = self._codec.accept(values, _span(at, n), allow_nonfinite=allow_nonfinite,
                                    key_word="index")
        first = _check_span(start, n, self.num_rows)
        if n:
            self._copy_span(first, stored)

    def _copy_span(self, first: int, values: torch.Tensor) -> None:
        """Checked ``values`` to rows ``first ..``, announced, under the gate and lock."""
        self._live()
        rows = self._rows
        if _overlaps(values, rows):  # NOTE: a copy from the rows themselves
            values = values.clone()
        n = values.shape[0]
        with self.gate.writing(), self._writing():
            self._store_span(first, values)
            self.ring.append(_span(first, n))
            self._counters[C_UPDATES] += n

    def _store_at(self, uidx: torch.Tensor, values: torch.Tensor,
                  pick: torch.Tensor | None = None) -> None:
        """Rows ``uidx`` (distinct) := ``values`` (rows ``pick`` of them), under the writer
        lock; a quantized table's in write sections of their versions."""
        v = self._versions
        if v is None:
            self._rows[uidx] = values if pick is None else values.index_select(0, pick)
            return
        step = row_versions.SECTION_ROWS
        for i in range(0, uidx.numel(), step):  # NOTE: per section of rows, not per row
            u = uidx[i:i + step]
            part = values[i:i + step] if pick is None else values.index_select(0, pick[i:i + step])
            with row_versions.section(v, u):
                self._rows.index_copy_(0, u, part)

    def _store_span(self, first: int, values: torch.Tensor) -> None:
        """Rows ``first ..`` := ``values``, under the writer lock; a quantized table's in
        write sections of their versions."""
        rows, v, n = self._rows, self._versions, values.shape[0]
        if v is None:
            rows[first:first + n].copy_(values)
            return
        step = row_versions.SECTION_ROWS
        for i in range(0, n, step):  # NOTE: per section of rows, not per row
            at = slice(first + i, first + min(n, i + step))
            with row_versions.section(v, at):
                rows[at].copy_(values[i:i + step])

    def fill_range(self, start: int, n: int, fill: Callable[[int, torch.Tensor], None], *,
                   stage: torch.Tensor | None = None) -> None:
        """Write rows ``start .. start + n - 1`` with what ``fill(i, out)`` puts into ``out``:
        rows ``i .. i + len(out) - 1`` of the span, ``out`` a contiguous ``[m, dim]`` tensor
        of the table's dtype. Where the rows lie back to back (no padding after a row)
        ``out`` is the table's rows themselves, in one call (a file read straight into the
        table); else the rows of ``stage`` (default: a new buffer of ``n`` rows), copied
        into place after each call. The same gate, writer lock and announcement to every
        process's GPU cache as :meth:`write_range`; no value checks (the caller's).

        Raises:
            BadArgumentError: ``start`` is not an int, the rows do not fit, or ``stage`` is
                not a contiguous ``[m, dim]`` tensor of the dtype; nothing is written.
            What ``fill`` raises; the rows it reached may have changed, and are announced.
        """
        first = _check_span(start, n, self.num_rows)
        self._live()
        rows = self._rows
        packed = self.geometry.row_stride == self.geometry.row_bytes and not self.quantized
        given = torch.float32 if self.quantized else self.dtype
        if not packed:
            if stage is None:
                stage = torch.empty(n, self.dim, dtype=given)
            if (not stage.is_contiguous() or stage.dim() != 2 or stage.shape[0] < 1
                    or stage.shape[1] != self.dim or stage.dtype != given):
                raise BadArgumentError(f"stage must be a contiguous [m, {self.dim}] "
                                       f"{str(given).removeprefix('torch.')} tensor")
        if n == 0:
            return
        with self.gate.writing(), self._writing():
            try:
                if packed:
                    fill(0, rows[first:first + n])
                else:
                    step = stage.shape[0]  # type: ignore[union-attr]
                    for i in range(0, n, step):  # NOTE: per stage of rows, not per row
                        m = min(step, n - i)
                        fill(i, stage[:m])  # type: ignore[index]
                        self._store_span(first + i,
                                         self._filled(stage[:m], first + i))  # type: ignore[index]
            finally:
                self.ring.append(_span(first, n))
                self._counters[C_UPDATES] += n

    def _filled(self, rows: torch.Tensor, first: int) -> torch.Tensor:
        """What :meth:`fill_range` stores of a filled stage (quantized: encoded; a stage
        that is not finite cannot be)."""
        if not self.quantized:
            return rows
        self._codec.finite(rows, _span(first, rows.shape[0]), allow_nonfinite=False,
                           key_word="index")
        return self._codec.stored(rows)

    def accumulate(self, indices: torch.Tensor, deltas: torch.Tensor, *,
                   allow_nonfinite: bool = False) -> None:
        """Add ``deltas`` (``[N, dim]``, the table's dtype or float32; float32 for a
        quantized table) to rows ``indices`` and tell every process's GPU cache to drop
        them.

        Duplicate indices have their deltas summed; float16/bfloat16 rows are added in
        float32 and rounded once (:mod:`nvecache.common.accumulate`); a quantized row is
        decoded, added to in float32 and encoded with stochastic rounding, so deltas under
        half its step add up over many calls (:func:`nvecache.common.quant.encode_sum`:
        each element within one step of the sum, not half of one). Each row's read, add
        and write happens under the table's writer lock, so accumulates and :meth:`write`
        calls of any process of the node never lose one another's rows (writes straight
        into :attr:`tensor` are not serialized with them).

        Raises:
            BadArgumentError: bad indices or deltas; nothing is written.
            NonFiniteValuesError: a delta holds NaN or an infinity and not
                ``allow_nonfinite``; nothing is written.
        """
        idx = check_indices(indices, self.num_rows)
        q = self.quantized
        check_deltas(deltas, idx, self.dim, torch.float32 if q else self.dtype,
                     allow_nonfinite=allow_nonfinite and not q,
                     errors=(BadArgumentError, NonFiniteValuesError), key_word="index")
        if idx.numel() == 0:
            return
        with self.gate.writing(), self._writing():
            if q:
                uidx = self._add_quantized(idx, deltas)
            else:
                uidx = add_at(self._rows, idx, deltas)
            self.ring.append(uidx)
            self._counters[C_UPDATES] += uidx.numel()

    def _add_quantized(self, idx: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        """Deltas added to quantized rows (under the writer lock): each distinct row
        decoded, added in float32 and encoded again with stochastic rounding
        (:meth:`hostcache.row_bytes.RowBytes.added`), so deltas under half the row's step
        add up over many calls instead of rounding away. A sum that is not finite leaves
        every row as it was."""
        uidx, sums, _ = sum_duplicates(idx, deltas, torch.float32)
        new = self._codec.added(self._rows.index_select(0, uidx), sums, uidx,
                                key_word="index")
        self._store_at(uidx, new)
        return uidx

    def exclusive(self) -> Any:
        """The table's node-wide writer lock, held while the ``with`` block runs: for a
        read-modify-write of rows kept elsewhere that this table journals
        (``gpu.DistMemBlock.accumulate``)."""
        return self._writing()

    def invalidate(self, indices: torch.Tensor) -> None:
        """Announce rows changed directly through :attr:`tensor` to every GPU cache."""
        idx = check_indices(indices, self.num_rows)
        with self._writing():
            self.ring.append(torch.unique(idx))

    def announce(self, keys: torch.Tensor) -> None:
        """Append any int64 keys to the invalidation ring, unchecked against the rows: a
        journal for a table kept elsewhere (``gpu.DistMemBlock`` announces its rows here)."""
        keys = check_keys(keys)
        if keys.numel():
            with self._writing():
                self.ring.append(torch.unique(keys))

    def _repair(self) -> None:
        # a dead writer may have changed rows without logging them: everyone drops all
        if self._versions is not None:
            row_versions.even(self._versions)  # NOTE: and its sections are over
        self.ring.invalidate_all()

    def _size(self) -> int:
        return self.num_rows
