"""The shared host tier: embedding tables in POSIX shared memory for every process of a node.

No CUDA is touched at import time; the ``gpu`` package registers these segments with CUDA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hostcache.errors import (
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
from nvecache.common.lazy import lazy_names

if TYPE_CHECKING:
    from hostcache.cache import HostCache, Inserted
    from hostcache.cache_probes import CacheAudit
    from hostcache.memblock import SharedMemBlock
    from hostcache.ring import ChangeFeed
    from hostcache.table import FeedStatus, TableStats

# NOTE: the table classes are imported on first use (PEP 562): `import hostcache` (and the
# `hostcache` command's table commands) load no torch and no numba.
__getattr__, __dir__ = lazy_names(__name__, globals(), {
    "CacheAudit": "hostcache.cache_probes",
    "HostCache": "hostcache.cache",
    "Inserted": "hostcache.cache",
    "SharedMemBlock": "hostcache.memblock",
    "ChangeFeed": "hostcache.ring",
    "FeedStatus": "hostcache.table",
    "TableStats": "hostcache.table",
})

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
