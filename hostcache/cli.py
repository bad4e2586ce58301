"""The ``hostcache`` command: list, inspect, create and remove this node's shared tables.

Subcommands are :class:`Command` values registered in :data:`COMMANDS` (one place); a later
subcommand (``serve``, ``demo``) is one more entry there. Every error a user can cause
(a :class:`~hostcache.HostCacheError`) prints one line ``hostcache: error: ...`` to stderr
and exits 2, as argparse does for bad arguments; nothing prints a traceback.

Inspecting a table attaches it like any other process does: the command holds a process
counter slot for the moment it runs (its own slot is left out of what it prints) and, as
any attacher, repairs a write section left by a dead writer.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import fnmatch
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import torch

from . import demo as demo_cmd
from . import layout, segment
from .cache import HostCache
from .errors import (
    BadArgumentError,
    HostCacheError,
    SegmentNotFoundError,
    SegmentPermissionError,
)
from .memblock import SharedMemBlock
from .service import command as serve_cmd
from .table import SharedTable

PROG = "hostcache"
EXIT_OK = 0
EXIT_USER_ERROR = 2
MIB = 1 << 20

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


class TableInUseError(HostCacheError):
    """``rm`` without ``--force`` on a table that live processes still have attached."""


@dataclass(frozen=True)
class Command:
    """One subcommand: its name, one-line help, argument setup and the function it runs.

    ``run`` gets the parsed arguments and the stream to print to, and returns the exit
    status; it may raise :class:`~hostcache.HostCacheError` for user errors.
    """

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, TextIO], int]


# -- opening tables of any kind ----------------------------------------------------------


def open_table(name: str) -> HostCache | SharedMemBlock:
    """Attach the named table with the class that matches the kind in its header."""
    mapping, geo = segment.attach(name)  # validates the header
    mapping.close()
    return _CLASSES[geo.kind].attach(name)


def _segment_bytes(name: str) -> int | None:
    try:
        return os.stat(segment.shm_path(name)).st_size
    except OSError:
        return None


def _dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype))


def _others(table: SharedTable) -> list[int]:
    """Live pids attached to ``table``, without this command's own handle."""
    me = os.getpid()
    return sorted({pid for pid in table.attached_pids() if pid != me})


def _geometry(table: HostCache | SharedMemBlock) -> dict[str, Any]:
    g = table.geometry
    is_cache = g.kind == layout.KIND_HOST_CACHE
    return {
        "kind": layout.KIND_NAMES[g.kind],
        "capacity": g.capacity if is_cache else None,
        "rows": None if is_cache else g.capacity,
        "num_buckets": g.num_buckets if is_cache else None,
        "ways": g.ways if is_cache else None,
        "dim": g.dim,
        "dtype": _dtype_name(g.dtype),
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


def _summary(name: str) -> dict[str, Any] | None:
    """One ``ls`` row; a table that cannot be attached gives a row with its ``error``.

    ``None`` when the table was removed between listing and attaching.
    """
    try:
        table = open_table(name)
    except SegmentNotFoundError:
        return None
    except HostCacheError as e:
        nbytes = _segment_bytes(name)
        return {
            "name": name,
            "error": f"{type(e).__name__}: {e}",
            "segment_mib": None if nbytes is None else round(nbytes / MIB, 2),
        }
    try:
        geo = _geometry(table)
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
            "hit_rate": st.hit_rate if st.hits + st.misses else None,
            "processes": len(_others(table)),
            "segment_mib": round(geo["segment_bytes"] / MIB, 2),
        }
    finally:
        table.close()


# -- formatting ----------------------------------------------------------------------------


def _fmt(value: Any, pct: bool = False) -> str:
    if value is None:
        return "-"
    if pct:
        return f"{100 * value:.1f}%"
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _print_table(rows: list[list[str]], out: TextIO, right: set[int]) -> None:
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(len(rows[0]))]
    for r in rows:
        cells = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(r)]
        print("  ".join(cells).rstrip(), file=out)


