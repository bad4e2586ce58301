"""``HostCache``: a set-associative embedding cache in one POSIX shared-memory segment.

Every process of the node maps the same segment. Readers never lock: each lookup reads a
slot's version, its key and row, then the version again, and treats a changed or odd
version as a miss (seqlock; see ``hostcache.layout``). Writers (insert, update, erase,
clear) take the table's robust writer lock. All paths are vectorized over the batch.

Eviction policy ``lfu-da`` (LFU with dynamic aging, per bucket): a hit adds one to its
slot's counter; a new key takes an empty way, else the way with the smallest counter
(ties: lowest way), and starts at the victim's counter + 1, so new keys are not evicted at
once by old heavy hitters, and old counts decay relative to new ones. A bucket whose
counters pass 2**30 has them halved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Self

import torch

from . import layout
from .errors import BadArgumentError
from .hashing import bucket_of
from .segment import Mapping, check_mode
from .table import (
    C_ERASES,
    C_EVICTIONS,
    C_HITS,
    C_INSERTS,
    C_LOOKUPS,
    C_MISSES,
    C_UPDATES,
    SharedTable,
)
from .validate import check_cache_keys, check_values, dedup_last

_COUNTER_CAP = 1 << 30
_PROTECTED = torch.iinfo(torch.int32).max


class Inserted(NamedTuple):
    """What one :meth:`HostCache.insert` did."""

    #: new keys placed, plus cached keys overwritten (with ``overwrite=True``)
    written: int
    #: resident keys it displaced
    evicted: int


@dataclass(frozen=True)
class CacheAudit:
    """What :meth:`HostCache.audit` found."""

    #: slots holding a key.
    occupied: int
    #: the header's size counter (equals ``occupied`` when consistent).
    size: int
    #: slots whose version is odd: a write section in progress, or left by a dead writer
    #: and not yet repaired.
    mid_write: int


def _matching_way(match: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(found, way) from a [N, ways] bool match (a key sits in at most one way).

    With 8 ways the row of 8 bools is read as one int64 (byte ``w`` holds bit ``8 w``), so
    finding the way is one float exponent instead of an argmax over 8 columns.
    """
    if match.shape[1] == 8 and match.is_contiguous():
        bits = match.view(torch.uint8).view(torch.int64).squeeze(1)
        found = bits != 0
        way = ((torch.frexp(bits.to(torch.float64))[1] - 1) >> 3).clamp_(min=0)
        return found, way
    return match.any(dim=1), match.to(torch.uint8).argmax(dim=1)


