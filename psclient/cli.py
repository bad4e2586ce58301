"""``psclient`` command line: list, load, inspect and drop parameter-server tables.

::

    psclient ls URL [--json]
    psclient load URL --table T FILE [--tensor NAME] [--format npy|safetensors|raw|dcp]
                  [--keys FILE] [--dim D] [--dtype DTYPE] [--batch-size N]
                  [--duplicates refuse|last] [--allow-nonfinite] [--progress|--no-progress]
    psclient dump URL --table T FILE [--format safetensors|npy] [--keys FILE]
                  [--progress|--no-progress]
    psclient stat URL --table T [--json]
    psclient drop URL --table T
    psclient upgrade URL --table T

Every error prints one line ``psclient: error: ...`` to stderr and exits 1 (2 for a bad
command line); nothing prints a traceback. A load's input is checked before the table is
created. A load into a new table creates it ``loading``: readers wait for it, other loads
join it; the last load to end publishes it, or drops it if no load succeeded, so a failed
or interrupted load never destroys rows another load is writing (a table that existed
keeps the rows inserted before a failure). ``ls``, ``stat`` and ``drop`` work on tables in
any state, and on data left without a table (psclient.loads). ``--dtype int8`` (or
``float8_e4m3fn``, ``fp8``) loads into a quantized table: float rows are quantized as they
are inserted, and a ``dump`` of such a table (its stored bytes) loads back bit for bit;
``ls`` and ``stat`` name a table's format as its dtype.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from nvecache.common import rows as row_formats
from nvecache.common.cli import EXIT_USAGE, OneLineParser, add_version, positive_int
from nvecache.common.lazy import deferred
from nvecache.common.names import TABLE_NAME_RULE
from psclient.errors import BadArgumentError, PSClientError, SchemaMismatchError, TableNotFoundError
from psclient.loads import LOADING, iso
from psclient.registry import connect, drop_orphans, list_orphans, list_tables, redact
from psclient.schema import DTYPES, dtype_name

if TYPE_CHECKING:
    from psclient.dump import default_keys_path, dump_table
    from psclient.loader import (
        check_finite_rows,
        check_rows,
        file_format,
        file_keys,
        open_keys,
        open_rows,
    )
else:  # NOTE: torch and the file readers and writers load when a command needs them
    check_finite_rows, check_rows, file_format, file_keys, open_keys, open_rows = (
        deferred("psclient.loader", f)
        for f in ("check_finite_rows", "check_rows", "file_format", "file_keys", "open_keys",
                  "open_rows"))
    default_keys_path, dump_table = (deferred("psclient.dump", f)
                                     for f in ("default_keys_path", "dump_table"))

PROG = "psclient"
EXIT_ERROR = 1
#: exit status of an interrupted command (128 + SIGINT, as a shell reports it)
EXIT_INTERRUPTED = 130

_URLS = f"""\
store URLs:
  file:///path/to/dir                     embedded LMDB store on this machine (no server)
  redis://[user:pass@]host:port/DB        one Redis server, database number DB (default 0)
  rediss://...                            the same over TLS (?ssl_ca_certs=/path/ca.pem)
  unix:///path/redis.sock[?db=N]          one Redis server on a unix socket
  redis+cluster://host:port[,host:port]   a Redis Cluster (rediss+cluster:// for TLS)
  Options go in the query, e.g. redis://host:6379/0?password=...&socket_timeout=5
  (docs/psclient.md lists them).