_LS_HEADER = [
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


def _ls_line(s: dict[str, Any]) -> list[str]:
    if "error" in s:
        return [s["name"], "?", f"cannot attach: {s['error']}"]
    return [
        s["name"],
        s["kind"],
        _fmt(s["capacity"]),
        _fmt(s["dim"]),
        s["dtype"],
        _fmt(s["ways"]),
        _fmt(s["size"]),
        _fmt(s["fill"], pct=True),
        _fmt(s["hit_rate"], pct=True),
        _fmt(s["processes"]),
        _fmt(s["segment_mib"]),
    ]


# -- subcommands ---------------------------------------------------------------------------


def _ls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "patterns",
        nargs="*",
        metavar="PATTERN",
        help="only tables whose name matches one of these shell patterns (e.g. 'ctr_*')",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")


def _ls(args: argparse.Namespace, out: TextIO) -> int:
    names = [
        name
        for name in segment.list_names()
        if not args.patterns or any(fnmatch.fnmatchcase(name, p) for p in args.patterns)
    ]
    summaries = [s for s in map(_summary, names) if s is not None]
    if args.json:
        print(json.dumps(summaries, indent=2), file=out)
        return EXIT_OK
    if not summaries:
        what = " matching " + " ".join(args.patterns) if args.patterns else ""
        print(f"no hostcache tables{what} on this node", file=out)
        return EXIT_OK
    good = [_ls_line(s) for s in summaries if "error" not in s]
    bad = [_ls_line(s) for s in summaries if "error" in s]
    if good:
        _print_table([_LS_HEADER, *good], out, right={2, 3, 5, 6, 7, 8, 9, 10})
    for line in bad:  # NOTE: broken tables get their own lines so the columns stay aligned
        print("  ".join(line), file=out)
    return EXIT_OK


def _stat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="table name")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _process_slots(table: SharedTable) -> list[dict[str, Any]]:
    """Per-process counter slots of live attachers (this command's own slot left out)."""
    words = table.buffer[layout.PROC_OFF : layout.PROC_OFF + layout.PROC_BYTES].view(torch.int64)
    procs = words.view(layout.PROC_SLOTS, layout.PROC_WORDS).clone()
    live = set(_others(table))
    slots = []
    for i in procs[:, 0].nonzero().flatten().tolist():  # a loop over process slots
        pid = int(procs[i, 0])
        if pid in live:
            counts = procs[i, 1 : 1 + len(layout.COUNTER_NAMES)].tolist()
            slots.append(
                {"slot": i, "pid": pid, **dict(zip(layout.COUNTER_NAMES, counts, strict=True))}
            )
    return slots


def _stat(args: argparse.Namespace, out: TextIO) -> int:
    table = open_table(args.name)
    try:
        header = table.buffer[: layout.HEADER_BYTES].view(torch.int64)
        st = table.stats("node")
        counters = {k: v for k, v in st.as_dict().items() if k not in ("name", "kind", "scope")}
        counters["processes"] = len(_others(table))
        info = {
            "name": args.name,
            "geometry": _geometry(table),
            "node": counters,
            "ring_head": int(header[layout.W_RING_HEAD]),
            "repairs": int(header[layout.W_REPAIRS]),
            "processes": _process_slots(table),
        }
    finally:
        table.close()
    if args.json:
        print(json.dumps(info, indent=2), file=out)
        return EXIT_OK
    node = info["node"]
    sections = {
        "geometry": [(k, _fmt(v)) for k, v in info["geometry"].items() if v is not None],
        "node-wide counters": [
            *((k, _fmt(v)) for k, v in node.items() if k != "hit_rate"),
            ("hit_rate", _fmt(node["hit_rate"], pct=True) if node["lookups"] else "-"),
            ("ring_head", _fmt(info["ring_head"])),
            ("repairs", _fmt(info["repairs"])),
        ],
    }
    width = max(len(k) for pairs in sections.values() for k, _ in pairs)
    print(f"table {args.name}", file=out)
    for title, pairs in sections.items():
        print(f"{title}:", file=out)
        for k, v in pairs:
            print(f"  {k.ljust(width)}  {v}", file=out)
    if info["processes"]:
        print("processes attached:", file=out)
        header_row = ["SLOT", "PID", *(c.upper() for c in layout.COUNTER_NAMES)]
        rows = [
            [str(p["slot"]), str(p["pid"]), *(_fmt(p[k]) for k in layout.COUNTER_NAMES)]
            for p in info["processes"]
        ]
        _print_table([header_row, *rows], out, right=set(range(len(header_row))))
    else:
        print("processes attached: none", file=out)
    return EXIT_OK


def _mode(text: str) -> int:
    try:
        return int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"mode must be octal like 0600 or 0660; got {text!r}"
        ) from None


