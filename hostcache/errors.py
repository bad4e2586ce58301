"""The error root of the host tier and its meaningful subclasses.

Every error a user can cause raises one of these, with a message that says what to do.
Errors that are also argument errors subclass :class:`ValueError` / :class:`TypeError`
too, so generic handlers keep working.
"""

from __future__ import annotations


class HostCacheError(Exception):
    """Root of every error raised by the ``hostcache`` package."""


class BadArgumentError(HostCacheError, ValueError):
    """An argument has the wrong value, shape, dtype or device."""


class NonFiniteValuesError(BadArgumentError):
    """Rows to write hold NaN or infinite values; nothing was written. Pass
    ``allow_nonfinite=True`` to write them anyway."""


class BadNameError(BadArgumentError):
    """A segment name is not ``[A-Za-z0-9_.-]{1,100}``."""


class SegmentNotFoundError(HostCacheError, FileNotFoundError):
    """No shared segment of that name exists on this node."""


class SegmentExistsError(HostCacheError, FileExistsError):
    """A shared segment of that name already exists on this node."""


class SegmentPermissionError(HostCacheError, PermissionError):
    """The segment or its lock file belongs to another user or mode."""


class GeometryMismatchError(HostCacheError):
    """The segment's geometry (kind, capacity, dim, dtype, ...) is not the one asked for."""


class LayoutVersionError(HostCacheError):
    """The segment was written by an incompatible layout version of this package."""


class CorruptedHeaderError(HostCacheError):
    """The segment header fails validation: foreign, truncated or damaged segment."""


class HandleClosedError(HostCacheError):
    """The handle was closed; attach again to keep using the table."""


class LockTimeoutError(HostCacheError, TimeoutError):
    """The writer lock could not be taken within the timeout."""


class SharedMemoryFullError(HostCacheError):
    """The shared-memory filesystem has no room for the segment asked for; nothing was created.

    ``needed`` and ``free`` are in bytes. Creating with ``overcommit=True`` skips the check.
    """

    def __init__(self, message: str, *, needed: int = 0, free: int = 0) -> None:
        super().__init__(message)
        #: bytes the segment needs, and bytes free on the shared-memory filesystem
        self.needed, self.free = needed, free


class TableInUseError(HostCacheError):
    """``rm`` without ``--force`` on a table that live processes still have attached."""
