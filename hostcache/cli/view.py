"""What the ``hostcache`` command shows: tables attached by kind, summarised and formatted.

Attaching a table to inspect it holds a process counter slot for the moment; this
command's own slot is left out of what it shows (:func:`others`). The command attaches a
table as a :class:`TableView`, which maps no rows: it reads the header and the process
counter slots with numpy, so it loads neither torch nor numba.
"""

from __future__ import annotations

import datetime as _dt
import os
from typing import Any, TextIO

import numpy as np

from hostcache import layout, segment
from hostcache.errors import HostCacheError, SegmentNotFoundError
from hostcache.table import SharedTable

MIB = 1 << 20

# -- opening tables of any kind ----------------------------------------------------------


class _RepairNeededError(HostCacheError):
    """A writer died inside its write section: the table's own class must repair it."""


class TableView(SharedTable):
    """A handle on a table of either kind that maps none of its rows: its geometry, header,
    counters and attached processes (what ``ls``, ``stat`` and ``rm`` read)."""

    def _map_views(self, mapping: segment.Mapping, geo: layout.Geometry) -> None:
        pass

    def _repair(self) -> None:
        # NOTE: raised under the lock, before anything is written: nothing changes
        raise _RepairNeededError(
            f"table {self.name!r}: a writer died inside its write section again while the "
            "command repaired it; run the command again")

    def word(self, index: int) -> int:
        """Header word ``index`` (a ``layout.W_*``) now."""
        return int(self._header[index])

    def slots(self) -> np.ndarray:
        """A copy of the process counter slots: ``[PROC_SLOTS, PROC_WORDS]`` int64, each a
        pid (0: free) and then the counters ``layout.COUNTER_NAMES``."""
        self._live()
        return self._procs.copy()


class _CacheView(TableView):
    KIND = layout.KIND_HOST_CACHE


class _LinearView(TableView):
    KIND = layout.KIND_LINEAR

    def _size(self) -> int:
        return self.geometry.capacity  # NOTE: as SharedMemBlock: every row is there


_VIEWS: dict[int, type[TableView]] = {
    layout.KIND_HOST_CACHE: _CacheView,
    layout.KIND_LINEAR: _LinearView,
}


def open_table(name: str) -> TableView:
    """Attach the named table as a :class:`TableView` of the kind in its header.

    A write section left by a dead writer is repaired first, as any attacher does: by the
    table's own class (which loads torch, only then).
    """
    try:
        mapping, geo = segment.attach(name)  # validates the header
    except SegmentNotFoundError as e:
        raise SegmentNotFoundError(
            f"no table named {name!r} on this node: `hostcache ls` lists them"
        ) from e
    mapping.close()
    try:
        return _VIEWS[geo.kind]._attach_segment(name)
    except _RepairNeededError:
        _repair(name, geo.kind)
    return _VIEWS[geo.kind]._attach_segment(name)


def _repair(name: str, kind: int) -> None:
    """Attach and close the table with its own class: attaching repairs it."""
    from hostcache.cache import HostCache
    from hostcache.memblock import SharedMemBlock

    cls: type[HostCache] | type[SharedMemBlock] = (
        HostCache if kind == layout.KIND_HOST_CACHE else SharedMemBlock)
    cls.attach(name).close()


def segment_bytes(name: str) -> int | None:
    """Size of the named segment in bytes, or None if it is gone."""
    try:
        return os.stat(segment.shm_path(name)).st_size
    except OSError:
        return None


def others(table: SharedTable) -> list[int]:
    """Live pids attached to ``table``, without this command's own handle."""
    me = os.getpid()
    return sorted({pid for pid in table.attached_pids() if pid != me})


