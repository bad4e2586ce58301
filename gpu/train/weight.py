"""``layer.weight`` of a training layer: an ``nn.Parameter`` standing for the whole table.

Its data is the table's rows where they live when the layer has one linear table
(GPULayer, LinearUVM, HostLayer: a view, no copy); a Hierarchical layer has no such
tensor, and its ``weight`` holds one zero broadcast to the table's shape (no memory).
A backward gives it a coalesced sparse gradient over the batch's unique keys (a
Hierarchical layer's may hold keys beyond ``num_embeddings``: its keys are any int64).

``weight.add_(sparse_grad, alpha=-lr)``, the step of ``torch.optim.SGD``, is routed to
the layer's write path (:meth:`gpu.train.step.Trainer.add`): the rows change in every
tier and the write is announced to every process. Other in-place changes of ``weight``
raise: write rows with the layer's ``update`` / ``insert`` / ``accumulate``.
"""

from __future__ import annotations

from typing import Any

import torch

from gpu.errors import BadArgumentError
from gpu.train.step import Trainer

_ADD = (torch.Tensor.add_,)


class TableWeight(torch.nn.Parameter):
    """The parameter of a training layer (see the module docstring)."""

    _trainer: Trainer

    def __new__(cls, data: torch.Tensor, trainer: Trainer) -> TableWeight:
        t = torch.Tensor._make_subclass(cls, data, True)
        t._trainer = trainer
        if trainer.optimizer is None:  # NOTE: a fused optimizer leaves the gradient None
            t.register_post_accumulate_grad_hook(_coalesced)
        return t

    def __deepcopy__(self, memo: dict[int, Any]) -> TableWeight:
        raise BadArgumentError("a layer's weight stands for its tables and is not copied: "
                               "copy rows with layer.state_dict()")

    def __reduce_ex__(self, proto: Any) -> Any:
        raise BadArgumentError("a layer's weight stands for its tables and is not pickled: "
                               "save rows with layer.state_dict()")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _ADD and args and isinstance(args[0], TableWeight):
            return _sparse_add(args[0], *args[1:], **kwargs)
        name = getattr(func, "__name__", "")
        if _writes_weight(name, args, kwargs):
            raise BadArgumentError(f"{name}() would write the table around the layer: "
                                   "use layer.update/insert/accumulate, or a torch "
                                   "optimizer with a sparse gradient (SGD)")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _writes_weight(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call writes a :class:`TableWeight`: an in-place function or method of one
    (passed first, or by keyword as ``nn.init``'s functions pass it), an item assignment,
    or one given as ``out=``."""
    out = kwargs.get("out")
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if any(isinstance(o, TableWeight) for o in outs):
        return True
    target = args[0] if args else kwargs.get("tensor", kwargs.get("input"))
    if not isinstance(target, TableWeight):
        return False
    if name == "__setitem__":
        return True
    return name.endswith("_") and not name.endswith("__") and name != "requires_grad_"


def _coalesced(weight: torch.Tensor) -> None:
    """After a backward: ``weight.grad`` coalesced. One backward's gradient is already
    (torch's accumulation drops the mark: it is set again); the sum of several is
    coalesced here."""
    grad = weight.grad
    if grad is None or not grad.is_sparse or grad.is_coalesced():
        return
    trainer = weight._trainer  # type: ignore[attr-defined]
    if grad._indices().data_ptr() == trainer.last_grad:
        grad._coalesced_(True)
    else:
        weight.grad = grad.coalesce()


def _sparse_add(weight: TableWeight, other: Any, *, alpha: float = 1) -> TableWeight:
    if not isinstance(other, torch.Tensor) or not other.is_sparse:
        raise BadArgumentError("weight.add_ takes the layer's sparse gradient (a torch "
                               "optimizer's step); write rows with layer.update/accumulate")
    if other.sparse_dim() != 1 or tuple(other.shape) != tuple(weight.shape):
        raise BadArgumentError(
            f"weight.add_ takes a sparse gradient of weight's shape {tuple(weight.shape)} "
            f"with one sparse dimension (the layer's own); got shape {tuple(other.shape)} "
            f"with {other.sparse_dim()}: write rows with layer.update/accumulate")
    if isinstance(alpha, torch.Tensor):
        alpha = float(alpha)
    g = other.coalesce()
    keys = g.indices()[0]
    deltas = g.values().float() * float(alpha)
    trainer = weight._trainer
    device = trainer.skipped.device
    weight._trainer.add(keys.to(device), deltas.to(device))
    return weight
