"""The ``file://`` store's row mirror: a memory-mapped hash table of a table's rows that
batched lookups read with compiled loops instead of one LMDB search per key.

LMDB stays the store of record (durable commits, the change feed in the same transaction);
the mirror is derived from it and only ever trusted when it provably equals it. A random
key costs LMDB a chain of dependent cache misses down its B-tree, which caps every read
path through its API; the mirror's probe is one hashed slot and a row copy, whose misses
overlap (bench/RESULTS.md, "Parameter server clients").

One file per table beside the LMDB files, ``rows.<table>.nvidx``: a header of int64 words
(:mod:`psclient.file.mirror_layout` names them), then the slots' keys and row indices, a stack of
free rows, and the rows. Protocol:

* **Writers** (every psclient write of rows, under one ``flock`` per store directory,
  ``mirror.lock``, plus a per-process lock for threads) make the header's ``GEN`` odd,
  commit to LMDB, apply the same change to the mirror, record LMDB's last transaction id,
  and make ``GEN`` even again. A write that fails before LMDB's commit leaves the mirror
  as it was; one that fails after it (or inside the mirror's own update) leaves it
  ``STALE``, rebuilt by the next writer; the caller's committed write still succeeds when
  only the mirror's update failed.
* **Readers** take no lock: ``GEN`` even, read, ``GEN`` unchanged, or else read LMDB
  instead (a write in flight, a stale or retired mirror). The seqlock's steps are separate
  calls (compiler barriers) and x86 keeps loads and stores in order, as in the host cache.
* A writer that finds ``GEN`` odd under the lock met a writer that died mid-write; it
  rebuilds the mirror from LMDB before writing. Opening a table checks, under the lock,
  that the mirror is even, ``OK``, written in this boot (page-cache writes lost in a
  crash of the machine leave no trace otherwise) and that LMDB's last transaction is the
  one it recorded (anything else, another table's write or a write that bypassed psclient,
  may have changed rows): otherwise it rebuilds it, scanning the table once.
* Growing or rebuilding writes a new file and renames it over the old one, whose header
  then says ``RETIRED``: a process still mapping it reopens the path.

The mirror takes 1.5-2x the rows' bytes on disk (allocated when it grows, so a full disk
is an error then, never a SIGBUS later) and holds the rows a second time in the page
cache; ``?mirror=false`` turns it off for a store (every lookup then searches LMDB).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from itertools import compress, islice
from typing import TYPE_CHECKING, Any

import numpy as np

from nvecache.common.fanout import split_run
from nvecache.common.lazy import lazy_import
from psclient.codec import be_bytes_to_keys
from psclient.file import mirror_layout
from psclient.file.mirror_files import HEADER_BYTES, OK, RETIRED, STALE, mirror_path
from psclient.file.mirror_files import thread_lock as _thread_lock
from psclient.file.mirror_twin import GATE as MIRROR_LOOPS

if TYPE_CHECKING:
    from psclient.file import mirror_loops as loops
else:  # NOTE: numba loads with the first compiled loop; the file's words need none
    loops = lazy_import("psclient.file.mirror_loops", globals(), "loops", preset=mirror_layout)

log = logging.getLogger(__name__)

_MAGIC, _FORMAT = mirror_layout.FILE_MAGIC, mirror_layout.FILE_FORMAT
_HEADER_BYTES = HEADER_BYTES
_MIN_SLOTS = 1024
#: rows read from LMDB per step of a rebuild
_REBUILD_CHUNK = 1 << 16


class _Mapped:
    """One mirror file mapped: its header and arrays as numpy views."""

    #: where a new file lies until it is published
    tmp: str | None = None

    def __init__(self, fd: int, size: int) -> None:
        self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        buf = memoryview(self._mm)
        self.hdr = np.frombuffer(buf, np.int64, loops.HEADER_WORDS)
        slots, cap, rb = (int(self.hdr[i]) for i in (loops.SLOTS, loops.ROW_CAP, loops.ROW_BYTES))
        at = _HEADER_BYTES
        self.skeys = np.frombuffer(buf, np.int64, slots, at)
        self.srows = np.frombuffer(buf, np.int64, slots, at + 8 * slots)
        self.free = np.frombuffer(buf, np.int64, cap, at + 16 * slots)
        self.rows = np.frombuffer(buf, np.uint8, cap * rb, at + 16 * slots + 8 * cap
                                  ).reshape(cap, rb)

    @staticmethod
    def size_of(slots: int, cap: int, row_bytes: int) -> int:
        return _HEADER_BYTES + 16 * slots + cap * (8 + row_bytes)


def _geometry(keys: int) -> tuple[int, int]:
    """(slots, row capacity) for a table about to hold ``keys`` keys, with room to grow."""
    cap = max(_MIN_SLOTS // 2, keys + keys // 2)
    slots = max(_MIN_SLOTS, 1 << (2 * cap - 1).bit_length())  # load <= 1/2 when full
    return slots, cap


class RowMirror:
    """One table's mirror in one process.

    Args:
        directory: The store's directory (LMDB's files are there).
        table: The table name.
        row_bytes: Bytes per row.
        scan: A context manager over one LMDB read of the table: it gives the table's row
            count and an iterator of ``(keys, values)`` chunks of its stored rows (raw
            LMDB bytes), for a rebuild.
        last_txnid: LMDB's last committed transaction id, now.
        check: raises if the table is gone (run under the lock before the mirror is built).
    """

    def __init__(self, directory: str, table: str, row_bytes: int,
                 scan: Callable[[], contextlib.AbstractContextManager[
                     tuple[int, Iterator[tuple[list[bytes], list[bytes]]]]]],
                 last_txnid: Callable[[], int], check: Callable[[], None] | None = None
                 ) -> None:
        self.path = mirror_path(directory, table)
        self._lock_path = os.path.join(directory, "mirror.lock")
        self._row_bytes = row_bytes
        self._scan, self._last_txnid = scan, last_txnid
        self._mode = os.stat(os.path.join(directory, "data.mdb")).st_mode & 0o666
        self._boot = mirror_layout.boot_id()
        self._map: _Mapped | None = None
        self._lock_fd = -1
        self._writing = False
        with self.writer_lock():
            if check is not None:
                check()
            self._ensure_fresh(at_open=True)

    # -- reading -------------------------------------------------------------------------

    def read(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """``(rows uint8 [N, row_bytes], found [N])`` of ``keys`` as the store holds them
        now, or None: ask LMDB (a write in flight, a stale mirror, a corrupt stored value)."""
        m = self._map
        if m is None or m.hdr[loops.STATE] != OK:
            m = self._reopen_if_retired()
            if m is None:
                return None
        hdr = m.hdr
        gen = hdr[loops.GEN]
        if gen & 1:
            return None
        n = keys.shape[0]
        out = np.empty((n, self._row_bytes), np.uint8)
        found = np.empty(n, np.bool_)

        def chunk(lo: int, hi: int) -> int:
            # NOTE: the compiled lookup once ready, its numpy twin until then (the writes
            # below compile theirs on first use)
            return int(MIRROR_LOOPS.pick().lookup(m.skeys, m.srows, m.rows, keys[lo:hi],
                                                  out[lo:hi], found[lo:hi]))

        # NOTE: a large batch on a few threads at once (nvecache.common.fanout: the loop waits on
        # memory and releases the GIL)
        bad = max(split_run(chunk, n))
        if hdr[loops.GEN] != gen or bad >= 0:
            return None
        return out, found

    def _reopen_if_retired(self) -> _Mapped | None:
        m = self._map
        if m is not None and m.hdr[loops.STATE] != RETIRED:
            return None  # STALE: the next writer rebuilds it
        try:
            new = self._open_file()
        except OSError:
            return None
        if new is None or new.hdr[loops.STATE] != OK:
            return None
        self._map = new
        return new

    # -- writing -------------------------------------------------------------------------

    @contextlib.contextmanager
    def writer_lock(self) -> Iterator[None]:
        """This process's threads, then the store's writers, one at a time."""
        with _thread_lock(self._lock_path):
            if self._lock_fd < 0:
                self._lock_fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, self._mode)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def writing(self, check: Callable[[], None] | None = None) -> Iterator[RowMirror]:
        """Around one write of rows: the LMDB commit inside, then :meth:`put` /
        :meth:`erase` / :meth:`clear` with what it committed. ``check()`` runs first under
        the lock (it raises when the table is gone: no mirror is rebuilt for it then)."""
        with self.writer_lock():
            if check is not None:
                check()
            self._ensure_fresh(at_open=False)
            m = self._map
            if m is None:  # NOTE: no mirror to keep (it could not be built): LMDB alone
                yield self
                return
            m.hdr[loops.GEN] += 1  # odd: readers go to LMDB
            before = self._last_txnid()
            self._writing = True
            try:
                yield self
            except BaseException:
                m = self._map
                if m is not None and m.hdr[loops.STATE] == OK:
                    if self._last_txnid() == before:
                        m.hdr[loops.GEN] += 1  # nothing committed, nothing applied: even
                    else:  # NOTE: committed, maybe not applied: rebuilt by the next writer
                        m.hdr[loops.STATE] = STALE
                raise
            finally:
                self._writing = False
            m = self._map
            if m is not None and m.hdr[loops.STATE] == OK:
                m.hdr[loops.TXNID] = self._last_txnid()
                m.hdr[loops.GEN] += 1

    def put(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Rows the write just committed (uint8 ``[N, row_bytes]``; the last of repeated
        keys wins), inside :meth:`writing`."""
        self._apply(lambda m: loops.put(m.hdr, m.skeys, m.srows, m.free, m.rows, keys,
                                        rows, False), keys.shape[0])

    def erase(self, keys: np.ndarray) -> None:
        self._apply(lambda m: loops.erase(m.hdr, m.skeys, m.srows, m.free, keys), 0)

    def clear(self) -> None:
        def wipe(m: _Mapped) -> None:
            m.srows[:] = loops.EMPTY
            for w in (loops.COUNT, loops.USED, loops.NEXT_ROW, loops.FREE_TOP):
                m.hdr[w] = 0
        self._apply(wipe, 0)

    def reserve(self, keys: int) -> None:
        """Grow once to hold ``keys`` more keys (a bulk load is coming)."""
        with self.writing():
            self._apply(lambda m: None, keys)

    def info(self) -> dict[str, Any]:
        """What ``stat()`` shows of the mirror."""
        m = self._map
        if m is None:
            return {"path": self.path, "state": "none (lookups search LMDB)"}
        state = {OK: "ok", STALE: "stale (lookups search LMDB until the next write)",
                 RETIRED: "retired"}.get(int(m.hdr[loops.STATE]), "unknown")
        return {"path": self.path, "state": state, "keys": int(m.hdr[loops.COUNT]),
                "slots": int(m.skeys.shape[0]), "row_capacity": int(m.rows.shape[0]),
                "file_bytes": os.path.getsize(self.path) if os.path.exists(self.path) else 0}

    def retire(self) -> None:
        """The table is dropped: the file goes, and every process stops reading it."""
        m = self._map
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        if m is not None:
            m.hdr[loops.STATE] = RETIRED
        self._map = None

    def _apply(self, change: Callable[[_Mapped], None], new_keys: int) -> None:
        assert self._writing, "inside writing() only"
        m = self._map
        if m is None or m.hdr[loops.STATE] != OK:
            return
        try:
            if new_keys:
                m = self._room_for(m, new_keys)
            change(m)
        except BaseException as e:
            m.hdr[loops.STATE] = STALE  # NOTE: odd and stale: readers use LMDB until a rebuild
            if not isinstance(e, Exception):  # NOTE: an interrupt is the caller's to report
                raise
            log.warning("the row mirror %s could not follow a write; lookups read LMDB "
                        "until the next write rebuilds it", self.path, exc_info=True)
            # NOTE: the write itself is committed: the caller's call succeeded

    def _room_for(self, m: _Mapped, n: int) -> _Mapped:
        hdr = m.hdr
        slots = m.skeys.shape[0]
        rows_left = m.rows.shape[0] - hdr[loops.NEXT_ROW] + hdr[loops.FREE_TOP]
        if hdr[loops.USED] + n <= slots * 3 // 4 and rows_left >= n:
            return m
        grown = self._new_file(int(hdr[loops.COUNT]) + n, gen=int(hdr[loops.GEN]))
        with _discarded_unless_published(grown):
            loops.copy_live(m.skeys, m.srows, m.rows, grown.hdr, grown.skeys, grown.srows,
                            grown.rows)
            self._publish(grown)
        return grown

    # -- files ---------------------------------------------------------------------------

    def _open_file(self) -> _Mapped | None:
        """The mirror at the path, mapped, if it is one of ours for these rows."""
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size < _HEADER_BYTES:
                return None
            head = np.frombuffer(os.pread(fd, 8 * loops.HEADER_WORDS, 0), np.int64)
            if head[loops.MAGIC] != _MAGIC or head[loops.VERSION] != _FORMAT or \
                    head[loops.ROW_BYTES] != self._row_bytes or size != _Mapped.size_of(
                        int(head[loops.SLOTS]), int(head[loops.ROW_CAP]), self._row_bytes):
                return None
            m = _Mapped(fd, size)
        finally:
            os.close(fd)
        return m

    def _new_file(self, keys: int, gen: int) -> _Mapped:
        """An empty mirror sized for ``keys`` keys, at a temporary path until published."""
        slots, cap = _geometry(keys)
        tmp = f"{self.path}.tmp-{os.getpid()}-{threading.get_ident()}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, self._mode)
        try:
            _allocate(fd, _Mapped.size_of(slots, cap, self._row_bytes))
            hdr = np.zeros(loops.HEADER_WORDS, np.int64)
            for word, value in ((loops.MAGIC, _MAGIC), (loops.VERSION, _FORMAT),
                                (loops.GEN, gen), (loops.STATE, OK), (loops.SLOTS, slots),
                                (loops.ROW_CAP, cap), (loops.ROW_BYTES, self._row_bytes),
                                (loops.BOOT0, self._boot[0]), (loops.BOOT1, self._boot[1])):
                hdr[word] = value
            os.pwrite(fd, hdr.tobytes(), 0)
            m = _Mapped(fd, _Mapped.size_of(slots, cap, self._row_bytes))
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(fd)
        m.srows[:] = loops.EMPTY
        m.tmp = tmp
        return m

    def _publish(self, new: _Mapped) -> None:
        """Rename a new file over the mirror's path; the old one's readers reopen it."""
        assert new.tmp is not None
        os.replace(new.tmp, self.path)
        new.tmp = None
        old = self._map
        if old is not None:
            old.hdr[loops.STATE] = RETIRED
        self._map = new

    def _ensure_fresh(self, *, at_open: bool) -> None:
        """Under the writer lock: map the mirror, rebuilding it if it cannot be trusted."""
        m = self._map
        if m is None or m.hdr[loops.STATE] == RETIRED:
            m = self._map = self._open_file()
        why = None
        if m is None:
            why = "none yet" if not os.path.exists(self.path) else "not readable as a mirror"
        elif m.hdr[loops.GEN] & 1:
            why = "a writer died while changing it"
        elif m.hdr[loops.STATE] != OK:
            why = "it missed a write"
        elif at_open and (int(m.hdr[loops.BOOT0]), int(m.hdr[loops.BOOT1])) != self._boot:
            why = "written before the machine restarted"
        elif at_open and m.hdr[loops.TXNID] != self._last_txnid():
            why = "the store changed since it was written"
        if why is not None:
            self._rebuild(why)

    def _rebuild(self, why: str) -> None:
        """The mirror from LMDB's rows, streamed from one read of the table into a file
        sized for its count (under the writer lock)."""
        t0 = time.perf_counter()
        rb = self._row_bytes
        try:
            with self._scan() as (count, chunks):
                new = self._new_file(count, gen=0)
                with _discarded_unless_published(new):
                    for keys, values in chunks:
                        good = np.fromiter(map(len, values), np.int64, len(values)) == rb
                        k = be_bytes_to_keys(b"".join(keys))
                        rows = np.frombuffer(b"".join(compress(values, good)), np.uint8)
                        loops.put(new.hdr, new.skeys, new.srows, new.free, new.rows,
                                  k[good], rows.reshape(-1, rb), False)
                        loops.put(new.hdr, new.skeys, new.srows, new.free, new.rows,
                                  k[~good], np.empty((0, rb), np.uint8), True)
                    new.hdr[loops.TXNID] = self._last_txnid()
                    self._publish(new)
        except OSError:
            log.warning("cannot build the row mirror %s: lookups read LMDB", self.path,
                        exc_info=True)
            return
        log.info("built the row mirror %s (%s): %d rows in %.2f s", self.path, why, count,
                 time.perf_counter() - t0)

    def after_fork(self) -> None:
        """In a forked child: a lock of its own (a flock is the open file's, shared)."""
        self._lock_fd = -1

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        self._map = None


def _allocate(fd: int, size: int) -> None:
    """Give a new file its blocks now: a store into a hole of a mapped file that the disk
    has no room for is a SIGBUS, a full disk here an OSError (no mirror, LMDB alone)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)  # NOTE: a file system without fallocate: a sparse file


@contextlib.contextmanager
def _discarded_unless_published(new: _Mapped) -> Iterator[None]:
    """A new file's temporary path is removed if the block fails before publishing it."""
    try:
        yield
    finally:
        if new.tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(new.tmp)


def scan_rows(txn: Any, db: Any) -> Iterator[tuple[list[bytes], list[bytes]]]:
    """Every row of an LMDB database, in ``(keys, values)`` chunks (a rebuild's read)."""
    items = txn.cursor(db=db).iternext()
    while True:
        chunk = list(islice(items, _REBUILD_CHUNK))
        if not chunk:
            return
        keys, values = zip(*chunk, strict=True)
        yield list(keys), list(values)
