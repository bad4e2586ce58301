"""A Hierarchical layer's construction and first lookup in a fresh process, with the
compiled caches (numba's and, on CUDA, Triton's) cold (a fresh install), warm (a process
ran before), or filled by the node service's warm-up child (what a replica on a node whose
``hostcache serve`` has started sees).

A ``file://`` store of 1M x 128 fp32 rows (``--quick``: 100k), written by a process of its
own; ``--redis URL`` adds the same table in Redis. Per store, a fresh Python process with
``NUMBA_CACHE_DIR`` a new empty directory (what a fresh install sees) times each step:
``import torch`` (not counted: users pay it anyway), ``import hostcache, psclient, gpu``,
``HostCache.create`` (20% of the rows), ``NVEmbedding(..., LayerType.Hierarchical,
gpu_cache_size=2**24, host_cache=..., storage=URL, device="cpu", default_row=0.0)`` and
its first lookup of 1,024 uniform keys; then how long until the compiled loops are ready
(where the tree has loop gates), and the steady state: the median of 30 lookups of fresh
1,024-key batches once they are. A second process does the same with the cache the first
left (warm). A third process starts with new empty caches that ``python -m
nvecache.apps.service.compiled 128:float32:hostcache`` (the service's child) filled first
(service). ``--device cuda`` runs the layer on the GPU (``TRITON_CACHE_DIR`` fresh per
store as numba's). One JSON line per process; ``counted_s`` is imports + create +
construction + first lookup; on CUDA ``triton_variants`` counts, per phase (construct,
first_lookup, later), the Triton kernel variants the process compiled or loaded from
Triton's cache and the seconds they took (each one listed on stderr).

``--root PATH`` measures another checkout of the project with the same script (the tree
before a change, from ``git archive``): every process puts it first on ``sys.path``.
``--profile`` prints where each process's construction and first lookup spent their time
(cProfile, to stderr). Run: ``python bench/layers/bench_cold_start.py [--quick] [--redis URL]
[--root PATH] [--device cuda] [--profile]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PREPARE = r"""
import sys
sys.path.insert(0, sys.argv[1])
import torch, psclient
url, table, rows = sys.argv[2], sys.argv[3], int(sys.argv[4])
ps = psclient.connect(url, table=table, dim=128, dtype=torch.float32)
ps.load(torch.randn(rows, 128, generator=torch.Generator().manual_seed(1)), progress=False)
ps.close()
"""

DROP = r"""
import sys
sys.path.insert(0, sys.argv[1])
import psclient
ps = psclient.connect(sys.argv[2], table=sys.argv[3])
ps.drop()
"""

MEASURE = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
url, table, rows, name, device = sys.argv[2], sys.argv[3], int(sys.argv[4]), *sys.argv[5:7]
profiling = sys.argv[7] == "profile"
if profiling:
    import cProfile, pstats
    prof = cProfile.Profile()
t = time.perf_counter()
import torch
torch_s = time.perf_counter() - t
t = time.perf_counter()
import gpu
gpu_import_s = time.perf_counter() - t
import hostcache, psclient
import_s = time.perf_counter() - t
def sync():
    if device != "cpu":
        torch.cuda.synchronize()
# NOTE: every Triton kernel variant this process compiles or loads from Triton's cache, by
# phase: its JIT calls jit_cache_hook before and jit_post_compile_hook after (both keyed)
phase, kernels, started = ["before"], [], {}
if device != "cpu":
    try:
        from triton import knobs
    except ImportError:
        knobs = None
    if knobs is not None:
        def _before(*, key, fn, **_):
            started[id(fn.jit_function), str(key)] = time.perf_counter()
            return False
        def _after(*, key, fn, **_):
            t0 = started.pop((id(fn.jit_function), str(key)), None)
            if t0 is not None:
                kernels.append((phase[0], fn.name, time.perf_counter() - t0))
        knobs.runtime.jit_cache_hook = _before
        knobs.runtime.jit_post_compile_hook = _after
from gpu import LayerType, NVEmbedding
from hostcache import HostCache
t = time.perf_counter()
hc = HostCache.create(name, capacity=rows // 5, dim=128)
create_s = time.perf_counter() - t
try:
    if profiling:
        prof.enable()
    phase[0] = "construct"
    t = time.perf_counter()
    layer = NVEmbedding(rows, 128, torch.float32, LayerType.Hierarchical, gpu_cache_size=2**24,
                        host_cache=hc, storage=url, table=table, device=device, default_row=0.0)
    sync()
    build_s = time.perf_counter() - t
    if profiling:  # NOTE: the construction, then the first lookup on its own
        prof.disable()
        print(f"== {name}: construction", file=sys.stderr)
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(40)
        prof = cProfile.Profile()
    keys = torch.randint(0, rows, (1024,), generator=torch.Generator().manual_seed(2))
    keys = keys.to(device)
    sync()
    if profiling:
        prof.enable()
    phase[0] = "first_lookup"
    t = time.perf_counter()
    layer(keys)
    sync()
    first_s = time.perf_counter() - t
    if profiling:
        prof.disable()
        print(f"== {name}: first lookup", file=sys.stderr)
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(40)
    phase[0] = "later"
    numba_at_first = "numba" in sys.modules
    t = time.perf_counter()
    if not any(os.path.exists(os.path.join(sys.argv[1], *p, "loop_gate.py"))
               for p in (("psclient",), ("nvecache", "common"))):
        ready_s = 0.0  # NOTE: a tree without loop gates: compiled before the first lookup
    else:
        from gpu.stacks.misses.miss_twin import GATE as MISS
        from hostcache.table_twin import GATE as TABLE
        from psclient.file.mirror_twin import GATE as MIRROR
        ready = all(g.wait(600) for g in (TABLE, MIRROR, MISS) if g.twin_picks)
        ready_s = time.perf_counter() - t if ready else None
    g = torch.Generator().manual_seed(3)
    times = []
    for _ in range(30):
        batch = torch.randint(0, rows, (1024,), generator=g).to(device)
        sync()
        t = time.perf_counter()
        layer(batch)
        sync()
        times.append(time.perf_counter() - t)
    layer.close()
finally:
    hc.close()
    HostCache.unlink(name)
times.sort()
by_phase = {}
for ph, kname, secs in kernels:
    n_s = by_phase.setdefault(ph, [0, 0.0])
    n_s[0] += 1
    n_s[1] += secs
if kernels:
    print(f"== {name}: Triton kernel variants compiled or loaded (phase, seconds, kernel)",
          file=sys.stderr)
    for ph, kname, secs in sorted(kernels, key=lambda k: -k[2]):
        print(f"  {ph:13s} {secs:7.3f} {kname}", file=sys.stderr)
print(json.dumps({
    "torch_import_s": torch_s, "gpu_import_s": gpu_import_s, "imports_s": import_s,
    "host_cache_create_s": create_s,
    "construct_s": build_s, "first_lookup_s": first_s,
    "counted_s": import_s + create_s + build_s + first_s,
    "numba_loaded_at_first_lookup": numba_at_first, "compiled_ready_after_s": ready_s,
    "steady_p50_ms": times[len(times) // 2] * 1e3, "hostcache_from": hostcache.__file__,
    "triton_variants": {ph: {"count": c, "s": secs} for ph, (c, secs) in by_phase.items()}}))
"""


