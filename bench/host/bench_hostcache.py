"""Host cache on the CPU: throughput against index_select, reader scaling, hit rate vs LRU.

Three parts, each measured against its baseline in the same run:

1. ``lookup`` / ``insert`` throughput (keys/s, GB/s of rows) of one process for batches of
   1k-1M keys, dim 32 and 128, fp32. Lookups: every key present (100% hits), keys drawn
   uniformly from the cached ones; the ceiling is ``torch.index_select`` of the same rows
   from a plain contiguous tensor. Inserts: new keys into a full cache (every insert evicts
   through the policy); the ceiling is ``index_copy_`` of the rows into a plain tensor.
2. ``readers``: 1 and 2 spawned reader processes, each looking up its own key stream in the
   same attached HostCache for a fixed time; aggregate keys/s and the 2/1 ratio. Every
   reader (and the 1-process run) uses ``torch.set_num_threads(1)``: the machine may have
   only 2 cores, so one thread per process is the fair comparison. The same is measured for
   ``index_select`` over a SharedMemBlock (the machine's own scaling ceiling).
3. ``hit_rate``: the cache's policy against an exact LRU of the same capacity on the same
   trace (Zipf alpha 1.05, capacity 10% of the distinct keys; per batch: look up, then
   insert the misses).

Prints one JSON line per result, then a human-readable summary. ``--quick`` runs in seconds.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root

from bench.host.lru import ExactLRU  # noqa: E402
from bench.workloads import ZipfKeys  # noqa: E402
from hostcache import HostCache, SharedMemBlock  # noqa: E402

GOAL_LOOKUP_RATIO = 0.40  # of index_select, at 64k-key batches
GOAL_READER_SCALING = 1.7  # 2 readers over 1
GOAL_HIT_RATE_POINTS = 3.0  # within this many points of exact LRU
READER_BATCH = 65_536

results: list[dict[str, Any]] = []

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_heap_pages() -> bool:
    """Let glibc reuse freed heap pages for large tensors instead of mapping fresh ones.

    By default every allocation over 32 MiB is a new mmap whose pages fault in on first
    touch; on a VM that costs more than the copy itself (index_select of 64k x 512 B rows:
    28 ms with, 8 ms without). Both sides of every comparison allocate their outputs, so
    this changes the absolute figures, not who pays.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    return bool(ok)


def emit(record: dict[str, Any]) -> None:
    results.append(record)
    print(json.dumps(record), flush=True)


