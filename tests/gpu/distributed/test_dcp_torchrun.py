"""A checkpoint of a layer over a ``DistMemBlock`` under a real ``torchrun`` launch
(``tests/gpu/dcp_torchrun.py``, 2 gloo ranks): one launch saves, a separate launch (fresh
processes, as after a restart) loads into a fresh block, and the checkpoint holds the
table whole, one chunk per rank, so one process without a group reads it too. On the CPU
twin and (when present) CUDA, both ranks on GPU ``LOCAL_RANK % device_count``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gpu import LayerType, NVEmbedding, state
from tests.conftest import fresh_name
from tests.gpu import dcp_torchrun
from tests.gpu.distmem_ranks import device_of
from tests.gpu.state_ranks import DIM, Model, want_rows

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = Path(dcp_torchrun.__file__).resolve()
RANKS, ROWS = 2, 41  # rows that do not divide by the ranks: shares of 21 and 20
TIMEOUT = 300
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
KINDS = [pytest.param("cpu"), pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])]


def torchrun(ckpt: Path, mode: str, kind: str, layer_type: str = "LinearUVM") -> None:
    """One ``torchrun --standalone`` launch of the script; its output shown if it fails."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={RANKS}", str(SCRIPT), str(ckpt), mode,
           f"--name={fresh_name('dcp')}", f"--device={kind}", f"--rows={ROWS}",
           f"--layer-type={layer_type}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks: their own session
        out, _ = proc.communicate()
        pytest.fail(f"torchrun {mode} ran over {TIMEOUT} s:\n{out[-6000:]}")
    assert proc.returncode == 0, f"torchrun {mode} exited {proc.returncode}:\n{out[-6000:]}"
    ok = sorted(int(r) for r in re.findall(rf"rank (\d+)/{RANKS}: {mode} ok on", out))
    assert ok == list(range(RANKS)), out


@pytest.fixture(scope="module", params=KINDS)
def saved(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """(device kind, checkpoint directory) of one save launch of a LinearUVM layer."""
    kind = request.param
    ckpt = tmp_path_factory.mktemp(f"dcp-{kind}") / "ckpt"
    torchrun(ckpt, "save", kind)
    return kind, ckpt


@pytest.mark.parametrize("layer_type", ["LinearUVM", "GPULayer"])
def test_a_separate_launch_loads_what_another_saved(saved: tuple[str, Path],
                                                    layer_type: str) -> None:
    """Fresh processes, a fresh block of zeros: every rank's lookups are the saved rows
    again and the dense layer round-trips (checked in the ranks; any mismatch: rc 1)."""
    kind, ckpt = saved
    torchrun(ckpt, "load", kind, layer_type)


def test_the_checkpoint_holds_the_table_whole_one_chunk_per_rank(
        saved: tuple[str, Path]) -> None:
    md = dcp.FileSystemReader(str(saved[1])).read_metadata()
    weight = md.state_dict_metadata["emb.weight"]
    assert tuple(weight.size) == (ROWS, DIM)
    chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in weight.chunks)
    shares = [state.share(ROWS, RANKS, r) for r in range(RANKS)]
    assert chunks == [((start, 0), (stop - start, DIM)) for start, stop in shares]
    assert [size[0] for _, size in chunks] == [21, 20]
    dense = md.state_dict_metadata["dense.weight"]  # replicated: saved once
    assert [tuple(c.sizes) for c in dense.chunks] == [(2, DIM)]


def single_process_load(sd: dict[str, torch.Tensor], ckpt: Path) -> None:
    with warnings.catch_warnings():  # NOTE: "assuming ... a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(sd, checkpoint_id=str(ckpt), no_dist=True)


def test_one_process_without_a_group_reads_it_into_a_plain_tensor(
        saved: tuple[str, Path]) -> None:
    sd = {"emb.weight": torch.zeros(ROWS, DIM), "dense.weight": torch.zeros(2, DIM)}
    single_process_load(sd, saved[1])
    assert torch.equal(sd["emb.weight"], want_rows(ROWS, dcp_torchrun.ROWS_SEED))
    assert torch.equal(sd["dense.weight"], dcp_torchrun.saved_dense())


def test_one_process_without_a_group_loads_it_into_its_own_layer(
        saved: tuple[str, Path]) -> None:
    kind, ckpt = saved
    dev = device_of(kind, 0)
    layer = NVEmbedding(ROWS, DIM, torch.float32, LayerType.GPULayer, device=dev)
    try:
        model = Model(layer, seed=3)
        keys = torch.arange(ROWS, device=dev)
        want = want_rows(ROWS, dcp_torchrun.ROWS_SEED)
        assert not torch.equal(layer(keys).cpu(), want)
        sd = model.state_dict()
        single_process_load(sd, ckpt)
        model.load_state_dict(sd, strict=True)
        assert torch.equal(layer(keys).cpu(), want)
        assert torch.equal(model.dense.weight.detach().cpu(), dcp_torchrun.saved_dense())
    finally:
        layer.close()
