"""Exported against eager: per-call p50/p99 of each layer type called eagerly, as a
``torch.export`` program loaded by ``gpu.export.load``, and as an AOTInductor package,
with ``nn.Embedding`` on the same keys as the baseline. Default layer arguments; the calls
of the four alternate one by one over distinct Zipf 1.05 batches (a sync after each).
Prints one JSON line per figure. On a CUDA machine: ``python bench/bench_export.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psclient  # noqa: E402
from bench.bench_per_call import interleaved  # noqa: E402
from bench.workloads import ZipfKeys  # noqa: E402
from gpu import LayerType, NVEmbedding  # noqa: E402
from gpu import export as gx  # noqa: E402
from hostcache import HostCache, SharedMemBlock  # noqa: E402

DIM = 128


class Model(torch.nn.Module):
    """One layer, then a scale: the smallest model a program holds the op in."""

    def __init__(self, emb: NVEmbedding) -> None:
        super().__init__()
        self.emb = emb

    def forward(self, keys: torch.Tensor) -> torch.Tensor:
        return self.emb(keys) * 2.0


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
    tag, tmp = f"bx-{os.getpid()}", Path(tempfile.mkdtemp(prefix="nvec-bx-"))
    mb = SharedMemBlock.create(tag + "-lin", num_rows=rows, dim=DIM)
    ps = psclient.connect(f"file://{tmp}/ps", table=tag, dim=DIM, dtype=torch.float32)
    hc = HostCache.create(tag, capacity=rows // 5, dim=DIM)
    try:
        mb.write(torch.arange(rows), weights)
        ps.load(weights, progress=False)
        kinds = {LayerType.GPULayer: {"weight_init": weights},
                 LayerType.LinearUVM: {"storage": mb},
                 LayerType.Hierarchical: {"storage": ps, "host_cache": hc}}
        for lt, kw in kinds.items():
            model = Model(NVEmbedding(rows, DIM, torch.float32, lt, device=dev, **kw))
            example = (ZipfKeys(rows, 1.05, seed=0).sample(1024).to(dev),)
            program = gx.load(gx.save(model, example, tmp / f"{lt.name}-program"))
            fns = {"eager": model, "program": program}
            if a.aot:
                fns["aot"] = gx.load(gx.save(model, example, tmp / f"{lt.name}-aot", aot=True))
            fns["torch"] = lambda k: base(k) * 2.0
            with torch.no_grad():
                for n in sizes:
                    batches = [ZipfKeys(rows, 1.05, seed=n + i).sample(n).to(dev)
                               for i in range(32)]
                    for name, fn in fns.items():
                        if not torch.equal(fn(batches[0]), base(batches[0]) * 2.0):
                            raise SystemExit(f"{lt.name} {name} returned wrong rows")
                    got = interleaved(list(fns.values()), batches, a.reps, wait)
                    row = {"layer": lt.name, "keys": n}
                    for name, (p50, p99) in zip(fns, got, strict=True):
                        row[f"{name}_p50_us"], row[f"{name}_p99_us"] = round(p50, 1), round(p99, 1)
                    print(json.dumps(row), flush=True)
            program.close()
            if a.aot:
                fns["aot"].close()
            model.emb.close()
    finally:
        hc.close()
        HostCache.unlink(tag)
        mb.close()
        SharedMemBlock.unlink(tag + "-lin")
        ps.drop()
        ps.close()


if __name__ == "__main__":
    main()
