"""gpu.export: a model saved by one process loads in a FRESH process (a subprocess) and
gives the eager outputs, for every layer type and both layer classes, with batch sizes
other than the example's; the load errors are typed and name the table."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu import LayerType, NVEmbedding, NVEmbeddingBag
from gpu import export as gx
from gpu.export import metadata as md
from hostcache import SharedMemBlock
from tests import aot_probe
from tests.conftest import fresh_name
from tests.gpu import layer_tables
from tests.gpu.layer_tables import DEVICES

ROWS, DIM = 64, 8
CUDA = torch.cuda.is_available()
LAYER_TYPES = [LayerType.GPULayer, LayerType.LinearUVM, LayerType.Hierarchical]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def weights() -> torch.Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(7))


@contextlib.contextmanager
def tables(layer_type: LayerType, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Layer arguments over tables the test owns (closed and removed at the end)."""
    with layer_tables.tables(layer_type, tmp_path, weights()) as kw:
        yield kw


class Model(torch.nn.Module):
    """An embedding and a bag over the same table, then a dense layer."""

    def __init__(self, emb: NVEmbedding, bag: NVEmbeddingBag) -> None:
        super().__init__()
        self.emb, self.bag = emb, bag
        self.dense = torch.nn.Linear(DIM, 3)
        torch.nn.init.constant_(self.dense.weight, 0.25)
        torch.nn.init.zeros_(self.dense.bias)

    def forward(self, keys: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.dense(self.bag(keys, offsets)) + self.dense(self.emb(keys)).sum(0)


def _gpu_model(**kw: Any) -> Model:
    """The test model with GPULayer layers on the CPU over the table ``kw`` names."""
    return Model(NVEmbedding(ROWS, DIM, torch.float32, LayerType.GPULayer, device="cpu", **kw),
                 NVEmbeddingBag(ROWS, DIM, torch.float32, LayerType.GPULayer, device="cpu",
                                **kw))


def batches(device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keys and offsets (1-D input) of several batch sizes, the example's first."""
    return [(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 2])),
            (torch.arange(9) * 7 % ROWS, torch.tensor([0, 3, 3, 6])),
            (torch.arange(40) % ROWS, torch.arange(0, 40, 5))]


#: run in a fresh interpreter: load, call on each batch, save the outputs
CHILD = """
import sys, torch
import gpu.export as gx
path, device, out = sys.argv[1], sys.argv[2], sys.argv[3]
batches = torch.load(out + ".in")
with gx.load(path, device=device) as model:
    got = [model(k.to(device), o.to(device)).cpu() for k, o in batches]
torch.save(got, out)
"""


