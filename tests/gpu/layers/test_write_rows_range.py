"""Loads of consecutive rows into a SharedMemBlock a LinearUVM layer reads (load_state_dict,
hostcache.files.load_rows): the rows go in with one copy and are announced, so the layer's
cache (and another layer's over the same block) drops its copies."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu import LayerType, NVEmbedding
from hostcache import GeometryMismatchError, NonFiniteValuesError, SharedMemBlock, files
from tests.conftest import fresh_name

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not CUDA, reason="needs a CUDA GPU")])]
ROWS, DIM = 64, 8


def _uvm(mb: SharedMemBlock, device: str) -> NVEmbedding:
    return NVEmbedding(ROWS, DIM, torch.float32, LayerType.LinearUVM,
                       gpu_cache_size=ROWS * 64, storage=mb, device=device)


def _rows(layer: NVEmbedding, device: str) -> torch.Tensor:
    return layer(torch.arange(ROWS, device=device)).cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_loads_of_consecutive_rows_drop_the_cached_copies(device: str, tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        mb = SharedMemBlock.create(fresh_name(), num_rows=ROWS, dim=DIM)
        stack.callback(SharedMemBlock.unlink, mb.name)
        stack.callback(mb.close)
        writer, reader = _uvm(mb, device), _uvm(mb, device)
        stack.callback(writer.close)
        stack.callback(reader.close)
        for layer in (writer, reader):
            _rows(layer, device)
            layer.flush()  # both caches hold the zero rows
        # the reader serves its cached copies: a write the ring does not announce is unseen
        mb.tensor[:] = 9.0
        assert not _rows(reader, device).any()
        mb.tensor[:] = 0.0

        torch.manual_seed(3)
        new = torch.randn(ROWS, DIM)
        cursor = mb.change_cursor
        writer.load_state_dict({"weight": new})  # gpu.state's chunks: write_rows
        assert mb.changes_since(cursor)[0].tolist() == list(range(ROWS))
        assert torch.equal(_rows(writer, device), new)
        assert torch.equal(_rows(reader, device), new)
        reader.flush()

        path = tmp_path / "rows.npy"
        np.save(path, (new * 2).numpy())
        with SharedMemBlock.attach(mb.name) as other:
            assert files.load_rows(other, path, chunk=10) == ROWS
        assert torch.equal(_rows(reader, device), new * 2)
        assert torch.equal(_rows(writer, device), new * 2)


def test_a_row_load_that_fails_writes_nothing(tmp_path: Path) -> None:
    with SharedMemBlock.create(fresh_name(), num_rows=ROWS, dim=DIM) as mb:
        try:
            bad = torch.ones(ROWS, DIM)
            bad[ROWS - 1, 0] = float("nan")  # in the last chunk: refused before the first
            np.save(tmp_path / "bad.npy", bad.numpy())
            cursor = mb.change_cursor
            with pytest.raises(NonFiniteValuesError, match="row 63"):
                files.load_rows(mb, tmp_path / "bad.npy", chunk=10)
            np.save(tmp_path / "big.npy", torch.ones(ROWS + 1, DIM).numpy())
            with pytest.raises(GeometryMismatchError):
                files.load_rows(mb, tmp_path / "big.npy", chunk=10)
            assert not mb.tensor.any() and mb.change_cursor == cursor
        finally:
            SharedMemBlock.unlink(mb.name)
