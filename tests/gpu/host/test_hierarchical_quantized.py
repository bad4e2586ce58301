"""A Hierarchical layer over a quantized parameter server (int8, float8_e4m3fn), a plain
host cache and GPU cache in front: lookups (plain and pooled) return the server's
dequantized rows in the layer's dtype, through every tier; updates and accumulates reach
the server quantized and every tier reads them back (an accumulate rounded
stochastically); an export reopens it; training over it with a stateful fused optimizer is
refused (the stateless ones train: tests/gpu/train/test_quantized.py). file:// and Redis;
the CPU and CUDA."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import psclient
from gpu import BadArgumentError, LayerType, NVEmbedding, NVEmbeddingBag, optim
from gpu.tier_config import TierConfig
from hostcache import HostCache
from nvecache.common import quant
from nvecache.common.rows import QUANTIZED, RowFormat
from tests.conftest import fresh_name
from tests.gpu.layer_tables import DEVICES

ROWS, DIM = 300, 13
STORES = ["file", pytest.param("redis", marks=pytest.mark.redis)]
FORMATS = [getattr(torch, name) for name in QUANTIZED]
TUNING = TierConfig(admit_batches=1)


def initial() -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return torch.randn(ROWS, DIM, generator=g) * 3


def dequantized(rows: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    f = RowFormat(fmt, DIM)
    return quant.decode(quant.encode(rows, f), f)


@contextlib.contextmanager
def server(store: str, fmt: torch.dtype, tmp_path: Path, request: pytest.FixtureRequest
           ) -> Iterator[Any]:
    name = fresh_name()
    url = (f"file://{tmp_path}/{name}" if store == "file"
           else request.getfixturevalue("redis_url"))
    ps = psclient.connect(url, table=name, dim=DIM, dtype=fmt)
    try:
        ps.insert(torch.arange(ROWS), initial())
        yield ps
    finally:
        ps.drop()
        ps.close()


@contextlib.contextmanager
def host_cache(dtype: torch.dtype) -> Iterator[HostCache]:
    name = fresh_name()
    hc = HostCache.create(name, capacity=128, dim=DIM, dtype=dtype, ways=8)
    try:
        yield hc
    finally:
        hc.close()
        HostCache.unlink(name)


def layer_on(ps: Any, hc: Any, device: str, dtype: torch.dtype, cls: type = NVEmbedding,
             **kw: Any) -> Any:
    return cls(ROWS, DIM, dtype, LayerType.Hierarchical, host_cache=hc, storage=ps,
               device=device, gpu_cache_size=64 * (DIM * 4 + 12), tuning=TUNING, **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_lookups_return_the_dequantized_rows_in_the_layers_dtype(
        dtype: torch.dtype, fmt: torch.dtype, store: str, device: str, tmp_path: Path,
        request: pytest.FixtureRequest) -> None:
    want = dequantized(initial(), fmt).to(dtype)
    keys = torch.tensor([0, 7, 7, 299, 150, 3])
    with server(store, fmt, tmp_path, request) as ps, host_cache(dtype) as hc, \
            layer_on(ps, hc, device, dtype) as layer:
        for _ in range(3):  # NOTE: from the server, then the host cache, then the GPU cache
            got = layer(keys.to(device))
            layer.flush()
            assert torch.equal(got.cpu(), want[keys])
        assert bool(layer.in_gpu_cache(keys.to(device)).all())
        with layer_on(ps, None, device, dtype, NVEmbeddingBag, mode="sum") as bag:
            offsets = torch.tensor([0, 2, 2, 5])
            pooled = bag(keys.to(device), offsets.to(device))
            ref = torch.nn.functional.embedding_bag(keys, want.float(), offsets, mode="sum")
            torch.testing.assert_close(pooled.cpu().float(), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_writes_reach_the_server_quantized_and_every_tier_reads_them(
        fmt: torch.dtype, store: str, device: str, tmp_path: Path,
        request: pytest.FixtureRequest) -> None:
    keys = torch.tensor([4, 5, 6])
    new = torch.randn(3, DIM, generator=torch.Generator().manual_seed(6))
    deltas = torch.ones(4, DIM) * 0.5
    with server(store, fmt, tmp_path, request) as ps, host_cache(torch.float32) as hc, \
            layer_on(ps, hc, device, torch.float32) as layer:
        layer(keys.to(device))
        layer.flush()
        layer.update(keys.to(device), new.to(device))
        want = dequantized(new, fmt)
        assert torch.equal(ps.lookup(keys)[0], want)
        assert torch.equal(layer(keys.to(device)).cpu(), want)
        found = layer.accumulate(torch.tensor([4, 4, 6, 7]).to(device), deltas.to(device))
        assert bool(found.all())
        sums = torch.stack([want[0] + 1.0, want[2] + 0.5])
        # NOTE: the server's accumulate rounds stochastically: each element one of the two
        # steps around the sum (quant.steps_around), and every tier reads that same row
        f = RowFormat(fmt, DIM)
        after = ps.lookup(torch.tensor([4, 6]))[0]
        below, above = (quant.decode(s, f) for s in quant.steps_around(sums, f))
        assert bool(((after == below) | (after == above)).all())
        bound = quant.error_bound(quant.encode(sums, f), f, stochastic=True)
        assert bool(((after - sums).abs() <= bound).all())
        assert torch.equal(layer(torch.tensor([4, 6]).to(device)).cpu(), after)
        assert torch.equal(hc.lookup(torch.tensor([4, 6]))[0], after)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_an_export_reopens_the_quantized_server(fmt: torch.dtype, tmp_path: Path,
                                                request: pytest.FixtureRequest) -> None:
    from gpu import export

    keys = torch.tensor([1, 2, 3])
    with server("file", fmt, tmp_path, request) as ps:
        model = torch.nn.Sequential(layer_on(ps, None, "cpu", torch.float32))
        want = model(keys)
        export.save(model, (keys,), tmp_path / "exp")
        model[0].close()
        with export.load(tmp_path / "exp") as loaded:
            assert torch.equal(loaded(keys), want)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_training_with_state_is_refused_and_sgd_trains(fmt: torch.dtype, tmp_path: Path,
                                                      request: pytest.FixtureRequest) -> None:
    """A stateful fused optimizer's state would be quantized with the row: refused, naming
    the table and what to do, nothing written; SGD (fused, or torch's on layer.weight)
    trains over the server (its steps through the server's stochastic accumulate)."""
    with server("file", fmt, tmp_path, request) as ps:
        before = ps.lookup(torch.arange(ROWS))[0]
        for opt in (optim.Adagrad(0.1), optim.RowwiseAdagrad(0.1), optim.Adam(0.1)):
            with pytest.raises(BadArgumentError, match="cannot train over the quantized") as e:
                layer_on(ps, None, "cpu", torch.float32, optimize_for_training=True,
                         optimizer=opt)
            assert ps.table in str(e.value) and "gpu.optim.SGD" in str(e.value)
        assert torch.equal(ps.lookup(torch.arange(ROWS))[0], before)
        keys = torch.tensor([3, 4, 3])
        for opt in (None, optim.SGD(0.1)):
            with layer_on(ps, None, "cpu", torch.float32, optimize_for_training=True,
                          optimizer=opt) as layer:
                sgd = torch.optim.SGD(layer.parameters(), lr=0.1) if opt is None else None
                layer(keys).sum().backward()  # a gradient of ones: each row steps by -0.1 x n
                if sgd is not None:
                    sgd.step()
        got = ps.lookup(torch.tensor([3, 4]))[0]
        exact = before[[3, 4]] - torch.tensor([[0.4], [0.2]])
        f = RowFormat(fmt, DIM)
        # NOTE: two steps, each rounded within one quantization step of its row, whose range
        # moves with the step: its bound lies between those of the first and last rows
        first, last = (quant.error_bound(quant.encode(r, f), f, stochastic=True)
                       for r in (before[[3, 4]], exact))
        bound = 2 * torch.maximum(first, last) * 1.01 + 1e-5
        assert bool(((got - exact).abs() <= bound).all())
        assert not torch.equal(got, before[[3, 4]])
