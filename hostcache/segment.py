"""POSIX shared-memory segments: names, creation, attachment, mapping, removal.

``close()`` (this process lets go of its mapping) is distinct from ``unlink()`` (the
segment is destroyed for everyone, once, by its owner). A mapping stays valid while any
tensor view of it lives, so closing a handle never pulls memory from under a tensor.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import posix_ipc

from hostcache import layout, shmlog
from hostcache.errors import (
    BadArgumentError,
    BadNameError,
    CorruptedHeaderError,
    SegmentExistsError,
    SegmentNotFoundError,
    SegmentPermissionError,
    SharedMemoryFullError,
)
from nvecache.common.lazy import lazy_import
from nvecache.common.names import TABLE_NAME_RULE, is_table_name

if TYPE_CHECKING:
    import torch
else:  # NOTE: a mapping's header is numpy; torch loads with its first tensor view
    torch = lazy_import("torch", globals())

#: this process's node namespace: tables of node ``X`` are ``nvec@X.<name>`` in /dev/shm
#: (lock files ``nvec-lock@X.<name>``), so several simulated nodes share one machine without
#: seeing each other's tables; unset (the default): ``nvec.<name>``, one node per machine.
NODE_ENV = "NVEC_NODE"
_NODE_RE = re.compile(r"[A-Za-z0-9_-]{1,32}")
SHM_DIR = "/dev/shm"
#: how long ``attach`` waits for a segment whose creator has not finished its header
ATTACH_READY_TIMEOUT_S = 2.0
GIB = 1 << 30


def check_name(name: object) -> str:
    """Return ``name`` if it is a valid table name, else raise :class:`BadNameError`.

    The rule is :func:`nvecache.common.names.is_table_name`, the one rule of every tier.
    """
    if not is_table_name(name):
        raise BadNameError(f"bad table name {name!r}: use {TABLE_NAME_RULE}")
    return name


def check_mode(mode: object) -> int:
    if isinstance(mode, bool) or not isinstance(mode, int) or mode & ~0o666 or not mode & 0o600:
        raise BadArgumentError(
            f"mode must be a permission mask within 0o666 that lets the owner read and "
            f"write (0o600 by default); got {mode!r}"
        )
    return mode


def node() -> str:
    """This process's node namespace (``NVEC_NODE``; "" when unset).

    Raises:
        BadArgumentError: the variable holds something other than ``[A-Za-z0-9_-]{1,32}``.
    """
    value = os.environ.get(NODE_ENV, "")
    if value and not _NODE_RE.fullmatch(value):
        raise BadArgumentError(f"{NODE_ENV}={value!r} is not a node name: use 1-32 letters, "
                               "digits, '_' or '-', or unset it")
    return value


def prefix() -> str:
    """The file-name prefix of this node's segments in /dev/shm."""
    n = node()
    return f"nvec@{n}." if n else "nvec."


def lock_prefix() -> str:
    """The file-name prefix of this node's lock files in /dev/shm."""
    n = node()
    return f"nvec-lock@{n}." if n else "nvec-lock."


def posix_name(name: str) -> str:
    return "/" + prefix() + name


def shm_path(name: str) -> str:
    return os.path.join(SHM_DIR, prefix() + name)


def lock_path(name: str) -> str:
    return os.path.join(SHM_DIR, lock_prefix() + name)


