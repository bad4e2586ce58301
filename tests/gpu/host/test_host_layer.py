"""A user's own CPU tensor as a table: ``LayerType.HostLayer`` (host memory read without a
GPU cache) and a LinearUVM layer over it; on CUDA the tensor is registered in place (no
copy, private to the process) and released on close. Every case runs on the CPU, and on
CUDA where there is a GPU."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from gpu import LayerType, NVEmbedding, NVEmbeddingBag
from gpu.errors import BadArgumentError
from gpu.layer_config import TableRef
from hostcache import SharedMemBlock
from tests.conftest import fresh_name
from tests.gpu.layer_tables import DEVICES

ROWS, DIM = 64, 8
#: the layer types that read a user's CPU tensor, and the arguments each takes beside it
USER_TABLES = [(LayerType.HostLayer, {}), (LayerType.LinearUVM, {"gpu_cache_size": 16 * 64})]
IDS = ["HostLayer", "LinearUVM"]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (torch.cuda.is_available() is False)")


def user_tensor(dtype: torch.dtype = torch.float32, pinned: bool = False) -> torch.Tensor:
    t = torch.randn(ROWS, DIM).to(dtype)
    return t.pin_memory() if pinned else t


@pytest.fixture
def memblock() -> Iterator[SharedMemBlock]:
    name = fresh_name("hostlayer")
    with SharedMemBlock.create(name, num_rows=ROWS, dim=DIM) as mb:
        try:
            yield mb
        finally:
            SharedMemBlock.unlink(name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("layer_type", "kw"), USER_TABLES, ids=IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_a_user_tensor_is_read_in_place_equal_to_torch(device: str, layer_type: LayerType,
                                                       kw: dict[str, Any],
                                                       dtype: torch.dtype) -> None:
    t = user_tensor(dtype)
    want = t.clone()
    keys = torch.tensor([0, 5, 63, 5, 17, 2], device=device)
    offsets = torch.tensor([0, 2, 2, 6], device=device)
    with NVEmbedding(ROWS, DIM, dtype, layer_type, storage=t, device=device, **kw) as emb, \
            NVEmbeddingBag(ROWS, DIM, dtype, layer_type, storage=t, device=device,
                           mode="sum", include_last_offset=True, **kw) as bag:
        for _ in range(2):  # the second time a LinearUVM cache may answer
            torch.testing.assert_close(emb(keys).cpu(), F.embedding(keys.cpu(), want))
            torch.testing.assert_close(
                bag(keys, offsets).cpu(),
                F.embedding_bag(keys.cpu(), want.float(), offsets.cpu(), mode="sum",
                                include_last_offset=True).to(dtype),
                atol=1e-2, rtol=1e-2)
            emb.flush()
        # NOTE: no copy: the checkpoint's weight is the user's tensor itself
        weight = emb.state_dict()["weight"]
        assert weight is t and weight.data_ptr() == t.data_ptr()
        assert emb.spec.tables == (TableRef("own"),)
    assert torch.equal(t, want)  # reading wrote nothing


@pytest.mark.parametrize(("layer_type", "kw"), USER_TABLES, ids=IDS)
@pytest.mark.parametrize("pinned", [False, pytest.param(True, marks=needs_cuda)],
                         ids=["pageable", "pinned"])
@pytest.mark.parametrize("device", DEVICES)
def test_writes_go_to_the_user_tensor_in_place(device: str, pinned: bool,
                                               layer_type: LayerType,
                                               kw: dict[str, Any]) -> None:
    t = user_tensor(pinned=pinned)
    ptr, want = t.data_ptr(), t.clone()
    keys = torch.tensor([3, 9, 40], device=device)
    with NVEmbedding(ROWS, DIM, torch.float32, layer_type, storage=t, device=device,
                     **kw) as layer:
        layer(keys)
        layer.flush()
        layer(keys)  # NOTE: a LinearUVM layer's cache holds the rows now
        layer.update(keys[:1], torch.full((1, DIM), 1.0, device=device))
        layer.insert(keys[1:2], torch.full((1, DIM), 2.0, device=device), tier="storage")
        layer.accumulate(keys[2:], torch.full((1, DIM), 0.5, device=device))
        want[3], want[9], want[40] = 1.0, 2.0, want[40] + 0.5
        assert t.data_ptr() == ptr and torch.equal(t, want)  # the user's tensor, in place
        torch.testing.assert_close(layer(keys).cpu(), want[keys.cpu()])
        # a checkpoint of other rows loads into the same tensor
        other = torch.randn(ROWS, DIM)
        layer.load_state_dict({"weight": other})
        assert t.data_ptr() == ptr and torch.equal(t, other)
        torch.testing.assert_close(layer(keys).cpu(), other[keys.cpu()])


@pytest.mark.parametrize("device", DEVICES)
def test_host_layer_tier_is_storage_and_it_has_no_gpu_cache(device: str) -> None:
    t = user_tensor()
    with NVEmbedding(ROWS, DIM, torch.float32, LayerType.HostLayer, storage=t,
                     device=device) as layer:
        assert layer.tiers == ("storage",)
        keys = torch.tensor([1, 2, 3], device=device)
        layer(keys)
        stats = layer.stats()
        assert stats.layer_type == "HostLayer" and stats.storage is not None
        assert stats.storage.hits == 3 and stats.gpu.hits == 0
        assert not bool(layer.in_gpu_cache(keys).any())
        with pytest.raises(BadArgumentError, match="'storage'"):
            layer.insert(keys, torch.zeros(3, DIM, device=device), tier="gpu")
        with pytest.raises(BadArgumentError, match="cannot erase from a HostLayer"):
            layer.erase(keys, tier="storage")
        assert torch.equal(layer(keys).cpu(), t[keys.cpu()])  # nothing was written


@pytest.mark.parametrize("device", DEVICES)
def test_host_layer_over_a_memblock_and_over_its_own_rows(device: str,
                                                          memblock: SharedMemBlock) -> None:
    w = user_tensor()
    keys = torch.tensor([0, 31, 63], device=device)
    with NVEmbedding(ROWS, DIM, torch.float32, LayerType.HostLayer, storage=memblock,
                     weight_init=w, device=device) as shared, \
            NVEmbedding(ROWS, DIM, torch.float32, LayerType.HostLayer, weight_init=w,
                        device=device) as own:
        assert shared.spec.tables == (TableRef("memblock", memblock.name),)
        assert torch.equal(memblock.tensor[:ROWS], w)  # weight_init written into the block
        for layer in (shared, own):
            assert torch.equal(layer(keys).cpu(), w[keys.cpu()])
        own_rows = own.state_dict()["weight"]
        assert own_rows.device.type == "cpu" and torch.equal(own_rows, w)
        assert own_rows.data_ptr() != w.data_ptr()  # weight_init is copied, not kept


@pytest.mark.parametrize("device", DEVICES)
def test_bad_user_tensors_raise_saying_what_to_pass(device: str) -> None:
    def build(layer_type: LayerType, storage: Any, **kw: Any) -> None:
        NVEmbedding(ROWS, DIM, torch.float32, layer_type, storage=storage, device=device,
                    **kw).close()

    for layer_type, kw in USER_TABLES:
        with pytest.raises(BadArgumentError, match=r"dtype=torch.float16.*dtype=torch.float32"):
            build(layer_type, user_tensor(torch.float16), **kw)
        with pytest.raises(BadArgumentError, match="rows=32"):
            build(layer_type, torch.randn(32, DIM), **kw)
        with pytest.raises(BadArgumentError, match="CPU tensor"):
            build(layer_type, [[0.0] * DIM] * ROWS, **kw)
    with pytest.raises(BadArgumentError, match="gpu_cache_size must be 0 for LayerType.HostLayer"):
        build(LayerType.HostLayer, user_tensor(), gpu_cache_size=1024)
    with pytest.raises(BadArgumentError, match="host_cache is only used"):
        build(LayerType.HostLayer, user_tensor(), host_cache="x")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("layer_type", "kw"), USER_TABLES, ids=IDS)
def test_cuda_refuses_a_strided_or_device_tensor(layer_type: LayerType,
                                                 kw: dict[str, Any]) -> None:
    strided = torch.randn(DIM, ROWS).t()
    with pytest.raises(BadArgumentError, match=r"not contiguous.*storage.contiguous\(\)"):
        NVEmbedding(ROWS, DIM, torch.float32, layer_type, storage=strided, device="cuda",
                    **kw)
    with pytest.raises(BadArgumentError, match="pass a CPU tensor"):
        NVEmbedding(ROWS, DIM, torch.float32, layer_type, storage=user_tensor().cuda(),
                    device="cuda", **kw)


def test_cpu_host_layer_reads_a_strided_tensor_directly() -> None:
    """On the CPU nothing is registered: any [rows, dim] view is read where it is."""
    strided = torch.randn(DIM, ROWS).t()
    keys = torch.tensor([1, 60, 7])
    with NVEmbedding(ROWS, DIM, torch.float32, LayerType.HostLayer, storage=strided,
                     device="cpu") as layer:
        assert torch.equal(layer(keys), strided[keys])
        assert layer.state_dict()["weight"] is strided


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("layer_type", "kw"), USER_TABLES, ids=IDS)
def test_cuda_registers_a_pageable_tensor_until_close(layer_type: LayerType,
                                                      kw: dict[str, Any]) -> None:
    from gpu.cuda.registration import pointer_is_registered

    t = user_tensor()
    assert not pointer_is_registered(t.data_ptr(), "cuda")
    layer = NVEmbedding(ROWS, DIM, torch.float32, layer_type, storage=t, device="cuda", **kw)
    assert pointer_is_registered(t.data_ptr(), "cuda")
    keys = torch.tensor([4, 8], device="cuda")
    assert torch.equal(layer(keys).cpu(), t[keys.cpu()])
    layer.close()
    gc.collect()
    assert not pointer_is_registered(t.data_ptr(), "cuda")
    assert torch.equal(t[4], t[4].clone())  # the tensor is the user's still, readable
