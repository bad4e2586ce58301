"""The per-process GPU cache: a set-associative table of hot rows in device memory.

One :class:`GPUCache` per layer per process. Keys, per-way policy counters and rows live
in three device tensors (slot ``b * ways + w`` is way ``w`` of bucket ``b``); the bucket of
a key is ``hostcache.hashing.bucket_of`` (the host tier's hash). On CUDA the lookups run as
Triton kernels (``gpu.cache_kernels``); on CPU, or wherever Triton is missing, the torch
twin (``gpu.cache_twin``) gives identical results. Writes (insert / update / erase) plan
slots with deterministic torch ops shared by both backends, so the table state after any
sequence of operations is the same on CPU and CUDA.

Bookkeeping (which key lives where: :meth:`GPUCache.probe`) is separate from the code that
moves bytes (:meth:`GPUCache.gather`); the fused paths do both in one kernel launch.

With ``device="cpu"`` the cache lives in host memory and no CUDA call is made.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import torch

from hostcache.layout import EMPTY_KEY

from . import cache_twin as twin
from ._triton import kernel_module, triton_available
from .devices import resolve_device, same_device
from .errors import BadArgumentError

logger = logging.getLogger(__name__)

Backend = Literal["auto", "torch", "triton"]
PoolMode = Literal["sum", "mean"]

#: element types a cache row may have.
ROW_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_INT32_MAX = (1 << 31) - 1
#: odd multiplier (2^32 / golden ratio) spreading successive lookup counts over the rows
_GOLDEN = 0x9E3779B1
#: set NVEC_FORCE_TRITON=1 to make ``backend="auto"`` run the Triton kernels on CPU tensors
#: too (through Triton's interpreter; slow, for tests).
FORCE_TRITON_ENV = "NVEC_FORCE_TRITON"


@dataclass(frozen=True)
class GPUCacheStats:
    """Counters of one :class:`GPUCache` since it was created."""

    #: slots in the table (``num_buckets * ways``).
    capacity: int
    #: occupied slots.
    size: int
    #: looked-up keys found in the cache.
    hits: int
    #: looked-up keys not found.
    misses: int
    #: new keys placed by ``insert`` (keys already present are overwritten, not counted).
    inserts: int
    #: resident keys displaced by ``insert``.
    evictions: int
    #: keys overwritten by ``update``.
    updates: int
    #: keys removed by ``erase``.
    erases: int
    #: ``hits / (hits + misses)``, 0.0 before the first lookup.
    hit_rate: float


@dataclass(frozen=True)
class MissCandidates:
    """Where a linear lookup writes its misses, so that the caller learns them without a
    host sync: one int64 buffer ``[1 + 2 * cap]`` holding the number of in-range misses
    (all of them, even past ``cap``), the first ``cap`` missed keys found and their
    positions in the batch. Duplicated keys appear once per occurrence.

    Which misses come first: batch order on the CPU; on CUDA the order in which the
    kernel's key blocks ran (a block's misses stay together, in the order the block visits
    them: batch order, or host-page order from a rotating start row for large batches over
    a host table, see ``gpu.cache_kernels.page_order``).
    """

    buffer: torch.Tensor

    @classmethod
    def empty(cls, cap: int, device: object) -> MissCandidates:
        """A zeroed buffer for up to ``cap`` candidates (one allocation, one memset).

        Raises:
            BadArgumentError: ``cap`` is not a non-negative int, or a bad device.
        """
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
            raise BadArgumentError(f"cap must be a non-negative int; got {cap!r}")
        # NOTE: a torch.device is taken as is (the layers pass their own, once per lookup)
        dev = device if isinstance(device, torch.device) else resolve_device(device)
        return cls(torch.zeros(1 + 2 * cap, dtype=torch.int64, device=dev))

    @property
    def cap(self) -> int:
        return (self.buffer.numel() - 1) // 2

    @property
    def count(self) -> torch.Tensor:
        """``[1]`` int64 on the buffer's device: the lookup's in-range misses."""
        return self.buffer[:1]

    @property
    def keys(self) -> torch.Tensor:
        return self.buffer[1:1 + self.cap]

    @property
    def positions(self) -> torch.Tensor:
        return self.buffer[1 + self.cap:]


class GPUCache:
    """A set-associative cache of embedding rows in device memory, sized in bytes.

    Args:
        capacity_bytes: Memory budget. Slots = ``capacity_bytes // (8 + 4 + row bytes)``
            rounded down to whole buckets; 0 slots make a disabled cache (all misses).
        dim: Row length in elements.
        dtype: Row element type (float32, float16, bfloat16 or float64).
        device: ``"cpu"`` or a CUDA device.
        ways: Slots per bucket, a power of two from 1 to 64 (8: one 64-byte key load).
        backend: ``"triton"`` (kernels; on CPU tensors through Triton's interpreter),
            ``"torch"`` (the twin in torch ops) or ``"auto"`` (Triton on CUDA when it is
            importable, else torch; ``NVEC_FORCE_TRITON=1`` forces Triton).

    Raises:
        BadArgumentError: A size, dtype, ways or backend is invalid.
        CUDAUnavailableError: A CUDA device was asked for without CUDA.
        TritonUnavailableError: ``backend="triton"`` without the triton package.
    """

    def __init__(
        self,
        capacity_bytes: int,
        dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        *,
        ways: int = 8,
        backend: Backend = "auto",
    ) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) \
                or capacity_bytes < 0:
            raise BadArgumentError(
                f"capacity_bytes must be an int >= 0; got {capacity_bytes!r}")
        if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
            raise BadArgumentError(f"dim must be an int > 0; got {dim!r}")
        if dtype not in ROW_DTYPES:
            raise BadArgumentError(
                f"dtype must be one of {', '.join(map(str, ROW_DTYPES))}; got {dtype!r}")
        if isinstance(ways, bool) or not isinstance(ways, int) or not 1 <= ways <= 64 \
                or ways & (ways - 1):
            raise BadArgumentError(f"ways must be a power of two in [1, 64]; got {ways!r}")
        if backend not in ("auto", "torch", "triton"):
            raise BadArgumentError(
                f"backend must be 'auto', 'torch' or 'triton'; got {backend!r}")
        dev = resolve_device(device)
        self.dim = dim
        self.dtype = dtype
        self.device = dev
        self.ways = ways
        self.row_bytes = dim * torch.empty((), dtype=dtype).element_size()
        self.slot_bytes = 8 + 4 + self.row_bytes
        self.num_buckets = capacity_bytes // self.slot_bytes // ways
        self.capacity = self.num_buckets * ways
        # NOTE: one slot more than the table: the trash slot that insert plans write where
        # a batch position writes nothing (gpu.cache_twin.InsertPlan); views hide it.
        self._tkeys_all = torch.full((self.capacity + 1,), EMPTY_KEY, dtype=torch.int64,
                                     device=dev)
        self._counters_all = torch.zeros(self.capacity + 1, dtype=torch.int32, device=dev)
        self._rows_all = torch.zeros((self.capacity + 1, dim), dtype=dtype, device=dev)
        self._tkeys = self._tkeys_all[: self.capacity]
        self._counters = self._counters_all[: self.capacity]
        self._rows = self._rows_all[: self.capacity]
        self._hits = torch.zeros(twin.STAT_STRIPES, dtype=torch.int64, device=dev)
        self._lookups = 0
        self._updates = self._erases = 0
        # inserts, evictions, dropped keys: counted on the device (insert makes no sync)
        self._insert_stats = torch.zeros(3, dtype=torch.int64, device=dev)
        self._kernels: ModuleType | None = None
        #: keys counted by the kernels since the counters were last clamped in full.
        self._unclamped = 0
        use_triton = backend == "triton" or (backend == "auto" and (
            os.environ.get(FORCE_TRITON_ENV, "") == "1"
            or (dev.type == "cuda" and triton_available())))
        if use_triton:
            self._kernels = kernel_module("cache_kernels", interpret=dev.type != "cuda")
        self.backend = "triton" if use_triton else "torch"
        logger.debug("GPUCache %d slots (%d buckets x %d ways), dim %d %s on %s, backend %s",
                     self.capacity, self.num_buckets, ways, dim, dtype, dev, self.backend)

    # ------------------------------------------------------------------ validation

    def _check_keys(self, keys: object, what: str = "keys") -> torch.Tensor:
        if not isinstance(keys, torch.Tensor):
            raise BadArgumentError(f"{what} must be a torch.Tensor; got {type(keys).__name__}")
        if keys.dtype != torch.int64 or keys.dim() != 1:
            raise BadArgumentError(
                f"{what} must be a 1-D int64 tensor; got {keys.dtype} of shape "
                f"{tuple(keys.shape)} (use keys.long().reshape(-1))")
        if not same_device(keys, self.device):
            raise BadArgumentError(
                f"{what} are on {keys.device} but the cache is on {self.device}; "
                f"move them with .to({str(self.device)!r})")
        return keys.contiguous()

    def _check_rows(self, values: object, n: int, what: str = "values") -> torch.Tensor:
        if not isinstance(values, torch.Tensor):
            raise BadArgumentError(
                f"{what} must be a torch.Tensor; got {type(values).__name__}")
        if tuple(values.shape) != (n, self.dim):
            raise BadArgumentError(
                f"{what} must have shape ({n}, {self.dim}); got {tuple(values.shape)}")
        if values.dtype != self.dtype:
            raise BadArgumentError(
                f"{what} must be {self.dtype}; got {values.dtype} (convert with .to())")
        if not same_device(values, self.device):
            raise BadArgumentError(
                f"{what} are on {values.device} but the cache is on {self.device}")
        return values.contiguous()

    def _check_table(self, table: object) -> torch.Tensor:
        if not isinstance(table, torch.Tensor) or table.dim() != 2 \
                or table.shape[1] != self.dim or table.dtype != self.dtype:
            got = (f"{table.dtype} {tuple(table.shape)}" if isinstance(table, torch.Tensor)
                   else type(table).__name__)
            raise BadArgumentError(
                f"table must be a [num_rows, {self.dim}] {self.dtype} tensor; got {got}")
        if not same_device(table, self.device):
            raise BadArgumentError(
                f"table is on {table.device} but the cache is on {self.device}; on CUDA pass "
                "a zero-copy CUDA view of the registered host table")
        # NOTE: rows may be padded (a SharedMemBlock rounds them up to 16 bytes): the kernels
        # step by stride(0); only the elements of a row must be contiguous
        if table.shape[0] > 1 and table.stride(0) < self.dim or (
                self.dim > 1 and table.stride(1) != 1):
            raise BadArgumentError(
                f"table rows must each be contiguous and not overlap (strides (>= {self.dim}, "
                f"1)); got strides {tuple(table.stride())}: pass table.contiguous()")
        return table

    def _check_linear_keys(self, keys: torch.Tensor, num_rows: int) -> None:
        if keys.numel() and bool(((keys < 0) | (keys >= num_rows)).any()):
            raise BadArgumentError(
                f"keys of a linear table must lie in [0, {num_rows}); drop or remap the "
                "others before the lookup")

    def _check_bags(
        self, n: int, offsets: object, mode: object, weights: object,
        miss_values: object, validate: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        if mode not in ("sum", "mean"):
            raise BadArgumentError(f"mode must be 'sum' or 'mean'; got {mode!r}")
        if not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int64 \
                or offsets.dim() != 1 or offsets.numel() < 1:
            raise BadArgumentError(
                "offsets must be a 1-D int64 tensor of B + 1 bag boundaries "
                "(include_last_offset semantics)")
        if not same_device(offsets, self.device):
            raise BadArgumentError(f"offsets are on {offsets.device}, not {self.device}")
        offsets = offsets.contiguous()
        if validate:
            bad = (offsets[0] != 0) | (offsets[-1] != n) | (offsets[1:] < offsets[:-1]).any()
            if bool(bad):
                raise BadArgumentError(
                    f"offsets must start at 0, end at len(keys) = {n} and never decrease")
        w: torch.Tensor | None = None
        if weights is not None:
            if mode != "sum":
                raise BadArgumentError("per_sample_weights are only supported with mode='sum'")
            if not isinstance(weights, torch.Tensor) or tuple(weights.shape) != (n,) \
                    or not weights.is_floating_point():
                raise BadArgumentError(
                    f"per_sample_weights must be a float tensor of shape ({n},)")
            if not same_device(weights, self.device):
                raise BadArgumentError(
                    f"per_sample_weights are on {weights.device}, not {self.device}")
            w = weights.contiguous()
        mv = None if miss_values is None else self._check_rows(miss_values, n, "miss_values")
        return offsets, w, mv

    # ------------------------------------------------------------------ lookups

    def _will_count(self, n: int) -> None:
        """Before a kernel adds up to ``n`` unsaturated hits to the counters.

        The kernels add without saturating (``gpu.cache_kernels``: a stored counter ``c``
        means ``min(c, COUNTER_MAX)``); clamp every counter before the adds counted since
        the last clamp could overflow int32. One pass over the counters per ~10^9 keys.
        """
        if self._unclamped + n > _INT32_MAX - twin.COUNTER_MAX:
            self._counters.clamp_max_(twin.COUNTER_MAX)
            self._unclamped = 0
        self._unclamped += n

    def probe(self, keys: torch.Tensor, *, record: bool = True) -> torch.Tensor:
        """Slots holding ``keys`` (bookkeeping only, no row is moved).

        Args:
            keys: int64 ``[N]`` on the cache's device.
            record: Count the probe as a lookup (policy counters and hit statistics).

        Returns:
            int64 ``[N]``: the slot of each key, -1 where it is not cached.
        """
        keys = self._check_keys(keys)
        if self._kernels is not None:
            if record:
                self._will_count(keys.numel())
            _, hit, slots = self._kernels.lookup(
                keys, self._tkeys, self._counters, self._rows, self._hits, self.num_buckets,
                self.ways, empty=EMPTY_KEY, gather=False,
                count=record, want_slots=True, cmax=twin.COUNTER_MAX)
            assert slots is not None
        else:
            hit, slots = twin.probe(self._tkeys, self.num_buckets, self.ways, keys)
            if record:
                twin.bump(self._counters, slots, hit)
                twin.count_hits(self._hits, hit)
        if record:
            self._lookups += keys.numel()
        return slots

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows at ``slots`` (from :meth:`probe`); zero rows where a slot is -1."""
        slots = self._check_keys(slots, "slots")
        if slots.numel() and bool((slots >= self.capacity).any()):
            raise BadArgumentError(f"slots must be -1 or lie in [0, {self.capacity})")
        return twin.gather(self._rows, slots, slots >= 0)

    def lookup(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``keys``: ``(values [N, dim], hit bool [N])``; misses give zero rows."""
        return self._lookup_rows(self._check_keys(keys), None)

    def lookup_linear(
        self, keys: torch.Tensor, table: torch.Tensor, *, validate: bool = True,
        candidates: MissCandidates | None = None, host_table: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hits from the cache, misses from row ``key`` of ``table``, in one launch.

        Args:
            keys: int64 ``[N]`` row indices of the linear table, on the cache's device.
            table: ``[num_rows, dim]`` rows of the cache's dtype (on CUDA, a zero-copy CUDA
                view of the registered host table); rows may be padded (any row stride
                ``>= dim``), the elements of a row contiguous.
            validate: Check that every key lies in ``[0, num_rows)`` (one host sync); out of
                range keys otherwise give zero rows and ``hit = False``.
            candidates: A zeroed :class:`MissCandidates` on the cache's device that receives
                the in-range misses (written by the lookup itself: no host sync).
            host_table: ``table`` is a zero-copy view of host memory (large batches are
                then visited in host-page order, see ``gpu.cache_kernels``); pass False for
                a table in GPU memory (a tensor in HBM, a ``DistMemBlock``). Same results
                either way.

        Returns:
            ``(values [N, dim], hit bool [N])``; ``keys[~hit]`` are the keys to insert.
        """
        keys = self._check_keys(keys)
        table = self._check_table(table)
        if validate:
            self._check_linear_keys(keys, table.shape[0])
        return self._lookup_rows(keys, table, self._check_candidates(candidates), host_table)

    def _check_candidates(self, candidates: MissCandidates | None) -> torch.Tensor | None:
        if candidates is None:
            return None
        buf = candidates.buffer
        if (buf.dtype != torch.int64 or buf.dim() != 1 or buf.numel() % 2 != 1
                or not buf.is_contiguous() or not same_device(buf, self.device)):
            raise BadArgumentError(
                f"candidates must be a MissCandidates.empty(cap, {self.device}) buffer")
        return buf

    def _lookup_rows(
        self, keys: torch.Tensor, table: torch.Tensor | None,
        cand: torch.Tensor | None = None, host_table: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Probe + gather (+ misses from row ``key`` of ``table``), counted as a lookup."""
        # NOTE: where a large batch is visited in host-page order, start it at a different
        # row each time (gpu.cache_kernels.page_order)
        rotate = (self._lookups * _GOLDEN) & _INT32_MAX
        self._lookups += keys.numel()
        if self._kernels is not None:
            self._will_count(keys.numel())
            out, hit, _ = self._kernels.lookup(
                keys, self._tkeys, self._counters, self._rows, self._hits, self.num_buckets,
                self.ways, empty=EMPTY_KEY, gather=True, count=True,
                want_slots=False, table=table, candidates=cand, host_table=host_table,
                cmax=twin.COUNTER_MAX, rotate=rotate)
            assert out is not None
            return out, hit
        hit, slot = twin.probe(self._tkeys, self.num_buckets, self.ways, keys)
        twin.bump(self._counters, slot, hit)
        twin.count_hits(self._hits, hit)
        if table is None:
            return twin.gather(self._rows, slot, hit), hit
        if cand is not None:
            twin.collect_misses(cand, keys, hit, table.shape[0])
        return twin.gather_linear(self._rows, slot, hit, keys, table), hit

    def lookup_pooled(
        self,
        keys: torch.Tensor,
        offsets: torch.Tensor,
        mode: PoolMode = "sum",
        per_sample_weights: torch.Tensor | None = None,
        *,
        miss_values: torch.Tensor | None = None,
        validate: bool = True,
        out_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pooled rows per bag, probe + gather + pool fused: ``(pooled [B, dim], hit [N])``.

        Args:
            keys: int64 ``[N]`` on the cache's device.
            offsets: int64 ``[B + 1]`` bag boundaries (``embedding_bag`` with
                ``include_last_offset=True``); an empty bag gives a zero row.
            mode: ``"sum"`` or ``"mean"`` (mean divides by the bag length, misses included).
            per_sample_weights: float ``[N]`` weights (mode ``"sum"`` only).
            miss_values: ``[N, dim]`` rows used at the positions that miss the cache;
                ``None`` makes misses contribute zero.
            validate: Check the offsets (one host sync).
            out_dtype: Element type of ``pooled`` (default the cache's; the sums are fp32
                either way): ``torch.float32`` lets a caller add more rows to the sums
                before one final rounding.

        Returns:
            ``(pooled [B, dim], hit bool [N])``.
        """
        keys = self._check_keys(keys)
        offsets, w, mv = self._check_bags(
            keys.numel(), offsets, mode, per_sample_weights, miss_values, validate)
        if out_dtype is not None and out_dtype not in ROW_DTYPES:
            raise BadArgumentError(f"out_dtype must be one of {ROW_DTYPES}; got {out_dtype!r}")
        return self._pooled(keys, offsets, mode == "mean", w, mv, None, out_dtype=out_dtype)

    def lookup_linear_pooled(
        self,
        keys: torch.Tensor,
        offsets: torch.Tensor,
        table: torch.Tensor,
        mode: PoolMode = "sum",
        per_sample_weights: torch.Tensor | None = None,
        *,
        validate: bool = True,
        candidates: MissCandidates | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`lookup_pooled` whose misses read row ``key`` of ``table`` in the same launch.

        ``candidates`` as in :meth:`lookup_linear`.

        Returns:
            ``(pooled [B, dim], hit bool [N])``; ``keys[~hit]`` are the keys to insert.
        """
        keys = self._check_keys(keys)
        table = self._check_table(table)
        offsets, w, _ = self._check_bags(
            keys.numel(), offsets, mode, per_sample_weights, None, validate)
        if validate:
            self._check_linear_keys(keys, table.shape[0])
        return self._pooled(keys, offsets, mode == "mean", w, None, table,
                            self._check_candidates(candidates))

    def _pooled(
        self, keys: torch.Tensor, offsets: torch.Tensor, mean: bool, w: torch.Tensor | None,
        mv: torch.Tensor | None, table: torch.Tensor | None, cand: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._lookups += keys.numel()
        if self._kernels is not None:
            self._will_count(keys.numel())
            return self._kernels.pooled(
                keys, offsets, w, mv, self._tkeys, self._counters, self._rows, self._hits,
                self.num_buckets, self.ways, mean=mean, empty=EMPTY_KEY, table=table,
                candidates=cand, cmax=twin.COUNTER_MAX, out_dtype=out_dtype)
        hit, slot = twin.probe(self._tkeys, self.num_buckets, self.ways, keys)
        twin.bump(self._counters, slot, hit)
        twin.count_hits(self._hits, hit)
        if table is not None:
            if cand is not None:
                twin.collect_misses(cand, keys, hit, table.shape[0])
            vals = twin.gather_linear(self._rows, slot, hit, keys, table)
        else:
            vals = twin.gather(self._rows, slot, hit)
            if mv is not None:
                vals = torch.where(hit[:, None], vals, mv)
        return twin.pool(vals, offsets, w, mean, out_dtype or self.dtype), hit

    # ------------------------------------------------------------------ writes

    def _scatter(self, target: torch.Tensor, values: torch.Tensor, src: torch.Tensor) -> None:
        """``rows[target] = values[src]``; ``target`` may name the trash slot."""
        if self._kernels is not None:
            self._kernels.scatter_rows(self._rows_all, target, values, src)
        else:
            self._rows_all[target] = values[src]

    def insert(self, keys: torch.Tensor, values: torch.Tensor, *, validate: bool = True
               ) -> None:
        """Insert or overwrite rows (best effort: a full bucket evicts by policy).

        Duplicate keys keep their last occurrence; see ``gpu.cache_twin`` for the batch
        rules. Keys already cached are overwritten in place. No host sync with
        ``validate=False`` (then a key equal to the empty marker is stored as an empty slot,
        i.e. dropped, instead of raising).

        Raises:
            BadArgumentError: Bad keys/values, or a key equal to the reserved empty marker.
        """
        keys = self._check_keys(keys)
        values = self._check_rows(values, keys.numel())
        if keys.numel() == 0 or self.num_buckets == 0:
            return
        if validate and bool((keys == EMPTY_KEY).any()):
            raise BadArgumentError(
                f"key {EMPTY_KEY} (INT64_MIN) is reserved for empty slots; remap it")
        if self._kernels is not None:
            self._kernels.insert(keys, values, self._tkeys, self._counters, self._rows_all,
                                 self._insert_stats, self.num_buckets, self.ways,
                                 empty=EMPTY_KEY, cmax=twin.COUNTER_MAX,
                                 decay_at=twin.DECAY_AT)
            return
        plan = twin.plan_insert(self._tkeys, self._counters, self.num_buckets, self.ways, keys)
        self._counters_all[plan.decay_target] = plan.decay_values
        self._tkeys_all[plan.key_target] = plan.new_keys
        self._counters_all[plan.key_target] = plan.new_counters
        self._scatter(plan.row_target, values, plan.row_src)
        self._insert_stats += torch.stack([plan.placed, plan.evictions, plan.dropped])

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Overwrite the rows of keys that are cached; others are ignored.

        Returns:
            bool ``[N]``: whether each key was cached (and so updated).
        """
        keys = self._check_keys(keys)
        values = self._check_rows(values, keys.numel())
        slots, src, present = twin.plan_update(self._tkeys, self.num_buckets, self.ways, keys)
        self._scatter(slots, values, src)
        self._updates += slots.numel()
        return present

    def erase(self, keys: torch.Tensor) -> None:
        """Remove ``keys`` from the cache (absent keys are ignored)."""
        keys = self._check_keys(keys)
        hit, slots = twin.probe(self._tkeys, self.num_buckets, self.ways, torch.unique(keys))
        slots = slots[hit]
        self._tkeys[slots] = EMPTY_KEY
        self._counters[slots] = 0
        self._erases += slots.numel()

    def clear(self) -> None:
        """Drop every row (statistics are kept)."""
        self._tkeys.fill_(EMPTY_KEY)
        self._counters.zero_()
        self._unclamped = 0

    # ------------------------------------------------------------------ introspection

    def stats(self) -> GPUCacheStats:
        """Counters since creation (one host sync)."""
        hits = int(self._hits.sum())
        size = int((self._tkeys != EMPTY_KEY).sum()) if self.capacity else 0
        misses = self._lookups - hits
        inserts, evictions, _dropped = (int(x) for x in self._insert_stats.tolist())
        return GPUCacheStats(
            capacity=self.capacity, size=size, hits=hits, misses=misses,
            inserts=inserts, evictions=evictions, updates=self._updates,
            erases=self._erases, hit_rate=hits / self._lookups if self._lookups else 0.0)

    def state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copies of ``(keys [slots], counters [slots], rows [slots, dim])`` on the CPU."""
        counters = self._counters.clamp_max(twin.COUNTER_MAX)  # see _will_count
        return self._tkeys.cpu(), counters.cpu(), self._rows.cpu()

    def __repr__(self) -> str:
        return (f"GPUCache(slots={self.capacity}, ways={self.ways}, dim={self.dim}, "
                f"dtype={self.dtype}, device={self.device}, backend={self.backend!r})")
