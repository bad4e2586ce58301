"""Training over quantized tables (int8, float8_e4m3fn) with the stateless optimizers, a
torch ``SGD`` on ``layer.weight`` and the fused ``gpu.optim.SGD``; the stateful fused
optimizers refused.

The seed's scenario (tests/gpu/train/test_differential.py: 40 rows of dim 7, six SGD
steps of MSE over batches of 3 x 9 keys with repeats, lr 0.05):

- each step against torch's SGD on the dequantized rows the layer read before it: every
  row it touched within one quantization step of torch's (stochastic rounding:
  ``quant.error_bound(..., stochastic=True)``), every other row unchanged;
- the six steps against the same six in float32 from the same dequantized rows: within
  the sum of the steps' bounds (each step's map is non-expansive for this loss, so the
  rounding errors add at most), the loss falling as float32's does.

Over every table a layer type can read quantized (tests/gpu/train/quantized_tables.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpu import BadArgumentError, LayerType, NVEmbedding, optim
from hostcache import HostCache, SharedMemBlock
from nvecache.common import quant
from nvecache.common.rows import RowFormat
from tests.conftest import fresh_name
from tests.gpu.layer_tables import DEVICES
from tests.gpu.train.quantized_tables import KINDS, build, tables
from tests.gpu.train.tables import rows_of

ROWS, DIM, STEPS, LR = 40, 7, 6, 0.05
FORMATS = [torch.int8, torch.float8_e4m3fn]
OPTIMIZERS = {"torch-sgd": lambda: None, "sgd": lambda: optim.SGD(LR)}
#: float32 arithmetic the comparisons allow beyond the quantization bounds (sums of a
#: batch's gradients in another order than torch's)
SLACK = 1e-5


def _batches(gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randint(0, ROWS // 2, (3, 9), generator=gen),
             torch.randn(3, 9, DIM, generator=gen)) for _ in range(STEPS)]


def _step(layer: Any, torch_opt: Any, keys: torch.Tensor, target: torch.Tensor) -> float:
    """One training step of the layer (MSE); its loss."""
    if torch_opt is not None:
        torch_opt.zero_grad()
    loss = ((layer(keys.to(layer.device)) - target.to(layer.device)) ** 2).mean()
    loss.backward()
    if torch_opt is not None:
        torch_opt.step()
    return float(loss.detach())


def _torch_step(rows: torch.Tensor, keys: torch.Tensor, target: torch.Tensor
                ) -> tuple[torch.Tensor, float]:
    """torch's SGD step of MSE from float32 ``rows``: the new rows and the loss."""
    ref = torch.nn.Embedding(ROWS, DIM, sparse=True)
    with torch.no_grad():
        ref.weight.copy_(rows)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    loss = ((ref(keys) - target) ** 2).mean()
    loss.backward()
    opt.step()
    return ref.weight.detach().clone(), float(loss.detach())


