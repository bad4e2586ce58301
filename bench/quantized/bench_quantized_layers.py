"""Quantized rows read by the layers (issue 36): each layer over int8 / fp8 rows against
the same layer over float32 rows, in one run, on the same keys.

Default constructor arguments everywhere but the table's format (a GPULayer's
``weight_dtype=``, a quantized ``SharedMemBlock`` / ``HostCache`` / parameter server).
Wall clock over back-to-back calls of distinct batches (one sync at the end) is the
headline; p50/p99 per call (a sync after each) beside it. Dim 128, Zipf alpha 1.05 and
uniform keys.

1. GPULayer pooled, 256 bags x 1,024 keys: int8 / fp8 storage with fp16 and fp32 output
   against our fp32 layer and ``nn.EmbeddingBag``.
2. GPULayer plain at 1M keys (output writes dominate): the same comparison; and
   (``plain_bytes``) over uniform keys at 64k-1M, float32 and int8 -> fp16, as the bytes a
   call moves per second.
3. The seed library's benchmark configuration: a [256, 1024] key tensor per step over a
   table in HBM, int8 storage against ``nn.Embedding`` fp32 (and our fp32 layer).
4. LinearUVM with a GPU cache of 10% of the table's rows, 256k and 1M keys: int8 / fp8
   against fp32 (misses cross the host link in a quarter of the bytes).
5. Hierarchical (GPU cache 5%, shared host cache 20%, file:// parameter server, every tier
   in the format) p50/p99 at 1k and 64k keys and back-to-back keys/s, int8 vs fp32.

Before timing, every quantized layer's rows are checked against
``quant.decode(quant.encode(rows))`` of the same keys. Prints one JSON line per figure.
Run on a CUDA machine: ``python bench/quantized/bench_quantized_layers.py [--quick] [--only NAME]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psclient  # noqa: E402
from bench.layers.bench_per_call import p50_p99  # noqa: E402
from bench.training.bench_training_tiers import back_to_back as tiers_back_to_back  # noqa: E402
from bench.workloads import ZipfKeys, compiled_loops  # noqa: E402
from gpu import LayerType, NVEmbedding, NVEmbeddingBag, TierConfig  # noqa: E402
from gpu.kernels.tiles import DEFAULT_TILES  # noqa: E402
from hostcache import HostCache, SharedMemBlock  # noqa: E402
from nvecache.common import quant  # noqa: E402
from nvecache.common.rows import RowFormat  # noqa: E402

DIM = 128
FORMATS = (torch.int8, torch.float8_e4m3fn)


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def per_call(fn: Callable[[torch.Tensor], Any], batches: list[torch.Tensor], reps: int
             ) -> tuple[float, float]:
    """(p50, p99) in microseconds of one call and a sync, over distinct batches."""
    for b in batches[:3]:
        fn(b)
    sync()
    ts = []
    for i in range(reps):
        b = batches[i % len(batches)]
        t0 = time.perf_counter()
        fn(b)
        sync()
        ts.append(time.perf_counter() - t0)
    return p50_p99(ts)


def back_to_back(fn: Callable[[torch.Tensor], Any], batches: list[torch.Tensor]) -> float:
    """Seconds per call, wall clock over back-to-back calls on distinct batches, warmed."""
    for b in batches[:3]:
        fn(b)
    return tiers_back_to_back(fn, batches, sync, 0.5)[0]


def name_of(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def compare(bench: str, fns: dict[str, Callable[[torch.Tensor], Any]],
            batches: list[torch.Tensor], reps: int, base: str, **fields: Any) -> None:
    """One JSON line per entry of ``fns``: back-to-back and per-call times, and each
    one's ratio against ``fns[base]`` measured in the same run."""
    n = batches[0].numel()
    times = {label: back_to_back(fn, batches) for label, fn in fns.items()}
    for label, fn in fns.items():
        p50, p99 = per_call(fn, batches, reps)
        t = times[label]
        emit(bench=bench, layer=label, keys=n, mkeys_s=n / t / 1e6, us_per_call=t * 1e6,
             p50_us=p50, p99_us=p99, speedup_vs=base, speedup=times[base] / t, **fields)


