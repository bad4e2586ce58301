"""Loading a table from a ``.npy`` file and from a raw binary file of rows (with and without a
keys file), into file:// and Redis; a Hierarchical layer over that parameter server then
returns exactly those rows."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import psclient
from gpu import LayerType, NVEmbedding

ROWS, DIM = 300, 5  # NOTE: 20-byte rows, not a multiple of 16


@pytest.fixture(params=["file", "redis"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/store"
    shared: str = request.getfixturevalue("shared_redis")
    return shared


@pytest.fixture
def ps(url: str, table_name: str) -> Iterator[psclient.ParameterServer]:
    with psclient.connect(url, table=table_name, dim=DIM) as table:
        yield table
    psclient.connect(url, table=table_name).drop()


def rows_and_keys(tmp_path: Path) -> tuple[torch.Tensor, np.ndarray]:
    data = torch.randn(ROWS, DIM)
    keys = np.random.default_rng(0).choice(10**12, ROWS, replace=False).astype(np.int64) - 10**11
    np.save(tmp_path / "rows.npy", data.numpy())
    data.numpy().astype("<f4").tofile(tmp_path / "rows.bin")
    np.save(tmp_path / "keys.npy", keys)
    keys.astype("<i8").tofile(tmp_path / "keys.bin")
    return data, keys


def layer_over(ps: psclient.ParameterServer, device: str) -> NVEmbedding:
    return NVEmbedding(2**40, DIM, torch.float32, LayerType.Hierarchical, storage=ps,
                       device=device, gpu_cache_size=64 * DIM * 4)


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the layer on it)")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("source, keys_file", [
    ("rows.npy", None), ("rows.bin", None), ("rows.npy", "keys.npy"), ("rows.bin", "keys.bin"),
    ("rows.bin", "keys.npy"),
])
def test_load_file_then_layer_reads_those_rows(
        ps: psclient.ParameterServer, tmp_path: Path, source: str, keys_file: str | None,
        device: str) -> None:
    data, keys = rows_and_keys(tmp_path)
    kw = {} if keys_file is None else {"keys": tmp_path / keys_file}
    assert ps.load(tmp_path / source, progress=False, batch_size=64, **kw) == ROWS
    k = torch.arange(ROWS) if keys_file is None else torch.from_numpy(keys)
    assert ps.size() == ROWS
    order = torch.randperm(ROWS)
    emb = layer_over(ps, device)
    for _ in range(2):  # from the parameter server, then partly from the layer's cache
        assert torch.equal(emb(k[order].to(device)).cpu(), data[order])


def test_bad_files_are_refused_before_anything_is_written(
        ps: psclient.ParameterServer, tmp_path: Path) -> None:
    rows_and_keys(tmp_path)
    (tmp_path / "ragged.bin").write_bytes(b"\0" * (DIM * 4 * 3 + 1))
    (tmp_path / "rows.dat").write_bytes(b"\0" * (DIM * 4))
    np.save(tmp_path / "fkeys.npy", np.zeros(ROWS, dtype=np.float32))
    np.save(tmp_path / "ukeys.npy", np.zeros(ROWS, dtype=np.uint64))
    np.arange(ROWS - 1, dtype="<i8").tofile(tmp_path / "short.bin")
    cases: list[tuple[type[Exception], str, dict]] = [
        (psclient.BadValuesError, "whole number of rows", {"source": tmp_path / "ragged.bin"}),
        (psclient.BadArgumentError, "format=", {"source": tmp_path / "rows.dat"}),
        (psclient.BadKeysError, "one key per row",
         {"source": tmp_path / "rows.npy", "keys": tmp_path / "short.bin"}),
        (psclient.BadKeysError, "int64",
         {"source": tmp_path / "rows.npy", "keys": tmp_path / "fkeys.npy"}),
        (psclient.BadKeysError, "int64",
         {"source": tmp_path / "rows.npy", "keys": tmp_path / "ukeys.npy"}),
        (psclient.BadValuesError, "convert=True", {"source": torch.zeros(3, DIM).double()}),
        (psclient.BadArgumentError, "unknown file format",
         {"source": tmp_path / "rows.npy", "format": "csv"}),
    ]
    for err, match, kw in cases:
        with pytest.raises(err, match=match):
            ps.load(progress=False, **kw)
    assert ps.size() == 0
    # a raw file of any name with format="raw", and conversion on request
    assert ps.load(tmp_path / "rows.dat", format="raw", progress=False) == 1
    assert ps.load(torch.ones(2, DIM).double(), convert=True, progress=False) == 2
    assert torch.equal(ps.lookup(torch.arange(2))[0], torch.ones(2, DIM))
