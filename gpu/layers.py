"""The torch layers users put in serving code: ``NVEmbedding`` and ``NVEmbeddingBag``.

Forward semantics are torch's (``F.embedding`` / ``F.embedding_bag``); where the rows
come from is the :class:`~gpu.layer_config.LayerType`'s business: one stack per type,
``gpu.stacks.gpu_layer``, ``gpu.stacks.linear_uvm``, ``gpu.stacks.hierarchical``.
Inference only: outputs carry no autograd history. ``close()`` (or leaving a ``with``
block) releases a layer's tables at once; a closed layer raises ``LayerClosedError``.

Writes per layer type:

=============  ==========================================  ===============================
layer type     ``update`` / ``insert``                     ``erase`` / ``clear``
=============  ==========================================  ===============================
GPULayer       write the table (a SharedMemBlock write is  nothing to drop: a linear
               announced to every process)                 table keeps its rows
LinearUVM      write the linear table, announced; every    drop keys / everything from
               process's GPU cache drops the keys          this layer's GPU cache
Hierarchical   parameter server first, then the shared     erase: PS, host cache, GPU
               host cache (announced to every process),    cache; clear: both caches (the
               then this GPU cache                         PS keeps its rows)
=============  ==========================================  ===============================
"""

from __future__ import annotations

import logging
from typing import Any, Self

import torch

from gpu import ops
from gpu.cuda.devices import resolve_device
from gpu.dist.distmem import DistMemBlock
from gpu.errors import BadArgumentError
from gpu.inputs import bags, check_keys, check_values
from gpu.layer_config import InsertPolicy, LayerStats, LayerType, PoolingMode
from gpu.stacks.closed import ClosedStack
from gpu.stacks.gpu_layer import DeviceTable
from gpu.stacks.hierarchical import HierarchicalStack
from gpu.stacks.linear_tables import table_gate, write_linear, write_tensor
from gpu.stacks.linear_uvm import LinearStack
from gpu.tier_config import DEFAULT, TierConfig
from hostcache import HostCache, SharedMemBlock
from nvecache.common.keys import RESERVED_KEY, RESERVED_KEY_RULE
from psclient import ParameterServer, connect

logger = logging.getLogger(__name__)

TABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _positive(name: str, value: object, *, zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero else 1):
        bound = ">= 0" if zero else "> 0"
        raise BadArgumentError(f"{name} must be an int {bound}; got {value!r}")
    return value


def _check_geometry(what: str, dim: int, dtype: torch.dtype, want_dim: int,
                    want_dtype: torch.dtype, rows: int | None = None,
                    want_rows: int | None = None) -> None:
    if dim != want_dim or dtype != want_dtype or (rows is not None and rows != want_rows):
        got = f"dim={dim}, dtype={dtype}" + (f", rows={rows}" if rows is not None else "")
        want = f"dim={want_dim}, dtype={want_dtype}" + (
            f", rows={want_rows}" if rows is not None else "")
        raise BadArgumentError(f"{what} has {got}; the layer has {want}")