def gpulayer(device: torch.device, rows: int, quick: bool, reps: int) -> None:
    """GPULayer pooled 256x1024 and plain 1M keys, quantized storage vs fp32."""
    weights = torch.randn(rows, DIM, device=device)
    layers: dict[str, Any] = {}
    bags: dict[str, Any] = {}
    try:
        bags["fp32"] = NVEmbeddingBag(rows, DIM, torch.float32, LayerType.GPULayer,
                                      storage=weights, mode="sum", device=device)
        layers["fp32"] = NVEmbedding(rows, DIM, torch.float32, LayerType.GPULayer,
                                     storage=weights, device=device)
        bags["torch fp32"] = torch.nn.EmbeddingBag.from_pretrained(weights, mode="sum")
        layers["torch fp32"] = torch.nn.Embedding.from_pretrained(weights)
        for wd in FORMATS:
            fmt = RowFormat(wd, DIM)
            for out in (torch.float16, torch.float32):
                label = f"{name_of(wd)} -> {name_of(out)}"
                init = weights.to(out)
                bags[label] = NVEmbeddingBag(rows, DIM, out, LayerType.GPULayer,
                                             weight_dtype=wd, weight_init=init, mode="sum",
                                             device=device)
                layers[label] = NVEmbedding(rows, DIM, out, LayerType.GPULayer,
                                            weight_dtype=wd, weight_init=init, device=device)
                keys = torch.randint(0, rows, (4096,), device=device)
                want = quant.decode(quant.encode(init.index_select(0, keys), fmt), fmt, out)
                assert torch.equal(layers[label](keys), want), label
                del init
        nb, per = (32, 256) if quick else (256, 1024)
        plain_n = (1 << 14) if quick else (1 << 20)
        for alpha in (1.05, 0.0):
            z = ZipfKeys(rows, alpha, seed=7)
            pooled = [z.sample(nb * per).to(device).view(nb, per) for _ in range(8)]
            compare("gpulayer_pooled", bags, pooled, reps, "fp32", alpha=alpha, bags=nb,
                    keys_per_bag=per)
            plain = [z.sample(plain_n).to(device) for _ in range(8)]
            compare("gpulayer_plain", layers, plain, reps, "fp32", alpha=alpha)
    finally:
        for layer in (*layers.values(), *bags.values()):
            if hasattr(layer, "close"):
                layer.close()


#: pooled launch settings compared by :func:`pooled_tiles`: (keys per program, warps,
#: programs in all); the first is the default's
POOLED_TILES = ((DEFAULT_TILES.pooled_block_k, DEFAULT_TILES.pooled_warps,
                 DEFAULT_TILES.pooled_programs), (64, 8, 256), (64, 8, 512), (128, 8, 512),
                (32, 4, 1024), (64, 4, 512), (256, 16, 256))


