"""Host tier read from the GPU: lookups in a registered HostCache against the link's ceiling.

Prints one JSON line per result:

1. ``copy_ceiling``: pinned host-to-device copy bandwidth (256 MiB), measured in this run;
2. ``lookup``: ``gpu.kernels.host_reads.hostcache_lookup`` on a 2 GiB HostCache (fp32, dim 128,
   every queried key present) at 64k/256k/1M-key batches, Zipf 1.05 and uniform keys:
   keys/s, effective row bandwidth (keys/s x 512 B), its ratio to the copy ceiling, and
   the baselines in the same run: zero-copy ``index_select`` over the same registered rows
   (slots known in advance, no probe at all) and the same seqlock probe in torch ops;
   variants of ours (no dedup, no sort, no fence) show what each step is worth;
3. ``register``: ``cudaHostRegister`` time per GiB (fresh pages and already-touched pages)
   and ``attach_to_first_lookup`` for a 16 GiB segment in a freshly spawned process.

Usage: ``python3 bench/kernels/bench_host_tier.py [--quick]`` (needs CUDA; says so without it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import sys
import time
import uuid

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from gpu.cuda.registration import register  # noqa: E402
from gpu.kernels import host_reads as hk  # noqa: E402
from gpu.kernels.tiles import DEFAULT_TILES  # noqa: E402
from gpu.kernels.triton_access import kernel_module  # noqa: E402
from hostcache import HostCache, hashing, layout  # noqa: E402

DIM = 128
ROW_BYTES = DIM * 4


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def cuda_time(fn, reps: int, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def copy_ceiling(nbytes: int, reps: int) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    t = cuda_time(lambda: dev.copy_(host, non_blocking=True), reps)
    gbps = nbytes / t / 1e9
    emit(bench="copy_ceiling", what="pinned host-to-device copy", bytes=nbytes, s=t, GBps=gbps)
    return gbps


def fill(hc: HostCache, n: int, chunk: int = 1 << 20) -> None:
    keys = torch.randperm(n * 4)[:n] * 7 + 3  # spread-out keys
    for i in range(0, n, chunk):
        k = keys[i : i + chunk]
        hc.insert(k, k.to(torch.float32)[:, None].expand(-1, DIM).contiguous())


def zipf_ranks(n_items: int, batch: int, alpha: float, gen: torch.Generator) -> torch.Tensor:
    """Ranks in [0, n_items) drawn by inverse CDF of p(r) ~ (r + 1) ** -alpha."""
    if alpha == 0:
        return torch.randint(0, n_items, (batch,), generator=gen, device="cuda")
    w = torch.arange(1, n_items + 1, device="cuda", dtype=torch.float64).pow(-alpha)
    cdf = torch.cumsum(w, 0)
    cdf /= cdf[-1].clone()
    u = torch.rand(batch, generator=gen, device="cuda", dtype=torch.float64)
    return torch.searchsorted(cdf, u).clamp_(max=n_items - 1)


def slots_of(reg, keys: torch.Tensor) -> torch.Tensor:
    """Slot of each (present) key, computed once on the GPU for the index_select baseline."""
    g = reg.geometry
    b = hashing.bucket_of(keys, g.num_buckets)
    way = (reg.keys().view(-1, g.ways)[b] == keys[:, None]).to(torch.uint8).argmax(1)
    return b * g.ways + way


def bench_lookups(capacity: int, batches: list[int], reps: int, ceiling: float) -> None:
    name = f"bench-{uuid.uuid4().hex[:8]}"
    hc = HostCache.create(name, capacity=capacity, dim=DIM)
    try:
        t0 = time.perf_counter()
        fill(hc, int(capacity * 0.9))
        fill_s = time.perf_counter() - t0
        with register(hc, device="cuda") as reg:
            tab_keys = reg.keys()
            present = tab_keys[tab_keys != layout.EMPTY_KEY]
            present = present[torch.randperm(present.numel(), device="cuda")]
            emit(bench="host_tier_table", capacity=capacity, rows=int(present.numel()),
                 GiB=hc.geometry.total_size / 2**30, fill_s=fill_s)
            rows = reg.rows()
            g = reg.geometry
            kern = kernel_module("host_tier", interpret=False)
            gen = torch.Generator(device="cuda").manual_seed(0)
            for alpha in (1.05, 0.0):
                for batch in batches:
                    q = present[zipf_ranks(present.numel(), batch, alpha, gen)]
                    slots = slots_of(reg, q)
                    unique = int(torch.unique(q).numel())
                    values, hit = hk.hostcache_lookup(reg, q)
                    assert bool(hit.all()) and torch.equal(values[:, 0], q.to(torch.float32))
                    sorted_slots = torch.unique(slots)  # ascending = page order

                    def variant(q=q, **cfg):
                        tiles = dataclasses.replace(DEFAULT_TILES, **cfg)
                        return lambda: hk.hostcache_lookup(reg, q, tiles=tiles)

                    def sort_only(q=q):
                        skey = torch.empty_like(q)
                        kern.sort_key_kernel[(triton.cdiv(q.numel(), 1024),)](
                            q, skey, q.numel(), g.num_buckets, SHIFT=32, BLOCK=1024)
                        return torch.sort(skey).indices

                    runs = {
                        "ours": lambda q=q: hk.hostcache_lookup(reg, q),
                        "ours_bk32": variant(host_block_k=32),
                        "ours_bk64_w8": variant(host_block_k=64, host_warps=8),
                        "ours_unique_then_sort": variant(host_one_sort_max=0),
                        "ours_one_sort": variant(host_one_sort_max=1 << 40),
                        "ours_no_dedup": lambda q=q: hk.hostcache_lookup(reg, q, dedup=False),
                        "ours_no_fence": lambda q=q: hk.triton_lookup(reg, q, fence=False),
                        "stage_probe_only": lambda q=q: hk.triton_lookup(reg, q, gather=False),
                        "stage_sort_only": sort_only,
                        "ref_sorted_index_select_unique_rows": lambda s=sorted_slots:
                            rows.index_select(0, s),
                        "baseline_index_select": lambda s=slots: rows.index_select(0, s),
                        "baseline_torch_probe": lambda q=q: hk.hostcache_lookup(
                            reg, q, backend="torch"),
                    }
                    if batch <= 65536:
                        runs["ours_no_sort"] = lambda q=q: hk.hostcache_lookup(
                            reg, q, dedup=False, sort=False)
                    secs = {w: cuda_time(f, reps) for w, f in runs.items()}
                    base = secs["baseline_index_select"]
                    for what, s in secs.items():
                        gbps = batch * ROW_BYTES / s / 1e9
                        emit(bench="lookup", what=what, alpha=alpha, batch=batch,
                             unique_keys=unique, s=s, MKPS=batch / s / 1e6, GBps=gbps,
                             ratio_to_copy=gbps / ceiling, speedup_vs_index_select=base / s)
    finally:
        hc.close()
        HostCache.unlink(name)


def _first_lookup(name: str, batch: int, out) -> None:
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # CUDA context up before the clock starts
    kernel_module("host_tier", interpret=False)
    keys = torch.randint(0, 1 << 30, (batch,), device="cuda")
    t0 = time.perf_counter()
    hc = HostCache.attach(name)
    t1 = time.perf_counter()
    reg = register(hc, device="cuda")
    t2 = time.perf_counter()
    values, hit = hk.hostcache_lookup(reg, keys)
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    out.put({"attach_s": t1 - t0, "register_s": t2 - t1, "first_lookup_s": t3 - t2,
             "attach_to_first_lookup_s": t3 - t0, "hits": int(hit.sum())})
    reg.close()
    hc.close()


def bench_registration(gib: float) -> None:
    name = f"bench-{uuid.uuid4().hex[:8]}"
    capacity = int(gib * 2**30) // (ROW_BYTES + 20)
    hc = HostCache.create(name, capacity=capacity, dim=DIM)
    try:
        size = hc.geometry.total_size / 2**30
        fill(hc, min(capacity // 2, 1 << 20))
        t0 = time.perf_counter()
        reg = register(hc, device="cuda")
        fresh = time.perf_counter() - t0
        reg.close()
        t0 = time.perf_counter()
        reg = register(hc, device="cuda")
        again = time.perf_counter() - t0
        reg.close()
        emit(bench="register", GiB=size, first_s=fresh, first_s_per_GiB=fresh / size,
             again_s=again, again_s_per_GiB=again / size)
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        p = ctx.Process(target=_first_lookup, args=(name, 65536, out))
        p.start()
        res = out.get(timeout=300)
        p.join(timeout=60)
        emit(bench="attach_to_first_lookup", GiB=size, batch=65536, **res)
    finally:
        hc.close()
        HostCache.unlink(name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small tables and batches (seconds)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        emit(bench="host_tier", skipped="needs a CUDA GPU (torch.cuda.is_available() is False), "
             "cuda-python and triton; run it on the GPU machine")
        return 0
    if args.quick:
        ceiling = copy_ceiling(64 << 20, 5)
        parts = [(bench_lookups, (1 << 19, [65536], 3, ceiling)), (bench_registration, (0.5,))]
    else:
        ceiling = copy_ceiling(256 << 20, 10)
        parts = [
            (bench_lookups, (1 << 22, [65536, 262144, 1 << 20], 10, ceiling)),  # 2 GiB of rows
            (bench_registration, (16,)),
        ]
    failed = 0
    for fn, fn_args in parts:
        try:
            fn(*fn_args)
        except Exception as e:  # noqa: BLE001 - report and go on with the other parts
            emit(bench=fn.__name__, error=f"{type(e).__name__}: {e}")
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
