"""What a quantized host tier buys: bytes a row takes in a SharedMemBlock and a HostCache
(int8 and fp8 vs float32 at dim 128), and the hit rate a fixed host-memory budget buys
two replica processes sharing one HostCache (the same Zipf workload in each format).

Each replica (a spawned process) replays its own Zipf(alpha) stream of batches over
``keys`` keys: a lookup, then its misses inserted (``overwrite=False``, as a layer's fill
from the parameter server does); the hit rate is counted over the second half of the
batches (the first half warms the cache). The cache of each format is the largest whose
segment fits ``--budget-mib``. No GPU needed: the figures are the host tier's.

Prints one JSON line per figure. Run: ``python bench/bench_quantized_hostcache.py
[--budget-mib 64] [--keys 1000000] [--batches 200] [--batch 4096]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hostcache import HostCache, SharedMemBlock, layout  # noqa: E402
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--budget-mib", type=int, default=64)
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--alpha", type=float, default=1.05)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--batch", type=int, default=4096)
    args = ap.parse_args()
    budget = args.budget_mib << 20
    for dtype in FORMATS:
        name = fresh_name("bq")
        with SharedMemBlock.create(name, num_rows=100_000, dim=DIM, dtype=dtype) as mb:
            try:
                g = mb.geometry
                # NOTE: a quantized block's row versions lie just before its rows
                first = g.versions_off if mb.quantized else g.rows_off
                emit(bench="bytes_per_row", table="SharedMemBlock", dtype=str(dtype),
                     row_stride=g.row_stride, stored_bytes=g.row_format.stored_bytes,
                     version_bytes=(g.rows_off - g.versions_off) // g.capacity
                     if mb.quantized else 0,
                     segment_bytes_per_row=round((g.total_size - first) / g.capacity, 2))
            finally:
                SharedMemBlock.unlink(name)
    ctx = mp.get_context("spawn")
    for dtype in FORMATS:
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