table names: {TABLE_NAME_RULE}.
"""


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG,
                      description="Create, fill, inspect and drop parameter-server tables.",
                      epilog=_URLS, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_version(p)
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    ls = sub.add_parser("ls", help="list the tables of a store, in any state (ready, "
                        "loading), and data left without a table", epilog=_URLS,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ls.add_argument("url", metavar="URL", help="the store (see store URLs below)")
    ls.add_argument("--json", action="store_true", help="print a JSON list")
    ld = sub.add_parser(
        "load", epilog=_URLS, formatter_class=argparse.RawDescriptionHelpFormatter,
        help="bulk-load rows from a .npy, .safetensors or raw binary file, or a DCP checkpoint",
        description="Insert every row of FILE into table T, creating the table if needed "
        "(from the file's row length and dtype unless --dim/--dtype say otherwise). Row i "
        "gets key i, or the i-th key of --keys.")
    ld.add_argument("url", metavar="URL", help="the store (see store URLs below)")
    ld.add_argument("--table", required=True, metavar="T", help="the table to load into")
    ld.add_argument("file", metavar="FILE", help="a .npy or .safetensors file of [N, dim] "
                    "rows, a raw file (.bin/.raw) of rows back to back, little-endian, or a "
                    "torch.distributed.checkpoint directory")
    ld.add_argument("--tensor", metavar="NAME", help="the tensor inside a .safetensors file, "
                    "or its fully qualified name in a DCP checkpoint (e.g. emb.weight)")
    ld.add_argument("--format", choices=["npy", "safetensors", "raw", "dcp"],
                    help="the file's format (default: by its suffix)")
    ld.add_argument("--keys", metavar="FILE", help="one key per row: a .npy of integers or "
                    "a raw file of little-endian int64 (default: row i gets key i)")
    ld.add_argument("--dim", type=positive_int, help="row length: creates a new table with it; "
                    "must match the file's rows and an existing table; gives a raw file's")
    ld.add_argument("--dtype", type=_format_arg, choices=row_formats.FORMATS,
                    help="row dtype of the table: the file's rows are converted to it, or "
                    "quantized for int8 and float8_e4m3fn (fp8) tables (default: the file's, "
                    "a dump's format, or the table's)")
    ld.add_argument("--batch-size", type=positive_int, default=65536, metavar="N",
                    help="rows per insert (65536)")
    ld.add_argument("--duplicates", choices=["refuse", "last"], default="refuse",
                    help="a key given to more than one row: refuse the load (the default), "
                    "or store the last row of each such key")
    ld.add_argument("--allow-nonfinite", action="store_true",
                    help="load rows holding NaN or infinite values (refused by default)")
    ld.add_argument("--progress", action="store_true",
                    help="show the progress bar even when stderr is not a terminal")
    ld.add_argument("--no-progress", action="store_true", help="no progress bar")
    du = sub.add_parser(
        "dump", epilog=_URLS, formatter_class=argparse.RawDescriptionHelpFormatter,
        help="write a table's keys and rows to a .safetensors or .npy file",
        description="Write every key and row of table T to FILE: a .safetensors file (rows "
        "as 'weight', keys as 'keys') or .npy rows with their keys in a second .npy (--keys, "
        "default NAME.keys.npy). The file is written beside and renamed into place. "
        "`psclient load` reads it back.")
    du.add_argument("url", metavar="URL", help="the store (see store URLs below)")
    du.add_argument("--table", required=True, metavar="T", help="the table to dump")
    du.add_argument("file", metavar="FILE", help="where to write: .safetensors or .npy")
    du.add_argument("--format", choices=["safetensors", "npy"],
                    help="the file's format (default: by its suffix)")
    du.add_argument("--keys", metavar="FILE", help="with .npy: where the keys go "
                    "(default: FILE's name with .keys.npy)")
    du.add_argument("--progress", action="store_true",
                    help="show the progress bar even when stderr is not a terminal")
    du.add_argument("--no-progress", action="store_true", help="no progress bar")
    st = sub.add_parser("stat", help="schema, row count and backend details of a table",
                        epilog=_URLS, formatter_class=argparse.RawDescriptionHelpFormatter)
    st.add_argument("url", metavar="URL", help="the store (see store URLs below)")
    st.add_argument("--table", required=True, metavar="T")
    st.add_argument("--json", action="store_true", help="print one JSON object")
    dr = sub.add_parser("drop", help="delete a table in any state (rows, schema, change "
                        "feed), or the data left under a name with no table",
                        epilog=_URLS, formatter_class=argparse.RawDescriptionHelpFormatter)
    dr.add_argument("url", metavar="URL", help="the store (see store URLs below)")
    dr.add_argument("--table", required=True, metavar="T")
    up = sub.add_parser(
        "upgrade", epilog=_URLS, formatter_class=argparse.RawDescriptionHelpFormatter,
        help="bring a table written by an older psclient to this layout",
        description="Upgrade table T to this psclient's layout (Redis layout 1 to 2: the rows "
        "stay, the old change feed is dropped, followers re-sync once). Stop every client of "
        "the older psclient first: its writes would not reach the new feed.")
    up.add_argument("url", metavar="URL", help="the store (see store URLs below)")
    up.add_argument("--table", required=True, metavar="T")
    return p


def _format_arg(text: str) -> str:
    """``--dtype``: a format's name, an alias (``fp8``, ``fp16``) read as its name; anything
    else is left to argparse's choices to refuse."""
    try:
        return row_formats.dtype_name(text, row_formats.FORMATS)
    except row_formats.RowFormatError:
        return text


