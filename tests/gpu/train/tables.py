"""Tables a training test builds a layer of each type over (rows stored with their
optimizer state: ``optimizer.row_width``), and torch's references of the optimizers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import psclient
from gpu import LayerType, optim
from gpu.train import wide
from hostcache import HostCache, SharedMemBlock
from tests.conftest import fresh_name

#: every layer type a test trains (HostLayer is the CPU-table twin of GPULayer)
TYPES = [LayerType.GPULayer, LayerType.LinearUVM, LayerType.Hierarchical]


def width(optimizer: optim.Optimizer | None, dim: int, dtype: torch.dtype) -> int:
    return dim if optimizer is None else optimizer.row_width(dim, dtype)


@contextlib.contextmanager
def tables(layer_type: LayerType, tmp_path: Path, w: torch.Tensor,
           optimizer: optim.Optimizer | None, *, cache_rows: int = 16,
           name: str | None = None) -> Iterator[dict[str, Any]]:
    """Layer arguments of ``layer_type`` over tables holding ``w``'s rows with zero
    state: a GPULayer's own table, a SharedMemBlock under a LinearUVM cache of
    ``cache_rows`` lines, a host cache over a ``file://`` parameter server."""
    name = name or fresh_name()
    rows, dim = w.shape
    stored = width(optimizer, dim, w.dtype)
    row_bytes = stored * w.element_size()
    if layer_type is LayerType.GPULayer:
        yield {"weight_init": w}
    elif layer_type is LayerType.LinearUVM:
        with SharedMemBlock.create(name, num_rows=rows, dim=stored, dtype=w.dtype) as mb:
            try:
                mb.write(torch.arange(rows), wide.pad(w, stored))
                yield {"storage": mb, "gpu_cache_size": cache_rows * row_bytes}
            finally:
                SharedMemBlock.unlink(name)
    else:
        with HostCache.create(name, capacity=max(32, rows // 2), dim=stored, dtype=w.dtype,
                              ways=4) as hc:
            try:
                with psclient.connect(f"file://{tmp_path}/{name}", table=name, dim=stored,
                                      dtype=w.dtype) as ps:
                    ps.load(wide.pad(w, stored), progress=False)
                    yield {"host_cache": hc, "storage": ps,
                           "gpu_cache_size": cache_rows * row_bytes}
            finally:
                HostCache.unlink(name)


class RowwiseAdagradRef(torch.optim.Optimizer):
    """A reference RowwiseAdagrad on a sparse gradient, written from its definition:
    ``s += mean(g**2)`` per row; ``w -= lr * g / (sqrt(s) + eps)``."""

    def __init__(self, params: Any, lr: float, eps: float = 1e-10) -> None:
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.coalesce()
                idx, val = g.indices()[0], g.values()
                state = self.state[p].setdefault("sum", torch.zeros(p.shape[0]))
                state[idx] += val.square().mean(dim=1)
                p[idx] -= group["lr"] * val / (state[idx].sqrt() + group["eps"]).unsqueeze(1)


def reference(optimizer: optim.Optimizer | None, params: Any, lr: float) -> torch.optim.Optimizer:
    """torch's optimizer that ``optimizer`` equals (SGD for a layer without one)."""
    if optimizer is None or isinstance(optimizer, optim.SGD):
        return torch.optim.SGD(params, lr=lr)
    if isinstance(optimizer, optim.Adagrad):
        return torch.optim.Adagrad(params, lr=lr, eps=optimizer.eps)
    if isinstance(optimizer, optim.RowwiseAdagrad):
        return RowwiseAdagradRef(params, lr=lr, eps=optimizer.eps)
    return torch.optim.SparseAdam(params, lr=lr, betas=optimizer.betas, eps=optimizer.eps)


def rows_of(layer: Any, keys: torch.Tensor) -> torch.Tensor:
    """The layer's rows of ``keys`` as float32 on the CPU (no autograd)."""
    keys = keys.to(layer.device)
    with torch.no_grad():
        if hasattr(layer, "mode"):  # NOTE: a bag layer: one key per bag
            return layer(keys.view(-1, 1)).float().cpu()
        return layer(keys).float().cpu()
