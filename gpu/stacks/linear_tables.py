"""Linear tables a layer reads (its own tensor, a user's CPU tensor registered in place for
a CUDA layer, a ``SharedMemBlock``, a ``DistMemBlock``), plain or quantized
(:mod:`gpu.stacks.quantized`): the zero-copy row views, the read/write gate, the writes
every process sees, and :class:`LinearTable`, the base of the stacks over one (GPULayer,
HostLayer, LinearUVM)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from gpu.errors import NonFiniteValuesError
from gpu.inputs import check_range
from gpu.stacks.key_flag import RangeCheck
from gpu.stacks.quantized import add_stored, block_format, write_stored
from hostcache.errors import NonFiniteValuesError as HostNonFiniteValuesError
from hostcache.gate import TableGate, gate_for
from hostcache.memblock import SharedMemBlock
from nvecache.common.accumulate import added, sum_duplicates
from nvecache.common.rows import RowFormat


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


def user_rows(tensor: torch.Tensor, device: torch.device) -> tuple[Any, torch.Tensor]:
    """(registration, rows view on ``device``) of a user's CPU tensor that a CUDA layer
    reads in place (registered with CUDA in this process, no copy)."""
    from gpu.cuda.registration import register_tensor

    reg = register_tensor(tensor, device)
    return reg, reg.rows()


def write_linear(block: Any, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write rows of a shared linear table; the write is announced to every process."""
    from gpu.dist.distmem import DistMemBlock

    if isinstance(block, DistMemBlock):
        block.write(keys, values)  # on the device, no host round trip
    else:
        # NOTE: the layer checked the rows (a quantized block checks them anyway)
        with _nonfinite_as_layer_error():
            block.write(keys.cpu(), values.cpu(), allow_nonfinite=True)


def add_linear(block: Any, keys: torch.Tensor, deltas: torch.Tensor) -> None:
    """Add ``deltas`` to rows of a shared linear table (duplicates summed); announced to
    every process as a write."""
    from gpu.dist.distmem import DistMemBlock

    if isinstance(block, DistMemBlock):
        block.accumulate(keys, deltas)  # on the device, no host round trip
    else:
        with _nonfinite_as_layer_error():  # NOTE: a quantized block's sums may overflow
            block.accumulate(keys.cpu(), deltas.cpu(), allow_nonfinite=True)


@contextlib.contextmanager
def _nonfinite_as_layer_error() -> Iterator[None]:
    """A block's refusal of rows that are not finite (a quantized block stores finite rows
    only) raised as the layer's own error."""
    try:
        yield
    except HostNonFiniteValuesError as e:
        raise NonFiniteValuesError(str(e)) from None


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


def add_tensor(gate: TableGate, table: torch.Tensor, keys: torch.Tensor,
               deltas: torch.Tensor) -> None:
    """Add ``deltas`` to rows of a layer's own table tensor through its gate, by the one
    add rule of every tier (:mod:`nvecache.common.accumulate`: duplicate keys summed,
    half-precision rows added in float32 and rounded once); on CUDA the rows are in place
    when this returns, as after :func:`write_tensor`."""
    ukeys, sums, _ = sum_duplicates(keys.to(table.device), deltas.to(table.device),
                                    table.dtype)
    with gate.writing():
        table[ukeys] = added(table[ukeys], sums)
        if table.is_cuda:
            torch.cuda.current_stream(table.device).synchronize()


def finite_rows(rows: torch.Tensor) -> torch.Tensor:
    """bool ``[N]``: which rows of ``[N, dim]`` hold no NaN and no infinity."""
    return torch.isfinite(rows).all(dim=1)


def add_occurrences(table: torch.Tensor, keys: torch.Tensor, grad: torch.Tensor,
                    alpha: float, skipped: torch.Tensor) -> None:
    """The torch twin of :func:`gpu.kernels.row_add.add_rows`: ``alpha * grad[i]`` added
    to row ``keys[i]`` of ``table`` in place, in float32; rows of ``grad`` holding NaN or
    an infinity, and keys outside the table, add nothing (the former counted into
    ``skipped``)."""
    ok = finite_rows(grad)
    skipped += (~ok).sum()
    ok &= (keys >= 0) & (keys < table.shape[0])
    delta = torch.where(ok[:, None], grad.float() * alpha, 0).to(table.dtype)
    table.index_add_(0, torch.where(ok, keys, 0), delta)


