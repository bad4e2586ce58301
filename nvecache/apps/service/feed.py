"""One thread per table: follow the parameter server's change feed into the shared table.

The loop (``FeedFollower.run``):

1. connect to the parameter server (retrying with a bounded backoff while it is down);
2. pick the start cursor: the one handed in (taken before warm-up), else the cursor saved
   in the state dir if it belongs to the same PS table, else the feed's current end, and
   then the table is cleared, since changes made while nobody followed are unknown;
3. ``ps.follow(cursor, block_ms=poll_interval)``: the call returns as soon as a change is
   committed (it blocks on the feed: no timer between polls), or empty after
   ``poll_interval``; apply the keys; record the propagation lag (commit in the parameter
   server to the erase here, from the entries' commit times: the server's clock); save the
   cursor (atomically); call again at once.

Applying changes. Host cache: the changed keys are read from the PS, and every cached key
whose row differs from the PS's row is erased (appended to the invalidation ring, so every
replica's GPU cache drops it and the next lookup reads the new row from the PS); a key that
already holds the PS's row (this node's own replica wrote it through) is left alone, since
erasing it only opens a window for a replica's stale fill. The same check runs once more
``settle`` seconds later, which drops a stale row that a replica read from the PS just
before the write and inserted just after the first erase. Linear
table: the rows are read from the PS and written with ``write`` (announced the same way).
``ChangeFeedGapError``: the host cache is cleared (every replica drops everything), a linear
table reloaded from the PS, and the loop resumes from ``err.cursor``.

NOTE: the cursor is saved only after the keys were applied: a crash in between re-applies
them on restart (erasing twice is harmless), never skips them.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hostcache import HostCache, SharedMemBlock
from nvecache.apps.errors import PSTableMissingError
from nvecache.apps.service.config import TableConfig
from nvecache.apps.service.warmup import reload_linear
from psclient import ChangeFeedGapError, PSClientError, TableNotFoundError, connect
from psclient.redis.conn import redact

logger = logging.getLogger(__name__)

#: the longest wait between attempts while the parameter server is unreachable
MAX_BACKOFF_S = 5.0
#: feed entries per ``follow`` call
FEED_LIMIT = 256
#: upper bounds (seconds) of the propagation-lag histogram's buckets
LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


def ps_identity(cfg: TableConfig) -> str:
    """A digest naming the PS table a cursor belongs to (the URL may hold a password)."""
    return hashlib.sha256(f"{cfg.ps_url}\n{cfg.ps_name}".encode()).hexdigest()[:16]


def connect_ps(cfg: TableConfig) -> Any:
    """Open the parameter-server table behind ``cfg``; create it only if ``ps_create``.

    Without ``ps_create`` the table must exist with the configured dim and dtype
    (``ps_dtype``, default the table's ``dtype``): a name mistyped in the config is an
    error, never a new empty table.

    Args:
        cfg: a table config with a ``ps_url``.

    Returns:
        The table's ``ParameterServer``.

    Raises:
        PSTableMissingError: the table does not exist and ``ps_create`` is false.
        SchemaMismatchError: the table exists with another dim or dtype.
        PSClientError: the parameter server cannot be reached or refuses us.
    """
    assert cfg.ps_url is not None  # only tables with a ps_url have a parameter server
    if cfg.ps_create:
        return connect(cfg.ps_url, table=cfg.ps_name, dim=cfg.dim, dtype=cfg.ps_torch_dtype,
                       **cfg.ps_options)
    try:
        ps = connect(cfg.ps_url, table=cfg.ps_name, **cfg.ps_options)
    except TableNotFoundError:
        url = redact(cfg.ps_url)
        raise PSTableMissingError(
            f"table {cfg.name!r}: parameter-server table {cfg.ps_name!r} does not exist at "
            f"{url}; load it first (`psclient load {url} --table {cfg.ps_name} FILE`), fix "
            "ps_url / ps_table if they are mistyped, or set ps_create = true for this table "
            "to create it empty") from None
    try:
        ps.schema.check(cfg.ps_name, dim=cfg.dim, dtype=cfg.ps_format, partitions=None)
    except BaseException:
        ps.close()
        raise
    return ps


class CursorStore:
    """``<state_dir>/cursors/<table>.json``: the last applied cursor, written atomically."""

    def __init__(self, state_dir: str | Path, cfg: TableConfig) -> None:
        self.path = Path(state_dir) / "cursors" / f"{cfg.name}.json"
        self._identity = ps_identity(cfg)

    def load(self) -> str | None:
        """The saved cursor, or None if absent, unreadable or of another PS table."""
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("ps") != self._identity:
            return None
        cursor = data.get("cursor")
        return cursor if isinstance(cursor, str) else None

    def save(self, cursor: str) -> None:
        """Write tmp, fsync, rename: a reader sees the old or the new cursor, never half."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump({"ps": self._identity, "cursor": cursor, "saved": time.time()}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


@dataclass
class FeedState:
    """What the follower of one table has done (read by metrics and health)."""

    connected: bool = False
    up: bool = False
    cursor: str | None = None
    polls: int = 0
    poll_seconds: float = 0.0
    last_latency: float = 0.0
    last_ok: float = 0.0  # time.monotonic() of the last successful poll
    keys_applied: int = 0
    gaps: int = 0
    errors: int = 0
    full_resets: int = 0
    #: propagation lag of each applied batch (its oldest change): counts per
    #: ``LAG_BUCKETS`` bound (cumulative, as Prometheus wants them), the +Inf count, the sum
    lag_buckets: list[int] = field(default_factory=lambda: [0] * len(LAG_BUCKETS))
    lag_count: int = 0
    lag_sum: float = 0.0

    def observe_lag(self, seconds: float) -> None:
        """Count one applied batch's propagation lag in the histogram."""
        for i, bound in enumerate(LAG_BUCKETS):  # a loop over 13 buckets, once per batch
            if seconds <= bound:
                self.lag_buckets[i] += 1
        self.lag_count += 1
        self.lag_sum += seconds


class FeedFollower(threading.Thread):
    """Follows one table's PS change feed until ``stop`` is set."""

    def __init__(self, cfg: TableConfig, table: HostCache | SharedMemBlock,
                 store: CursorStore, stop: threading.Event, *, poll_interval: float,
                 settle: float, ps: Any = None, start_cursor: str | None = None) -> None:
        super().__init__(name=f"feed-{cfg.name}", daemon=True)
        self.cfg, self.table, self.store = cfg, table, store
        self._stop_event = stop
        self._poll = poll_interval
        self._settle = settle
        self._ps = ps
        self._start_cursor = start_cursor
        self._recent: collections.deque[tuple[float, torch.Tensor]] = collections.deque()
        self.state = FeedState()

    # -- the loop -------------------------------------------------------------------------

    def run(self) -> None:
        failures = 0
        cursor: str | None = None
        while not self._stop_event.is_set():
            try:
                if cursor is None:
                    cursor = self._establish()
                self._step(cursor)  # NOTE: blocks up to poll_interval for a change
                cursor = self.state.cursor
                failures = 0
            except (PSClientError, PSTableMissingError) as e:
                failures += 1
                self._down(e, failures)
            except Exception:  # noqa: BLE001 - the thread must outlive any one bad poll
                failures += 1
                self.state.errors += 1
                logger.exception("table %s: feed poll failed", self.cfg.name)
            if failures:
                self._stop_event.wait(min(MAX_BACKOFF_S, self._poll * 2 ** min(failures, 10)))
        if self._ps is not None:
            self._ps.close()

    def _down(self, err: Exception, failures: int) -> None:
        self.state.errors += 1
        if self.state.up or failures == 1:
            logger.warning("table %s: parameter server unavailable, retrying: %s",
                           self.cfg.name, err)
        self.state.up = False

    def _connect(self) -> Any:
        if self._ps is None:
            self._ps = connect_ps(self.cfg)
            logger.info("table %s: connected to parameter server table %s", self.cfg.name,
                        self.cfg.ps_name)
        self.state.connected = True
        return self._ps

    def _establish(self) -> str:
        """The cursor to start from (see the module docstring), applying a reset if needed."""
        ps = self._connect()
        if self._start_cursor is not None:
            cursor = self._start_cursor
            how = "after warm-up"
        elif (saved := self.store.load()) is not None:
            cursor, how = saved, "resumed from the saved cursor"
        else:
            cursor = ps.changes(None)[1]
            self._reset(ps)
            how = "no saved cursor: table reset, following from the feed's end"
        self.store.save(cursor)
        self.state.cursor = cursor
        self.state.up = True  # the feed answered (its end, or the saved cursor's table)
        self.table.record_feed(restart=True)
        logger.info("table %s: following the change feed at %s (%s)", self.cfg.name, cursor, how)
        return cursor

    def _step(self, cursor: str) -> None:
        """One ``follow`` call (it waits up to ``poll_interval`` for a change), applied."""
        ps = self._connect()
        started = time.monotonic()
        try:
            batch = ps.follow(cursor, limit=FEED_LIMIT, block_ms=max(1, int(self._poll * 1e3)))
        except ChangeFeedGapError as gap:
            self._account(started)
            self.state.gaps += 1
            logger.warning("table %s: change feed gap (%s); resetting the table, resuming "
                           "from %s", self.cfg.name, gap, gap.cursor)
            self._reset(ps)
            self.table.record_feed(gap=True)
            self._commit(gap.cursor)
            return
        self._account(started)
        if batch.keys.numel():
            self._apply(ps, batch.keys)
            if batch.oldest_ns is not None:
                lag = max(0.0, (time.time_ns() - batch.oldest_ns) / 1e9)
                self.state.observe_lag(lag)
                self.table.record_feed(lag_s=lag)
        self._resettle()
        if batch.cursor != cursor:
            self._commit(batch.cursor)

    def _account(self, started: float) -> None:
        now = time.monotonic()
        s = self.state
        s.polls += 1
        s.last_latency = now - started
        s.poll_seconds += s.last_latency
        s.last_ok = now
        if not s.up:
            logger.info("table %s: change feed reachable", self.cfg.name)
        s.up = True

    def _commit(self, cursor: str) -> None:
        self.store.save(cursor)
        self.state.cursor = cursor

    # -- applying changes -----------------------------------------------------------------

    def _apply(self, ps: Any, keys: torch.Tensor) -> None:
        if isinstance(self.table, HostCache):
            self._invalidate(ps, keys)
            if self._settle > 0:
                self._recent.append((time.monotonic() + self._settle, keys))
        else:
            rows = self.table.num_rows
            idx = keys[(keys >= 0) & (keys < rows)]
            if idx.numel():
                values, found = ps.lookup(idx)
                values[~found] = 0  # erased in the PS: the linear row goes back to zeros
                self.table.write(idx, values, allow_nonfinite=True)  # the PS's rows as they are
        self.state.keys_applied += int(keys.numel())
        logger.debug("table %s: applied %d changed keys", self.cfg.name, keys.numel())

    def _resettle(self) -> None:
        """Erase once more the keys whose settle time has passed."""
        now = time.monotonic()
        due = []
        while self._recent and self._recent[0][0] <= now:
            due.append(self._recent.popleft()[1])
        if due and self._ps is not None:
            self._invalidate(self._ps, torch.unique(torch.cat(due)))

    def _invalidate(self, ps: Any, keys: torch.Tensor) -> None:
        """Erase the cached keys whose row is not the PS's current row.

        NOTE: a key this node's own replicas just updated (PS first, then the host cache)
        already holds the PS's row: erasing it would only open a window in which a replica
        that read the PS before that update inserts the old row. PS read first, host second:
        a row equal to the PS's is at least as new as the change being applied.
        """
        assert isinstance(self.table, HostCache)
        hc = self.table
        values, found = ps.lookup(keys)
        cached, hit = hc.lookup(keys, count=False)  # a peek: not traffic
        same = hit & found & (cached == values).all(dim=1)
        if bool((~same).any()):
            hc.erase(keys[~same & hit])
            # keys not cached here are announced too: a replica filling one of them from a
            # read made before the change has its fill refused (HostCache.insert since=)
            hc.announce(keys[~hit])

    def _reset(self, ps: Any) -> None:
        """Forget every row that may be stale: clear a host cache, reload a linear table."""
        self.state.full_resets += 1
        self._recent.clear()
        if isinstance(self.table, HostCache):
            self.table.clear()
        else:
            reload_linear(self.cfg, self.table, ps)
