"""Load throughput of a table from a file into a SharedMemBlock, against reading the file.

For each size (fp32 rows of ``--dim``), one run writes the table as a ``.safetensors`` file
and as a ``torch.distributed.checkpoint`` directory in a temporary folder, then measures,
in this order and ``--repeat`` times each (the best is reported):

* ``read``: the file's bytes read alone (``readinto`` 16 MiB at a time into one buffer,
  nothing kept): the floor any load pays;
* ``load``: :func:`hostcache.files.load_rows` into a fresh SharedMemBlock, the default load
  (every row read once for NaN/infinity before the first write, then written);
* ``load, unchecked``: the same with ``allow_nonfinite=True`` (one read, one write);
* for safetensors also ``restore``: :func:`hostcache.files.restore` of the same rows saved by
  ``hostcache save`` (keys and rows), the path that loaded a SharedMemBlock from a file
  before ``load_rows``.

GB/s is table bytes / seconds (10^9). The files are written just before they are read, so
the page cache is warm whenever they fit in free memory (the run says whether they did);
nothing is dropped. Every file and segment is removed at the end.

    python bench/bench_table_files.py                  # 256 MiB and 1 GiB
    python bench/bench_table_files.py --mib 64 --repeat 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from hostcache import SharedMemBlock, files

_NAMES = iter(range(1 << 30))
_BUF = bytearray(b"\1" * (16 << 20))  # NOTE: allocated and touched once, outside the timings


def fresh_name(tag: str) -> str:
    """A segment name of this process."""
    return f"{tag}-tf-{os.getpid()}-{next(_NAMES)}"


def _read_alone(path: Path) -> int:
    """Bytes of ``path`` (every file under it, for a directory) read once, nothing kept."""
    paths = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    buf = _BUF
    total = 0
    for p in paths:
        with p.open("rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total


def _best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _available() -> int:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) << 10


def run_size(mib: int, dim: int, repeat: int, root: Path) -> list[dict[str, object]]:
    n = (mib << 20) // (dim * 4)
    nbytes = n * dim * 4
    table = torch.randn(n, dim)
    st, ck, saved = root / "t.safetensors", root / "ck", root / "saved.safetensors"
    from safetensors.torch import save_file

    save_file({"emb.weight": table}, str(st))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch.distributed.checkpoint as dcp

        dcp.save({"emb.weight": table}, checkpoint_id=str(ck))
    name = fresh_name("bench")
    with SharedMemBlock.create(name, num_rows=n, dim=dim) as block:
        block.tensor.copy_(table)
        files.save(block, saved)
    SharedMemBlock.unlink(name)
    del table
    warm = _available() > 4 * nbytes
    out: list[dict[str, object]] = []

    def row(source: str, what: str, secs: float) -> None:
        out.append({"mib": mib, "dim": dim, "rows": n, "source": source, "what": what,
                    "s": round(secs, 4), "GB/s": round(nbytes / secs / 1e9, 3),
                    "page_cache_warm": warm})
        print(f"{mib:>5} MiB  {source:<12} {what:<17} {secs:7.3f} s  "
              f"{nbytes / secs / 1e9:6.2f} GB/s", flush=True)

    for source, path in (("safetensors", st), ("dcp", ck)):
        row(source, "read", _best(partial(_read_alone, path), repeat))
        name = fresh_name("bench")
        with SharedMemBlock.create(name, num_rows=n, dim=dim) as block:
            try:
                row(source, "load", _best(partial(files.load_rows, block, path), repeat))
                row(source, "load, unchecked",
                    _best(partial(files.load_rows, block, path, allow_nonfinite=True), repeat))
            finally:
                SharedMemBlock.unlink(name)

    def restore() -> None:
        name = fresh_name("bench")
        try:
            files.restore(name, saved).close()
        finally:
            SharedMemBlock.unlink(name)

    row("safetensors", "restore (saved)", _best(restore, repeat))
    for p in (st, saved):
        p.unlink()
    shutil.rmtree(ck)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, nargs="+", default=[256, 1024], help="table sizes")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the files go")
    ap.add_argument("--json", action="store_true", help="one JSON line per figure at the end")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {_available() >> 30} GiB available", flush=True)
    root = Path(tempfile.mkdtemp(prefix="bench-table-files-", dir=args.dir))
    rows: list[dict[str, object]] = []
    try:
        for mib in args.mib:
            rows += run_size(mib, args.dim, args.repeat, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        for r in rows:
            print(json.dumps(r))


if __name__ == "__main__":
    main()
