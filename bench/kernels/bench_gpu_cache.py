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

Run: ``python bench/kernels/bench_gpu_cache.py [--quick] [--sweep]`` (needs CUDA and triton).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gpu.cache.gpu_cache import GPUCache  # noqa: E402
from gpu.cache.twin import COUNTER_MAX  # noqa: E402
from gpu.kernels.tiles import DEFAULT_TILES, Tiles  # noqa: E402
from gpu.kernels.triton_access import kernel_module  # noqa: E402
from hostcache.layout import EMPTY_KEY  # noqa: E402

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
        try:  # NOTE: lazy: cuda-python is optional (without it the UVA host pointer serves)
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
    import triton.testing  # NOTE: lazy: triton is optional (main() says so when missing)

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
    # NOTE: the baselines read the cache's own rows (same table size, same values), so the
    # pooled check can compare with EmbeddingBag over the slots of the looked-up keys.
    table = cache.tables.rows
    emb = torch.nn.Embedding.from_pretrained(table, freeze=True)
    bag = torch.nn.EmbeddingBag.from_pretrained(table, freeze=True, mode="sum",
                                                include_last_offset=True)
    plain = GPUCache(0, DIM, torch.float32, "cuda")  # the GPULayer path: a plain gather
    perm = torch.randperm(keys.numel(), device="cuda", generator=gen)
    with torch.no_grad():
        for dist, alpha in (("zipf", 1.05), ("uniform", 0.0)):
            for n in (1 << 16, 1 << 18, 1 << 20):
                pick = perm[zipf_ranks(keys.numel(), n, alpha, gen)]
                q, idx = keys[pick], slot_of[pick]
                got, hit = cache.lookup(q)
                assert bool(hit.all()) and torch.equal(got, cache.gather(idx))
                assert torch.equal(got, emb(idx))
                got0, hit0 = plain.lookup_linear(idx, table, validate=False, host_table=False)
                assert not bool(hit0.any()) and torch.equal(got0, got)
                t = bench(lambda q=q: cache.lookup(q), args.quick)
                tb = bench(lambda idx=idx: emb(idx), args.quick)
                t0 = bench(lambda idx=idx: plain.lookup_linear(idx, table, validate=False,
                                                               host_table=False), args.quick)
                emit(bench="lookup", dist=dist, batch=n, hit_rate=1.0,
                     baseline="torch.nn.Embedding", **figures(n, t, tb))
                emit(bench="plain_gather", what="GPUCache(0).lookup_linear (GPULayer path)",
                     dist=dist, batch=n, baseline="torch.nn.Embedding", **figures(n, t0, tb))
            n = 256 * 1024
            pick = perm[zipf_ranks(keys.numel(), n, alpha, gen)]
            q, idx = keys[pick], slot_of[pick]
            offsets = torch.arange(0, n + 1, 1024, device="cuda")
            ref = bag(idx, offsets)
            got, hit = cache.lookup_pooled(q, offsets, "sum")
            assert bool(hit.all())
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-3)
            got0, _ = plain.lookup_linear_pooled(idx, offsets, table, "sum")
            torch.testing.assert_close(got0, ref, rtol=1e-4, atol=1e-3)
            t = bench(lambda q=q, o=offsets: cache.lookup_pooled(q, o, "sum"), args.quick)
            t_nv = bench(lambda q=q, o=offsets: cache.lookup_pooled(q, o, "sum", validate=False),
                         args.quick)
            t0 = bench(lambda i=idx, o=offsets: plain.lookup_linear_pooled(
                i, o, table, "sum", validate=False), args.quick)
            tb = bench(lambda idx=idx, o=offsets: bag(idx, o), args.quick)
            emit(bench="pooled", dist=dist, bags=256, bag_size=1024, mode="sum",
                 baseline="torch.nn.EmbeddingBag", unvalidated_ratio=round(tb / t_nv, 3),
                 **figures(n, t, tb))
            emit(bench="plain_pooled", what="GPUCache(0).lookup_linear_pooled (GPULayer path)",
                 dist=dist, bags=256, bag_size=1024, mode="sum",
                 baseline="torch.nn.EmbeddingBag", **figures(n, t0, tb))
    if args.sweep:
        sweep(args, cache, keys, slot_of, gen)


