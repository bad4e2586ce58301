"""Multi-GPU (issue 7): a linear table sharded over every GPU, one process per GPU.

For N = 1, 2, 4, 8 GPUs (as many as the machine has), N spawned processes build one
``DistMemBlock`` (``rows`` x 128 fp32, the same total table for every N, sharded N ways
and mapped into one range in every process) and each runs a LinearUVM ``NVEmbedding``
over it with a GPU cache of 1% of the table, on its own Zipf-1.05 key stream, all ranks at
once. Per GPU, in the same run:

* ``layer``: the layer's forward (``validate=False``: no host syncs), after warm-up, with
  every miss admitted to the GPU cache (the default ``InsertPolicy``); ``layer_admit<p>``:
  the same with ``InsertPolicy(gpu=p)`` (a random fraction p of the misses admitted);
* ``kernel``: the fused GPU-cache probe + gather the layer launches (hits from HBM,
  misses from the sharded range), without the layer's Python;
* ``nocache``: ``index_select`` over the sharded range (no cache: what a user gets
  without caching; (N-1)/N of the rows come over NVLink);
* ``hbm``: ``torch.nn.functional.embedding`` over a full copy of the table in this GPU's
  HBM (the upper bound when the table fits one GPU).

Million keys per second per GPU, the GPU-cache hit rate, and ratios against ``nocache``
and ``hbm``; then the scaling of the aggregate from 1 GPU. One JSON line per figure.
NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``).

Run: ``python bench/multigpu/bench_multigpu.py [--quick] [--gpus 1,2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

DIM = 128


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def _time(fn: Any, reps: int) -> float:
    """Seconds per call: ``reps`` calls between two device syncs (all ranks at once)."""
    import torch.distributed as dist

    fn()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def measure(layers: dict[str, Any], view: torch.Tensor, full: torch.Tensor | None, z: Any,
            batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """Seconds per lookup of each variant at ``batch`` keys, and the GPU-cache hit rates."""
    import torch.nn.functional as F  # noqa: N812

    dev = view.device
    stream = [z.sample(batch).to(dev) for _ in range(args.pool)]
    at = [0]

    def nxt() -> torch.Tensor:
        at[0] = (at[0] + 1) % len(stream)
        return stream[at[0]]

    reps = max(3, args.keys_per_rep // batch)
    rec: dict[str, Any] = {"batch": batch}
    for label, layer in layers.items():
        layer.clear()
        for _ in range(args.warm):  # fill the GPU cache
            layer(nxt())
        torch.cuda.synchronize()
        before = layer.stats().gpu
        rec[f"{label}_s"] = _time(lambda: layer(nxt()), reps)  # noqa: B023 - called at once
        after = layer.stats().gpu
        hits, misses = after.hits - before.hits, after.misses - before.misses
        rec[f"{label}_hit_rate"] = hits / max(1, hits + misses)
    # the kernel alone, over the cache of the layer whose policy kept the most hits
    best = max(layers, key=lambda label: rec[f"{label}_hit_rate"])
    tiers = layers[best]._tiers
    rec["kernel_cache_of"] = best
    rec["kernel_s"] = _time(
        lambda: tiers.cache.lookup_linear(nxt(), tiers.table, validate=False,
                                          host_table=False), reps)
    rec["nocache_s"] = _time(lambda: view.index_select(0, nxt()), reps)
    rec["hbm_s"] = _time(lambda: F.embedding(nxt(), full), reps) if full is not None else None
    return rec


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    import torch.distributed as dist

    from gpu import DistMemBlock, InsertPolicy, LayerType, NVEmbedding
    from nvecache.apps.demo.workload import ZipfKeys

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    rows = args.rows
    block = DistMemBlock(rows, DIM, torch.float32, devices=dev, group="torch",
                         name=f"bench-mg-{port}")
    view = block.view(dev)
    # every rank fills the rows of its own shard range, on its GPU
    per = -(-rows // world)
    lo, hi = rank * per, min(rows, (rank + 1) * per)
    g = torch.Generator(device=dev).manual_seed(rank)
    for a in range(lo, hi, 1 << 20):
        b = min(hi, a + (1 << 20))
        view[a:b] = torch.randn(b - a, DIM, device=dev, generator=g)
    torch.cuda.synchronize()
    dist.barrier()
    full = view.clone() if args.hbm else None  # a whole copy in this GPU's HBM
    cache_bytes = max(1 << 20, int(rows * DIM * 4 * args.cache_fraction))
    layers = {("layer" if p == 1.0 else f"layer_admit{p:g}"): NVEmbedding(
        rows, DIM, torch.float32, LayerType.LinearUVM, gpu_cache_size=cache_bytes,
        storage=block, device=dev, validate=False, insert_policy=InsertPolicy(gpu=p))
        for p in [1.0] + [a for a in args.admit if a != 1.0]}
    # one popularity for every rank, its own draws
    z = ZipfKeys(rows, args.alpha, popularity_seed=0, seed=1000 + rank)
    results = [measure(layers, view, full, z, batch, args) for batch in args.batches]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        out.put(gathered)
    del layers, view, full
    torch.cuda.synchronize()
    block.close()
    dist.destroy_process_group()


def run(world: int, args: argparse.Namespace) -> list[list[dict[str, Any]]]:
    import multiprocessing as mp

    import torch.multiprocessing as tmp

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.servers import free_port

    q = mp.get_context("spawn").SimpleQueue()
    tmp.spawn(rank_main, args=(world, free_port(), args, q), nprocs=world, join=True)
    return q.get()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--gpus", help="GPU counts, e.g. 1,2 (default 1,2,4,8 up to the machine's)")
    p.add_argument("--rows", type=int, help="table rows (default 2**24 = 8 GiB; quick 2**22)")
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--cache-fraction", type=float, default=0.01)
    p.add_argument("--batches", default="65536,1048576")
    p.add_argument("--admit", default="1.0,0.1",
                   help="GPU-cache admission probabilities of the layers measured")
    p.add_argument("--pool", type=int, default=16, help="distinct key batches cycled")
    p.add_argument("--warm", type=int, default=60, help="warm-up lookups per batch size")
    p.add_argument("--keys-per-rep", type=int, default=64 << 20,
                   help="keys timed per figure (default 64M)")
    p.add_argument("--oversubscribe", action="store_true",
                   help="allow more ranks than GPUs (ranks share GPUs: checks the code path, "
                        "not a figure)")
    p.add_argument("--no-hbm", dest="hbm", action="store_false",
                   help="skip the full-copy nn.Embedding baseline")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_multigpu needs CUDA GPUs", file=sys.stderr)
        return 2
    n = torch.cuda.device_count()
    args.rows = args.rows or (1 << 22 if args.quick else 1 << 24)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.admit = [float(a) for a in args.admit.split(",")]
    if args.quick:
        args.keys_per_rep, args.warm = 8 << 20, 20
    counts = [int(x) for x in args.gpus.split(",")] if args.gpus else [1, 2, 4, 8]
    counts = [c for c in counts if c <= n or args.oversubscribe]
    base: dict[int, float] = {}
    for world in counts:
        per_rank = run(world, args)
        for j, batch in enumerate(args.batches):
            recs = [r[j] for r in per_rank]
            kinds = [k[:-2] for k in recs[0] if k.endswith("_s") and recs[0][k]]
            mkps = {k: [batch / r[f"{k}_s"] / 1e6 for r in recs] for k in kinds}
            mean = {k: sum(v) / len(v) for k, v in mkps.items()}
            agg = sum(mkps["layer"])
            if world == counts[0]:
                base[batch] = agg / world
            emit(bench="multigpu", gpus=min(world, n), ranks=world, batch=batch,
                 rows=args.rows, dim=DIM,
                 table_gib=args.rows * DIM * 4 / 2**30, cache_fraction=args.cache_fraction,
                 alpha=args.alpha, remote_share=(min(world, n) - 1) / min(world, n),
                 mkps_per_gpu={k: round(v, 1) for k, v in mean.items()},
                 hit_rate={k[:-9]: round(sum(r[k] for r in recs) / world, 4)
                           for k in recs[0] if k.endswith("_hit_rate")},
                 layer_vs_nocache=round(mean["layer"] / mean["nocache"], 2),
                 kernel_vs_nocache=round(mean["kernel"] / mean["nocache"], 2),
                 kernel_vs_hbm=round(mean["kernel"] / mean["hbm"], 2) if "hbm" in mean
                 else None,
                 kernel_cache_of=recs[0]["kernel_cache_of"], aggregate_mkps=round(agg, 1),
                 scaling_per_rank_vs_first=round(agg / world / base[batch], 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
