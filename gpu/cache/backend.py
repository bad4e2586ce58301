"""The GPU cache's backends: its Triton kernels and their torch twin, one method set.

A :class:`gpu.cache.gpu_cache.GPUCache` holds one backend object, built by
:func:`make_backend` over the cache's :class:`CacheTables`, and calls it for everything
whose implementation differs between the two: the probe, the lookups (plain, linear,
listing their misses), the pooled lookups, the row scatter and the insert's steps.

* :class:`TritonBackend`: the kernels of :mod:`gpu.kernels.cache_lookup`,
  :mod:`gpu.kernels.cache_pooled` and :mod:`gpu.kernels.cache_insert`, compiled for a CUDA
  cache or run by Triton's interpreter for a CPU one; launched with the cache's
  :class:`gpu.kernels.tiles.Tiles`.
* :class:`TorchBackend`: the same operations in torch ops (:mod:`gpu.cache.twin`), on any
  device, with identical table states and bit-exact gathers.

The choice is made once, by device unless the caller names one: ``"auto"`` is Triton on a
CUDA device where triton is importable, the torch twin otherwise; ``"triton"`` and
``"torch"`` force one (tests compare them on the CPU with ``backend="triton"``).
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

from gpu.cache import twin
from gpu.cache.records import MissCandidates, PreparedInsert
from gpu.errors import BadArgumentError
from gpu.kernels.tiles import DEFAULT_TILES, Tiles
from gpu.kernels.triton_access import kernel_module, triton_available
from hostcache.layout import EMPTY_KEY
from nvecache.common.rows import RowFormat

if TYPE_CHECKING:
    from gpu.stacks.misses.miss_list import MissList

__all__ = ["BACKENDS", "BackendName", "CacheBackend", "CacheTables", "TorchBackend",
           "TritonBackend", "make_backend"]

BackendName = Literal["auto", "torch", "triton"]
#: the names a cache's ``backend=`` argument takes
BACKENDS = ("auto", "torch", "triton")


class CacheTables:
    """The device tensors of one GPU cache.

    Slot ``b * ways + w`` is way ``w`` of bucket ``b``. Keys, counters and rows have one
    slot more than the table: the trash slot that insert plans write where a batch
    position writes nothing (``gpu.cache.twin.InsertPlan``); ``tkeys``, ``counters`` and
    ``rows`` are the views without it.
    """

    def __init__(self, num_buckets: int, ways: int, dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_buckets, self.ways = num_buckets, ways
        capacity = num_buckets * ways
        self.tkeys_all = torch.full((capacity + 1,), EMPTY_KEY, dtype=torch.int64,
                                    device=device)
        self.counters_all = torch.zeros(capacity + 1, dtype=torch.int32, device=device)
        self.rows_all = torch.zeros((capacity + 1, dim), dtype=dtype, device=device)
        self.tkeys = self.tkeys_all[:capacity]
        self.counters = self.counters_all[:capacity]
        self.rows = self.rows_all[:capacity]
        #: hit counts, striped to spread the kernels' atomics (summed on read)
        self.hits = torch.zeros(twin.STAT_STRIPES, dtype=torch.int64, device=device)
        #: inserts, evictions, dropped keys: counted on the device (insert makes no sync)
        self.insert_stats = torch.zeros(3, dtype=torch.int64, device=device)


class CacheBackend(Protocol):
    """What a GPU cache asks of its backend. Arguments are checked by the cache."""

    #: ``"triton"`` or ``"torch"``
    name: str

    def probe(self, keys: torch.Tensor, record: bool) -> torch.Tensor:
        """Slots of ``keys`` (-1 where absent); ``record``: count hits and bump counters."""
        ...

    def lookup(self, keys: torch.Tensor, table: torch.Tensor | None,
               cand: MissCandidates | None, host_table: bool, err: torch.Tensor | None,
               misses: MissList | None, rotate: int, want_hit: bool, bind: bool,
               fmt: RowFormat | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows of ``keys`` (misses from row ``key`` of ``table``, or zero), counted; see
        ``GPUCache.lookup_linear`` for ``cand``, ``host_table``, ``err`` and
        ``GPUCache.serve`` for ``misses``. ``rotate``: where a page-ordered visit starts;
        ``want_hit``: return hit flags (else None may come back); ``bind``: the call's
        ``table`` and ``err`` are the same objects call after call (a bound launch);
        ``fmt``: a quantized ``table``'s format (its stored bytes, read dequantized)."""
        ...

    def pooled(self, keys: torch.Tensor, offsets: torch.Tensor, mean: bool,
               weights: torch.Tensor | None, miss_values: torch.Tensor | None,
               table: torch.Tensor | None, cand: MissCandidates | None,
               out_dtype: torch.dtype | None, err: torch.Tensor | None,
               fmt: RowFormat | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Pooled rows per bag and hit flags (``GPUCache.lookup_pooled``), counted;
        ``fmt`` as for :meth:`lookup`."""
        ...

    def pool_linear(self, keys: torch.Tensor, offsets: torch.Tensor, mean: bool,
                    weights: torch.Tensor | None, table: torch.Tensor,
                    cand: MissCandidates | None, err: torch.Tensor, check: bool,
                    fmt: RowFormat | None = None) -> torch.Tensor:
        """Pooled rows per bag of a linear lookup (``GPUCache.pool_linear``), counted, no
        hit flags; ``table`` and ``err`` are the same objects call after call (a bound
        launch); ``check``: report keys outside ``table`` in ``err``."""
        ...

    def scatter(self, target: torch.Tensor, values: torch.Tensor, src: torch.Tensor) -> None:
        """``rows_all[target] = values[src]`` (``target`` may name the trash slot)."""
        ...

    def prepare_insert(self, keys: torch.Tensor) -> PreparedInsert: ...

    def sort_insert_keys(self, keys: torch.Tensor, out: PreparedInsert, small: bool
                         ) -> None: ...

    def sort_insert_buckets(self, out: PreparedInsert) -> None: ...

    def apply_insert(self, prepared: PreparedInsert, values: torch.Tensor) -> None: ...


def make_backend(backend: object, tables: CacheTables, device: torch.device,
                 tiles: Tiles = DEFAULT_TILES) -> TritonBackend | TorchBackend:
    """The backend named ``backend`` (one of :data:`BACKENDS`) over ``tables``.

    Raises:
        BadArgumentError: An unknown name, or ``tiles`` not a :class:`Tiles`.
        TritonUnavailableError: ``"triton"`` without the triton package.
    """
    if not isinstance(tiles, Tiles):
        raise BadArgumentError(f"tiles must be a gpu.kernels.tiles.Tiles; got {tiles!r}")
    if chosen_backend(backend, device) == "triton":
        return TritonBackend(tables, device, tiles)
    return TorchBackend(tables)


def chosen_backend(backend: object, device: torch.device) -> str:
    """The backend (``"triton"`` or ``"torch"``) that ``backend`` (one of :data:`BACKENDS`)
    names on ``device``: ``"auto"`` is Triton on CUDA where the package is installed.

    Raises:
        BadArgumentError: An unknown name.
    """
    if backend not in BACKENDS:
        raise BadArgumentError(f"backend must be 'auto', 'torch' or 'triton'; got {backend!r}")
    if backend == "triton" or (backend == "auto" and device.type == "cuda"
                               and triton_available()):
        return "triton"
    return "torch"


class TritonBackend:
    """The Triton kernels (compiled on CUDA, interpreted on the CPU) over one cache."""

    name = "triton"

    def __init__(self, tables: CacheTables, device: torch.device, tiles: Tiles) -> None:
        interpret = device.type != "cuda"
        self._lookups: ModuleType = kernel_module("cache_lookup", interpret=interpret)
        self._pooled: ModuleType = kernel_module("cache_pooled", interpret=interpret)
        self._writes: ModuleType = kernel_module("cache_insert", interpret=interpret)
        self._t = tables
        self.tiles = tiles
        #: the lookups' launches with this cache's tables bound (gpu.kernels.launch.BoundLaunch)
        self.bound: dict[tuple[Any, ...], Any] = {}

    def probe(self, keys: torch.Tensor, record: bool) -> torch.Tensor:
        t = self._t
        _, _, slots = self._lookups.lookup(
            keys, t.tkeys, t.counters, t.rows, t.hits, t.num_buckets, t.ways,
            empty=EMPTY_KEY, gather=False, count=record, want_slots=True,
            cmax=twin.COUNTER_MAX, tiles=self.tiles)
        assert slots is not None
        return slots

    def lookup(self, keys: torch.Tensor, table: torch.Tensor | None,
               cand: MissCandidates | None, host_table: bool, err: torch.Tensor | None,
               misses: MissList | None, rotate: int, want_hit: bool, bind: bool,
               fmt: RowFormat | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = self._t
        out, hit, _ = self._lookups.lookup(
            keys, t.tkeys, t.counters, t.rows, t.hits, t.num_buckets, t.ways,
            empty=EMPTY_KEY, gather=True, count=True, want_slots=False, table=table,
            candidates=cand.buffer if cand is not None else None, host_table=host_table,
            cmax=twin.COUNTER_MAX, rotate=rotate, err=err,
            candidate_rows=cand.rows if cand is not None else None,
            misses=(misses.counter, misses.start, misses.view) if misses is not None else None,
            bound=self.bound if bind else None, want_hit=want_hit, tiles=self.tiles,
            table_format=fmt)
        assert out is not None
        return out, hit

    def pooled(self, keys: torch.Tensor, offsets: torch.Tensor, mean: bool,
               weights: torch.Tensor | None, miss_values: torch.Tensor | None,
               table: torch.Tensor | None, cand: MissCandidates | None,
               out_dtype: torch.dtype | None, err: torch.Tensor | None,
               fmt: RowFormat | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        t = self._t
        return self._pooled.pooled(
            keys, offsets, weights, miss_values, t.tkeys, t.counters, t.rows, t.hits,
            t.num_buckets, t.ways, mean=mean, empty=EMPTY_KEY, table=table,
            candidates=cand.buffer if cand is not None else None, cmax=twin.COUNTER_MAX,
            out_dtype=out_dtype, err=err,
            candidate_rows=cand.rows if cand is not None else None, tiles=self.tiles,
            table_format=fmt)

    def pool_linear(self, keys: torch.Tensor, offsets: torch.Tensor, mean: bool,
                    weights: torch.Tensor | None, table: torch.Tensor,
                    cand: MissCandidates | None, err: torch.Tensor, check: bool,
                    fmt: RowFormat | None = None) -> torch.Tensor:
        key = ("pooled", id(table), id(err), fmt)
        launch = self.bound.get(key)
        if launch is None:
            if len(self.bound) >= 16:  # NOTE: a caller passing new tables: bounded
                self.bound.clear()
            t = self._t
            launch = self.bound[key] = self._pooled.BoundPooled(
                table, err, dim=t.rows.shape[1], dtype=t.rows.dtype, tiles=self.tiles,
                fmt=fmt, device=t.rows.device, cache=self._pooled.PooledCache(
                    t.tkeys, t.counters, t.rows, t.hits, t.num_buckets, t.ways, EMPTY_KEY,
                    twin.COUNTER_MAX))
        if cand is None:
            return launch(keys, offsets, weights, mean, check)
        return launch(keys, offsets, weights, mean, check, cand.buffer, cand.rows)

    def scatter(self, target: torch.Tensor, values: torch.Tensor, src: torch.Tensor) -> None:
        self._writes.scatter_rows(self._t.rows_all, target, values, src, tiles=self.tiles)

    def prepare_insert(self, keys: torch.Tensor) -> PreparedInsert:
        return self._writes.prepare_insert(keys, self._t.num_buckets, tiles=self.tiles)

    def sort_insert_keys(self, keys: torch.Tensor, out: PreparedInsert, small: bool) -> None:
        self._writes.sort_keys(keys, out, small)

    def sort_insert_buckets(self, out: PreparedInsert) -> None:
        self._writes.sort_buckets(out, self._t.num_buckets, tiles=self.tiles)

    def apply_insert(self, prepared: PreparedInsert, values: torch.Tensor) -> None:
        t = self._t
        self._writes.apply_insert(prepared, values, t.tkeys, t.counters, t.rows_all,
                                  t.insert_stats, t.num_buckets, t.ways,
                                  cmax=twin.COUNTER_MAX, decay_at=twin.DECAY_AT,
                                  tiles=self.tiles)


class TorchBackend:
    """The torch twin (:mod:`gpu.cache.twin`) over one cache, on any device."""

    name = "torch"
    #: launch settings do not apply to torch ops
    tiles = None

    def __init__(self, tables: CacheTables) -> None:
        self._t = tables

    def _probe_counted(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self._t
        hit, slot = twin.probe(t.tkeys, t.num_buckets, t.ways, keys)
        twin.bump(t.counters, slot, hit)
        twin.count_hits(t.hits, hit)
        return hit, slot

    def probe(self, keys: torch.Tensor, record: bool) -> torch.Tensor:
        if record:
            return self._probe_counted(keys)[1]
        t = self._t
        return twin.probe(t.tkeys, t.num_buckets, t.ways, keys)[1]

    def lookup(self, keys: torch.Tensor, table: torch.Tensor | None,
               cand: MissCandidates | None, host_table: bool, err: torch.Tensor | None,
               misses: MissList | None, rotate: int, want_hit: bool, bind: bool,
               fmt: RowFormat | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        # NOTE: host_table, rotate and bind only change how the kernels run; err is the
        # kernels' device-side key check (the twin's callers check keys on the host)
        hit, slot = self._probe_counted(keys)
        if misses is not None:
            twin.list_misses(misses.counter, misses.start, misses.view, keys, hit)
        if table is None:
            return twin.gather(self._t.rows, slot, hit), hit
        vals = twin.gather_linear(self._t.rows, slot, hit, keys, table, fmt)
        if cand is not None:
            twin.collect_misses(cand.buffer, keys, hit, table.shape[0], vals, cand.rows)
        return vals, hit

    def pooled(self, keys: torch.Tensor, offsets: torch.Tensor, mean: bool,
               weights: torch.Tensor | None, miss_values: torch.Tensor | None,
               table: torch.Tensor | None, cand: MissCandidates | None,
               out_dtype: torch.dtype | None, err: torch.Tensor | None,
               fmt: RowFormat | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        hit, slot = self._probe_counted(keys)
        rows = self._t.rows
        if table is not None:
            vals = twin.gather_linear(rows, slot, hit, keys, table, fmt)
            if cand is not None:
                twin.collect_misses(cand.buffer, keys, hit, table.shape[0], vals, cand.rows)
        else:
            vals = twin.gather(rows, slot, hit)
            if miss_values is not None:
                vals = torch.where(hit[:, None], vals, miss_values)
        return twin.pool(vals, offsets, weights, mean, out_dtype or rows.dtype), hit

    def pool_linear(self, keys: torch.Tensor, offsets: torch.Tensor, mean: bool,
                    weights: torch.Tensor | None, table: torch.Tensor,
                    cand: MissCandidates | None, err: torch.Tensor, check: bool,
                    fmt: RowFormat | None = None) -> torch.Tensor:
        # NOTE: err is the kernels' device-side key check (the twin's callers check keys on
        # the host)
        return self.pooled(keys, offsets, mean, weights, None, table, cand, None, None,
                           fmt)[0]

    def scatter(self, target: torch.Tensor, values: torch.Tensor, src: torch.Tensor) -> None:
        self._t.rows_all[target] = values[src]

    def prepare_insert(self, keys: torch.Tensor) -> PreparedInsert:
        # NOTE: the twin plans the whole insert at apply time: only the keys are kept
        return PreparedInsert(keys, *(keys[:0],) * 6)

    def sort_insert_keys(self, keys: torch.Tensor, out: PreparedInsert, small: bool) -> None:
        if keys is not out.keys:
            out.keys.copy_(keys)

    def sort_insert_buckets(self, out: PreparedInsert) -> None:
        return None

    def apply_insert(self, prepared: PreparedInsert, values: torch.Tensor) -> None:
        t = self._t
        plan = twin.plan_insert(t.tkeys, t.counters, t.num_buckets, t.ways, prepared.keys)
        t.counters_all[plan.decay_target] = plan.decay_values
        t.tkeys_all[plan.key_target] = plan.new_keys
        t.counters_all[plan.key_target] = plan.new_counters
        self.scatter(plan.row_target, values, plan.row_src)
        t.insert_stats += torch.stack([plan.placed, plan.evictions, plan.dropped])