def _create_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="table name, [A-Za-z0-9_.-]{1,100}")
    p.add_argument(
        "--linear",
        action="store_true",
        help="a linear table (SharedMemBlock) of --rows rows instead of a cache",
    )
    p.add_argument("--capacity", type=int, help="rows the host cache holds")
    p.add_argument("--rows", type=int, help="rows of a linear table (with --linear)")
    p.add_argument("--dim", type=int, required=True, help="elements per row")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--ways", type=int, help="slots per bucket of a host cache (default 8)")
    p.add_argument(
        "--mode",
        type=_mode,
        default=0o600,
        help="octal permission bits of the segment and its lock file (0600)",
    )
    p.add_argument(
        "--ring-capacity",
        type=int,
        default=layout.DEFAULT_RING_CAPACITY,
        help="records in the invalidation ring",
    )


def _create(args: argparse.Namespace, out: TextIO) -> int:
    dtype = DTYPES[args.dtype]
    if args.linear:
        if args.rows is None or args.capacity is not None or args.ways is not None:
            raise BadArgumentError("create --linear takes --rows N (not --capacity or --ways)")
        table: HostCache | SharedMemBlock = SharedMemBlock.create(
            args.name,
            num_rows=args.rows,
            dim=args.dim,
            dtype=dtype,
            ring_capacity=args.ring_capacity,
            mode=args.mode,
        )
    else:
        if args.capacity is None or args.rows is not None:
            raise BadArgumentError("create takes --capacity N (or --linear --rows N)")
        table = HostCache.create(
            args.name,
            capacity=args.capacity,
            dim=args.dim,
            dtype=dtype,
            ways=8 if args.ways is None else args.ways,
            ring_capacity=args.ring_capacity,
            mode=args.mode,
        )
    g = table.geometry
    table.close()  # NOTE: close, never unlink: the table stays for the node's processes
    shape = (
        f"capacity {g.capacity:,} ({g.num_buckets:,} buckets x {g.ways} ways)"
        if g.kind == layout.KIND_HOST_CACHE
        else f"{g.capacity:,} rows"
    )
    print(
        f"created {layout.KIND_NAMES[g.kind]} table {args.name}: {shape}, dim {g.dim}, "
        f"{_dtype_name(g.dtype)}, {g.total_size / MIB:.2f} MiB, mode {args.mode:04o}",
        file=out,
    )
    return EXIT_OK


def _rm_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="table name")
    p.add_argument(
        "--force",
        action="store_true",
        help="remove even if live processes are attached (they keep their mapping)",
    )


def _rm(args: argparse.Namespace, out: TextIO) -> int:
    segment.check_name(args.name)
    if not args.force:
        try:
            table = open_table(args.name)
        except (SegmentNotFoundError, SegmentPermissionError):
            raise
        except HostCacheError:
            table = None  # a broken header: no process can attach it, remove it anyway
        if table is not None:
            try:
                pids = _others(table)
            finally:
                table.close()
            if pids:
                raise TableInUseError(
                    f"table {args.name!r} is attached by {len(pids)} live process(es) "
                    f"(pids {', '.join(map(str, pids))}); stop them first or pass --force"
                )
    segment.unlink(args.name)
    print(f"removed {args.name}", file=out)
    return EXIT_OK


#: every subcommand, in the order ``--help`` lists them; add new ones here.
COMMANDS: tuple[Command, ...] = (
    Command("ls", "list this node's tables", _ls_args, _ls),
    Command("stat", "one table's geometry, node-wide counters and processes", _stat_args, _stat),
    Command("create", "create a table and leave it on the node", _create_args, _create),
    Command("rm", "remove a table from the node", _rm_args, _rm),
    Command("serve", "run the node service (docs/service.md)", serve_cmd.configure, serve_cmd.run),
    Command("demo", demo_cmd.HELP, demo_cmd.configure, demo_cmd.run_command),
)


def build_parser(commands: Sequence[Command] = COMMANDS) -> argparse.ArgumentParser:
    """The argument parser with one subparser per :class:`Command`."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Inspect and manage this node's shared embedding tables."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for cmd in commands:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.configure(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``hostcache`` command; returns the exit status (0 ok, 2 user error)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2), already printed
        return e.code if isinstance(e.code, int) else EXIT_USER_ERROR
    try:
        return int(args._run(args, sys.stdout))
    except HostCacheError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except BrokenPipeError:  # e.g. `hostcache ls | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