def kernel_us(fn: Callable[[torch.Tensor], Any], batches: list[torch.Tensor]) -> float:
    """Microseconds of GPU kernels per call (the profiler's device time over 40 calls):
    the second column, beside the wall clock a serving process sees."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for i in range(40):
            fn(batches[i % len(batches)])
        sync()
    return sum(e.self_device_time_total for e in p.key_averages()) / 40


def pooled_default(device: torch.device, rows: int, quick: bool, reps: int) -> None:
    """GPULayer pooled 256x1024 under the default launch settings only (the first part of
    :func:`pooled_tiles`): each format's kernel time per call beside its wall clock, for
    an A/B of two checkouts."""
    pooled_tiles(device, rows, quick, reps, settings=POOLED_TILES[:1], dims=False)


def pooled_tiles(device: torch.device, rows: int, quick: bool, reps: int,
                 settings: tuple[tuple[int, int, int], ...] = POOLED_TILES,
                 dims: bool = True) -> None:
    """GPULayer pooled 256x1024 (fp16 output for the quantized tables, fp32 for float32)
    under each of ``settings``: wall clock back to back and kernel time per call; then
    (``dims``) rows of 64, 256 and 512 elements under the default settings against 64 keys
    per program (the default before its tile cap). Which launch settings each format
    wants."""
    nb, per = (32, 256) if quick else (256, 1024)
    timed = kernel_us if device.type == "cuda" else (lambda fn, b: float("nan"))

    def run(dim: int, alpha: float, wd: torch.dtype, tiles: Any, **fields: Any) -> None:
        out = torch.float32 if wd == torch.float32 else torch.float16
        z = ZipfKeys(rows, alpha, seed=7)
        batches = [z.sample(nb * per).to(device).view(nb, per) for _ in range(8)]
        bag = NVEmbeddingBag(rows, dim, out, LayerType.GPULayer,
                             weight_dtype=None if wd == torch.float32 else wd,
                             weight_init=torch.randn(rows, dim, device=device, dtype=out),
                             mode="sum", device=device, tuning=TierConfig(tiles=tiles))
        try:
            t = back_to_back(bag, batches)
            emit(bench="pooled_tiles", dim=dim, alpha=alpha, weight=name_of(wd),
                 out=name_of(out), us_per_call=t * 1e6, kernel_us=timed(bag, batches),
                 **fields)
        finally:
            bag.close()

    for alpha in (1.05, 0.0):
        for wd in (torch.float32, *FORMATS):
            for bk, warps, programs in settings:
                tiles = dataclasses.replace(DEFAULT_TILES, pooled_block_k=bk,
                                            pooled_warps=warps, pooled_programs=programs)
                run(DIM, alpha, wd, tiles, block_k=bk, warps=warps, programs=programs)
    if not dims:
        return
    before = dataclasses.replace(DEFAULT_TILES, pooled_block_k=64, pooled_max_tile=1 << 20)
    for dim in (64, 256, 512):
        for wd in (torch.float32, torch.int8):
            for label, tiles in (("default", DEFAULT_TILES), ("64 keys", before)):
                run(dim, 1.05, wd, tiles, setting=label)


def seed_config(device: torch.device, rows: int, quick: bool, reps: int) -> None:
    """The seed library's configuration: a [256, 1024] lookup per step, int8 vs torch."""
    weights = torch.randn(rows, DIM, device=device)
    base = torch.nn.Embedding.from_pretrained(weights)
    ours = NVEmbedding(rows, DIM, torch.float32, LayerType.GPULayer, storage=weights,
                       device=device)
    q = NVEmbedding(rows, DIM, torch.float32, LayerType.GPULayer, weight_dtype=torch.int8,
                    weight_init=weights, device=device)
    try:
        shape = (32, 256) if quick else (256, 1024)
        z = ZipfKeys(rows, 1.05, seed=8)
        steps = [z.sample(shape[0] * shape[1]).to(device).view(shape) for _ in range(8)]
        fmt = RowFormat(torch.int8, DIM)
        k = steps[0].reshape(-1)[:4096]
        want = quant.decode(quant.encode(weights.index_select(0, k), fmt), fmt)
        assert torch.equal(q(k), want)
        compare("seed_config", {"torch fp32": base, "fp32": ours, "int8 -> fp32": q}, steps,
                reps, "torch fp32", rows=rows, shape=list(shape))
    finally:
        ours.close()
        q.close()


@contextmanager
def linear_block(name: str, weights: torch.Tensor, dtype: torch.dtype
                 ) -> Iterator[SharedMemBlock]:
    mb = SharedMemBlock.create(name, num_rows=weights.shape[0], dim=DIM, dtype=dtype)
    try:
        step = 1 << 20
        for s in range(0, weights.shape[0], step):
            idx = torch.arange(s, min(weights.shape[0], s + step))
            mb.write(idx, weights[s:s + step])
        yield mb
    finally:
        mb.close()
        SharedMemBlock.unlink(name)


