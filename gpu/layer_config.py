"""Closed choices and counters of the embedding layers."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from gpu.errors import BadArgumentError
from hostcache.table import HitRate
from nvecache.common import rows

if TYPE_CHECKING:
    import torch

    from gpu.tier_config import TierConfig

PoolingMode = Literal["sum", "mean", "max"]

#: the dtypes a layer's ``data_type`` may be, by stored name (``nvecache.common.rows``)
DATA_TYPES: tuple[str, ...] = rows.LAYER_DTYPES


class LayerType(enum.Enum):
    """Where a layer's table lives (the seed's layer types)."""

    #: the whole table in GPU-accessible memory (device memory, or a registered
    #: ``SharedMemBlock`` that one copy of a small table serves every process with); no cache.
    GPULayer = "gpu"
    #: a linear host table (``SharedMemBlock``) with a GPU cache in front; misses are read
    #: zero-copy from the host table in the same kernel launch.
    LinearUVM = "linear_uvm"
    #: GPU cache -> shared ``HostCache`` -> parameter server.
    Hierarchical = "hierarchical"
    #: a host-only table read without a GPU cache (the seed library's name): a CPU tensor
    #: (a user's, registered in place with CUDA, no copy) or a ``SharedMemBlock``, read
    #: zero-copy by the GPULayer's kernels; its one tier is ``"storage"``.
    HostLayer = "host"


@dataclass(frozen=True)
class InsertPolicy:
    """Which misses a Hierarchical layer copies into its caches.

    Each field is the probability that a missed key is admitted to that tier: 1.0 admits
    every miss (the default), 0.0 none; values between admit a random fraction, which
    keeps one-off keys of a long tail from displacing hot rows.
    """

    #: admission probability of rows fetched from the parameter server into the host cache.
    host: float = 1.0
    #: admission probability of rows fetched from lower tiers into this layer's GPU cache.
    gpu: float = 1.0

    def __post_init__(self) -> None:
        for field in ("host", "gpu"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                0.0 <= float(value) <= 1.0
            ):
                raise BadArgumentError(
                    f"InsertPolicy.{field} must be a probability in [0, 1]; got {value!r}"
                )


#: where a table a layer reads lives: ``"own"`` (the layer's private table),
#: ``"memblock"`` (a ``hostcache.SharedMemBlock``), ``"distmem"`` (a ``gpu.DistMemBlock``),
#: ``"hostcache"`` (a shared ``hostcache.HostCache``), ``"ps"`` (a parameter-server table)
TableKind = Literal["own", "memblock", "distmem", "hostcache", "ps"]


@dataclass(frozen=True)
class TableRef:
    """One table a layer reads, by identity (no rows)."""

    kind: TableKind
    #: the table's name: the block's or host cache's segment name, the parameter server's
    #: table; ``""`` for the layer's own table
    name: str = ""
    #: a parameter server's URL without a password (``ParameterServer.url``), else None
    url: str | None = None


@dataclass(frozen=True)
class LayerSpec:
    """How a layer was built: its construction arguments as it resolved them (``layer.spec``).

    A host cache given by name and a parameter server given by URL appear as the tables
    they opened; ``insert_policy`` and ``tuning`` are the defaults where none was passed.
    """

    layer_type: LayerType
    num_embeddings: int
    embedding_size: int
    data_type: torch.dtype
    device: torch.device
    #: bytes of the GPU cache asked for (0: none)
    gpu_cache_size: int
    insert_policy: InsertPolicy
    tuning: TierConfig
    #: a Hierarchical layer's row for keys in no tier (``embedding_size`` floats), or None
    default_row: tuple[float, ...] | None
    #: the tables the layer reads, nearest first
    tables: tuple[TableRef, ...]
    #: the quantized format a GPULayer's own table is stored in (``weight_dtype=``:
    #: ``torch.int8``, ``torch.float8_e4m3fn``), None where it stores ``data_type`` (or
    #: has no table of its own: a block's format is the block's)
    weight_dtype: torch.dtype | None = None

    def table(self, kind: TableKind) -> TableRef | None:
        """The layer's table of ``kind``, or None when it has none."""
        return next((t for t in self.tables if t.kind == kind), None)


@dataclass(frozen=True)
class TierStats(HitRate):
    """What one tier of one layer answered, in this process."""

    hits: int = 0
    misses: int = 0
    inserts: int = 0
    evictions: int = 0


@dataclass(frozen=True)
class LayerStats:
    """Per-tier counters of a layer in this process, plus node-wide shared-table counters."""

    layer_type: str
    #: the GPU cache (for a GPULayer: its table lookups, every key a hit).
    gpu: TierStats
    #: the shared host tier as seen by this layer (None when the layer has none).
    host: TierStats | None
    #: the parameter server: hits = rows found, misses = keys it did not have.
    storage: TierStats | None
    #: keys answered with the configured default row.
    default_rows: int
    #: node-wide counters of the shared host table (every process), if any.
    host_node: Any | None = None
    #: the invalidations this layer applied to its GPU cache (keys dropped, full clears).
    invalidated_keys: int = 0
    full_invalidations: int = 0

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-ready), each tier with its hit rate."""
        out = asdict(self)
        for tier in ("gpu", "host", "storage"):
            stats = getattr(self, tier)
            if stats is not None:
                out[tier]["hit_rate"] = stats.hit_rate
        if self.host_node is not None:
            out["host_node"] = self.host_node.as_dict()
        return out
