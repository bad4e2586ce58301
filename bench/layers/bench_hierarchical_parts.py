"""Where a Hierarchical lookup's time goes: the probes behind bench_hierarchical's figures.

Same workload as ``bench/layers/bench_hierarchical.py`` (1M x 128 fp32 rows in a ``file://``
parameter server, GPU cache 5%, shared host cache 20%, fresh Zipf 1.05 batches, default
arguments), at 1k and 4k keys a call, after 8M keys of warm-up. One JSON line each:

* ``hierarchical_parts``: the calling thread's time per call in each step, with the
  host-cache worker's work run inline (so nothing else competes for the GIL): the GPU
  cache's lookup (and its sync), the host cache's read (with the GPU's hit report when the
  GPU reads it), the parameter-server path (of it ``ps.lookup`` itself, and the fills
  made inline), the admission offer. Beside them the p50 of the whole call as shipped
  (worker thread) and with the worker's work switched off.
* ``hierarchical_host_read_paths`` (CUDA): the p50 of the whole call with every GPU miss
  read from the host cache by the GPU kernel against read on the CPU
  (``TierConfig.host_gpu_read_keys`` 1 or never), alternating on one warm layer.

These poke the stack's internals on purpose (timers around its steps); they measure, and
change nothing the layer returns. Run: ``python bench/layers/bench_hierarchical_parts.py
[--device cpu] [--quick]``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
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
from bench.layers.bench_hierarchical import emit, per_call  # noqa: E402
from bench.workloads import ZipfKeys, compiled_loops  # noqa: E402
from gpu import LayerType, NVEmbedding  # noqa: E402
from gpu.kernels import host_reads as host_kernels  # noqa: E402
from hostcache import HostCache  # noqa: E402

DIM = 128


def _p50(fn: Callable[[torch.Tensor], Any], batches: list[torch.Tensor],
         wait: Callable[[], None]) -> float:
    return per_call(fn, batches, wait)[0]


class _Inline:
    """A stand-in for the host-cache worker that runs each submission at once, timed."""

    def __init__(self, spent: dict[str, float]) -> None:
        self._spent = spent

    def submit(self, handler: Callable[[list[Any]], None], item: Any, weight: int = 1) -> None:
        t0 = time.perf_counter()
        handler([item])
        self._spent["worker_inline"] += time.perf_counter() - t0

    def drain(self, timeout: float | None = None) -> bool:
        return True

    def close(self) -> None:
        pass


def _timed(obj: Any, name: str, label: str, spent: dict[str, float], sync: Callable[[], None]
           ) -> None:
    """Wrap ``obj.name`` so that its time (after a sync) adds to ``spent[label]``."""
    inner = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        sync()
        spent[label] += time.perf_counter() - t0
        return out

    setattr(obj, name, wrapper)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run)")
    ap.add_argument("--quick", action="store_true", help="a smaller table, fewer calls")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU here: pass --device cpu for a smoke run", file=sys.stderr)
        return 2
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = 1 << 16 if args.quick else 1 << 20
    calls = 40 if args.quick else 200
    warm_keys = (1 << 19) if args.quick else (8 << 20)
    with tempfile.TemporaryDirectory() as tmp:
        ps = psclient.connect(f"file://{tmp}/ps", table="parts", dim=DIM, dtype=torch.float32)
        ps.load(torch.randn(rows, DIM, generator=torch.Generator().manual_seed(1)),
                progress=False)
        for mode in ("inline", "thread"):
            hc = HostCache.create(f"bench-parts-{mode}-{os.getpid()}", capacity=rows // 5,
                                  dim=DIM)
            try:
                emb = NVEmbedding(rows, DIM, torch.float32, LayerType.Hierarchical,
                                  gpu_cache_size=rows // 20 * (DIM * 4 + 12), host_cache=hc,
                                  storage=ps, device=dev)
                stack = emb._tiers
                spent: dict[str, float] = collections.defaultdict(float)
                if mode == "inline":
                    stack.filler.close()
                    stack.filler = stack.resolver.filler = _Inline(spent)
                    _timed(stack.cache, "serve", "gpu_cache_lookup", spent, sync)
                    _timed(hc, "lookup", "host_cache_read", spent, lambda: None)
                    _timed(host_kernels, "hostcache_lookup", "host_cache_read", spent, sync)
                    _timed(stack.resolver, "read_ps", "ps_path", spent, sync)
                    _timed(ps, "lookup", "ps_lookup", spent, lambda: None)
                    _timed(stack.pending, "offer", "admission_offer", spent, sync)
                z = ZipfKeys(rows, 1.05, seed=4)
                for n in (1 << 10, 1 << 12):
                    for _ in range(warm_keys // n):
                        emb(z.sample(n).to(dev))
                    emb.flush()
                    compiled_loops()  # NOTE: the compiled loops timed, not their twins
                    spent.clear()
                    p50 = _p50(emb, [z.sample(n).to(dev) for _ in range(calls)], sync)
                    per_call = {k: round(v / calls * 1e6, 1) for k, v in spent.items()}
                    if mode == "inline":
                        emit(bench="hierarchical_parts", device=dev.type, batch=n,
                             worker="inline", p50_us=round(p50, 1), per_call_us=per_call)
                        continue
                    submit = stack.filler.submit
                    stack.filler.submit = lambda handler, item, weight=1: None
                    off = _p50(emb, [z.sample(n).to(dev) for _ in range(calls)], sync)
                    stack.filler.submit = submit
                    emit(bench="hierarchical_parts", device=dev.type, batch=n,
                         worker="thread", p50_us=round(p50, 1),
                         p50_worker_work_off_us=round(off, 1))
                    if dev.type == "cuda":
                        base = stack.config
                        res: dict[str, list[float]] = {"gpu": [], "cpu": []}
                        for _ in range(2):
                            for path, thr in (("gpu", 1), ("cpu", 1 << 62)):
                                stack.config = dataclasses.replace(base, host_gpu_read_keys=thr)
                                res[path].append(round(_p50(
                                    emb, [z.sample(n).to(dev) for _ in range(calls // 2)],
                                    sync), 1))
                                emb.flush()
                        stack.config = base
                        emit(bench="hierarchical_host_read_paths", batch=n,
                             gpu_read_p50_us=res["gpu"], cpu_read_p50_us=res["cpu"])
                emb.close()
            finally:
                hc.close()
                HostCache.unlink(hc.name)
        ps.drop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