def git_state() -> str:
    """Commit of the checkout and whether hostcache/ has uncommitted changes."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "hostcache"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "unknown"
    return f"{head}{' (hostcache/ modified)' if dirty else ''}" if head else "unknown"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def median_times(
    *runs: tuple[Callable[[Any], object], Callable[[int], Any]],
    min_time: float,
    min_reps: int = 5,
    max_reps: int = 200,
) -> list[float]:
    """Median seconds of each ``run(setup(i))``, the runs interleaved call by call.

    Interleaving makes every side see the same background load (the machine may be
    shared), so the ratio stays fair when the load changes. One warm-up call each;
    ``setup`` is not timed.
    """
    for run, setup in runs:
        run(setup(-1))
    times: list[list[float]] = [[] for _ in runs]
    i = 0
    while i < max_reps and (i < min_reps or sum(map(sum, times)) < min_time):
        for (run, setup), ts in zip(runs, times, strict=True):
            arg = setup(i)
            t0 = time.perf_counter()
            run(arg)
            ts.append(time.perf_counter() - t0)
        i += 1
    return [statistics.median(ts) for ts in times]


def _none(_: int) -> None:
    return None


def rate(batch: int, seconds: float, row_bytes: int) -> dict[str, float]:
    return {
        "ms_per_batch": round(seconds * 1e3, 4),
        "mkeys_per_s": round(batch / seconds / 1e6, 3),
        "gb_per_s": round(batch * row_bytes / seconds / 1e9, 3),
    }


# -- 1. single-process throughput ------------------------------------------------------------


def filled_cache(name: str, num_keys: int, dim: int) -> tuple[HostCache, torch.Tensor]:
    """A cache holding (nearly) ``num_keys`` keys; returns it and the keys it holds."""
    hc = HostCache.create(name, capacity=2 * num_keys, dim=dim)
    try:
        gen = torch.Generator().manual_seed(dim)
        keys = torch.randint(0, 1 << 40, (num_keys,), generator=gen).unique()
        keys = keys[torch.randperm(keys.numel(), generator=gen)]
        for chunk in keys.split(65_536):
            hc.insert(chunk, torch.randn(chunk.numel(), dim, generator=gen))
        return hc, keys[hc.contains(keys)]
    except BaseException:
        hc.close()
        HostCache.unlink(name)
        raise


def lookup_case(
    hc: HostCache, present: torch.Tensor, plain: torch.Tensor, batch: int, min_time: float
) -> None:
    """Lookups of ``batch`` cached keys against index_select of the same rows of ``plain``."""
    dim = hc.geometry.dim
    idx = torch.randint(0, present.numel(), (batch,), generator=torch.Generator().manual_seed(1))
    keys = present[idx]
    values, hit = hc.lookup(keys)
    assert bool(hit.all()), "every key of the lookup benchmark must be cached"
    assert torch.equal(values, plain.index_select(0, idx)), "lookup returned other rows"
    t_hc, t_base = median_times(
        (lambda _: hc.lookup(keys), _none),
        (lambda _: plain.index_select(0, idx), _none),
        min_time=min_time,
    )
    emit({
        "bench": "lookup", "dim": dim, "batch": batch, "dtype": "float32",
        "table_rows": int(present.numel()), "hits": 1.0, "threads": torch.get_num_threads(),
        "hostcache": rate(batch, t_hc, dim * 4),
        "index_select": rate(batch, t_base, dim * 4),
        "ratio": round(t_base / t_hc, 3),
    })  # fmt: skip


def insert_case(hc: HostCache, batch: int, first_key: int, min_time: float) -> int:
    """Inserts of new keys into a full cache against index_copy_ of the rows into a plain
    tensor; returns the next unused key."""
    dim = hc.geometry.dim
    gen = torch.Generator().manual_seed(2)
    values = torch.randn(batch, dim, generator=gen)
    sink = torch.zeros(hc.geometry.capacity, dim)
    pos = torch.randint(0, sink.shape[0], (batch,), generator=gen)
    next_key = first_key

    def fresh(_: int) -> torch.Tensor:  # new keys every call: every insert evicts
        nonlocal next_key
        next_key += batch
        return torch.arange(next_key - batch, next_key, dtype=torch.int64)

    t_hc, t_base = median_times(
        (lambda k: hc.insert(k, values), fresh),
        (lambda _: sink.index_copy_(0, pos, values), _none),
        min_time=min_time,
    )
    emit({
        "bench": "insert", "dim": dim, "batch": batch, "dtype": "float32",
        "table_rows": hc.geometry.capacity, "threads": torch.get_num_threads(),
        "hostcache": rate(batch, t_hc, dim * 4),
        "index_copy": rate(batch, t_base, dim * 4),
        "ratio": round(t_base / t_hc, 3),
    })  # fmt: skip
    return next_key


def bench_throughput(
    name: str, dims: list[int], batches: list[int], min_time: float, table_bytes: int
) -> None:
    for dim in dims:
        hc, present = filled_cache(name, table_bytes // (dim * 4), dim)
        try:
            plain = hc.lookup(present)[0].contiguous()  # the same rows, in a plain tensor
            for batch in batches:
                lookup_case(hc, present, plain, batch, min_time)
            del plain
            next_key = 1 << 41  # above every key filled_cache drew
            for batch in batches:
                next_key = insert_case(hc, batch, next_key, min_time)
        finally:
            hc.close()
            HostCache.unlink(name)


# -- 2. reader processes ---------------------------------------------------------------------


def reader(
    wid: int, name: str, mb_name: str, present: torch.Tensor, heap: bool, cmds: Any, out: Any
) -> None:
    """Spawned reader: runs timed lookup phases on command, reports keys done and seconds."""
    torch.set_num_threads(1)
    if heap:
        keep_heap_pages()
    hc = HostCache.attach(name)
    mb = SharedMemBlock.attach(mb_name)
    gen = torch.Generator().manual_seed(100 + wid)
    idx = [torch.randint(0, present.numel(), (READER_BATCH,), generator=gen) for _ in range(8)]
    keys = [present[i] for i in idx]
    rows = mb.tensor
    hc.lookup(keys[0])
    rows.index_select(0, idx[0])
    out.put(("ready", wid))
    while (cmd := cmds.get()) is not None:
        mode, start_at, duration = cmd
        while time.time() < start_at:  # common start time of every reader of the phase
            time.sleep(0.0005)
        done = hits = 0
        t0 = time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < duration:
            j = done // READER_BATCH % len(keys)
            if mode == "hostcache":
                hits += int(hc.lookup(keys[j])[1].sum())
            else:
                rows.index_select(0, idx[j])
                hits += READER_BATCH
            done += READER_BATCH
        out.put((mode, wid, done, elapsed, hits))
    hc.close()
    mb.close()


def bench_readers(
    name: str, seconds: float, rounds: int, modes: list[str], table_bytes: int, heap: bool
) -> None:
    dim = 128
    hc, present = filled_cache(name, table_bytes // (dim * 4), dim)
    mb_name = name + "-linear"
    mb: SharedMemBlock | None = None
    ctx = mp.get_context("spawn")
    procs: list[Any] = []
    try:
        mb = SharedMemBlock.create(mb_name, num_rows=present.numel(), dim=dim)
        mb.tensor.copy_(hc.lookup(present)[0])
        cmds = [ctx.Queue() for _ in range(2)]
        out = ctx.Queue()
        procs = [
            ctx.Process(target=reader, args=(w, name, mb_name, present, heap, cmds[w], out))
            for w in range(2)
        ]
        for p in procs:
            p.start()
        for _ in procs:
            assert out.get(timeout=120)[0] == "ready"
        for mode in modes:
            runs: dict[int, list[tuple[float, float, list[float]]]] = {1: [], 2: []}
            for _ in range(rounds):  # 1 and 2 readers alternate, so both see the same load
                for n in (1, 2):
                    start_at = time.time() + 0.2
                    for w in range(n):
                        cmds[w].put((mode, start_at, seconds))
                    reports = [out.get(timeout=seconds + 120) for _ in range(n)]
                    per_proc = [r[2] / r[3] for r in reports]
                    hit_rate = sum(r[4] for r in reports) / sum(r[2] for r in reports)
                    runs[n].append((sum(per_proc), hit_rate, per_proc))
            agg = {}
            for n, rs in runs.items():
                agg[n] = statistics.median(r[0] for r in rs)
                emit({
                    "bench": "readers", "impl": mode, "processes": n, "dim": dim,
                    "batch": READER_BATCH, "threads_per_process": 1, "seconds": seconds,
                    "rounds": rounds, "mkeys_per_s": round(agg[n] / 1e6, 3),
                    "gb_per_s": round(agg[n] * dim * 4 / 1e9, 3),
                    "rounds_mkeys_per_s": [round(r[0] / 1e6, 3) for r in rs],
                    "per_process_mkeys_per_s": [[round(x / 1e6, 3) for x in r[2]] for r in rs],
                    "hit_rate": round(min(r[1] for r in rs), 4),
                })  # fmt: skip
            emit({
                "bench": "readers_scaling", "impl": mode,
                "ratio_2_over_1": round(agg[2] / agg[1], 3),
            })  # fmt: skip
        for q in cmds:
            q.put(None)
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        hc.close()
        HostCache.unlink(name)
        if mb is not None:
            mb.close()
            SharedMemBlock.unlink(mb_name)


# -- 3. hit rate against exact LRU -------------------------------------------------------------


def bench_hit_rate(name: str, num_keys: int, trace_len: int, batch: int) -> None:
    alpha = 1.05
    trace = ZipfKeys(num_keys, alpha, seed=7).sample(trace_len)
    distinct = int(trace.unique().numel())
    dim = 4
    hc = HostCache.create(name, capacity=max(distinct // 10, 8), dim=dim)
    try:
        capacity = hc.geometry.capacity  # rounded up to whole buckets; LRU gets the same
        lru = ExactLRU(capacity)
        hits = 0
        t0 = time.perf_counter()
        for keys in trace.split(batch):
            _, hit = hc.lookup(keys)
            hits += int(hit.sum())
            miss = keys[~hit]
            if miss.numel():
                hc.insert(miss, torch.zeros(miss.numel(), dim))
        t_hc = time.perf_counter() - t0
        t0 = time.perf_counter()
        lru.access(trace)
        t_lru = time.perf_counter() - t0
        ours = hits / trace_len
        emit({
            "bench": "hit_rate", "alpha": alpha, "key_space": num_keys, "trace_keys": trace_len,
            "distinct_keys": distinct, "capacity": capacity, "batch": batch,
            "policy": hc.geometry.policy, "ways": hc.geometry.ways,
            "hostcache": round(ours, 4), "exact_lru": round(lru.hit_rate, 4),
            "points_vs_lru": round(100 * (ours - lru.hit_rate), 2),
            "hostcache_seconds": round(t_hc, 2), "lru_seconds": round(t_lru, 2),
        })  # fmt: skip
    finally:
        hc.close()
        HostCache.unlink(name)


# -- summary -----------------------------------------------------------------------------------


def summary() -> str:
    lines = ["", "== host cache (CPU) summary =="]
    env = next((r for r in results if r["bench"] == "env"), None)
    end = next((r for r in results if r["bench"] == "env_end"), None)
    if env:
        lines.append(
            f"{env['cpu']}, {env['cores']} cores, torch {env['torch']}, {env['threads']} torch "
            f"thread(s); load average at start {env['loadavg_1_5_15'][0]}"
            + (f", at end {end['loadavg_1_5_15'][0]}" if end else "")
            + " (other work on the machine skews absolute figures; the ratios are interleaved)"
        )
    tp = [r for r in results if r["bench"] in ("lookup", "insert")]
    if tp:
        lines.append(
            f"{'op':<7} {'dim':>4} {'batch':>9} {'hostcache Mkeys/s':>18} {'GB/s':>7} "
            f"{'ceiling Mkeys/s':>16} {'GB/s':>7} {'ratio':>6}"
        )
        for r in tp:
            base = r.get("index_select") or r["index_copy"]
            lines.append(
                f"{r['bench']:<7} {r['dim']:>4} {r['batch']:>9,} "
                f"{r['hostcache']['mkeys_per_s']:>18.2f} {r['hostcache']['gb_per_s']:>7.2f} "
                f"{base['mkeys_per_s']:>16.2f} {base['gb_per_s']:>7.2f} {r['ratio']:>6.2f}"
            )
        lines.append(
            "ceiling: lookup = index_select from a plain tensor, insert = index_copy_ into one; "
            f"torch threads: {tp[0]['threads']}"
        )
        at64k = [r["ratio"] for r in tp if r["bench"] == "lookup" and r["batch"] == 65_536]
        if at64k:
            ok = min(at64k) >= GOAL_LOOKUP_RATIO
            lines.append(
                f"lookup ratio at 64k keys: {', '.join(f'{x:.2f}' for x in at64k)} "
                f"(goal >= {GOAL_LOOKUP_RATIO:.2f}: {'met' if ok else 'MISSED'})"
            )
    for r in results:
        if r["bench"] == "readers":
            lines.append(
                f"readers {r['impl']:<12} x{r['processes']}: {r['mkeys_per_s']:.2f} Mkeys/s "
                f"({r['gb_per_s']:.2f} GB/s), batch {r['batch']:,}, median of {r['rounds']} "
                "round(s); torch.set_num_threads(1) in every reader for a fair 1-vs-2 comparison"
            )
        elif r["bench"] == "readers_scaling":
            goal = ""
            if r["impl"] == "hostcache":
                ok = r["ratio_2_over_1"] >= GOAL_READER_SCALING
                goal = f" (goal >= {GOAL_READER_SCALING}: {'met' if ok else 'MISSED'})"
            lines.append(f"readers {r['impl']:<12} 2/1 = {r['ratio_2_over_1']:.2f}{goal}")
        elif r["bench"] == "hit_rate":
            ok = abs(r["points_vs_lru"]) <= GOAL_HIT_RATE_POINTS or r["points_vs_lru"] > 0
            lines.append(
                f"hit rate (Zipf {r['alpha']}, capacity {r['capacity']:,} = 10% of "
                f"{r['distinct_keys']:,} distinct, {r['trace_keys']:,} keys): hostcache "
                f"{r['hostcache']:.4f} vs exact LRU {r['exact_lru']:.4f} "
                f"({r['points_vs_lru']:+.2f} points; goal within {GOAL_HIT_RATE_POINTS:.0f}: "
                f"{'met' if ok else 'MISSED'})"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few-second smoke run")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch threads of the single-process part (default 1: on a small shared machine "
        "a second OpenMP thread mostly waits for a busy core; both sides use the same)",
    )  # fmt: skip
    parser.add_argument(
        "--no-mallopt", action="store_true",
        help="keep glibc's default of a fresh mmap (page faults) for every tensor over 32 MiB",
    )  # fmt: skip
    parser.add_argument(
        "--only", choices=["throughput", "readers", "hit_rate"], action="append",
        help="run only these parts (repeatable); default all",
    )  # fmt: skip
    args = parser.parse_args(argv)
    parts = args.only or ["throughput", "readers", "hit_rate"]
    name = f"bench-{os.getpid()}"
    heap = not args.no_mallopt and keep_heap_pages()
    emit({
        "bench": "env", "quick": args.quick, "cpu": cpu_name(), "cores": os.cpu_count(),
        "torch": torch.__version__, "threads": args.threads, "mallopt_heap_reuse": heap,
        "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()], "git": git_state(),
    })  # fmt: skip
    torch.set_num_threads(args.threads)
    dims = [32, 128]
    if args.quick:
        batches, min_time, table_bytes = [4096, 65_536], 0.05, 64 << 20
        reader_seconds, reader_rounds, reader_modes = 0.5, 1, ["hostcache"]
        hit_configs = [(100_000, 200_000, 1024)]
    else:
        batches, min_time, table_bytes = (
            [1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20],
            0.5,
            256 << 20,
        )
        reader_seconds, reader_rounds, reader_modes = 2.0, 3, ["hostcache", "index_select"]
        hit_configs = [(100_000, 200_000, 1024), (1_000_000, 2_000_000, 4096)]
    if "throughput" in parts:
        bench_throughput(name, dims, batches, min_time, table_bytes)
    if "readers" in parts:
        bench_readers(name, reader_seconds, reader_rounds, reader_modes, table_bytes, heap)
    if "hit_rate" in parts:
        for config in hit_configs:
            bench_hit_rate(name, *config)
    emit({"bench": "env_end", "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()]})
    print(summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
