"""Training benchmarks: one step = forward + backward + optimizer, wall clock over
distinct batches of Zipf(1.05) keys, dim 128, each against torch in the same run.

1. GPULayer with fused ``gpu.optim.RowwiseAdagrad`` vs ``nn.Embedding(sparse=True)`` +
   ``torch.optim.Adagrad``, at 64k / 256k / 1M keys per step.
2. SGD on both sides: fused ``gpu.optim.SGD``, and ``torch.optim.SGD`` on the layer's
   sparse ``weight`` gradient, vs ``nn.Embedding(sparse=True)`` + ``torch.optim.SGD``.
3. LinearUVM training a table 10x its GPU cache (rows and RowwiseAdagrad state in a
   registered SharedMemBlock) vs the best torch alone does with such a table: a CPU
   ``nn.Embedding(sparse=True)`` + Adagrad, rows copied to the GPU and gradients back.

4. The floor under every step taken through ``loss.backward()``: a 4 x 4 ``nn.Linear``.

Per figure: ``step_ms`` (back-to-back steps, one sync at the end), p50/p99 of one step
followed by a device sync, and the ratio to torch's step. Prints one JSON line per
figure. Run: ``python bench/training/bench_training.py [--quick]`` (CPU at small sizes when there
is no CUDA).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.workloads import ZipfKeys  # noqa: E402
from gpu import LayerType, NVEmbedding, optim  # noqa: E402
from hostcache import SharedMemBlock  # noqa: E402
from tests.conftest import fresh_name  # noqa: E402

DIM = 128


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(step: Callable[[int], None], device: torch.device, reps: int
            ) -> dict[str, float]:
    """Back-to-back ms per step over batches ``0..reps``, then p50/p99 (us) of one step
    followed by a sync."""
    for i in range(3):
        step(i)
    sync(device)
    t0 = time.perf_counter()
    for i in range(reps):
        step(i)
    sync(device)
    wall = (time.perf_counter() - t0) / reps
    ts = []
    for i in range(reps):
        t = time.perf_counter()
        step(i)
        sync(device)
        ts.append(time.perf_counter() - t)
    ts.sort()
    return {"step_ms": round(wall * 1e3, 3), "p50_us": round(ts[len(ts) // 2] * 1e6, 1),
            "p99_us": round(ts[min(len(ts) - 1, int(len(ts) * 0.99))] * 1e6, 1)}


def batches(rows: int, n: int, count: int, device: torch.device
            ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    z = ZipfKeys(rows, 1.05, seed=n)
    keys = [z.sample(n).to(device) for _ in range(count)]
    gen = torch.Generator().manual_seed(n)
    grads = [torch.randn(n, DIM, generator=gen).to(device) for _ in range(2)]
    return keys, grads


def torch_step(emb: torch.nn.Embedding, opt: torch.optim.Optimizer, keys: list[torch.Tensor],
               grads: list[torch.Tensor]) -> Callable[[int], None]:
    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        emb(keys[i % len(keys)]).backward(grads[i % len(grads)])
        opt.step()
    return step


def layer_step(layer: Any, opt: torch.optim.Optimizer | None, keys: list[torch.Tensor],
               grads: list[torch.Tensor]) -> Callable[[int], None]:
    def step(i: int) -> None:
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        layer(keys[i % len(keys)]).backward(grads[i % len(grads)])
        if opt is not None:
            opt.step()
    return step


def autograd_floor(device: torch.device, reps: int) -> None:
    """The least a training step through ``loss.backward()`` costs on this machine: a
    4 x 4 ``nn.Linear``'s forward, sum and backward (every layer's step, torch's included,
    pays the autograd engine's call of its device's worker thread)."""
    lin = torch.nn.Linear(4, 4, device=device)
    x = torch.randn(4, 4, device=device)

    def step(_: int) -> None:
        lin(x).sum().backward()
    emit(bench="train_autograd_floor", impl="linear_4x4", device=device.type,
         **measure(step, device, max(reps, 100)))


def gpulayer(device: torch.device, rows: int, sizes: list[int], reps: int) -> None:
    init = torch.randn(rows, DIM, device=device)
    cases: list[tuple[str, Callable[[], Any], str]] = [
        ("rowwise_adagrad", lambda: optim.RowwiseAdagrad(0.01), "adagrad"),
        ("sgd_fused", lambda: optim.SGD(0.01), "sgd"),
        ("sgd_torch_optim", lambda: None, "sgd"),
    ]
    for n in sizes:
        keys, grads = batches(rows, n, 8, device)
        base: dict[str, dict[str, float]] = {}
        for name in ("adagrad", "sgd"):
            emb = torch.nn.Embedding(rows, DIM, sparse=True, device=device)
            with torch.no_grad():
                emb.weight.copy_(init)
            opt = (torch.optim.Adagrad(emb.parameters(), lr=0.01) if name == "adagrad"
                   else torch.optim.SGD(emb.parameters(), lr=0.01))
            base[name] = measure(torch_step(emb, opt, keys, grads), device, reps)
            emit(bench="train_gpulayer", impl=f"torch_{name}", keys=n, rows=rows,
                 device=device.type, **base[name])
            del emb, opt
        for label, make, against in cases:
            fused = make()
            with NVEmbedding(rows, DIM, torch.float32, LayerType.GPULayer, device=device,
                             weight_init=init, optimize_for_training=True,
                             optimizer=fused) as layer:
                opt = (torch.optim.SGD(layer.parameters(), lr=0.01) if fused is None
                       else None)
                got = measure(layer_step(layer, opt, keys, grads), device, reps)
            emit(bench="train_gpulayer", impl=label, keys=n, rows=rows, device=device.type,
                 vs=f"torch_{against}", speedup=round(base[against]["step_ms"] /
                                                     got["step_ms"], 2), **got)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def linear_uvm(device: torch.device, rows: int, n: int, reps: int) -> None:
    opt = optim.RowwiseAdagrad(0.01)
    width = opt.row_width(DIM, torch.float32)
    cache = rows * width * 4 // 10
    keys, grads = batches(rows, n, 8, device)
    init = torch.randn(rows, DIM)
    name = fresh_name("bench")
    with SharedMemBlock.create(name, num_rows=rows, dim=width) as mb:
        try:
            mb.write_range(0, torch.nn.functional.pad(init, (0, width - DIM)))
            with NVEmbedding(rows, DIM, torch.float32, LayerType.LinearUVM, device=device,
                             storage=mb, gpu_cache_size=cache, optimize_for_training=True,
                             optimizer=opt) as layer:
                got = measure(layer_step(layer, None, keys, grads), device, reps)
                hit = layer.stats()
        finally:
            SharedMemBlock.unlink(name)
    emb = torch.nn.Embedding(rows, DIM, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(init)
    tor = torch.optim.Adagrad(emb.parameters(), lr=0.01)
    cpu_keys = [k.cpu() for k in keys]

    def torch_cpu(i: int) -> None:
        tor.zero_grad(set_to_none=True)
        out = emb(cpu_keys[i % len(cpu_keys)]).to(device)  # NOTE: rows to the GPU
        out.backward(grads[i % len(grads)])  # NOTE: the gradient back to the host
        tor.step()

    base = measure(torch_cpu, device, max(3, reps // 4))
    emit(bench="train_linear_uvm", impl="torch_cpu_adagrad", keys=n, rows=rows,
         device=device.type, **base)
    emit(bench="train_linear_uvm", impl="rowwise_adagrad", keys=n, rows=rows,
         cache_bytes=cache, device=device.type, vs="torch_cpu_adagrad",
         speedup=round(base["step_ms"] / got["step_ms"], 2), stats=str(hit.gpu), **got)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--only", choices=["gpulayer", "linear_uvm"], default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    rows = args.rows or (4 << 20 if cuda and not args.quick else 1 << 16)
    sizes = [1 << 16, 1 << 18, 1 << 20] if cuda and not args.quick else [1 << 12, 1 << 14]
    reps = args.reps or (30 if cuda else 5)
    if args.only in (None, "gpulayer"):
        autograd_floor(device, reps)
        gpulayer(device, rows, sizes, reps)
    if args.only in (None, "linear_uvm"):
        linear_uvm(device, rows, sizes[-1 if cuda else 0], reps)


if __name__ == "__main__":
    main()
