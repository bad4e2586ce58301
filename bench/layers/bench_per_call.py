"""Per-call path of the layers (issue 14): what a serving process sees, against torch.

Default constructor arguments everywhere. For each layer type: p50/p99 latency per call
(a sync after each call, distinct Zipf 1.05 batches) against ``nn.Embedding`` on the same
keys (measured one layer after the other, and again with the two layers' calls
alternating, so that the machine's drift falls on both alike), back-to-back wall-clock
throughput over distinct batches, LinearUVM's warm-up, the
first forward after construction (a fresh process, Triton's kernel cache warm), where a
GPULayer call's host time goes (``--only host``), the gather's launch settings swept
(``--only tiles``, not in the default set), and
``torch.compile``. Prints one JSON line per figure. Run on a CUDA machine:
``python bench/layers/bench_per_call.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.workloads import ZipfKeys  # noqa: E402
from gpu import LayerType, NVEmbedding, NVEmbeddingBag  # noqa: E402
from gpu.cuda.registration import register  # noqa: E402
from hostcache import SharedMemBlock  # noqa: E402

DIM = 128
DEV = torch.device("cuda")


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def per_call(fn: Callable[[torch.Tensor], Any], batches: list[torch.Tensor],
             reps: int, wait: Callable[[], None] = torch.cuda.synchronize
             ) -> tuple[float, float]:
    """(p50, p99) in microseconds of one call followed by ``wait`` (a device-wide sync
    unless said), over distinct batches."""
    for b in batches[:3]:
        fn(b)
    torch.cuda.synchronize()
    ts = []
    for i in range(reps):
        b = batches[i % len(batches)]
        t0 = time.perf_counter()
        fn(b)
        wait()
        ts.append(time.perf_counter() - t0)
    return p50_p99(ts)


def p50_p99(ts: list[float]) -> tuple[float, float]:
    """(p50, p99) in microseconds of call times in seconds."""
    ts = sorted(ts)
    return ts[len(ts) // 2] * 1e6, ts[min(len(ts) - 1, int(len(ts) * 0.99))] * 1e6


def interleaved(fns: list[Callable[[torch.Tensor], Any]], batches: list[torch.Tensor],
                reps: int, wait: Callable[[], None] = torch.cuda.synchronize
                ) -> list[tuple[float, float]]:
    """(p50, p99) in microseconds of each of ``fns``, their calls alternating one by one
    (each followed by ``wait``), so that the machine's drift (other tenants, clocks) falls
    on all of them alike; each fn visits the batches from its own offset, so no call finds
    the rows of the batch just before it in L2 unless it looked them up itself."""
    for fn in fns:
        for b in batches[:3]:
            fn(b)
    wait()
    ts: list[list[float]] = [[] for _ in fns]
    for i in range(reps):
        for j, fn in enumerate(fns):
            b = batches[(i + j * len(batches) // len(fns)) % len(batches)]
            t0 = time.perf_counter()
            fn(b)
            wait()
            ts[j].append(time.perf_counter() - t0)
    return [p50_p99(t) for t in ts]


def back_to_back(fn: Callable[[torch.Tensor], Any], batches: list[torch.Tensor],
                 min_s: float = 0.3) -> float:
    """Seconds per call, wall clock over back-to-back calls on distinct batches."""
    for b in batches[:3]:
        fn(b)
    torch.cuda.synchronize()
    calls, t0 = 0, time.perf_counter()
    while calls < 2 * len(batches) or time.perf_counter() - t0 < min_s:
        fn(batches[calls % len(batches)])
        calls += 1
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls


def gather_from(view: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The zero-copy baseline: ``index_select`` over the registered table."""
    return lambda k: view.index_select(0, k)


def stream(z: ZipfKeys, n: int, count: int) -> list[torch.Tensor]:
    return [z.sample(n).to(DEV) for _ in range(count)]