def load_in_fresh_process(path: Path, device: str, batches: list[Any], tmp_path: Path
                          ) -> list[torch.Tensor]:
    out = tmp_path / "outputs.pt"
    torch.save(batches, str(out) + ".in")
    done = subprocess.run([sys.executable, "-c", CHILD, str(path), device, str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)


@pytest.mark.parametrize("layer_type", LAYER_TYPES)
def test_export_loads_in_a_fresh_process_and_equals_eager(tmp_path: Path, device: str,
                                                          layer_type: LayerType) -> None:
    with tables(layer_type, tmp_path) as kw:
        model = Model(NVEmbedding(ROWS, DIM, torch.float32, layer_type, device=device, **kw),
                      NVEmbeddingBag(ROWS, DIM, torch.float32, layer_type, device=device,
                                     mode="sum", **kw)).to(device)
        data = batches(device)
        want = [model(k.to(device), o.to(device)).cpu() for k, o in data]
        k0, o0 = data[0]
        path = gx.save(model, (k0.to(device), o0.to(device)), tmp_path / "exported")
        meta = json.loads((path / "metadata.json").read_text())
        assert [e["layer_type"] for e in meta["layers"]] == [layer_type.name] * 2
        assert (path / "tables.safetensors").exists() == (layer_type is LayerType.GPULayer)
        got = load_in_fresh_process(path, device, data, tmp_path)
        model.emb.close()
        model.bag.close()
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_a_saved_program_without_load_raises_a_typed_error(tmp_path: Path) -> None:
    """The program's ids are the saving process's: torch.export.load alone names no layer."""
    with tables(LayerType.GPULayer, tmp_path) as kw:
        model = _gpu_model(**kw)
        k, o = batches("cpu")[0]
        path = gx.save(model, (k, o), tmp_path / "exported")
    code = ("import torch, gpu\n"
            f"p = torch.export.load({str(path / 'program.pt2')!r}).module()\n"
            "try:\n    p(torch.tensor([1, 2]), torch.tensor([0, 1]))\n"
            "except gpu.BadArgumentError as e:\n    print('typed:', e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert "typed: no layer with handle" in done.stdout, done.stderr[-2000:]


def test_load_errors_are_typed_and_name_the_table(tmp_path: Path) -> None:
    name = fresh_name()
    k, o = batches("cpu")[0]
    with SharedMemBlock.create(name, num_rows=ROWS, dim=DIM) as mb:
        try:
            mb.write(torch.arange(ROWS), weights())
            model = _gpu_model(storage=mb)
            path = gx.save(model, (k, o), tmp_path / "exported")
            with gx.load(path) as loaded:  # the table is there: loads, equals eager
                torch.testing.assert_close(loaded(k, o), model(k, o))
        finally:
            SharedMemBlock.unlink(name)
    # the shared table is gone
    with pytest.raises(gx.MissingTableError, match=f"SharedMemBlock '{name}'") as e:
        gx.load(path)
    assert "\n" not in str(e.value)
    # a table of that name with another geometry
    with SharedMemBlock.create(name, num_rows=ROWS, dim=DIM * 2):
        try:
            with pytest.raises(gx.ShapeMismatchError, match=f"SharedMemBlock '{name}'.*dim=16"):
                gx.load(path)
        finally:
            SharedMemBlock.unlink(name)
    # a newer format version
    meta_file = path / "metadata.json"
    meta = json.loads(meta_file.read_text())
    newer = md.FORMAT_VERSION + 1
    meta["version"] = newer
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(gx.FormatVersionError, match=f"format version {newer}"):
        gx.load(path)


def test_private_table_of_another_shape_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    with tables(LayerType.GPULayer, tmp_path) as kw:
        model = _gpu_model(**kw)
        k, o = batches("cpu")[0]
        path = gx.save(model, (k, o), tmp_path / "exported")
    save_file({"emb": torch.zeros(ROWS + 1, DIM), "bag": torch.zeros(ROWS, DIM)},
              str(path / "tables.safetensors"))
    with pytest.raises(gx.ShapeMismatchError, match="private table 'emb'.*rows=65"):
        gx.load(path)


@pytest.mark.parametrize("layer_type", LAYER_TYPES)
def test_aot_package_loads_in_a_fresh_process_and_equals_eager(tmp_path: Path, device: str,
                                                               layer_type: LayerType,
                                                               aoti_loads: bool) -> None:
    """save(aot=True) writes an AOTInductor package; a fresh process loads it, the package
    calls the rebuilt layers (ids rebound) and equals eager for every batch size."""
    if not aoti_loads:
        pytest.skip(aot_probe.REASON)
    with tables(layer_type, tmp_path) as kw:
        model = Model(NVEmbedding(ROWS, DIM, torch.float32, layer_type, device=device, **kw),
                      NVEmbeddingBag(ROWS, DIM, torch.float32, layer_type, device=device,
                                     mode="sum", **kw)).to(device)
        data = batches(device)
        with torch.no_grad():
            want = [model(k.to(device), o.to(device)).cpu() for k, o in data]
        k0, o0 = data[0]
        path = gx.save(model, (k0.to(device), o0.to(device)), tmp_path / "exported", aot=True)
        meta = json.loads((path / "metadata.json").read_text())
        assert (meta["aot"], meta["package"], meta["program"]) == (True, "package.pt2", None)
        assert (path / "package.pt2").exists() and not (path / "program.pt2").exists()
        got = load_in_fresh_process(path, device, data, tmp_path)
        model.emb.close()
        model.bag.close()
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_aot_package_errors_are_typed(tmp_path: Path, aoti_loads: bool) -> None:
    """An op's error inside the package is raised as itself; an export saved again with
    aot=False replaces the package by the program (and back); a missing package is an
    ExportError."""
    if not aoti_loads:
        pytest.skip(aot_probe.REASON)
    from gpu.errors import LayerClosedError

    with tables(LayerType.GPULayer, tmp_path) as kw:
        model = _gpu_model(**kw)
        k, o = batches("cpu")[0]
        out = tmp_path / "exported"
        gx.save(model, (k, o), out)
        assert (out / "program.pt2").exists()
        gx.save(model, (k, o), out, aot=True)
        assert (out / "package.pt2").exists() and not (out / "program.pt2").exists()
        with gx.load(out) as loaded:
            torch.testing.assert_close(loaded(k, o), model(k, o).detach())
            loaded.layers["emb"].close()
            with pytest.raises(LayerClosedError, match="closed"):
                loaded(k, o)
        meta = json.loads((out / "metadata.json").read_text())
        assert meta["layers"][0]["inline"] == {"index": 0, "stride": [DIM, 1]}
        meta["layers"][0]["inline"]["stride"] = [DIM + 8, 1]  # NOTE: as if another layout
        (out / "metadata.json").write_text(json.dumps(meta))
        with pytest.raises(gx.ShapeMismatchError, match=r"layer 'emb' is laid out with "
                                                        r"strides \[8, 1\].*compiled for "
                                                        r"\[16, 1\]"):
            gx.load(out)
        (out / "package.pt2").unlink()
        with pytest.raises(gx.ExportError, match="package.pt2 is missing"):
            gx.load(out)
        model.emb.close()
        model.bag.close()
