"""What a :class:`gpu.cache.gpu_cache.GPUCache` hands out: its statistics, the miss-candidate
buffer its linear lookups fill without a host sync, and an insert's prepared half."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu.cuda.devices import resolve_device
from gpu.errors import BadArgumentError
from hostcache.table import HitRate


@dataclass(frozen=True)
class GPUCacheStats(HitRate):
    """Counters of one :class:`gpu.cache.gpu_cache.GPUCache` since it was created."""

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


@dataclass(frozen=True)
class MissCandidates:
    """Where a linear lookup writes its misses, so that the caller learns them without a
    host sync: one int64 buffer ``[1 + 2 * cap]`` holding the number of in-range misses
    (all of them, even past ``cap``), the first ``cap`` missed keys found and their
    positions in the batch. Duplicated keys appear once per occurrence.

    Which misses come first: batch order on the CPU, and on CUDA for large batches over a
    host table (visited in host-page order, see ``gpu.kernels.cache_lookup.page_order``, then
    listed in batch order); for other CUDA lookups the order in which the kernel's key
    blocks ran (a block's misses stay together, in batch order). Either way a sample of
    the miss occurrences, in which keys that miss often are likelier.

    With ``rows`` (``[cap, dim]``, the cache's dtype) the lookup also copies the row it
    read for each listed miss there (row ``i`` belongs to ``keys[i]``): an admission then
    inserts them without reading the linear table again.
    """

    buffer: torch.Tensor
    rows: torch.Tensor | None = None

    @classmethod
    def empty(cls, cap: int, device: object, *, dim: int | None = None,
              dtype: torch.dtype | None = None) -> MissCandidates:
        """A zeroed buffer for up to ``cap`` candidates (one allocation, one memset), with
        room for their rows where ``dim`` and ``dtype`` are given.

        Raises:
            BadArgumentError: ``cap`` is not a non-negative int, or a bad device.
        """
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
            raise BadArgumentError(f"cap must be a non-negative int; got {cap!r}")
        # NOTE: a torch.device is taken as is (the layers pass their own, once per lookup)
        dev = device if isinstance(device, torch.device) else resolve_device(device)
        rows = None
        if dim is not None:
            rows = torch.empty((cap, dim), dtype=dtype or torch.float32, device=dev)
        return cls(torch.zeros(1 + 2 * cap, dtype=torch.int64, device=dev), rows)

    @property
    def cap(self) -> int:
        """How many missed keys the buffer has room for."""
        return (self.buffer.numel() - 1) // 2

    @property
    def count(self) -> torch.Tensor:
        """``[1]`` int64 on the buffer's device: the lookup's in-range misses."""
        return self.buffer[:1]

    @property
    def keys(self) -> torch.Tensor:
        """``[cap]`` int64: the missed keys found, the first ``min(count, cap)`` valid."""
        return self.buffer[1:1 + self.cap]

    @property
    def positions(self) -> torch.Tensor:
        """``[cap]`` int64: the batch position of each of :attr:`keys`."""
        return self.buffer[1 + self.cap:]


@dataclass(frozen=True)
class PreparedInsert:
    """The half of an insert that reads nothing of the cache's table
    (:meth:`gpu.cache.gpu_cache.GPUCache.prepare_insert`): the batch sorted by key (``ks``, and
    ``src``, each sorted key's batch position), each position's int32 bucket sort key
    (``skey``: the last occurrence of a key its bucket, the others past every bucket),
    those sorted (``sb``, ``order``) and where each one's run of equal buckets starts
    (``start``). On the torch backend only ``keys`` is kept (its plan reads the table)."""

    keys: torch.Tensor
    ks: torch.Tensor
    src: torch.Tensor
    skey: torch.Tensor
    sb: torch.Tensor
    order: torch.Tensor
    start: torch.Tensor

    @classmethod
    def empty(cls, n: int, device: torch.device | str, keys: torch.Tensor | None = None
              ) -> PreparedInsert:
        """Buffers for a batch of ``n`` keys (what a reused round writes into); ``keys``
        (the batch itself) where it need not be copied."""
        def i64() -> torch.Tensor:
            return torch.empty(n, dtype=torch.int64, device=device)
        skey = torch.empty(n, dtype=torch.int32, device=device)
        return cls(i64() if keys is None else keys, i64(), i64(), skey,
                   torch.empty_like(skey), i64(), i64())
