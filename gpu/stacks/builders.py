"""How each layer type builds its stack: :data:`BUILDERS` maps a
:class:`~gpu.layer_config.LayerType` to one builder function, which checks the arguments
that type takes and returns its :class:`~gpu.stacks.protocol.LayerStack`.

A new layer type is one builder here (and its stack module); :func:`build_stack` does the
checks every type shares and picks the builder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gpu.dist.distmem import DistMemBlock
from gpu.errors import BadArgumentError
from gpu.layer_config import InsertPolicy, LayerSpec, LayerType, TableRef
from gpu.stacks.gpu_layer import DeviceTable, HostTable
from gpu.stacks.hierarchical import HierarchicalStack
from gpu.stacks.linear_tables import table_gate, write_linear, write_tensor
from gpu.stacks.linear_uvm import LinearStack
from gpu.stacks.protocol import LayerStack
from gpu.stacks.quantized import block_format, no_weight_format, own_table
from gpu.tier_config import DEFAULT, TierConfig
from hostcache import HostCache, SharedMemBlock
from nvecache.common.rows import RowFormat
from psclient import ParameterServer, connect

#: the linear tables a GPULayer or LinearUVM layer may be built over
LINEAR_BLOCKS = (SharedMemBlock, DistMemBlock)


@dataclass
class StackSpec:
    """A layer's arguments, as its builder gets them."""

    num_rows: int
    dim: int
    dtype: torch.dtype
    device: torch.device
    gpu_cache_size: int
    host_cache: Any
    storage: Any
    weight_init: Any
    table: str | None
    default_row: Any
    policy: InsertPolicy
    config: TierConfig
    #: tables the builder opened itself (by name or URL): the layer closes them
    owned: list[Any] = field(default_factory=list)
    #: the tables the stack reads, by identity, nearest first (set by the builder)
    tables: list[TableRef] = field(default_factory=list)
    #: the checked default row (Hierarchical), set by the builder
    default: torch.Tensor | None = None
    #: the quantized format of a GPULayer's own table (``weight_dtype=``), or None
    weight_format: RowFormat | None = None


def check_geometry(what: str, dim: int, dtype: torch.dtype, want_dim: int,
                   want_dtype: torch.dtype, rows: int | None = None,
                   want_rows: int | None = None) -> None:
    """A BadArgumentError naming ``what`` unless its geometry is the layer's."""
    if dim != want_dim or dtype != want_dtype or (rows is not None and rows != want_rows):
        got = f"dim={dim}, dtype={dtype}" + (f", rows={rows}" if rows is not None else "")
        want = f"dim={want_dim}, dtype={want_dtype}" + (
            f", rows={want_rows}" if rows is not None else "")
        raise BadArgumentError(f"{what} has {got}; the layer has {want}")


def tensor_geometry(what: str, t: object, dim: int, dtype: torch.dtype,
                    rows: int) -> torch.Tensor:
    """``t`` as a ``[rows, dim]`` tensor of ``dtype``, or a BadArgumentError naming ``what``."""
    if not isinstance(t, torch.Tensor):
        raise BadArgumentError(f"{what} must be a [{rows}, {dim}] tensor; got "
                               f"{type(t).__name__}")
    two_d = t.dim() == 2
    check_geometry(what, t.shape[-1] if two_d else -1, t.dtype, dim, dtype,
                   t.shape[0] if two_d else -1, rows)
    return t


def _write_init(storage: Any, init: torch.Tensor | None) -> None:
    """Write ``weight_init`` into the layer's table (a shared block's write is announced
    to every process's caches, as any write through the block)."""
    if init is None:
        return
    if isinstance(storage, torch.Tensor):  # through its gate, as any write to it
        write_tensor(table_gate(storage, storage.device), storage,
                     torch.arange(init.shape[0]), init.detach())
    else:
        write_linear(storage, torch.arange(init.shape[0]), init.detach())


def _init(spec: StackSpec) -> torch.Tensor | None:
    """``weight_init`` checked to ``[num_rows, dim]`` of the layer's dtype (or None)."""
    if spec.weight_init is None:
        return None
    return tensor_geometry("weight_init", spec.weight_init, spec.dim, spec.dtype,
                           spec.num_rows)


