"""The torch layers users put in serving code: ``NVEmbedding`` and ``NVEmbeddingBag``.

Forward semantics are torch's (``F.embedding`` / ``F.embedding_bag``); where the rows
come from is the :class:`~gpu.layer_config.LayerType`'s business: one stack per type,
``gpu.stacks.gpu_layer``, ``gpu.stacks.linear_uvm``, ``gpu.stacks.hierarchical``.
By default a layer serves inference (outputs carry no autograd history);
``optimize_for_training=True`` makes it trainable (``gpu.train``, ``gpu.optim``).
``close()`` (or leaving a ``with`` block) releases a layer's tables at once; a closed
layer raises ``LayerClosedError``.

Writes per layer type (``tier=None``, the default; ``insert``/``erase`` take ``tier=`` to
write or drop one of the layer's tiers only, ``layer.tiers``):

=============  ==========================================  ===============================
layer type     ``update`` / ``insert`` / ``accumulate``    ``erase`` / ``clear``
=============  ==========================================  ===============================
GPULayer       write the table (a SharedMemBlock write is  nothing to drop: a linear
               announced to every process)                 table keeps its rows
LinearUVM      write the linear table, announced; every    drop keys / everything from
               process's GPU cache drops the keys          this layer's GPU cache
Hierarchical   parameter server first, then the shared     erase: PS, host cache, GPU
               host cache (announced to every process),    cache; clear: both caches (the
               then this GPU cache                         PS keeps its rows)
=============  ==========================================  ===============================

The stack of each type is built by :data:`gpu.stacks.builders.BUILDERS` and called
through :class:`gpu.stacks.protocol.LayerStack` only.
"""

from __future__ import annotations

from typing import Any, Self

import torch

from gpu import ops, state, traced_lookup
from gpu.cuda.devices import resolve_device
from gpu.errors import BadArgumentError
from gpu.inputs import bags, check_dtype, check_keys, check_values, positive_int
from gpu.layer_config import InsertPolicy, LayerSpec, LayerStats, LayerType, PoolingMode
from gpu.optim.rules import Optimizer
from gpu.stacks.builders import build_layer
from gpu.stacks.closed import ClosedStack, close_all
from gpu.stacks.protocol import LayerStack, LinearState, Tier, check_tier
from gpu.stacks.quantized import weight_format
from gpu.tier_config import TierConfig
from gpu.train import quantized, wide
from gpu.train.autograd import Lookup
from gpu.train.step import Trainer
from gpu.train.weight import TableWeight
from nvecache.common.keys import RESERVED_KEY, RESERVED_KEY_RULE
from psclient.errors import SchemaMismatchError


