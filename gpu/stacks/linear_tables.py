"""Linear tables a layer reads (its own tensor, a ``SharedMemBlock``, a ``DistMemBlock``):
the zero-copy row views, the read/write gate, and the writes every process sees."""

from __future__ import annotations

import functools
from typing import Any

import torch

from hostcache.gate import TableGate, gate_for


def registered_rows(table: Any, device: torch.device) -> tuple[Any, torch.Tensor]:
    """(registration or None, rows view on ``device``) of a SharedMemBlock or DistMemBlock."""
    from gpu.dist.distmem import DistMemBlock

    if isinstance(table, DistMemBlock):
        return None, table.view(device)  # already mapped for its devices
    if device.type == "cpu":
        return None, table.tensor
    from gpu.cuda.registration import register

    reg = register(table, device)
    return reg, reg.rows()


def write_linear(block: Any, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write rows of a shared linear table; the write is announced to every process."""
    from gpu.dist.distmem import DistMemBlock

    if isinstance(block, DistMemBlock):
        block.write(keys, values)  # on the device, no host round trip
    else:
        block.write(keys.cpu(), values.cpu(), allow_nonfinite=True)  # the layer checked


def table_gate(storage: Any, device: torch.device) -> TableGate:
    """The process's read/write gate of a linear table (a block, or a layer's own tensor),
    with a drain that waits for ``device``'s queued kernels before any write (they may still
    be reading the rows)."""
    if isinstance(storage, torch.Tensor):
        gate = gate_for(("tensor", str(storage.device), storage.data_ptr()))
    else:  # a SharedMemBlock or a DistMemBlock
        gate = storage.gate
    if device.type == "cuda":
        gate.add_drain(("cuda", device.index), functools.partial(torch.cuda.synchronize, device))
    return gate


def write_tensor(gate: TableGate, table: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor) -> None:
    """Write rows of a layer's own table tensor through its gate; on CUDA the rows are in
    place when this returns (a lookup on another stream that starts later reads them)."""
    with gate.writing():
        table[keys.to(table.device)] = values.to(table.device)
        if table.is_cuda:
            torch.cuda.current_stream(table.device).synchronize()


def add_user(block: Any, user: object) -> None:
    if hasattr(block, "add_user"):  # a DistMemBlock: closing it first is an order error
        block.add_user(user)


def remove_user(block: Any, user: object) -> None:
    if hasattr(block, "remove_user"):
        block.remove_user(user)