def gpulayer(rows: int, sizes: list[int], reps: int) -> None:
    w = torch.randn(rows, DIM, device=DEV)
    emb = NVEmbedding(rows, DIM, torch.float32, LayerType.GPULayer, storage=w, device=DEV)
    base = torch.nn.Embedding.from_pretrained(w)
    for n in sizes:
        batches = stream(ZipfKeys(rows, 1.05, seed=n), n, max(4, min(64, (64 << 20) // n)))
        assert torch.equal(emb(batches[0]), base(batches[0]))
        r = reps if n <= 1 << 16 else reps // 4
        p50, p99 = per_call(emb, batches, r)
        b50, b99 = per_call(base, batches, r)
        # NOTE: the same two, their calls alternating: the machine's drift between the two
        # runs above (nn.Embedding's own p50 moves by 1.5x from run to run on a shared
        # host) falls on both alike
        (i50, i99), (ib50, ib99) = interleaved([emb, base], batches, r)
        emit(bench="gpulayer_per_call", batch=n, rows=rows, p50_us=p50, p99_us=p99,
             torch_p50_us=b50, torch_p99_us=b99, p50_ratio_to_torch=p50 / b50,
             p99_over_own_p50=p99 / p50, interleaved_p50_us=i50, interleaved_p99_us=i99,
             interleaved_torch_p50_us=ib50, interleaved_torch_p99_us=ib99,
             interleaved_p50_ratio_to_torch=i50 / ib50,
             interleaved_p99_over_own_p50=i99 / i50,
             interleaved_torch_p99_over_own_p50=ib99 / ib50)
    for alpha in (1.05, 0.0):
        for n in (1 << 16, 1 << 18, 1 << 20):
            batches = stream(ZipfKeys(rows, alpha, seed=7), n, 16)
            t, tb = back_to_back(emb, batches), back_to_back(base, batches)
            emit(bench="gpulayer_back_to_back", alpha=alpha, batch=n, rows=rows,
                 mkeys_s=n / t / 1e6, torch_mkeys_s=n / tb / 1e6, speedup=tb / t)
    small = torch.randn(1 << 20, DIM, device=DEV)
    emb_s = NVEmbedding(1 << 20, DIM, torch.float32, LayerType.GPULayer, storage=small,
                        device=DEV)
    base_s = torch.nn.Embedding.from_pretrained(small)
    batches = [b.view(128, 128) for b in stream(ZipfKeys(1 << 20, 1.05, seed=8), 128 * 128,
                                                 64)]
    t, tb = back_to_back(emb_s, batches), back_to_back(base_s, batches)
    emit(bench="gpulayer_back_to_back_128x128", rows=1 << 20, speedup=tb / t,
         us_per_step=t * 1e6, torch_us_per_step=tb * 1e6)
    bag = NVEmbeddingBag(rows, DIM, torch.float32, LayerType.GPULayer, storage=w, device=DEV)
    base_bag = torch.nn.EmbeddingBag.from_pretrained(w, mode="sum")
    for alpha in (1.05, 0.0):
        batches = [b.view(256, 1024) for b in stream(ZipfKeys(rows, alpha, seed=9), 1 << 18,
                                                      16)]
        torch.testing.assert_close(bag(batches[0]), base_bag(batches[0]), rtol=1e-4,
                                   atol=1e-3)
        t, tb = back_to_back(bag, batches), back_to_back(base_bag, batches)
        emit(bench="gpulayer_pooled_back_to_back", alpha=alpha, bags=256, keys_per_bag=1024,
             speedup=tb / t, mkeys_s=(1 << 18) / t / 1e6)
    compiled = torch.compile(emb, fullgraph=True, mode="reduce-overhead")
    # NOTE: torch's own layer compiled the same way: what the CUDA-graph path itself costs
    base_compiled = torch.compile(base, fullgraph=True, mode="reduce-overhead")
    for n in (1024, 4096):
        batches = stream(ZipfKeys(rows, 1.05, seed=n), n, 64)
        for b in batches[:4]:
            assert torch.equal(compiled(b).clone(), base(b))
            assert torch.equal(base_compiled(b).clone(), base(b))
        p50, p99 = per_call(compiled, batches, reps)
        b50, _ = per_call(base, batches, reps)
        c50, _ = per_call(base_compiled, batches, reps)
        emit(bench="gpulayer_compiled_reduce_overhead", batch=n, p50_us=p50, p99_us=p99,
             torch_p50_us=b50, p50_ratio_to_torch=p50 / b50, torch_compiled_p50_us=c50,
             p50_ratio_to_torch_compiled=p50 / c50)
    emb.close()


def linear_uvm(name: str, rows: int, sizes: list[int], reps: int, big_rows: int) -> None:
    for table_rows, what in ((rows, "latency"), (big_rows, "throughput")):
        mb = SharedMemBlock.create(name, num_rows=table_rows, dim=DIM)
        try:
            chunk = 1 << 20
            for s in range(0, table_rows, chunk):
                idx = torch.arange(s, min(table_rows, s + chunk))
                mb.write(idx, torch.randn(idx.numel(), DIM))
            cache = table_rows // 10 * (DIM * 4 + 12)
            emb = NVEmbedding(table_rows, DIM, torch.float32, LayerType.LinearUVM,
                              gpu_cache_size=cache, storage=mb, device=DEV)
            if what == "latency":
                hbm = torch.nn.Embedding.from_pretrained(mb.tensor.to(DEV).contiguous())
                for n in sizes:
                    batches = stream(ZipfKeys(table_rows, 1.05, seed=3), n,
                                     max(8, (8 << 20) // n))
                    for b in batches:  # to steady state
                        emb(b)
                    before = emb.stats().gpu
                    p50, p99 = per_call(emb, batches, reps)
                    after = emb.stats().gpu
                    b50, _ = per_call(hbm, batches, reps)
                    # NOTE: a caller reading its result waits for its own stream only: an
                    # admission round's sorts run on the layer's side stream
                    own = torch.cuda.current_stream(DEV).synchronize
                    s50, s99 = per_call(emb, batches, reps, own)
                    hits = after.hits - before.hits
                    hit_rate = hits / max(1, hits + after.misses - before.misses)
                    (i50, i99), (ib50, _) = interleaved([emb, hbm], batches, reps)
                    # NOTE: what the call's misses alone cost: as many distinct random rows
                    # as a call missed, read zero-copy over the host link, a sync after each
                    # (a lower bound on the layer's call at this hit rate)
                    m = max(1, round((1 - hit_rate) * n))
                    gen = torch.Generator().manual_seed(n)
                    cold = [torch.randperm(table_rows, generator=gen)[:m].to(DEV)
                            for _ in range(16)]
                    reg = register(mb, DEV)
                    m50, _ = per_call(gather_from(reg.rows()), cold, reps)
                    reg.close()
                    emit(bench="linear_uvm_per_call", batch=n, rows=table_rows, p50_us=p50,
                         p99_us=p99, torch_p50_us=b50, p50_ratio_to_torch=p50 / b50,
                         p99_over_own_p50=p99 / p50, stream_sync_p50_us=s50,
                         stream_sync_p99_us=s99, stream_sync_p99_over_p50=s99 / s50,
                         hit_rate=hit_rate, interleaved_p50_us=i50, interleaved_p99_us=i99,
                         interleaved_torch_p50_us=ib50,
                         interleaved_p50_ratio_to_torch=i50 / ib50,
                         interleaved_p99_over_own_p50=i99 / i50, misses_alone_p50_us=m50,
                         misses_alone_over_torch_p50=m50 / ib50)
            else:
                reg = register(mb, DEV)  # this process's registration, shared with the layer
                view = reg.rows()  # the registered zero-copy view of the table
                for n in (1 << 16, 1 << 18, 1 << 20):
                    batches = stream(ZipfKeys(table_rows, 1.05, seed=4), n,
                                     max(8, (16 << 20) // n))
                    for b in batches:
                        emb(b)
                    before = emb.stats().gpu
                    t = back_to_back(emb, batches)
                    after = emb.stats().gpu
                    tb = back_to_back(gather_from(view), batches[:8])
                    # NOTE: what the misses alone cost over the host link: as many distinct
                    # random rows as a call missed, read zero-copy (the link's random-read
                    # rate; the Zipf baseline re-reads its hot rows); the layer cannot beat
                    # the baseline by more than tb / t_miss however cheap its hits
                    misses = after.misses - before.misses
                    miss_rate = misses / max(1, misses + after.hits - before.hits)
                    m = max(1, round(miss_rate * n))
                    gen = torch.Generator().manual_seed(n)
                    cold = [torch.randperm(table_rows, generator=gen)[:m].to(DEV)
                            for _ in range(8)]
                    t_miss = back_to_back(gather_from(view), cold)
                    emit(bench="linear_uvm_back_to_back", batch=n, rows=table_rows,
                         mkeys_s=n / t / 1e6, index_select_mkeys_s=n / tb / 1e6,
                         speedup=tb / t, miss_rate=miss_rate, misses_alone_us=t_miss * 1e6,
                         misses_alone_gb_s=m * DIM * 4 / t_miss / 1e9,
                         speedup_bound_by_misses=tb / t_miss)
                reg.close()
                for n in (1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20):
                    fresh = NVEmbedding(table_rows, DIM, torch.float32, LayerType.LinearUVM,
                                        gpu_cache_size=cache, storage=mb, device=DEV)
                    z = ZipfKeys(table_rows, 1.05, seed=5)
                    rates = []
                    for _ in range(3):  # keys 0-16M, 16M-32M, 32M-48M
                        before = fresh.stats().gpu
                        for _ in range((16 << 20) // n):
                            fresh(z.sample(n).to(DEV))
                        a = fresh.stats().gpu
                        h, m = a.hits - before.hits, a.misses - before.misses
                        rates.append(h / max(1, h + m))
                    emit(bench="linear_uvm_warm_up", batch=n, rows=table_rows,
                         hit_rate_first_16m=rates[0], hit_rate_16m_32m=rates[1],
                         steady_hit_rate=rates[2], points_behind_after_16m=100 * (
                             rates[2] - rates[1]))
                    fresh.close()
            emb.close()
        finally:
            mb.close()
            SharedMemBlock.unlink(name)


FIRST = """
import time, torch; t0 = time.perf_counter()
from gpu import LayerType, NVEmbedding
e = NVEmbedding(1 << 20, 128, torch.float32, LayerType.{lt}, device="cuda"{extra})
k = torch.randint(0, 1 << 20, (1024,), device="cuda"); torch.cuda.synchronize()
t1 = time.perf_counter(); e(k); torch.cuda.synchronize(); t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""


def first_forward(name: str) -> None:
    """Construction to first lookup in fresh processes: Triton's cache cold, then warm."""
    mb = SharedMemBlock.create(name, num_rows=1 << 20, dim=DIM)
    try:
        env = dict(os.environ, TRITON_CACHE_DIR=f"/tmp/nvec-first-{os.getpid()}")
        for lt, extra in (("GPULayer", ""), ("LinearUVM", f", storage=__import__('hostcache')"
                                             f".SharedMemBlock.attach({name!r}), "
                                             "gpu_cache_size=1 << 26")):
            for cache in ("cold", "warm"):
                t_start = time.perf_counter()
                out = subprocess.run([sys.executable, "-c", FIRST.format(lt=lt, extra=extra)],
                                     env=env, capture_output=True, text=True, check=True)
                wall = time.perf_counter() - t_start
                setup, first = (float(x) for x in out.stdout.split())
                emit(bench="first_forward", layer=lt, triton_cache=cache,
                     first_forward_ms=first * 1e3, import_and_construct_ms=setup * 1e3,
                     process_start_to_first_lookup_ms=wall * 1e3)
    finally:
        mb.close()
        SharedMemBlock.unlink(name)


def host_time(fn: Callable[[], Any], calls: int = 3000) -> float:
    """Mean host time of one call in microseconds: no sync per call (one every 100, so
    the queue stays short), what the calling thread spends before the call returns."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    total = 0.0
    for i in range(calls):
        t0 = time.perf_counter()
        fn()
        total += time.perf_counter() - t0
        if i % 100 == 99:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return total / calls * 1e6


def host_path(rows: int) -> None:
    """Where a 1k-key GPULayer call's host time goes, against ``nn.Embedding``'s: the
    pieces timed alone (the layer's gather launched as the layer does, behind no checks;
    the output's allocation; an empty module call), then both whole calls."""
    w = torch.randn(rows, DIM, device=DEV)
    emb = NVEmbedding(rows, DIM, torch.float32, LayerType.GPULayer, storage=w, device=DEV)
    base = torch.nn.Embedding.from_pretrained(w)
    keys = ZipfKeys(rows, 1.05, seed=3).sample(1024).to(DEV)
    stack = emb._tiers  # NOTE: the bench times its pieces; tests use public seams
    table, flag, bound = stack.table, stack.check.err, stack._bound
    gather = stack._gather
    empty = torch.nn.Identity()
    out = torch.empty(1024, DIM, device=DEV)
    grid = (1024 + 15) // 16
    for _ in range(3):  # NOTE: the bound launch's variant found, then launched directly
        bound(keys)
    run, head, tail = next(iter(bound.launch._variants.values()))
    stream = torch.cuda.current_stream().cuda_stream
    packed = (grid, 1, 1, stream, *head, keys.data_ptr(), 1024, table.data_ptr(),
              table.shape[0], table.stride(0), out.data_ptr(), flag.data_ptr(),
              flag.data_ptr(), *tail)
    parts = {
        "nn_embedding_call": lambda: base(keys),
        "torch_embedding_op": lambda: torch.embedding(w, keys),
        "layer_call": lambda: emb(keys),
        "layer_stack_rows": lambda: stack.rows(keys),
        "bound_gather_with_output_alloc": lambda: bound(keys),
        "unbound_gather_with_output_alloc": lambda: gather(keys, table, flag,
                                                           host_table=False),
        "bound_launch_preallocated": lambda: bound.launch.call(grid, keys, 1024, out),
        "triton_c_launcher_prepacked": lambda: run(*packed),
        "torch_empty_output": lambda: torch.empty(1024, DIM, device=DEV),
        "empty_module_call": lambda: empty(keys),
        "layer_checks_and_gate": lambda: (stack.check(keys), stack._gate.__enter__(),
                                          stack._gate.__exit__()),
    }
    for what, fn in parts.items():
        emit(bench="gpulayer_host_time", part=what, batch=1024, host_us=host_time(fn))
    emb.close()


def gather_tiles(rows: int) -> None:
    """The GPULayer gather's launch settings (keys per program x warps) back to back over
    uniform keys at 256k and 1M, as bytes moved a second (each key's row read and its
    output row written), beside ``nn.Embedding``: whether the defaults leave bandwidth."""
    import dataclasses

    from gpu import TierConfig
    from gpu.kernels.tiles import DEFAULT_TILES

    w = torch.randn(rows, DIM, device=DEV)
    row_bytes = 2 * DIM * w.element_size()
    for n in (1 << 18, 1 << 20):
        batches = [torch.randint(0, rows, (n,), device=DEV) for _ in range(8)]
        t = back_to_back(lambda k: torch.embedding(w, k), batches)
        emit(bench="gather_tiles", batch=n, what="nn.Embedding", tb_s=n * row_bytes / t / 1e12)
        for bk in (8, 16, 32, 64):
            for warps in (2, 4, 8):
                tiles = dataclasses.replace(DEFAULT_TILES, gather_block_k=bk, gather_warps=warps)
                emb = NVEmbedding(rows, DIM, torch.float32, LayerType.GPULayer, storage=w,
                                  device=DEV, tuning=TierConfig(tiles=tiles))
                t = back_to_back(emb, batches)
                emit(bench="gather_tiles", batch=n, block_k=bk, warps=warps,
                     default=tiles == DEFAULT_TILES, tb_s=n * row_bytes / t / 1e12)
                emb.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", action="append", choices=["gpu", "linear", "first", "host", "tiles"])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_per_call needs a CUDA GPU", file=sys.stderr)
        return 2
    only = set(args.only or ["gpu", "linear", "first", "host"])  # NOTE: tiles when asked
    reps = 100 if args.quick else 400
    sizes = [1 << 10, 1 << 12, 1 << 14]
    name = f"bench-per-call-{os.getpid()}"
    if "gpu" in only:
        gpulayer(1 << 20 if args.quick else 1 << 24, sizes + [1 << 16, 1 << 18, 1 << 20],
                 reps)
    if "linear" in only:
        linear_uvm(name, 1 << 20, sizes, reps, 1 << 20 if args.quick else 1 << 22)
    if "first" in only:
        first_forward(name)
    if "host" in only:
        host_path(1 << 20)
    if "tiles" in only:
        gather_tiles(1 << 20 if args.quick else 1 << 24)
    return 0


if __name__ == "__main__":
    sys.exit(main())
