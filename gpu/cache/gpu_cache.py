"""The per-process GPU cache: a set-associative table of hot rows in device memory.

One :class:`GPUCache` per layer per process. Keys, per-way policy counters and rows live
in three device tensors (slot ``b * ways + w`` is way ``w`` of bucket ``b``); the bucket of
a key is ``hostcache.hashing.bucket_of`` (the host tier's hash). The cache holds one
backend object (``gpu.cache.backend``): on CUDA the Triton kernels, on CPU, or wherever
Triton is missing, the torch twin (``gpu.cache.twin``), with identical results. Updates and
erases plan slots with deterministic torch ops shared by both backends, so the table state
after any sequence of operations is the same on CPU and CUDA. Argument checks are in
``gpu.cache.checks``, the statistics and miss-candidate types in ``gpu.cache.records``.

Bookkeeping (which key lives where: :meth:`GPUCache.probe`) is separate from the code that
moves bytes (:meth:`GPUCache.gather`); the fused paths do both in one kernel launch.

With ``device="cpu"`` the cache lives in host memory and no CUDA call is made.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal

import torch

from gpu.cache import twin
from gpu.cache.backend import BackendName, CacheTables, make_backend
from gpu.cache.checks import ArgumentChecks, row_dtype, row_format_of
from gpu.cache.records import GPUCacheStats, MissCandidates, PreparedInsert
from gpu.cuda.devices import resolve_device
from gpu.errors import BadArgumentError
from gpu.kernels.tiles import DEFAULT_TILES, Tiles
from hostcache.layout import EMPTY_KEY
from nvecache.common.rows import RowFormat

if TYPE_CHECKING:
    from gpu.stacks.misses.miss_list import MissList

__all__ = ["Backend", "GPUCache", "GPUCacheStats", "MissCandidates",
           "PoolMode"]

logger = logging.getLogger(__name__)

Backend = BackendName
PoolMode = Literal["sum", "mean"]

_INT32_MAX = (1 << 31) - 1
#: odd multiplier (2^32 / golden ratio) spreading successive lookup counts over the rows
_GOLDEN = 0x9E3779B1


class GPUCache:
    """A set-associative cache of embedding rows in device memory, sized in bytes.

    Args:
        capacity_bytes: Memory budget. Slots = ``capacity_bytes // (8 + 4 + row bytes)``
            rounded down to whole buckets; 0 slots make a disabled cache (all misses).
        dim: Row length in elements.
        dtype: Row element type: a stored dtype of ``nvecache.common.rows.DTYPES``.
        device: ``"cpu"`` or a CUDA device.
        ways: Slots per bucket, a power of two from 1 to 64 (8: one 64-byte key load).
        backend: ``"triton"`` (kernels; on CPU tensors through Triton's interpreter),
            ``"torch"`` (the twin in torch ops) or ``"auto"`` (Triton on CUDA when it is
            importable, else torch).
        tiles: The kernels' launch settings (:class:`gpu.kernels.tiles.Tiles`; a layer's
            ``TierConfig.tiles``); the torch twin ignores them.

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
        tiles: Tiles = DEFAULT_TILES,
    ) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) \
                or capacity_bytes < 0:
            raise BadArgumentError(
                f"capacity_bytes must be an int >= 0; got {capacity_bytes!r}")
        if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
            raise BadArgumentError(f"dim must be an int > 0; got {dim!r}")
        row_format = row_format_of(dtype, dim)
        if isinstance(ways, bool) or not isinstance(ways, int) or not 1 <= ways <= 64 \
                or ways & (ways - 1):
            raise BadArgumentError(f"ways must be a power of two in [1, 64]; got {ways!r}")
        dev = resolve_device(device)
        self.dim = dim
        self.dtype = dtype
        self.device = dev
        self._checks = ArgumentChecks(dim, dtype, dev)
        self.ways = ways
        #: how a row is stored (``nvecache.common.rows``); a slot holds its payload
        self.row_format = row_format
        self.row_bytes = row_format.row_bytes
        self.slot_bytes = 8 + 4 + self.row_bytes
        self.num_buckets = capacity_bytes // self.slot_bytes // ways
        self.capacity = self.num_buckets * ways
        #: the table's tensors (benches read them; ``state()`` copies them)
        self.tables = t = CacheTables(self.num_buckets, ways, dim, dtype, dev)
        self._tkeys, self._counters, self._hits = t.tkeys, t.counters, t.hits
        self._lookups = 0
        self._updates = self._erases = 0
        #: keys counted by the kernels since the counters were last clamped in full.
        self._unclamped = 0
        #: the backend object every lookup and insert runs on (gpu.cache.backend)
        self.ops = make_backend(backend, t, dev, tiles)
        self.backend = self.ops.name
        logger.debug("GPUCache %d slots (%d buckets x %d ways), dim %d %s on %s, backend %s",
                     self.capacity, self.num_buckets, ways, dim, dtype, dev, self.backend)

    # ------------------------------------------------------------------ lookups

    def _will_count(self, n: int) -> None:
        """Before a kernel adds up to ``n`` unsaturated hits to the counters.

        The kernels add without saturating (``gpu.kernels.cache_lookup``: a stored counter ``c``
        means ``min(c, COUNTER_MAX)``); clamp every counter before the adds counted since
        the last clamp could overflow int32 (a rare pass over the counters).
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
        keys = self._checks.keys(keys)
        if record:
            self._will_count(keys.numel())
            self._lookups += keys.numel()
        return self.ops.probe(keys, record)

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows at ``slots`` (from :meth:`probe`); zero rows where a slot is -1."""
        slots = self._checks.keys(slots, "slots")
        if slots.numel() and bool((slots >= self.capacity).any()):
            raise BadArgumentError(f"slots must be -1 or lie in [0, {self.capacity})")
        return twin.gather(self.tables.rows, slots, slots >= 0)

    def lookup(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``keys``: ``(values [N, dim], hit bool [N])``; misses give zero rows."""
        values, hit = self._lookup_rows(self._checks.keys(keys), None)
        assert hit is not None
        return values, hit

    def serve(self, keys: torch.Tensor, misses: MissList) -> torch.Tensor:
        """:meth:`lookup` for a caller that checked its keys (a layer's stack: 1-D int64,
        contiguous, on the cache's device) and learns its misses on the host: each missed
        key and its batch position go to ``misses`` (grown to ``N`` keys by the caller:
        ``MissList.ensure``), read with ``MissList.take`` once the lookup finished; no hit
        flags. Returns the rows (zero where a key missed)."""
        values, _ = self._lookup_rows(keys, None, misses=misses)
        return values

    def lookup_linear(
        self, keys: torch.Tensor, table: torch.Tensor, *, validate: bool = True,
        candidates: MissCandidates | None = None, host_table: bool = True,
        err: torch.Tensor | None = None, table_format: RowFormat | None = None,
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
                then visited in host-page order, see ``gpu.kernels.cache_lookup``); pass False for
                a table in GPU memory (a tensor in HBM, a ``DistMemBlock``). Same results
                either way.
            err: A key-error flag (``gpu.stacks.key_flag``, int64 ``[1]`` on the device) that the
                Triton kernel writes an out-of-range key into (the torch twin ignores it:
                its callers check keys on the host).
            table_format: The format of a quantized ``table``
                (:data:`nvecache.common.rows.QUANTIZED`, of the cache's dim): ``table`` is
                then its stored bytes, uint8 ``[num_rows, >= stored_bytes]`` (a quantized
                ``SharedMemBlock``'s ``tensor``), its rows read dequantized in the cache's
                dtype, as ``nvecache.common.quant.decode`` reads them.

        Returns:
            ``(values [N, dim], hit bool [N])``; ``keys[~hit]`` are the keys to insert.
        """
        keys = self._checks.keys(keys)
        table = self._checks.table(table, table_format)
        if validate:
            self._checks.linear_keys(keys, table.shape[0])
        values, hit = self._lookup_rows(keys, table, self._checks.candidates(candidates),
                                        host_table, err, fmt=table_format)
        assert hit is not None
        return values, hit

    def gather_linear(
        self, keys: torch.Tensor, table: torch.Tensor, *,
        candidates: MissCandidates | None, host_table: bool, err: torch.Tensor | None,
        table_format: RowFormat | None = None,
    ) -> torch.Tensor:
        """:meth:`lookup_linear` for a caller that checked its arguments (a layer's stack):
        no argument checks, no hit flags; keys outside the table read zero rows."""
        rotate = (self._lookups * _GOLDEN) & _INT32_MAX
        self._lookups += keys.numel()
        self._will_count(keys.numel())
        return self.ops.lookup(keys, table, candidates, host_table, err, None, rotate, False,
                               True, table_format)[0]

    def _lookup_rows(
        self, keys: torch.Tensor, table: torch.Tensor | None,
        cand: MissCandidates | None = None, host_table: bool = True,
        err: torch.Tensor | None = None, misses: MissList | None = None,
        fmt: RowFormat | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Probe + gather (+ misses from row ``key`` of ``table``), counted as a lookup;
        with ``misses`` (no ``table``) the misses are listed there and no hit flags are
        returned."""
        # NOTE: where a large batch is visited in host-page order, start it at a different
        # row each time (gpu.kernels.cache_lookup.page_order)
        rotate = (self._lookups * _GOLDEN) & _INT32_MAX
        self._lookups += keys.numel()
        self._will_count(keys.numel())
        return self.ops.lookup(keys, table, cand, host_table, err, misses, rotate,
                               misses is None, table is None, fmt)

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
        keys = self._checks.keys(keys)
        offsets, w, mv = self._checks.bags(
            keys.numel(), offsets, mode, per_sample_weights, miss_values, validate)
        if out_dtype is not None:
            out_dtype = row_dtype(out_dtype, "out_dtype")
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
        err: torch.Tensor | None = None, table_format: RowFormat | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`lookup_pooled` whose misses read row ``key`` of ``table`` in the same launch.

        ``candidates``, ``err`` and ``table_format`` as in :meth:`lookup_linear` (a
        quantized table's rows are dequantized in the cache's dtype, then pooled).

        Returns:
            ``(pooled [B, dim], hit bool [N])``; ``keys[~hit]`` are the keys to insert.
        """
        keys = self._checks.keys(keys)
        table = self._checks.table(table, table_format)
        offsets, w, _ = self._checks.bags(
            keys.numel(), offsets, mode, per_sample_weights, None, validate)
        if validate:
            self._checks.linear_keys(keys, table.shape[0])
        return self._pooled(keys, offsets, mode == "mean", w, None, table,
                            self._checks.candidates(candidates), err=err, fmt=table_format)

    def pool_linear(
        self, keys: torch.Tensor, offsets: torch.Tensor, table: torch.Tensor, mean: bool,
        weights: torch.Tensor | None, *, candidates: MissCandidates | None,
        err: torch.Tensor, check: bool, table_format: RowFormat | None = None,
    ) -> torch.Tensor:
        """:meth:`lookup_linear_pooled` for a caller that checked its arguments (a layer's
        stack), launched with ``table``, ``err`` and this cache's tables bound
        (``gpu.kernels.cache_pooled.BoundPooled``): they must be the same objects call
        after call. No argument checks, no hit flags; offsets as the kernel clamps them;
        keys outside the table read zero rows, reported in ``err`` with ``check``."""
        self._lookups += keys.numel()
        self._will_count(keys.numel())
        return self.ops.pool_linear(keys, offsets, mean, weights, table, candidates, err,
                                    check, table_format)

    def _pooled(
        self, keys: torch.Tensor, offsets: torch.Tensor, mean: bool, w: torch.Tensor | None,
        mv: torch.Tensor | None, table: torch.Tensor | None,
        cand: MissCandidates | None = None, out_dtype: torch.dtype | None = None,
        err: torch.Tensor | None = None, fmt: RowFormat | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._lookups += keys.numel()
        self._will_count(keys.numel())
        return self.ops.pooled(keys, offsets, mean, w, mv, table, cand, out_dtype, err, fmt)

    # ------------------------------------------------------------------ writes

    def insert(self, keys: torch.Tensor, values: torch.Tensor, *, validate: bool = True
               ) -> None:
        """Insert or overwrite rows (best effort: a full bucket evicts by policy).

        Duplicate keys keep their last occurrence; see ``gpu.cache.twin`` for the batch
        rules. Keys already cached are overwritten in place. No host sync with
        ``validate=False`` (then a key equal to the empty marker is skipped instead of
        raising: a batch may be padded with it).

        Raises:
            BadArgumentError: Bad keys/values, or a key equal to the reserved empty marker.
        """
        keys = self._checks.keys(keys)
        values = self._checks.rows(values, keys.numel())
        if keys.numel() == 0 or self.num_buckets == 0:
            return
        if validate and bool((keys == EMPTY_KEY).any()):
            raise BadArgumentError(
                f"key {EMPTY_KEY} (INT64_MIN) is reserved for empty slots; remap it")
        self.apply_insert(self.prepare_insert(keys), values)

    def prepare_insert(self, keys: torch.Tensor) -> PreparedInsert:
        """The half of ``insert(keys, ...)`` that reads nothing of the table (sorts of the
        batch; on the torch backend nothing): it may run on another stream while lookups
        use the cache (gpu.stacks.misses.split_round). ``keys``: int64 on this cache's device,
        non-empty, not checked."""
        return self.ops.prepare_insert(keys)

    def sort_insert_keys(self, keys: torch.Tensor, out: PreparedInsert, *,
                         small: bool = False) -> None:
        """``prepare_insert`` in two steps into reused buffers (``PreparedInsert.empty``
        of ``keys``' size), this the first: ``keys`` copied (they may change afterwards),
        then sorted. ``small``: each key is the empty marker or in ``[0, 2**31)``."""
        self.ops.sort_insert_keys(keys, out, small)

    def sort_insert_buckets(self, out: PreparedInsert) -> None:
        """The second step of ``prepare_insert`` into ``out``."""
        self.ops.sort_insert_buckets(out)

    def apply_insert(self, prepared: PreparedInsert, values: torch.Tensor) -> None:
        """The other half, in stream order: the placements ``insert`` makes of the
        prepared keys into the table as it is now, ``values[i]`` the row of the batch's
        key ``i`` (not checked)."""
        if self.num_buckets == 0:
            return
        self.ops.apply_insert(prepared, values)

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Overwrite the rows of keys that are cached; others are ignored.

        Returns:
            bool ``[N]``: whether each key was cached (and so updated).
        """
        keys = self._checks.keys(keys)
        values = self._checks.rows(values, keys.numel())
        slots, src, present = twin.plan_update(self._tkeys, self.num_buckets, self.ways, keys)
        self.ops.scatter(slots, values, src)
        self._updates += slots.numel()
        return present

    def erase(self, keys: torch.Tensor) -> None:
        """Remove ``keys`` from the cache (absent keys are ignored)."""
        keys = self._checks.keys(keys)
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

    @contextlib.contextmanager
    def warming_up(self) -> Iterator[None]:
        """Work whose effects are forgotten after it: every row dropped, the statistics as
        they were. For loading kernels at a layer's construction (the cache is empty then)
        with the very argument shapes its lookups and rounds will use."""
        saved = (self._hits.clone(), self.tables.insert_stats.clone(), self._lookups,
                 self._updates, self._erases)
        try:
            yield
        finally:
            self.clear()
            self._hits.copy_(saved[0])
            self.tables.insert_stats.copy_(saved[1])
            self._lookups, self._updates, self._erases = saved[2:]

    # ------------------------------------------------------------------ introspection

    def stats(self) -> GPUCacheStats:
        """Counters since creation (one host sync)."""
        hits = int(self._hits.sum())
        size = int((self._tkeys != EMPTY_KEY).sum()) if self.capacity else 0
        misses = self._lookups - hits
        inserts, evictions, _dropped = (int(x) for x in self.tables.insert_stats.tolist())
        return GPUCacheStats(
            capacity=self.capacity, size=size, hits=hits, misses=misses,
            inserts=inserts, evictions=evictions, updates=self._updates,
            erases=self._erases)

    def state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copies of ``(keys [slots], counters [slots], rows [slots, dim])`` on the CPU."""
        counters = self._counters.clamp_max(twin.COUNTER_MAX)  # see _will_count
        return self._tkeys.cpu(), counters.cpu(), self.tables.rows.cpu()

    def __repr__(self) -> str:
        return (f"GPUCache(slots={self.capacity}, ways={self.ways}, dim={self.dim}, "
                f"dtype={self.dtype}, device={self.device}, backend={self.backend!r})")