def _open(url: str, table: str) -> Any:
    """Open an existing table in any state; a missing one is an error that says how to find
    tables."""
    try:
        return connect(url, table=table, partial=True)
    except TableNotFoundError as e:
        raise TableNotFoundError(
            f"no table {table!r} at {redact(url)}: `psclient ls URL` lists the tables there, "
            "`psclient load` creates one"
        ) from e


def _existing(url: str, table: str) -> tuple[int, str] | None:
    """(dim, dtype name) of the table if it exists, in any state, else None; creates
    nothing."""
    try:
        with connect(url, table=table, partial=True) as ps:
            return ps.dim, ps.schema.dtype
    except TableNotFoundError:
        return None


def _load(args: argparse.Namespace) -> int:
    # NOTE: everything is checked before the table is created, so a bad input changes nothing.
    fmt = file_format(args.file, args.format, cli=True)
    stored = _existing(args.url, args.table)
    if stored is not None:
        dim, dtype = stored
        asked = {"--dim": (args.dim, dim), "--dtype": (args.dtype, dtype)}
        diff = [f"{flag} {a}" for flag, (a, s) in asked.items() if a is not None and a != s]
        if diff:
            raise SchemaMismatchError(
                f"table {args.table!r} exists with dim {dim}, {dtype}; {' and '.join(diff)} "
                f"does not match: leave it out, load into another table, or drop it first "
                f"(psclient drop URL --table {args.table})")
    elif fmt == "raw":
        if args.dim is None:
            raise BadArgumentError(f"{args.file!r} is raw rows and table {args.table!r} does not "
                                   "exist: give its row length with --dim (and --dtype, "
                                   "default float32)")
        dim, dtype = args.dim, args.dtype or "float32"
    else:
        rows = open_rows(args.file, args.tensor, format=fmt, cli=True)
        if rows.stored is not None:
            # NOTE: a dump of a quantized table: its format and dim, from the file
            dim, dtype = args.dim or rows.stored.dim, args.dtype or rows.stored.dtype
        else:
            dim = args.dim or rows.dim
            try:
                dtype = args.dtype or dtype_name(rows.dtype)
            except BadArgumentError:
                raise BadArgumentError(
                    f"{rows.what} holds {str(rows.dtype).removeprefix('torch.')} rows; a table "
                    f"holds one of {', '.join(DTYPES)}: convert them on load with --dtype "
                    "float32 (or another)"
                ) from None
    quantized = dtype in row_formats.QUANTIZED
    stored_as = row_formats.torch_dtype(dtype)  # NOTE: a quantized table's: its format's
    # NOTE: a raw file holds what the table's writes take: float32 rows if it is quantized
    rows = open_rows(args.file, args.tensor, format=fmt, dim=dim, cli=True,
                     dtype=row_formats.torch_dtype("float32") if quantized else stored_as)
    check_rows(rows, dim, stored_as, table=args.table, convert=args.dtype is not None,
               cli=True)
    keys = file_keys(args.file, args.keys, fmt, args.tensor)
    ks = None if keys is None else open_keys(keys, rows.n, cli=True, duplicates=args.duplicates)
    if not args.allow_nonfinite or quantized:
        # NOTE: every row read once, before the table is created (a quantized table stores
        # finite rows only: its load reads them once more, ParameterServer.load)
        check_finite_rows(rows, stored_as, ks, batch_size=args.batch_size, cli=True, dim=dim)
    # NOTE: a new table is created `loading`, a loading one joined; the load's end publishes
    # it, leaves it to the loads still writing, or (last out, nothing loaded) drops it.
    with connect(args.url, table=args.table, dim=dim, dtype=dtype, loading=True) as ps:
        t0 = time.perf_counter()
        n = ps.load(args.file, keys=args.keys, tensor=args.tensor, format=fmt,
                    convert=args.dtype is not None, batch_size=args.batch_size,
                    progress=False if args.no_progress else True if args.progress else None,
                    duplicates=args.duplicates, allow_nonfinite=True)  # NOTE: rows checked
        dt = time.perf_counter() - t0
        state = ps.state()
    rate = f"in {dt:.2f} s ({n / max(dt, 1e-9):,.0f} rows/s)"
    if n.duplicates:
        print(f"loaded {args.table}: {n} rows read, {n.distinct} distinct keys stored, "
              f"{n.duplicates} duplicates (last wins) {rate}")
    else:
        print(f"loaded {n} rows into {args.table} {rate}")
    if state["state"] == LOADING:
        others = "; ".join(f"pid {x['pid']} on {x['host']}" for x in state["loads"])
        print(f"table {args.table} stays loading until the other loads end ({others})")
    return 0


