"""The GPU cache's CPU twin (``gpu.cache.twin``): what a CPU layer's cache lookup costs.

A ``GPUCache`` on the CPU (64k slots of fp32 dim 128, every slot filled), looked up with
batches of 1k, 16k and 64k keys, half of them cached; median of 100 calls, wall clock.
Run: ``python bench/kernels/bench_cache_twin.py``. One JSON line per batch size.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gpu.cache.gpu_cache import GPUCache  # noqa: E402


def main() -> int:
    slots, dim = 1 << 16, 128
    cache = GPUCache(slots * (8 + 4 + 4 * dim), dim, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(0)
    keys = torch.randperm(1 << 20, generator=gen)[:slots]
    cache.insert(keys, torch.randn(slots, dim, generator=gen))
    for n in (1 << 10, 1 << 14, 1 << 16):
        absent = torch.randint(1 << 21, 1 << 22, (n - n // 2,), generator=gen)
        batch = torch.cat([keys[: n // 2], absent])
        ts = []
        for _ in range(100):
            t0 = time.perf_counter()
            cache.lookup(batch)
            ts.append(time.perf_counter() - t0)
        ts.sort()
        print(json.dumps({"bench": "cache_twin_lookup", "batch": n, "dim": dim,
                          "p50_us": round(ts[50] * 1e6, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
