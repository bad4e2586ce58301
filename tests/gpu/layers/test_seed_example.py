"""The seed's snippet (examples/seed_linear_uvm.py) runs with its imports changed (plus the
documented table size, the CPU where no CUDA GPU is present and the filled-in ``...``), and
prints what each rank read."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hostcache import shmlog
from tests.servers import free_port

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "seed_linear_uvm.py"
#: what each rank prints once its lookups read back the rows rank 0 wrote
REPORT = re.compile(r"^rank (\d+): 1024 rows read correctly on (\S+); GPU cache hit rate "
                    r"([0-9.]+)$", re.M)


def run_example(argv: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess[str],
                                                          list[str]]:
    """Run the example with its own shm log: ``(result, what it left in /dev/shm)`` (its
    own segments and lock files only, whatever tests running beside it create)."""
    log = tmp_path / "shm.log"
    env = {**os.environ, shmlog.ENV: str(log)}
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env,
                            cwd=tmp_path)
    return result, shmlog.leftovers(str(log))


def test_seed_snippet_runs_and_leaves_no_segment(tmp_path: Path) -> None:
    """Alone: one rank, on cuda:0 where a GPU is present, else on the CPU (the CPU twin of
    the sharded table)."""
    result, left = run_example([sys.executable, str(EXAMPLE)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = REPORT.findall(result.stdout)
    assert len(reports) == 1, result.stdout
    rank, device, hit_rate = reports[0]
    assert rank == "0"
    assert device == ("cuda:0" if torch.cuda.is_available() else "cpu")
    # first pass misses, second pass hits what the ~1,000-row GPU cache admitted
    assert 0.3 < float(hit_rate) <= 0.5
    assert left == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="one rank per GPU under torchrun: needs a CUDA GPU")
def test_seed_snippet_runs_under_torchrun_one_process_per_gpu(tmp_path: Path) -> None:
    """Two ranks (on two GPUs, or both on the one GPU) share one sharded MPIMemBlock."""
    ranks = max(2, torch.cuda.device_count())
    result, left = run_example(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
         f"--master-port={free_port()}", str(EXAMPLE)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = sorted(REPORT.findall(result.stdout))
    assert [r for r, _, _ in reports] == [str(r) for r in range(ranks)], result.stdout
    count = torch.cuda.device_count()
    assert [d for _, d, _ in reports] == [f"cuda:{r % count}" for r in range(ranks)]
    assert all(0.3 < float(h) <= 0.5 for _, _, h in reports)
    assert left == []
