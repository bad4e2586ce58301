"""Admission of a LinearUVM cache's misses with no host sync (the LinearUVM stack's).

The lookup kernel itself appends each key it missed to a miss log on the device (a
:class:`~gpu.cache.gpu_cache.MissCandidates` buffer: a count, then the keys; slots not written hold
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
kernel block order (batch order for a page-ordered lookup: gpu.kernels.cache_lookup), up to its
:class:`~gpu.stacks.misses.admission.RoundBudget` (``warm_round_fraction`` of the cache's slots)
once
the cache is warm; while it fills, up to ``admit_fraction`` of its slots, or a larger
lookup's size. The log's rows cost that much device memory beside the cache: an eighth
of the cache's rows once it is warm with the defaults, while it fills a quarter, or one
lookup's output.

On CUDA a LinearUVM stack keeps the warm cache's log for good from its construction
(:meth:`MissLog.keep`; while the cache fills, it waits beside the filling log), and that
log's round runs in three steps (:mod:`gpu.stacks.misses.split_round`), each captured there into a
CUDA graph (:mod:`gpu.cuda.graphed`): the insert's two sorts on a side stream, the first
started by the lookup that makes the round due and the second by a later one, and its
table writes (then the log emptied) queued by the first lookup after the sorts are done.
No lookup waits for the sorts on its own stream, and each step costs the lookup that
queues it one graph launch instead of a dozen allocations and launches (bench/RESULTS.md,
"Per-call path (H200)"). Statistics, cache probes and ``flush`` queue what is left of a
round first.

Consistency: a logged row is as old as the lookup that read it, so the log is emptied
whenever the stack learns of a change to the table (the change follower's ``on_change``,
:meth:`MissLog.changed`; a write through the layer; an erase): a row logged before a
change is never admitted after it.
"""

from __future__ import annotations

import torch

from gpu.cache.gpu_cache import GPUCache, MissCandidates
from gpu.cache.guard import CacheGuard
from gpu.stacks.misses.admission import RoundBudget
from gpu.stacks.misses.split_round import SplitRound
from gpu.tier_config import TierConfig
from hostcache.layout import EMPTY_KEY


class MissLog:
    """The device-side log of one cache's misses and their rows, and its admission rounds.

    Args:
        cache: The GPU cache.
        budget: The round budget shared with the stack (reset on clear).
        config: Round cadence.
        prob: Admission probability of a logged miss (``InsertPolicy.gpu``).
        num_rows: The linear table's rows, if known: every logged key is below it.
        guard: The cache's guard, held around every call here (its ``stream``).
    """

    def __init__(self, cache: GPUCache, budget: RoundBudget, config: TierConfig,
                 prob: float, num_rows: int | None = None,
                 guard: CacheGuard | None = None) -> None:
        self._cache, self._budget, self._config, self._prob = cache, budget, config, prob
        self._num_rows, self._guard = num_rows, guard
        self._cand: MissCandidates | None = None
        #: a warm cache's log kept for good, with its round in three steps, each captured
        #: into a CUDA graph (:meth:`keep`, gpu.stacks.misses.split_round)
        self._kept: tuple[MissCandidates, SplitRound] | None = None
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
        kernels loaded) for every later warm phase, its round split in three steps
        (:mod:`gpu.stacks.misses.split_round`), each step captured into a CUDA graph; returns
        whether
        rounds now replay them. At a layer's construction: the capture holds the device's
        default random generator (gpu.cuda.graphed). On the CPU the log is kept the same way,
        its steps eager (no layer does that: tests do)."""
        cand = self._cand
        if cand is None or self._prob < 1.0 or not self._budget.warm or \
                self._kept is not None:
            return False
        small = self._num_rows is not None and self._num_rows <= 1 << 31
        split = SplitRound(self._cache, cand, small, self._guard)
        self._kept = (cand, split)
        return split.capture()

    def _split(self) -> SplitRound | None:
        """The current log's split round, where it is the kept log and no CUDA graph is
        being captured (inside a caller's capture a round runs whole, in stream order, and
        becomes part of that graph)."""
        kept = self._kept
        if kept is None or self._cand is not kept[0]:
            return None
        if kept[0].buffer.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        return kept[1]

    def settle(self) -> None:
        """Queue what is left of a pending round now (caller holds the cache guard):
        statistics and probes after it see its keys."""
        split = self._split()
        if split is not None:
            split.finish()

    def logged(self, n: int) -> None:
        """After a lookup of ``n`` keys logged its misses (caller holds the cache guard
        and the table's read side): queue the next step of a round whose last step is
        done, and start a round if one is due."""
        kept = self._kept
        if kept is not None and kept[1].pending:
            split = self._split()
            if split is not None:
                split.poll()
        self._calls += 1
        self._keys += n
        cfg, slots = self._config, self._cache.capacity
        fill = max(1, int(slots * cfg.admit_fraction))
        if self._budget.warm and n < fill:
            due = self._calls >= cfg.round_lookups or self._keys >= cfg.round_capacities * slots
        else:  # filling, or a batch large enough to pay for a round of its own
            due = self._keys >= fill
        if due:
            self.round(wait=False)

    def round(self, wait: bool = True) -> None:
        """Admit what is logged (caller holds the guard and the table's read side). The
        kept log's round is split (gpu.stacks.misses.split_round): with ``wait=False`` its later
        steps
        come with later lookups, and while one is pending no other starts (the lookups
        go on counting: the next one due starts it)."""
        cand = self._cand
        if cand is None:
            return
        split = self._split()
        if split is not None:
            if split.pending:
                if not wait:
                    return
                split.finish()
            self._budget.admitted += min(self._keys, cand.cap)
            self.rounds += 1
            split.start()
            if wait:
                split.finish()
            if self._warm == self._budget.warm:
                self._calls = self._keys = 0
            else:
                self.drop()
            return
        admitted = min(self._keys, cand.cap)
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
        self.drop()

    def changed(self, keys: torch.Tensor | None) -> None:
        """The stack applied a change (to ``keys``, or to every key): a logged row is as old
        as its lookup, so the whole log goes (caller holds the cache guard)."""
        self.drop()

    def drop(self) -> None:
        """Empty the log, in stream order (a change made logged rows stale, or a round
        took them); caller holds the cache guard."""
        self._calls = self._keys = 0
        if self._kept is not None:
            self._kept[1].cancel()  # NOTE: its table half would read rows logged anew
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
            # NOTE: a replay may still run: its graph and pool go once the streams are
            # past it
            kept[1].close()
            torch.cuda.current_stream(kept[0].buffer.device).synchronize()

    def _release(self) -> None:
        cand, self._cand = self._cand, None
        if self._kept is not None and cand is self._kept[0]:
            self._kept[1].cancel()
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
