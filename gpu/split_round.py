"""A warm LinearUVM round in two halves, so that no lookup waits for its sorts.

A round inserts the miss log into the cache. Most of its GPU time is the insert's two
radix sorts (bench/RESULTS.md, "Per-call path (H200)": ~107 of a round's ~159 us), and
those read nothing of the cache's table (:meth:`gpu.cache.GPUCache.prepare_insert`).
Queued behind the lookup that triggers it, the round held that lookup's caller at its
sync for all of it: the LinearUVM tail. Split:

* :meth:`SplitRound.start` (the triggering lookup): on a side stream that first waits for
  the lookups queued so far, the log's keys are copied and sorted (one CUDA graph);
* :meth:`SplitRound.poll` (each later lookup, before its own): once those sorts are done
  (an event query, no wait), the table half, the probe, plan and writes and then the log
  emptied, is queued on the caller's stream (another graph, ~15 us of GPU time);
* :meth:`SplitRound.finish` queues it at once, behind the sorts (``flush``, statistics).

Lookups between the halves go on appending to the log, behind the copied part: the table
half reads rows only of the keys copied (written by lookups queued before the copy, so
before it in stream order), and empties the log, dropping what came after the copy (a
warm log is full long before its round: few misses go unlisted). The table half probes
the table as it is when it runs, so an erase, a clear or an invalidation between the
halves is simply seen; a change that makes the logged rows stale cancels the pending half
(:meth:`cancel`), as it empties the log.

On the CPU (tests) the sorts run at ``start`` and the table half at the next ``poll``.
"""

from __future__ import annotations

from typing import Any

import torch

from hostcache.layout import EMPTY_KEY

from .cache import GPUCache, MissCandidates
from .cache_types import PreparedInsert
from .graphed import GraphedCall


class SplitRound:
    """The two halves of the round of one kept miss log (its buffers fixed for good).

    Args:
        cache: The GPU cache.
        cand: The kept log (keys and rows).
    """

    def __init__(self, cache: GPUCache, cand: MissCandidates) -> None:
        assert cand.rows is not None
        self._cache, self._cand, self._rows = cache, cand, cand.rows
        dev = cache.device
        self._cuda = dev.type == "cuda"
        self._prep = PreparedInsert.empty(cand.cap, dev)
        self._sorts = GraphedCall(self._prepare, dev)
        self._writes = GraphedCall(self._apply, dev)
        self._side: Any = torch.cuda.Stream(dev) if self._cuda else None
        self._queued: Any = torch.cuda.Event() if self._cuda else None
        self._sorted: Any = torch.cuda.Event() if self._cuda else None
        #: the sorts were queued and their table half not yet
        self.pending = False

    def _prepare(self) -> None:
        self._cache.prepare_insert(self._cand.keys, out=self._prep)

    def _apply(self) -> None:
        cand = self._cand
        self._cache.apply_insert(self._prep, self._rows)
        cand.buffer.fill_(EMPTY_KEY)
        cand.buffer[:1].zero_()

    def capture(self) -> bool:
        """Run both halves once eagerly (the kernels loaded; the log must be empty, so
        nothing goes in), then capture each into a CUDA graph; returns whether both
        replay from one."""
        self.start()
        self.finish()
        if not self._cuda:
            return False
        return self._sorts.capture() and self._writes.capture()

    def start(self) -> None:
        """Queue the sorts of what the log holds (caller holds the cache guard; no round
        pending)."""
        assert not self.pending
        if self._cuda:
            caller = torch.cuda.current_stream(self._cache.device)
            self._queued.record(caller)
            self._side.wait_event(self._queued)
            with torch.cuda.stream(self._side):
                self._sorts()
            self._sorted.record(self._side)
        else:
            self._sorts()
        self.pending = True

    def poll(self) -> bool:
        """Queue the table half if the sorts are done (no wait); returns whether it was."""
        if not self.pending or (self._cuda and not self._sorted.query()):
            return False
        self._writes()
        self.pending = False
        return True

    def finish(self) -> None:
        """Queue the table half now, behind the sorts (caller holds the cache guard)."""
        if not self.pending:
            return
        if self._cuda:
            torch.cuda.current_stream(self._cache.device).wait_event(self._sorted)
        self._writes()
        self.pending = False

    def cancel(self) -> None:
        """Forget the pending half (the logged rows went stale: the caller empties the
        log); sorts still running only write this round's own buffers."""
        self.pending = False

    def close(self) -> None:
        """Wait for the side stream (its graph and buffers may go after)."""
        self.pending = False
        if self._cuda:
            self._side.synchronize()
