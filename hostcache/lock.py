"""The robust writer lock of a shared table.

An ``flock`` on a file beside the segment: the kernel releases it when its holder dies,
at any instruction (a posix_ipc semaphore would stay taken forever). ``flock`` locks belong
to an open file description, so a thread lock guards the handle's own threads too.

The header word ``writer_pid`` is set while a write section runs. A writer that finds it
non-zero when it takes the lock knows the previous writer died inside its section and runs
the table's repair (odd slot versions become empty slots) before its own write.

The lock is the lock file's inode, not its name: a handle opens the file once (creating it
only for a segment that still exists, so attaching a table being removed leaves no lock
file behind), and a forked child reopens that same inode through ``/proc/self/fd``. A
table whose name was removed (a ``gpu.DistMemBlock`` journal once every rank holds it,
or a table removed and created again under its name) keeps one lock for its handles.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from hostcache import layout, segment
from hostcache.errors import LockTimeoutError, SegmentNotFoundError, SegmentPermissionError


class WriterLock:
    """Writer lock of one table for one handle (one fd, one thread lock)."""

    def __init__(self, name: str, header: np.ndarray, repair: Callable[[], None]) -> None:
        self._name = name
        self._header = header
        self._repair = repair
        self._fd: int | None = None
        self._fd = _open_lock(name)
        self._thread_lock = threading.Lock()

    def reopened(self) -> WriterLock:
        """A lock of the same lock file with its own file description (for a forked child:
        the inherited one is shared with the parent, so ``flock`` would not exclude it)."""
        assert self._fd is not None
        new = WriterLock.__new__(WriterLock)
        new._name, new._header, new._repair = self._name, self._header, self._repair
        new._thread_lock = threading.Lock()
        try:
            new._fd = os.open(f"/proc/self/fd/{self._fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError:  # no /proc: the name is all there is
            new._fd = _open_lock(self._name)
        self.close()  # this process's copy of the parent's description
        return new

    @property
    def inode(self) -> int:
        """Inode of the lock file this lock holds open."""
        assert self._fd is not None
        return os.fstat(self._fd).st_ino

    def close(self) -> None:
        """Close this handle's lock file description."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _take(self, timeout: float | None) -> None:
        assert self._fd is not None
        if timeout is None:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            return
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LockTimeoutError(
                        f"the writer lock of table {self._name!r} was not free within "
                        f"{timeout} s; another writer holds it for long, retry later"
                    ) from None
                time.sleep(delay)  # bounded backoff while polling a non-blocking flock
                delay = min(delay * 2, 0.01)

    @contextmanager
    def held(self, timeout: float | None = None) -> Iterator[None]:
        """Hold the lock for one write section (repairing a dead writer's section first)."""
        if not self._thread_lock.acquire(timeout=-1 if timeout is None else timeout):
            raise LockTimeoutError(
                f"the writer lock of table {self._name!r} is held by another thread of this "
                "process for longer than the timeout"
            )
        try:
            self._take(timeout)
            try:
                h = self._header
                if int(h[layout.W_WRITER_PID]) != 0:
                    self._repair()
                    h[layout.W_REPAIRS] += 1
                h[layout.W_WRITER_PID] = os.getpid()
                yield
                h[layout.W_WRITER_PID] = 0
            finally:
                assert self._fd is not None
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()


def _open_lock(name: str) -> int:
    """Open the table's lock file; recreate a missing one only while the segment exists."""
    path = segment.lock_path(name)
    try:
        return os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        pass
    except PermissionError as e:
        raise SegmentPermissionError(
            f"no permission to open the lock file {path}; run as the table's owner"
        ) from e
    gone = SegmentNotFoundError(
        f"table {name!r} was removed while this process attached it; create it again"
    )
    try:
        mode = os.stat(segment.shm_path(name)).st_mode & 0o666
    except FileNotFoundError:
        raise gone from None
    fd = int(segment.open_lock_file(name, mode=mode))
    if not os.path.exists(segment.shm_path(name)):  # removed meanwhile: take ours back
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
        except FileNotFoundError:
            pass
        os.close(fd)
        raise gone
    return fd
