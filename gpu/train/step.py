"""The step a layer's backward takes: the gradient summed per unique key, then written
to the rows in every tier (a fused optimizer), or handed to ``layer.weight`` as a sparse
gradient for a torch optimizer to apply (:mod:`gpu.train.weight`).

Writes go through the layer's stack, as ``update`` / ``accumulate`` do, so a shared
table's trained rows are announced to every process (invalidation ring, change feed) and
readers never see a torn row. A linear table (GPULayer, LinearUVM, HostLayer) is
rewritten with the new rows (``step_write`` / ``step_add`` of the stack); a layer's own
table (a GPULayer's, no other process reads it) is written in place, on CUDA by kernels
queued on the current stream with no host sync, ordered as a torch optimizer's step on a
parameter is. A Hierarchical layer over float32 rows adds the difference
with ``accumulate`` (atomic per row at the parameter server: two trainers never lose
each other's steps; keys it lacks are inserted); over 16-bit rows with optimizer state
it writes the new rows, since state stored bit for bit cannot be added to.

Rows whose summed gradient holds NaN or an infinity (an fp16 overflow) are skipped: they
keep their values and state, and ``Trainer.skipped`` counts them (on the device, no host
sync per step). Fused SGD on a linear table adds ``-lr * grad`` per occurrence, without
summing per key first (the table's add sums duplicates); there an occurrence whose
gradient is not finite is skipped, and counted. A torch optimizer's step on
``layer.weight`` adds its (per key) deltas, a key whose delta is not finite skipped and
counted, on every layer type.

Over a quantized table (int8, float8_e4m3fn) every step, fused SGD's or a torch
optimizer's, is written as float32 deltas through the stack's ``accumulate``, which adds
them to the dequantized rows and encodes the sums with stochastic rounding
(:mod:`gpu.train.quantized`): small steps are not lost to rounding.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from gpu.optim.rules import SGD
from gpu.stacks.linear_tables import finite_rows
from gpu.train import quantized, wide

if TYPE_CHECKING:
    from gpu.optim.rules import Optimizer


def sum_by_key(keys: torch.Tensor, grad: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted unique ``keys`` and their gradients ``[U, dim]`` in float32 (rows of
    duplicate keys added)."""
    uniq, inverse = torch.unique(keys, sorted=True, return_inverse=True)
    summed = torch.zeros(uniq.numel(), grad.shape[1], dtype=torch.float32,
                         device=grad.device)
    return uniq, summed.index_add_(0, inverse, grad.float())


