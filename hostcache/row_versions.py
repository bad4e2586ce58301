"""Per-row seqlock versions of a quantized linear table (``SharedMemBlock``).

A quantized row is its payload and its scale (and bias): a reader that took the payload of
one write and the scale of another would decode values no write stored. In one process
the table's gate orders lookups and writes; across processes these versions do, as a host
cache's slot versions do (``hostcache.layout``, "Seqlock protocol per row"):

* a writer, holding the table's writer lock, adds one to the versions of the rows it is
  about to write (odd: being written), writes them, and adds one again (even: stable),
  a bounded number of rows per section (:data:`SECTION_ROWS`) so that readers never wait
  long;
* a reader reads a row's version, the row, and the version again, and reads the row again
  while the two differ or are odd.

Each row's version (int32) is the 4 bytes after its stored bytes, in the room its stride
leaves (``hostcache.layout``): whoever holds a row finds its version beside it, a GPU
kernel at ``row + stored_bytes`` (:mod:`gpu.kernels.stored_rows`), torch through a view
(:func:`versions_in`), and a CPU reader takes the row's cache line with it.
:class:`VersionedFormat` is the row format a reader is told, so that it takes that path.

A writer that dies inside a section leaves odd versions; the next process to take the
writer lock makes them even (its repair, which also tells every GPU cache to drop all
rows). A CPU reader that finds rows still being written after :data:`WAIT_SECONDS` of
rounds (a writer that keeps rewriting them, one stalled inside its section, or a dead
one) reads those rows holding the writer lock, when its table gave it one
(:attr:`VersionedFormat.wait`): no writer runs meanwhile, a dead writer's section is
repaired first, and the rows are read whole. A GPU kernel cannot take the lock: it reads
a row again for a bounded number of rounds (:mod:`gpu.kernels.stored_rows`), then takes
it as read.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from hostcache.layout import ROW_VERSION_BYTES
from nvecache.common.rows import RowFormat

#: rows one write section covers at most (a bigger write is several sections)
SECTION_ROWS = 1 << 14
#: how long a CPU reader reads rows again, unlocked, before it takes the writer lock
WAIT_SECONDS = 0.25
#: a context manager holding a table's writer lock (a reader's last resort)
Wait = Callable[[], AbstractContextManager[Any]]


@dataclass(frozen=True)
class VersionedFormat(RowFormat):
    """A quantized linear table's row format as its readers are told it: each row carries
    a seqlock version after its :attr:`stored_bytes` (the kernels read them; a reader told
    the plain :class:`~nvecache.common.rows.RowFormat` reads the rows without). ``wait``,
    the table's writer lock, is what a CPU reader takes for rows it could not read whole
    in :data:`WAIT_SECONDS` (not part of the format: formats compare without it)."""

    versioned: ClassVar[bool] = True
    wait: Wait | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, fmt: RowFormat, wait: Wait | None = None) -> VersionedFormat:
        return cls(fmt.dtype, fmt.dim, wait)


def is_versioned(fmt: object) -> bool:
    """Whether a reader told ``fmt`` reads rows under their seqlock versions."""
    return bool(getattr(fmt, "versioned", False))


def wait_of(fmt: object) -> Wait | None:
    """The writer lock a reader told ``fmt`` takes as its last resort (None: none)."""
    return getattr(fmt, "wait", None)


class _VersionsIn:
    """``__cuda_array_interface__`` of the versions in a CUDA view of a table's rows
    (registered host memory); keeps the rows' view, and so the registration, alive."""

    def __init__(self, rows: torch.Tensor, offset: int) -> None:
        self._rows = rows
        self.__cuda_array_interface__ = {
            "shape": (rows.shape[0],), "strides": (rows.stride(0),), "typestr": "<i4",
            "version": 3, "data": (rows.data_ptr() + offset, False)}


def versions_in(rows: torch.Tensor, offset: int) -> torch.Tensor:
    """int32 ``[num_rows]``: the versions of a versioned table's rows, given a view of its
    rows (uint8, row stride a multiple of 4: on the CPU a view of the table's segment, on
    CUDA of its registration) and where in a row the version is (its stored bytes)."""
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.stride(0) % ROW_VERSION_BYTES:
        raise ValueError("not a view of a versioned table's stored rows")
    if rows.device.type != "cpu":
        return torch.as_tensor(_VersionsIn(rows, offset), device=rows.device)
    raw = torch.empty(0, dtype=torch.uint8).set_(
        rows.untyped_storage(), rows.storage_offset() + offset,
        (rows.shape[0], ROW_VERSION_BYTES), (rows.stride(0), 1))
    return raw.view(torch.int32)[:, 0]


def _clean(v1: torch.Tensor, v2: torch.Tensor) -> torch.Tensor:
    return (v1 == v2) & ((v1 & 1) == 0)


def read_rows(rows: torch.Tensor, idx: torch.Tensor, versions: torch.Tensor,
              wait: Wait | None = None) -> torch.Tensor:
    """``rows.index_select(0, idx)``, each row read inside a window its version did not
    change in: never a payload of one write with the parameters of another.

    Each step is a separate torch call (on the CPU, neither the compiler nor the CPU moves
    a load of one step past another: x86 does not reorder loads with loads; on CUDA, each
    is a launch after the one before it completed). Rows read during a write section are
    read again, as a batch, until their window is clean; those still not clean after
    :data:`WAIT_SECONDS` are read holding ``wait`` (the table's writer lock: no section
    is open then, a dead writer's repaired), or, without one, taken as read. On CUDA,
    knowing whether any was torn costs a host sync: the layers read versioned rows on
    CUDA with the kernels (:mod:`gpu.kernels.stored_rows`), this only under the torch
    cache backend."""
    v1 = versions.index_select(0, idx)
    got = rows.index_select(0, idx)
    v2 = versions.index_select(0, idx)
    # NOTE: the common case in two calls: every v1 even and equal to its v2 (versions only
    # grow, so an odd v1 never equals v2 once its last bit is cleared)
    if torch.equal(v1 & -2, v2):
        return got
    sel = (~_clean(v1, v2)).nonzero().squeeze(1)
    deadline = time.monotonic() + WAIT_SECONDS
    while sel.numel() and time.monotonic() < deadline:  # NOTE: rounds over the torn rows
        os.sched_yield()
        i = idx.index_select(0, sel)
        v1 = versions.index_select(0, i)
        again = rows.index_select(0, i)
        v2 = versions.index_select(0, i)
        ok = _clean(v1, v2)
        got.index_copy_(0, sel[ok], again[ok])
        sel = sel[~ok]
    if sel.numel() and wait is not None:
        with wait():  # NOTE: no writer inside a section while it is held
            got.index_copy_(0, sel, rows.index_select(0, idx.index_select(0, sel)))
    return got


@contextmanager
def section(versions: torch.Tensor, rows: torch.Tensor | slice) -> Iterator[None]:
    """A write section of ``rows`` (distinct indices, or a slice): their versions odd while
    the ``with`` block writes them, even after (also when it raises: the rows it reached
    stay as written). The caller holds the table's writer lock."""
    if isinstance(rows, slice):
        versions[rows] += 1
    else:
        versions.index_add_(0, rows, torch.ones_like(rows, dtype=versions.dtype))
    try:
        yield
    finally:
        if isinstance(rows, slice):
            versions[rows] += 1
        else:
            versions.index_add_(0, rows, torch.ones_like(rows, dtype=versions.dtype))


def even(versions: torch.Tensor) -> None:
    """Make every odd version even (a dead writer's sections ended; under the lock)."""
    versions += versions & 1
