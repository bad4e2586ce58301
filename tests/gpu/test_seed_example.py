"""The seed's snippet (examples/seed_linear_uvm.py) runs with its imports changed (plus
the documented table size and the filled-in ``...``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hostcache import shmlog
from tests.servers import free_port

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "seed_linear_uvm.py"


def run_example(argv: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess[str],
                                                          list[str]]:
    """Run the example with its own shm log: ``(result, what it left in /dev/shm)`` (its
    own segments and lock files only, whatever tests running beside it create)."""
    log = tmp_path / "shm.log"
    env = {**os.environ, shmlog.ENV: str(log)}
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    return result, shmlog.leftovers(str(log))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the seed's snippet picks a CUDA device: needs a CUDA GPU")
def test_seed_snippet_runs_and_leaves_no_segment(tmp_path: Path) -> None:
    result, left = run_example([sys.executable, str(EXAMPLE)], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "rows read correctly" in result.stdout
    # first pass misses, second pass hits what the ~1,000-row GPU cache holds
    hit_rate = float(result.stdout.rsplit("hit rate", 1)[1].split()[0])
    assert 0.3 < hit_rate <= 0.5
    assert left == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the seed's snippet picks a CUDA device: needs a CUDA GPU")
def test_seed_snippet_runs_under_torchrun_one_process_per_gpu(tmp_path: Path) -> None:
    """Two ranks (on two GPUs, or both on the one GPU) share one sharded MPIMemBlock."""
    ranks = max(2, torch.cuda.device_count())
    result, left = run_example(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
         f"--master-port={free_port()}", str(EXAMPLE)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [ln for ln in result.stdout.splitlines() if "rows read correctly" in ln]
    assert sorted(ln.split(":")[0] for ln in lines) == [f"rank {r}" for r in range(ranks)]
    assert left == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present: the snippet runs")
def test_seed_snippet_without_cuda_says_so_in_one_line() -> None:
    result = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "CUDA" in lines[0] and "Traceback" not in result.stderr


def test_seed_snippet_differs_from_the_seed_only_where_documented() -> None:
    """Every line of the seed's code after the imports is in the example, in order."""
    seed = Path(__file__).resolve().parents[3] / "shared" / "SEED-resource-sharing.txt"
    if not seed.exists():
        pytest.skip("../shared/SEED-resource-sharing.txt is not beside the checkout")
    text = seed.read_text()
    snippet = text[text.index("import pynve.torch.nve_layers"):]
    snippet = snippet[: snippet.index("gc.collect()") + len("gc.collect()")]
    example = EXAMPLE.read_text().splitlines()
    changed = {"num_table_rows = 2**30"}  # scaled to fit one node, as the docstring says
    pos = 0
    for line in snippet.splitlines():
        line = line.strip()
        if not line or line.startswith(("import ", "from ")) or line in changed or line == "...":
            continue
        matches = [i for i in range(pos, len(example)) if example[i].strip().startswith(line)]
        assert matches, f"seed line missing from the example: {line!r}"
        pos = matches[0] + 1
