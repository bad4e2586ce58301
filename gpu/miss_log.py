"""Admission of a LinearUVM cache's misses with no host sync (the LinearUVM stack's).

The lookup kernel itself appends each key it missed to a miss log on the device (a
:class:`~gpu.cache.MissCandidates` buffer: a count, then the keys; slots not written hold
the empty marker), and the row it read for it from the linear table. Nothing travels to
the host: the host only counts lookups and keys. When a round is due, it is queued on the
stream behind the lookups: the cache inserts the logged keys with their logged rows (the
empty marker is skipped, so the host never needs the count) and the log is emptied; the
table is not read again. A round runs:

* while the cache fills, and after every lookup of at least ``admit_fraction`` of its
  slots of keys: once that many keys were looked up;
* once it is warm, for smaller lookups: every ``round_lookups`` lookups, or after
  ``round_capacities`` times its slots of keys, whichever comes first (a round costs
  several lookups' time: bench/RESULTS.md, "Per-call path (H200)"), so serving-size
  lookups pay it rarely.

A round admits at most what the log holds: the first misses of the round's lookups, in
kernel block order (batch order for a page-ordered lookup: gpu.cache_kernels), up to its
:class:`~gpu.admission.RoundBudget` (``warm_round_fraction`` of the cache's slots) once
the cache is warm; while it fills, up to ``admit_fraction`` of its slots, or a larger
lookup's size. The log's rows cost that much device memory beside the cache: an eighth
of the cache's rows once it is warm with the defaults, while it fills a quarter, or one
lookup's output.

On CUDA a LinearUVM stack keeps the warm cache's log for good from its construction
(:meth:`MissLog.keep`; while the cache fills, it waits beside the filling log), and that
log's round, its insert and then the log emptied, is captured there into a CUDA graph
(:mod:`gpu.graphed`): a warm round costs the lookup that triggers it one graph launch
instead of a dozen allocations and launches (bench/RESULTS.md, "Per-call path (H200)").

Consistency: a logged row is as old as the lookup that read it, so the log is emptied
whenever the stack learns of a change to the table (:class:`~gpu.change_follower.
ChangeFollower`'s ``on_change``, a write through the layer, an erase): a row logged
before a change is never admitted after it.
"""

from __future__ import annotations

import torch

from hostcache.layout import EMPTY_KEY

from .admission import RoundBudget
from .cache import GPUCache, MissCandidates
from .graphed import GraphedCall
from .tier_config import TierConfig


