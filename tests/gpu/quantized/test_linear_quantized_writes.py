"""Writes through the linear layer types over quantized tables, and their life: update and
insert store ``quant.encode(rows)`` (every process's cache drops the rows); accumulate adds
in float32 and, on a GPULayer's own table, rounds stochastically (repeated deltas under half
a step add up); NaN / infinite rows and sums are refused with nothing written; the typed
errors of a quantized block of another geometry and of ``weight_dtype`` misused;
``state_dict`` / ``load_state_dict`` / DCP round-trip the stored bytes bit for bit and
quantize float rows; ``gpu.export`` reopens a quantized own table and block. The CPU, and
CUDA where there is a GPU."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gpu import LayerType, NVEmbedding, NVEmbeddingBag, export, optim
from gpu.errors import BadArgumentError, NonFiniteValuesError, StateDictError
from nvecache.common import quant
from nvecache.common.rows import RowFormat
from tests.gpu.layer_tables import DEVICES
from tests.gpu.quantized_tables import (
    FORMATS,
    KINDS,
    cache_bytes,
    quantized_block,
    quantized_layer,
    reference,
    rows_of,
)

ROWS, DIM = 48, 13


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_update_and_insert_store_the_encoded_rows(dtype: torch.dtype, fmt: torch.dtype,
                                                  kind: str, device: str) -> None:
    values = rows_of(ROWS, DIM, dtype)
    keys = torch.tensor([4, 9, 4, 30])  # NOTE: a duplicate: the last occurrence is written
    new = rows_of(4, DIM, dtype, seed=9)
    with quantized_layer(kind, values, fmt, dtype, device, NVEmbedding) as (layer, mb):
        layer(torch.arange(ROWS, device=device))  # NOTE: a LinearUVM cache holds old rows
        layer.flush()
        assert bool(layer.update(keys.to(device), new.to(dtype).to(device)).all())
        want = reference(values, fmt, dtype)
        want[torch.tensor([9, 4, 30])] = reference(new[1:], fmt, dtype)
        assert torch.equal(layer(torch.arange(ROWS, device=device)).cpu(), want)
        if mb is not None:  # the block holds the encoded rows
            assert torch.equal(mb.read(torch.tensor([9])), reference(new[1:2], fmt,
                                                                      torch.float32))
        layer.insert(torch.tensor([0], device=device), new[:1].to(dtype).to(device))
        assert torch.equal(layer(torch.tensor([0], device=device)).cpu(),
                           reference(new[:1], fmt, dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_accumulate_adds_in_float32(dtype: torch.dtype, fmt: torch.dtype, kind: str,
                                    device: str) -> None:
    values = rows_of(ROWS, DIM, dtype)
    deltas = (torch.ones(3, DIM) * 0.75).to(dtype)
    with quantized_layer(kind, values, fmt, dtype, device, NVEmbedding) as (layer, _):
        before = layer(torch.tensor([2, 7], device=device)).cpu().float()
        found = layer.accumulate(torch.tensor([2, 2, 7], device=device), deltas.to(device))
        assert bool(found.all())
        got = layer(torch.tensor([2, 7], device=device)).cpu().float()
        sums = before + torch.tensor([[1.5], [0.75]])
        f = RowFormat(fmt, DIM)
        # NOTE: within one step of the sum (stochastic rounding: one, not half of one), and
        # the output dtype's rounding
        bound = 2 * quant.error_bound(quant.encode(sums, f), f) + sums.abs() * 2.0 ** -8
        assert bool(((got - sums).abs() <= bound).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_repeated_small_deltas_add_up_on_a_quantized_own_table(fmt: torch.dtype,
                                                               device: str) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    values = torch.rand(8, 128, generator=g) + 1.0  # NOTE: a step of ~0.004 (int8) .. 0.07
    keys = torch.arange(8, device=device)
    delta = torch.full((8, 128), 1e-3, device=device)  # NOTE: well under half a step
    with NVEmbedding(8, 128, torch.float32, LayerType.GPULayer, weight_init=values,
                     weight_dtype=fmt, device=device) as layer:
        start = layer(keys).mean().item()
        for _ in range(200):
            layer.accumulate(keys, delta)
        grown = layer(keys).mean().item() - start
        # NOTE: unbiased: the mean of 1024 elements grew by 200 deltas (nearest rounding
        # would have kept every row as it was)
        assert abs(grown - 0.2) < 0.04, grown
        # a training step's add goes through the same accumulate
        skipped = torch.zeros((), dtype=torch.int64, device=device)
        grad = torch.ones(2, 128, device=device)
        grad[1, 0] = float("nan")
        before = layer(keys[:2]).cpu()
        layer._tiers.step_add(keys[:2], grad, -0.5, skipped)
        assert int(skipped) == 1
        moved = (layer(keys[:2]).cpu() - before).mean(dim=1)
        assert abs(float(moved[0]) + 0.5) < 0.05 and abs(float(moved[1])) < 0.05


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_rows_that_are_not_finite_are_refused_and_nothing_is_written(
        fmt: torch.dtype, kind: str, device: str) -> None:
    values = rows_of(ROWS, DIM, torch.float32)
    bad = torch.ones(2, DIM)
    bad[1, 3] = float("nan")
    with quantized_layer(kind, values, fmt, torch.float32, device, NVEmbedding) as (layer, _):
        keys = torch.tensor([1, 2], device=device)
        before = layer(torch.arange(ROWS, device=device)).cpu()
        for write in (layer.update, layer.insert, layer.accumulate):
            with pytest.raises(NonFiniteValuesError, match="key 2"):
                write(keys, bad.to(device), allow_nonfinite=True)  # NOTE: never stored
        huge = torch.full((2, DIM), 3e38, device=device)  # NOTE: their sum overflows
        with pytest.raises(NonFiniteValuesError):
            layer.accumulate(torch.tensor([5, 5], device=device), huge)
        assert torch.equal(layer(torch.arange(ROWS, device=device)).cpu(), before)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_a_quantized_block_of_another_geometry_is_refused(fmt: torch.dtype) -> None:
    with quantized_block(ROWS, DIM, fmt) as mb:
        for lt in (LayerType.GPULayer, LayerType.HostLayer, LayerType.LinearUVM):
            extra = {"gpu_cache_size": cache_bytes(DIM, torch.float32)} \
                if lt is LayerType.LinearUVM else {}
            with pytest.raises(BadArgumentError, match=r"quantized.*dim=13"):
                NVEmbedding(ROWS, DIM + 1, torch.float32, lt, storage=mb, device="cpu",
                            **extra)
            with pytest.raises(BadArgumentError, match=f"rows={ROWS}"):
                NVEmbedding(ROWS + 1, DIM, torch.float16, lt, storage=mb, device="cpu",
                            **extra)


def test_weight_dtype_misuse_is_refused() -> None:
    w = rows_of(ROWS, DIM, torch.float32)
    gpu = LayerType.GPULayer
    with quantized_block(ROWS, DIM, torch.int8) as mb:
        with pytest.raises(BadArgumentError, match="storage's format is used"):
            NVEmbedding(ROWS, DIM, torch.float32, gpu, storage=mb, weight_dtype=torch.int8,
                        device="cpu")
        for lt, extra in ((LayerType.HostLayer, {}),
                          (LayerType.LinearUVM, {"gpu_cache_size": 1 << 14})):
            with pytest.raises(BadArgumentError, match=f"a {lt.name} layer reads"):
                NVEmbedding(ROWS, DIM, torch.float32, lt, storage=mb,
                            weight_dtype=torch.int8, device="cpu", **extra)
    with pytest.raises(BadArgumentError, match="quantized parameter server"):
        NVEmbedding(ROWS, DIM, torch.float32, LayerType.Hierarchical, storage="file:///x",
                    table="t", weight_dtype=torch.float8_e4m3fn, device="cpu")
    with pytest.raises(BadArgumentError, match="data_type=torch.float16"):
        NVEmbedding(ROWS, DIM, torch.float32, gpu, weight_dtype=torch.float16, device="cpu")
    for bad in ("int8", torch.int32, 8):
        with pytest.raises(BadArgumentError, match="weight_dtype must be"):
            NVEmbedding(ROWS, DIM, torch.float32, gpu, weight_dtype=bad, device="cpu")
    # NOTE: a stateless optimizer trains an own quantized table (tests/gpu/train); one
    # keeping state beside each row is refused
    with pytest.raises(BadArgumentError, match=r"own table of the layer \(weight_dtype=int8"):
        NVEmbedding(ROWS, DIM, torch.float32, gpu, weight_dtype=torch.int8, device="cpu",
                    optimize_for_training=True, optimizer=optim.Adagrad(0.1))
    with pytest.raises(BadArgumentError, match="weight_init must have"):
        NVEmbedding(ROWS, DIM, torch.float32, gpu, weight_dtype=torch.int8, device="cpu",
                    weight_init=torch.zeros(3, RowFormat(torch.int8, DIM).stored_bytes,
                                            dtype=torch.uint8))
    # NOTE: data_type itself stores the table as it is
    with NVEmbedding(ROWS, DIM, torch.float16, gpu, weight_init=w.half(),
                     weight_dtype=torch.float16, device="cpu") as plain:
        assert plain.spec.weight_dtype is None
        assert torch.equal(plain(torch.arange(3)), w[:3].half())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_state_dict_round_trips_the_stored_bytes(fmt: torch.dtype, kind: str,
                                                 device: str) -> None:
    values = rows_of(ROWS, DIM, torch.float32)
    other = rows_of(ROWS, DIM, torch.float32, seed=2)
    f = RowFormat(fmt, DIM)
    with quantized_layer(kind, values, fmt, torch.float32, device, NVEmbedding) as (a, _), \
            quantized_layer(kind, other, fmt, torch.float32, device, NVEmbedding) as (b, _):
        sd = a.state_dict()
        assert sd["weight"].dtype == torch.uint8
        assert tuple(sd["weight"].shape) == (ROWS, f.stored_bytes)
        saved = sd["weight"].cpu().clone()
        b.load_state_dict(sd)
        assert torch.equal(b.state_dict()["weight"].cpu(), saved)  # bit for bit
        assert torch.equal(b(torch.arange(ROWS, device=device)).cpu(),
                           quant.decode(saved, f))
        # float rows (an nn.Embedding's) are quantized as they load
        b.load_state_dict({"weight": other})
        assert torch.equal(b(torch.arange(ROWS, device=device)).cpu(),
                           reference(other, fmt, torch.float32))
        with tempfile.TemporaryDirectory() as path, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP: "assuming ... a single process"
            dcp.save(a.state_dict(), checkpoint_id=path)
            a.update(torch.arange(ROWS, device=device), torch.zeros(ROWS, DIM, device=device))
            into = a.state_dict()
            dcp.load(into, checkpoint_id=path)  # into the table's bytes, in place
            a.load_state_dict(into)
        assert torch.equal(a.state_dict()["weight"].cpu(), saved)
        assert torch.equal(a(torch.arange(ROWS, device=device)).cpu(), quant.decode(saved, f))


def test_checkpoints_of_another_format_are_refused_with_nothing_written() -> None:
    values = rows_of(ROWS, DIM, torch.float32)
    with quantized_layer("own", values, torch.int8, torch.float32, "cpu",
                         NVEmbedding) as (q, _), \
            NVEmbedding(ROWS, DIM, torch.float32, LayerType.GPULayer, device="cpu",
                        weight_init=values) as plain:
        before = q.state_dict()["weight"].clone()
        with pytest.raises(StateDictError, match="quantized table's stored bytes"):
            plain.load_state_dict(q.state_dict())
        with pytest.raises(StateDictError, match=r"stored int8: load its stored bytes"):
            q.load_state_dict({"weight": before[:, :-1]})
        nan = values.clone()
        nan[3, 1] = float("inf")
        with pytest.raises(StateDictError, match="NaN or an infinity"):
            q.load_state_dict({"weight": nan})
        broken = before.clone()
        scale = RowFormat(torch.int8, DIM).meta_offset
        broken[5, scale:scale + 4] = torch.tensor([float("nan")]).view(torch.uint8)
        with pytest.raises(StateDictError, match="NaN or an infinity"):
            q.load_state_dict({"weight": broken})
        assert torch.equal(q.state_dict()["weight"], before)
        assert torch.equal(plain(torch.arange(ROWS)), values)


class _Model(torch.nn.Module):
    def __init__(self, own: NVEmbedding, shared: NVEmbeddingBag) -> None:
        super().__init__()
        self.own, self.shared = own, shared

    def forward(self, keys: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.own(keys).float().sum(dim=0) + self.shared(keys, offsets).float().sum(0)


@pytest.mark.parametrize("device", DEVICES)
def test_an_export_reopens_a_quantized_own_table_and_block(device: str, tmp_path: Path
                                                          ) -> None:
    values = rows_of(ROWS, DIM, torch.bfloat16)
    keys = torch.tensor([1, 5, 47, 5], device=device)
    offsets = torch.tensor([0, 2], device=device)
    with quantized_layer("own", values, torch.float8_e4m3fn, torch.bfloat16, device,
                         NVEmbedding) as (own, _), \
            quantized_layer("linearuvm", values, torch.int8, torch.float16, device,
                            NVEmbeddingBag, mode="mean") as (shared, _):
        model = _Model(own, shared)
        want = model(keys, offsets)
        export.save(model, (keys, offsets), tmp_path / "m")
        meta = (tmp_path / "m" / "metadata.json").read_text()
        assert '"version": 2' in meta and '"weight_dtype": "float8_e4m3fn"' in meta
        with export.load(tmp_path / "m") as loaded:
            assert torch.equal(loaded(keys, offsets), want)
            again = loaded.layers["own"]
            assert again.spec.weight_dtype == torch.float8_e4m3fn
            assert torch.equal(again.state_dict()["weight"].cpu(),
                               own.state_dict()["weight"].cpu())
