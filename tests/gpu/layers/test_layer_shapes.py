"""Every layer type over every storage kind, against torch, over the shapes reference suites use.

Differential: each example builds 1-5 tables in one process (each its own layer type,
storage kind, dim 1-256, dtype fp32/fp16/bf16, plain or pooled) and checks interleaved
lookups against ``F.embedding`` / ``F.embedding_bag`` over the same rows: exact for plain
lookups and ``max`` pooling, to the dtype's rounding for ``sum`` / ``mean``. Bags hold 0-20
keys, batches up to 128 bags. Rows of odd byte length matter: a ``SharedMemBlock`` pads rows
to 16 bytes, a ``HostCache`` too, a ``DistMemBlock`` does not.
"""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import psclient
from gpu import DistMemBlock, LayerType, NVEmbedding, NVEmbeddingBag
from hostcache import HostCache, SharedMemBlock
from tests.conftest import fresh_name

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")])]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
#: storage kinds per layer type ("tensor" for a LinearUVM is the CPU-only form)
STORAGES: dict[LayerType, list[str]] = {
    LayerType.GPULayer: ["weight_init", "tensor", "memblock", "memblock+init", "distmem"],
    LayerType.LinearUVM: ["memblock", "memblock+init", "distmem", "tensor"],
    LayerType.Hierarchical: ["hostcache+ps", "hostcache", "ps"],
}
#: (rtol, atol) of pooled sums/means: the kernels sum in fp32 in another order than torch
TOL = {torch.float32: (1e-5, 1e-4), torch.float16: (2e-3, 4e-3), torch.bfloat16: (1.6e-2, 3e-2)}


@dataclass
class Spec:
    layer_type: LayerType
    storage: str
    rows: int
    dim: int
    dtype: torch.dtype
    mode: str | None  # None: NVEmbedding; else NVEmbeddingBag's mode


@st.composite
def specs(draw: Any, device: str) -> Spec:
    layer_type = draw(st.sampled_from(list(STORAGES)))
    kinds = [k for k in STORAGES[layer_type] if not (k == "tensor" and device != "cpu"
                                                     and layer_type is LayerType.LinearUVM)]
    return Spec(
        layer_type=layer_type,
        storage=draw(st.sampled_from(kinds)),
        rows=draw(st.integers(1, 300)),
        # odd and small dims most of the time: they are where row padding bites
        dim=draw(st.one_of(st.integers(1, 9), st.integers(1, 256))),
        dtype=draw(st.sampled_from(DTYPES)),
        mode=draw(st.sampled_from([None, "sum", "mean", "max"])),
    )