class Trainer:
    """A training layer's writer of rows: holds the layer weakly (its stack changes when
    it closes) and the fused optimizer, if any."""

    def __init__(self, layer: Any, optimizer: Optimizer | None) -> None:
        self._layer = weakref.ref(layer)
        self.optimizer = optimizer
        self.dim = layer.embedding_size
        #: ``layer.weight``'s shape (read here, not through the parameter's torch function)
        self.shape = torch.Size((layer.num_embeddings, layer.embedding_size))
        self.dtype = layer.data_type
        #: stored row width: the row plus its optimizer state
        self.width = optimizer.row_width(self.dim, self.dtype) if optimizer else self.dim
        self._hierarchical = layer.layer_type.name == "Hierarchical"
        self._adds = self._hierarchical and (
            self.dtype == torch.float32 or self.width == self.dim)
        #: the layer reads a quantized table: a step is written as float32 deltas through
        #: its accumulate, rounded stochastically there (gpu.train.quantized)
        self._quantized = bool(getattr(layer, "_quant", False))
        #: the indices' address of the last sparse gradient handed to ``weight``
        self.last_grad = 0
        #: rows a step skipped for a non-finite gradient (a device tensor)
        self.skipped = torch.zeros((), dtype=torch.int64, device=layer.device)

    @property
    def stack(self) -> Any:
        layer = self._layer()
        if layer is None:
            raise ReferenceError("the layer was garbage collected")
        return layer._tiers

    def skipped_rows(self) -> int:
        """Rows skipped so far for a non-finite gradient (one host sync)."""
        return int(self.skipped)

    def sparse_grad(self, keys: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """``layer.weight``'s coalesced sparse gradient of a batch (rows of duplicate keys
        added), on the layer's device."""
        uniq, summed = sum_by_key(keys, grad)
        device = self.skipped.device
        sparse = torch.sparse_coo_tensor(
            uniq.unsqueeze(0).to(device), summed.to(self.dtype).to(device), self.shape,
            is_coalesced=True, check_invariants=False)
        self.last_grad = sparse._indices().data_ptr()
        return sparse

    def step(self, keys: torch.Tensor, grad: torch.Tensor) -> None:
        """A compiled backward's step (``gpu.ops``' ``train_step``): the fused optimizer,
        or the batch's sparse gradient added to ``layer.weight.grad``, as an eager
        backward gives it."""
        if self.optimizer is not None:
            self.fused(keys, grad)
            return
        layer = self._layer()
        if layer is None:
            raise ReferenceError("the layer was garbage collected")
        weight = layer.weight
        sparse = self.sparse_grad(keys, grad)
        weight.grad = sparse if weight.grad is None else (weight.grad + sparse).coalesce()

    @torch.no_grad()
    def fused(self, keys: torch.Tensor, grad: torch.Tensor) -> None:
        """Apply the fused optimizer for a batch's gradient ``[N, dim]`` of ``keys``."""
        assert self.optimizer is not None
        if isinstance(self.optimizer, SGD) and not self._hierarchical:
            self._sgd(keys, grad)
            return
        uniq, g = sum_by_key(keys, grad)
        if uniq.numel() == 0:
            return
        self.optimizer.steps += 1
        stack = self.stack
        cur = stack.rows(uniq)
        w, s = wide.split(cur, self.dim)
        new_w, new_s = self.optimizer.apply(w.clone(), s.clone(), g)
        ok = torch.isfinite(g).all(dim=1, keepdim=True)
        self.skipped += (~ok).sum()
        new_w = torch.where(ok, new_w, w)
        new_s = torch.where(ok, new_s, s)
        self._write(stack, uniq, cur, wide.join(new_w, new_s, self.dtype))

    def _sgd(self, keys: torch.Tensor, grad: torch.Tensor) -> None:
        """SGD on a linear table: ``-lr * grad`` added per occurrence (the table adds
        duplicates), no dedup; an occurrence whose gradient is not finite adds nothing."""
        assert self.optimizer is not None
        self.optimizer.steps += 1
        if self._quantized:
            self.stack.accumulate(keys, quantized.step_deltas(grad, -self.optimizer.lr,
                                                              self.skipped))
            return
        self.stack.step_add(keys, grad, -self.optimizer.lr, self.skipped)

    @torch.no_grad()
    def add(self, keys: torch.Tensor, deltas: torch.Tensor) -> None:
        """Add float32 ``deltas [U, dim]`` to the rows of unique ``keys``: a torch
        optimizer's step on the sparse gradient (a layer without optimizer state)."""
        stack = self.stack
        if not self._hierarchical:
            if self._quantized:  # NOTE: float32 deltas, rounded stochastically by the table
                stack.accumulate(keys, quantized.step_deltas(deltas, 1.0, self.skipped))
            else:
                stack.step_add(keys, deltas, 1.0, self.skipped)
            return
        ok = finite_rows(deltas)
        self.skipped += (~ok).sum()
        keys = keys[ok]  # NOTE: the few rows of a Hierarchical step: a host sync is paid
        deltas = deltas[ok]
        found = stack.accumulate(keys, deltas if self._quantized else deltas.to(self.dtype))
        self._insert_missing(stack, keys, found, None, deltas)

    @torch.no_grad()
    def add_rows(self, keys: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        """Add ``deltas [N, dim]`` to rows stored with 16-bit state (read, add in float32,
        write: state kept bit for bit); bool ``[N]``: all True (a key no tier held is
        inserted as its default row plus the delta)."""
        uniq, d = sum_by_key(keys, deltas)
        stack = self.stack
        cur = stack.rows(uniq)
        w, s = wide.split(cur, self.dim)
        found = stack.update(uniq, wide.join(w.add_(d), s, self.dtype))
        self._insert_missing(stack, uniq, found, wide.join(w, s, self.dtype), None)
        return torch.ones(keys.numel(), dtype=torch.bool, device=keys.device)

    def _write(self, stack: Any, keys: torch.Tensor, cur: torch.Tensor,
               new: torch.Tensor) -> None:
        if not self._hierarchical:
            stack.step_write(keys, new)
            return
        if self._adds:
            delta = (new - cur if self.dtype == torch.float32 else
                     new.float() - cur.float())
            found = stack.accumulate(keys, delta if self._quantized else delta.to(self.dtype))
        else:
            found = stack.update(keys, new)
        self._insert_missing(stack, keys, found, new, None)

    def _insert_missing(self, stack: Any, keys: torch.Tensor, found: torch.Tensor,
                        new: torch.Tensor | None, deltas: torch.Tensor | None) -> None:
        """Insert the rows of keys no tier held (they read as the default row)."""
        if not self._hierarchical:
            return  # NOTE: a linear table holds every key in range
        missing = ~found
        if not bool(missing.any()):
            return
        keys = keys[missing]
        if new is None:
            assert deltas is not None
            base = stack.rows(keys)
            new = (base.float() + deltas[missing]).to(base.dtype)
        else:
            new = new[missing]
        stack.insert(keys, new)
