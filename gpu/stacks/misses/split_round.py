"""A warm cache's admission round in three steps, so that no lookup waits for all of it
(a LinearUVM's miss log, :mod:`gpu.stacks.misses.miss_log`; a Hierarchical stack's log of
fetched rows, :mod:`gpu.stacks.misses.admission`).

A round inserts the log into the cache. Most of its GPU time is the insert's two
radix sorts (bench/RESULTS.md, "Per-call path"; each sort pass a small launch-bound
kernel), and those read nothing of the cache's table
(:meth:`gpu.cache.gpu_cache.GPUCache.sort_insert_keys`, ``sort_insert_buckets``). Queued whole
behind the lookup that triggers it, the round held that lookup's caller at its sync for
all of it: the LinearUVM tail. Here each step is one CUDA graph, queued by a different
lookup:

1. :meth:`SplitRound.start` (the lookup that makes the round due): on a side stream that
   first waits for the lookups queued so far, the log's keys are copied and sorted (as
   int32 where the keys are a linear table's rows: half the radix passes);
2. :meth:`SplitRound.poll` (a later lookup, once step 1 is done: an event query, no
   wait): the bucket sort, on the side stream;
3. :meth:`SplitRound.poll` (a later lookup, once step 2 is done): the table half, the
   probe, plan and writes, then the log emptied, on the caller's stream.

A caller that waits for its own stream never waits for steps 1-2; one that syncs the
whole device after every call waits for one step per call. :meth:`finish` queues what is
left at once, in order (``flush``, statistics, probes).

Lookups between the steps go on appending to the log, behind the copied part: the table
half reads rows only of the keys copied (written by lookups queued before the copy, so
before it in stream order), and empties the log, dropping what came after the copy (a
warm log is full long before its round: few misses go unlisted). The table half probes
the table as it is when it runs, so an erase, a clear or an invalidation between the
steps is simply seen; a change that makes the logged rows stale cancels what is left
(:meth:`cancel`), as it empties the log.

On the CPU (tests) steps 1 and 2 run at ``start`` and the table half at the next ``poll``.
"""

from __future__ import annotations

from typing import Any

import torch

from gpu.cache.gpu_cache import GPUCache, MissCandidates
from gpu.cache.guard import CacheGuard
from gpu.cache.records import PreparedInsert
from gpu.cuda.graphed import GraphedCall
from hostcache.layout import EMPTY_KEY

_IDLE, _KEYS, _BUCKETS = 0, 1, 2  # what was queued last


class SplitRound:
    """The steps of the round of one kept miss log (its buffers fixed for good).

    Args:
        cache: The GPU cache.
        cand: The kept log (keys and rows).
        small_keys: Every logged key is below ``2**31`` (a linear table's row).
        guard: The cache's guard, held around every call here: its ``stream`` is the
            caller's (without the cost of ``torch.cuda.current_stream()``).
    """

    def __init__(self, cache: GPUCache, cand: MissCandidates, small_keys: bool,
                 guard: CacheGuard | None = None) -> None:
        assert cand.rows is not None
        self._cache, self._cand, self._rows = cache, cand, cand.rows
        self._small = small_keys
        self._guard = guard
        dev = cache.device
        self._cuda = dev.type == "cuda"
        self._prep = PreparedInsert.empty(cand.cap, dev)
        self._steps = [GraphedCall(self._sort_keys, dev), GraphedCall(self._sort_buckets, dev),
                       GraphedCall(self._apply, dev)]
        self._side: Any = torch.cuda.Stream(dev) if self._cuda else None
        self._queued: Any = torch.cuda.Event() if self._cuda else None
        self._done: Any = torch.cuda.Event() if self._cuda else None
        self._stage = _IDLE

    @property
    def pending(self) -> bool:
        """A round was started and its table half not yet queued."""
        return self._stage != _IDLE

    def _sort_keys(self) -> None:
        self._cache.sort_insert_keys(self._cand.keys, self._prep, small=self._small)

    def _sort_buckets(self) -> None:
        self._cache.sort_insert_buckets(self._prep)

    def _apply(self) -> None:
        cand = self._cand
        self._cache.apply_insert(self._prep, self._rows)
        cand.buffer.fill_(EMPTY_KEY)
        cand.buffer[:1].zero_()

    def capture(self) -> bool:
        """Run the steps once eagerly (the kernels loaded; the log must be empty, so
        nothing goes in), then capture each into a CUDA graph; returns whether all three
        replay from one."""
        self.start()
        self.finish()
        if not self._cuda:
            return False
        return all([step.capture() for step in self._steps])

    def _caller(self) -> Any:
        stream = self._guard.stream if self._guard is not None else None
        return stream if stream is not None else torch.cuda.current_stream(self._cache.device)

    def _on_side(self, step: GraphedCall, caller: Any) -> None:
        # NOTE: set_stream, not the stream context: that one reads the current stream
        # again (a costly call) on the way in
        torch.cuda.set_stream(self._side)
        try:
            step()
        finally:
            torch.cuda.set_stream(caller)
        self._done.record(self._side)

    def start(self) -> None:
        """Queue step 1 on what the log holds (caller holds the cache guard; nothing
        pending)."""
        assert self._stage == _IDLE
        if self._cuda:
            caller = self._caller()
            self._queued.record(caller)
            self._side.wait_event(self._queued)
            self._on_side(self._steps[0], caller)
        else:
            self._steps[0]()
            self._steps[1]()
        self._stage = _KEYS if self._cuda else _BUCKETS

    def poll(self) -> bool:
        """Queue the next step if the last one is done (no wait); returns whether the
        table half was queued."""
        if self._stage == _IDLE or (self._cuda and not self._done.query()):
            return False
        if self._stage == _KEYS:
            self._on_side(self._steps[1], self._caller())
            self._stage = _BUCKETS
            return False
        self._steps[2]()
        self._stage = _IDLE
        return True

    def finish(self) -> None:
        """Queue what is left now, in order (caller holds the cache guard)."""
        if self._stage == _IDLE:
            return
        if self._cuda:
            caller = self._caller()
            if self._stage == _KEYS:
                self._on_side(self._steps[1], caller)
            caller.wait_event(self._done)
        elif self._stage == _KEYS:
            self._steps[1]()
        self._steps[2]()
        self._stage = _IDLE

    def cancel(self) -> None:
        """Forget what is left (the logged rows went stale: the caller empties the log);
        steps still running only write this round's own buffers."""
        self._stage = _IDLE

    def close(self) -> None:
        """Wait for the side stream (its graphs and buffers may go after)."""
        self._stage = _IDLE
        if self._cuda:
            self._side.synchronize()
