"""The shared host tier: embedding tables in POSIX shared memory for every process of a node.

No CUDA is touched at import time; the ``gpu`` package registers these segments with CUDA.
"""

from __future__ import annotations

from .cache import CacheAudit, HostCache, Inserted
from .errors import (
    BadArgumentError,
    BadNameError,
    CorruptedHeaderError,
    GeometryMismatchError,
    HandleClosedError,
    HostCacheError,
    LayoutVersionError,
    LockTimeoutError,
    NonFiniteValuesError,
    SegmentExistsError,
    SegmentNotFoundError,
    SegmentPermissionError,
    SharedMemoryFullError,
    TableInUseError,
)
from .memblock import SharedMemBlock
from .ring import ChangeFeed
from .table import FeedStatus, TableStats

__all__ = [
    "BadArgumentError",
    "BadNameError",
    "CacheAudit",
    "Inserted",
    "ChangeFeed",
    "CorruptedHeaderError",
    "GeometryMismatchError",
    "HandleClosedError",
    "HostCache",
    "HostCacheError",
    "LayoutVersionError",
    "LockTimeoutError",
    "NonFiniteValuesError",
    "SegmentExistsError",
    "SegmentNotFoundError",
    "SegmentPermissionError",
    "SharedMemBlock",
    "SharedMemoryFullError",
    "TableInUseError",
    "FeedStatus",
    "TableStats",
]
