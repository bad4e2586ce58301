"""What a quantized host tier buys: bytes a row takes in a SharedMemBlock and a HostCache
(int8 and fp8 vs float32 at dim 128), and the hit rate a fixed host-memory budget buys
two replica processes sharing one HostCache (the same Zipf workload in each format).

Each replica (a spawned process) replays its own Zipf(alpha) stream of batches over
``keys`` keys: a lookup, then its misses inserted (``overwrite=False``, as a layer's fill
from the parameter server does); the hit rate is counted over the second half of the
batches (the first half warms the cache). The cache of each format is the largest whose
segment fits ``--budget-mib``. No GPU needed: the figures are the host tier's.

A third part times what a quantized block's seqlock versions cost its CPU readers and
writers (``versions``).

Prints one JSON line per figure. Run: ``python bench/quantized/bench_quantized_hostcache.py
[--only bytes|versions|hit_rate] [--budget-mib 64] [--keys 1000000] [--batches 200]
[--batch 4096] [--reps 200]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hostcache import HostCache, SharedMemBlock, layout, row_versions  # noqa: E402
from nvecache.apps.demo.workload import ZipfKeys  # noqa: E402
from tests.conftest import fresh_name  # noqa: E402

DIM = 128
FORMATS = (torch.float32, torch.int8, torch.float8_e4m3fn)


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def capacity_for(budget: int, dtype: torch.dtype, ways: int = 8) -> int:
    """The largest host-cache capacity (whole buckets) whose segment fits ``budget``."""
    lo, hi = ways, budget  # NOTE: a bisection over capacities, not a loop over rows
    while lo < hi:
        mid = (lo + hi + 1) // 2
        geo = layout.plan(layout.KIND_HOST_CACHE, capacity=mid, dim=DIM, dtype=dtype,
                          ways=ways)
        lo, hi = (mid, hi) if geo.total_size <= budget else (lo, mid - 1)
    return lo // ways * ways


def rows_of(keys: torch.Tensor) -> torch.Tensor:
    """A row per key, the same in every process (what a parameter server would return)."""
    j = torch.arange(DIM, dtype=torch.float32)
    return torch.sin(keys.float()[:, None] * 0.001 + j[None, :])


def replica(name: str, keys: int, alpha: float, seed: int, batches: int, batch: int,
            out: Any) -> None:
    # NOTE: one popularity order for every replica, each its own draws
    z = ZipfKeys(keys, alpha, popularity_seed=1, seed=seed)
    hits = looked = 0
    with HostCache.attach(name) as hc:
        for b in range(batches):
            k = torch.unique(z.sample(batch))
            _, hit = hc.lookup(k)
            miss = k[~hit]
            if miss.numel():
                hc.insert(miss, rows_of(miss), overwrite=False)
            if b >= batches // 2:
                hits += int(hit.sum())
                looked += k.numel()
    out.put((seed, hits, looked))


def _alternating_p50(calls: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Microseconds, p50 of ``reps`` calls of each, the calls alternating call by call."""
    ts: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(reps):
        for k, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            ts[k].append(time.perf_counter() - t0)
    return {k: sorted(v)[len(v) // 2] * 1e6 for k, v in ts.items()}


def _versioned_calls(mb: SharedMemBlock, idx: torch.Tensor, reps: int) -> dict[str, float]:
    """The p50s of :func:`versioned_reads` for one batch of row indices."""
    rows, versions = mb.tensor, mb.versions
    assert versions is not None
    uidx = torch.unique(idx)
    new = rows.index_select(0, uidx)
    # NOTE: reads alternate with reads, writes with writes
    p50 = _alternating_p50({
        "read_versioned": lambda: row_versions.read_rows(rows, idx, versions),
        "read_plain": lambda: rows.index_select(0, idx)}, reps)
    # NOTE: on its own: the decode's worker threads would slow the gathers beside it
    p50.update(_alternating_p50({"read_decoded": lambda: mb.read(idx)}, reps))
    p50.update(_alternating_p50({
        "write_versioned": lambda: mb._store_at(uidx, new),
        "write_plain": lambda: rows.index_copy_(0, uidx, new)}, reps))
    return p50


def versioned_reads(reps: int) -> None:
    """What a quantized block's row versions cost its CPU readers and writers: a gather of
    1k / 16k / 64k random rows' stored bytes under the versions (``SharedMemBlock.read``'s
    path) against the same gather without them, beside the whole ``read`` (gather and
    decode); and a write of those rows' bytes with and without its write sections (p50 of
    ``reps`` calls, alternating)."""
    name = fresh_name("bv")
    with SharedMemBlock.create(name, num_rows=1 << 20, dim=DIM, dtype=torch.int8) as mb:
        try:
            mb.write_range(0, torch.randn(1 << 20, DIM))
            gen = torch.Generator().manual_seed(3)
            for n in (1 << 10, 1 << 14, 1 << 16):
                idx = torch.randint(0, 1 << 20, (n,), generator=gen)
                p50 = _versioned_calls(mb, idx, reps)
                emit(bench="versioned_reads", rows=n,
                     **{f"{k}_us": round(v, 1) for k, v in p50.items()},
                     read_ratio=round(p50["read_versioned"] / p50["read_plain"], 2),
                     write_ratio=round(p50["write_versioned"] / p50["write_plain"], 2))
        finally:
            SharedMemBlock.unlink(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--budget-mib", type=int, default=64)
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--alpha", type=float, default=1.05)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--only", choices=("bytes", "versions", "hit_rate"), action="append",
                    help="run only these parts (repeatable)")
    ap.add_argument("--reps", type=int, default=200, help="calls timed per versioned p50")
    args = ap.parse_args()
    parts = set(args.only or ("bytes", "versions", "hit_rate"))
    budget = args.budget_mib << 20
    if "versions" in parts:
        versioned_reads(args.reps)
    for dtype in FORMATS if "bytes" in parts else ():
        name = fresh_name("bq")
        with SharedMemBlock.create(name, num_rows=100_000, dim=DIM, dtype=dtype) as mb:
            try:
                g = mb.geometry
                # NOTE: a quantized block's rows carry their versions in their stride
                emit(bench="bytes_per_row", table="SharedMemBlock", dtype=str(dtype),
                     row_stride=g.row_stride, stored_bytes=g.row_format.stored_bytes,
                     version_bytes=4 if g.row_versions else 0,
                     segment_bytes_per_row=round((g.total_size - g.rows_off) / g.capacity,
                                                 2))
            finally:
                SharedMemBlock.unlink(name)
    ctx = mp.get_context("spawn")
    for dtype in FORMATS if "hit_rate" in parts else ():
        cap = capacity_for(budget, dtype)
        name = fresh_name("bq")
        with HostCache.create(name, capacity=cap, dim=DIM, dtype=dtype) as hc:
            try:
                g = hc.geometry
                per_slot = g.row_stride + 8 + 8 + 4  # row, key, seqlock version, counter
                out = ctx.Queue()
                procs = [ctx.Process(target=replica, args=(
                    name, args.keys, args.alpha, seed, args.batches, args.batch, out))
                    for seed in (11, 12)]
                for p in procs:
                    p.start()
                got = [out.get(timeout=3600) for _ in procs]
                for p in procs:
                    p.join(timeout=60)
                hits, looked = sum(x[1] for x in got), sum(x[2] for x in got)
                emit(bench="hit_rate_at_budget", dtype=str(dtype), budget_mib=args.budget_mib,
                     capacity=g.capacity, bytes_per_slot=per_slot,
                     segment_mib=round(g.total_size / 2**20, 2), replicas=len(procs),
                     keys=args.keys, alpha=args.alpha, distinct_lookups=looked,
                     hit_rate=round(hits / max(1, looked), 4),
                     per_replica=[round(x[1] / max(1, x[2]), 4) for x in sorted(got)])
            finally:
                HostCache.unlink(name)


if __name__ == "__main__":
    main()
