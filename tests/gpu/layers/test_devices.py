"""Device arguments (``gpu.cuda.devices.resolve_device``): an int ``i`` is ``cuda:i``, for the
layers as for every other module of the package."""

from __future__ import annotations

import pytest
import torch

from gpu import LayerType, NVEmbedding
from gpu.cuda.devices import resolve_device
from gpu.errors import BadArgumentError, CUDAUnavailableError

CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("index", [0, 1])
def test_an_int_is_a_cuda_device_index(index: int) -> None:
    if CUDA and index < torch.cuda.device_count():
        assert resolve_device(index) == torch.device("cuda", index)
    elif CUDA:
        with pytest.raises(BadArgumentError, match="CUDA device"):
            resolve_device(index)
    else:
        with pytest.raises(CUDAUnavailableError, match=f"cuda:{index}.*not available"):
            resolve_device(index)


@pytest.mark.parametrize("device", [-1, True, 1.0, "tpu"])
def test_what_is_not_a_device_is_refused_with_what_to_pass(device: object) -> None:
    with pytest.raises(BadArgumentError, match="device|index"):
        resolve_device(device)


def test_a_layer_takes_device_0() -> None:
    """``device=0`` builds the layer on cuda:0; without CUDA it says CUDA is missing."""
    weight = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    if not CUDA:
        with pytest.raises(CUDAUnavailableError, match="not available"):
            NVEmbedding(4, 3, torch.float32, LayerType.GPULayer, weight_init=weight, device=0)
        return
    emb = NVEmbedding(4, 3, torch.float32, LayerType.GPULayer, weight_init=weight, device=0)
    try:
        assert emb.device == torch.device("cuda", 0)
        out = emb(torch.tensor([2, 0], device="cuda:0"))
        assert torch.equal(out.cpu(), weight[[2, 0]])
    finally:
        emb.close()
