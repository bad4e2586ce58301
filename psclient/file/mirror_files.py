"""A ``file://`` store's row mirror files as files: where one lies, the store's writers'
lock, and retiring one (:mod:`psclient.file.mirror` keeps the mirror itself).

A drop takes the writers' lock whether or not its client keeps a mirror (another process
may), so no writer rebuilds a mirror of a table while it is dropped; what a drop (or the
removal of data left without a table) finds at the path is retired, then deleted.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
import threading
from collections.abc import Iterator

from psclient.file import mirror_layout as layout

#: a mirror's states (its header's ``STATE`` word), and the header's size
OK, STALE, RETIRED = 0, 1, 2
HEADER_BYTES = 4096

#: (pid, lock path) -> the lock that orders this process's threads before the flock
_THREAD_LOCKS: dict[tuple[int, str], threading.Lock] = {}
_THREAD_LOCKS_GUARD = threading.Lock()


def thread_lock(path: str) -> threading.Lock:
    """This process's lock for the store lock file ``path`` (taken before its flock)."""
    with _THREAD_LOCKS_GUARD:
        key = (os.getpid(), path)  # NOTE: a forked child never inherits a held one
        lock = _THREAD_LOCKS.get(key)
        if lock is None:
            lock = _THREAD_LOCKS[key] = threading.Lock()
        return lock


def mirror_path(directory: str, table: str) -> str:
    """The mirror file of ``table`` in a store directory."""
    return os.path.join(directory, f"rows.{table}.nvidx")


@contextlib.contextmanager
def store_lock(directory: str) -> Iterator[None]:
    """The store's mirror writers' lock, taken without a mirror: this process's threads,
    then the store's processes."""
    lock_path = os.path.join(directory, "mirror.lock")
    with thread_lock(lock_path):
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # NOTE: releases the flock


def remove_mirror(directory: str, table: str) -> bool:
    """Under :func:`store_lock`: retire and delete ``table``'s mirror file, if any. Returns
    whether there was one."""
    path = mirror_path(directory, table)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        if os.fstat(fd).st_size >= HEADER_BYTES:
            with mmap.mmap(fd, HEADER_BYTES) as mm:
                # NOTE: processes still mapping it reopen the path, and find none
                struct.pack_into("q", mm, 8 * layout.STATE, RETIRED)
        os.unlink(path)
    finally:
        os.close(fd)
    return True