def _tensor_geometry(what: str, t: object, dim: int, dtype: torch.dtype,
                     rows: int) -> torch.Tensor:
    """``t`` as a ``[rows, dim]`` tensor of ``dtype``, or a BadArgumentError naming ``what``."""
    if not isinstance(t, torch.Tensor):
        raise BadArgumentError(f"{what} must be a [{rows}, {dim}] tensor; got "
                               f"{type(t).__name__}")
    two_d = t.dim() == 2
    _check_geometry(what, t.shape[-1] if two_d else -1, t.dtype, dim, dtype,
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


def _build_tiers(
    num_embeddings: int, dim: int, dtype: torch.dtype, layer_type: LayerType, device: torch.device,
    *, gpu_cache_size: int, host_cache: Any, storage: Any, weight_init: Any, table: str | None,
    default_row: Any, insert_policy: InsertPolicy | None, tuning: TierConfig | None,
    owned: list[Any],
) -> DeviceTable | LinearStack | HierarchicalStack:
    """The layer's tier stack; the tables it opens itself (a host cache attached by name, a
    parameter server connected from a URL) are appended to ``owned``: the layer closes them."""
    linear_blocks = (SharedMemBlock, DistMemBlock)
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
    if layer_type is LayerType.Hierarchical and weight_init is not None:
        raise BadArgumentError("weight_init is not used by LayerType.Hierarchical: load the "
                               "rows into the parameter server (ps.load) instead")
    init = None if weight_init is None else _tensor_geometry(
        "weight_init", weight_init, dim, dtype, num_embeddings)

    if layer_type is LayerType.GPULayer:
        if gpu_cache_size:
            raise BadArgumentError("gpu_cache_size must be 0 for LayerType.GPULayer (the whole "
                                   "table is GPU-accessible; it has no cache)")
        if isinstance(storage, linear_blocks):
            _check_geometry("storage", storage.dim, storage.dtype, dim, dtype,
                            storage.num_rows, num_embeddings)
            _write_init(storage, init)
            return DeviceTable(storage, dim, dtype, device)
        if storage is None:
            weights = (torch.empty(num_embeddings, dim, dtype=dtype, device=device).normal_()
                       if init is None else init.detach().to(device).clone())
        elif isinstance(storage, torch.Tensor):
            weights = _tensor_geometry("storage", storage, dim, dtype, num_embeddings)
            if weights.device != device:
                raise BadArgumentError(f"storage tensor is on {weights.device}; a GPULayer on "
                                       f"{device} reads it in place: move it there")
            _write_init(weights, init)
        else:
            raise BadArgumentError("storage of a GPULayer must be a tensor, a SharedMemBlock "
                                   "or a DistMemBlock")
        return DeviceTable(weights, dim, dtype, device)

    if layer_type is LayerType.LinearUVM:
        if isinstance(storage, linear_blocks):
            _check_geometry("storage", storage.dim, storage.dtype, dim, dtype,
                            storage.num_rows, num_embeddings)
        elif isinstance(storage, torch.Tensor) and device.type == "cpu":
            _tensor_geometry("storage", storage, dim, dtype, num_embeddings)
        else:
            raise BadArgumentError(
                "storage of a LinearUVM layer must be a hostcache.SharedMemBlock, a "
                "gpu.DistMemBlock (or, on the CPU, a [num_embeddings, dim] tensor); a "
                "weight_init is written into it"
            )
        _write_init(storage, init)
        return LinearStack(storage, dim, dtype, device, gpu_cache_size, policy, config)

    if layer_type is not LayerType.Hierarchical:
        raise BadArgumentError(f"layer_type must be a gpu.LayerType; got {layer_type!r}")
    if isinstance(host_cache, str):
        host_cache = HostCache.attach(host_cache)
        owned.append(host_cache)
    if host_cache is not None:
        if not isinstance(host_cache, HostCache):
            raise BadArgumentError("host_cache must be a hostcache.HostCache or its name")
        g = host_cache.geometry
        _check_geometry(f"host cache {host_cache.name!r}", g.dim, g.dtype, dim, dtype)
    if isinstance(storage, str):
        name = table or (host_cache.name if host_cache is not None else None)
        if name is None:
            raise BadArgumentError("pass table= (the parameter server's table name) with a "
                                   "storage URL")
        storage = connect(storage, table=name, dim=dim, dtype=dtype)
        owned.append(storage)
    if storage is not None:
        if not isinstance(storage, ParameterServer):
            raise BadArgumentError("storage of a Hierarchical layer must be a "
                                   "psclient.ParameterServer or a URL")
        _check_geometry(f"parameter server table {storage.table!r}", storage.dim,
                        storage.dtype, dim, dtype)
    if host_cache is None and storage is None:
        raise BadArgumentError("a Hierarchical layer needs a host_cache, a storage, or both")
    default = None
    if default_row is not None:
        default = torch.as_tensor(default_row, dtype=dtype)
        if default.dim() == 0:
            default = default.expand(dim)
        if tuple(default.shape) != (dim,):
            raise BadArgumentError(f"default_row must be a scalar or a [{dim}] row; got shape "
                                   f"{tuple(default.shape)}")
        default = default.to(device)
    return HierarchicalStack(host_cache, storage, dim, dtype, device, gpu_cache_size, policy,
                             default, config)


def _close_all(tables: list[Any]) -> None:
    """Close each table, then raise the first error any close raised."""
    error: BaseException | None = None
    for table in tables:
        try:
            table.close()
        except BaseException as e:  # noqa: BLE001 - the others still close
            error = error or e
    if error is not None:
        raise error


class _NVBase(torch.nn.Module):
    def __init__(
        self, num_embeddings: int, embedding_size: int, data_type: torch.dtype,
        layer_type: LayerType, *, gpu_cache_size: int = 0, host_cache: Any = None,
        storage: Any = None, weight_init: torch.Tensor | None = None,
        optimize_for_training: bool = False, device: object = None,
        default_row: Any = None, insert_policy: InsertPolicy | None = None,
        table: str | None = None, validate: bool = False, tuning: TierConfig | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings = _positive("num_embeddings", num_embeddings)
        self.embedding_size = _positive("embedding_size", embedding_size)
        _positive("gpu_cache_size", gpu_cache_size, zero=True)
        if data_type not in TABLE_DTYPES:
            raise BadArgumentError(f"data_type must be one of {TABLE_DTYPES}; got {data_type!r}")
        if not isinstance(layer_type, LayerType):
            raise BadArgumentError(f"layer_type must be a gpu.LayerType; got {layer_type!r}")
        if optimize_for_training:
            raise BadArgumentError("optimize_for_training=True is not supported: these layers "
                                   "serve inference (pass False)")
        self.data_type = data_type
        self.layer_type = layer_type
        self.device = resolve_device(device)
        #: tables the layer opened itself (by name or URL): close() closes them
        self._owned: list[Any] = []
        try:
            self._tiers: DeviceTable | LinearStack | HierarchicalStack | ClosedStack = (
                _build_tiers(
                    num_embeddings, embedding_size, data_type, layer_type, self.device,
                    gpu_cache_size=gpu_cache_size, host_cache=host_cache, storage=storage,
                    weight_init=weight_init, table=table, default_row=default_row,
                    insert_policy=insert_policy, tuning=tuning, owned=self._owned))
        except BaseException:
            _close_all(self._owned)  # NOTE: a failed build keeps nothing open
            raise
        self.validate = bool(validate)
        self._tiers.validate = self.validate
        self._op = ops.register(self._tiers)

    def synchronize(self) -> None:
        """Wait for this layer's queued lookups, then raise a bad key any of them met.

        With the default ``validate=False`` a lookup on CUDA that meets a key outside a
        linear table reads a zero row for it and reports the key on the device; the error
        is raised by the layer's next call, or here at once.

        Raises:
            BadArgumentError: an earlier lookup held a key outside the table.
        """
        # NOTE: first: a closed layer's stand-in raises LayerClosedError here
        check = getattr(self._tiers, "check", None)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if check is not None:
            check.flag.raise_pending()

    def _write_args(self, keys: object, values: object | None, allow_nonfinite: bool = False
                    ) -> tuple[torch.Tensor, Any]:
        if not isinstance(keys, torch.Tensor) or keys.dtype != torch.int64 or keys.dim() != 1:
            raise BadArgumentError("keys must be a 1-D int64 tensor")
        if values is not None:
            if keys.numel() and int(keys.min()) == RESERVED_KEY:  # NOTE: before any tier
                raise BadArgumentError(RESERVED_KEY_RULE)
            # NOTE: the one finiteness check of a layer's write: its tiers are told the rows
            # were checked (allow_nonfinite=True), so none reads them again
            values = check_values(values, keys.numel(), self.embedding_size, self.data_type,
                                  keys=keys, allow_nonfinite=allow_nonfinite)
        return keys, values

    @torch.no_grad()
    def update(self, keys: torch.Tensor, values: torch.Tensor, *,
               allow_nonfinite: bool = False) -> torch.Tensor:
        """Overwrite the rows of keys that exist; returns bool ``[N]``: which were written.

        A key the table does not hold (for a Hierarchical layer: not in the parameter
        server, or, without one, not in the host cache) is not written and reads False:
        :meth:`insert` creates rows. Linear tables hold every row in range: all True.
        After it returns, no lookup in any process of the node returns the old rows.

        Raises:
            NonFiniteValuesError: a row holds NaN or an infinity and not
                ``allow_nonfinite``; no tier is written (on CUDA the check is one host
                sync).
        """
        keys, values = self._write_args(keys, values, allow_nonfinite)
        return self._tiers.update(keys, values)

    @torch.no_grad()
    def insert(self, keys: torch.Tensor, values: torch.Tensor, *,
               allow_nonfinite: bool = False) -> None:
        """Write rows, creating those that do not exist (for a Hierarchical layer: in the
        parameter server, then the host cache); announced to every process like update.
        Rows holding NaN or an infinity raise ``NonFiniteValuesError`` (no tier written)
        unless ``allow_nonfinite``."""
        keys, values = self._write_args(keys, values, allow_nonfinite)
        self._tiers.insert(keys, values)

    @torch.no_grad()
    def erase(self, keys: torch.Tensor) -> None:
        """Drop keys (see the module docstring for what each layer type drops)."""
        keys, _ = self._write_args(keys, None)
        self._tiers.erase(keys)

    def clear(self) -> None:
        """Drop every cached row of this layer's caches."""
        self._tiers.clear()

    def in_gpu_cache(self, keys: torch.Tensor) -> torch.Tensor:
        """bool ``[N]``: which keys this layer's GPU cache holds now (not counted as a
        lookup; a GPULayer has no cache: all False)."""
        keys, _ = self._write_args(keys, None)
        if isinstance(self._tiers, DeviceTable):  # NOTE: a closed layer's in_cache raises
            return torch.zeros(keys.numel(), dtype=torch.bool, device=keys.device)
        return self._tiers.in_cache(keys).to(keys.device)

    def flush(self) -> None:
        """Finish the work earlier lookups left behind: LinearUVM admits its logged misses
        now; Hierarchical finishes its host-cache fills and hit reports (they run off the
        lookup's path)."""
        self._tiers.flush()

    def stats(self) -> LayerStats:
        """Per-tier counters of this layer (this process), plus node-wide host counters."""
        return self._tiers.stats()

    def close(self) -> None:
        """Release what the layer holds, at once; idempotent.

        Finishes the queued host-cache fills and stops the layer's worker thread, undoes
        its CUDA registrations, frees its GPU cache (a GPULayer built from ``weight_init``:
        its table), forgets its custom-op handle, and closes the tables the layer opened
        itself: a host cache attached by name, a parameter server connected from a URL
        (then no longer counted as attached by this process, e.g. by ``hostcache rm``).
        Tables passed in as objects stay open: they are the caller's to close. Any later
        call raises :class:`~gpu.errors.LayerClosedError`. Close a layer once no other
        thread is inside one of its calls.
        """
        tiers = self._tiers
        if isinstance(tiers, ClosedStack):
            return
        # NOTE: the stand-in first: later calls raise, eager or compiled (gpu.ops)
        self._tiers = ClosedStack(f"{type(self).__name__} ({self.layer_type.name})", tiers)
        self._op = ops.unregister(self._op, self._tiers)
        owned, self._owned = self._owned, []
        try:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # queued lookups may read the tables
            tiers.close()
        finally:
            del tiers  # NOTE: the layer's last reference: the stack and its GPU cache go now
            _close_all(owned)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def extra_repr(self) -> str:
        closed = ", closed" if isinstance(self._tiers, ClosedStack) else ""
        return (f"{self.num_embeddings}, {self.embedding_size}, {self.data_type}, "
                f"{self.layer_type.name}, device={self.device}{closed}")


class NVEmbedding(_NVBase):
    """``torch.nn.Embedding`` semantics over a GPU cache, shared host cache and PS.

    Args:
        num_embeddings: rows of the table (for a Hierarchical layer keys may be any int64).
        embedding_size: elements per row.
        data_type: torch.float32, torch.float16 or torch.bfloat16.
        layer_type: a :class:`LayerType`.
        gpu_cache_size: bytes of this layer's GPU cache (LinearUVM, Hierarchical).
        host_cache: Hierarchical: a shared :class:`hostcache.HostCache` or its name.
        storage: GPULayer: a tensor, SharedMemBlock or DistMemBlock; LinearUVM: a
            SharedMemBlock or DistMemBlock (a table sharded over GPUs);
            Hierarchical: a :class:`psclient.ParameterServer` or a URL.
        weight_init: GPULayer, LinearUVM: initial rows ``[num_embeddings,
            embedding_size]``. Without ``storage`` a GPULayer copies them to the device;
            with one, they are written into it (a shared block's write reaches every
            process's caches).
        optimize_for_training: must be False (inference only).
        device: "cpu" or a CUDA device (default: the current CUDA device, else the CPU).
        default_row: Hierarchical: row (or scalar) for keys in no tier; None raises
            KeyNotFoundError (and StorageUnavailableError while the PS is down).
        insert_policy: Hierarchical/LinearUVM: which misses enter the caches.
        tuning: Hierarchical/LinearUVM: admission tunables (a :class:`TierConfig`).
        table: the parameter server table name when ``storage`` is a URL.
        validate: check keys (linear tables: in range) and offsets on the host before each
            lookup, raising typed errors at once (one device sync each). The default,
            ``False``, costs no sync on CUDA: a key outside a linear table reads as a zero
            row and the kernel reports it, raised as ``BadArgumentError`` by the layer's
            next call or by :meth:`synchronize` (offsets are not checked; the kernels
            clamp bag bounds). The CPU always checks on the host.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - torch's name
        """Rows of ``input`` (int64 keys of any shape): ``[*input.shape, embedding_size]``,
        as ``torch.nn.functional.embedding``."""
        keys = check_keys(input, self.device)
        if torch.compiler.is_compiling():  # one custom op: no graph break (gpu.ops)
            rows = ops.rows(keys.reshape(-1).contiguous(), self._op)
        elif keys.dim() == 1 and keys.is_contiguous():  # NOTE: no reshape or view to pay
            return self._tiers.rows(keys)
        else:
            rows = self._tiers.rows(keys.reshape(-1).contiguous())
        return rows.view(*keys.shape, self.embedding_size)


class NVEmbeddingBag(_NVBase):
    """``torch.nn.EmbeddingBag`` semantics (sum / mean / max) over the same tiers.

    Takes :class:`NVEmbedding`'s arguments plus ``mode`` and ``include_last_offset``.
    """

    def __init__(self, num_embeddings: int, embedding_size: int, data_type: torch.dtype,
                 layer_type: LayerType, *, mode: PoolingMode = "sum",
                 include_last_offset: bool = False, **kwargs: Any) -> None:
        if mode not in ("sum", "mean", "max"):
            raise BadArgumentError(f"mode must be 'sum', 'mean' or 'max'; got {mode!r}")
        super().__init__(num_embeddings, embedding_size, data_type, layer_type, **kwargs)
        self.mode: PoolingMode = mode
        self.include_last_offset = bool(include_last_offset)

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,  # noqa: A002
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled rows, one per bag ``[B, embedding_size]``, as
        ``torch.nn.functional.embedding_bag`` (1-D input with offsets, or 2-D input)."""
        keys, full, weights = bags(input, offsets, per_sample_weights, self.mode,
                                   self.include_last_offset, self.data_type, self.device,
                                   self.validate)
        if torch.compiler.is_compiling():  # one custom op: no graph break (gpu.ops)
            return ops.pooled(keys, full, weights, self._op, self.mode)
        with torch.no_grad():
            return self._tiers.pooled(keys, full, weights, self.mode)
