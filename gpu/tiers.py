"""The tier stacks behind the layers: where a layer's rows come from, and how writes flow.

One class per :class:`~gpu.layer_config.LayerType`:

* :class:`DeviceTable` (GPULayer): the whole table in GPU-accessible memory.
* :class:`LinearTiers` (LinearUVM): GPU cache -> linear host table (``SharedMemBlock``).
* :class:`HierarchicalTiers`: GPU cache -> shared ``HostCache`` -> parameter server.

Consistency (the invalidation protocol). Before each lookup a stack reads the invalidation
ring of its shared table and drops those keys from its GPU cache (a reader that fell
behind the ring clears the cache). Rows fetched from lower tiers are admitted to the GPU
cache only if no change to their key was announced since the lookup began (the ring
cursor taken with the probe is checked again at admission: a two-phase protocol), and
rows from the parameter server enter the host cache with ``overwrite=False``, so a
concurrent ``update`` (which writes the PS first, then the host cache with
``insert_missing=True``, which announces every key) always wins.

Threads: GPU-cache operations run under a short lock; on CUDA each one is ordered after
the previous one through a CUDA event, so streams never race on the cache's memory.
Fetches from the host cache and the parameter server run outside the lock, so one
thread's misses never hold up another thread's hits.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from hostcache.ring import ChangeFeed

from .cache import GPUCache, MissCandidates
from .errors import KeyNotFoundError, StorageUnavailableError, StorageWriteError
from .inputs import check_range
from .key_flag import RangeCheck
from .layer_config import InsertPolicy, LayerStats, PoolingMode, TierStats
from .linear_tables import (
    add_user,
    registered_rows,
    remove_user,
    table_gate,
    write_linear,
    write_tensor,
)

logger = logging.getLogger(__name__)

#: admissions wait until this many missed keys (at most ``ADMIT_FRACTION`` of the cache)
#: ... or ``ADMIT_BATCHES`` lookups have gathered them. An insert round costs about the same
#: host time for 9k keys as for 50k, so larger rounds are cheaper per key, and a round that
#: samples ``WARM_ROUND_FRACTION`` of the cache from a larger pool favours keys that missed
#: often. H200, LinearUVM, 4M rows, 10% cache, Zipf 1.05, 64k-key lookups: 2048 / 1/64 / 8
#: gave 93 M keys/s at 86.6% hits, 1M / 1/4 / 32 gives 234 at 87.4% (1M keys: 495 -> 529).
#: Pending rows hold at most about ``ADMIT_FRACTION`` of the cache's memory.
ADMIT_KEYS = 1 << 20
ADMIT_FRACTION = 1 / 4
ADMIT_BATCHES = 32
#: at most this many of a GPU lookup's host-cache hits are reported to the host cache's
#: eviction policy (weighted by hits / sample), so its counters see the GPU's traffic.
HOST_TOUCH_SAMPLE = 4096
#: once the GPU cache has been offered as many keys as it has slots, one admission round
#: may bring in at most this fraction of its slots (a random sample of the round's miss
#: occurrences): a small cache then keeps its hot rows when lookups miss many cold keys.
WARM_ROUND_FRACTION = 1 / 8
#: LinearUVM on CUDA: lookups whose miss count is still on its way to the host; past this
#: many the oldest is waited for.
MAX_DEFERRED = 4
#: LinearUVM: a lookup copies out at most this many times the last known miss count of
#: candidates (at least ``MIN_CANDIDATES``); beyond it, the misses its kernel finds first.
CANDIDATE_HEADROOM = 2
MIN_CANDIDATES = 1024
#: LinearUVM: False takes the earlier path, one host sync per lookup to learn what missed
#: (bench_layers' baseline for it: sync-free measured 1.2-1.8x faster on the H200)
SYNC_FREE_ADMISSION = True


def pool_rows(
    rows: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None, mode: PoolingMode
) -> torch.Tensor:
    """Pool ``rows`` [N, dim] over bags ``offsets`` [B + 1] exactly as embedding_bag does."""
    idx = torch.arange(rows.shape[0], device=rows.device)
    return F.embedding_bag(
        idx, rows, offsets, mode=mode, per_sample_weights=weights, include_last_offset=True
    )


class Tiers:
    """Common machinery: the GPU cache, its lock and stream ordering, counters."""

    layer_type = "?"
    #: check offsets on the host (one sync each); linear tables also check their keys there
    #: (else on the device, gpu.key_flag). The CPU always checks.
    validate = False

    def __init__(self, dim: int, dtype: torch.dtype, device: torch.device,
                 cache_bytes: int) -> None:
        self.dim, self.dtype, self.device = dim, dtype, device
        self.cache = GPUCache(cache_bytes, dim, dtype, device)
        self._lock = threading.RLock()
        self._event: Any = None
        self._pending = []
        self._deferred = []
        self.default_rows = 0
        self.invalidated_keys = 0
        self.full_invalidations = 0

    @contextmanager
    def _cache_op(self) -> Iterator[None]:
        """Hold the cache lock; on CUDA order this op after the previous one on any stream."""
        with self._lock:
            if self.device.type == "cuda":
                stream = torch.cuda.current_stream(self.device)
                if self._event is not None:
                    stream.wait_event(self._event)
                yield
                self._event = torch.cuda.Event()
                self._event.record(stream)
            else:
                yield

    # -- reads (overridden) ---------------------------------------------------------------

    def rows(self, keys: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def pooled(self, keys: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
               mode: PoolingMode) -> torch.Tensor:
        return pool_rows(self.rows(keys), offsets, weights, mode)

    # -- writes (overridden) --------------------------------------------------------------

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def insert(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        raise NotImplementedError

    def erase(self, keys: torch.Tensor) -> None:
        with self._cache_op():
            self._drop_pending()
            self.cache.erase(keys.to(self.device))

    def clear(self) -> None:
        with self._cache_op():
            self._drop_pending()
            self.cache.clear()
            self._admitted = 0  # empty again: fill it at full speed

    # -- shared-table invalidation ----------------------------------------------------------

    _shared: ChangeFeed | None = None  # the shared table whose changes this stack follows
    _cursor = 0

    def _follow(self, table: ChangeFeed) -> None:
        self._shared = table
        self._cursor = table.change_cursor

    def _sync(self) -> int:
        """Apply announced changes to the GPU cache (caller holds the lock); the cursor."""
        if self._shared is None:
            return 0
        keys, cursor, overflowed = self._shared.changes_since(self._cursor)
        if overflowed:
            self.cache.clear()
            self._admitted = 0  # empty again: fill it at full speed
            self.full_invalidations += 1
        elif keys.numel():
            self.cache.erase(keys.to(self.device))
            self.invalidated_keys += int(keys.numel())
        self._cursor = cursor
        return cursor

    _admitted = 0  # keys sent to the GPU cache's insert so far
    #: admissions waiting for a round: (keys, rows, event recorded on the stream that
    #: produced them, CUDA only)
    _pending: list[tuple[torch.Tensor, torch.Tensor, Any]]
    _pending_since: int | None = None

    def _admit(self, keys: torch.Tensor, rows: torch.Tensor, since: int, prob: float) -> None:
        """Insert fetched rows into the GPU cache unless a change was announced meanwhile.

        Admissions are batched: a few misses per lookup wait (their rows already read)
        until ``ADMIT_KEYS`` keys or ``ADMIT_BATCHES`` lookups have gathered, so that a
        cache that mostly hits pays one insert per several lookups. Pending rows are
        checked against the ring from the earliest lookup's cursor when they go in, and
        dropped by any write through the layer. A round never admits more keys than the
        cache has slots, and once the cache is warm not more than ``WARM_ROUND_FRACTION``
        of them: beyond that, a random sample of the miss occurrences goes in.
        """
        if self.cache.capacity == 0 or keys.numel() == 0 or prob <= 0.0:
            return
        if prob < 1.0:
            keep = torch.rand(keys.numel(), device=keys.device) < prob
            keys, rows = keys[keep], rows[keep]
        ready = None
        if rows.is_cuda:
            # NOTE: another thread may run the round on its own stream: it waits for this
            # event before reading these rows (enqueued here, maybe not yet computed)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(rows.device))
        with self._lock:
            self._pending.append((keys, rows, ready))
            if self._pending_since is None:
                self._pending_since = since
            waiting = sum(int(k.numel()) for k, _, _ in self._pending)
            enough = min(ADMIT_KEYS, max(1, int(self.cache.capacity * ADMIT_FRACTION)))
            if waiting < enough and len(self._pending) < ADMIT_BATCHES:
                return
            pending = self._pending
            since = self._pending_since
            self._pending = []  # the round takes them (deferred candidates stay)
            self._pending_since = None
        if rows.is_cuda:
            stream = torch.cuda.current_stream(rows.device)
            for k, r, ev in pending:
                stream.wait_event(ev)
                # the caching allocator must not hand these blocks to their producing
                # stream again before this stream is done with them
                k.record_stream(stream)
                r.record_stream(stream)
        keys = torch.cat([k for k, _, _ in pending])
        rows = torch.cat([r for _, r, _ in pending])
        with self._cache_op():
            if self._shared is not None:
                changed, _, overflowed = self._shared.changes_since(since)
                if overflowed:
                    return
                if changed.numel():
                    keep = ~torch.isin(keys, changed.to(keys.device))
                    keys, rows = keys[keep], rows[keep]
            cap = self._round_cap()  # warm: a round replaces at most a fraction
            if keys.numel() > cap:
                # NOTE: admit a random sample of the miss occurrences, so keys that missed
                # often are likelier in
                keep = torch.randperm(keys.numel(), device=keys.device)[:cap]
                keys, rows = keys[keep], rows[keep]
            self._admitted += keys.numel()
            self.cache.insert(keys, rows, validate=False)

    def _drop_pending(self) -> None:
        """Forget every admission not yet made (a write made their rows stale)."""
        self._pending = []
        self._pending_since = None
        self._deferred = []

    def _round_cap(self) -> int:
        """The most keys the next admission round may bring in."""
        cap = self.cache.capacity
        if self._admitted >= cap:
            cap = max(1, int(cap * WARM_ROUND_FRACTION))
        return cap

    #: (candidate keys, their rows or None, miss count (pinned host tensor on CUDA), ready
    #: event or None, ring cursor of the lookup), oldest first
    _deferred: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, Any, int]]

    def gpu_stats(self) -> TierStats:
        s = self.cache.stats()
        return TierStats(s.hits, s.misses, s.inserts, s.evictions)

    def stats(self) -> LayerStats:
        return LayerStats(self.layer_type, self.gpu_stats(), None, None, self.default_rows,
                          None, self.invalidated_keys, self.full_invalidations)

    def close(self) -> None:
        pass


class LinearTiers(Tiers):
    """LinearUVM: GPU cache in front of a linear host table read zero-copy on misses."""

    layer_type = "LinearUVM"

    def __init__(self, storage: Any, dim: int, dtype: torch.dtype, device: torch.device,
                 cache_bytes: int, policy: InsertPolicy) -> None:
        super().__init__(dim, dtype, device, cache_bytes)
        self._policy = policy
        self._block = None
        self._reg = None
        if isinstance(storage, torch.Tensor):
            self.table = storage
        else:
            self._block = storage
            self._reg, self.table = registered_rows(storage, device)
            add_user(storage, self)
            self._follow(storage)
        #: the table is host memory read over the host link (a DistMemBlock is GPU memory)
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
        self.check.set_validate(value)

    def rows(self, keys: torch.Tensor) -> torch.Tensor:
        self.check(keys)
        self._drain()
        cand = self._candidates(keys.numel())
        with self._gate, self._cache_op():
            since = self._sync()
            values, hit = self.cache.lookup_linear(keys, self.table, validate=False,
                                                   candidates=cand, host_table=self._host,
                                                   err=self.check.err)
        self._admit_misses(keys, hit, since, values, cand)
        return values

    def pooled(self, keys: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
               mode: PoolingMode) -> torch.Tensor:
        if mode == "max":
            return super().pooled(keys, offsets, weights, mode)
        self.check(keys)
        self._drain()
        cand = self._candidates(keys.numel())
        with self._gate, self._cache_op():
            since = self._sync()
            out, hit = self.cache.lookup_linear_pooled(keys, offsets, self.table, mode, weights,
                                                      validate=False, candidates=cand,
                                                      err=self.check.err)
        self._admit_misses(keys, hit, since, None, cand)
        return out

    #: misses of the latest lookup whose count has arrived (None before the first)
    _last_misses: int | None = None

    def _admits(self, n: int) -> bool:
        return self.cache.capacity > 0 and self._policy.gpu > 0.0 and n > 0

    def _candidates(self, n: int) -> MissCandidates | None:
        """A buffer for the misses of a lookup of ``n`` keys (sync-free admissions): room
        for as many as a round may admit, and at most about twice the last miss count."""
        if not SYNC_FREE_ADMISSION or not self._admits(n):
            return None
        take = min(n, self._round_cap())
        if self._last_misses is not None:  # room for about as many rows as will miss
            take = min(take, max(MIN_CANDIDATES, CANDIDATE_HEADROOM * self._last_misses))
        return MissCandidates.empty(take, self.device)

    def _admit_misses(self, keys: torch.Tensor, hit: torch.Tensor, since: int,
                      values: torch.Tensor | None, cand: MissCandidates | None) -> None:
        """Offer the missed keys for admission (their rows already read by the lookup when
        ``values`` is given; duplicates are fine: insert keeps one copy of a key).

        Without a host sync (``cand`` given): the lookup kernel itself wrote its misses
        (count, keys, batch positions) into ``cand``; their rows are copied out now, on the
        stream, and only the count travels to the host. The candidates wait in
        ``_deferred`` until it has arrived (on the CPU at once): the lookup that made them
        never waits for its own kernel. Each is admitted with the policy's probability.
        """
        if cand is None:
            if SYNC_FREE_ADMISSION or not self._admits(keys.numel()):
                return
            miss = (~hit).nonzero().squeeze(1)  # one host sync: how many missed
            if miss.numel() == 0:
                return
            missed = keys.index_select(0, miss)
            rows = (values.index_select(0, miss) if values is not None
                    else self._table_rows(missed))
            self._admit(missed, rows, since, self._policy.gpu)
            return
        # NOTE: copied now, in stream order: the caller may overwrite ``values`` later
        cand_rows = values.index_select(0, cand.positions) if values is not None else None
        count = cand.count
        ready = None
        if count.is_cuda:
            host = torch.empty(1, dtype=count.dtype, pin_memory=True)
            host.copy_(count, non_blocking=True)
            count = host
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        with self._lock:
            self._deferred.append((cand.keys, cand_rows, count, ready, since))
        self._drain()

    def _table_rows(self, keys: torch.Tensor) -> torch.Tensor:
        """Rows ``keys`` of the linear table, on the layer's device."""
        with self._gate:
            return self.table.index_select(0, keys.to(self.table.device)).to(self.device)

    def _drain(self) -> None:
        """Admit deferred candidates whose miss count has arrived (oldest first; past
        ``MAX_DEFERRED`` waiting, wait for the oldest)."""
        while True:
            with self._lock:
                if not self._deferred:
                    return
                cand, rows, count, ready, since = self._deferred[0]
                if ready is not None and not ready.query():
                    if len(self._deferred) <= MAX_DEFERRED:
                        return
                else:
                    ready = None
                self._deferred.pop(0)
            if ready is not None:
                ready.synchronize()  # too many waiting: wait for the oldest (lock released)
            self._last_misses = int(count)
            m = min(self._last_misses, cand.numel())
            if m == 0:
                continue
            cand = cand[:m]
            # pooled lookups did not keep the rows: read the missed ones now
            rows = self._table_rows(cand) if rows is None else rows[:m]
            if cand.is_cuda:
                # produced on the lookup's stream (complete: its event has fired); used here
                stream = torch.cuda.current_stream(cand.device)
                cand.record_stream(stream)
                rows.record_stream(stream)
            self._admit(cand, rows, since, self._policy.gpu)

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        check_range(keys, self.num_rows, name="keys")
        if self._block is not None:
            write_linear(self._block, keys, values)  # gated, announced: every cache drops them
            with self._cache_op():
                self._drop_pending()
                self._sync()
        else:
            write_tensor(self._gate, self.table, keys, values)
            with self._cache_op():
                self._drop_pending()
                self.cache.erase(keys.to(self.device))
        return torch.ones(keys.numel(), dtype=torch.bool, device=keys.device)

    def insert(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.update(keys, values)

    def erase(self, keys: torch.Tensor) -> None:
        check_range(keys, self.num_rows, name="keys")
        super().erase(keys)

    def close(self) -> None:
        if self._reg is not None:
            self._reg.close()
            self._reg = None
        with self._lock:
            self._drop_pending()
        remove_user(self._block, self)


class HierarchicalTiers(Tiers):
    """GPU cache -> shared HostCache -> parameter server (any of the last two optional)."""

    layer_type = "Hierarchical"

    def __init__(self, host_cache: Any, storage: Any, dim: int, dtype: torch.dtype,
                 device: torch.device, cache_bytes: int, policy: InsertPolicy,
                 default_row: torch.Tensor | None) -> None:
        super().__init__(dim, dtype, device, cache_bytes)
        self.host = host_cache
        self.ps = storage
        self._policy = policy
        self._default = default_row
        self._reg = None
        if host_cache is not None:
            self._follow(host_cache)
            if device.type == "cuda":
                from .hostreg import register

                self._reg = register(host_cache, device)
        self._host = [0, 0, 0]  # hits, misses, admitted
        self._ps = [0, 0]  # found, missing

    def rows(self, keys: torch.Tensor) -> torch.Tensor:
        with self._cache_op():
            since = self._sync()
            values, hit = self.cache.lookup(keys)
        if bool(hit.all()):
            return values
        miss = (~hit).nonzero().squeeze(1)
        ukeys, inverse = torch.unique(keys[miss], return_inverse=True)
        urows, cacheable = self._fetch(ukeys, since)
        values[miss] = urows[inverse]
        self._admit(ukeys[cacheable], urows[cacheable], since, self._policy.gpu)
        return values

    def pooled(self, keys: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
               mode: PoolingMode) -> torch.Tensor:
        if mode == "max":
            return super().pooled(keys, offsets, weights, mode)
        with self._cache_op():
            since = self._sync()
            # NOTE: fp32 sums out of the kernel, so that missed rows join them before the
            # one rounding to the table's dtype (as embedding_bag rounds once)
            out, hit = self.cache.lookup_pooled(keys, offsets, mode, weights, validate=False,
                                                out_dtype=torch.float32)
        if bool(hit.all()):
            return out.to(self.dtype)
        miss = (~hit).nonzero().squeeze(1)
        ukeys, inverse = torch.unique(keys[miss], return_inverse=True)
        urows, cacheable = self._fetch(ukeys, since)
        contrib = urows[inverse].float()
        if weights is not None:
            contrib = contrib * weights[miss, None].float()
        bag = torch.searchsorted(offsets, miss, right=True) - 1
        if mode == "mean":
            length = (offsets[1:] - offsets[:-1]).float()
            contrib = contrib / length[bag, None]
        out.index_add_(0, bag, contrib)
        self._admit(ukeys[cacheable], urows[cacheable], since, self._policy.gpu)
        return out.to(self.dtype)

    def _host_lookup(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._reg is not None:
            from .host_kernels import hostcache_lookup

            values, hit = hostcache_lookup(self._reg, keys)
            hits = int(hit.sum())
            self.host.count_lookup(keys.numel(), hits)
            self._touch_host(keys, hit, hits)
            return values, hit
        return self.host.lookup(keys)

    def _touch_host(self, keys: torch.Tensor, hit: torch.Tensor, hits: int) -> None:
        """Report the GPU's host-cache hits to its eviction policy, as a CPU lookup does.

        A sample of at most ``HOST_TOUCH_SAMPLE`` hit keys goes to the CPU, each counted
        ``hits / sample`` times: the policy sees the traffic without a full copy."""
        if hits == 0:
            return
        hk = keys[hit]
        weight = 1
        if hits > HOST_TOUCH_SAMPLE:
            pick = torch.randint(0, hits, (HOST_TOUCH_SAMPLE,), device=hk.device)
            hk, weight = hk[pick], max(1, round(hits / HOST_TOUCH_SAMPLE))
        self.host.touch(hk.cpu(), weight)

    def _fetch(self, ukeys: torch.Tensor, since: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of distinct missed keys from the lower tiers: (rows, found).

        ``since`` is the ring cursor taken before anything was read: fills of keys
        announced after it are refused (their rows may predate the change)."""
        n = ukeys.numel()
        if self.host is not None:
            rows, found = self._host_lookup(ukeys)
            nh = int(found.sum())
            self._host[0] += nh
            self._host[1] += n - nh
        else:
            rows = torch.zeros(n, self.dim, dtype=self.dtype, device=self.device)
            found = torch.zeros(n, dtype=torch.bool, device=self.device)
        need = ~found
        if self.ps is not None and bool(need.any()):
            self._fetch_ps(ukeys, rows, found, need, since)
        missing = ~found
        if bool(missing.any()):
            if self._default is None:
                examples = ukeys[missing][:5].tolist()
                raise KeyNotFoundError(
                    f"{int(missing.sum())} keys are in no tier of this layer (e.g. {examples}); "
                    "load them into the parameter server, or pass default_row= to serve a "
                    "default row for missing keys"
                )
            rows[missing] = self._default
            self.default_rows += int(missing.sum())
        return rows, found

    def _fetch_ps(self, ukeys: torch.Tensor, rows: torch.Tensor, found: torch.Tensor,
                  need: torch.Tensor, since: int) -> None:
        from psclient import PSClientError

        need_keys = ukeys[need].cpu()
        try:
            values, ok = self.ps.lookup(need_keys)
        except PSClientError as e:
            if self._default is None:
                raise StorageUnavailableError(
                    f"the parameter server could not answer {need_keys.numel()} missed keys: "
                    f"{e}; cached rows are still served. Pass default_row= to serve a default "
                    "row for misses while it is down"
                ) from e
            logger.warning("parameter server unavailable (%s); serving default rows", e)
            return
        nf = int(ok.sum())
        self._ps[0] += nf
        self._ps[1] += need_keys.numel() - nf
        rows[need] = values.to(self.device)
        found[need] = ok.to(self.device)
        if self.host is not None and nf and self._policy.host > 0.0:
            admit = ok.clone()
            if self._policy.host < 1.0:
                admit &= torch.rand(admit.numel()) < self._policy.host
            if bool(admit.any()):
                self.host.insert(need_keys[admit], values[admit], overwrite=False, since=since)
                self._host[2] += int(admit.sum())

    # -- writes -----------------------------------------------------------------------------

    def _write(self, op: str, keys: torch.Tensor, values: torch.Tensor | None) -> torch.Tensor:
        """Write the parameter server first (the source of truth), then the host cache."""
        from psclient import PSClientError

        ck = keys.cpu()
        cv = values.cpu() if values is not None else None
        found = torch.ones(ck.numel(), dtype=torch.bool)
        if self.ps is not None:
            try:
                if op == "update":
                    found = self.ps.update(ck, cv)
                elif op == "insert":
                    self.ps.insert(ck, cv)
                else:
                    self.ps.erase(ck)
            except PSClientError as e:
                raise StorageWriteError(
                    f"{op} of {ck.numel()} keys failed at the parameter server: {e}; no tier "
                    "was changed, retry when it is reachable"
                ) from e
        if self.host is not None:
            if op == "erase":
                self.host.erase(ck)
            elif self.ps is None and op == "update":
                found = self.host.update(ck, cv)
            else:  # write-through that announces every key to every process
                assert cv is not None
                self.host.update(ck[found], cv[found], insert_missing=True)
        with self._cache_op():
            self._drop_pending()
            self._sync()
            if self.host is None:  # no ring to announce through: drop our own copies
                self.cache.erase(keys.to(self.device))
        return found.to(keys.device)

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return self._write("update", keys, values)

    def insert(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self._write("insert", keys, values)

    def erase(self, keys: torch.Tensor) -> None:
        self._write("erase", keys, None)

    def clear(self) -> None:
        """Drop every cached row (GPU cache, and the shared host cache for every process)."""
        if self.host is not None:
            self.host.clear()
        with self._cache_op():
            self._drop_pending()
            self._sync()
            self.cache.clear()
            self._admitted = 0  # empty again: fill it at full speed

    def stats(self) -> LayerStats:
        host = TierStats(self._host[0], self._host[1], self._host[2]) if self.host else None
        ps = TierStats(self._ps[0], self._ps[1]) if self.ps is not None else None
        node = self.host.stats() if self.host is not None else None
        return LayerStats(self.layer_type, self.gpu_stats(), host, ps, self.default_rows, node,
                          self.invalidated_keys, self.full_invalidations)

    def close(self) -> None:
        if self._reg is not None:
            self._reg.close()
            self._reg = None

