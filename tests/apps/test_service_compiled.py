"""``hostcache serve`` fills the node's compiled caches at start (issue 37's first lookup):
a child process compiles the per-key loops into numba's on-disk cache (and, on a CUDA
node, the layers' kernels into Triton's: tests/gpu/test_compiled_warm.py), so a replica
started after it loads every loop instead of compiling one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def _config(tmp_path: Path, table_name: str, **node: object) -> Path:
    return write_config(tmp_path / "node.toml",
                        {"state_dir": str(tmp_path / "state"), "metrics_port": -1, **node},
                        [{"name": table_name, "capacity": 256, "dim": DIM}])


def _loads(cache: Path) -> dict[str, dict[str, int]]:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
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
