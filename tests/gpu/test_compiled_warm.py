"""The service's warm-up child fills Triton's cache on a CUDA node: a replica started after
it, reading tables of the formats it warmed (its own table sizes and cache sizes), runs
every lookup path without compiling a kernel (Triton's cache gains no entry)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU "
                                 "(Triton compiles kernels only for one)")]

ROOT = Path(__file__).resolve().parents[2]

#: a replica: a Hierarchical layer over its own host cache, a LinearUVM and a GPULayer
#: over an int8 block, sizes unlike the warm-up's; row and pooled lookups, hits and misses
REPLICA = r"""
import sys, uuid
import torch
from gpu import LayerType, NVEmbedding, NVEmbeddingBag
from hostcache import HostCache, SharedMemBlock
dev = torch.device("cuda", 0)
tag = uuid.uuid4().hex[:8]
hc = HostCache.create(f"replica-hc-{tag}", capacity=50_000, dim=16)
mb = SharedMemBlock.create(f"replica-mb-{tag}", num_rows=30_000, dim=16, dtype=torch.int8)
try:
    hc.insert(torch.arange(20_000), torch.randn(20_000, 16))
    mb.write(torch.arange(30_000), torch.randn(30_000, 16))
    layers = [
        NVEmbedding(100_000, 16, torch.float32, LayerType.Hierarchical, host_cache=hc,
                    gpu_cache_size=1 << 20, device=dev, default_row=0.0),
        NVEmbeddingBag(100_000, 16, torch.float32, LayerType.Hierarchical, host_cache=hc,
                       gpu_cache_size=1 << 20, device=dev, default_row=0.0),
        NVEmbedding(30_000, 16, torch.float16, LayerType.LinearUVM, storage=mb,
                    gpu_cache_size=1 << 18, device=dev),
        NVEmbeddingBag(30_000, 16, torch.bfloat16, LayerType.GPULayer,
                       weight_init=torch.randn(30_000, 16, dtype=torch.bfloat16),
                       weight_dtype=torch.int8, device=dev),
    ]
    g = torch.Generator().manual_seed(1)
    for n in (300, 7000, 300, 7000):
        keys = torch.randint(0, 30_000, (n,), generator=g).to(dev)
        for layer in layers:
            if isinstance(layer, NVEmbeddingBag):
                layer(keys, torch.arange(0, n, 10, device=dev))
            else:
                layer(keys)
    torch.cuda.synchronize()
    for layer in layers:
        layer.close()
finally:
    hc.close(); HostCache.unlink(hc.name)
    mb.close(); SharedMemBlock.unlink(mb.name)
"""


def _entries(cache: Path) -> set[str]:
    return {str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file()}


def test_a_replica_after_the_warm_up_compiles_no_kernel(tmp_path: Path) -> None:
    cache = tmp_path / "triton"
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT),
           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
    subprocess.run([sys.executable, "-m", "nvecache.apps.service.compiled",
                    "16:float32:hostcache", "16:int8:linear"], env=env, cwd=ROOT, check=True,
                   timeout=900, capture_output=True)
    warmed = _entries(cache)
    assert warmed  # NOTE: the warm-up compiled kernels into the cache
    subprocess.run([sys.executable, "-c", REPLICA], env=env, cwd=ROOT, check=True,
                   timeout=600, capture_output=True)
    assert _entries(cache) - warmed == set()
