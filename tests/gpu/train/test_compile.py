"""Training through ``torch.compile(fullgraph=True)``: the lookup and its backward are
custom ops (gpu.ops' ``train_rows`` / ``train_step``), so a model's forward and backward
trace with no graph break, and the compiled steps write the rows an eager layer's steps
do, for every layer type, a fused optimizer and a torch optimizer on ``layer.weight``,
plain and pooled lookups. CPU: the ``aot_eager`` backend (dynamo, the ops' fakes and AOT
autograd; inductor's C++ is slow to build here) and inductor once; CUDA: inductor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpu import LayerType, NVEmbedding, NVEmbeddingBag, optim
from tests.gpu.layer_tables import DEVICES
from tests.gpu.train.tables import TYPES, rows_of, tables

ROWS, DIM, LR = 30, 6, 0.1


class Model(torch.nn.Module):
    """A plain and a pooled lookup of one layer each, an MSE loss."""

    def __init__(self, plain: NVEmbedding, bag: NVEmbeddingBag) -> None:
        super().__init__()
        self.plain, self.bag = plain, bag

    def forward(self, keys: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        out = self.plain(keys).sum(1) + self.bag(keys)
        return ((out - target) ** 2).mean()


def _optimizer(name: str) -> optim.Optimizer | None:
    return {"torch-sgd": None, "rowwise": optim.RowwiseAdagrad(LR),
            "sgd": optim.SGD(LR)}[name]


def _train(model: Model, step: Any, opt: torch.optim.Optimizer | None, device: str) -> None:
    gen = torch.Generator().manual_seed(5)
    for _ in range(4):
        keys = torch.randint(0, ROWS // 2, (4, 5), generator=gen).to(device)
        target = torch.randn(4, DIM, generator=gen).to(device)
        if opt is not None:
            opt.zero_grad()
        loss = step(keys, target)
        assert loss.requires_grad
        loss.backward()
        if opt is not None:
            opt.step()


def _run(layer_type: LayerType, opt_name: str, device: str, tmp_path: Path,
         backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(1))
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir(parents=True)
    with tables(layer_type, tmp_path / "a", w, _optimizer(opt_name)) as a_args, \
            tables(layer_type, tmp_path / "b", w, _optimizer(opt_name)) as b_args:
        kw = dict(device=device, optimize_for_training=True)
        a = _optimizer(opt_name)
        b = _optimizer(opt_name)
        model = Model(NVEmbedding(ROWS, DIM, torch.float32, layer_type, optimizer=a,
                                  **a_args, **kw),
                      NVEmbeddingBag(ROWS, DIM, torch.float32, layer_type, mode="mean",
                                     optimizer=b, **b_args, **kw))
        with model.plain, model.bag:
            opt = (torch.optim.SGD(model.parameters(), lr=LR) if opt_name == "torch-sgd"
                   else None)
            step = model if backend is None else torch.compile(model, fullgraph=True,
                                                               backend=backend)
            _train(model, step, opt, device)
            keys = torch.arange(ROWS)
            return rows_of(model.plain, keys), rows_of(model.bag, keys)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_name", ["torch-sgd", "rowwise", "sgd"])
@pytest.mark.parametrize("layer_type", TYPES, ids=lambda t: t.name)
def test_compiled_training_writes_the_eager_rows(layer_type: LayerType, opt_name: str,
                                                 device: str, tmp_path: Path) -> None:
    torch._dynamo.reset()
    backend = "aot_eager" if device == "cpu" else "inductor"
    want = _run(layer_type, opt_name, device, tmp_path / "eager", None)
    got = _run(layer_type, opt_name, device, tmp_path / "compiled", backend)
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    w = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(got[0], w)  # NOTE: the steps changed rows


def test_inductor_on_the_cpu_trains_a_gpulayer(tmp_path: Path) -> None:
    torch._dynamo.reset()
    want = _run(LayerType.GPULayer, "rowwise", "cpu", tmp_path / "eager", None)
    got = _run(LayerType.GPULayer, "rowwise", "cpu", tmp_path / "compiled", "inductor")
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def test_inference_under_compile_records_no_history() -> None:
    torch._dynamo.reset()
    layer = NVEmbedding(ROWS, DIM, torch.float32, LayerType.GPULayer, device="cpu",
                        optimize_for_training=True, optimizer=optim.RowwiseAdagrad(LR))
    with layer:
        f = torch.compile(layer, fullgraph=True, backend="aot_eager")
        keys = torch.tensor([[1, 2], [3, 3]])
        with torch.no_grad():
            out = f(keys)
        assert out.shape == (2, 2, DIM) and out.grad_fn is None
        assert torch.equal(out, layer(keys).detach())


def test_the_compiled_graphs_hold_the_lookup_and_the_step() -> None:
    """One forward graph and one backward graph: the lookup in the first, the step in the
    second (no graph break, the step not dropped as dead code)."""
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    graphs: dict[str, list[str]] = {"forward": [], "backward": []}

    def keep(kind: str) -> Any:
        def compiler(gm: torch.fx.GraphModule, _inputs: Any) -> Any:
            graphs[kind].append(str(gm.graph))
            return gm.forward
        return compiler

    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    layer = NVEmbedding(ROWS, DIM, torch.float32, LayerType.GPULayer, device="cpu",
                        optimize_for_training=True, optimizer=optim.SGD(LR))
    with layer:
        before = rows_of(layer, torch.tensor([4]))
        f = torch.compile(lambda k: layer(k).square().sum(), fullgraph=True, backend=backend)
        f(torch.tensor([4, 4])).backward()
        assert len(graphs["forward"]) == 1 and len(graphs["backward"]) == 1
        assert "nvecache.train_rows" in graphs["forward"][0]
        assert "nvecache.train_step" in graphs["backward"][0]
        after = rows_of(layer, torch.tensor([4]))
    # d/dw sum(w**2) over two occurrences: 4 w; SGD: w - lr * 4 w
    torch.testing.assert_close(after, before * (1 - 4 * LR))
