"""The ``hostcache`` command: list, inspect, create and remove this node's shared tables.

Subcommands are :class:`Command` values registered in :data:`COMMANDS` (one place). The
``hostcache`` console script is ``nvecache.apps.cli``, which builds the same parser from these
commands plus the applications' ``serve`` and ``demo`` (:func:`build_parser` and
:func:`main` take the command list); ``python -m hostcache.cli`` runs the table commands
alone, and nothing here imports the applications. Every error a user can cause
(a :class:`~hostcache.HostCacheError`) prints one line ``hostcache: error: ...`` to stderr
and exits 2, as argparse does for bad arguments; nothing prints a traceback.

Inspecting a table attaches it like any other process does: the command holds a process
counter slot for the moment it runs (its own slot is left out of what it prints) and, as
any attacher, repairs a write section left by a dead writer. It reads a table through a
:class:`~hostcache.cli.view.TableView` (its header and counters, no rows), so the table
commands load neither torch nor numba and answer at once; only a repair loads the table's
own class.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import fnmatch
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, TextIO

from hostcache.errors import (
    BadArgumentError,
    HostCacheError,
    SegmentNotFoundError,
    SegmentPermissionError,
    SharedMemoryFullError,
    TableInUseError,
)
from nvecache.common.cli import EXIT_USAGE, OneLineParser, add_version, positive_int
from nvecache.common.lazy import deferred, lazy_import
from nvecache.common.rows import FORMATS

if TYPE_CHECKING:
    from hostcache import files, layout, segment
    from hostcache.cli import view
    from hostcache.table import init_segment
else:  # NOTE: numpy and the segment code load with a command that reads a table (not --help)
    view = lazy_import("hostcache.cli.view", globals(), "view")
    files = lazy_import("hostcache.files", globals())  # NOTE: torch and safetensors: save/restore
    layout = lazy_import("hostcache.layout", globals())
    segment = lazy_import("hostcache.segment", globals())
    init_segment = deferred("hostcache.table", "init_segment")

PROG = "hostcache"
EXIT_OK = 0
EXIT_USER_ERROR = EXIT_USAGE


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
    summaries = [s for s in map(view.summary, names) if s is not None]
    if args.json:
        print(json.dumps(summaries, indent=2), file=out)
        return EXIT_OK
    if not summaries:
        what = " matching " + " ".join(args.patterns) if args.patterns else ""
        print(f"no hostcache tables{what} on this node", file=out)
        return EXIT_OK
    good = [view.ls_line(s) for s in summaries if "error" not in s]
    bad = [view.ls_line(s) for s in summaries if "error" in s]
    if good:
        view.print_table([view.LS_HEADER, *good], out, right={2, 3, 5, 6, 7, 8, 9, 10})
    for line in bad:  # NOTE: broken tables get their own lines so the columns stay aligned
        print("  ".join(line), file=out)
    return EXIT_OK


def _stat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="table name")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _feed_lines(feed: dict[str, Any]) -> list[tuple[str, str]]:
    """``stat``'s lines about the change feed a node service follows into the table."""
    if feed["applied_ns"] is None:
        return [("followed", "no change applied yet"), ("gaps", view.fmt(feed["gaps"]))]
    when = _dt.datetime.fromtimestamp(feed["applied_ns"] / 1e9, _dt.UTC)
    return [("last_lag", f"{feed['last_lag_s'] * 1e3:.1f} ms"),
            ("max_lag", f"{feed['max_lag_s'] * 1e3:.1f} ms"),
            ("last_applied", when.isoformat(timespec="seconds")),
            ("gaps", view.fmt(feed["gaps"]))]