def _linear_block(spec: StackSpec) -> bool:
    """Whether ``spec.storage`` is a shared linear table of the layer's geometry; records
    the table the stack reads (``spec.tables``)."""
    storage = spec.storage
    if not isinstance(storage, LINEAR_BLOCKS):
        spec.tables[:] = [TableRef("own")]
        return False
    fmt = block_format(storage)
    if fmt is not None and (storage.dim, storage.num_rows) != (spec.dim, spec.num_rows):
        raise BadArgumentError(
            f"storage (quantized, {fmt.dtype}) has dim={storage.dim}, rows={storage.num_rows}"
            f"; the layer has dim={spec.dim}, rows={spec.num_rows} (a quantized table is read "
            "in any layer dtype: its dim and rows must be the layer's)")
    # NOTE: a quantized block is read dequantized in the layer's dtype, whatever it is
    check_geometry("storage", storage.dim, spec.dtype if fmt is not None else storage.dtype,
                   spec.dim, spec.dtype, storage.num_rows, spec.num_rows)
    spec.tables[:] = [TableRef("memblock" if isinstance(storage, SharedMemBlock) else "distmem",
                               storage.name)]
    return True


def build_gpu_layer(spec: StackSpec) -> DeviceTable:
    """GPULayer: the table itself (a tensor on the device, or a shared block)."""
    if spec.gpu_cache_size:
        raise BadArgumentError("gpu_cache_size must be 0 for LayerType.GPULayer (the whole "
                               "table is GPU-accessible; it has no cache)")
    storage, device, fmt = spec.storage, spec.device, spec.weight_format
    if fmt is not None:
        if storage is not None:
            raise BadArgumentError(
                "weight_dtype is the format of a GPULayer's own table; with storage= the "
                "storage's format is used (a quantized one: SharedMemBlock.create(..., "
                "dtype=torch.int8)): drop weight_dtype")
        spec.tables[:] = [TableRef("own")]
        # NOTE: weight_init: float rows of the layer's dtype (quantized here), or the table's
        # stored bytes (uint8, an export's or a state_dict's: stored as they are)
        init = spec.weight_init
        if not (isinstance(init, torch.Tensor) and init.dtype == torch.uint8):
            init = _init(spec)
        table = own_table(spec.num_rows, fmt, device, init)
        return DeviceTable(table, spec.dim, spec.dtype, device, spec.config, fmt)
    init = _init(spec)
    if _linear_block(spec):
        _write_init(storage, init)
        return DeviceTable(storage, spec.dim, spec.dtype, device, spec.config)
    if storage is None:
        weights = (torch.empty(spec.num_rows, spec.dim, dtype=spec.dtype,
                               device=device).normal_()
                   if init is None else init.detach().to(device).clone())
    elif isinstance(storage, torch.Tensor):
        weights = tensor_geometry("storage", storage, spec.dim, spec.dtype, spec.num_rows)
        if weights.device != device:
            raise BadArgumentError(f"storage tensor is on {weights.device}; a GPULayer on "
                                   f"{device} reads it in place: move it there (or read a "
                                   "CPU tensor in place with LayerType.HostLayer)")
        _write_init(weights, init)
    else:
        raise BadArgumentError("storage of a GPULayer must be a tensor, a SharedMemBlock "
                               "or a DistMemBlock")
    return DeviceTable(weights, spec.dim, spec.dtype, device, spec.config)


def _host_tensor(spec: StackSpec, what: str) -> torch.Tensor:
    """``spec.storage``, a CPU tensor of the layer's geometry that the layer reads in place
    (on CUDA through a registration: its rows must be contiguous), or a BadArgumentError
    saying what to pass."""
    t = tensor_geometry("storage", spec.storage, spec.dim, spec.dtype, spec.num_rows)
    if t.device.type != "cpu":
        raise BadArgumentError(f"storage tensor of {what} is on {t.device}: pass a CPU "
                               "tensor (pinned or pageable; a GPU table is a GPULayer's)")
    if spec.device.type == "cuda" and not t.is_contiguous():
        raise BadArgumentError(f"storage tensor of {what} is not contiguous: CUDA reads it in "
                               "place, row after row; pass storage.contiguous() (a copy) "
                               "or a hostcache.SharedMemBlock")
    return t