class _NVBase(torch.nn.Module):
    #: the layer's id buffer (gpu.ops): registered in __init__
    nvecache_id: torch.Tensor

    def __init__(
        self, num_embeddings: int, embedding_size: int, data_type: torch.dtype,
        layer_type: LayerType, *, gpu_cache_size: int = 0, host_cache: Any = None,
        storage: Any = None, weight_init: torch.Tensor | None = None,
        optimize_for_training: bool = False, device: object = None,
        default_row: Any = None, insert_policy: InsertPolicy | None = None,
        table: str | None = None, validate: bool = False, tuning: TierConfig | None = None,
        optimizer: Optimizer | None = None, weight_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings = positive_int("num_embeddings", num_embeddings)
        self.embedding_size = positive_int("embedding_size", embedding_size)
        positive_int("gpu_cache_size", gpu_cache_size, zero=True)
        data_type = check_dtype(data_type)
        own_fmt = weight_format(weight_dtype, data_type, embedding_size)
        if not isinstance(layer_type, LayerType):
            raise BadArgumentError(f"layer_type must be a gpu.LayerType; got {layer_type!r}")
        if optimizer is not None and not isinstance(optimizer, Optimizer):
            raise BadArgumentError(
                f"optimizer must be one of gpu.optim's (SGD, Adagrad, RowwiseAdagrad, Adam); "
                f"got {type(optimizer).__module__}.{type(optimizer).__qualname__} (a torch "
                "optimizer takes layer.parameters() instead, with no optimizer= here)")
        if optimizer is not None and not optimize_for_training:
            raise BadArgumentError("optimizer= trains the layer: pass "
                                   "optimize_for_training=True with it")
        #: the fused optimizer applied inside backward (None: a torch optimizer on
        #: ``weight``'s sparse gradient, or no training)
        self.optimizer = optimizer
        #: elements per stored row: the row, then its optimizer state (gpu.train.wide)
        self.row_width = (optimizer.row_width(embedding_size, data_type)
                          if optimizer is not None else embedding_size)
        self.data_type = data_type
        self.layer_type = layer_type
        self.device = resolve_device(device)
        #: tables the layer opened itself (by name or URL): close() closes them
        self._owned: list[Any] = []
        #: set by close(): the stack is then a ClosedStack
        self._closed = False
        if optimize_for_training:  # NOTE: stateful optimizers refused over quantized rows
            quantized.check_optimizer(optimizer, (storage, host_cache, own_fmt))
        fresh_table = weight_init is None and storage is None
        if self.row_width != embedding_size:
            weight_init, default_row = wide.stored(weight_init, default_row, embedding_size,
                                                   self.row_width, data_type)
        try:
            self._tiers: LayerStack
            self._tiers, spec = build_layer(
                layer_type, num_embeddings, self.row_width, data_type, self.device,
                gpu_cache_size=gpu_cache_size, host_cache=host_cache, storage=storage,
                weight_init=weight_init, table=table, default_row=default_row,
                insert_policy=insert_policy, tuning=tuning, owned=self._owned,
                weight_format=own_fmt)
        except (BadArgumentError, SchemaMismatchError) as e:
            err = quantized.build_error(e, optimizer, embedding_size, data_type, self._owned)
            close_all(self._owned)
            if err is None:
                raise
            raise err from e
        except BaseException:
            close_all(self._owned)  # NOTE: a failed build keeps nothing open
            raise
        if fresh_table and self.row_width != embedding_size and isinstance(
                self._tiers, LinearState):
            with torch.no_grad():  # NOTE: the layer's own random rows: their state starts at 0
                self._tiers.table_view()[:, embedding_size:].zero_()
        #: how the layer was built: its arguments as resolved and its tables by identity
        #: (a record: it stays after close())
        self.spec: LayerSpec = spec
        self._quant = quantized.settle(optimizer if optimize_for_training else None,
                                       (storage, host_cache, own_fmt), self._tiers, self._owned)
        self.validate = bool(validate)
        self._tiers.validate = self.validate
        self._op = ops.register(self._tiers)
        #: the op a compiled forward takes (gpu.ops): False once closed, so it traces again
        self._graph_safe = ops.graph_safe(self._op)
        #: the layer's id as data in a compiled or exported graph (gpu.ops, gpu.export)
        self.register_buffer("nvecache_id", ops.id_buffer(self._op, self.device),
                             persistent=False)
        #: the writer of trained rows (None: an inference layer)
        self._trainer: Trainer | None = None
        if optimize_for_training:
            self._trainer = Trainer(self, optimizer)
            #: the table as a parameter (gpu.train.weight): its gradient is sparse
            self.weight = TableWeight(self._weight_data(), self._trainer)
            ops.register_trainer(self._op, self._trainer)
            #: a compiled forward's differentiable input (gpu.ops' ``train_rows``)
            self._anchor = torch.zeros(0, device=self.device, requires_grad=True)

    def _weight_data(self) -> torch.Tensor:
        if isinstance(self._tiers, LinearState) and not self._quant:  # NOTE: float rows
            return self._tiers.table_view()[:, :self.embedding_size]
        zero = torch.zeros((), dtype=self.data_type, device=self.device)
        return zero.expand(self.num_embeddings, self.embedding_size)

    def _apply(self, fn: Any, recurse: bool = True) -> Self:
        # NOTE: .to()/.half() leave ``weight`` alone: it stands for tables whose device and
        # dtype are the layer's
        weight = self._parameters.pop("weight", None)
        try:
            return super()._apply(fn, recurse)
        finally:
            if weight is not None:
                self._parameters["weight"] = weight

    def _learning(self) -> bool:
        """Whether this call records autograd history (a training layer, grad mode on)."""
        return (self._trainer is not None and torch.is_grad_enabled()
                and self.weight.requires_grad)

    def _read(self, keys: torch.Tensor) -> torch.Tensor:
        """Rows ``[N, embedding_size]`` of flat keys, less any optimizer state."""
        rows = self._tiers.rows(keys)
        if self.row_width != self.embedding_size:
            return rows[:, :self.embedding_size].contiguous()
        return rows

    def _rows(self, keys: torch.Tensor) -> torch.Tensor:
        """A training layer's rows of flat keys, with autograd history when learning
        (compiled: through gpu.ops' ``train_rows``)."""
        if torch.compiler.is_compiling():
            if self._learning():
                return ops.train_rows(keys, self.nvecache_id, self._anchor,
                                      self.embedding_size, self.data_type)
            return ops.rows(keys, self.nvecache_id, self.embedding_size, self.data_type,
                            safe=self._graph_safe)
        if self._learning():
            assert self._trainer is not None
            return Lookup.apply(self.weight, keys, self._read, self._trainer)
        with torch.no_grad():
            return self._read(keys)

    def _own_rows(self) -> bool:
        """Whether a training layer's call takes :meth:`_rows`: eager, learning, or rows
        stored with optimizer state (a compiled inference call of plain rows takes the
        lookup ops, an AOTInductor export's compiled-in GPULayer lookup included)."""
        return (not torch.compiler.is_compiling() or self._learning()
                or self.row_width != self.embedding_size)

    def skipped_rows(self) -> int:
        """Rows a training step left unchanged because their gradient held NaN or an
        infinity (e.g. an fp16 overflow), since the layer was built; one host sync."""
        return 0 if self._trainer is None else self._trainer.skipped_rows()

    # NOTE: checkpoints (gpu.state): ``<prefix>weight`` is a view of a linear table (no
    # copy), a Hierarchical layer's ``<prefix>_extra_state`` names its tables; loading
    # writes rows through the layer's write path, in chunks
    _save_to_state_dict = state.save_to_state_dict
    _load_from_state_dict = state.load_from_state_dict
    get_extra_state = state.get_extra_state
    set_extra_state = state.set_extra_state

    def synchronize(self) -> None:
        """Wait for this layer's queued lookups, then raise a bad key any of them met.

        With the default ``validate=False`` a lookup on CUDA that meets a key outside a
        linear table reads a zero row for it and reports the key on the device; the error
        is raised by the layer's next call, or here at once.

        Raises:
            BadArgumentError: an earlier lookup held a key outside the table.
        """
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._tiers.check_pending()  # NOTE: a closed layer's stand-in raises LayerClosedError

    def _write_args(self, keys: object, values: object | None, allow_nonfinite: bool = False
                    ) -> tuple[torch.Tensor, Any]:
        if not isinstance(keys, torch.Tensor) or keys.dtype != torch.int64 or keys.dim() != 1:
            raise BadArgumentError("keys must be a 1-D int64 tensor")
        if values is not None:
            if keys.numel() and int(keys.min()) == RESERVED_KEY:  # NOTE: before any tier
                raise BadArgumentError(RESERVED_KEY_RULE)
            # NOTE: the one finiteness check of a layer's write (a quantized table's rows are
            # finite): its tiers are told the rows were checked, so none reads them again
            values = check_values(values, keys.numel(), self.embedding_size, self.data_type,
                                  keys=keys, allow_nonfinite=allow_nonfinite and not self._quant)
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
        return self._tiers.update(keys, wide.pad(values, self.row_width))

    @torch.no_grad()
    def insert(self, keys: torch.Tensor, values: torch.Tensor, *, tier: Tier | None = None,
               allow_nonfinite: bool = False) -> None:
        """Write rows, creating those that do not exist; announced to every process like
        update.

        Args:
            keys: 1-D int64 keys.
            values: ``[N, embedding_size]`` rows of the layer's dtype (any device).
            tier: one of the layer's tiers (``layer.tiers``) to write only it, or None
                (the default) for every tier: the parameter server, then the host cache
                (Hierarchical); the table (GPULayer, LinearUVM). ``"gpu"``: this layer's GPU
                cache only (a GPULayer: its table); ``"host"``: the shared host cache only;
                ``"storage"``: the parameter server only, or a LinearUVM layer's linear
                table (every process's GPU cache then drops the keys).
            allow_nonfinite: write rows holding NaN or an infinity instead of raising.

        Raises:
            BadArgumentError: ``tier`` is not one of the layer's tiers; nothing written.
            NonFiniteValuesError: a row holds NaN or an infinity and not
                ``allow_nonfinite``; no tier written.
        """
        tier = check_tier(tier, self._tiers.tiers)
        keys, values = self._write_args(keys, values, allow_nonfinite)
        self._tiers.insert(keys, wide.pad(values, self.row_width), tier)

    @torch.no_grad()
    def erase(self, keys: torch.Tensor, *, tier: Tier | None = None) -> None:
        """Drop keys (see the module docstring for what each layer type drops).

        Args:
            keys: 1-D int64 keys.
            tier: one of the layer's tiers to drop the keys from it only, or None (the
                default) for what the layer type drops.

        Raises:
            BadArgumentError: ``tier`` is not one of the layer's tiers, or names a linear
                table (a GPULayer's ``"gpu"``, a LinearUVM layer's ``"storage"``): a linear
                table has every row. Nothing is dropped.
        """
        tier = check_tier(tier, self._tiers.tiers)
        keys, _ = self._write_args(keys, None)
        self._tiers.erase(keys, tier)

    @torch.no_grad()
    def accumulate(self, keys: torch.Tensor, deltas: torch.Tensor, *,
                   allow_nonfinite: bool = False) -> torch.Tensor:
        """Add ``deltas`` to the rows of keys that exist, in every tier; returns bool
        ``[N]``: which keys existed and were added to.

        Duplicate keys are summed; half-precision rows are added in float32 and rounded
        once. The authoritative tier decides which keys exist (a linear table: every key
        in range; Hierarchical: the parameter server, or without one the host cache); a
        key it lacks is not written and reads False, as in :meth:`update`. A linear table
        is added to in place, then every process's GPU cache drops the keys; a parameter
        server adds atomically per row. After it returns, a lookup reads the new rows.

        Args:
            keys: 1-D int64 keys.
            deltas: ``[N, embedding_size]`` of the layer's dtype (any device).
            allow_nonfinite: add deltas holding NaN or an infinity instead of raising.

        Raises:
            BadArgumentError: bad keys or deltas (shape, dtype; a key outside a linear
                table); nothing is added.
            NonFiniteValuesError: a delta holds NaN or an infinity and not
                ``allow_nonfinite``; no tier is written.
            StorageWriteError: the parameter server refused the write (Hierarchical).
        """
        keys, deltas = self._write_args(keys, deltas, allow_nonfinite)
        deltas = deltas.float() if self._quant else deltas  # NOTE: added in float32
        if self.row_width != self.embedding_size and self.data_type != torch.float32:
            # NOTE: 16-bit rows hold their float32 state bit for bit: not added to
            assert self._trainer is not None
            return self._trainer.add_rows(keys, deltas)
        return self._tiers.accumulate(keys, wide.pad(deltas, self.row_width))

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The tiers a per-tier write may name, nearest first: ``("gpu",)`` for a GPULayer,
        ``("storage",)`` for a HostLayer (it has no GPU tier), ``("gpu", "storage")`` for
        LinearUVM, ``("gpu", "host", "storage")`` for a Hierarchical layer (less a tier it
        was built without)."""
        return self._tiers.tiers

    def clear(self) -> None:
        """Drop every cached row of this layer's caches."""
        self._tiers.clear()

    def in_gpu_cache(self, keys: torch.Tensor) -> torch.Tensor:
        """bool ``[N]``: which keys this layer's GPU cache holds now (not counted as a
        lookup; a GPULayer has no cache: all False)."""
        keys, _ = self._write_args(keys, None)
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
        if self._closed:
            return
        tiers = self._tiers
        self._closed = True
        # NOTE: the stand-in first: later calls raise, eager or compiled (gpu.ops)
        self._tiers = ClosedStack(f"{type(self).__name__} ({self.layer_type.name})", tiers)
        self._op = ops.unregister(self._op, self._tiers)
        self._graph_safe = False
        owned, self._owned = self._owned, []
        try:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # queued lookups may read the tables
            tiers.close()
        finally:
            del tiers  # NOTE: the layer's last reference: the stack and its GPU cache go now
            close_all(owned)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def extra_repr(self) -> str:
        closed = ", closed" if self._closed else ""
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
        optimize_for_training: True makes the layer trainable (``gpu.train``): a
            ``weight`` parameter with a sparse gradient, outputs with autograd history
            under grad mode. False (the default): inference only, no history.
        optimizer: a fused optimizer of :mod:`gpu.optim`, applied inside backward to the
            rows in every tier; its state is stored beside each row, so the layer's
            tables have rows of ``optimizer.row_width(embedding_size, data_type)``.
        weight_dtype: GPULayer without ``storage``: the format its own table is stored in,
            ``torch.int8`` or ``torch.float8_e4m3fn`` (quantized, read in ``data_type``);
            None (the default) or ``data_type``: stored as ``data_type``.
        device: "cpu" or a CUDA device (default: the current CUDA device, else the CPU).
        default_row: Hierarchical: row (or scalar) for keys in no tier; None raises
            KeyNotFoundError (and StorageUnavailableError while the PS is down).
        insert_policy: Hierarchical/LinearUVM: which misses enter the caches.
        tuning: a :class:`TierConfig`: admission tunables (Hierarchical, LinearUVM), the
            GPU cache's backend and the kernels' launch settings (every type).
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
        if isinstance(input, torch.Tensor) and input.dtype == torch.int64 and \
                input.device == self.device:
            keys = input  # NOTE: the common case, checked inline (bench/RESULTS.md, "Per-call")
        else:
            keys = check_keys(input, self.device)
        if self._trainer is not None and self._own_rows():
            rows = self._rows(keys.reshape(-1).contiguous())
        elif torch.compiler.is_compiling():  # one custom op: no graph break (gpu.ops)
            flat = keys.reshape(-1).contiguous()
            inline = traced_lookup.bound(self)  # NOTE: an AOTInductor export's GPULayer
            rows = (inline.rows(flat) if inline is not None else
                    ops.rows(flat, self.nvecache_id, self.embedding_size, self.data_type,
                             safe=self._graph_safe))
        elif keys.is_contiguous() and (keys.dim() == 1 or self._tiers.rows_any_shape):
            return self._tiers.rows(keys)  # NOTE: no reshape or view to pay
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
        if self._trainer is not None and (self._learning()
                                          or self.row_width != self.embedding_size):
            rows = self._rows(keys)  # NOTE: torch pools them: its backward routes the grads
            return torch.nn.functional.embedding_bag(
                torch.arange(keys.numel(), device=rows.device), rows, full, mode=self.mode,
                per_sample_weights=weights, include_last_offset=True)
        if torch.compiler.is_compiling():  # one custom op: no graph break (gpu.ops)
            inline = traced_lookup.bound(self)  # NOTE: an AOTInductor export's GPULayer
            if inline is not None:
                return inline.pooled(keys, full, weights, self.mode)
            return ops.pooled(keys, full, weights, self.nvecache_id, self.mode,
                              self.embedding_size, self.data_type)
        with torch.no_grad():
            return self._tiers.pooled(keys, full, weights, self.mode)