def _stat(args: argparse.Namespace, out: TextIO) -> int:
    table = view.open_table(args.name)
    try:
        st = table.stats("node")
        counters = {k: v for k, v in st.as_dict().items() if k not in ("name", "kind", "scope")}
        # NOTE: no hit rate before a key was looked up (null in JSON, "-" in text, as in ls)
        counters["hit_rate"] = st.measured_hit_rate
        counters["processes"] = len(view.others(table))
        info = {
            "name": args.name,
            "geometry": view.geometry(table),
            "node": counters,
            "ring_head": table.word(layout.W_RING_HEAD),
            "repairs": table.word(layout.W_REPAIRS),
            "feed": asdict(table.feed_status()),
            "processes": view.process_slots(table),
        }
    finally:
        table.close()
    if args.json:
        print(json.dumps(info, indent=2), file=out)
        return EXIT_OK
    node = info["node"]
    sections = {
        "geometry": [(k, view.fmt(v)) for k, v in info["geometry"].items() if v is not None],
        "node-wide counters": [
            *((k, view.fmt(v)) for k, v in node.items() if k != "hit_rate"),
            ("hit_rate", view.fmt(node["hit_rate"], pct=True)),
            ("ring_head", view.fmt(info["ring_head"])),
            ("repairs", view.fmt(info["repairs"])),
        ],
        "change feed (node service)": _feed_lines(info["feed"]),
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
            [str(p["slot"]), str(p["pid"]), *(view.fmt(p[k]) for k in layout.COUNTER_NAMES)]
            for p in info["processes"]
        ]
        view.print_table([header_row, *rows], out, right=set(range(len(header_row))))
    else:
        print("processes attached: none", file=out)
    return EXIT_OK


def _mode(text: str) -> int:
    try:
        mode = int(text, 8)
    except ValueError:
        mode = -1
    if mode < 0 or mode & ~0o666 or not mode & 0o600:
        raise argparse.ArgumentTypeError(
            f"must be octal permission bits within 0666 that let the owner read and write, "
            f"like 0600 or 0660; got {text!r}"
        )
    return mode


def _create_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="table name, [A-Za-z0-9_.-]{1,100}")
    p.add_argument(
        "--linear",
        action="store_true",
        help="a linear table (SharedMemBlock) of --rows rows instead of a cache",
    )
    p.add_argument("--capacity", type=positive_int, help="rows the host cache holds")
    p.add_argument("--rows", type=positive_int, help="rows of a linear table (with --linear)")
    p.add_argument("--dim", type=positive_int, required=True, help="elements per row")
    p.add_argument("--dtype", choices=FORMATS, default="float32",
                   help="row dtype; int8 and float8_e4m3fn store rows quantized")
    p.add_argument("--ways", type=int, choices=(4, 8, 16, 32),
                   help="slots per bucket of a host cache (default 8)")
    p.add_argument(
        "--mode",
        type=_mode,
        default=0o600,
        help="octal permission bits of the segment and its lock file (0600)",
    )
    p.add_argument(
        "--ring-capacity",
        type=positive_int,
        help="records in the invalidation ring (default: HostCache.create's)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="create it even if it is larger than the free space of /dev/shm (the segment "
        "is sparse; a process that writes past the free space is killed)",
    )


def _create(args: argparse.Namespace, out: TextIO) -> int:
    try:
        return _create_table(args, out)
    except SharedMemoryFullError as e:
        if args.force or e.needed <= e.free:
            raise  # NOTE: --force was refused by the kernel itself (e.g. ENOMEM): say so
        what = "--rows" if args.linear else "--capacity"
        raise SharedMemoryFullError(
            f"table {args.name!r} needs {e.needed / 2**30:,.2f} GiB of shared memory but "
            f"{segment.SHM_DIR} has {e.free / 2**30:,.2f} GiB free: ask for a smaller {what}, "
            "remove tables you no longer need (`hostcache rm`), or pass --force to overcommit",
            needed=e.needed, free=e.free) from e


def _create_table(args: argparse.Namespace, out: TextIO) -> int:
    ring = layout.DEFAULT_RING_CAPACITY if args.ring_capacity is None else args.ring_capacity
    if args.linear:
        if args.rows is None or args.capacity is not None or args.ways is not None:
            raise BadArgumentError("create --linear takes --rows N (not --capacity or --ways)")
        g = layout.plan(layout.KIND_LINEAR, capacity=args.rows, dim=args.dim,
                        dtype=args.dtype, ring_capacity=ring)
    else:
        if args.capacity is None or args.rows is not None:
            raise BadArgumentError("create takes --capacity N (or --linear --rows N)")
        g = layout.plan(layout.KIND_HOST_CACHE, capacity=args.capacity, dim=args.dim,
                        dtype=args.dtype, ways=8 if args.ways is None else args.ways,
                        ring_capacity=ring)
    # NOTE: the segment as HostCache.create / SharedMemBlock.create make it, without a handle
    # (which would map the rows with torch); closed, never unlinked: the table stays
    segment.create(args.name, g, mode=args.mode, init=init_segment,
                   overcommit=args.force).close()
    shape = (
        f"capacity {g.capacity:,} ({g.num_buckets:,} buckets x {g.ways} ways)"
        if g.kind == layout.KIND_HOST_CACHE
        else f"{g.capacity:,} rows"
    )
    print(
        f"created {layout.KIND_NAMES[g.kind]} table {args.name}: {shape}, dim {g.dim}, "
        f"{g.dtype_name}, {g.total_size / view.MIB:.2f} MiB, mode {args.mode:04o}",
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
            table = view.open_table(args.name)
        except (SegmentNotFoundError, SegmentPermissionError):
            raise
        except HostCacheError:
            table = None  # a broken header: no process can attach it, remove it anyway
        if table is not None:
            try:
                pids = view.others(table)
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


def _save_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="table name")
    p.add_argument("file", help="the .safetensors file to write (rows as 'weight', keys as "
                   "'keys'); written beside and renamed into place")


def _save(args: argparse.Namespace, out: TextIO) -> int:
    segment.check_name(args.name)
    n = files.save(args.name, args.file)
    print(f"saved {n:,} rows of {args.name} to {args.file}", file=out)
    return EXIT_OK


def _restore_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="table name: created from the file's geometry if it does "
                   "not exist")
    p.add_argument("file", help="a .safetensors file `hostcache save` wrote, or a "
                   "torch.distributed.checkpoint directory (restored into a linear table)")
    p.add_argument("--tensor", metavar="NAME", help="the 2-D tensor of a DCP checkpoint, by "
                   "its fully qualified name (e.g. emb.weight); needed where it holds several")
    p.add_argument("--no-create", action="store_true",
                   help="restore only into an existing table")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="restore rows holding NaN or infinite values (refused by default)")