@dataclass
class Mapping:
    """One process's mapping of a segment: the raw buffer and typed views on it."""

    name: str
    mm: mmap.mmap
    header: np.ndarray  # int64[HEADER_WORDS] view of the header
    _buffer: torch.Tensor | None = field(default=None, repr=False)
    _closed: bool = field(default=False, repr=False)

    @property
    def buffer(self) -> torch.Tensor:
        """uint8 view of the whole segment (made on first use: the header needs no torch)."""
        if self._buffer is None:
            if self._closed:
                return torch.empty(0, dtype=torch.uint8)
            # NOTE: through a memoryview, which holds an export of the mmap for as long as
            # the tensor (or any view of it) lives: torch.frombuffer keeps a reference to
            # the object it is given but releases its buffer at once, so over the bare mmap
            # a close() would unmap pages that torch views (and CUDA registrations of them)
            # still point into.
            self._buffer = torch.frombuffer(memoryview(self.mm), dtype=torch.uint8)
        return self._buffer

    def words(self, offset: int, count: int) -> np.ndarray:
        """An int64 numpy view of ``count`` words at byte ``offset``."""
        return np.frombuffer(self.mm, dtype=np.int64, count=count, offset=offset)

    def tensor(self, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D torch view of ``count`` elements of ``dtype`` at byte ``offset``."""
        size = torch.empty((), dtype=dtype).element_size()
        return self.buffer[offset : offset + count * size].view(dtype)

    def close(self) -> None:
        """Drop this process's mapping; deferred while tensor views of it still live."""
        self.header = np.empty(0, dtype=np.int64)
        self._buffer, self._closed = None, True
        try:
            self.mm.close()
        except BufferError:
            # NOTE: views handed to the user still point into the mapping; it is unmapped
            # when the last of them is garbage collected (the views hold the mmap).
            pass


def _map(name: str, memory: posix_ipc.SharedMemory, size: int) -> Mapping:
    try:
        mm = mmap.mmap(memory.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        memory.close_fd()
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # NOTE: random row reads are TLB-bound with 4 KiB pages. Huge pages take effect
        # where /dev/shm is mounted with huge=advise (or always): `mount -o
        # remount,huge=advise /dev/shm`; elsewhere this is a no-op.
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    header = np.frombuffer(mm, dtype=np.int64, count=layout.HEADER_WORDS)
    return Mapping(name=name, mm=mm, header=header)


def free_bytes() -> int:
    """Bytes free for unprivileged writers on the shared-memory filesystem (``/dev/shm``)."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def check_space(name: str, size: int) -> None:
    """Refuse a segment of ``size`` bytes that ``/dev/shm`` has no room for.

    Segments are sparse: creating one takes no memory until rows are written, so an
    oversized table would only fail later, when a write hits the full filesystem (SIGBUS).

    Raises:
        SharedMemoryFullError: ``size`` exceeds the free space of the filesystem.
    """
    free = free_bytes()
    if size > free:
        raise SharedMemoryFullError(
            f"table {name!r} needs {size / GIB:,.2f} GiB of shared memory but {SHM_DIR} has "
            f"{free / GIB:,.2f} GiB free: ask for fewer rows, free shared memory (remove "
            "unused tables), or overcommit on purpose (overcommit=True)",
            needed=size, free=free)


def create(
    name: str,
    geo: layout.Geometry,
    *,
    mode: int = 0o600,
    init: Callable[[Mapping, layout.Geometry], None] | None = None,
    overcommit: bool = False,
) -> Mapping:
    """Create the segment (fails if it exists), size it, ``init`` it, write its header.

    The header's magic is written last, after ``init``: attachers wait for it, so nobody
    sees a half-initialised table. Unless ``overcommit``, a segment larger than the free
    space of ``/dev/shm`` is refused up front (:func:`check_space`).
    """
    check_name(name)
    check_mode(mode)
    if not overcommit:
        check_space(name, geo.total_size)
    try:
        memory = posix_ipc.SharedMemory(
            posix_name(name), flags=posix_ipc.O_CREX, mode=mode, size=geo.total_size
        )
    except posix_ipc.ExistentialError as e:
        raise SegmentExistsError(
            f"a table named {name!r} already exists on this node; attach it, or remove it "
            f"with `hostcache rm {name}` first"
        ) from e
    except OSError as e:  # e.g. ENOSPC on a small /dev/shm
        _unlink_quietly(name)
        raise SharedMemoryFullError(
            f"could not create a {geo.total_size}-byte segment for {name!r}: {e}; "
            "free shared memory or ask for a smaller capacity",
            needed=geo.total_size, free=free_bytes()) from e
    try:
        shmlog.record(shm_path(name))
        os.fchmod(memory.fd, mode)  # exact mode whatever the umask
        try:
            mapping = _map(name, memory, geo.total_size)
        except OSError as e:  # ENOMEM: more than the address space or overcommit allows
            raise SharedMemoryFullError(
                f"could not map a {geo.total_size}-byte segment for {name!r}: {e}; "
                "ask for fewer rows", needed=geo.total_size, free=free_bytes()) from e
        open_lock_file(name, mode=mode).close()
        if init is not None:
            init(mapping, geo)
        layout.write(mapping.header, geo, uid=os.getuid())
        return mapping
    except BaseException:
        memory.close_fd()
        _unlink_quietly(name)
        raise


def attach(name: str) -> tuple[Mapping, layout.Geometry]:
    """Map an existing segment and validate its header before trusting it."""
    check_name(name)
    try:
        memory = posix_ipc.SharedMemory(posix_name(name))
    except posix_ipc.ExistentialError as e:
        raise SegmentNotFoundError(
            f"no table named {name!r} on this node; create it (HostCache.create / "
            f"`hostcache create {name} ...`) or start the node service that owns it"
        ) from e
    except posix_ipc.PermissionsError as e:
        raise SegmentPermissionError(
            f"no permission to open table {name!r}: it belongs to another user or mode; "
            "run as its owner or have it created with a group mode (mode=0o660)"
        ) from e
    size = memory.size
    if size < layout.HEADER_BYTES:
        memory.close_fd()
        raise CorruptedHeaderError(
            f"segment {name!r} is {size} bytes, too small for a header; remove it with "
            f"`hostcache rm {name}`"
        )
    mapping = _map(name, memory, size)
    deadline = time.monotonic() + ATTACH_READY_TIMEOUT_S
    while int(mapping.header[layout.W_MAGIC]) == 0 and time.monotonic() < deadline:
        time.sleep(0.005)  # the creator writes the magic last; wait for it to finish
    try:
        geo = layout.read(mapping.header, name=name, segment_size=size)
    except BaseException:
        mapping.close()
        raise
    return mapping, geo


def open_lock_file(name: str, *, mode: int = 0o600) -> _Fd:
    """Open (creating if needed) the writer-lock file beside the segment; returns a fd."""
    path = lock_path(name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        os.fchmod(fd, mode)  # exact mode whatever the umask (a group must be able to write)
        shmlog.record(path)
    except FileExistsError:
        fd = _open_existing_lock(path)
    except PermissionError as e:
        raise SegmentPermissionError(
            f"no permission to open the lock file {path}; run as the table's owner"
        ) from e
    return _Fd(fd)


def _open_existing_lock(path: str) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except PermissionError as e:
        raise SegmentPermissionError(
            f"no permission to open the lock file {path}; run as the table's owner"
        ) from e


class _Fd(int):
    """An fd that can be closed with ``.close()`` (for ``open_lock_file(...).close()``)."""

    def close(self) -> None:
        os.close(self)


def _unlink_quietly(name: str) -> None:
    """Remove the segment and its lock file, whichever exist (a failed creation's)."""
    try:
        posix_ipc.unlink_shared_memory(posix_name(name))
    except posix_ipc.ExistentialError:
        pass
    try:
        os.unlink(lock_path(name))
    except FileNotFoundError:
        pass


def unlink(name: str) -> None:
    """Destroy the segment and its lock file. Processes still attached keep their mapping.

    A lock file left without its segment is removed too (no error then).
    """
    check_name(name)
    try:
        posix_ipc.unlink_shared_memory(posix_name(name))
    except posix_ipc.ExistentialError as e:
        if _unlink_orphan_lock(name):
            return
        raise SegmentNotFoundError(f"no table named {name!r} on this node to remove") from e
    except posix_ipc.PermissionsError as e:
        raise SegmentPermissionError(f"no permission to remove table {name!r}") from e
    try:
        os.unlink(lock_path(name))
    except FileNotFoundError:
        pass


def _unlink_orphan_lock(name: str) -> bool:
    try:
        os.unlink(lock_path(name))
    except FileNotFoundError:
        return False
    except PermissionError as e:
        raise SegmentPermissionError(f"no permission to remove the lock file of {name!r}") from e
    return True


def exists(name: str) -> bool:
    return os.path.exists(shm_path(check_name(name)))


def list_names() -> Iterator[str]:
    """Names of this package's segments on this node, sorted."""
    try:
        entries = sorted(os.listdir(SHM_DIR))
    except OSError as e:
        if e.errno == errno.ENOENT:
            return
        raise
    pre = prefix()
    for entry in entries:
        if entry.startswith(pre):
            try:
                # NOTE: lstat: a link is not a segment (and never followed)
                mode = os.lstat(os.path.join(SHM_DIR, entry)).st_mode
            except FileNotFoundError:  # removed since the listing (another process)
                continue
            if stat.S_ISREG(mode):
                yield entry[len(pre) :]