def python(code: str, *args: str, env: dict[str, str] | None = None) -> str:
    """``code`` run by a fresh interpreter with ``args``: its stdout (its stderr, a
    profile's report, passed on to ours)."""
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, check=True,
                          capture_output=True, text=True)
    sys.stderr.write(done.stderr)
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100k rows instead of 1M")
    parser.add_argument("--redis", metavar="URL", help="also a Redis store at URL")
    parser.add_argument("--root", default=str(ROOT), help="the checkout to measure")
    parser.add_argument("--device", default="cpu", help="the layer's device (cpu, cuda)")
    parser.add_argument("--profile", action="store_true",
                        help="each process's construction and first lookup under cProfile, "
                        "its report (40 entries by cumulative time) to stderr")
    args = parser.parse_args()
    rows = 100_000 if args.quick else 1_000_000
    root = os.path.abspath(args.root)
    with tempfile.TemporaryDirectory(prefix="bench-cold-") as tmp:
        table = f"bench-cold-{uuid.uuid4().hex[:8]}"
        stores = [("file", f"file://{tmp}/store")]
        if args.redis:
            stores.append(("redis", args.redis))
        prep_env = {**os.environ, "NUMBA_CACHE_DIR": f"{tmp}/numba-prepare"}
        for _, url in stores:
            python(PREPARE, root, url, table, str(rows), env=prep_env)
        try:
            for backend, url in stores:
                for state in ("cold", "warm", "service"):
                    # NOTE: new and empty caches for cold (warm reuses them) and service
                    caches = f"{tmp}/caches-{backend}-{'service' if state == 'service' else 'own'}"
                    env = {**os.environ, "NUMBA_CACHE_DIR": f"{caches}/numba",
                           "TRITON_CACHE_DIR": f"{caches}/triton",
                           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
                    warm_s = None
                    if state == "service":
                        t0 = time.perf_counter()
                        subprocess.run([sys.executable, "-m", "nvecache.apps.service.compiled",
                                        "128:float32:hostcache"], env=env, check=True)
                        warm_s = time.perf_counter() - t0
                    out = python(MEASURE, root, url, table, str(rows),
                                 f"bench-cold-{uuid.uuid4().hex[:8]}", args.device,
                                 "profile" if args.profile else "-", env=env)
                    fields = json.loads(out.splitlines()[-1])
                    print(json.dumps({"bench": "cold_start", "backend": backend,
                                      "device": args.device, "caches": state,
                                      "service_warm_up_s": warm_s, "rows": rows, **fields}),
                          flush=True)
        finally:
            if args.redis:
                python(DROP, root, args.redis, table, env=prep_env)


if __name__ == "__main__":
    main()
