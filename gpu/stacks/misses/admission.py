"""Admission of fetched rows into a GPU cache, in rounds (the Hierarchical stack's).

A Hierarchical lookup fetches its misses' rows from the host cache or the parameter
server, on the host's knowledge of which keys missed. The rows are appended to a log on
the device (two copies on the caller's stream; the host counts what the log holds) until
it holds a round's worth (``admit_keys``, at most ``admit_fraction`` of the cache's slots,
and once the cache is warm its round budget, ``warm_round_fraction`` of them) or
``admit_batches`` lookups have offered rows: an insert's host time hardly grows with its
keys, so a cache that mostly hits pays one insert per several lookups. Rows offered while
the log is full are not admitted; while the cache fills, a lookup that offers more than
the log has room for runs a round of its own at once.

On CUDA the warm cache's log is allocated when the layer is built and kept for good, and
its round runs in three steps (:mod:`gpu.stacks.misses.split_round`), each captured then
into a CUDA graph: the sort of the logged keys on a side stream, queued by the lookup
that fills the log, the bucket sort by a later one, the table writes by a later one still
(offers in between are not taken: the table half empties the log). No lookup pays a
round's dozens of launches; before, the one that ran it paid about a millisecond
(bench/RESULTS.md, "Hierarchical layer at serving sizes"). A cold cache's rounds, and the
CPU's, run whole, when due.

Consistency (the two-phase check): a lookup takes the change feed's cursor before it
reads. Rows it offers after the stack applied a change announced since then drop that
change's keys; changes applied later reach the log as they are applied
(:meth:`PendingAdmissions.changed`: their keys leave it, and a started round that copied
them is cancelled), and any write through the layer empties it.
"""

from __future__ import annotations

import math

import torch

from gpu.cache.gpu_cache import GPUCache, MissCandidates
from gpu.cache.guard import CacheGuard
from gpu.stacks.misses.change_follower import ChangeFollower
from gpu.stacks.misses.split_round import SplitRound
from gpu.tier_config import TierConfig
from hostcache.layout import EMPTY_KEY


class RoundBudget:
    """How many keys one admission round may bring into a cache: all its slots while it
    fills, ``warm_round_fraction`` of them once it has been offered ``warm_capacities``
    times as many keys as it has slots (a small cache then keeps its hot rows when lookups
    miss many cold keys). Offered keys repeat (a Zipf stream's hot keys), so one capacity's
    worth leaves the cache far from full: bench/RESULTS.md, "GPU-cache admission"."""

    def __init__(self, cache: GPUCache, config: TierConfig) -> None:
        self._cache = cache
        self._fraction = config.warm_round_fraction
        self._warm_at = config.warm_capacities * cache.capacity
        self.admitted = 0

    @property
    def warm(self) -> bool:
        return self.admitted >= self._warm_at

    def make_warm(self) -> None:
        """Count the cache as warm from now on (a layer loading its warm rounds' kernels)."""
        self.admitted = max(self.admitted, int(math.ceil(self._warm_at)))

    def cap(self) -> int:
        return self.cap_when(self.warm)

    def cap_when(self, warm: bool) -> int:
        """The cap of a round while the cache is warm (``warm``) or fills."""
        cap = self._cache.capacity
        return max(1, int(cap * self._fraction)) if warm else cap

    def reset(self) -> None:
        """The cache is empty again: fill it at full speed."""
        self.admitted = 0


