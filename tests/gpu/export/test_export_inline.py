"""gpu.export with aot=True compiles a GPULayer's lookup into the package: a call runs no
custom op (no Python per lookup), its outputs equal eager over every dtype, odd dims,
weighted, mean and empty bags and 2-D input, and an out-of-range key raises the layer's
typed error as eager's device check does. Max bags and the cached layer types stay ops."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu import LayerType, NVEmbedding, NVEmbeddingBag
from gpu import export as gx
from gpu.errors import BadArgumentError
from tests import aot_probe
from tests.gpu.layer_tables import DEVICES

ROWS, DIM = 50, 5
GPU = LayerType.GPULayer


def table(dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(seed)).to(dtype)


class Model(torch.nn.Module):
    """GPULayer embeddings and bags of several dtypes and modes, a max bag and a LinearUVM
    layer (both through the custom ops); every output as fp32."""

    def __init__(self, device: str) -> None:
        super().__init__()

        def emb(dtype: torch.dtype, seed: int) -> NVEmbedding:
            return NVEmbedding(ROWS, DIM, dtype, GPU, device=device,
                               weight_init=table(dtype, seed))

        def bag(dtype: torch.dtype, seed: int, mode: str) -> NVEmbeddingBag:
            return NVEmbeddingBag(ROWS, DIM, dtype, GPU, device=device, mode=mode,
                                  weight_init=table(dtype, seed))

        self.e32, self.e16 = emb(torch.float32, 1), emb(torch.float16, 2)
        self.sum32, self.mean16 = bag(torch.float32, 3, "sum"), bag(torch.bfloat16, 4, "mean")
        self.max32 = bag(torch.float32, 5, "max")
        self.uvm = NVEmbedding(ROWS, DIM, torch.float32, LayerType.LinearUVM, device=device,
                               gpu_cache_size=16, storage=table(torch.float32, 6))

    def forward(self, keys: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor,
                grid: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs = (self.e32(keys), self.e16(grid), self.sum32(keys, offsets, weights),
                self.mean16(keys, offsets), self.mean16(grid), self.max32(keys, offsets),
                self.uvm(keys))
        return tuple(o.float() for o in outs)

    def close(self) -> None:
        for layer in (self.e32, self.e16, self.sum32, self.mean16, self.max32, self.uvm):
            layer.close()


def batch(device: str, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    """``n`` keys in bags of 0..4 keys (empty ones included), weights, a 2-D key grid."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(0, ROWS, (n,), generator=g)
    cuts = torch.sort(torch.randint(0, n + 1, (max(n // 3, 1),), generator=g)).values
    offsets = torch.cat([torch.tensor([0]), cuts])
    offsets[1] = 0  # NOTE: an empty bag first
    weights = torch.rand(n, generator=g)
    grid = torch.randint(0, ROWS, (max(n // 4, 1), 3), generator=g)
    return tuple(t.to(device) for t in (keys, offsets, weights, grid))


@pytest.fixture(scope="module", params=DEVICES)
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
             aoti_loads: bool) -> Iterator[tuple[Model, Any, str, Path]]:
    if not aoti_loads:
        pytest.skip(aot_probe.REASON)
    device = str(request.param)
    model = Model(device)
    path = gx.save(model, batch(device, 12, 0), tmp_path_factory.mktemp("inline") / "x",
                   aot=True)
    try:
        with gx.load(path) as loaded:
            yield model, loaded, device, path
    finally:
        model.close()


def op_calls(fn: Any) -> list[str]:
    """Names of the nvecache custom ops dispatched while ``fn`` runs."""
    with torch.profiler.profile() as prof:
        fn()
    return sorted({e.name for e in prof.events() if "nvecache" in e.name})


def test_gpu_layers_compile_into_the_package_and_equal_eager(
        exported: tuple[Model, Any, str, Path]) -> None:
    model, loaded, device, path = exported
    layers = json.loads((path / "metadata.json").read_text())["layers"]
    assert {e["path"]: "inline" in e for e in layers} == {
        "e32": True, "e16": True, "sum32": True, "mean16": True, "max32": False, "uvm": False}
    for n, seed in ((12, 0), (1, 1), (37, 2), (300, 3)):
        args = batch(device, n, seed)
        with torch.no_grad():
            want = model(*args)
        got = loaded(*args)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)
    args = batch(device, 12, 0)
    called = op_calls(lambda: loaded(*args))
    # NOTE: the max bag and the LinearUVM layer call their ops; no GPULayer lookup does
    assert called and all("table_rows" not in name for name in called), called
    assert any("pooled" in name for name in called) and any("stack_rows" in name
                                                            for name in called), called


def test_an_out_of_range_key_raises_the_layers_typed_error(
        exported: tuple[Model, Any, str, Path]) -> None:
    """A bad key of the 2-D input (read by two GPULayers only): one typed error for the
    call (both layers' reports taken), then the package serves again."""
    _, loaded, device, _ = exported
    keys, offsets, weights, grid = batch(device, 12, 0)
    bad = grid.clone()
    bad[1, 2] = ROWS + 7
    with pytest.raises(BadArgumentError, match=f"key {ROWS + 7}, outside"):
        loaded(keys, offsets, weights, bad)
        if device != "cpu":  # NOTE: CUDA reports it at the layer's next call
            torch.cuda.synchronize()
            loaded(keys, offsets, weights, grid)
    out = loaded(keys, offsets, weights, grid)  # reported once: the next call serves
    assert out[0].shape == (12, DIM)


@pytest.mark.parametrize("device", DEVICES)
def test_the_traced_lookup_compiles_with_inductor_and_equals_torch(device: str) -> None:
    """The lookup a package compiles in, compiled by Inductor (what AOTInductor lowers it
    with) on this device: rows and bags equal torch's for good keys, zeros for a bad one,
    which the flag's new value names; an earlier report is kept."""
    from gpu import traced_lookup

    def lookup(t: torch.Tensor, flag: torch.Tensor, keys: torch.Tensor,
               offsets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        bound = traced_lookup.Bound(t, flag)
        return bound.rows(keys), bound.pooled(keys, offsets, None, "mean"), bound.flag

    t = table(torch.float32, 9).to(device)
    compiled = torch.compile(lookup, fullgraph=True, dynamic=True)
    keys = torch.tensor([3, ROWS - 1, ROWS + 3, 0, 7, 7], device=device)
    offsets = torch.tensor([0, 2, 2, 6], device=device)
    clear = torch.zeros(1, dtype=torch.int64, device=device)
    rows, bags, flag = compiled(t, clear, keys, offsets)
    good = torch.tensor([True, True, False, True, True, True], device=device)
    want = torch.where(good[:, None], t[torch.where(good, keys, 0)], 0)
    torch.testing.assert_close(rows, want)
    sums = torch.stack([want[0:2].sum(0), want[2:2].sum(0), want[2:6].sum(0)])
    torch.testing.assert_close(bags, sums / torch.tensor([2.0, 1.0, 4.0], device=device)[:, None])
    assert flag.tolist() == [ROWS + 3]
    ok = keys.clamp(0, ROWS - 1)
    torch.testing.assert_close(compiled(t, clear, ok, offsets)[0], t[ok])
    assert compiled(t, clear, ok, offsets)[2].tolist() == [0]
    earlier = torch.tensor([-5], device=device)
    assert compiled(t, earlier, keys, offsets)[2].tolist() == [-5]