class HostCache(SharedTable):
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
            dtype: float32, float16, bfloat16 or float64.
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

    @staticmethod
    def _init_segment(mapping: Mapping, geo: layout.Geometry) -> None:
        # NOTE: a new segment is zeros, i.e. key 0 everywhere; mark every slot empty before
        # the header is published, so no reader ever sees key 0 with a zero row.
        mapping.tensor(geo.keys_off, geo.slots, torch.int64).fill_(layout.EMPTY_KEY)

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
        self._keys2 = self._keys.view(-1, ways)
        self._versions2 = self._versions.view(-1, ways)
        self._policy2 = self._policy.view(-1, ways)
        raw = mapping.tensor(geo.rows_off, slots * geo.row_stride, torch.uint8)
        self._rows = raw.view(slots, geo.row_stride)[:, : geo.row_bytes].view(geo.dtype)

    def _drop_views(self) -> None:
        empty = torch.empty(0)
        self._keys = self._versions = self._policy = self._rows = empty
        self._keys2 = self._versions2 = self._policy2 = empty

    # -- reads ---------------------------------------------------------------------------

    def lookup(
        self, keys: torch.Tensor, *, count: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``keys`` (int64 CPU [N]): ``(values [N, dim], hit bool [N])``.

        Missing keys give zero rows. Never takes a lock; never returns a torn row.
        ``count=False`` is a peek: no hit counters or policy counters change.
        """
        keys = check_cache_keys(keys)
        self._live()
        ways = self.geometry.ways
        bucket = bucket_of(keys, self.geometry.num_buckets)
        found, way = _matching_way(self._keys2.index_select(0, bucket) == keys[:, None])
        slot = bucket * ways + way
        # NOTE: seqlock window: version, row, key, version. A hit needs an even version
        # that did not change and the key still in place inside the window, so the row
        # belongs to the key even if writers moved keys between the probe and the window.
        ver_before = self._versions.index_select(0, slot)
        values = self._rows.index_select(0, slot)
        key_inside = self._keys.index_select(0, slot)
        ver_after = self._versions.index_select(0, slot)
        hit = key_inside == keys
        hit &= found
        # NOTE: even before and unchanged after, in one comparison (versions only grow, so
        # an odd ver_before, cleared of its low bit, is below any ver_after)
        hit &= ver_after == (ver_before & -2)
        n_hits = int(hit.sum())
        if n_hits < keys.numel():
            values.index_fill_(0, (~hit).nonzero().squeeze(1), 0)
        if not count:
            return values, hit
        if n_hits:
            # policy counters: racy across processes by design (approximate frequencies).
            # Every key's slot gets its hit bit (0 for a miss) in one pass, with no
            # boolean compaction of the hit slots; adding 0 is a read and write back,
            # racy with a writer placing a new key there as a hit's add is (the new key
            # may keep the old counter: approximate, never a wrong row).
            self._policy.index_add_(0, slot, hit.to(torch.int32))
        c = self._counters
        c[C_LOOKUPS] += 1
        c[C_HITS] += n_hits
        c[C_MISSES] += keys.numel() - n_hits
        return values, hit

    def touch(self, keys: torch.Tensor, weight: int = 1) -> None:
        """Count ``weight`` hits of each cached key in the eviction policy, as a lookup
        would, without reading rows or changing hit counters (for reads made elsewhere: a
        GPU kernel reading the segment reports a sample of its hits here)."""
        keys = check_cache_keys(keys)
        if isinstance(weight, bool) or not isinstance(weight, int) or weight < 1:
            raise BadArgumentError(f"weight must be an int >= 1; got {weight!r}")
        self._live()
        _, found, slot = self._find(keys)
        slot = slot[found]
        if slot.numel():
            # racy across processes by design, like lookup's (approximate frequencies)
            self._policy.index_add_(0, slot, torch.full((slot.numel(),), weight,
                                                        dtype=torch.int32))

    def contains(self, keys: torch.Tensor) -> torch.Tensor:
        """bool [N]: whether each key is cached now (no counters touched)."""
        keys = check_cache_keys(keys)
        self._live()
        return self._find(keys)[1]

    def policy(self, keys: torch.Tensor) -> torch.Tensor:
        """int32 [N]: each key's eviction-policy counter now (-1 where it is not cached);
        read without the writer lock, so approximate while others write."""
        keys = check_cache_keys(keys)
        self._live()
        _, found, slot = self._find(keys)
        counts = self._policy.index_select(0, slot)
        return torch.where(found, counts, torch.full_like(counts, -1))

    def audit(self) -> CacheAudit:
        """What a consistency check finds (exact while no writer is inside; see
        :attr:`writer_pid`): occupied slots, the size counter, slots mid-write."""
        self._live()
        return CacheAudit(
            occupied=int((self._keys != layout.EMPTY_KEY).sum()),
            size=int(self._header[layout.W_SIZE]),
            mid_write=int(((self._versions & 1) == 1).sum()),
        )

    def _find(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(bucket, found, slot) of each key; exact under the writer lock."""
        ways = self.geometry.ways
        bucket = bucket_of(keys, self.geometry.num_buckets)
        found, way = _matching_way(self._keys2.index_select(0, bucket) == keys[:, None])
        return bucket, found, bucket * ways + way

    # -- writes --------------------------------------------------------------------------

    def _write_slots(
        self,
        slots: torch.Tensor,
        keys: torch.Tensor,
        rows: torch.Tensor | None,
        policy: torch.Tensor | None,
    ) -> None:
        """Seqlock write of distinct ``slots`` (caller holds the writer lock)."""
        if slots.numel() == 0:
            return
        one = torch.ones(slots.numel(), dtype=torch.int64)
        self._versions.index_add_(0, slots, one)  # odd: readers treat the slot as a miss
        self._keys.index_copy_(0, slots, keys)
        if rows is not None:
            self._rows.index_copy_(0, slots, rows)
        if policy is not None:
            self._policy.index_copy_(0, slots, policy)
        self._versions.index_add_(0, slots, one)  # even again: the new contents are committed

    def insert(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        overwrite: bool = True,
        since: int | None = None,
    ) -> Inserted:
        """Insert rows, best effort: evicts by policy; returns what it wrote and evicted.

        Args:
            keys: int64 CPU ``[N]``; duplicates: the last occurrence wins.
            values: ``[N, dim]`` rows of the table's dtype.
            overwrite: Keys already cached get the new row (and every process's GPU cache
                drops them). ``False`` leaves cached keys as they are: the safe way to fill
                the cache with rows read from a parameter server, since a concurrent
                ``update`` that got there first is never overwritten with an older row.
            since: a ring cursor (:attr:`change_cursor`) taken before the rows were read:
                keys announced since then are not inserted (their rows may be older than
                the change), and nothing is if the ring overflowed since. Together with
                ``overwrite=False`` this makes a fill from the parameter server safe
                against any concurrent update, here or on another node.

        When more new keys than ``ways`` fall in one bucket in one batch, the extra ones
        are not inserted.
        """
        _, written, evicted = self._upsert(keys, values, overwrite=overwrite,
                                           announce_new=False, since=since)
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
    ) -> tuple[torch.Tensor, int, int]:
        """Write present keys (if ``overwrite``) and place absent ones: (bool [N] present,
        keys written, keys evicted)."""
        keys = check_cache_keys(keys)
        values = check_values(values, keys.numel(), self.geometry.dim, self.geometry.dtype)
        if keys.numel() == 0:
            return torch.zeros(0, dtype=torch.bool), 0, 0
        ways = self.geometry.ways
        with self._writing():
            ukeys, last, inverse_or_none = dedup_last(keys)
            inverse: torch.Tensor | None = inverse_or_none
            if since is not None:
                changed, _, overflowed = self.ring.changes_since(since)
                if overflowed:
                    return torch.zeros(keys.numel(), dtype=torch.bool), 0, 0
                if changed.numel():
                    fresh = ~torch.isin(ukeys, changed)
                    ukeys, last = ukeys[fresh], last[fresh]
                    inverse = None
            # NOTE: rows travel as positions in `values` until the one gather that feeds
            # each write: a 2k-row insert spent a quarter of its time copying rows
            bucket, found, slot = self._find(ukeys)
            old_slots = slot[found]
            if overwrite:  # keys already present: overwrite in place, tell the others
                self._write_slots(old_slots, ukeys[found],
                                  values.index_select(0, last[found]), None)
            new = ~found
            written, evicted = 0, 0
            if bool(new.any()):
                written, evicted = self._insert_new(
                    ukeys[new], values, last[new], bucket[new], old_slots, ways
                )
            self.ring.append(ukeys if announce_new else ukeys[found] if overwrite else ukeys[:0])
            c = self._counters
            written += int(found.sum()) if overwrite else 0
            c[C_INSERTS] += written
            c[C_EVICTIONS] += evicted
        if inverse is None:  # some keys were refused: report the found ones by key
            return torch.isin(keys, ukeys[found]), written, evicted
        return found[inverse], written, evicted

    def _insert_new(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        src: torch.Tensor,
        bucket: torch.Tensor,
        protected_slots: torch.Tensor,
        ways: int,
    ) -> tuple[int, int]:
        """Place keys that are not cached (key ``i``'s row is ``values[src[i]]``); returns
        (written, evicted). Under the lock."""
        order = torch.argsort(bucket, stable=True)
        keys, src, bucket = keys[order], src[order], bucket[order]
        ubuckets, group = torch.unique_consecutive(bucket, return_inverse=True)
        first = torch.searchsorted(bucket, ubuckets)
        rank = torch.arange(bucket.numel(), dtype=torch.int64) - first[group]
        # priority of each way of every touched bucket: empty first, then the coldest
        key_b = self._keys2.index_select(0, ubuckets)
        prio = self._policy2.index_select(0, ubuckets).clone()
        prio[key_b == layout.EMPTY_KEY] = -1
        if protected_slots.numel():
            # NOTE: the touched buckets' protected ways, found by searching the (sorted)
            # buckets: the work of the keys, not of the table's size
            pb = torch.div(protected_slots, ways, rounding_mode="floor")
            at = torch.searchsorted(ubuckets, pb).clamp_(max=ubuckets.numel() - 1)
            mine = ubuckets[at] == pb
            prio[at[mine], (protected_slots - pb * ways)[mine]] = _PROTECTED
        prio_sorted, way_order = torch.sort(prio, dim=1, stable=True)
        ok = rank < ways
        g, r = group[ok], rank[ok]
        victim_prio = prio_sorted[g, r]
        usable = victim_prio != _PROTECTED
        g, r, victim_prio = g[usable], r[usable], victim_prio[usable]
        sel = ok.nonzero().squeeze(1)[usable]
        target = ubuckets[g] * ways + way_order[g, r]
        was_empty = victim_prio < 0
        new_policy = torch.where(was_empty, 1, victim_prio + 1).to(torch.int32)
        self._write_slots(target, keys[sel], values.index_select(0, src[sel]), new_policy)
        n_filled = int(was_empty.sum())
        self._header[layout.W_SIZE] += n_filled
        self._decay(ubuckets)
        return int(target.numel()), int(target.numel()) - n_filled

    def _decay(self, buckets: torch.Tensor) -> None:
        pol = self._policy2.index_select(0, buckets)
        hot = (pol > _COUNTER_CAP).any(dim=1)
        if bool(hot.any()):
            b = buckets[hot]
            self._policy2[b] = self._policy2.index_select(0, b) >> 1

    def update(
        self, keys: torch.Tensor, values: torch.Tensor, *, insert_missing: bool = False
    ) -> torch.Tensor:
        """Overwrite rows of cached keys; returns bool [N] of keys that were cached.

        Every process's next lookup sees the new rows (their GPU caches drop the keys).
        With ``insert_missing`` the other keys are inserted too and announced as well (the
        write-through of a layer's ``update``: a replica that read the old row from the
        parameter server just before is told to drop it).
        """
        if insert_missing:
            found, _, _ = self._upsert(keys, values, overwrite=True, announce_new=True)
            self._counters[C_UPDATES] += int(found.sum())
            return found
        keys = check_cache_keys(keys)
        values = check_values(values, keys.numel(), self.geometry.dim, self.geometry.dtype)
        if keys.numel() == 0:
            return torch.zeros(0, dtype=torch.bool)
        with self._writing():
            ukeys, last, inverse = dedup_last(keys)
            _, found, slot = self._find(ukeys)
            self._write_slots(slot[found], ukeys[found], values.index_select(0, last[found]), None)
            self.ring.append(ukeys[found])
            self._counters[C_UPDATES] += int(found.sum())
        return found[inverse]

    def erase(self, keys: torch.Tensor) -> torch.Tensor:
        """Remove keys; returns bool [N] of keys that were cached.

        Every key is announced, cached or not: a fill of a key in flight (read from the
        parameter server before the erase, inserted after it with ``since``) is refused,
        and every process's GPU cache drops its copy, wherever that copy came from."""
        keys = check_cache_keys(keys)
        if keys.numel() == 0:
            return torch.zeros(0, dtype=torch.bool)
        with self._writing():
            ukeys, _, inverse = dedup_last(keys)
            _, found, slot = self._find(ukeys)
            gone = slot[found]
            empty = torch.full((gone.numel(),), layout.EMPTY_KEY, dtype=torch.int64)
            self._write_slots(gone, empty, None, torch.zeros(gone.numel(), dtype=torch.int32))
            self.ring.append(ukeys)
            n = int(gone.numel())
            self._header[layout.W_SIZE] -= n
            self._counters[C_ERASES] += n
        return found[inverse]

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
