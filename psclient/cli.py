"""``psclient`` command line: load, stat, drop.

::

    psclient load URL --table T FILE [--tensor NAME] [--dim D --dtype float32] [--batch-size N]
    psclient stat URL --table T [--json]
    psclient drop URL --table T

Errors print one line to stderr and exit with status 1 (2 for usage errors).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from .errors import PSClientError
from .loader import open_rows
from .registry import connect
from .schema import dtype_name


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="psclient", description="Parameter-server tables.")
    sub = p.add_subparsers(dest="cmd", required=True)
    ld = sub.add_parser("load", help="bulk-load rows from a .npy or .safetensors file")
    ld.add_argument("url")
    ld.add_argument("--table", required=True)
    ld.add_argument("file")
    ld.add_argument("--tensor", help="tensor name inside a .safetensors file")
    ld.add_argument("--dim", type=int, help="row length (to create the table; default: file's)")
    ld.add_argument("--dtype", help="row dtype (to create the table; default: file's)")
    ld.add_argument("--batch-size", type=int, default=65536)
    ld.add_argument("--no-progress", action="store_true")
    st = sub.add_parser("stat", help="schema, row count and backend details of a table")
    st.add_argument("url")
    st.add_argument("--table", required=True)
    st.add_argument("--json", action="store_true")
    dr = sub.add_parser("drop", help="delete a table: rows, schema and change feed")
    dr.add_argument("url")
    dr.add_argument("--table", required=True)
    return p


def _load(args: argparse.Namespace) -> int:
    rows = open_rows(args.file, args.tensor)
    dim = args.dim or rows.dim
    dtype = dtype_name(args.dtype) if args.dtype else dtype_name(rows.dtype)
    with connect(args.url, table=args.table, dim=dim, dtype=dtype) as ps:
        t0 = time.perf_counter()
        n = ps.load(args.file, tensor=args.tensor, batch_size=args.batch_size,
                    progress=not args.no_progress)
        dt = time.perf_counter() - t0
    print(f"loaded {n} rows into {args.table} in {dt:.2f} s ({n / max(dt, 1e-9):,.0f} rows/s)")
    return 0


def _stat(args: argparse.Namespace) -> int:
    with connect(args.url, table=args.table) as ps:
        info = ps.stat()
    if args.json:
        print(json.dumps(info, sort_keys=True))
    else:
        for k, v in info.items():
            print(f"{k:14} {v}")
    return 0


def _drop(args: argparse.Namespace) -> int:
    ps = connect(args.url, table=args.table)
    rows = ps.size()
    ps.drop()
    print(f"dropped table {args.table} ({rows} rows)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        return {"load": _load, "stat": _stat, "drop": _drop}[args.cmd](args)
    except PSClientError as e:
        print(f"psclient {args.cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