def build_linear_uvm(spec: StackSpec) -> LinearStack:
    """LinearUVM: a GPU cache in front of a linear table: a shared block, or a user's CPU
    tensor (read in place, on CUDA registered with CUDA in this process)."""
    storage, init = spec.storage, _init(spec)
    if not _linear_block(spec):
        if not isinstance(storage, torch.Tensor):
            raise BadArgumentError(
                "storage of a LinearUVM layer must be a hostcache.SharedMemBlock, a "
                "gpu.DistMemBlock or a [num_embeddings, dim] CPU tensor of the layer's "
                "dtype (read in place); a weight_init is written into it"
            )
        _host_tensor(spec, "a LinearUVM layer")
    _write_init(storage, init)
    return LinearStack(storage, spec.dim, spec.dtype, spec.device, spec.gpu_cache_size,
                       spec.policy, spec.config)


def build_host_layer(spec: StackSpec) -> HostTable:
    """HostLayer: the GPULayer's stack over host memory, no GPU cache: a user's CPU tensor
    (read in place; on CUDA registered with CUDA in this process), a SharedMemBlock, or
    without ``storage`` a CPU table of its own (``weight_init``'s rows, or random)."""
    if spec.gpu_cache_size:
        raise BadArgumentError("gpu_cache_size must be 0 for LayerType.HostLayer (it reads "
                               "host memory without a GPU cache; LinearUVM has one)")
    storage, init = spec.storage, _init(spec)
    if isinstance(storage, DistMemBlock):
        raise BadArgumentError("a DistMemBlock is GPU memory: read it with "
                               "LayerType.GPULayer (a HostLayer reads host memory)")
    if _linear_block(spec):
        _write_init(storage, init)
        return HostTable(storage, spec.dim, spec.dtype, spec.device, spec.config)
    if storage is None:
        pin = spec.device.type == "cuda"
        storage = torch.empty(spec.num_rows, spec.dim, dtype=spec.dtype, pin_memory=pin)
        if init is None:
            storage.normal_()
    elif not isinstance(storage, torch.Tensor):
        raise BadArgumentError("storage of a HostLayer must be a [num_embeddings, dim] CPU "
                               "tensor of the layer's dtype or a hostcache.SharedMemBlock")
    else:
        _host_tensor(spec, "a HostLayer")
    _write_init(storage, init)
    return HostTable(storage, spec.dim, spec.dtype, spec.device, spec.config)


def _default_row(spec: StackSpec) -> torch.Tensor | None:
    if spec.default_row is None:
        return None
    default = torch.as_tensor(spec.default_row, dtype=spec.dtype)
    if default.dim() == 0:
        default = default.expand(spec.dim)
    if tuple(default.shape) != (spec.dim,):
        raise BadArgumentError(f"default_row must be a scalar or a [{spec.dim}] row; got "
                               f"shape {tuple(default.shape)}")
    return default.to(spec.device)


def build_hierarchical(spec: StackSpec) -> HierarchicalStack:
    """Hierarchical: GPU cache -> shared host cache -> parameter server (either of the
    last two may be missing, not both)."""
    if spec.weight_init is not None:
        raise BadArgumentError("weight_init is not used by LayerType.Hierarchical: load the "
                               "rows into the parameter server (ps.load) instead")
    host_cache, storage = spec.host_cache, spec.storage
    if isinstance(host_cache, str):
        host_cache = HostCache.attach(host_cache)
        spec.owned.append(host_cache)
    if host_cache is not None:
        if not isinstance(host_cache, HostCache):
            raise BadArgumentError("host_cache must be a hostcache.HostCache or its name")
        g = host_cache.geometry
        # NOTE: a quantized cache's rows are read dequantized in the layer's dtype (the CPU
        # lookup and the GPU read kernel alike): any layer dtype reads it
        check_geometry(f"host cache {host_cache.name!r}", g.dim,
                       spec.dtype if host_cache.quantized else g.dtype, spec.dim, spec.dtype)
    if isinstance(storage, str):
        name = spec.table or (host_cache.name if host_cache is not None else None)
        if name is None:
            raise BadArgumentError("pass table= (the parameter server's table name) with a "
                                   "storage URL")
        storage = connect(storage, table=name, dim=spec.dim, dtype=spec.dtype)
        spec.owned.append(storage)
    if storage is not None:
        if not isinstance(storage, ParameterServer):
            raise BadArgumentError("storage of a Hierarchical layer must be a "
                                   "psclient.ParameterServer or a URL")
        # NOTE: a quantized table's lookups return float32 rows, which the miss resolver
        # converts to the layer's dtype: any layer dtype reads it
        check_geometry(f"parameter server table {storage.table!r}", storage.dim,
                       spec.dtype if storage.quantized else storage.dtype, spec.dim,
                       spec.dtype)
    if host_cache is None and storage is None:
        raise BadArgumentError("a Hierarchical layer needs a host_cache, a storage, or both")
    spec.default = _default_row(spec)
    spec.tables[:] = ([TableRef("hostcache", host_cache.name)] if host_cache is not None
                      else []) + ([TableRef("ps", storage.table, storage.url)]
                                  if storage is not None else [])
    return HierarchicalStack(host_cache, storage, spec.dim, spec.dtype, spec.device,
                             spec.gpu_cache_size, spec.policy, spec.default, spec.config)