class PendingAdmissions:
    """Rows read by lookups, waiting in a log on the device for their admission round.

    Args:
        cache: The GPU cache.
        guard: Its guard (held around every call here: each takes it).
        follower: The stack's change-feed follower (its cursor, and what changed since a
            lookup's).
        budget: The round budget shared with the stack.
        config: Round sizes and cadence.
    """

    def __init__(self, cache: GPUCache, guard: CacheGuard, follower: ChangeFollower,
                 budget: RoundBudget, config: TierConfig) -> None:
        self._cache, self._guard, self._follower = cache, guard, follower
        self._budget, self._config = budget, config
        self._log: MissCandidates | None = None
        self._log_warm = False  # the budget's phase the log was sized for
        #: a warm cache's log kept for good (CUDA), its round split in three steps
        self._kept: tuple[MissCandidates, SplitRound] | None = None
        self._used = 0  # rows appended to the log, counted on the host
        self._calls = 0  # offers since the last round
        self.rounds = 0

    @property
    def waiting(self) -> int:
        """Rows in the log (waiting for a round, or in one not yet applied)."""
        return self._used

    def _room(self, warm: bool) -> int:
        """The rows a log holds: one round's, at most ``admit_keys`` and ``admit_fraction``
        of the slots, and at most the budget's cap in the phase ``warm``."""
        cache, cfg = self._cache, self._config
        enough = min(cfg.admit_keys, max(1, int(cache.capacity * cfg.admit_fraction)))
        return min(enough, self._budget.cap_when(warm))

    def keep(self) -> bool:
        """Allocate the warm phase's log for good and split its round in three steps, each
        captured into a CUDA graph (:mod:`gpu.stacks.misses.split_round`; run once
        eagerly first, on the empty log: the kernels loaded); returns whether rounds
        replay them. At a CUDA layer's construction, inside the cache's ``warming_up``; on
        the CPU the log is kept the same way, its steps eager (no layer does that: tests
        do)."""
        cache = self._cache
        if self._kept is not None or cache.capacity == 0:
            return False
        cand = MissCandidates.empty(self._room(True), cache.device, dim=cache.dim,
                                    dtype=cache.dtype)
        cand.keys.fill_(EMPTY_KEY)
        split = SplitRound(cache, cand, False, self._guard)
        with self._guard:
            self._kept = (cand, split)
            return split.capture()

    def _split(self) -> SplitRound | None:
        """The kept log's split round, where the kept log is the current one and no CUDA
        graph is being captured (inside a caller's capture a round runs whole)."""
        kept = self._kept
        if kept is None or self._log is not kept[0]:
            return None
        if kept[0].buffer.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        return kept[1]

    def _current(self) -> MissCandidates:
        """The log for the budget's phase now (a new one when the phase changed)."""
        warm = self._budget.warm
        log = self._log
        if log is not None and self._log_warm == warm:
            return log
        self._release()
        kept = self._kept
        cache = self._cache
        if warm and kept is not None and kept[0].cap == self._room(True):
            log = kept[0]
        else:
            log = MissCandidates.empty(self._room(warm), cache.device, dim=cache.dim,
                                       dtype=cache.dtype)
        self._log, self._log_warm = log, warm
        return log

    def offer(self, keys: torch.Tensor, rows: torch.Tensor, since: int, prob: float,
              found: torch.Tensor | None = None) -> None:
        """Queue fetched rows (read after feed cursor ``since``, on the caller's stream;
        ``found``: bool flags of the rows to take, the others are default rows) for
        admission with probability ``prob`` each; start a round if one is due."""
        cache = self._cache
        n = keys.numel()
        if cache.capacity == 0 or n == 0 or prob <= 0.0:
            return
        # NOTE: rows not taken become the empty marker, which a round skips: no
        # compaction, so no host sync
        if prob < 1.0:
            pick = torch.rand(n, device=keys.device) < prob
            found = pick if found is None else found & pick
        if found is not None:
            keys = torch.where(found, keys, EMPTY_KEY)
        with self._guard:
            if self._follower.cursor != since:
                # NOTE: changes were applied after this lookup began: rows it read of
                # their keys may predate them (changes not yet applied reach the log
                # when they are: :meth:`changed`)
                changed, overflowed = self._follower.changed_since(since)
                if overflowed:
                    return
                if changed.numel():
                    stale = torch.isin(keys, changed.to(keys.device))
                    keys = torch.where(stale, EMPTY_KEY, keys)
            split = self._split()
            if split is not None and split.pending:
                if split.poll():
                    self._applied()
                else:
                    return  # NOTE: rows appended now would go with the log's table half
            log = self._current()
            used, room = self._used, log.cap - self._used
            if n > room and not self._log_warm:
                # NOTE: a cold cache and a large lookup: a round of its own, now
                self._used = self._calls = 0
                self._insert(torch.cat([log.keys[:used], keys]),
                             torch.cat([log.rows[:used], rows]))
                return
            take = min(n, room)
            if take:
                log.keys[used:used + take].copy_(keys[:take])
                log.rows[used:used + take].copy_(rows[:take])
                self._used = used + take
            self._calls += 1
            if self._used >= log.cap or self._calls >= self._config.admit_batches:
                self._round()

    def _round(self) -> None:
        """Admit what the log holds (caller holds the guard): the kept log's round is
        started (its later steps come with later offers), another's runs now."""
        log = self._log
        if log is None or self._used == 0:
            self._calls = 0
            return
        self._budget.admitted += self._used
        self.rounds += 1
        self._calls = 0
        split = self._split()
        if split is not None:
            split.start()
            return
        used, self._used = self._used, 0
        self._cache.insert(log.keys[:used], log.rows[:used], validate=False)
        if self._kept is not None and log is self._kept[0]:
            log.keys[:used].fill_(EMPTY_KEY)  # NOTE: the kept log's unused slots are empty

    def _insert(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """A round of its own (caller holds the guard): at most the budget's cap of the
        miss occurrences, a random sample of them (keys that missed often likelier in)."""
        cap = self._budget.cap()
        if keys.numel() > cap:
            keep = torch.randperm(keys.numel(), device=keys.device)[:cap]
            keys, rows = keys[keep], rows[keep]
        self._budget.admitted += keys.numel()
        self.rounds += 1
        self._cache.insert(keys, rows, validate=False)

    def _applied(self) -> None:
        """The kept log's table half was queued: the log is empty, in stream order."""
        self._used = 0

    def settle(self) -> None:
        """Queue what is left of a started round now: statistics and probes after it see
        its keys."""
        with self._guard:
            split = self._split()
            if split is not None and split.pending:
                split.finish()
                self._applied()

    def changed(self, keys: torch.Tensor | None) -> None:
        """The stack applied changes to ``keys`` (on the device; None: every key, the cache
        was cleared): rows logged of them may predate the change (caller holds the
        guard)."""
        if keys is None:
            self.drop()
            return
        if self._used == 0:
            return
        split = self._split()
        if split is not None and split.pending:
            split.cancel()  # NOTE: its sorted copy of the keys would bring them in
        log = self._log
        assert log is not None
        logged = log.keys[:self._used]
        logged.masked_fill_(torch.isin(logged, keys), EMPTY_KEY)

    def drop(self) -> None:
        """Forget every admission not yet made (a write made their rows stale)."""
        with self._guard:
            split = self._split()
            if split is not None:
                split.cancel()
            log, used = self._log, self._used
            self._used = self._calls = 0
            if log is not None and used and self._kept is not None and log is self._kept[0]:
                log.keys[:used].fill_(EMPTY_KEY)  # NOTE: the slots past it are empty

    def _release(self) -> None:
        """Let the current log go (caller holds the guard; its rows were dropped or
        admitted): the kept one stays, emptied."""
        self.drop()
        log, self._log = self._log, None
        if log is not None and log.buffer.is_cuda and (self._kept is None
                                                       or log is not self._kept[0]):
            # NOTE: rounds on this stream may still read it: the allocator reuses the
            # blocks only after this stream's work
            stream = torch.cuda.current_stream(log.buffer.device)
            log.buffer.record_stream(stream)
            assert log.rows is not None
            log.rows.record_stream(stream)

    def close(self) -> None:
        """Free the logs and the captured round."""
        with self._guard:
            self._release()
            kept, self._kept = self._kept, None
            if kept is not None:
                kept[1].close()
                if kept[0].buffer.is_cuda:
                    # NOTE: a replay may still run: its graph and pool go once the
                    # streams are past it
                    torch.cuda.current_stream(kept[0].buffer.device).synchronize()