def _dump(args: argparse.Namespace) -> int:
    if args.keys is not None and default_keys_path(args.file, args.format) is None:
        raise BadArgumentError("--keys is for .npy rows: a .safetensors file holds its keys")
    with _open(args.url, args.table) as ps:
        t0 = time.perf_counter()
        n = dump_table(ps, args.file, keys_path=args.keys, format=args.format, cli=True,
                       progress=False if args.no_progress else True if args.progress else None)
        dt = time.perf_counter() - t0
    where = args.keys or default_keys_path(args.file, args.format)
    keys = "" if where is None else f" (keys in {where})"
    print(f"dumped {n} rows of {args.table} to {args.file}{keys} in {dt:.2f} s")
    return 0


def _state_text(info: dict[str, Any]) -> str:
    """``ready``, or ``loading (pid 1234 on host since ...)``."""
    loads = info.get("loads") or []
    if not loads:
        return str(info.get("state", "ready"))
    return f"{info['state']} (" + "; ".join(
        f"pid {x['pid']} on {x['host']} since {x['since'] or '?'}"
        + (", not running" if x.get("running") is False else "") for x in loads) + ")"


#: per URL scheme, the module that reads what ``ls`` and ``stat`` show without opening a
#: table (no numpy, no redis-py); where it answers None, the table is opened
_PEEKS = {"file": "psclient.file.peek", "redis": "psclient.redis.peek",
          "unix": "psclient.redis.peek"}


def _peek(url: str, what: str, *args: str) -> Any:
    """``what(url, *args)`` of the scheme's peek module, or None (ask the library)."""
    module = _PEEKS.get(url.partition("://")[0].lower()) if "://" in url else None
    read = None if module is None else getattr(importlib.import_module(module), what, None)
    return None if read is None else read(url, *args)


def _stat_info(url: str, table: str, opener: Any) -> dict[str, Any]:
    """``stat()`` of the table, read by the scheme's peek module or else through
    ``opener(url, table)``, with its creation time as an ISO date."""
    info: dict[str, Any] | None = _peek(url, "stat", table)
    if info is None:
        with opener(url, table) as ps:
            info = ps.stat()
    info["created"] = iso(info.get("created"))
    return info


def _open_any(url: str, table: str) -> Any:
    """The table in any state (TableNotFoundError: there is none)."""
    return connect(url, table=table, partial=True)


def _stat(args: argparse.Namespace) -> int:
    info = _stat_info(args.url, args.table, _open)
    if args.json:
        print(json.dumps(info, sort_keys=True))
    else:
        info["state"] = _state_text(info)
        for k, v in info.items():
            if k != "loads":
                print(f"{k:14} {'-' if v is None else v}")
    return 0


_LS_KEYS = ("table", "dim", "dtype", "rows", "created", "state", "loads")


