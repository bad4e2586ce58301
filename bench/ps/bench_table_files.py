"""Load throughput and memory of a table loaded from a file into a SharedMemBlock, against
reading the file alone.

For each size (fp32 rows of ``--dim``), one run writes the table as a ``.safetensors`` file
(one tensor, ``emb.weight``) and as a ``torch.distributed.checkpoint`` directory in a
temporary folder (from a source SharedMemBlock, a chunk at a time: the run never holds the
table in private memory), then, for each of the two, measures ``--repeat`` times (the best
is reported):

* ``read``: the file's bytes read alone (``readinto`` 1 MiB at a time into one page-aligned
  buffer that stays in the CPU's cache, nothing kept): the floor any load pays (a load also
  writes every byte to memory). The buffer is an anonymous ``mmap``: a ``bytearray``'s
  data sit 16 bytes past a page boundary, and the kernel's copy into a destination so
  aligned ran 3-4x slower on the development VM;
* ``load``: :func:`hostcache.files.load_rows` into a SharedMemBlock, the default load (every
  row read once for NaN/infinity before the first write, then read into the rows);
* ``load, unchecked``: the same with ``allow_nonfinite=True`` (one read).

The block is created once per source and loaded ``--repeat`` times, so its pages are in
memory after the first load (the best run is one that did not allocate them). GB/s is
table bytes / seconds (10^9). The files are written just before they are read: the page
cache is warm where they fit in free memory (each figure says whether the run thought so).
``--cold MIB ...``: for those sizes, also each figure once with the page cache dropped just
before it (``echo 1 > /proc/sys/vm/drop_caches``; root only; the NaN check's read warms the
cache for the write's read, as it would for any user).

Memory: for each size and source, a child process creates a SharedMemBlock, touches every
page of it, resets its peak RSS (``/proc/self/clear_refs``), takes its RSS as the baseline,
runs the default load, and reports the peak RSS (``VmHWM``) less the baseline: what the
load added to the process (buffers, mapped file pages), the block itself and the modules
a load imports (imported before the baseline) excluded.
``--no-rss`` skips it; ``--no-timing`` measures only that.

Every file and segment is removed at the end.

    python bench/ps/bench_table_files.py                       # 1, 2, 4 and 8 GiB
    python bench/ps/bench_table_files.py --mib 64 --repeat 1   # a smoke run
    python bench/ps/bench_table_files.py --mib 32768 --sources safetensors --repeat 1  # 32 GiB
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from hostcache import SharedMemBlock, files

_NAMES = iter(range(1 << 30))
_BUF = mmap.mmap(-1, 1 << 20)  # NOTE: page-aligned; touched once, outside the timings
_BUF.write(b"\1" * len(_BUF))
_CHUNK = 1 << 16


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


def _drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError:
        return False
    return True


def _best(fn: Callable[[], object], repeat: int, cold: bool = False) -> float:
    times = []
    for _ in range(repeat):
        if cold and not _drop_caches():
            raise SystemExit("--cold needs root (it writes /proc/sys/vm/drop_caches)")
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _available() -> int:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) << 10


#: the files a run loads from
SOURCES = ("safetensors", "dcp")


def _write_files(n: int, dim: int, st: Path, ck: Path | None) -> None:
    """The table (random fp32 rows) as one-tensor safetensors and (unless ``ck`` is None)
    DCP, a chunk at a time."""
    nbytes = n * dim * 4
    head = json.dumps({"emb.weight": {"dtype": "F32", "shape": [n, dim],
                                      "data_offsets": [0, nbytes]}}).encode()
    head = head.ljust(-(-len(head) // 8) * 8, b" ")
    name = fresh_name("src")
    g = torch.Generator().manual_seed(n)
    with SharedMemBlock.create(name, num_rows=n, dim=dim) as src:
        try:
            rows = src.tensor
            with st.open("wb") as f:
                f.write(len(head).to_bytes(8, "little") + head)
                for a in range(0, n, _CHUNK):
                    chunk = rows[a:a + _CHUNK]
                    chunk.normal_(generator=g)
                    f.write(chunk.numpy().data)
            if ck is None:
                return
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                import torch.distributed.checkpoint as dcp

                dcp.save({"emb.weight": rows}, checkpoint_id=str(ck))
        finally:
            SharedMemBlock.unlink(name)


def _child(path: str, n: int, dim: int) -> None:
    """One default load into a fresh, touched block; prints its RSS figures as JSON."""
    name = fresh_name("rss")
    with SharedMemBlock.create(name, num_rows=n, dim=dim) as block:
        try:
            block.tensor.zero_()  # NOTE: the block's pages in this process's RSS first
            # NOTE: what a load imports, imported before the baseline (a process pays it once)
            import torch.distributed.checkpoint  # noqa: F401
            import tqdm  # noqa: F401

            import psclient.loader  # noqa: F401

            # NOTE: ru_maxrss keeps the parent's peak across fork and exec: the peak is reset
            # (clear_refs 5) and read as VmHWM instead
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5\n")
            base = _status_kib("VmRSS")
            t0 = time.perf_counter()
            files.load_rows(block, path, progress=False)
            secs = time.perf_counter() - t0
            peak = _status_kib("VmHWM")
        finally:
            SharedMemBlock.unlink(name)
    print(json.dumps({"base_kib": base, "peak_kib": peak, "s": secs}))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(dict(line.split(":", 1) for line in f)[field].split()[0])


def _rss(path: Path, n: int, dim: int) -> dict[str, float]:
    flags = ["-S"] if sys.flags.no_site else []  # NOTE: a run of another tree (-S) stays one
    out = subprocess.run([sys.executable, *flags, __file__, "--child", str(path), "--rows", str(n),
                          "--dim", str(dim)], check=True, capture_output=True, text=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return {"extra_mib": round((got["peak_kib"] - got["base_kib"]) / 1024, 1),
            "base_mib": round(got["base_kib"] / 1024, 1)}


def run_size(mib: int, dim: int, repeat: int, root: Path, cold: bool, rss: bool,
             timing: bool = True, sources: tuple[str, ...] = SOURCES) -> list[dict[str, object]]:
    n = (mib << 20) // (dim * 4)
    nbytes = n * dim * 4
    st, ck = root / "t.safetensors", root / "ck"
    _write_files(n, dim, st, ck if "dcp" in sources else None)
    os.sync()  # NOTE: the files' writeback done before any figure
    warm = _available() > 3 * nbytes
    out: list[dict[str, object]] = []

    def row(source: str, what: str, secs: float, cache: str, base: float | None) -> float:
        gbs = nbytes / secs / 1e9
        ratio = f"{gbs / base:5.2f}x read" if base else ""
        out.append({"mib": mib, "dim": dim, "rows": n, "source": source, "what": what,
                    "s": round(secs, 4), "GB/s": round(gbs, 3), "cache": cache,
                    "ratio": round(gbs / base, 3) if base else None})
        print(f"{mib:>5} MiB  {source:<12} {cache:<4} {what:<16} {secs:7.3f} s  "
              f"{gbs:6.2f} GB/s  {ratio}", flush=True)
        return gbs

    modes = [("warm" if warm else "warm?", repeat, False)] + ([("cold", 1, True)] if cold else [])
    if not timing:
        modes = []
    for source, path in (("safetensors", st), ("dcp", ck)):
        if source not in sources:
            continue
        name = fresh_name("bench")
        with SharedMemBlock.create(name, num_rows=n, dim=dim) as block:
            try:
                for cache, times, drop in modes:
                    base = row(source, "read", _best(partial(_read_alone, path), times, drop),
                               cache, None)
                    row(source, "load", _best(partial(files.load_rows, block, path),
                                              times, drop), cache, base)
                    row(source, "load, unchecked",
                        _best(partial(files.load_rows, block, path, allow_nonfinite=True),
                              times, drop), cache, base)
            finally:
                SharedMemBlock.unlink(name)
        if rss:
            got = _rss(path, n, dim)
            out.append({"mib": mib, "source": source, "what": "rss", **got})
            print(f"{mib:>5} MiB  {source:<12} load adds {got['extra_mib']:8.1f} MiB to the "
                  f"process's peak RSS (baseline {got['base_mib']:.0f} MiB, block included)",
                  flush=True)
    st.unlink()
    shutil.rmtree(ck, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, nargs="+", default=[1024, 2048, 4096, 8192],
                    help="table sizes")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cold", type=int, nargs="*", default=[], metavar="MIB",
                    help="sizes also measured with the page cache dropped (root)")
    ap.add_argument("--no-rss", action="store_true", help="skip the memory measurement")
    ap.add_argument("--no-timing", action="store_true", help="only the memory measurement")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the files go")
    ap.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES),
                    help="which files to write and load (a large table: one, for disk)")
    ap.add_argument("--json", action="store_true", help="one JSON line per figure at the end")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.child:
        _child(args.child, args.rows, args.dim)
        return
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {_available() >> 30} GiB available, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="bench-table-files-", dir=args.dir))
    rows: list[dict[str, object]] = []
    try:
        for mib in args.mib:
            rows += run_size(mib, args.dim, args.repeat, root, mib in args.cold,
                             not args.no_rss, not args.no_timing, tuple(args.sources))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"# load average at the end: {os.getloadavg()[0]:.1f}")
    if args.json:
        for r in rows:
            print(json.dumps(r))


if __name__ == "__main__":
    main()
