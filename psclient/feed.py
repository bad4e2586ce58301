"""The change feed's value types: what :meth:`ParameterServer.follow` returns.

A follower keeps one opaque cursor per table and calls ``follow(cursor, block_ms=...)`` in a
loop; each call returns the keys changed after the cursor and the cursor to pass next. The
feed is bounded: when the follower cannot be told every change since its cursor (entries
trimmed, the table cleared, the store lost entries the follower had read), the call raises
:class:`psclient.ChangeFeedGapError` instead, and the follower drops every cached row of the
table and resumes from ``err.cursor``. docs/psclient.md, "Change feed", states the rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from nvecache.common.lazy import lazy_import

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_import("torch", globals())


@dataclass(frozen=True)
class FeedBatch:
    """Keys changed after a cursor, and where to continue.

    ``oldest_ns``/``newest_ns`` are the commit times of the oldest and newest feed entry in
    this batch, by the store's clock (the Redis server's ``TIME``; the writer's clock for
    file://), in nanoseconds since the epoch; ``None`` when the batch holds no entry (and
    for entries written by an older psclient that recorded no time).
    """

    #: unique int64 keys changed after the cursor (CPU, sorted)
    keys: torch.Tensor
    #: opaque: pass it to the next ``follow()``/``changes()``
    cursor: str
    #: commit time of the oldest entry in this batch (store clock, ns since the epoch)
    oldest_ns: int | None = None
    #: commit time of the newest entry in this batch (store clock, ns since the epoch)
    newest_ns: int | None = None


def make_batch(parts: list[np.ndarray], cursor: str, times: list[int]) -> FeedBatch:
    """A :class:`FeedBatch` from packed key arrays and the entries' commit times (ns)."""
    if parts:
        keys = np.unique(np.concatenate(parts)).astype(np.int64, copy=False)
    else:
        keys = np.empty(0, dtype=np.int64)
    return FeedBatch(keys=torch.from_numpy(keys), cursor=cursor,
                     oldest_ns=min(times) if times else None,
                     newest_ns=max(times) if times else None)