def sweep(args: argparse.Namespace, cache: GPUCache, keys: torch.Tensor, slot_of: torch.Tensor,
          gen: torch.Generator) -> None:
    """Tile sizes and stages left out, by difference: kernel launches only, no validation.

    ``sat``: the policy counters set to ``COUNTER_MAX`` first (every slot saturated: no
    counter atomic at all); otherwise they hold what the run counted.
    """
    kernels = kernel_module("cache_lookup", interpret=False)
    pooled_kernels = kernel_module("cache_pooled", interpret=False)
    c = cache
    t = c.tables
    counted = t.counters.clone()

    def set_counters(sat: int) -> None:
        if sat:
            t.counters.fill_(COUNTER_MAX)
        else:
            t.counters.copy_(counted)

    lookup_configs = ((16, 4, 0), (16, 4, 1), (8, 2, 0), (8, 4, 0), (16, 2, 0), (32, 4, 0),
                      (32, 8, 0), (4, 1, 0), (8, 1, 0))
    # NOTE: the counters are clamped before the sweep's unsaturated adds could overflow
    # int32, as GPUCache does before its lookups
    added = [0]

    def will_count(n: int) -> None:
        added[0] += n
        if added[0] > 1 << 30:
            t.counters.clamp_max_(COUNTER_MAX)
            added[0] = 0

    try:
        for dist, alpha in (("zipf", 1.05), ("uniform", 0.0)):
            for n in (1 << 16, 1 << 20):
                pick = zipf_ranks(keys.numel(), n, alpha, gen)
                q, idx = keys[pick], slot_of[pick]

                def run(count: bool, gather: bool = True, q: torch.Tensor = q,
                        tiles: Tiles = DEFAULT_TILES) -> Any:
                    will_count(q.numel())
                    return kernels.lookup(q, t.tkeys, t.counters, t.rows, t.hits,
                                          c.num_buckets, c.ways, empty=EMPTY_KEY,
                                          gather=gather, count=count, want_slots=False,
                                          cmax=COUNTER_MAX, tiles=tiles)

                def plain(idx: torch.Tensor = idx, tiles: Tiles = DEFAULT_TILES) -> Any:
                    return kernels.lookup(idx, t.tkeys, t.counters, t.rows, t.hits, 0,
                                          c.ways, empty=EMPTY_KEY, gather=True, count=False,
                                          want_slots=False, table=t.rows, host_table=False,
                                          cmax=COUNTER_MAX, tiles=tiles)

                t_emb = bench(lambda idx=idx: torch.nn.functional.embedding(idx, t.rows),
                              True)
                for bk, warps, sat in lookup_configs:
                    tiles = dataclasses.replace(DEFAULT_TILES, lookup_block_k=bk,
                                                lookup_warps=warps)
                    set_counters(sat)
                    row = {}
                    fns = {"full": lambda tiles=tiles: run(True, tiles=tiles),
                           "no_count": lambda tiles=tiles: run(False, tiles=tiles),
                           "probe_only": lambda tiles=tiles: run(True, False, tiles=tiles),
                           "plain_gather": lambda tiles=tiles: plain(tiles=tiles)}
                    for what, fn in fns.items():
                        row[what] = round(n / bench(fn, True) / 1e6, 1)
                    emit(bench="sweep_lookup", dist=dist, block_k=bk, warps=warps,
                         saturated=sat, batch=n, emb_mkps=round(n / t_emb / 1e6, 1),
                         full_ratio=round(row["full"] * t_emb / n * 1e6, 3), **row)
                set_counters(0)
        n = 256 * 1024
        offsets = torch.arange(0, n + 1, 1024, device="cuda")
        pooled_configs = ((64, 8, 256, 0), (64, 8, 256, 1), (32, 4, 256, 0), (64, 8, 1024, 0),
                          (128, 8, 256, 0), (64, 4, 256, 0), (32, 8, 512, 0))
        for dist, alpha in (("zipf", 1.05), ("uniform", 0.0)):
            pick = zipf_ranks(keys.numel(), n, alpha, gen)
            q, idx = keys[pick], slot_of[pick]
            t_bag = bench(lambda idx=idx: torch.nn.functional.embedding_bag(
                idx, t.rows, offsets, mode="sum", include_last_offset=True), True)

            def pooled(count: bool, tiles: Tiles, q: torch.Tensor = q) -> Any:
                will_count(q.numel())
                return pooled_kernels.pooled(q, offsets, None, None, t.tkeys, t.counters,
                                             t.rows, t.hits, c.num_buckets, c.ways,
                                             mean=False, empty=EMPTY_KEY, count=count,
                                             cmax=COUNTER_MAX, tiles=tiles)

            def plain_pooled(tiles: Tiles, idx: torch.Tensor = idx) -> Any:
                return pooled_kernels.pooled(idx, offsets, None, None, t.tkeys, t.counters,
                                             t.rows, t.hits, 0, c.ways, mean=False,
                                             empty=EMPTY_KEY, table=t.rows, cmax=COUNTER_MAX,
                                             tiles=tiles)

            for bk, warps, programs, sat in pooled_configs:
                tiles = dataclasses.replace(DEFAULT_TILES, pooled_block_k=bk,
                                            pooled_warps=warps, pooled_programs=programs)
                set_counters(sat)
                tp = bench(lambda tiles=tiles: pooled(True, tiles), True)
                t_nc = bench(lambda tiles=tiles: pooled(False, tiles), True)
                t0 = bench(lambda tiles=tiles: plain_pooled(tiles), True)
                emit(bench="sweep_pooled", dist=dist, block_k=bk, warps=warps,
                     programs=programs, saturated=sat,
                     split=pooled_kernels.pooled_split(n, 256, tiles, DIM),
                     mkps=round(n / tp / 1e6, 1), ratio=round(t_bag / tp, 3),
                     no_count_mkps=round(n / t_nc / 1e6, 1), plain_mkps=round(n / t0 / 1e6, 1),
                     bag_mkps=round(n / t_bag / 1e6, 1))
            set_counters(0)
    finally:
        set_counters(0)


