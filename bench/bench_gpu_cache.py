"""GPU cache benchmark: lookups, pooled lookups and the LinearUVM fused miss path.

Each figure is measured against its baseline in the same run and printed as one JSON line
(MKPS = million keys per second, GB/s = keys/s x row bytes, ratio = ours / baseline):

1. ``lookup``: 100%-hit ``GPUCache.lookup`` vs ``torch.nn.Embedding`` over a table of the
   same number of slots in HBM, at 64k / 256k / 1M-key batches, Zipf 1.05 and uniform keys.
2. ``pooled``: ``GPUCache.lookup_pooled`` (256 bags x 1,024 keys, sum; probe + gather + pool
   in one kernel) vs ``torch.nn.EmbeddingBag`` over the same rows.
3. ``linear``: ``GPUCache.lookup_linear`` over a pinned host table (cache = 10% of rows,
   warmed by lookup + insert of the misses) vs ``torch.index_select`` of the pinned table
   read zero-copy with no cache; also the full cycle (lookup, then insert the misses).

Zero-copy view of pinned memory: ``torch.empty(..., pin_memory=True)`` is allocated with
``cudaHostAlloc``, which under unified virtual addressing (every 64-bit Linux CUDA
platform) is mapped into the device address space. The device pointer comes from
``cudaHostGetDevicePointer`` (``cuda.bindings.runtime``) when cuda-python is importable,
else it is the host pointer itself (UVA); a ``__cuda_array_interface__`` holder turns it
into a CUDA tensor that keeps the pinned tensor alive.

Run: ``python bench/bench_gpu_cache.py [--quick] [--sweep]`` (needs CUDA and triton).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu._triton import kernel_module  # noqa: E402
from gpu.cache import GPUCache  # noqa: E402

DIM = 128
ROW_BYTES = DIM * 4


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def zipf_ranks(n_items: int, batch: int, alpha: float, gen: torch.Generator) -> torch.Tensor:
    """Ranks in [0, n_items) drawn by inverse CDF (alpha 0 = uniform), on the GPU."""
    if alpha == 0:
        return torch.randint(0, n_items, (batch,), device="cuda", generator=gen)
    w = torch.arange(1, n_items + 1, device="cuda", dtype=torch.float64).pow_(-alpha)
    cdf = torch.cumsum(w, 0)
    cdf /= cdf[-1].clone()
    u = torch.rand(batch, device="cuda", dtype=torch.float64, generator=gen)
    return torch.searchsorted(cdf, u).clamp_max_(n_items - 1)


class _CudaView:
    """``__cuda_array_interface__`` over mapped pinned host memory; keeps ``owner`` alive."""

    def __init__(self, owner: torch.Tensor) -> None:
        self.owner = owner
        ptr = owner.data_ptr()
        self.how = "uva host pointer"
        try:
            from cuda.bindings import runtime as rt

            err, dptr = rt.cudaHostGetDevicePointer(ptr, 0)
            if int(err) == 0:
                ptr, self.how = int(dptr), "cudaHostGetDevicePointer"
        except ImportError:
            pass
        self.__cuda_array_interface__ = {
            "shape": tuple(owner.shape), "typestr": "<f4", "data": (ptr, False),
            "version": 3, "strides": None,
        }


def bench(fn: Any, quick: bool) -> float:
    """Median seconds per call."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=5 if quick else 25, rep=20 if quick else 100,
                                         return_mode="median")) / 1e3


def figures(n: int, t: float, t_base: float) -> dict[str, float]:
    return {"mkps": round(n / t / 1e6, 1), "gbps": round(n * ROW_BYTES / t / 1e9, 1),
            "base_mkps": round(n / t_base / 1e6, 1),
            "base_gbps": round(n * ROW_BYTES / t_base / 1e9, 1), "ratio": round(t_base / t, 3)}


