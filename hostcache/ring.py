"""The invalidation ring inside a segment: which keys changed, in order.

Every update, erase and insert over an existing key appends its keys (for a linear table:
row indices). A per-process GPU cache reads the ring before each lookup and drops those
keys; a reader that fell more than ``ring_capacity`` records behind is told it overflowed
and must drop everything. ``clear()`` of a table advances the head past the capacity, so
every reader behind it overflows (which is exactly "drop everything").

Writers append under the table's writer lock. Record ``s`` lives at ``s % capacity``; the
writer stores ``seq = -1``, then the key, then ``seq = s``, then advances the head, so a
reader that reads the key and then finds ``seq == s`` has read record ``s``'s key.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from hostcache import layout
from hostcache.segment import Mapping


@runtime_checkable
class ChangeFeed(Protocol):
    """What a follower of a shared table reads to drop the keys others changed: a
    ``HostCache``, a ``SharedMemBlock`` and a ``gpu.DistMemBlock`` each are one (every
    layer's GPU cache follows the feed of the table it reads)."""

    @property
    def change_cursor(self) -> int:
        """The feed's end now: where a new follower starts."""
        ...

    def changes_since(self, cursor: int) -> tuple[torch.Tensor, int, bool]:
        """``(keys changed after cursor, the new cursor, overflowed)``; ``overflowed``: the
        follower fell behind (or the table was cleared): drop everything."""
        ...


class InvalidationRing:
    """Append/read view of one segment's ring (header word ``ring_head`` + two arrays)."""

    def __init__(self, mapping: Mapping, geo: layout.Geometry) -> None:
        self.capacity = geo.ring_capacity
        self._header = mapping.header
        self._seqs = mapping.tensor(geo.ring_seq_off, geo.ring_capacity, torch.int64)
        self._keys = mapping.tensor(geo.ring_key_off, geo.ring_capacity, torch.int64)

    @property
    def head(self) -> int:
        """Records ever appended (the cursor a new reader starts from)."""
        return int(self._header[layout.W_RING_HEAD])

    def append(self, keys: torch.Tensor) -> None:
        """Append ``keys`` (int64 CPU 1-D). Caller holds the writer lock."""
        n = int(keys.numel())
        if n == 0:
            return
        head = self.head
        if n > self.capacity:  # only the newest `capacity` records can be kept
            head += n - self.capacity
            keys = keys[-self.capacity :]
            n = self.capacity
        seqs = torch.arange(head, head + n, dtype=torch.int64)
        pos = seqs % self.capacity
        self._seqs[pos] = -1
        self._keys[pos] = keys
        self._seqs[pos] = seqs
        self._header[layout.W_RING_HEAD] = head + n

    def invalidate_all(self) -> None:
        """Make every reader overflow (used by ``clear``). Caller holds the writer lock."""
        self._header[layout.W_RING_HEAD] = self.head + self.capacity + 1

    def changes_since(self, seq: int) -> tuple[torch.Tensor, int, bool]:
        """Keys appended since cursor ``seq``: ``(keys, new_seq, overflowed)``.

        ``overflowed`` means records were lost to the reader (it fell behind the ring, or
        the table was cleared, or ``seq`` is from another table): drop everything cached.
        """
        head = self.head
        empty = torch.empty(0, dtype=torch.int64)
        if seq == head:
            return empty, head, False
        if seq > head or seq < 0 or head - seq > self.capacity:
            return empty, head, True
        want = torch.arange(seq, head, dtype=torch.int64)
        pos = want % self.capacity
        keys = self._keys[pos]  # NOTE: keys before seqs (see the module docstring)
        seqs = self._seqs[pos]
        if not bool(torch.equal(seqs, want)):
            return empty, self.head, True  # overwritten while we read: we fell behind
        return keys, head, False
