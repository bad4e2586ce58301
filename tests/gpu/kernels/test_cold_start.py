"""A Hierarchical layer in a process whose numba cache is cold (a fresh install): its
construction and first lookup are served by the loops' numpy twins without waiting for
numba, and give what the compiled loops give once they are ready."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import psclient
from hostcache import HostCache
from tests.conftest import fresh_name

ROOT = Path(__file__).resolve().parents[3]
DIM = 16

SCRIPT = r"""
import json, sys
import numpy as np
import torch
import psclient
from gpu import LayerType, NVEmbedding
from gpu.stacks.misses.miss_twin import GATE as MISS
from hostcache import HostCache
from hostcache.table_twin import GATE as TABLE
from psclient.file.mirror_twin import GATE as MIRROR

url, table, first_cache, second_cache, work = sys.argv[1:6]
dim = int(sys.argv[6])
keys = torch.from_numpy(np.load(f"{work}/keys.npy"))
gates = (TABLE, MIRROR, MISS)
report = {}


def serve(name, out):
    with HostCache.attach(name) as hc:
        layer = NVEmbedding(1000, dim, torch.float32, LayerType.Hierarchical,
                            gpu_cache_size=2**20, host_cache=hc, storage=url, table=table,
                            device="cpu", default_row=0.0)
        try:
            np.save(f"{work}/{out}.npy", layer(keys).numpy())
            report[out] = {"twin_picks": [g.twin_picks for g in gates],
                           "ready": [g.ready for g in gates]}
            layer.flush()  # NOTE: the host-cache fills, through the same loops
            report[out]["twin_picks_flushed"] = [g.twin_picks for g in gates]
        finally:
            layer.close()


serve(first_cache, "first")
report["ready"] = all(g.wait(500) for g in gates)
from gpu.stacks.misses import miss_loops
from hostcache import table_loops
from psclient.file import mirror_loops
loops = {f"{m.__name__}.{n}": f for m in (table_loops, mirror_loops, miss_loops)
         for n, f in vars(m).items() if hasattr(f, "signatures") and not n.startswith("_")}
before = {n: len(f.signatures) for n, f in loops.items()}
report["compiled_here"] = {n: sum(f.stats.cache_misses.values()) for n, f in loops.items()}
serve(second_cache, "second")
ps = psclient.connect(url, table=table)
try:
    ps.update(keys[:8], torch.ones(8, dim))  # NOTE: a write of the row mirror, compiled
finally:
    ps.close()
report["new_signatures"] = {n: len(f.signatures) - before[n] for n, f in loops.items()
                            if len(f.signatures) != before[n]}
print(json.dumps(report))
"""


@pytest.mark.slow
def test_a_cold_process_serves_its_first_lookup_without_waiting_for_numba(
        tmp_path: Path) -> None:
    url, table = f"file://{tmp_path}/store", "cold"
    rng = np.random.default_rng(5)
    rows = torch.from_numpy(rng.standard_normal((600, DIM)).astype(np.float32))
    ps = psclient.connect(url, table=table, dim=DIM, dtype=torch.float32)
    try:
        ps.insert(torch.arange(600), rows)
    finally:
        ps.close()
    # NOTE: keys in the host cache (0-99), in the store only (100-599), in neither
    # (600-799, the default row), many repeated
    keys = rng.integers(0, 800, 1000).astype(np.int64)
    np.save(tmp_path / "keys.npy", keys)
    want = np.zeros((keys.size, DIM), np.float32)
    stored = keys < 600
    want[stored] = rows.numpy()[keys[stored]]
    names = [fresh_name("cold-"), fresh_name("cold-")]
    try:
        for name in names:
            with HostCache.create(name, capacity=4096, dim=DIM) as hc:
                hc.insert(torch.arange(100), rows[:100])
        env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}  # NOTE: empty
        done = subprocess.run([sys.executable, "-c", SCRIPT, url, table, *names,
                               str(tmp_path), str(DIM)], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=580)
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads(done.stdout.splitlines()[-1])
    finally:
        for name in names:
            HostCache.unlink(name)
    first, second = (np.load(tmp_path / f"{n}.npy") for n in ("first", "second"))
    np.testing.assert_array_equal(first, want)
    np.testing.assert_array_equal(second, first)  # NOTE: the twins' answer, the loops'
    # the first lookup: every loop module's twin served (the compiled loops are only
    # asked for by a first pick, and cannot be ready before it returns)
    assert all(p >= 1 for p in report["first"]["twin_picks"])
    assert report["ready"]
    # the second: the compiled loops alone (no twin picked since), loaded from the cache
    # the child process wrote (none compiled in this process), for every signature used
    assert report["second"]["twin_picks_flushed"] == report["first"]["twin_picks_flushed"]
    assert report["second"]["ready"] == [True, True, True]
    assert not any(report["compiled_here"].values()), report["compiled_here"]
    assert report["new_signatures"] == {}