def add_user(block: Any, user: object) -> None:
    if hasattr(block, "add_user"):  # a DistMemBlock: closing it first is an order error
        block.add_user(user)


def remove_user(block: Any, user: object) -> None:
    if hasattr(block, "remove_user"):
        block.remove_user(user)


class LinearTable:
    """What the stacks over a linear table share: the table (a layer's own tensor, or a
    ``SharedMemBlock`` / ``DistMemBlock`` registered for the device), its read/write gate,
    the range check of its keys, the writes (update, accumulate) and the release.

    A subclass calls :meth:`_open_table` from its ``__init__`` and overrides
    :meth:`_written` to drop what a write made stale (a GPU cache's copies).

    A quantized table (:attr:`fmt` not None: a quantized block, or a GPULayer's own table
    stored quantized) is :attr:`table` as its stored bytes, uint8 ``[num_rows,
    stored_bytes]``; its lookups return rows of the stack's dtype (``dtype``), read
    dequantized by the kernels (the format is one of their constexprs, chosen here once),
    and its writes encode (:mod:`gpu.stacks.quantized`).
    """

    dim: int
    dtype: torch.dtype
    device: torch.device
    #: the table's quantized format (None: a plain table of ``dtype``); a quantized
    #: ``SharedMemBlock``'s is versioned (its rows read under their seqlock versions:
    #: another process may write them while this one reads)
    fmt: RowFormat | None = None
    rows_any_shape = False
    #: check keys on the host whatever ``validate`` says (a table torch's gathers read:
    #: they assert on the device for a bad key)
    _host_checks = False

    def _open_table(self, storage: Any, device: torch.device,
                    fmt: RowFormat | None = None) -> None:
        """Open ``storage``: a block (its format its own), or a tensor of the layer's own
        (``fmt``: the quantized format of its stored bytes, a GPULayer's ``weight_dtype``)."""
        self._block = None if isinstance(storage, torch.Tensor) else storage
        self.fmt = fmt if self._block is None else block_format(storage)
        self._reg = None
        #: the tensor that writes go to and a checkpoint views: the layer's own tensor (a
        #: user's CPU tensor a CUDA layer reads through a registration), None for a block
        self._own: torch.Tensor | None = None
        if self._block is None:
            self._own = storage
            self.table: torch.Tensor = storage
            if storage.device.type == "cpu" and device.type == "cuda":
                self._reg, self.table = user_rows(storage, device)
        else:  # a SharedMemBlock or DistMemBlock: one copy serves every process
            self._reg, self.table = registered_rows(storage, device)
            add_user(storage, self)
        #: the table is host memory read over the host link (a tensor or a DistMemBlock is
        #: device memory)
        self._host = self._reg is not None
        self.num_rows = int(self.table.shape[0])
        #: lookups hold its read side while they read table rows, writes its write side
        self._gate = table_gate(storage, device)
        self.check = RangeCheck(device, self.num_rows)

    @property
    def validate(self) -> bool:
        return self.check.on_host

    @validate.setter
    def validate(self, value: bool) -> None:
        self.check.set_validate(value or self._host_checks)

    def check_pending(self) -> None:
        """Raise an out-of-range key an earlier lookup met on the device."""
        self.check.flag.raise_pending()

    def _written(self, keys: torch.Tensor) -> None:
        """After a write of ``keys`` to the table: drop the copies it made stale."""

    def _checked(self, keys: torch.Tensor) -> None:
        self.check_pending()
        check_range(keys, self.num_rows, name="keys")

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Write rows of the table (a block's write is announced to every process); every
        key in range exists: all True."""
        self._checked(keys)
        if self._block is not None:
            write_linear(self._block, keys, values)
        elif self.fmt is not None:
            write_stored(self._gate, self._own_rows(), self.fmt, keys, values)
        else:
            write_tensor(self._gate, self._own_rows(), keys, values)
        self._written(keys)
        return torch.ones(keys.numel(), dtype=torch.bool, device=keys.device)

    def accumulate(self, keys: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        """Add ``deltas`` to rows of the table, duplicates summed (announced as a write);
        all True. A quantized table adds in float32 (a block: its own accumulate; the
        layer's own table: decoded, added, encoded with stochastic rounding)."""
        self._checked(keys)
        if self._block is not None:
            add_linear(self._block, keys, deltas if self.fmt is None else deltas.float())
        elif self.fmt is not None:
            add_stored(self._gate, self._own_rows(), self.fmt, keys, deltas)
        else:
            add_tensor(self._gate, self._own_rows(), keys, deltas)
        self._written(keys)
        return torch.ones(keys.numel(), dtype=torch.bool, device=keys.device)

    def step_add(self, keys: torch.Tensor, grad: torch.Tensor, alpha: float,
                 skipped: torch.Tensor) -> None:
        """A training step's add: ``alpha * grad[i]`` to row ``keys[i]`` for each of the
        ``N`` occurrences (duplicates added), through :meth:`accumulate` (announced as a
        write); a row of ``grad`` holding NaN or an infinity adds nothing and is counted
        into ``skipped`` (an int64 scalar on the device: no host sync)."""
        ok = finite_rows(grad)
        skipped += (~ok).sum()
        delta = torch.where(ok[:, None], grad.float() * alpha, 0)
        self.accumulate(keys, delta.to(self.dtype))

    def step_write(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """A training step's new rows of distinct ``keys``, through :meth:`update`."""
        self.update(keys, rows)

    def _own_rows(self) -> torch.Tensor:
        """The layer's own tensor (written in place, under the gate)."""
        assert self._own is not None
        return self._own

    def table_view(self) -> torch.Tensor:
        """The table's rows where they live (see :class:`gpu.stacks.protocol.LinearState`):
        a user's storage tensor is itself; a quantized table's stored bytes."""
        return self.table if self._own is None else self._own

    def table_format(self) -> RowFormat | None:
        """The table's quantized format (None: plain rows of the layer's dtype)."""
        return self.fmt

    def table_block(self) -> Any:
        """The block the table lives in, None for a tensor."""
        return self._block

    def table_label(self) -> str:
        """The table as an error names it."""
        if self._block is None:
            return f"the layer's own table on {self.table_view().device}"
        return f"{type(self._block).__name__} {self._block.name!r}"

    def write_rows(self, start: int, values: torch.Tensor) -> None:
        """Write rows ``start ..`` as :meth:`update` does (announced to every process); a
        ``SharedMemBlock``'s in one copy (:meth:`~hostcache.SharedMemBlock.write_range`)."""
        keys = torch.arange(start, start + values.shape[0])
        if not isinstance(self._block, SharedMemBlock):
            self.update(keys, values)
            return
        self._checked(keys)
        self._block.write_range(start, values.cpu(), allow_nonfinite=True)  # the layer checked
        self._written(keys)

    def rows_changed(self, start: int, stop: int) -> None:
        """Announce rows written in place through :meth:`table_view`: every process's GPU
        cache drops them (a block's feed), this one's at once."""
        keys = torch.arange(start, stop)
        if self.table.is_cuda:
            torch.cuda.synchronize(self.table.device)  # the writes are in place first
        if self._block is not None:
            self._block.invalidate(keys)
        self._written(keys)

    def _release_table(self) -> None:
        """Undo the table's registration and the block's user record."""
        if self._reg is not None:
            self._reg.close()
            self._reg = None
            if self._block is None:  # NOTE: a user's tensor: its view holds the registration
                self.table = self.table.new_empty((0, self.dim))
        self._own = None  # NOTE: a tensor this stack copied to the device is freed
        remove_user(self._block, self)