def linear_uvm(device: torch.device, rows: int, quick: bool, reps: int) -> None:
    """LinearUVM, 10% of the rows cacheable, quantized block vs fp32 block."""
    weights = torch.randn(rows, DIM)
    sizes = [1 << 12, 1 << 14] if quick else [1 << 18, 1 << 20]
    cache_rows = rows // 10
    layers: dict[str, Any] = {}
    blocks = []
    try:
        for dtype in (torch.float32, *FORMATS):
            cm = linear_block(f"bench-q-{name_of(dtype)}-{os.getpid()}", weights, dtype)
            mb = cm.__enter__()
            blocks.append(cm)
            # NOTE: the cache holds rows of the layer's dtype (fp32): the same number of
            # rows for every format, 10% of the table
            layers[name_of(dtype)] = NVEmbedding(
                rows, DIM, torch.float32, LayerType.LinearUVM,
                gpu_cache_size=cache_rows * (DIM * 4 + 12), storage=mb, device=device)
            if dtype != torch.float32:
                fmt = RowFormat(dtype, DIM)
                k = torch.randint(0, rows, (4096,))
                want = quant.decode(mb.tensor.index_select(0, k), fmt)
                assert torch.equal(layers[name_of(dtype)](k.to(device)).cpu(), want)
        for n in sizes:
            z = ZipfKeys(rows, 1.05, seed=9)
            stream = [z.sample(n).to(device) for _ in range(max(8, (16 << 20) // n))]
            for layer in layers.values():
                for b in stream:  # NOTE: steady state: 16M keys of warm-up each
                    layer(b)
            rates = {}
            for label, layer in layers.items():
                s0 = layer.stats().gpu
                back_to_back(layer, stream[:16])
                s1 = layer.stats().gpu
                h, m = s1.hits - s0.hits, s1.misses - s0.misses
                rates[label] = h / max(1, h + m)
            compare("linear_uvm", layers, stream[:16], reps, "float32", rows=rows,
                    cache_fraction=0.1, gpu_hit_rates=rates)
    finally:
        for layer in layers.values():
            layer.close()
        for cm in reversed(blocks):
            cm.__exit__(None, None, None)


def hierarchical(device: torch.device, rows: int, quick: bool, reps: int) -> None:
    """Hierarchical over file://, every tier int8 (or fp8) vs every tier fp32."""
    weights = torch.randn(rows, DIM, generator=torch.Generator().manual_seed(1))
    sizes = [1 << 10, 1 << 12] if quick else [1 << 10, 1 << 16]
    folder = tempfile.mkdtemp(prefix="bench-q-ps-")
    opened: list[Any] = []
    layers: dict[str, Any] = {}
    names = []
    try:
        for dtype in (torch.float32, *FORMATS):
            table = f"bench-q-h-{name_of(dtype)}-{os.getpid()}"
            ps = psclient.connect(f"file://{folder}/{name_of(dtype)}", table=table, dim=DIM,
                                  dtype=dtype)
            opened.append(ps)
            ps.load(weights, progress=False)
            hc = HostCache.create(table, capacity=rows // 5, dim=DIM, dtype=dtype)
            opened.append(hc)
            names.append(table)
            layers[name_of(dtype)] = NVEmbedding(
                rows, DIM, torch.float32, LayerType.Hierarchical,
                gpu_cache_size=rows // 20 * (DIM * 4 + 12), host_cache=hc, storage=ps,
                device=device)
        z = ZipfKeys(rows, 1.05, seed=10)
        for n in sizes:
            warm = [z.sample(n).to(device) for _ in range(max(1, (16 << 20) // n))]
            for layer in layers.values():
                for b in warm:
                    layer(b)
            del warm
            compiled_loops()  # NOTE: the compiled loops timed, not their twins
            batches = [z.sample(n).to(device) for _ in range(max(reps, 16))]
            for dtype in FORMATS:
                fmt = RowFormat(dtype, DIM)
                k = batches[0]
                # NOTE: the host cache holds the server's stored bytes (docs/layers.md)
                want = quant.decode(quant.encode(weights.index_select(0, k.cpu()), fmt), fmt)
                assert torch.equal(layers[name_of(dtype)](k).cpu(), want)
            compare("hierarchical", layers, batches, reps, "float32", rows=rows)
    finally:
        for layer in layers.values():
            layer.close()
        for t in opened:
            if isinstance(t, HostCache):
                t.close()
            else:
                t.drop()
                t.close()
        for name in names:
            HostCache.unlink(name)


def plain_bytes(device: torch.device, rows: int, quick: bool, reps: int) -> None:
    """GPULayer plain, uniform keys, 64k / 256k / 1M a call, float32 rows against int8
    rows read into fp16, beside ``nn.Embedding``: back to back, and the bytes a call moves
    per second (each key's stored row read, its output row written): how close each gets
    to HBM's bandwidth. Default arguments."""
    weights = torch.randn(rows, DIM, device=device)
    fmt = RowFormat(torch.int8, DIM)
    layers = {"fp32": (NVEmbedding(rows, DIM, torch.float32, LayerType.GPULayer,
                                   storage=weights, device=device), 2 * DIM * 4),
              "int8 -> float16": (NVEmbedding(rows, DIM, torch.float16, LayerType.GPULayer,
                                              weight_dtype=torch.int8,
                                              weight_init=weights.half(), device=device),
                                  fmt.stride + DIM * 2)}
    try:
        gen = torch.Generator(device=device).manual_seed(3)
        for n in (1 << 12, 1 << 14) if quick else (1 << 16, 1 << 18, 1 << 20):
            batches = [torch.randint(0, rows, (n,), device=device, generator=gen)
                       for _ in range(8)]
            base = back_to_back(lambda k: torch.embedding(weights, k), batches)
            for label, (layer, row_bytes) in layers.items():
                t = back_to_back(layer, batches)
                emit(bench="plain_bytes", layer=label, keys=n, us_per_call=t * 1e6,
                     tb_s=n * row_bytes / t / 1e12, torch_fp32_us=base * 1e6)
    finally:
        for layer, _ in layers.values():
            layer.close()


BENCHES = {"gpulayer": gpulayer, "pooled_tiles": pooled_tiles,
           "pooled_default": pooled_default, "seed": seed_config,
           "linear_uvm": linear_uvm, "hierarchical": hierarchical,
           "plain_bytes": plain_bytes}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--only", choices=sorted(BENCHES), action="append",
                    help="run only these benchmarks (repeatable)")
    ap.add_argument("--rows", type=int, default=None,
                    help="table rows (default: 4M; the seed configuration 64M, LinearUVM 16M, "
                    "Hierarchical 1M; --quick: 64k)")
    ap.add_argument("--reps", type=int, default=200, help="calls timed per p50/p99")
    args = ap.parse_args(argv)
    # NOTE: a time limit's SIGTERM (the device scripts' `timeout`) exits through the finally
    # blocks, which unlink the blocks and caches made here (a bare kill leaves them in
    # /dev/shm, where `hostcache ls` then finds tables that need repair)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    defaults = {"gpulayer": 1 << 22, "pooled_tiles": 1 << 22, "pooled_default": 1 << 22,
                "plain_bytes": 1 << 22,
                "seed": 1 << 26, "linear_uvm": 1 << 24, "hierarchical": 1 << 20}
    if args.quick or device.type == "cpu":
        defaults = dict.fromkeys(defaults, 1 << 16)
    reps = 20 if args.quick else args.reps
    # NOTE: pooled_default is the first part of pooled_tiles: run only when asked
    for name in args.only or [n for n in BENCHES if n != "pooled_default"]:
        rows = args.rows or defaults[name]
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0]
            # NOTE: the seed configuration holds the fp32 table and its int8 copy on the
            # device: scale its rows to the card (64M on an H200, fewer on an H100)
            while name == "seed" and rows * DIM * 4 * 1.6 > free:
                rows //= 2
        BENCHES[name](device, rows, args.quick, reps)
        emit(bench="done", which=name, device=torch.cuda.get_device_name(device)
             if device.type == "cuda" else "cpu")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
