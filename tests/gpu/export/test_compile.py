"""A model holding the layers compiles with ``torch.compile(fullgraph=True)`` (the lookups
are custom ops, gpu.ops) and gives the eager outputs; on CUDA a GPULayer also runs under
``mode="reduce-overhead"`` (CUDA graphs)."""

from __future__ import annotations

import pytest
import torch

from gpu import LayerType, NVEmbedding, NVEmbeddingBag
from hostcache import SharedMemBlock

CUDA = torch.cuda.is_available()
ROWS, DIM = 500, 16


class Model(torch.nn.Module):
    def __init__(self, plain: NVEmbedding, bag: NVEmbeddingBag) -> None:
        super().__init__()
        self.plain, self.bag = plain, bag

    def forward(self, keys: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.plain(keys).sum(1) * 0.5 + self.bag(keys))


def _model(kind: str, device: str, w: torch.Tensor, mb: SharedMemBlock | None) -> Model:
    if kind == "gpu":
        kw = dict(weight_init=w, device=device)
        lt = LayerType.GPULayer
    else:
        kw = dict(storage=mb, gpu_cache_size=64 * (DIM * 4 + 12), device=device)
        lt = LayerType.LinearUVM
    return Model(NVEmbedding(ROWS, DIM, torch.float32, lt, **kw),
                 NVEmbeddingBag(ROWS, DIM, torch.float32, lt, mode="sum", **kw))


@pytest.fixture
def block(table_name: str):
    """A SharedMemBlock holding seeded rows (also the GPULayer's ``weight_init``)."""
    torch._dynamo.reset()
    mb = SharedMemBlock.create(table_name, num_rows=ROWS, dim=DIM)
    mb.write(torch.arange(ROWS), torch.randn(ROWS, DIM, generator=torch.Generator()
                                             .manual_seed(3)))
    yield mb
    mb.close()
    SharedMemBlock.unlink(table_name)


def _keys(seed: int, device: str) -> torch.Tensor:
    return torch.randint(0, ROWS, (8, 5), generator=torch.Generator().manual_seed(seed)
                         ).to(device)


@pytest.mark.parametrize("kind", ["gpu", "linear"])
def test_fullgraph_compile_equals_eager_cpu(kind: str, block: SharedMemBlock) -> None:
    model = _model(kind, "cpu", block.tensor.clone(), block)
    # aot_eager: the whole tracing stack (dynamo, the ops' fake kernels, AOT autograd)
    # without a C++ toolchain for inductor's CPU code
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for seed in range(3):
        keys = _keys(seed, "cpu")
        torch.testing.assert_close(compiled(keys), model(keys))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("kind", ["gpu", "linear"])
def test_inductor_compile_equals_eager_cuda(kind: str, mode: str,
                                            block: SharedMemBlock) -> None:
    model = _model(kind, "cuda", block.tensor.clone(), block)
    compiled = torch.compile(model, fullgraph=True, mode=mode)
    for seed in range(4):  # replays, for reduce-overhead
        keys = _keys(seed, "cuda")
        got = compiled(keys).clone()
        torch.testing.assert_close(got, model(keys))
    model.plain.close()
    model.bag.close()


def test_a_handle_of_a_collected_layer_raises_a_typed_error() -> None:
    from gpu import BadArgumentError, ops

    layer = NVEmbedding(ROWS, DIM, torch.float32, LayerType.GPULayer, device="cpu")
    handle = layer._op
    assert torch.equal(ops.rows(torch.tensor([1, 2]), handle), layer(torch.tensor([1, 2])))
    del layer
    for call in (lambda: ops.rows(torch.tensor([1]), handle),
                 lambda: ops.pooled(torch.tensor([1]), torch.tensor([0, 1]), None, handle,
                                    "sum")):
        with pytest.raises(BadArgumentError, match=f"no layer with handle {handle}"):
            call()
