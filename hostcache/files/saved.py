"""A saved table's file (``hostcache save``, or ``psclient dump``), opened: its metadata,
keys and a lazy view of its rows, and what it must fit before a restore writes anything
(the table's kind and geometry, rows that hold no NaN or infinity).

A quantized table's file holds its stored bytes (uint8 ``[N, stored_bytes]``, the format's
name and the dim in the metadata: :mod:`psclient.formats`); :class:`Saved` reads it as
rows of that format, ``stored`` True, and its rows are checked by decoding them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hostcache import layout
from hostcache.cache import HostCache
from hostcache.errors import BadArgumentError, GeometryMismatchError, NonFiniteValuesError
from hostcache.memblock import SharedMemBlock
from nvecache.common import quant
from nvecache.common.finite import nonfinite_rows
from nvecache.common.rows import QUANTIZED, RowFormat, RowFormatError
from psclient.formats import KEYS_NAME, ROWS_NAME

if TYPE_CHECKING:
    from tqdm import tqdm

    from hostcache.table import SharedTable


def kind_of(table: SharedTable) -> str:
    return layout.KIND_NAMES[table.geometry.kind]


class Saved:
    """A saved file, opened: its metadata, keys and a lazy view of its rows."""

    def __init__(self, path: Path) -> None:
        from safetensors import SafetensorError, safe_open

        what = repr(str(path))
        if not path.is_file():
            raise BadArgumentError(f"no such file: {what}")
        try:
            self._f = safe_open(str(path), framework="pt")
        except (SafetensorError, OSError) as e:
            raise BadArgumentError(f"{what} is not a saved table (not a .safetensors "
                                   f"file: {e}): restore a file `hostcache save` wrote") from e
        names = set(self._f.keys())
        if not {ROWS_NAME, KEYS_NAME} <= names:
            raise BadArgumentError(f"{what} holds tensors {sorted(names)}, not a table's "
                                   f"{ROWS_NAME!r} and {KEYS_NAME!r}: restore a file "
                                   "`hostcache save` or `psclient dump` wrote")
        self.meta = self._f.metadata() or {}
        self.rows = self._f.get_slice(ROWS_NAME)
        shape = self.rows.get_shape()
        self.keys = self._f.get_tensor(KEYS_NAME)
        if len(shape) != 2 or self.keys.dim() != 1 or self.keys.numel() != shape[0] \
                or self.keys.dtype != torch.int64:
            raise BadArgumentError(f"{what}: rows {shape} and keys {list(self.keys.shape)} "
                                   f"{self.keys.dtype} do not make a table ([N, dim] rows, "
                                   "[N] int64 keys)")
        self.n, self.dim = shape
        self.dtype = self.rows[0:0].dtype
        self.what = what
        #: a quantized table's file: its rows are the format's stored bytes
        self.stored = self.meta.get("dtype") in QUANTIZED
        #: how its rows are stored (None for plain rows, read as they are)
        self.fmt: RowFormat | None = None
        if self.stored:
            try:
                fmt = RowFormat(self.meta["dtype"], int(self.meta.get("dim", "0")))
            except (RowFormatError, ValueError):
                fmt = None
            if fmt is None or self.dtype != torch.uint8 or self.dim != fmt.stored_bytes:
                raise BadArgumentError(
                    f"{what}: rows {shape} {self.dtype} are not the stored bytes of a "
                    f"{self.meta['dtype']} table of dim {self.meta.get('dim')!r} (uint8 [N, "
                    "stored_bytes]): restore a file `hostcache save` or `psclient dump` wrote")
            self.fmt, self.dim, self.dtype = fmt, fmt.dim, fmt.torch_dtype

    def decoded(self, a: int, b: int) -> torch.Tensor:
        """Rows ``a .. b`` as values (a quantized table's decoded)."""
        got = self.rows[a:b]
        return got if self.fmt is None else quant.decode(got, self.fmt)

    def kind(self) -> str:
        return self.meta.get("kind", "hostcache")

    def geometry(self) -> str:
        return f"dim {self.dim}, {str(self.dtype).removeprefix('torch.')}"


def check_fits(saved: Saved, table: SharedTable, name: str) -> None:
    geo = table.geometry
    if saved.kind() != kind_of(table) or saved.dim != geo.dim or saved.dtype != geo.dtype:
        raise GeometryMismatchError(
            f"{saved.what} holds a {saved.kind()} table of {saved.geometry()}, table {name!r} "
            f"is a {kind_of(table)} table of dim {geo.dim}, {geo.dtype_name}: restore into "
            "another name (it is created) or remove the table first (hostcache rm)")
    keys = saved.keys
    if isinstance(table, SharedMemBlock) and saved.n and (
            int(keys.min()) < 0 or int(keys.max()) >= table.num_rows):
        raise GeometryMismatchError(
            f"{saved.what} holds rows {int(keys.min())}..{int(keys.max())}, table {name!r} "
            f"has {table.num_rows} rows: restore into a table of at least "
            f"{int(keys.max()) + 1} rows")
    if isinstance(table, HostCache) and saved.n > geo.capacity:
        raise GeometryMismatchError(
            f"{saved.what} holds {saved.n} rows, cache {name!r} holds {geo.capacity}: "
            "restore into a cache of that capacity or more")


def nonfinite_scan(read: Callable[[int, int], torch.Tensor], n: int, chunk: int,
                    bar: tqdm | None = None) -> tuple[int, int]:
    """(how many of ``n`` rows hold NaN or an infinity, the first one's index or -1), the
    rows read once, ``read(start, stop)`` a chunk at a time."""
    bad, first = 0, -1
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        at = nonfinite_rows(read(a, b))
        if at is not None:
            idx = torch.nonzero(at)[:, 0]
            first = a + int(idx[0]) if first < 0 else first
            bad += idx.numel()
        if bar is not None:
            bar.update(b - a)
    return bad, first


def check_finite(saved: Saved, chunk: int) -> None:
    """Every saved row read once (a quantized table's decoded): NaN and infinities refused
    before the first write."""
    bad, first = nonfinite_scan(saved.decoded, saved.n, chunk)
    if bad:
        fix = ("a quantized table stores finite rows only" if saved.stored else
               "or restore it anyway with allow_nonfinite=True (--allow-nonfinite)")
        raise NonFiniteValuesError(
            f"{saved.what}: {bad} of {saved.n} rows hold NaN or infinite values (the first: "
            f"key {int(saved.keys[first])}); nothing was written: fix the file, {fix}")


