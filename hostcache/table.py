"""What every shared table has: mapping, writer lock, invalidation ring, process counters.

A handle notices a fork (``_checkpid``, as redis-py does) and rebuilds what must not be
shared with the parent: its writer-lock file description and its process counter slot.
Handles pickle by name, so a spawned process attaches the same segment.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self

import numpy as np

from hostcache import layout, segment
from hostcache.errors import BadArgumentError, HandleClosedError
from hostcache.lock import WriterLock

if TYPE_CHECKING:
    import torch

    from hostcache.ring import InvalidationRing

logger = logging.getLogger(__name__)

Scope = Literal["node", "process"]
_N_COUNTERS = len(layout.COUNTER_NAMES)
C_LOOKUPS, C_HITS, C_MISSES, C_INSERTS, C_EVICTIONS, C_UPDATES, C_ERASES = range(_N_COUNTERS)


class HitRate:
    """The hit rate of a counters record with ``hits`` and ``misses`` (the one definition
    shared by the host tables', the GPU cache's and the layers' stats)."""

    hits: int
    misses: int

    @property
    def hit_rate(self) -> float:
        """Hits over keys looked up (0.0 before the first lookup)."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    @property
    def measured_hit_rate(self) -> float | None:
        """Hits over keys looked up; None before the first lookup (what reports show)."""
        return self.hit_rate if self.hits + self.misses else None


@dataclass(frozen=True)
class TableStats(HitRate):
    """Counters of one shared table, node-wide or for this handle's process."""

    name: str
    kind: str
    scope: Scope
    capacity: int
    size: int
    lookups: int
    hits: int
    misses: int
    inserts: int
    evictions: int
    updates: int
    erases: int
    processes: int

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-ready) with the hit rate."""
        return {**asdict(self), "hit_rate": self.hit_rate}


@dataclass(frozen=True)
class FeedStatus:
    """How the node service follows the parameter server's change feed into a table (what
    it recorded in the table's header; all zero/None until a service follows it)."""

    #: propagation lag of the last change applied: commit in the parameter server to the
    #: erase here (seconds; None before the first).
    last_lag_s: float | None
    #: the largest such lag since the service began following.
    max_lag_s: float | None
    #: when changes were last applied (ns since the epoch; None: never).
    applied_ns: int | None
    #: full re-syncs after a gap in the feed (trimmed entries, a lost stream, a clear).
    gaps: int


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process of this pid namespace (a zombie is dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            state = f.read().rpartition(")")[2].split()
    except OSError:
        return True
    return not state or state[0] not in ("Z", "X")


def init_segment(mapping: segment.Mapping, geo: layout.Geometry) -> None:
    """Initialise a new, zeroed segment of either kind before its header is published.

    A new segment is zeros, i.e. key 0 everywhere: a host cache's slots are all marked
    empty first, so no reader ever sees key 0 with a zero row. A linear table needs nothing.
    """
    if geo.kind == layout.KIND_HOST_CACHE:
        mapping.words(geo.keys_off, geo.slots)[:] = layout.EMPTY_KEY


class SharedTable:
    """Base of :class:`~hostcache.HostCache` and :class:`~hostcache.SharedMemBlock`."""

    KIND: ClassVar[int]
    # NOTE: class-level defaults, so close() works even after a failed constructor.
    _mapping: segment.Mapping | None = None
    _lock: WriterLock | None = None
    _slot: int = -1
    _counters: np.ndarray = np.zeros(_N_COUNTERS, dtype=np.int64)
    _ring: InvalidationRing | None = None

    def __init__(self, name: str, mapping: segment.Mapping, geo: layout.Geometry) -> None:
        self.name = name
        self.geometry = geo
        self._mapping = mapping
        self._pid = os.getpid()
        self._procs = mapping.words(
            layout.PROC_OFF, layout.PROC_SLOTS * layout.PROC_WORDS
        ).reshape(layout.PROC_SLOTS, layout.PROC_WORDS)
        self._lock = WriterLock(name, mapping.header, self._repair)
        self._map_views(mapping, geo)
        self._claim_slot()

    # -- construction -------------------------------------------------------------------

    @classmethod
    def _create_segment(
        cls, name: str, geo: layout.Geometry, mode: int, overcommit: bool = False
    ) -> Self:
        mapping = segment.create(
            name, geo, mode=mode, init=init_segment, overcommit=overcommit
        )
        try:
            return cls(name, mapping, geo)
        except BaseException:
            mapping.close()
            segment.unlink(name)
            raise

    @classmethod
    def _attach_segment(cls, name: str, **want: object) -> Self:
        mapping, geo = segment.attach(name)
        try:
            layout.expect(geo, name, cls.KIND, **want)
            return cls(name, mapping, geo)
        except BaseException:
            mapping.close()
            raise

    def _map_views(self, mapping: segment.Mapping, geo: layout.Geometry) -> None:
        raise NotImplementedError

    def _repair(self) -> None:
        """Undo what a writer that died inside its section left (under the lock)."""
        raise NotImplementedError

    # -- process counter slots -------------------------------------------------------------

    def reap_dead_processes(self) -> list[int]:
        """Free the counter slots of processes that died without closing their handles.

        Their counters are added to the retired counters (node-wide stats keep them). Taking
        the writer lock also repairs a write section left by a writer that died inside it.

        Returns:
            The pids whose slots were freed.
        """
        with self._writing():
            return self._reap_locked()

    def _reap_locked(self) -> list[int]:
        """Retire and free the slots of dead processes (caller holds the writer lock)."""
        retired = self._header[layout.W_RETIRED : layout.W_RETIRED + _N_COUNTERS]
        pids = self._procs[:, 0]
        reaped: list[int] = []
        for i in np.flatnonzero(pids):  # a loop over process slots, not keys
            pid = int(pids[i])
            if not process_alive(pid):
                retired += self._procs[i, 1 : 1 + _N_COUNTERS]
                self._procs[i, :] = 0
                reaped.append(pid)
        return reaped

    def _claim_slot(self) -> None:
        with self._writing():
            self._reap_locked()
            free = np.flatnonzero(self._procs[:, 0] == 0)
            if free.size == 0:
                logger.warning(
                    "table %s: all %d process slots in use; this handle's counters stay "
                    "private to it",
                    self.name,
                    layout.PROC_SLOTS,
                )
                self._slot = -1
                self._counters = np.zeros(_N_COUNTERS, dtype=np.int64)
                return
            self._slot = int(free[0])
            self._procs[self._slot, 1:] = 0
            self._procs[self._slot, 0] = os.getpid()
            self._counters = self._procs[self._slot, 1 : 1 + _N_COUNTERS]

    def _release_slot(self) -> None:
        if self._slot < 0 or self._lock is None:
            return
        with self._writing():
            retired = self._header[layout.W_RETIRED : layout.W_RETIRED + _N_COUNTERS]
            retired += self._procs[self._slot, 1 : 1 + _N_COUNTERS]
            self._procs[self._slot, :] = 0
        self._slot = -1
        self._counters = np.zeros(_N_COUNTERS, dtype=np.int64)

    # -- plumbing -----------------------------------------------------------------------

    @property
    def _header(self) -> np.ndarray:
        return self._live().header

    def _live(self) -> segment.Mapping:
        if self._mapping is None:
            raise HandleClosedError(
                f"table {self.name!r}: this handle is closed; attach the table again"
            )
        if os.getpid() != self._pid:
            self._after_fork()
        return self._mapping

    def _after_fork(self) -> None:
        """In a forked child: new lock file description and counter slot (mapping is kept)."""
        assert self._mapping is not None
        logger.debug("table %s: handle used after fork; rebuilding lock and counters", self.name)
        self._pid = os.getpid()
        assert self._lock is not None
        self._lock = self._lock.reopened()  # the same lock file, even if its name is gone
        self._slot = -1
        self._claim_slot()

    def _writing(self, timeout: float | None = None) -> Any:
        self._live()
        assert self._lock is not None
        return self._lock.held(timeout)

    @property
    def ring(self) -> InvalidationRing:
        """The table's invalidation ring (its torch views made on first use)."""
        ring = self._ring
        if ring is None:
            from hostcache.ring import InvalidationRing

            ring = self._ring = InvalidationRing(self._live(), self.geometry)
        return ring

    @property
    def buffer(self) -> torch.Tensor:
        """uint8 CPU view of the whole segment (byte 0 is the header); for GPU registration."""
        return self._live().buffer

    @property
    def closed(self) -> bool:
        return self._mapping is None

    # -- public API common to both tables -----------------------------------------------

    def changes_since(self, seq: int) -> tuple[torch.Tensor, int, bool]:
        """Keys changed since cursor ``seq``: ``(keys, new_seq, overflowed)``.

        Start from :attr:`change_cursor`. ``overflowed`` means some changes were lost to
        this reader (it fell behind the ring, or the table was cleared): drop all cached rows.
        """
        if isinstance(seq, bool) or not isinstance(seq, int):
            raise BadArgumentError(f"seq must be an int cursor; got {type(seq).__name__}")
        self._live()
        return self.ring.changes_since(seq)

    @property
    def change_cursor(self) -> int:
        """The current end of the invalidation ring: where a new reader starts."""
        self._live()
        return self.ring.head

    def count_lookup(self, keys: int, hits: int) -> None:
        """Count a lookup made without :meth:`lookup` (a GPU kernel reading the segment)."""
        c = self._counters
        c[C_LOOKUPS] += 1
        c[C_HITS] += hits
        c[C_MISSES] += keys - hits

    def attached_pids(self) -> list[int]:
        """Live processes holding a handle on this table (one entry per handle)."""
        return [p for p in self.slot_pids() if process_alive(p)]

    def slot_pids(self) -> list[int]:
        """The pid of every process counter slot in use, alive or not: a dead process's
        slot stays until the next process that attaches (or the node service) reaps it."""
        self._live()
        return [int(p) for p in self._procs[:, 0] if p]

    @property
    def writer_pid(self) -> int:
        """The process inside a write section now (0: none). A dead one's section is
        repaired by the next writer that takes the lock."""
        return int(self._header[layout.W_WRITER_PID])

    @property
    def lock_inode(self) -> int:
        """Inode of the lock file this handle locks: a handle of a table that was removed
        and created again under its name keeps locking the file of the table it maps."""
        self._live()
        assert self._lock is not None
        return self._lock.inode

    def feed_status(self) -> FeedStatus:
        """What the node service recorded about following the change feed into this table."""
        h = self._header
        applied = int(h[layout.W_FEED_APPLIED_NS])
        return FeedStatus(
            last_lag_s=int(h[layout.W_FEED_LAG_US]) / 1e6 if applied else None,
            max_lag_s=int(h[layout.W_FEED_LAG_MAX_US]) / 1e6 if applied else None,
            applied_ns=applied or None,
            gaps=int(h[layout.W_FEED_GAPS]),
        )

    def record_feed(self, *, lag_s: float | None = None, gap: bool = False,
                    restart: bool = False) -> None:
        """For the node service: record a change applied ``lag_s`` after its commit, a gap
        re-synced, or (``restart``) that following starts over (the max lag is reset).
        Single writer (the one service of the node); readers may see a mix of two records."""
        h = self._header
        if restart:
            h[layout.W_FEED_LAG_MAX_US] = 0
        if lag_s is not None:
            us = max(0, int(lag_s * 1e6))
            h[layout.W_FEED_LAG_US] = us
            h[layout.W_FEED_LAG_MAX_US] = max(int(h[layout.W_FEED_LAG_MAX_US]), us)
            h[layout.W_FEED_APPLIED_NS] = time.time_ns()
        if gap:
            h[layout.W_FEED_GAPS] += 1

    @property
    def repairs(self) -> int:
        """Write sections left by dead writers and repaired since the table was created."""
        return int(self._header[layout.W_REPAIRS])

    def stats(self, scope: Scope = "node") -> TableStats:
        """Counters node-wide (every process, past and present) or of this handle only."""
        if scope not in ("node", "process"):
            raise BadArgumentError(f"scope must be 'node' or 'process'; got {scope!r}")
        h = self._header
        if scope == "node":
            counts = h[layout.W_RETIRED : layout.W_RETIRED + _N_COUNTERS].copy()
            counts += self._procs[:, 1 : 1 + _N_COUNTERS].sum(axis=0)
        else:
            counts = np.array(self._counters, copy=True)
        named = {name: int(c) for name, c in zip(layout.COUNTER_NAMES, counts, strict=True)}
        return TableStats(
            name=self.name,
            kind=layout.KIND_NAMES[self.KIND],
            scope=scope,
            capacity=self.geometry.capacity,
            size=self._size(),
            processes=len(set(self.attached_pids())),
            **named,
        )

    def _size(self) -> int:
        return int(self._header[layout.W_SIZE])

    def close(self) -> None:
        """Let go of this process's handle. The segment stays for the others (see unlink)."""
        if self._mapping is None:
            return
        try:
            if os.getpid() == self._pid:
                self._release_slot()
        finally:
            if self._lock is not None:
                self._lock.close()
                self._lock = None
            self._drop_views()
            mapping, self._mapping = self._mapping, None
            mapping.close()

    def _drop_views(self) -> None:
        pass

    @staticmethod
    def unlink(name: str) -> None:
        """Destroy the named segment for everyone (attached processes keep their mapping)."""
        segment.unlink(name)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (type(self).attach, (self.name,))  # type: ignore[attr-defined]

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    def __repr__(self) -> str:
        state = "closed" if self._mapping is None else "open"
        g = self.geometry
        return (
            f"{type(self).__name__}({self.name!r}, capacity={g.capacity}, dim={g.dim}, "
            f"dtype={g.dtype}, {state})"
        )
