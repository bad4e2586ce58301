"""The one interface every layer stack implements, and the names of its tiers.

A layer (:mod:`gpu.layers`) checks its arguments (keys, rows, a tier name) and calls
its stack through this protocol only; a stack gets keys already checked. Stacks:
:class:`gpu.stacks.gpu_layer.DeviceTable` (GPULayer), :class:`gpu.stacks.linear_uvm.LinearStack`
(LinearUVM), :class:`gpu.stacks.hierarchical.HierarchicalStack` (Hierarchical) and
:class:`gpu.stacks.closed.ClosedStack` (a closed layer's stand-in: every call raises).

Tiers, nearest first:

- ``"gpu"``: the GPU cache (a GPULayer: its table, wherever its memory is);
- ``"host"``: the shared host cache (Hierarchical);
- ``"storage"``: the parameter server (Hierarchical) or the linear table (LinearUVM).

Per-tier writes: ``insert(tier=t)`` writes tier ``t`` only, ``erase(tier=t)`` drops
from tier ``t`` only (a linear table has every row: erasing from one raises
:class:`~gpu.errors.BadArgumentError`); ``tier=None`` is every tier. A write to a
shared tier (host, storage) is announced to other processes as any write to it is.
``accumulate`` adds to the rows each tier holds; keys the authoritative tier lacks are
not written and read False.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol, get_args, runtime_checkable

from gpu.errors import BadArgumentError

if TYPE_CHECKING:
    import torch

    from gpu.layer_config import LayerStats, PoolingMode
    from nvecache.common.rows import RowFormat

#: A tier a per-tier write names.
Tier = Literal["gpu", "host", "storage"]

#: Every tier name, nearest first.
TIERS: tuple[Tier, ...] = get_args(Tier)


@runtime_checkable
class LayerStack(Protocol):
    """What a layer calls on its stack. Keys are 1-D int64 (checked by the layer); rows
    and deltas ``[N, dim]`` of the stack's dtype, already checked for finiteness."""

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The tiers this stack has, nearest first."""
        ...

    #: check keys (and offsets) on the host before each lookup (one sync each)
    validate: bool

    #: :meth:`rows` also takes contiguous keys of any shape, returning ``[*shape, dim]``
    #: (the layer then passes them as they come, with no reshape on either side)
    rows_any_shape: bool

    def rows(self, keys: torch.Tensor) -> torch.Tensor:
        """``[N, dim]`` rows of ``keys`` (see :attr:`rows_any_shape`)."""
        ...

    def pooled(self, keys: torch.Tensor, offsets: torch.Tensor,
               weights: torch.Tensor | None, mode: PoolingMode) -> torch.Tensor:
        """One pooled row per bag; ``offsets`` are ``[B + 1]`` bounds."""
        ...

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Overwrite rows that exist; bool ``[N]``: which were written."""
        ...

    def insert(self, keys: torch.Tensor, values: torch.Tensor,
               tier: Tier | None = None) -> None:
        """Write rows into ``tier`` (None: every tier), creating those missing."""
        ...

    def erase(self, keys: torch.Tensor, tier: Tier | None = None) -> None:
        """Drop keys from ``tier`` (None: what the layer type drops by default)."""
        ...

    def accumulate(self, keys: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        """Add ``deltas`` to existing rows, duplicates summed; bool ``[N]``: which keys
        existed in the authoritative tier and were added to."""
        ...

    def in_cache(self, keys: torch.Tensor) -> torch.Tensor:
        """bool ``[N]``: which keys the GPU cache holds now (not counted as a lookup)."""
        ...

    def clear(self) -> None:
        """Drop every cached row of this stack's caches."""
        ...

    def flush(self) -> None:
        """Finish the work earlier lookups left behind."""
        ...

    def stats(self) -> LayerStats:
        """Per-tier counters."""
        ...

    def check_pending(self) -> None:
        """Raise an out-of-range key a queued lookup met (or do nothing)."""
        ...

    def close(self) -> None:
        """Release what the stack holds."""
        ...


@runtime_checkable
class LinearState(Protocol):
    """What a stack over one linear table (GPULayer, LinearUVM) hands out for checkpoints
    (:mod:`gpu.state`): the table's rows as a tensor, with no copy, and the writes a load
    goes through."""

    def table_view(self) -> torch.Tensor:
        """The table's ``[num_rows, dim]`` rows where they live (the layer's own tensor, a
        ``SharedMemBlock``'s or ``DistMemBlock``'s rows): a view, no copy (a quantized
        table's: its stored bytes)."""
        ...

    def table_label(self) -> str:
        """The table as an error names it (its kind and name)."""
        ...

    def table_format(self) -> RowFormat | None:
        """The table's quantized format (:data:`nvecache.common.rows.QUANTIZED`; its
        :meth:`table_view` is then its stored bytes, uint8 ``[num_rows, stored_bytes]``),
        None for plain rows of the layer's dtype."""
        ...

    def table_block(self) -> object | None:
        """The block the table lives in (a ``SharedMemBlock``, a ``DistMemBlock``), None
        for a tensor (the layer's own, a user's)."""
        ...

    def write_rows(self, start: int, values: torch.Tensor) -> None:
        """Write rows ``start .. start + len(values)`` through the layer's write path (every
        process's GPU cache drops them)."""
        ...

    def rows_changed(self, start: int, stop: int) -> None:
        """Rows ``start .. stop`` were written through :meth:`table_view` (in place, e.g. by
        ``torch.distributed.checkpoint.load``): announce them as a write would."""
        ...


@runtime_checkable
class NamedState(Protocol):
    """What a Hierarchical stack hands out for checkpoints: the names of its tables (its
    rows stay where they are), and the write a load of rows goes through."""

    def table_names(self) -> dict[str, object]:
        """The tables the stack reads, by name: ``host_cache``, ``url``, ``table`` (each
        present when the stack has that tier), ``dim``, ``dtype``."""
        ...

    def table_label(self) -> str:
        """The tables as an error names them."""
        ...

    def write_rows(self, start: int, values: torch.Tensor) -> None:
        """Insert rows of keys ``start .. start + len(values)`` into every tier."""
        ...


def check_tier(tier: object, tiers: tuple[Tier, ...]) -> Tier | None:
    """``tier`` if it is None or one of ``tiers``, else a BadArgumentError naming them.

    Raises:
        BadArgumentError: ``tier`` is not a str naming one of ``tiers``.
    """
    if tier is None or (isinstance(tier, str) and tier in tiers):
        return tier
    names = ", ".join(repr(t) for t in tiers)
    raise BadArgumentError(f"tier must be None (every tier) or one of this layer's tiers "
                           f"({names}); got {tier!r}")


def linear_erase_error(what: str) -> BadArgumentError:
    """The error of an erase from a linear table (it has every row)."""
    return BadArgumentError(f"cannot erase from {what}: a linear table has every row "
                            "(overwrite rows with insert or update instead)")