def geometry(table: TableView) -> dict[str, Any]:
    """A table's geometry as ``stat`` prints it (JSON-ready)."""
    g = table.geometry
    is_cache = g.kind == layout.KIND_HOST_CACHE
    return {
        "kind": layout.KIND_NAMES[g.kind],
        "capacity": g.capacity if is_cache else None,
        "rows": None if is_cache else g.capacity,
        "num_buckets": g.num_buckets if is_cache else None,
        "ways": g.ways if is_cache else None,
        "dim": g.dim,
        "dtype": g.dtype_name,
        "policy": g.policy if is_cache else None,
        "row_bytes": g.row_bytes,
        "row_stride": g.row_stride,
        "ring_capacity": g.ring_capacity,
        "segment_bytes": g.total_size,
        "creator_uid": g.creator_uid,
        "created": _dt.datetime.fromtimestamp(g.created_ns / 1e9, _dt.UTC).isoformat(
            timespec="seconds"
        ),
    }


def summary(name: str) -> dict[str, Any] | None:
    """One ``ls`` row; a table that cannot be attached gives a row with its ``error``.

    ``None`` when the table was removed between listing and attaching.
    """
    try:
        table = open_table(name)
    except SegmentNotFoundError:
        return None
    except HostCacheError as e:
        nbytes = segment_bytes(name)
        return {
            "name": name,
            "error": f"{type(e).__name__}: {e}",
            "segment_mib": None if nbytes is None else round(nbytes / MIB, 2),
        }
    try:
        geo = geometry(table)
        st = table.stats("node")
        is_cache = geo["kind"] == "hostcache"
        return {
            "name": name,
            "kind": geo["kind"],
            "capacity": geo["capacity"] if is_cache else geo["rows"],
            "dim": geo["dim"],
            "dtype": geo["dtype"],
            "ways": geo["ways"],
            "size": st.size,
            "fill": st.size / st.capacity if is_cache and st.capacity else None,
            "hit_rate": st.measured_hit_rate,
            "processes": len(others(table)),
            "segment_mib": round(geo["segment_bytes"] / MIB, 2),
        }
    finally:
        table.close()


# -- formatting ----------------------------------------------------------------------------


def fmt(value: Any, pct: bool = False) -> str:
    """A value as a table cell: ``-`` for None, thousands separators, a percentage."""
    if value is None:
        return "-"
    if pct:
        return f"{100 * value:.1f}%"
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def print_table(rows: list[list[str]], out: TextIO, right: set[int]) -> None:
    """Print rows as aligned columns (the columns in ``right`` right-aligned)."""
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(len(rows[0]))]
    for r in rows:
        cells = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(r)]
        print("  ".join(cells).rstrip(), file=out)


LS_HEADER = [
    "NAME",
    "KIND",
    "CAPACITY",
    "DIM",
    "DTYPE",
    "WAYS",
    "SIZE",
    "FILL",
    "HIT RATE",
    "PROCS",
    "MiB",
]


def ls_line(s: dict[str, Any]) -> list[str]:
    """The cells of one ``ls`` row."""
    if "error" in s:
        return [s["name"], "?", f"cannot attach: {s['error']}"]
    return [
        s["name"],
        s["kind"],
        fmt(s["capacity"]),
        fmt(s["dim"]),
        s["dtype"],
        fmt(s["ways"]),
        fmt(s["size"]),
        fmt(s["fill"], pct=True),
        fmt(s["hit_rate"], pct=True),
        fmt(s["processes"]),
        fmt(s["segment_mib"]),
    ]



def process_slots(table: TableView) -> list[dict[str, Any]]:
    """Per-process counter slots of live attachers (this command's own slot left out)."""
    procs = table.slots()
    live = set(others(table))
    slots = []
    for i in np.flatnonzero(procs[:, 0]).tolist():  # a loop over process slots
        pid = int(procs[i, 0])
        if pid in live:
            counts = procs[i, 1 : 1 + len(layout.COUNTER_NAMES)].tolist()
            slots.append(
                {"slot": i, "pid": pid, **dict(zip(layout.COUNTER_NAMES, counts, strict=True))}
            )
    return slots