def _ls(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    names = _peek(args.url, "list_tables")
    for name in list_tables(args.url) if names is None else names:
        try:
            info = _stat_info(args.url, name, _open_any)
            rows.append({k: info[k] for k in _LS_KEYS})
        except TableNotFoundError:
            continue  # dropped between listing and opening
        except PSClientError as e:
            rows.append({"table": name, "error": str(e)})
    orphans = _peek(args.url, "list_orphans")
    for name, found in (list_orphans(args.url) if orphans is None else orphans).items():
        rows.append({"table": name, "state": "orphaned", "keys": found["keys"],
                     "rows": found["rows"]})
    rows.sort(key=lambda r: str(r["table"]))
    if args.json:
        print(json.dumps(rows))
        return 0
    if not rows:
        print(f"no tables at {redact(args.url)}")
        return 0
    head = ["TABLE", "DIM", "DTYPE", "ROWS", "CREATED", "STATE"]
    cells = []
    for r in rows:
        if "error" in r:
            cells.append([r["table"], "?", "?", "?", "-", f"cannot open: {r['error']}"])
        elif r["state"] == "orphaned":
            cells.append([r["table"], "?", "?", f"{r['rows']:,}", "-",
                          f"orphaned: {r['keys']} keys with no schema (psclient drop URL "
                          f"--table {r['table']} removes them)"])
        else:
            cells.append([r["table"], str(r["dim"]), r["dtype"], f"{r['rows']:,}",
                          r["created"] or "-", _state_text(r)])
    widths = [max(len(c[i]) for c in [head, *cells]) for i in range(len(head))]
    for line in [head, *cells]:
        print("  ".join(c.rjust(w) if i in (1, 3) else c.ljust(w)
                        for i, (c, w) in enumerate(zip(line, widths, strict=True))).rstrip())
    return 0


def _drop(args: argparse.Namespace) -> int:
    try:
        ps = _open(args.url, args.table)
    except TableNotFoundError:
        gone = drop_orphans(args.url, args.table)
        if not gone["keys"]:
            raise
        print(f"dropped the orphaned data of table {args.table} ({gone['rows']} rows in "
              f"{gone['keys']} keys with no schema)")
        return 0
    with ps:
        rows = ps.size()
        state = ps.state()
        ps.drop()
    was = "" if state["state"] == "ready" else f", {_state_text(state)}"
    print(f"dropped table {args.table} ({rows} rows{was})")
    return 0


def _upgrade(args: argparse.Namespace) -> int:
    try:
        ps = connect(args.url, table=args.table, upgrade=True)
    except TableNotFoundError as e:
        raise TableNotFoundError(f"no table {args.table!r} at {redact(args.url)}: "
                                 "`psclient ls URL` lists the tables there") from e
    with ps:
        print(f"table {args.table}: layout {ps.schema.layout}")
    return 0


def _exit_now(status: int) -> None:
    """End the process with ``status`` now: flush what was printed, ignore further Ctrl-C,
    skip the interpreter's teardown (stores are closed by then; the kernel frees the rest)."""
    with contextlib.suppress(ValueError):  # NOTE: not the main thread: no handler to change
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(status)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 error, 2 bad command line, 130
    interrupted).

    Called with no ``argv`` (the ``psclient`` program, ``python -m psclient.cli``), an
    interrupt (Ctrl-C) ends the process at once once its one line is printed: the
    interpreter's teardown of torch and numba would take seconds.
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help/--version (0) or a bad command line (2), already printed
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    if args.cmd is None:
        print(f"{PROG}: error: give a command: ls, load, stat, drop, upgrade or dump "
              f"(see `{PROG} --help`)", file=sys.stderr)
        return EXIT_USAGE
    try:
        return {"ls": _ls, "load": _load, "dump": _dump, "stat": _stat, "drop": _drop,
                "upgrade": _upgrade}[args.cmd](args)
    except PSClientError as e:
        print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"{PROG}: error: interrupted", file=sys.stderr)
        if argv is None:  # NOTE: the program's own process: nothing is left to tear down
            _exit_now(EXIT_INTERRUPTED)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # e.g. `psclient ls URL | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