def filled_cache(slots: int, gen: torch.Generator) -> tuple[GPUCache, torch.Tensor, torch.Tensor]:
    """A cache of ``slots`` slots filled to 70%; (cache, resident keys, their slots)."""
    cache = GPUCache(slots * (12 + ROW_BYTES), DIM, torch.float32, "cuda")
    n_keys = int(slots * 0.7)
    keys = torch.randint(0, 1 << 40, (n_keys,), device="cuda", generator=gen).unique()
    chunk = 1 << 20
    for s in range(0, keys.numel(), chunk):
        k = keys[s:s + chunk]
        cache.insert(k, torch.randn(k.numel(), DIM, device="cuda", generator=gen))
    slots_of = cache.probe(keys, record=False)
    resident = slots_of >= 0
    return cache, keys[resident], slots_of[resident]


def run_lookup(args: argparse.Namespace, gen: torch.Generator) -> None:
    slots = (1 << 21) if args.quick else (1 << 24)
    cache, keys, slot_of = filled_cache(slots, gen)
    emb = torch.nn.Embedding(cache.capacity, DIM, device="cuda")
    bag = torch.nn.EmbeddingBag(cache.capacity, DIM, mode="sum", include_last_offset=True,
                                _weight=emb.weight, device="cuda")
    perm = torch.randperm(keys.numel(), device="cuda", generator=gen)
    with torch.no_grad():
        for dist, alpha in (("zipf", 1.05), ("uniform", 0.0)):
            for n in (1 << 16, 1 << 18, 1 << 20):
                pick = perm[zipf_ranks(keys.numel(), n, alpha, gen)]
                q, idx = keys[pick], slot_of[pick]
                got, hit = cache.lookup(q)
                assert bool(hit.all()) and torch.equal(got, cache.gather(idx))
                t = bench(lambda q=q: cache.lookup(q), args.quick)
                tb = bench(lambda idx=idx: emb(idx), args.quick)
                emit(bench="lookup", dist=dist, batch=n, hit_rate=1.0,
                     baseline="torch.nn.Embedding", **figures(n, t, tb))
            n = 256 * 1024
            pick = perm[zipf_ranks(keys.numel(), n, alpha, gen)]
            q, idx = keys[pick], slot_of[pick]
            offsets = torch.arange(0, n + 1, 1024, device="cuda")
            ref = bag(idx, offsets)
            got, hit = cache.lookup_pooled(q, offsets, "sum")
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-3)
            t = bench(lambda q=q, o=offsets: cache.lookup_pooled(q, o, "sum"), args.quick)
            t_nv = bench(lambda q=q, o=offsets: cache.lookup_pooled(q, o, "sum", validate=False),
                         args.quick)
            tb = bench(lambda idx=idx, o=offsets: bag(idx, o), args.quick)
            emit(bench="pooled", dist=dist, bags=256, bag_size=1024, mode="sum",
                 baseline="torch.nn.EmbeddingBag", unvalidated_ratio=round(tb / t_nv, 3),
                 **figures(n, t, tb))
    if args.sweep:
        sweep(args, cache, keys, gen)


def sweep(args: argparse.Namespace, cache: GPUCache, keys: torch.Tensor,
          gen: torch.Generator) -> None:
    kernels = kernel_module("cache_kernels", interpret=False)
    saved = dict(kernels.CONFIG)
    q = keys[zipf_ranks(keys.numel(), 1 << 20, 1.05, gen)]
    for bk in (16, 32, 64):
        for warps in (2, 4, 8):
            kernels.CONFIG.update(lookup_block_k=bk, lookup_warps=warps)
            t = bench(lambda: cache.lookup(q), True)
            emit(bench="sweep_lookup", block_k=bk, warps=warps, batch=q.numel(),
                 mkps=round(q.numel() / t / 1e6, 1))
    n = 256 * 1024
    q = keys[zipf_ranks(keys.numel(), n, 1.05, gen)]
    offsets = torch.arange(0, n + 1, 1024, device="cuda")
    for bk in (32, 64, 128):
        for warps in (4, 8):
            for bd in (0, 64):
                kernels.CONFIG.update(pooled_block_k=bk, pooled_warps=warps, pooled_block_d=bd)
                t = bench(lambda: cache.lookup_pooled(q, offsets, validate=False), True)
                emit(bench="sweep_pooled", block_k=bk, warps=warps, block_d=bd or DIM,
                     mkps=round(n / t / 1e6, 1))
    kernels.CONFIG.clear()
    kernels.CONFIG.update(saved)


