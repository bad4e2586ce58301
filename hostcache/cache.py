"""``HostCache``: a set-associative embedding cache in one POSIX shared-memory segment.

Every process of the node maps the same segment. Readers never lock: each lookup reads a
slot's version, its key and row, then the version again, and treats a changed or odd
version as a miss (seqlock; see ``hostcache.layout``). Writers (insert, update,
accumulate, erase, clear) take the table's robust writer lock. All paths are vectorized
over the batch.

Eviction policy ``lfu-da`` (LFU with dynamic aging, per bucket): a hit adds one to its
slot's counter; a new key takes an empty way, else the way with the smallest counter
(ties: lowest way), and starts at the victim's counter + 1, so new keys are not evicted at
once by old heavy hitters, and old counts decay relative to new ones. A bucket whose
counters pass 2**30 has them halved.
"""

from __future__ import annotations

from typing import NamedTuple, Self

import numpy as np
import torch

from hostcache import layout
from hostcache.cache_probes import CacheProbes
from hostcache.errors import BadArgumentError, NonFiniteValuesError
from hostcache.row_bytes import RowBytes
from hostcache.segment import Mapping, check_mode
from hostcache.table import (
    C_ERASES,
    C_EVICTIONS,
    C_HITS,
    C_INSERTS,
    C_LOOKUPS,
    C_MISSES,
    C_UPDATES,
    SharedTable,
)
from hostcache.table_files import TableFiles
from hostcache.table_twin import GATE as LOOPS
from hostcache.validate import check_cache_keys
from nvecache.common import quant
from nvecache.common.accumulate import added, check_deltas, sum_duplicates
from nvecache.common.fanout import split_run
from nvecache.common.rows import LAYER_DTYPES, RowFormat, torch_dtype

_COUNTER_CAP = 1 << 30
#: the dtypes a quantized cache's lookup decodes into (``out=``): a layer's output dtypes
_DECODED = tuple(torch_dtype(name) for name in LAYER_DTYPES)


#: the per-key loops for this call: compiled (:mod:`hostcache.table_loops`) once they are
#: ready, their numpy twin (:mod:`hostcache.table_twin`) until then; the first call asks
#: for them (nvecache.common.loop_gate: compiled in a child process, then loaded here), so a
#: process never waits for numba
_loops = LOOPS.pick


class Inserted(NamedTuple):
    """What one :meth:`HostCache.insert` did."""

    #: new keys placed, plus cached keys overwritten (with ``overwrite=True``)
    written: int
    #: resident keys it displaced
    evicted: int