def _restore(args: argparse.Namespace, out: TextIO) -> int:
    segment.check_name(args.name)
    table = files.restore(args.name, args.file, create=not args.no_create,
                          allow_nonfinite=args.allow_nonfinite, tensor=args.tensor)
    with table:
        kind = layout.KIND_NAMES[table.geometry.kind]
    print(f"restored {args.file} into {kind} table {args.name}", file=out)
    return EXIT_OK


#: the table commands, in the order ``--help`` lists them (nvecache.apps.cli adds serve and demo).
COMMANDS: tuple[Command, ...] = (
    Command("ls", "list this node's tables", _ls_args, _ls),
    Command("stat", "one table's geometry, node-wide counters and processes", _stat_args, _stat),
    Command("create", "create a table and leave it on the node", _create_args, _create),
    Command("rm", "remove a table from the node", _rm_args, _rm),
    Command("save", "write a table's keys and rows to a .safetensors file", _save_args, _save),
    Command("restore", "write a saved table's rows into a table (created if need be)",
            _restore_args, _restore),
)


def build_parser(commands: Sequence[Command] = COMMANDS) -> argparse.ArgumentParser:
    """The argument parser with one subparser per :class:`Command`."""
    parser = OneLineParser(
        prog=PROG, description="Inspect and manage this node's shared embedding tables."
    )
    add_version(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd in commands:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.configure(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: list[str] | None = None, commands: Sequence[Command] = COMMANDS) -> int:
    """Run the ``hostcache`` command; returns the exit status (0 ok, 2 user error).

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
        commands: the subcommands it knows (default the table commands).
    """
    parser = build_parser(commands)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2), already printed
        return e.code if isinstance(e.code, int) else EXIT_USER_ERROR
    if args.command is None:
        names = ", ".join(cmd.name for cmd in commands)
        print(f"{PROG}: error: give a command: {names} (see `{PROG} --help`)", file=sys.stderr)
        return EXIT_USER_ERROR
    try:
        return int(args._run(args, sys.stdout))
    except HostCacheError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except BrokenPipeError:  # e.g. `hostcache ls | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
