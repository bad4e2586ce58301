"""Layer benchmarks (issue 5) on the standard workload, each against its baseline in one run.

1. GPULayer plain and pooled, table in HBM, vs ``torch.nn.Embedding`` / ``EmbeddingBag``.
2. LinearUVM, table 10x the GPU cache in a registered SharedMemBlock, Zipf 1.05: keys/s,
   GPU hit rate, ratio to zero-copy ``index_select`` over the registered table (no cache).
3. Hierarchical over the file:// parameter server: steady-state keys/s and per-tier hit
   rates, and the cold-start cost (first batches) against the steady state.

Prints one JSON line per figure. Run: ``python bench/layers/bench_layers.py [--quick]``; on a
machine without CUDA it runs the CPU variants at small sizes (figures then say "cpu").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psclient  # noqa: E402
from bench.workloads import ZipfKeys, compiled_loops  # noqa: E402
from gpu import InsertPolicy, LayerType, NVEmbedding, NVEmbeddingBag, TierConfig  # noqa: E402
from gpu.kernels.tiles import DEFAULT_TILES  # noqa: E402
from gpu.stacks.linear_tables import registered_rows  # noqa: E402
from hostcache import HostCache, SharedMemBlock  # noqa: E402

DIM = 128
ROW_BYTES = DIM * 4


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def timed(fn: Callable[[], Any], device: torch.device, reps: int, *,
          wall: bool = False) -> float:
    """Seconds per call after warm-up: CUDA events through do_bench when available, or
    with ``wall`` the wall clock over back-to-back calls (what a serving loop sees: a
    layer's host-side work and syncs count; do_bench flushes L2 between calls and times
    each on the GPU)."""
    if wall and device.type == "cuda":
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        calls, t0 = 0, time.perf_counter()
        while calls < reps or time.perf_counter() - t0 < 0.3:
            fn()
            calls += 1
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / calls
    if device.type == "cuda":
        try:
            from triton.testing import do_bench

            return do_bench(fn, warmup=25, rep=100 if reps > 3 else 25) / 1e3
        except ImportError:
            pass
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def cycle(layer: Any, stream: list[torch.Tensor]) -> Callable[[], torch.Tensor]:
    """A call that looks the next batch of ``stream`` up (round robin)."""
    state = {"i": 0}

    def step() -> torch.Tensor:
        state["i"] += 1
        return layer(stream[state["i"] % len(stream)])

    return step


def keys_on(z: ZipfKeys, n: int, device: torch.device) -> torch.Tensor:
    return z.sample(n).to(device)


def gpu_layer(device: torch.device, rows: int, batches: list[int], reps: int) -> None:
    weights = torch.randn(rows, DIM, device=device)
    emb = NVEmbedding(rows, DIM, torch.float32, LayerType.GPULayer, weight_init=weights,
                      device=device)
    # the default checks keys on the device; validate=True on the host (one sync a call)
    emb_nv = NVEmbedding(rows, DIM, torch.float32, LayerType.GPULayer, storage=weights,
                         device=device, validate=True)
    base = torch.nn.Embedding.from_pretrained(weights)
    for alpha in (1.05, 0.0):
        z = ZipfKeys(rows, alpha, seed=1)
        for n in batches:
            keys = keys_on(z, n, device)
            assert torch.equal(emb(keys), base(keys)) and torch.equal(emb_nv(keys), base(keys))
            t = timed(cycle(emb, [keys]), device, reps)
            t_nv = timed(cycle(emb_nv, [keys]), device, reps)
            tb = timed(cycle(base, [keys]), device, reps)
            emit(bench="gpulayer_plain", device=device.type, alpha=alpha, batch=n,
                 mkps=n / t / 1e6, gbps=n * ROW_BYTES / t / 1e9, baseline="nn.Embedding",
                 baseline_mkps=n / tb / 1e6, ratio=tb / t,
                 host_validated_mkps=n / t_nv / 1e6, host_validated_ratio=tb / t_nv)
    bags, per_bag = (256, 1024) if device.type == "cuda" else (64, 256)
    bag = NVEmbeddingBag(rows, DIM, torch.float32, LayerType.GPULayer, weight_init=weights,
                         device=device, mode="sum")
    bag_nv = NVEmbeddingBag(rows, DIM, torch.float32, LayerType.GPULayer, storage=weights,
                            device=device, mode="sum", validate=True)
    base_bag = torch.nn.EmbeddingBag.from_pretrained(weights, mode="sum")
    for alpha in (1.05, 0.0):
        z = ZipfKeys(rows, alpha, seed=2)
        keys = keys_on(z, bags * per_bag, device).view(bags, per_bag)
        torch.testing.assert_close(bag(keys), base_bag(keys), rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(bag_nv(keys), base_bag(keys), rtol=1e-4, atol=1e-3)
        t = timed(cycle(bag, [keys]), device, reps)
        t_nv = timed(cycle(bag_nv, [keys]), device, reps)
        tb = timed(cycle(base_bag, [keys]), device, reps)
        n = keys.numel()
        emit(bench="gpulayer_pooled", device=device.type, alpha=alpha, bags=bags,
             keys_per_bag=per_bag, mkps=n / t / 1e6, gbps=n * ROW_BYTES / t / 1e9,
             baseline="nn.EmbeddingBag", baseline_mkps=n / tb / 1e6, ratio=tb / t,
             host_validated_mkps=n / t_nv / 1e6, host_validated_ratio=tb / t_nv)


def linear_uvm(device: torch.device, rows: int, batches: list[int], reps: int) -> None:
    name = f"bench-linear-{os.getpid()}"
    mb = SharedMemBlock.create(name, num_rows=rows, dim=DIM)
    try:
        chunk = 1 << 20
        for start in range(0, rows, chunk):  # fill in chunks (a few GiB)
            idx = torch.arange(start, min(rows, start + chunk))
            mb.write(idx, torch.randn(idx.numel(), DIM))
        cache_bytes = rows // 10 * (ROW_BYTES + 12)
        emb = NVEmbedding(rows, DIM, torch.float32, LayerType.LinearUVM,
                          gpu_cache_size=cache_bytes, storage=mb, device=device)
        # the registered zero-copy view (CPU: the tensor), this process's registration
        reg, table_view = registered_rows(mb, device)
        for n in batches:
            z = ZipfKeys(rows, 1.05, seed=3)
            # NOTE: enough distinct batches (16M keys in all) that the cycle's working set
            # dwarfs the cache: a few batches cycled would all end up cached (hit rate ~1)
            stream = [keys_on(z, n, device) for _ in range(max(8, (16 << 20) // n))]
            for keys in stream:  # warm the cache to steady state
                emb(keys)
            before = emb.stats().gpu
            t = timed(cycle(emb, stream), device, reps, wall=True)
            after = emb.stats().gpu
            hits, misses = after.hits - before.hits, after.misses - before.misses
            keys = stream[0]
            assert torch.equal(emb(keys), table_view.index_select(0, keys))
            tb = timed(lambda k=keys: table_view.index_select(0, k), device, reps, wall=True)
            extra: dict[str, Any] = {}
            if device.type == "cuda":
                # a layer over the same table with every batch visited in batch order, or
                # in host-page order (the default picks by batch size:
                # Tiles.linear_page_order), warmed the same way
                for label, from_n in (("batch_order", 0), ("page_order", 1)):
                    tiles = dataclasses.replace(DEFAULT_TILES, linear_page_order=from_n)
                    other = NVEmbedding(rows, DIM, torch.float32, LayerType.LinearUVM,
                                        gpu_cache_size=cache_bytes, storage=mb, device=device,
                                        tuning=TierConfig(tiles=tiles))
                    try:
                        for warm in stream:
                            other(warm)
                        assert torch.equal(other(keys), table_view.index_select(0, keys))
                        b = other.stats().gpu
                        ts = timed(cycle(other, stream), device, reps, wall=True)
                        a = other.stats().gpu
                    finally:
                        other.close()
                    vh, vm = a.hits - b.hits, a.misses - b.misses
                    extra.update({f"{label}_mkps": n / ts / 1e6, f"{label}_ratio": tb / ts,
                                  f"{label}_hit_rate": vh / max(1, vh + vm)})
            emit(bench="linear_uvm", device=device.type, alpha=1.05, batch=n, rows=rows,
                 cache_fraction=0.1, gpu_hit_rate=hits / max(1, hits + misses),
                 mkps=n / t / 1e6, gbps=n * ROW_BYTES / t / 1e9,
                 baseline="zero-copy index_select, no cache", baseline_mkps=n / tb / 1e6,
                 ratio=tb / t, **extra)
        emb.close()
        if reg is not None:
            reg.close()
    finally:
        mb.close()
        SharedMemBlock.unlink(name)


def redis_reachable(url: str) -> str | None:
    """None when a Redis answers at ``url``, else why not (one line)."""
    import redis

    try:
        redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2).ping()
    except (redis.RedisError, OSError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def hierarchical(device: torch.device, rows: int, batch: int, reps: int,
                 ps_url: str | None = None) -> None:
    """Hierarchical over the file:// PS (``ps_url`` None) or the given Redis URL."""
    name = f"bench-hier-{os.getpid()}"
    with tempfile.TemporaryDirectory() as tmp:
        url = ps_url or f"file://{tmp}/ps"
        ps = psclient.connect(url, table=name, dim=DIM, dtype=torch.float32)
        t0 = time.perf_counter()
        ps.load(torch.randn(rows, DIM), progress=False)
        load_s = time.perf_counter() - t0
        hc = HostCache.create(name, capacity=rows // 2, dim=DIM)
        try:
            emb = NVEmbedding(rows, DIM, torch.float32, LayerType.Hierarchical,
                              gpu_cache_size=rows // 10 * (ROW_BYTES + 12), host_cache=hc,
                              storage=ps, device=device,
                              insert_policy=InsertPolicy(host=1.0, gpu=1.0))
            z = ZipfKeys(rows, 1.05, seed=4)
            stream = [keys_on(z, batch, device) for _ in range(16)]
            # NOTE: compile the kernels first, then start from empty caches: the cold start
            # measured below is that of the caches, not of Triton's JIT
            emb(keys_on(z, batch, device))
            emb.clear()
            cold = []
            for keys in stream[:4]:
                t1 = time.perf_counter()
                emb(keys)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                cold.append(time.perf_counter() - t1)
            for keys in stream * 2:
                emb(keys)
            compiled_loops()  # NOTE: the compiled loops timed, not their twins
            s0 = emb.stats()
            t = timed(cycle(emb, stream), device, reps, wall=True)
            s1 = emb.stats()

            def rate(a: Any, b: Any) -> float:
                h, m = b.hits - a.hits, b.misses - a.misses
                return h / max(1, h + m)

            emit(bench="hierarchical_file_ps" if ps_url is None else "hierarchical_redis_ps",
                 device=device.type, alpha=1.05, batch=batch,
                 rows=rows, ps_load_s=load_s, ps_load_rows_per_s=rows / load_s,
                 mkps=batch / t / 1e6, gpu_hit_rate=rate(s0.gpu, s1.gpu),
                 host_hit_rate=rate(s0.host, s1.host) if s1.host else None,
                 ps_hit_rate=rate(s0.storage, s1.storage) if s1.storage else None,
                 cold_first_batch_ms=cold[0] * 1e3, steady_batch_ms=t * 1e3,
                 cold_over_steady=cold[0] / t)
            emb.close()
        finally:
            hc.close()
            HostCache.unlink(name)
            if ps_url is not None:
                ps.drop()  # a Redis table outlives the run otherwise
            ps.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--only", choices=["gpu", "linear", "hierarchical"], action="append",
                   help="run only these layer types (repeatable); default all")
    p.add_argument("--redis-url", default=os.environ.get("NVEC_BENCH_REDIS_URL",
                                                        "redis://127.0.0.1:6379/0"),
                   help="Redis for the Hierarchical layer's second run (skipped, with a "
                        "record saying why, when none answers)")
    args = p.parse_args(argv)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    parts = args.only or ["gpu", "linear", "hierarchical"]
    full = dev.type == "cuda" and not args.quick
    if "gpu" in parts:
        if full:
            gpu_layer(dev, rows=1 << 22, batches=[1 << 16, 1 << 18, 1 << 20], reps=20)
        else:
            gpu_layer(dev, rows=1 << 16, batches=[1 << 12, 1 << 14], reps=3)
    if "linear" in parts:
        if full:
            linear_uvm(dev, rows=1 << 22, batches=[1 << 16, 1 << 18, 1 << 20], reps=10)
        else:
            linear_uvm(dev, rows=1 << 16, batches=[1 << 12], reps=3)
    if "hierarchical" in parts:
        why = redis_reachable(args.redis_url)
        for url in (None, args.redis_url):
            if url is not None and why is not None:
                emit(bench="hierarchical_redis_ps", skipped=f"no Redis at {url}: {why}")
                continue
            if full:
                hierarchical(dev, rows=1 << 18, batch=1 << 16, reps=10, ps_url=url)
            else:
                hierarchical(dev, rows=1 << 14, batch=1 << 12, reps=3, ps_url=url)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
