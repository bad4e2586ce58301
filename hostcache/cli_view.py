"""What the ``hostcache`` command shows: tables attached by kind, summarised and formatted.

Attaching a table to inspect it holds a process counter slot for the moment; this
command's own slot is left out of what it shows (:func:`others`).
"""

from __future__ import annotations

import datetime as _dt
import os
from typing import Any, TextIO

import torch

from . import layout, segment
from .cache import HostCache
from .errors import HostCacheError, SegmentNotFoundError
from .memblock import SharedMemBlock
from .table import SharedTable

MIB = 1 << 20

#: table dtypes by the name the command takes and prints
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_CLASSES: dict[int, type[HostCache] | type[SharedMemBlock]] = {
    layout.KIND_HOST_CACHE: HostCache,
    layout.KIND_LINEAR: SharedMemBlock,
}

# -- opening tables of any kind ----------------------------------------------------------


def open_table(name: str) -> HostCache | SharedMemBlock:
    """Attach the named table with the class that matches the kind in its header."""
    try:
        mapping, geo = segment.attach(name)  # validates the header
    except SegmentNotFoundError as e:
        raise SegmentNotFoundError(
            f"no table named {name!r} on this node: `hostcache ls` lists them"
        ) from e
    mapping.close()
    return _CLASSES[geo.kind].attach(name)


def segment_bytes(name: str) -> int | None:
    """Size of the named segment in bytes, or None if it is gone."""
    try:
        return os.stat(segment.shm_path(name)).st_size
    except OSError:
        return None


def dtype_name(dtype: torch.dtype) -> str:
    """The name the command prints for a table dtype."""
    return _DTYPE_NAMES.get(dtype, str(dtype))


def others(table: SharedTable) -> list[int]:
    """Live pids attached to ``table``, without this command's own handle."""
    me = os.getpid()
    return sorted({pid for pid in table.attached_pids() if pid != me})


def geometry(table: HostCache | SharedMemBlock) -> dict[str, Any]:
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
        "dtype": dtype_name(g.dtype),
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



def process_slots(table: SharedTable) -> list[dict[str, Any]]:
    """Per-process counter slots of live attachers (this command's own slot left out)."""
    words = table.buffer[layout.PROC_OFF : layout.PROC_OFF + layout.PROC_BYTES].view(torch.int64)
    procs = words.view(layout.PROC_SLOTS, layout.PROC_WORDS).clone()
    live = set(others(table))
    slots = []
    for i in procs[:, 0].nonzero().flatten().tolist():  # a loop over process slots
        pid = int(procs[i, 0])
        if pid in live:
            counts = procs[i, 1 : 1 + len(layout.COUNTER_NAMES)].tolist()
            slots.append(
                {"slot": i, "pid": pid, **dict(zip(layout.COUNTER_NAMES, counts, strict=True))}
            )
    return slots
