"""What a :class:`~hostcache.HostCache` answers about its keys without reading rows: where a
key sits (the probe every write starts from), whether it is cached, its eviction-policy
counter, hits counted for reads made elsewhere, and a consistency audit."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from hostcache import layout
from hostcache.errors import BadArgumentError
from hostcache.table_twin import GATE as LOOPS
from hostcache.validate import check_cache_keys

_loops = LOOPS.pick


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


class CacheProbes:
    """The key-side reads of a host cache (a base of :class:`~hostcache.HostCache`, which
    maps the views these read)."""

    geometry: layout.Geometry
    _keys: torch.Tensor
    _versions: torch.Tensor
    _size: Callable[[], int]
    _npolicy: np.ndarray
    _bucket_keys: np.ndarray
    _live: Callable[[], object]

    def touch(self, keys: torch.Tensor, weight: int = 1) -> None:
        """Count ``weight`` hits of each cached key in the eviction policy, as a lookup
        would, without reading rows or changing hit counters (for reads made elsewhere: a
        GPU kernel reading the segment reports a sample of its hits here)."""
        keys = check_cache_keys(keys)
        if isinstance(weight, bool) or not isinstance(weight, int) or weight < 1:
            raise BadArgumentError(f"weight must be an int >= 1; got {weight!r}")
        self._live()
        slot, found = self._probe(keys.numpy())
        _loops().add_policy(self._npolicy, slot, found, weight)

    def contains(self, keys: torch.Tensor) -> torch.Tensor:
        """bool [N]: whether each key is cached now (no counters touched)."""
        keys = check_cache_keys(keys)
        self._live()
        return torch.from_numpy(self._probe(keys.numpy())[1])

    def policy(self, keys: torch.Tensor) -> torch.Tensor:
        """int32 [N]: each key's eviction-policy counter now (-1 where it is not cached);
        read without the writer lock, so approximate while others write."""
        keys = check_cache_keys(keys)
        self._live()
        slot, found = self._probe(keys.numpy())
        return torch.from_numpy(np.where(found, self._npolicy[slot], -1).astype(np.int32))

    def audit(self) -> CacheAudit:
        """What a consistency check finds (exact while no writer is inside; see
        :attr:`writer_pid`): occupied slots, the size counter, slots mid-write."""
        self._live()
        return CacheAudit(
            occupied=int((self._keys != layout.EMPTY_KEY).sum()),
            size=self._size(),
            mid_write=int(((self._versions & 1) == 1).sum()),
        )

    def _probe(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slot, found) of each key (way 0 of its bucket where absent); exact under the
        writer lock."""
        slot = np.empty(keys.shape[0], np.int64)
        found = np.empty(keys.shape[0], np.bool_)
        bucket = _loops().buckets(keys, self.geometry.num_buckets)
        _loops().find(self._bucket_keys, keys, bucket, slot, found)
        return slot, found