class HostCache(TableFiles, SharedTable, CacheProbes):
    """One embedding cache shared by every process of the node.

    Create it once (``HostCache.create``) and attach it anywhere (``HostCache.attach``);
    a handle pickles by name, so it can be passed to a spawned process.
    """

    KIND = layout.KIND_HOST_CACHE

    @classmethod
    def create(
        cls,
        name: str,
        *,
        capacity: int,
        dim: int,
        dtype: torch.dtype = torch.float32,
        ways: int = 8,
        policy: str = "lfu-da",
        ring_capacity: int = layout.DEFAULT_RING_CAPACITY,
        mode: int = 0o600,
        overcommit: bool = False,
    ) -> Self:
        """Create the named cache on this node.

        Args:
            name: ``[A-Za-z0-9_.-]{1,100}``; the segment is ``/dev/shm/nvec.<name>``.
            capacity: rows it can hold (rounded up to whole buckets of ``ways`` slots).
            dim: elements per row.
            dtype: float32, float16, bfloat16 or float64; or a quantized format (int8,
                float8_e4m3fn): rows written as float rows are stored quantized
                (:mod:`nvecache.common.quant`) and read back dequantized, in float32.
            ways: slots per bucket (4, 8, 16 or 32).
            policy: eviction policy; ``"lfu-da"``.
            ring_capacity: records in the invalidation ring.
            mode: permission bits of the segment and its lock file (0o600 by default).
            overcommit: create it even if it is larger than the free space of ``/dev/shm``
                (the segment is sparse; writing past the free space kills the writer).

        Raises:
            SegmentExistsError: a table of that name exists.
            BadArgumentError: an argument is out of range.
            SharedMemoryFullError: ``/dev/shm`` has no room for it (and not ``overcommit``).
        """
        check_mode(mode)
        geo = layout.plan(
            layout.KIND_HOST_CACHE,
            capacity=capacity,
            dim=dim,
            dtype=dtype,
            ways=ways,
            policy=policy,
            ring_capacity=ring_capacity,
        )
        return cls._create_segment(name, geo, mode, overcommit)

    @classmethod
    def attach(
        cls, name: str, *, dim: int | None = None, dtype: torch.dtype | None = None
    ) -> Self:
        """Attach the named cache; geometry comes from its header.

        ``dim``/``dtype``, when given, must match the header (else GeometryMismatchError).
        """
        return cls._attach_segment(name, dim=dim, dtype=dtype)

    def _map_views(self, mapping: Mapping, geo: layout.Geometry) -> None:
        slots, ways = geo.slots, geo.ways
        self._keys = mapping.tensor(geo.keys_off, slots, torch.int64)
        self._versions = mapping.tensor(geo.versions_off, slots, torch.int64)
        self._policy = mapping.tensor(geo.counters_off, slots, torch.int32)
        raw = mapping.tensor(geo.rows_off, slots * geo.row_stride, torch.uint8)
        #: the rows between torch and their stored bytes (a quantized cache's encoded)
        self._codec = codec = RowBytes(geo.row_format)
        stored = raw.view(slots, geo.row_stride)[:, :codec.width]
        self._rows = stored if codec.quantized else stored.view(geo.dtype)
        # NOTE: numpy views of the same pages for the compiled loops (hostcache.table_loops);
        # rows as raw bytes, whole strides, of which each loop uses the first row_bytes
        self._nkeys = self._keys.numpy()
        self._nversions = self._versions.numpy()
        self._npolicy = self._policy.numpy()
        #: the slots' keys and policy counters again, as ``[buckets, ways]``
        self._bucket_keys: np.ndarray = self._nkeys.reshape(-1, ways)
        self._bucket_policy: np.ndarray = self._npolicy.reshape(-1, ways)
        self._nraw = raw.view(slots, geo.row_stride).numpy()

    @property
    def row_format(self) -> RowFormat:
        """How a row is stored (its format, bytes and stride): what a kernel reading the
        registered rows is told."""
        return self.geometry.row_format

    @property
    def quantized(self) -> bool:
        """Whether the rows are stored quantized (lookups dequantize them)."""
        return self.geometry.row_format.quantized

    def _drop_views(self) -> None:
        empty = torch.empty(0)
        self._keys = self._versions = self._policy = self._rows = empty
        none = np.empty(0, dtype=np.int64)
        self._nkeys = self._bucket_keys = self._nversions = self._npolicy = none
        self._bucket_policy = self._nraw = none

    # -- reads ---------------------------------------------------------------------------

    def lookup(
        self, keys: torch.Tensor, *, count: bool = True, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``keys`` (int64 CPU [N]): ``(values [N, dim], hit bool [N])``.

        Missing keys give zero rows. Never takes a lock; never returns a torn row.
        ``count=False`` is a peek: no hit counters or policy counters change. ``out``: a
        contiguous CPU ``[N, dim]`` tensor of the table's dtype to read the rows into
        (returned as ``values``), instead of a new one. A quantized cache's rows are
        returned dequantized, in float32; or in ``out``'s dtype, float32, float16 or
        bfloat16, decoded straight into it (bit for bit
        ``quant.decode(stored, fmt, out.dtype)``: what a layer of that dtype reads).
        """
        keys = check_cache_keys(keys)
        geo, codec = self.geometry, self._codec
        n = keys.numel()
        want = codec.out_dtype
        if out is None:
            out = torch.empty((n, geo.dim), dtype=want)
        elif ((out.dtype != want and not (codec.quantized and out.dtype in _DECODED))
              or out.shape != (n, geo.dim) or out.device.type != "cpu"
              or not out.is_contiguous() or out.stride(-1) != 1):
            dtypes = (", ".join(str(d) for d in _DECODED) if codec.quantized else str(want))
            raise BadArgumentError(
                f"out must be a contiguous CPU tensor of shape ({n}, {geo.dim}) and dtype "
                f"{dtypes}; got {tuple(out.shape)} {out.dtype} on {out.device}, strides "
                f"{out.stride()}")
        if codec.quantized:  # NOTE: the stored bytes read seqlocked, then decoded into out
            stored = torch.empty((n, codec.width), dtype=torch.uint8)
            hit = self._read(keys, stored, count)
            quant.decode(stored, codec.fmt, out=out)
            return out, hit
        return out, self._read(keys, out, count)

    def _read(self, keys: torch.Tensor, out: torch.Tensor, count: bool) -> torch.Tensor:
        """The seqlocked lookup of checked keys into ``out`` (rows as stored); bool hits."""
        geo, n = self.geometry, keys.numel()
        self._live()
        # NOTE: one compiled call: the probe, then the seqlock window (version, row and
        # key, version) over every slot, fenced apart (hostcache.table_loops.lookup). A hit
        # needs an even version that did not change and the key still in place inside the
        # window, so the row belongs to the key even if writers moved keys meanwhile.
        keys_np, rows = keys.numpy(), out.view(torch.uint8).numpy()
        hit = np.empty(n, np.bool_)

        def chunk(lo: int, hi: int) -> int:
            return int(_loops().lookup(self._nkeys, self._bucket_keys, self._nversions,
                                       self._nraw, self._npolicy, geo.num_buckets,
                                       keys_np[lo:hi], rows[lo:hi], hit[lo:hi], count))

        # NOTE: a large batch on a few threads at once (nvecache.common.fanout: the loop waits on
        # memory and releases the GIL)
        n_hits = sum(split_run(chunk, n))
        if count:
            counters = self._counters
            counters[C_LOOKUPS] += 1
            counters[C_HITS] += n_hits
            counters[C_MISSES] += n - n_hits
        return torch.from_numpy(hit)

    # -- writes --------------------------------------------------------------------------

    def _write_seqlocked(self, slots: np.ndarray, keys: np.ndarray, rows: np.ndarray,
                         src: np.ndarray, policy: np.ndarray, with_rows: bool,
                         with_policy: bool) -> None:
        """The seqlock write: versions odd (readers treat the slots as misses), the new
        contents, versions even again (committed); each a compiled call of its own."""
        _loops().bump_versions(self._nversions, slots)
        _loops().write_slots(self._nkeys, self._nraw, self._npolicy, slots, keys, rows,
                             src, policy, with_rows, with_policy)
        _loops().bump_versions(self._nversions, slots)

    def insert(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        overwrite: bool = True,
        since: int | None = None,
        allow_nonfinite: bool = False,
    ) -> Inserted:
        """Insert rows, best effort: evicts by policy; returns what it wrote and evicted.

        Args:
            keys: int64 CPU ``[N]``; duplicates: the last occurrence wins.
            values: ``[N, dim]`` rows of the table's dtype (a quantized cache: float rows, or
                its stored bytes, uint8 ``[N, stored_bytes]``).
            overwrite: Keys already cached get the new row (and every process's GPU cache
                drops them). ``False`` leaves cached keys as they are: the safe way to fill
                the cache with rows read from a parameter server, since a concurrent
                ``update`` that got there first is never overwritten with an older row.
            since: a ring cursor (:attr:`change_cursor`) taken before the rows were read:
                keys announced since then are not inserted (their rows may be older than
                the change), and nothing is if the ring overflowed since. Together with
                ``overwrite=False`` this makes a fill from the parameter server safe
                against any concurrent update, here or on another node.
            allow_nonfinite: write rows holding NaN or infinite values too (a fill passes
                the rows a parameter server holds as they are).

        When more new keys than ``ways`` fall in one bucket in one batch, the extra ones
        are not inserted.

        Raises:
            BadArgumentError: bad keys (the reserved ``INT64_MIN``) or values.
            NonFiniteValuesError: a row holds NaN or an infinity and not
                ``allow_nonfinite``.
            Nothing is written when one of these is raised.
        """
        _, written, evicted = self._upsert(keys, values, overwrite=overwrite,
                                           announce_new=False, since=since,
                                           allow_nonfinite=allow_nonfinite)
        return Inserted(written, evicted)

    def announce(self, keys: torch.Tensor) -> None:
        """Append keys to the invalidation ring without touching rows: tell every process
        that these keys changed elsewhere (a node service following a parameter server's
        change feed announces keys it does not hold, so in-flight fills of them are refused).
        """
        keys = check_cache_keys(keys)
        if keys.numel():
            with self._writing():
                self.ring.append(torch.unique(keys))

    def _upsert(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        overwrite: bool,
        announce_new: bool,
        since: int | None = None,
        allow_nonfinite: bool = False,
    ) -> tuple[torch.Tensor, int, int]:
        """Write present keys (if ``overwrite``) and place absent ones: (bool [N] present,
        keys written, keys evicted)."""
        keys = check_cache_keys(keys)
        codec = self._codec
        values = codec.accept(values, keys, allow_nonfinite=allow_nonfinite)
        if keys.numel() == 0:
            return torch.zeros(0, dtype=torch.bool), 0, 0
        keys_np = keys.numpy()
        with self._writing():
            ukeys, last, inverse = _loops().dedup_last(keys_np)
            refused = False
            if since is not None:
                changed, _, overflowed = self.ring.changes_since(since)
                if overflowed:
                    return torch.zeros(keys.numel(), dtype=torch.bool), 0, 0
                if changed.numel():
                    fresh = ~np.isin(ukeys, changed.numpy())
                    ukeys, last = ukeys[fresh], last[fresh]
                    refused = True
            # NOTE: rows travel as positions in `values` until the one copy that feeds each
            # write: copying them on the way cost an insert a good part of its time
            slot, found = self._probe(ukeys)
            old_slots = slot[found]
            rows = codec.raw(values)
            if overwrite and old_slots.size:
                # keys already present: overwrite in place, tell the others
                self._write_seqlocked(old_slots, ukeys[found], rows, last[found],
                                      self._npolicy[:0], True, False)
            new = ~found
            written, evicted = 0, 0
            if new.any():
                # NOTE: an absent key's probed slot is way 0 of its bucket
                written, evicted = self._insert_new(ukeys[new], rows, last[new],
                                                    slot[new] // self.geometry.ways, old_slots)
            announced = ukeys if announce_new else ukeys[found] if overwrite else ukeys[:0]
            self.ring.append(torch.from_numpy(announced))
            counters = self._counters
            written += int(found.sum()) if overwrite else 0
            counters[C_INSERTS] += written
            counters[C_EVICTIONS] += evicted
        if refused:  # some keys were refused: report the found ones by key
            return torch.from_numpy(np.isin(keys_np, ukeys[found])), written, evicted
        return torch.from_numpy(found[inverse]), written, evicted

    def _insert_new(self, keys: np.ndarray, rows: np.ndarray, src: np.ndarray,
                    bucket: np.ndarray, protected_slots: np.ndarray) -> tuple[int, int]:
        """Place keys that are not cached (key ``i``'s row is ``rows[src[i]]``, raw bytes;
        the ways of ``protected_slots`` are not taken); returns (written, evicted). Under
        the lock."""
        slot, placed_keys, placed_src, placed_policy, touched, filled = _loops().plan_new(
            self._bucket_keys, self._bucket_policy, keys, src, bucket, np.sort(protected_slots))
        if slot.size:
            self._write_seqlocked(slot, placed_keys, rows, placed_src, placed_policy, True, True)
        self._header[layout.W_SIZE] += filled
        _loops().decay(self._bucket_policy, touched, _COUNTER_CAP)
        return int(slot.size), int(slot.size) - filled

    def update(
        self, keys: torch.Tensor, values: torch.Tensor, *, insert_missing: bool = False,
        allow_nonfinite: bool = False,
    ) -> torch.Tensor:
        """Overwrite rows of cached keys; returns bool [N] of keys that were cached.

        Every process's next lookup sees the new rows (their GPU caches drop the keys).
        With ``insert_missing`` the other keys are inserted too and announced as well (the
        write-through of a layer's ``update``: a replica that read the old row from the
        parameter server just before is told to drop it). Rows holding NaN or an infinity
        raise :class:`NonFiniteValuesError` (nothing written) unless ``allow_nonfinite``.
        """
        if insert_missing:
            present, _, _ = self._upsert(keys, values, overwrite=True, announce_new=True,
                                         allow_nonfinite=allow_nonfinite)
            self._counters[C_UPDATES] += int(present.sum())
            return present
        keys = check_cache_keys(keys)
        codec = self._codec
        values = codec.accept(values, keys, allow_nonfinite=allow_nonfinite)
        if keys.numel() == 0:
            return torch.zeros(0, dtype=torch.bool)
        with self._writing():
            ukeys, last, inverse = _loops().dedup_last(keys.numpy())
            slot, found = self._probe(ukeys)
            if found.any():
                self._write_seqlocked(slot[found], ukeys[found], codec.raw(values),
                                      last[found], self._npolicy[:0], True, False)
            self.ring.append(torch.from_numpy(ukeys[found]))
            self._counters[C_UPDATES] += int(found.sum())
        return torch.from_numpy(found[inverse])

    def accumulate(self, keys: torch.Tensor, deltas: torch.Tensor, *,
                   allow_nonfinite: bool = False) -> torch.Tensor:
        """Add ``deltas`` (``[N, dim]``, the table's dtype or float32) to the rows of cached
        keys under the writer lock; returns bool [N] of keys that were cached. Duplicates
        are summed, float16/bfloat16 rows added in float32 and rounded once
        (:mod:`nvecache.common.accumulate`); a quantized table's rows (float32 deltas)
        decoded, added in float32 and encoded with stochastic rounding, so deltas under
        half a step add up over many calls (:func:`nvecache.common.quant.encode_sum`);
        announced as :meth:`update` announces. Bad
        arguments, or deltas holding NaN or an infinity (unless ``allow_nonfinite``), raise
        :class:`BadArgumentError` / :class:`NonFiniteValuesError`; nothing is written."""
        keys = check_cache_keys(keys)
        geo, codec = self.geometry, self._codec
        q = codec.quantized
        check_deltas(deltas, keys, geo.dim, torch.float32 if q else geo.dtype,
                     allow_nonfinite=allow_nonfinite and not q,
                     errors=(BadArgumentError, NonFiniteValuesError))
        if keys.numel() == 0:
            return torch.zeros(0, dtype=torch.bool)
        distinct, sums, inverse = sum_duplicates(keys, deltas, codec.out_dtype)
        ukeys = distinct.numpy()
        with self._writing():
            slot, found = self._probe(ukeys)
            old_slots = slot[found]
            if old_slots.size:
                old = np.empty((old_slots.size, codec.width), np.uint8)
                _loops().read_slots(self._nraw, old_slots, old)
                cur, held = torch.from_numpy(old), torch.from_numpy(found)
                # NOTE: a quantized row: decoded, added in float32, encoded again with
                # stochastic rounding (RowBytes.added: small deltas add up)
                new = (codec.added(cur, sums[held], distinct[held]) if q
                       else added(cur.view(geo.dtype), sums[held]))
                self._write_seqlocked(old_slots, ukeys[found], codec.raw(new),
                                      np.arange(old_slots.size), self._npolicy[:0], True, False)
            self.ring.append(torch.from_numpy(ukeys[found]))
            self._counters[C_UPDATES] += int(old_slots.size)
        return torch.from_numpy(found[inverse.numpy()])

    def erase(self, keys: torch.Tensor) -> torch.Tensor:
        """Remove keys; returns bool [N] of keys that were cached.

        Every key is announced, cached or not: a fill of a key in flight (read from the
        parameter server before the erase, inserted after it with ``since``) is refused,
        and every process's GPU cache drops its copy, wherever that copy came from."""
        keys = check_cache_keys(keys)
        if keys.numel() == 0:
            return torch.zeros(0, dtype=torch.bool)
        with self._writing():
            ukeys, _, inverse = _loops().dedup_last(keys.numpy())
            slot, found = self._probe(ukeys)
            gone = slot[found]
            n = int(gone.size)
            if n:
                empty = np.full(n, layout.EMPTY_KEY, dtype=np.int64)
                self._write_seqlocked(gone, empty, self._nraw[:0], gone[:0],
                                      np.zeros(n, dtype=np.int32), False, True)
            self.ring.append(torch.from_numpy(ukeys))
            self._header[layout.W_SIZE] -= n
            self._counters[C_ERASES] += n
        return torch.from_numpy(found[inverse])

    def clear(self) -> None:
        """Remove every row; every process's GPU cache is told to drop everything."""
        with self._writing():
            self._versions += 1
            self._keys.fill_(layout.EMPTY_KEY)
            self._policy.zero_()
            self._versions += 1
            self._header[layout.W_SIZE] = 0
            self.ring.invalidate_all()

    def _repair(self) -> None:
        odd = ((self._versions & 1) == 1).nonzero().squeeze(1)
        if odd.numel():
            self._keys[odd] = layout.EMPTY_KEY
            self._policy[odd] = 0
            self._versions[odd] += 1
        self._header[layout.W_SIZE] = int((self._keys != layout.EMPTY_KEY).sum())
        # the dead writer may have changed rows without logging them: everyone drops all
        self.ring.invalidate_all()

    def _size(self) -> int:
        return int(self._header[layout.W_SIZE])

    def __len__(self) -> int:
        return self._size()
