"""Training differential against torch: every layer type, every optimizer (fused, and a
torch optimizer on ``layer.weight``'s sparse gradient), plain and pooled lookups, every
dtype, several steps over batches with repeated keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpu import LayerType, NVEmbedding, NVEmbeddingBag, optim
from tests.gpu.layer_tables import DEVICES
from tests.gpu.train.tables import TYPES, reference, rows_of, tables

ROWS, DIM, STEPS, LR = 40, 7, 6, 0.05

OPTIMIZERS = {
    "torch-sgd": lambda: None,
    "sgd": lambda: optim.SGD(LR),
    "adagrad": lambda: optim.Adagrad(LR),
    "rowwise": lambda: optim.RowwiseAdagrad(LR),
    "adam": lambda: optim.Adam(LR, betas=(0.8, 0.9)),
}
#: how far a 16-bit table may drift from the float32 reference rounded each step
TOL = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 1e-1}


def _layer(cls: type, layer_type: LayerType, dtype: torch.dtype, device: str,
           opt: Any, args: dict[str, Any], **kw: Any) -> Any:
    return cls(ROWS, DIM, dtype, layer_type, device=device, optimize_for_training=True,
               optimizer=opt, **args, **kw)


def _train(layer: Any, ref: torch.nn.Module, ref_opt: torch.optim.Optimizer,
           torch_opt: torch.optim.Optimizer | None, dtype: torch.dtype, batches: Any,
           run: Any) -> None:
    """``STEPS`` steps of MSE on both; the reference's rows are rounded to ``dtype``
    after each step, as the layer stores them."""
    for keys, target, extra in batches:
        ref_opt.zero_grad()
        loss = ((run(ref, keys, extra, True) - target) ** 2).mean()
        loss.backward()
        ref_opt.step()
        with torch.no_grad():
            ref.weight.copy_(ref.weight.to(dtype).float())
        if torch_opt is not None:
            torch_opt.zero_grad()
        out = run(layer, keys, extra, False)
        assert out.dtype == dtype and out.requires_grad and out.grad_fn is not None
        ((out.float() - target.to(layer.device)) ** 2).mean().backward()
        if torch_opt is not None:
            grad = layer.weight.grad
            assert grad.is_sparse and grad.is_coalesced()
            torch_opt.step()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=str)
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("layer_type", TYPES, ids=lambda t: t.name)
def test_embedding_trains_as_torch(layer_type: LayerType, opt_name: str, dtype: torch.dtype,
                                   device: str, tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(ROWS, DIM, generator=gen).to(dtype)
    opt = OPTIMIZERS[opt_name]()
    ref = torch.nn.Embedding(ROWS, DIM, sparse=True)
    with torch.no_grad():
        ref.weight.copy_(w.float())
    ref_opt = reference(opt, ref.parameters(), LR)
    batches = [(torch.randint(0, ROWS // 2, (3, 9), generator=gen),
                torch.randn(3, 9, DIM, generator=gen), None) for _ in range(STEPS)]
    with tables(layer_type, tmp_path, w, opt) as args, \
            _layer(NVEmbedding, layer_type, dtype, device, opt, args) as layer:
        torch_opt = torch.optim.SGD(layer.parameters(), lr=LR) if opt is None else None
        _train(layer, ref, ref_opt, torch_opt, dtype, batches,
               lambda m, k, _e, r: m(k if r else k.to(device)))
        got = rows_of(layer, torch.arange(ROWS))
        if opt is not None:
            assert layer.weight.grad is None  # NOTE: fused: no gradient kept
    torch.testing.assert_close(got, ref.weight.detach(), atol=TOL[dtype], rtol=TOL[dtype])
    assert not torch.equal(got, w.float())


BAGS = ["sum", "mean", "max", "weighted"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_name", ["torch-sgd", "rowwise", "adam"])
@pytest.mark.parametrize("bag", BAGS)
@pytest.mark.parametrize("layer_type", TYPES, ids=lambda t: t.name)
def test_bags_train_as_torch(layer_type: LayerType, bag: str, opt_name: str, device: str,
                             tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(ROWS, DIM, generator=gen)
    opt = OPTIMIZERS[opt_name]()
    mode = "sum" if bag == "weighted" else bag
    ref = torch.nn.Embedding(ROWS, DIM, sparse=True)  # NOTE: pooled below, per bag
    with torch.no_grad():
        ref.weight.copy_(w)
    ref_opt = reference(opt, ref.parameters(), LR)
    batches = []
    for _ in range(STEPS):
        keys = torch.randint(0, ROWS // 2, (30,), generator=gen)
        cuts = torch.randint(0, 31, (5,), generator=gen)
        cuts = torch.cat([cuts, cuts[:1]]).sort().values  # NOTE: an empty bag at least
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.tensor([30])])
        weights = torch.rand(30, generator=gen) if bag == "weighted" else None
        batches.append(((keys, offsets), torch.randn(offsets.numel() - 1, DIM, generator=gen),
                        weights))

    def run(m: Any, k: Any, extra: Any, is_ref: bool) -> torch.Tensor:
        keys, offsets = k
        if is_ref:
            return _pool(m(keys), offsets, extra, mode)
        if not is_ref:
            keys, offsets = keys.to(device), offsets.to(device)
            extra = None if extra is None else extra.to(device)
        return m(keys, offsets, per_sample_weights=extra)

    with tables(layer_type, tmp_path, w, opt) as args, \
            _layer(NVEmbeddingBag, layer_type, torch.float32, device, opt, args,
                   mode=mode, include_last_offset=True) as layer:
        torch_opt = torch.optim.SGD(layer.parameters(), lr=LR) if opt is None else None
        _train(layer, ref, ref_opt, torch_opt, torch.float32, batches, run)
        got = rows_of(layer, torch.arange(ROWS))
    torch.testing.assert_close(got, ref.weight.detach(), atol=1e-5, rtol=1e-5)


def _pool(rows: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
          mode: str) -> torch.Tensor:
    """Bags of ``rows`` pooled one at a time: the reference (max's gradient goes to the
    winning row by torch's ``max``)."""
    if weights is not None:
        rows = rows * weights.unsqueeze(1)
    out = []
    for b in range(offsets.numel() - 1):
        bag = rows[int(offsets[b]):int(offsets[b + 1])]
        if bag.shape[0] == 0:
            out.append(rows.new_zeros(rows.shape[1]))
        elif mode == "sum":
            out.append(bag.sum(0))
        elif mode == "mean":
            out.append(bag.mean(0))
        else:
            out.append(bag.max(0).values)
    return torch.stack(out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layer_type", TYPES, ids=lambda t: t.name)
def test_per_sample_weights_get_their_gradient(layer_type: LayerType, device: str,
                                               tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(ROWS, DIM, generator=gen)
    keys = torch.randint(0, ROWS, (12,), generator=gen)
    offsets = torch.tensor([0, 5, 5, 9])
    psw = torch.rand(12, generator=gen)
    ref = torch.nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
    with torch.no_grad():
        ref.weight.copy_(w)
    want_w = psw.clone().requires_grad_()
    ref(keys, offsets, per_sample_weights=want_w).square().sum().backward()
    with tables(layer_type, tmp_path, w, None) as args, \
            _layer(NVEmbeddingBag, layer_type, torch.float32, device, None, args) as layer:
        got_w = psw.to(device).requires_grad_()
        layer(keys.to(device), offsets.to(device),
              per_sample_weights=got_w).square().sum().backward()
        grad = layer.weight.grad.to_dense()
    torch.testing.assert_close(got_w.grad.cpu(), want_w.grad)
    torch.testing.assert_close(grad.cpu(), ref.weight.grad.to_dense())
