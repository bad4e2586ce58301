"""Exported against eager: per-call p50/p99 of each layer type called eagerly, as a
``torch.export`` program loaded by ``gpu.export.load``, and as an AOTInductor package,
with ``nn.Embedding`` on the same keys as the baseline. Default layer arguments; the calls
of the four alternate one by one over distinct Zipf 1.05 batches (a sync after each).
Prints one JSON line per figure. On a CUDA machine: ``python bench/layers/bench_export.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.layers.bench_per_call import interleaved  # noqa: E402
from bench.layers.layer_tables import shared_tables  # noqa: E402
from bench.workloads import ZipfKeys  # noqa: E402
from gpu import LayerType, NVEmbedding  # noqa: E402
from gpu import export as gx  # noqa: E402

DIM = 128


class Model(torch.nn.Module):
    """One layer, then a scale: the smallest model a program holds the op in."""

    def __init__(self, emb: NVEmbedding) -> None:
        super().__init__()
        self.emb = emb

    def forward(self, keys: torch.Tensor) -> torch.Tensor:
        return self.emb(keys) * 2.0


def _compare(model: Model, lt: LayerType, rows: int, sizes: list[int],
             base: torch.nn.Embedding, tmp: Path, aot: bool, reps: int, wait: Any) -> None:
    """One layer type: eager, its loaded program (and package) and ``nn.Embedding``
    alternating, one JSON line per size."""
    dev = base.weight.device
    example = (ZipfKeys(rows, 1.05, seed=0).sample(1024).to(dev),)
    fns: dict[str, Any] = {"eager": model,
                           "program": gx.load(gx.save(model, example, tmp / f"{lt.name}-program"))}
    if aot:
        fns["aot"] = gx.load(gx.save(model, example, tmp / f"{lt.name}-aot", aot=True))
    fns["torch"] = lambda k: base(k) * 2.0
    try:
        with torch.no_grad():
            for n in sizes:
                batches = [ZipfKeys(rows, 1.05, seed=n + i).sample(n).to(dev) for i in range(32)]
                for name, fn in fns.items():
                    if not torch.equal(fn(batches[0]), base(batches[0]) * 2.0):
                        raise SystemExit(f"{lt.name} {name} returned wrong rows")
                got = interleaved(list(fns.values()), batches, reps, wait)
                row: dict[str, Any] = {"layer": lt.name, "keys": n}
                for name, (p50, p99) in zip(fns, got, strict=True):
                    row[f"{name}_p50_us"], row[f"{name}_p99_us"] = round(p50, 1), round(p99, 1)
                print(json.dumps(row), flush=True)
    finally:
        for name in ("program", "aot"):
            if name in fns:
                fns[name].close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1 << 20)
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--sizes", default="1024,16384")
    ap.add_argument("--device", default="cuda", help="cpu: a quick check of the script")
    ap.add_argument("--no-aot", dest="aot", action="store_false",
                    help="leave the AOTInductor package out (a torch whose AOTInductor cannot "
                         "load packages: tests/aot_probe.py)")
    a = ap.parse_args()
    rows, sizes = a.rows, [int(s) for s in a.sizes.split(",")]
    dev = torch.device(a.device)
    wait = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    weights = torch.randn(rows, DIM, generator=torch.Generator().manual_seed(1))
    base = torch.nn.Embedding.from_pretrained(weights.to(dev))
    tmp = Path(tempfile.mkdtemp(prefix="nvec-bx-"))
    with shared_tables(f"bx-{os.getpid()}", weights) as (mb, ps, hc):
        kinds = {LayerType.GPULayer: {"weight_init": weights},
                 LayerType.LinearUVM: {"storage": mb},
                 LayerType.Hierarchical: {"storage": ps, "host_cache": hc}}
        for lt, kw in kinds.items():
            model = Model(NVEmbedding(rows, DIM, torch.float32, lt, device=dev, **kw))
            try:
                _compare(model, lt, rows, sizes, base, tmp, a.aot, a.reps, wait)
            finally:
                model.emb.close()
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