def same_contents(cache: GPUCache, tiles: Tiles) -> GPUCache:
    """A cache like ``cache``, holding the same keys, counters and rows, launched with
    ``tiles``."""
    other = GPUCache(cache.capacity * cache.slot_bytes, cache.dim, cache.dtype, cache.device,
                     ways=cache.ways, tiles=tiles)
    src, dst = cache.tables, other.tables
    for a, b in ((src.tkeys_all, dst.tkeys_all), (src.counters_all, dst.counters_all),
                 (src.rows_all, dst.rows_all)):
        b.copy_(a)
    return other


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
        # the same lookups with every batch visited in batch order, or in host-page order
        # (the default picks by batch size: Tiles.linear_page_order), by a cache holding
        # the same table state
        variants = {}
        for label, from_n in (("batch_order", 0), ("page_order", 1)):
            other = same_contents(cache, dataclasses.replace(DEFAULT_TILES,
                                                             linear_page_order=from_n))
            got_v, hit_v = other.lookup_linear(q, table)
            assert torch.equal(got_v, got) and torch.equal(hit_v, hit)
            t_v = bench(lambda q=q, other=other: other.lookup_linear(q, table), args.quick)
            variants[f"{label}_mkps"] = round(n / t_v / 1e6, 1)
            variants[f"{label}_ratio"] = round(tb / t_v, 3)
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
             **variants, **figures(n, t, tb))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small tables, short timing")
    parser.add_argument("--sweep", action="store_true", help="also sweep kernel tile sizes")
    parser.add_argument("--only", choices=["lookup", "linear"], action="append",
                        help="run only these parts (repeatable); default both")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu_cache needs a CUDA GPU (torch.cuda.is_available() is False); "
              "run it on the GPU machine", file=sys.stderr)
        return 2
    try:  # NOTE: lazy: triton is optional; the bench says what to install
        import triton  # noqa: F401
    except ImportError:
        print("bench_gpu_cache needs triton: pip install triton", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    emit(bench="env", device=torch.cuda.get_device_name(), torch=torch.__version__,
         triton=sys.modules["triton"].__version__, quick=args.quick, dim=DIM, dtype="float32")
    t0 = time.perf_counter()
    parts = args.only or ["lookup", "linear"]
    if "lookup" in parts:
        run_lookup(args, gen)
        torch.cuda.empty_cache()
    if "linear" in parts:
        run_linear(args, gen)
    emit(bench="done", wall_s=round(time.perf_counter() - t0, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
