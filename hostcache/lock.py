"""The robust writer lock of a shared table.

An ``flock`` on a file beside the segment: the kernel releases it when its holder dies,
at any instruction (a posix_ipc semaphore would stay taken forever). ``flock`` locks belong
to an open file description, so a thread lock guards the handle's own threads too.

The header word ``writer_pid`` is set while a write section runs. A writer that finds it
non-zero when it takes the lock knows the previous writer died inside its section and runs
the table's repair (odd slot versions become empty slots) before its own write.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from . import layout
from .errors import LockTimeoutError
from .segment import open_lock_file


class WriterLock:
    """Writer lock of one table for one handle (one fd, one thread lock)."""

    def __init__(self, name: str, header: np.ndarray, repair: Callable[[], None]) -> None:
        self._name = name
        self._header = header
        self._repair = repair
        self._fd: int | None = None
        self._fd = int(open_lock_file(name))
        self._thread_lock = threading.Lock()

    def close(self) -> None:
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
