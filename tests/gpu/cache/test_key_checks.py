"""Default key checks cost no host sync: a bad key in a linear table is caught on the
device (gpu.stacks.key_flag), read as a zero row, and raised by the layer's next call or by
``synchronize()``; ``validate=True`` raises at once. The CPU checks on the host always."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from gpu import BadArgumentError, LayerType, NVEmbedding, NVEmbeddingBag
from gpu.stacks.key_flag import KeyErrorFlag
from hostcache import SharedMemBlock

CUDA = torch.cuda.is_available()
ROWS, DIM = 1000, 24


def test_flag_raises_once_then_clears() -> None:
    flag = KeyErrorFlag(torch.device("cpu"), ROWS)
    flag.raise_pending()  # nothing reported: no error
    flag.device_view.fill_(ROWS + 5)  # what a kernel writes for a bad key
    with pytest.raises(BadArgumentError, match=f"key {ROWS + 5}, outside"):
        flag.raise_pending()
    flag.raise_pending()  # reported once


@pytest.mark.parametrize("validate", [False, True])
def test_cpu_layers_raise_at_once_and_change_nothing(validate: bool) -> None:
    w = torch.randn(ROWS, DIM)
    emb = NVEmbedding(ROWS, DIM, torch.float32, LayerType.GPULayer, weight_init=w,
                      device="cpu", validate=validate)
    with pytest.raises(BadArgumentError, match="outside"):
        emb(torch.tensor([1, ROWS]))
    assert torch.equal(emb(torch.tensor([1, 2])), w[[1, 2]])


def _layers(kind: str, name: str, w: torch.Tensor) -> tuple[NVEmbedding, NVEmbeddingBag, Any]:
    if kind == "gpu":
        return (NVEmbedding(ROWS, DIM, torch.float32, LayerType.GPULayer, weight_init=w,
                            device="cuda"),
                NVEmbeddingBag(ROWS, DIM, torch.float32, LayerType.GPULayer, weight_init=w,
                               device="cuda"), None)
    mb = SharedMemBlock.create(name, num_rows=ROWS, dim=DIM)
    mb.write(torch.arange(ROWS), w)
    kw = dict(storage=mb, gpu_cache_size=64 * (DIM * 4 + 12), device="cuda")
    return (NVEmbedding(ROWS, DIM, torch.float32, LayerType.LinearUVM, **kw),
            NVEmbeddingBag(ROWS, DIM, torch.float32, LayerType.LinearUVM, **kw), mb)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("kind", ["gpu", "linear"])
@pytest.mark.parametrize("bad", [-3, ROWS, 1 << 40])
def test_cuda_bad_key_reads_zero_and_raises_at_the_next_call(kind: str, bad: int,
                                                               table_name: str) -> None:
    w = torch.randn(ROWS, DIM)
    emb, bag, mb = _layers(kind, table_name, w)
    try:
        keys = torch.tensor([3, bad, 7], device="cuda")
        out = emb(keys)  # no sync, no error yet
        want = w[[3, 0, 7]].cuda()
        want[1] = 0
        assert torch.equal(out, want)
        with pytest.raises(BadArgumentError, match=f"key {bad}, outside"):
            emb.synchronize()
        emb.synchronize()  # raised once
        good = torch.tensor([4, 5], device="cuda")
        assert torch.equal(emb(good), w[[4, 5]].cuda())
        emb(keys)
        torch.cuda.synchronize()
        with pytest.raises(BadArgumentError, match="outside"):
            emb(good)  # the next call raises what the previous one met
        # pooled: the bad key adds nothing, and is reported the same way
        pooled = bag(keys.view(1, 3))
        torch.testing.assert_close(pooled, F.embedding_bag(
            torch.tensor([[3, 7]]), w, mode="sum").cuda())
        with pytest.raises(BadArgumentError, match="outside"):
            bag.synchronize()
        # validate=True raises at once, before anything is read
        strict = NVEmbedding(ROWS, DIM, torch.float32, LayerType.GPULayer, weight_init=w,
                             device="cuda", validate=True)
        with pytest.raises(BadArgumentError, match="outside"):
            strict(keys)
    finally:
        for layer in (emb, bag):
            layer.close()
        if mb is not None:
            mb.close()
            SharedMemBlock.unlink(table_name)