def build(spec: Spec, weights: torch.Tensor, device: str, stack: contextlib.ExitStack,
          tmp: str) -> torch.nn.Module:
    """The layer of ``spec`` over ``weights``; every shared table it needs is closed and
    unlinked by ``stack``."""
    rows, dim, dtype, kind = spec.rows, spec.dim, spec.dtype, spec.storage
    kw: dict[str, Any] = {}
    if kind == "weight_init":
        kw["weight_init"] = weights
    elif kind == "tensor":
        kw["storage"] = weights.to(device) if spec.layer_type is LayerType.GPULayer else weights
    elif kind.startswith("memblock"):
        mb = SharedMemBlock.create(fresh_name(), num_rows=rows, dim=dim, dtype=dtype)
        stack.callback(SharedMemBlock.unlink, mb.name)
        stack.callback(mb.close)
        if kind == "memblock+init":  # the layer writes weight_init into the block
            kw["weight_init"] = weights
        else:
            mb.write(torch.arange(rows), weights)
        kw["storage"] = mb
    elif kind == "distmem":
        block = DistMemBlock(rows, dim, dtype, devices=[device] * (2 if device == "cpu" else 1),
                             name=fresh_name())
        stack.callback(block.close)
        block.write(torch.arange(rows), weights.to(block.view().device))
        kw["storage"] = block
    else:  # Hierarchical
        if "hostcache" in kind:
            # alone, it must hold every row: 16 slots a row leave no bucket overflowing
            capacity = rows * 16 if kind == "hostcache" else max(8, rows // 2)
            hc = HostCache.create(fresh_name(), capacity=capacity, dim=dim, dtype=dtype)
            stack.callback(HostCache.unlink, hc.name)
            stack.callback(hc.close)
            kw["host_cache"] = hc
            if kind == "hostcache":  # the only tier: it must hold every row
                hc.insert(torch.arange(rows), weights)
                assert bool(hc.lookup(torch.arange(rows))[1].all())
        if kind.endswith("ps"):
            name = fresh_name()
            ps = psclient.connect(f"file://{tmp}/{name}", table=name, dim=dim, dtype=dtype)
            stack.callback(ps.close)
            ps.load(weights, progress=False)
            kw["storage"] = ps
    if spec.layer_type is not LayerType.GPULayer:
        # a cache of about a third of the rows: hits, misses and evictions in every example
        kw["gpu_cache_size"] = max(1, rows // 3) * (12 + dim * weights.element_size())
    cls: Any = NVEmbedding if spec.mode is None else NVEmbeddingBag
    if spec.mode is not None:
        kw["mode"] = spec.mode
    layer = cls(rows, dim, dtype, spec.layer_type, device=device, **kw)
    stack.callback(layer.close)
    return layer


def check_plain(layer: Any, weights: torch.Tensor, keys: torch.Tensor, device: str) -> None:
    out = layer(keys.to(device))
    assert out.dtype == weights.dtype and out.device.type == device
    assert out.shape == (*keys.shape, weights.shape[1])
    assert torch.equal(out.cpu(), F.embedding(keys, weights))


def check_bags(layer: Any, spec: Spec, weights: torch.Tensor, lengths: list[int],
               keys: torch.Tensor, weighted: bool, device: str, gen: torch.Generator) -> None:
    offsets = torch.tensor([0, *lengths]).cumsum(0)[:-1]
    psw = (torch.rand(keys.numel(), generator=gen).to(spec.dtype)
           if weighted and spec.mode == "sum" else None)
    out = layer(keys.to(device), offsets.to(device), None if psw is None else psw.to(device))
    assert out.dtype == spec.dtype and out.shape == (len(lengths), spec.dim)
    if spec.mode == "max":  # a copy of one row per element: exact
        assert torch.equal(out.cpu(), F.embedding_bag(keys, weights, offsets, mode="max"))
        return
    ref = F.embedding_bag(keys, weights.float(), offsets, mode=spec.mode,
                          per_sample_weights=None if psw is None else psw.float())
    rtol, atol = TOL[spec.dtype]
    torch.testing.assert_close(out.cpu().float(), ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=60 if CUDA else 100, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_layers_over_every_storage_and_shape_equal_torch(device: str, data: Any) -> None:
    tables = data.draw(st.lists(specs(device), min_size=1, max_size=5), label="tables")
    # NOTE: every random tensor from a drawn seed, so hypothesis replays a failure exactly
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        layers = []
        for spec in tables:
            weights = torch.randn(spec.rows, spec.dim, generator=gen).to(spec.dtype)
            layers.append((spec, weights, build(spec, weights, device, stack, tmp)))
        for _ in range(3):  # interleaved rounds: misses, admissions, then hits
            for spec, weights, layer in layers:
                if spec.mode is None:
                    # NOTE: 0-d to 3-d keys, contiguous or not (transposed)
                    shape = data.draw(st.one_of(
                        st.lists(st.integers(0, 40), min_size=1, max_size=2),
                        st.lists(st.integers(0, 6), min_size=0, max_size=3)))
                    keys = torch.randint(0, spec.rows, tuple(shape), generator=gen)
                    if keys.dim() >= 2 and data.draw(st.booleans()):
                        keys = keys.transpose(0, 1)
                    check_plain(layer, weights, keys, device)
                else:
                    lengths = data.draw(st.lists(st.integers(0, 20), min_size=1, max_size=128))
                    keys = torch.randint(0, spec.rows, (sum(lengths),), generator=gen)
                    check_bags(layer, spec, weights, lengths, keys, data.draw(st.booleans()),
                               device, gen)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim,dtype", [(1, torch.float32), (2, torch.float32),
                                       (3, torch.float16), (7, torch.bfloat16),
                                       (5, torch.float32), (9, torch.float16)])
@pytest.mark.parametrize("layer_type", [LayerType.GPULayer, LayerType.LinearUVM])
def test_a_padded_shared_block_serves_plain_and_pooled_lookups(
        table_name: str, device: str, dim: int, dtype: torch.dtype,
        layer_type: LayerType) -> None:
    """The issue's reproduction: rows of a SharedMemBlock padded to 16 bytes (fp32 dims 1-3,
    5-7, fp16/bf16 dims not a multiple of 8) were refused by LinearUVM on the first lookup."""
    rows = 50
    mb = SharedMemBlock.create(table_name, num_rows=rows, dim=dim, dtype=dtype)
    try:
        assert mb.tensor.stride(0) > dim  # the case at hand: padded rows
        weights = torch.randn(rows, dim).to(dtype)
        mb.write(torch.arange(rows), weights)
        cache = 0 if layer_type is LayerType.GPULayer else 16 * 64
        emb = NVEmbedding(rows, dim, dtype, layer_type, storage=mb, gpu_cache_size=cache,
                          device=device)
        bag = NVEmbeddingBag(rows, dim, dtype, layer_type, storage=mb, gpu_cache_size=cache,
                             device=device)
        keys = torch.tensor([1, 2, 49, 0, 2, 2])
        for _ in range(3):
            assert torch.equal(emb(keys.to(device)).cpu(), weights[keys])
            got = bag(keys.view(2, 3).to(device)).cpu().float()
            torch.testing.assert_close(got, weights[keys].float().view(2, 3, dim).sum(1),
                                       rtol=TOL[dtype][0], atol=TOL[dtype][1])
        emb.close()
        bag.close()
    finally:
        mb.close()
        SharedMemBlock.unlink(table_name)


@pytest.mark.parametrize("device", DEVICES)
def test_hierarchical_pooled_sums_hits_and_misses_before_rounding(device: str) -> None:
    """A bf16 bag whose rows cancel: the cached rows' sum (100.875) and a missed row (-100)
    are added in fp32 and rounded once (0.875, as embedding_bag gives), not rounded to bf16
    first (101.0 - 100 = 1.0)."""
    dtype = torch.bfloat16
    rows = torch.tensor([[100.5], [-100.0], [0.375]]).to(dtype)
    with tempfile.TemporaryDirectory() as tmp:
        ps = psclient.connect(f"file://{tmp}/t", table="t", dim=1, dtype=dtype)
        ps.insert(torch.arange(3), rows)
        bag = NVEmbeddingBag(3, 1, dtype, LayerType.Hierarchical, storage=ps, mode="sum",
                             gpu_cache_size=64 * 14, device=device)
        hot = torch.tensor([[0, 2]], device=device)
        for _ in range(40):  # past an admission round: keys 0 and 2 are cached
            bag(hot)
        hits = bag.stats().gpu.hits
        out = bag(torch.tensor([[0, 1, 2]], device=device))
        assert bag.stats().gpu.hits == hits + 2  # two hits, one miss in that bag
        want = F.embedding_bag(torch.tensor([[0, 1, 2]]), rows.float(), mode="sum").to(dtype)
        assert float(want) == 0.875
        assert torch.equal(out.cpu(), want)
        bag.close()
        ps.close()
