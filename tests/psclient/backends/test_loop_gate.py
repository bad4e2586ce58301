"""nvecache.common.loop_gate in a process whose numba cache is cold: the twin answers the first
pick, a child process compiles the loop into the cache, and this process then loads it
from there (a cache hit, no compilation of its own) and hands it out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = r"""
import json, sys, types
import numpy as np
from nvecache.common.loop_gate import LoopGate

twin = types.ModuleType("twin")
twin.total = lambda a: int(a.sum())
gate = LoopGate("tests.psclient.gate_sample", twin)
first = gate.pick()
report = {"first_is_twin": first is twin, "twin_total": first.total(np.arange(5))}
report["ready"] = gate.wait(300)
m = gate.pick()
report.update(name=m.__name__, picks=gate.twin_picks, total=int(m.total(np.arange(5))),
              hits=sum(m.total.stats.cache_hits.values()),
              misses=sum(m.total.stats.cache_misses.values()))
print(json.dumps(report))
"""


@pytest.mark.slow
def test_a_cold_cache_is_filled_by_a_child_and_loaded_here(tmp_path: Path) -> None:
    cache = tmp_path / "numba"
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400, check=True)
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["first_is_twin"] and report["twin_total"] == 10
    assert report["ready"] and report["name"] == "tests.psclient.gate_sample"
    assert report["picks"] == 1 and report["total"] == 10
    # NOTE: loaded from the cache the child wrote: this process compiled nothing
    assert report["hits"] == 1 and report["misses"] == 0
    assert list(cache.rglob("gate_sample.total-*.nbi"))


def test_gates_lists_every_loop_modules_gate_made_in_this_process() -> None:
    from gpu.stacks.misses.miss_twin import GATE as MISS
    from hostcache.table_twin import GATE as TABLE
    from nvecache.common.loop_gate import gates
    from psclient.file.mirror_twin import GATE as MIRROR

    made = gates()
    assert all(any(g is known for g in made) for known in (TABLE, MIRROR, MISS))
    assert len({g.module for g in made}) == len(made)  # NOTE: one gate a module
