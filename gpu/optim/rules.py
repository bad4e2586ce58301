"""The update rules of the fused optimizers, on float32 rows of unique keys.

Each rule takes the rows' current values ``w [U, D]``, their state ``s [U, S]`` and the
summed gradient ``g [U, D]`` of the batch (duplicate keys already added together) and
returns the new ``(w, s)``. They match torch's optimizers on a coalesced sparse
gradient: ``SGD`` as ``torch.optim.SGD``, ``Adagrad`` as ``torch.optim.Adagrad``,
``Adam`` as ``torch.optim.SparseAdam`` (its step count is the optimizer's, one per
backward of the layer, as SparseAdam's is one per ``step()``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gpu.errors import BadArgumentError


def _rate(name: str, value: object, *, below_one: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadArgumentError(f"{name} must be a finite positive number; got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v <= 0 or (below_one and v >= 1):
        bound = "in (0, 1)" if below_one else "a finite positive number"
        raise BadArgumentError(f"{name} must be {bound}; got {value!r}")
    return v


class Optimizer:
    """A fused row-wise optimizer. Subclasses give ``state_cols`` (float32 values of
    state per row, a function of the row's width) and :meth:`apply`."""

    def __init__(self, lr: float) -> None:
        self.lr = _rate("lr", lr)
        #: backward passes applied (Adam's bias correction counts them)
        self.steps = 0

    def state_cols(self, dim: int) -> int:
        """float32 values of state per row of ``dim`` elements."""
        return 0

    def row_width(self, dim: int, dtype: torch.dtype) -> int:
        """Elements of ``dtype`` per stored row: the row's ``dim`` plus its state (a
        float32 takes two elements of a 16-bit dtype). Tables a layer trained with this
        optimizer reads (a host cache, a parameter-server table, a shared linear table)
        are built with this width."""
        per = 4 // torch.empty((), dtype=dtype).element_size()
        return dim + per * self.state_cols(dim)

    def apply(self, w: torch.Tensor, s: torch.Tensor, g: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """New rows and state from float32 ``w``, ``s``, ``g``."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's settings and step count (its per-row state is in the tables)."""
        return {"type": type(self).__name__, **vars(self)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the step count of :meth:`state_dict` back (settings must match)."""
        if state.get("type") != type(self).__name__:
            raise BadArgumentError(f"optimizer state of {state.get('type')!r} does not load "
                                   f"into {type(self).__name__}")
        self.steps = int(state.get("steps", 0))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if k != "steps")
        return f"{type(self).__name__}({args})"


class SGD(Optimizer):
    """``w -= lr * g``; no state."""

    def apply(self, w: torch.Tensor, s: torch.Tensor, g: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        return w.add_(g, alpha=-self.lr), s


class Adagrad(Optimizer):
    """``s += g**2``; ``w -= lr * g / (sqrt(s) + eps)``, element-wise (``torch.optim.
    Adagrad`` on a sparse gradient); state: one float32 per element."""

    def __init__(self, lr: float = 0.01, eps: float = 1e-10) -> None:
        super().__init__(lr)
        self.eps = _rate("eps", eps)

    def state_cols(self, dim: int) -> int:
        return dim

    def apply(self, w: torch.Tensor, s: torch.Tensor, g: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        s = s.addcmul_(g, g)
        return w.addcdiv_(g, s.sqrt().add_(self.eps), value=-self.lr), s


class RowwiseAdagrad(Optimizer):
    """``s += mean(g**2)`` per row; ``w -= lr * g / (sqrt(s) + eps)``; state: one float32
    per row."""

    def __init__(self, lr: float = 0.01, eps: float = 1e-10) -> None:
        super().__init__(lr)
        self.eps = _rate("eps", eps)

    def state_cols(self, dim: int) -> int:
        return 1

    def apply(self, w: torch.Tensor, s: torch.Tensor, g: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        s = s.add_(g.square().mean(dim=1, keepdim=True))
        return w.addcdiv_(g, s.sqrt().add_(self.eps), value=-self.lr), s


class Adam(Optimizer):
    """``torch.optim.SparseAdam``: moments updated on the rows the batch touched, bias
    correction by the optimizer's step count; state: two float32 per element."""

    def __init__(self, lr: float = 0.001, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8) -> None:
        super().__init__(lr)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise BadArgumentError(f"betas must be a pair of numbers in (0, 1); got {betas!r}")
        self.betas = (_rate("betas[0]", betas[0], below_one=True),
                      _rate("betas[1]", betas[1], below_one=True))
        self.eps = _rate("eps", eps)

    def state_cols(self, dim: int) -> int:
        return 2 * dim

    def apply(self, w: torch.Tensor, s: torch.Tensor, g: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        b1, b2 = self.betas
        dim = w.shape[1]
        m, v = s[:, :dim], s[:, dim:]
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        step = max(self.steps, 1)
        size = self.lr * math.sqrt(1 - b2 ** step) / (1 - b1 ** step)
        return w.addcdiv_(m, v.sqrt().add_(self.eps), value=-size), s
