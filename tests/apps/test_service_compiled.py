"""``hostcache serve`` fills the node's compiled caches at start (issue 37's first lookup):
a child process compiles the per-key loops into numba's on-disk cache and, on a CUDA node,
the layers' kernels into Triton's, so a replica started after it loads every loop and
kernel instead of compiling one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nvecache.apps.service import NodeService, ServiceConfigError, build_config
from nvecache.apps.service.compiled import LOOP_MODULES
from tests.test_failures import DIM, write_config

ROOT = Path(__file__).resolve().parents[2]

#: a fresh process: each loop module's compiled functions, loaded as a replica loads them,
#: and what numba's cache gave (hits) or had to compile (misses)
LOADS = r"""
import importlib, json, sys
from numba.core.dispatcher import Dispatcher
out = {}
for name in sys.argv[1:]:
    m = importlib.import_module(name)
    m.warm_up()
    fns = [f for f in vars(m).values() if isinstance(f, Dispatcher)]
    out[name] = {"functions": len(fns),
                 "hits": sum(sum(f.stats.cache_hits.values()) for f in fns),
                 "misses": sum(sum(f.stats.cache_misses.values()) for f in fns)}
print(json.dumps(out))
"""


def _path() -> str:
    """PYTHONPATH for a child: this checkout first, then what this process was given."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)


def _config(tmp_path: Path, table_name: str, **node: object) -> Path:
    return write_config(tmp_path / "node.toml",
                        {"state_dir": str(tmp_path / "state"), "metrics_port": -1, **node},
                        [{"name": table_name, "capacity": 256, "dim": DIM}])


def _loads(cache: Path) -> dict[str, dict[str, int]]:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": _path()}
    done = subprocess.run([sys.executable, "-c", LOADS, *LOOP_MODULES], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def test_a_replica_after_the_service_loads_every_loop_from_the_cache_it_filled(
        tmp_path: Path, table_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "numba"
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(cache))  # NOTE: what the child inherits
    svc = NodeService(build_config(_config(tmp_path, table_name)))
    svc.start()
    try:
        assert svc.warmer is not None
        assert svc.warmer.wait(600) == "ready"
        assert svc.health()[1]["compiled"] == "ready"
    finally:
        svc.stop()
    loads = _loads(cache)
    assert set(loads) == set(LOOP_MODULES)
    for name, got in loads.items():
        assert got["functions"] > 0, name
        assert got["misses"] == 0, (name, got)  # NOTE: nothing compiled in the replica
        assert got["hits"] > 0, (name, got)


def test_a_replica_without_the_service_compiles_its_loops(tmp_path: Path) -> None:
    # NOTE: the other side of the test above: a cold cache is what the service removes
    loads = _loads(tmp_path / "numba-cold")
    assert all(got["misses"] > 0 for got in loads.values()), loads


def test_stopping_the_service_stops_its_warm_up_child(
        tmp_path: Path, table_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba"))  # NOTE: cold: a long warm-up
    svc = NodeService(build_config(_config(tmp_path, table_name)))
    svc.start()
    warmer = svc.warmer
    assert warmer is not None and warmer.pid is not None
    svc.stop()
    assert warmer.state in ("stopped", "ready")
    with pytest.raises(ProcessLookupError):  # NOTE: ended and reaped
        os.kill(warmer.pid, 0)


def test_warm_compiled_off_starts_no_child(tmp_path: Path, table_name: str) -> None:
    svc = NodeService(build_config(_config(tmp_path, table_name, warm_compiled=False)))
    svc.start()
    try:
        assert svc.warmer is None
        assert "compiled" not in svc.health()[1]
    finally:
        svc.stop()


def test_warm_compiled_must_be_a_bool(tmp_path: Path, table_name: str) -> None:
    with pytest.raises(ServiceConfigError, match="warm_compiled"):
        build_config(_config(tmp_path, table_name, warm_compiled="sometimes"))


# -- Triton's cache (a CUDA node) ------------------------------------------------------------

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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU (Triton compiles kernels only for one)")
def test_a_replica_after_the_warm_up_compiles_no_kernel(tmp_path: Path) -> None:
    # NOTE: the replica's tables and caches are sized unlike the warm-up's, and read in
    # row and pooled lookups, hits and misses
    cache = tmp_path / "triton"
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "PYTHONPATH": _path(),
           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
    subprocess.run([sys.executable, "-m", "nvecache.apps.service.compiled",
                    "16:float32:hostcache", "16:int8:linear"], env=env, cwd=ROOT, check=True,
                   timeout=900, capture_output=True)
    warmed = _entries(cache)
    assert warmed  # NOTE: the warm-up compiled kernels into the cache
    subprocess.run([sys.executable, "-c", REPLICA], env=env, cwd=ROOT, check=True,
                   timeout=600, capture_output=True)
    assert _entries(cache) - warmed == set()