def _bound(rows: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    """``[N, 1]``: how far stochastic rounding may put each of ``rows`` (one step of the
    row's quantization; its parameters depend on its range only)."""
    return quant.error_bound(quant.encode(rows, fmt), fmt, stochastic=True) * (1 + 1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_each_step_is_torch_s_on_the_dequantized_rows_within_one_step(
        kind: str, fmt: torch.dtype, opt_name: str, device: str, tmp_path: Path,
        request: pytest.FixtureRequest) -> None:
    f = RowFormat(fmt, DIM)
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(ROWS, DIM, generator=gen)
    every = torch.arange(ROWS)
    with tables(kind, fmt, w, device, tmp_path, request) as (layer_type, args), \
            build(layer_type, args, fmt, device, OPTIMIZERS[opt_name](), ROWS, DIM) as layer:
        torch_opt = (torch.optim.SGD(layer.parameters(), lr=LR)
                     if layer.optimizer is None else None)
        quant.seed_rounding(0)
        before = rows_of(layer, every)
        # NOTE: over a server of the same format, the host cache holds its stored bytes
        stored = quant.decode(quant.encode(w, f), f)
        assert torch.equal(before, stored)
        for keys, target in _batches(gen):
            want, ref_loss = _torch_step(before, keys, target)
            loss = _step(layer, torch_opt, keys, target)
            assert abs(loss - ref_loss) <= 1e-5 * max(1.0, ref_loss)  # the same rows read
            got = rows_of(layer, every)
            touched = torch.zeros(ROWS, dtype=torch.bool)
            touched[keys.reshape(-1)] = True
            err = (got[touched] - want[touched]).abs()
            assert bool((err <= _bound(want[touched], f) + SLACK).all()), err.max()
            assert torch.equal(got[~touched], before[~touched])
            assert not torch.equal(got[touched], before[touched])
            before = got
        if layer.optimizer is not None:
            assert layer.weight.grad is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_six_steps_converge_as_float32_within_the_summed_bounds(
        kind: str, fmt: torch.dtype, device: str, tmp_path: Path,
        request: pytest.FixtureRequest) -> None:
    """The seed's six steps over quantized rows against the same steps in float32 from the
    same (dequantized) rows: the documented tolerance is the sum, per row, of one
    quantization step for each step that touched it (each SGD step of this MSE multiplies
    a row's difference by ``1 - 2 lr c / n`` in (0, 1], so differences never grow and each
    step's rounding adds at most its bound)."""
    f = RowFormat(fmt, DIM)
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(ROWS, DIM, generator=gen)
    every = torch.arange(ROWS)
    tolerance = torch.zeros(ROWS, 1)
    with tables(kind, fmt, w, device, tmp_path, request) as (layer_type, args), \
            build(layer_type, args, fmt, device, None, ROWS, DIM) as layer:
        sgd = torch.optim.SGD(layer.parameters(), lr=LR)
        quant.seed_rounding(0)
        exact = rows_of(layer, every)
        losses, exact_losses = [], []
        for keys, target in _batches(gen):
            exact, exact_loss = _torch_step(exact, keys, target)
            exact_losses.append(exact_loss)
            losses.append(_step(layer, sgd, keys, target))
            got = rows_of(layer, every)
            touched = torch.unique(keys)
            tolerance[touched] += _bound(got[touched], f)
        err = (got - exact).abs()
        assert bool((err <= tolerance + SLACK).all()), (err - tolerance).max()
    assert losses[0] == pytest.approx(exact_losses[0], rel=1e-5)
    assert losses[-1] < losses[0] and exact_losses[-1] < exact_losses[0]
    # NOTE: a loss is a mean of squares of rows within the tolerance of float32's
    assert abs(losses[-1] - exact_losses[-1]) <= 0.05 * exact_losses[-1]


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("opt", [optim.Adagrad(LR), optim.RowwiseAdagrad(LR), optim.Adam(LR)],
                         ids=lambda o: type(o).__name__)
def test_stateful_optimizers_are_refused_over_a_quantized_table(
        opt: optim.Optimizer, fmt: torch.dtype, tmp_path: Path) -> None:
    """Their state would be quantized with the row: BadArgumentError saying so and what to
    do, for a quantized block or host cache passed as an object or by name, before
    anything is opened or written."""
    width = opt.row_width(DIM, torch.float32)
    name, block = fresh_name(), fresh_name()
    with SharedMemBlock.create(block, num_rows=ROWS, dim=width, dtype=fmt) as mb, \
            HostCache.create(name, capacity=64, dim=width, dtype=fmt, ways=4) as hc:
        try:
            before = mb.tensor.clone()
            for layer_type, args in [
                    (LayerType.GPULayer, {"storage": mb}),
                    (LayerType.LinearUVM, {"storage": mb, "gpu_cache_size": 1 << 16}),
                    (LayerType.Hierarchical, {"host_cache": hc}),
                    (LayerType.Hierarchical, {"host_cache": name})]:
                with pytest.raises(BadArgumentError, match="cannot train over the quantized"
                                   ) as e:
                    NVEmbedding(ROWS, DIM, torch.float32, layer_type, device="cpu",
                                optimize_for_training=True, optimizer=opt, **args)
                assert type(opt).__name__ in str(e.value) and "gpu.optim.SGD" in str(e.value)
                assert "float32 state" in str(e.value)
            assert torch.equal(mb.tensor, before) and hc.stats().size == 0
            assert HostCache.attach(name).close() is None  # NOTE: still there, unharmed
        finally:
            SharedMemBlock.unlink(block)
            HostCache.unlink(name)