#: one builder per layer type
BUILDERS: dict[LayerType, Callable[[StackSpec], LayerStack]] = {
    LayerType.GPULayer: build_gpu_layer,
    LayerType.LinearUVM: build_linear_uvm,
    LayerType.Hierarchical: build_hierarchical,
    LayerType.HostLayer: build_host_layer,
}


def build_stack(layer_type: LayerType, num_rows: int, dim: int, dtype: torch.dtype,
                device: torch.device, **kwargs: Any) -> LayerStack:
    """The stack of a layer of ``layer_type`` (the keyword arguments of
    :func:`build_layer`, whose stack it returns)."""
    return build_layer(layer_type, num_rows, dim, dtype, device, **kwargs)[0]


def build_layer(layer_type: LayerType, num_rows: int, dim: int, dtype: torch.dtype,
                device: torch.device, *, gpu_cache_size: int, host_cache: Any, storage: Any,
                weight_init: Any, table: str | None, default_row: Any,
                insert_policy: InsertPolicy | None, tuning: TierConfig | None,
                owned: list[Any], weight_format: RowFormat | None = None
                ) -> tuple[LayerStack, LayerSpec]:
    """The stack of a layer of ``layer_type``, and the record of how it was built (its
    arguments as resolved, its tables by identity); the tables it opens itself (a host
    cache attached by name, a parameter server connected from a URL) are appended to
    ``owned``: the layer closes them, also when this raises. ``weight_format``: the
    quantized format a GPULayer's own table is stored in (``weight_dtype=``, checked by
    :func:`gpu.stacks.quantized.weight_format`), None for rows of ``dtype``.

    Raises:
        BadArgumentError: an argument the layer type does not take, or of the wrong kind
            or geometry.
    """
    builder = BUILDERS.get(layer_type) if isinstance(layer_type, LayerType) else None
    if builder is None:
        raise BadArgumentError(f"layer_type must be a gpu.LayerType; got {layer_type!r}")
    policy = insert_policy if insert_policy is not None else InsertPolicy()
    if not isinstance(policy, InsertPolicy):
        raise BadArgumentError("insert_policy must be a gpu.InsertPolicy")
    config = DEFAULT if tuning is None else tuning
    if not isinstance(config, TierConfig):
        raise BadArgumentError("tuning must be a gpu.TierConfig")
    if layer_type is not LayerType.Hierarchical and host_cache is not None:
        raise BadArgumentError(f"host_cache is only used by LayerType.Hierarchical, not "
                               f"{layer_type.name}")
    if layer_type is not LayerType.Hierarchical and default_row is not None:
        raise BadArgumentError("default_row is only used by LayerType.Hierarchical (a linear "
                               "table has every row)")
    if weight_format is not None and layer_type is not LayerType.GPULayer:
        raise no_weight_format(layer_type.name)
    spec = StackSpec(num_rows, dim, dtype, device, gpu_cache_size, host_cache, storage,
                     weight_init, table, default_row, policy, config, owned,
                     weight_format=weight_format)
    stack = builder(spec)
    default = (None if spec.default is None
               else tuple(float(x) for x in spec.default.detach().cpu().float().tolist()))
    return stack, LayerSpec(layer_type, num_rows, dim, dtype, device, gpu_cache_size, policy,
                            config, default, tuple(spec.tables),
                            None if weight_format is None else weight_format.torch_dtype)