def pinned_copy_gbps(host: torch.Tensor, quick: bool) -> float:
    """Pinned host-to-device copy bandwidth, the ceiling of the host link."""
    dev = torch.empty_like(host, device="cuda")
    t = bench(lambda: dev.copy_(host, non_blocking=True), quick)
    return host.numel() * host.element_size() / t / 1e9


def run_linear(args: argparse.Namespace, gen: torch.Generator) -> None:
    rows = (1 << 19) if args.quick else (1 << 22)
    t0 = time.perf_counter()
    host = torch.empty((rows, DIM), dtype=torch.float32, pin_memory=True)
    host.copy_(torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, DIM))
    view_holder = _CudaView(host)
    table = torch.as_tensor(view_holder, device="cuda")
    setup_s = time.perf_counter() - t0
    copy_gbps = pinned_copy_gbps(host, args.quick)
    cache = GPUCache(int(rows * 0.1) * (12 + ROW_BYTES), DIM, torch.float32, "cuda")
    perm = torch.randperm(rows, device="cuda", generator=gen)
    for n in (1 << 16, 1 << 18, 1 << 20):
        cache.clear()
        warm = 40 if args.quick else 60
        for _ in range(warm):  # warm the cache as a layer would: look up, insert the misses
            k = perm[zipf_ranks(rows, n, 1.05, gen)]
            vals, hit = cache.lookup_linear(k, table)
            cache.insert(k[~hit], vals[~hit])
        q = perm[zipf_ranks(rows, n, 1.05, gen)]
        got, hit = cache.lookup_linear(q, table)
        assert torch.equal(got[:, 0], q.float()), "rows read zero-copy do not match the table"
        hit_rate = float(hit.float().mean())
        t = bench(lambda q=q: cache.lookup_linear(q, table), args.quick)
        tb = bench(lambda q=q: torch.index_select(table, 0, q), args.quick)
        batches = [perm[zipf_ranks(rows, n, 1.05, gen)] for _ in range(10)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for k in batches:
            vals, h = cache.lookup_linear(k, table)
            miss = ~h
            cache.insert(k[miss], vals[miss])
        end.record()
        torch.cuda.synchronize()
        t_cycle = start.elapsed_time(end) / 1e3 / len(batches)
        emit(bench="linear", dist="zipf", alpha=1.05, batch=n, table_rows=rows,
             cache_rows=cache.capacity, hit_rate=round(hit_rate, 4),
             baseline="zero-copy torch.index_select, no cache", pinned_copy_gbps=round(
                 copy_gbps, 1), view=view_holder.how, table_setup_s=round(setup_s, 2),
             cycle_mkps=round(n / t_cycle / 1e6, 1), cycle_ratio=round(tb / t_cycle, 3),
             **figures(n, t, tb))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small tables, short timing")
    parser.add_argument("--sweep", action="store_true", help="also sweep kernel tile sizes")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu_cache needs a CUDA GPU (torch.cuda.is_available() is False); "
              "run it on the GPU machine", file=sys.stderr)
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print("bench_gpu_cache needs triton: pip install triton", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    emit(bench="env", device=torch.cuda.get_device_name(), torch=torch.__version__,
         triton=sys.modules["triton"].__version__, quick=args.quick, dim=DIM, dtype="float32")
    t0 = time.perf_counter()
    run_lookup(args, gen)
    torch.cuda.empty_cache()
    run_linear(args, gen)
    emit(bench="done", wall_s=round(time.perf_counter() - t0, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