class MissLog:
    """The device-side log of one cache's misses and their rows, and its admission rounds.

    Args:
        cache: The GPU cache.
        budget: The round budget shared with the stack (reset on clear).
        config: Round cadence.
        prob: Admission probability of a logged miss (``InsertPolicy.gpu``).
    """

    def __init__(self, cache: GPUCache, budget: RoundBudget, config: TierConfig,
                 prob: float) -> None:
        self._cache, self._budget, self._config, self._prob = cache, budget, config, prob
        self._cand: MissCandidates | None = None
        #: a warm cache's log kept for good, with its round (insert, then the log emptied)
        #: captured into a CUDA graph (:meth:`keep`, gpu.graphed)
        self._kept: tuple[MissCandidates, GraphedCall] | None = None
        self._warm = False  # the budget's phase when the log was sized
        self._calls = 0
        self._keys = 0
        self.rounds = 0

    def _cap(self, n: int) -> int:
        """Keys the log holds for a round that a lookup of ``n`` keys may run: the round
        budget once the cache is warm; while it fills, ``admit_fraction`` of its slots or
        the lookup's size, the larger (a large lookup of a cold cache admits what it can
        in one round, at the memory of its own output at most)."""
        budget = self._budget
        if budget.warm:
            return budget.cap()
        fill = max(1, int(self._cache.capacity * self._config.admit_fraction))
        return min(budget.cap(), max(fill, n))

    @property
    def active(self) -> bool:
        return self._cache.capacity > 0 and self._prob > 0.0

    def candidates(self, n: int) -> MissCandidates | None:
        """Where the next lookup, of ``n`` keys, logs its misses (None: this cache admits
        nothing)."""
        if not self.active:
            return None
        cand = self._cand
        if cand is None or (self._calls == 0 and cand.cap < self._cap(n)):
            # NOTE: a new log, or a larger one while it is empty (a cold cache's first
            # large lookup)
            self._release()
            cache, cap = self._cache, self._cap(n)
            kept = self._kept
            if kept is not None and self._budget.warm and kept[0].cap == cap:
                cand = kept[0]
            else:
                buf = torch.full((1 + 2 * cap,), EMPTY_KEY, dtype=torch.int64,
                                 device=cache.device)
                buf[0] = 0
                rows = torch.empty((cap, cache.dim), dtype=cache.dtype, device=cache.device)
                cand = MissCandidates(buf, rows)
            self._cand = cand
            self._warm = self._budget.warm
        return cand

    def keep(self) -> bool:
        """Keep the current log (a warm cache's, empty, its round run once eagerly: the
        kernels loaded) for every later warm phase, its round captured into a CUDA graph;
        returns whether rounds now replay it. At a layer's construction: the capture
        holds the device's default random generator (gpu.graphed). On the CPU the log is
        kept the same way, its round run eagerly (no layer does that: tests do)."""
        cand = self._cand
        if cand is None or self._prob < 1.0 or not self._budget.warm or \
                self._kept is not None:
            return False
        cache, rows = self._cache, cand.rows
        assert rows is not None

        def admit() -> None:
            keys, kept_rows = cand.keys, rows
            if not keys.is_cuda:  # NOTE: the count is at hand: insert no padding
                used = min(int(cand.count), cand.cap)
                keys, kept_rows = keys[:used], kept_rows[:used]
            cache.insert(keys, kept_rows, validate=False)
            cand.buffer.fill_(EMPTY_KEY)
            cand.buffer[:1].zero_()

        graphed = GraphedCall(admit, cache.device)
        self._kept = (cand, graphed)
        return cand.buffer.is_cuda and graphed.capture()

    def logged(self, n: int) -> None:
        """After a lookup of ``n`` keys logged its misses (caller holds the cache guard
        and the table's read side): run a round if one is due."""
        self._calls += 1
        self._keys += n
        cfg, slots = self._config, self._cache.capacity
        fill = max(1, int(slots * cfg.admit_fraction))
        if self._budget.warm and n < fill:
            due = self._calls >= cfg.round_lookups or self._keys >= cfg.round_capacities * slots
        else:  # filling, or a batch large enough to pay for a round of its own
            due = self._keys >= fill
        if due:
            self.round()

    def round(self) -> None:
        """Admit what is logged (caller holds the guard and the table's read side)."""
        cand = self._cand
        if cand is None:
            return
        admitted = min(self._keys, cand.cap)
        kept = self._kept
        graphed = kept[1] if kept is not None and cand is kept[0] else None
        if graphed is not None:
            graphed()  # NOTE: one graph launch: the insert below, then the log emptied
        else:
            keys, rows = cand.keys, cand.rows
            assert rows is not None
            if keys.device.type == "cpu":  # NOTE: the count is at hand: insert no padding
                used = min(int(cand.count), cand.cap)
                keys, rows = keys[:used], rows[:used]
            if self._prob < 1.0:
                keep = torch.rand(keys.numel(), device=keys.device) < self._prob
                keys = torch.where(keep, keys, EMPTY_KEY)
            if keys.numel():
                self._cache.insert(keys, rows, validate=False)
        self._budget.admitted += admitted
        self.rounds += 1
        if graphed is not None and self._warm == self._budget.warm:
            self._calls = self._keys = 0
        else:
            self.drop()

    def drop(self) -> None:
        """Empty the log, in stream order (a change made logged rows stale, or a round
        took them); caller holds the cache guard."""
        self._calls = self._keys = 0
        cand = self._cand
        if cand is None:
            return
        if self._warm == self._budget.warm:
            cand.buffer.fill_(EMPTY_KEY)
            cand.buffer[:1].zero_()
            return
        self._release()  # NOTE: warm now (or cold again): the next log is sized for it

    def close(self) -> None:
        """Free the logs and the captured round (caller holds the cache guard)."""
        self.drop()
        self._release()
        kept, self._kept = self._kept, None
        if kept is not None and kept[0].buffer.is_cuda:
            # NOTE: a replay may still run: its graph and pool go once the stream is past it
            torch.cuda.current_stream(kept[0].buffer.device).synchronize()

    def _release(self) -> None:
        cand, self._cand = self._cand, None
        if self._kept is not None and cand is self._kept[0]:
            # NOTE: kept for the next warm phase, emptied now: what it logged is as old as
            # the lookups that logged it, and the cache went cold meanwhile (a clear, a
            # change feed that overflowed)
            cand.buffer.fill_(EMPTY_KEY)
            cand.buffer[:1].zero_()
            return
        if cand is not None and cand.buffer.is_cuda:
            # NOTE: lookups on other streams were ordered before this one (the cache
            # guard): the allocator reuses the blocks only after this stream's work
            stream = torch.cuda.current_stream(cand.buffer.device)
            cand.buffer.record_stream(stream)
            if cand.rows is not None:
                cand.rows.record_stream(stream)
