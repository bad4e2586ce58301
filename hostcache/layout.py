"""Byte layout of a shared segment (host cache or linear table) and its validation.

One POSIX shared-memory segment per table, ``/dev/shm/nvec.<name>``. All integers are
little-endian; every region starts on a 4 KiB page; the row area is page aligned and every
row starts on a 16-byte boundary so GPU kernels can read rows with wide loads. A row's bytes
(payload, per-row parameters, stride) are its :class:`nvecache.common.rows.RowFormat`'s.

::

    offset        size                     what
    0             4096                     header: 512 int64 words (below)
    PROC_OFF      PROC_SLOTS * 16 * 8      per-process counter slots (below)
    keys_off      slots * 8                int64 key per slot, EMPTY_KEY when free   [HC only]
    versions_off  slots * 8                int64 seqlock version per slot            [HC only]
    counters_off  slots * 4                int32 eviction-policy counter per slot    [HC only]
    ring_seq_off  ring_capacity * 8        int64 sequence number of each ring record
    ring_key_off  ring_capacity * 8        int64 key (host cache) / row index (linear table)
    rows_off      slots * row_stride       rows; row i at rows_off + i * row_stride

``slots`` is ``num_buckets * ways`` for a host cache (slot ``b * ways + w`` is way ``w`` of
bucket ``b``) and ``num_rows`` for a linear table (``SharedMemBlock``).

Header words (int64 each; words 1..21 are static and covered by the checksum in word 22):

====  ===================  =====================================================
word  name                 meaning
====  ===================  =====================================================
0     magic                ``MAGIC``; written last by the creator (readiness flag)
1     layout_version       ``LAYOUT_VERSION``
2     kind                 1 = host cache, 2 = linear table
3     capacity             slots (host cache) or rows (linear table)
4     num_buckets          host cache buckets (0 for a linear table)
5     ways                 slots per bucket (0 for a linear table)
6     dim                  row elements
7     dtype_code           the row format's code (``nvecache.common.rows.code_of``)
8     elem_size            bytes per element
9     row_bytes            dim * elem_size (the payload)
10    row_stride           row_bytes + per-row parameters, rounded up to ``ROW_ALIGN``
11    policy_code          eviction policy (see ``POLICY_CODES``)
12    creator_uid          uid of the creating process
13    created_ns           creation time, ns since the epoch
14    total_size           segment size in bytes
15-21 offsets              keys, versions, counters, ring_seq, ring_key, rows, ring_capacity
22    checksum             crc32 of words 1..21
32    size                 occupied slots (host cache), maintained under the writer lock
33    ring_head            records ever appended to the invalidation ring
34    writer_pid           pid of the writer inside a write section, 0 outside
35    repairs              times a writer repaired a section left by a dead writer
36    feed_lag_us          the node service: propagation lag of the last change applied
37    feed_lag_max_us      the largest such lag since the service began following
38    feed_applied_ns      when it last applied changes (ns since the epoch), 0: never
39    feed_gaps            full re-syncs after a gap in the parameter server's feed
40-47 retired counters     counters of process slots whose process has exited
====  ===================  =====================================================

Process slot (16 int64 words): pid, then the counters ``COUNTER_NAMES`` in order.

Seqlock protocol per slot (host cache): a writer, holding the writer lock, makes the
version odd, writes key and row, then makes it even again. A reader finds the slot by
its bucket's keys, then reads the slot's version, row and key, then the version again; a
changed or odd version, or another key inside that window, is a miss. A reader therefore
never returns a torn or foreign row. (GPU readers read the bucket's versions before its
keys instead; both orders are correct against the same writer.) On x86 (TSO) stores are
seen in program order and loads are not reordered with loads; the compiler is kept from
reordering the steps by making each step of a write a separate call (a torch op, or one of
``hostcache.table_loops``' compiled loops: a compiler barrier) and by fences between the
passes of the one compiled lookup, so no hardware fence is needed for the order itself;
GPU readers use system-scope loads.

Seqlock protocol per row (quantized linear table): each row carries an int32 version in
the 4 bytes after its stored bytes (its stride has room for them: ``row_stride`` is the
stored bytes and the version, aligned). A writer, holding the writer lock, makes the row's
version odd, writes the row (payload and parameters), then makes it even again; a reader
reads the version, the row, then the version again, and reads the row again while the two
differ or are odd. A row's payload is then never decoded with another write's scale or
bias, whichever process wrote it (:mod:`hostcache.row_versions`). A plain linear table
has no versions: a row read during another process's write is a mix of old and new
elements, each of them whole.

Invalidation ring: record ``s`` lives at ``s % ring_capacity``. A writer stores
``seq = -1``, then the key, then ``seq = s``, then advances ``ring_head``. A reader that
reads the key and then finds ``seq == s`` has read the key of record ``s``.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from hostcache.errors import (
    BadArgumentError,
    CorruptedHeaderError,
    GeometryMismatchError,
    LayoutVersionError,
)
from nvecache.common import rows
from nvecache.common.keys import RESERVED_KEY

if TYPE_CHECKING:
    import torch

MAGIC = int.from_bytes(b"NVECACHE", "little")
LAYOUT_VERSION = 1
PAGE = 4096
HEADER_BYTES = PAGE
HEADER_WORDS = HEADER_BYTES // 8
ROW_ALIGN = rows.ROW_ALIGN

KIND_HOST_CACHE = 1
KIND_LINEAR = 2
KIND_NAMES = {KIND_HOST_CACHE: "hostcache", KIND_LINEAR: "linear"}
#: the row formats each kind stores (plain or quantized rows)
KIND_FORMATS = {KIND_HOST_CACHE: rows.FORMATS, KIND_LINEAR: rows.FORMATS}

#: reserved key marking an empty host-cache slot; users may use every other int64. The one
#: definition is ``nvecache.common.keys.RESERVED_KEY``: every tier refuses to write it.
EMPTY_KEY = RESERVED_KEY

PROC_SLOTS = 256
PROC_WORDS = 16
PROC_OFF = HEADER_BYTES
PROC_BYTES = PROC_SLOTS * PROC_WORDS * 8
COUNTER_NAMES = ("lookups", "hits", "misses", "inserts", "evictions", "updates", "erases")

DEFAULT_RING_CAPACITY = 1 << 16
#: bytes of a quantized linear table's per-row seqlock version (int32)
ROW_VERSION_BYTES = 4

POLICY_CODES = {"lfu-da": 1}
CODE_POLICIES = {code: name for name, code in POLICY_CODES.items()}

# header word indices
W_MAGIC, W_VERSION, W_KIND, W_CAPACITY, W_BUCKETS, W_WAYS, W_DIM, W_DTYPE = range(8)
W_ELEM, W_ROW_BYTES, W_ROW_STRIDE, W_POLICY, W_UID, W_CREATED, W_TOTAL = range(8, 15)
W_KEYS_OFF, W_VERSIONS_OFF, W_COUNTERS_OFF, W_RING_SEQ_OFF, W_RING_KEY_OFF = range(15, 20)
W_ROWS_OFF, W_RING_CAP, W_CHECKSUM = 20, 21, 22
W_SIZE, W_RING_HEAD, W_WRITER_PID, W_REPAIRS = 32, 33, 34, 35
W_FEED_LAG_US, W_FEED_LAG_MAX_US, W_FEED_APPLIED_NS, W_FEED_GAPS = 36, 37, 38, 39
W_RETIRED = 40
STATIC_WORDS = slice(1, 22)


def _page_up(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def checked_dtype(dtype: object, allowed: tuple[str, ...] = tuple(rows.DTYPES)) -> str:
    """The name of ``dtype`` (a torch dtype or its name) if it is one of ``allowed`` (the
    formats the table's kind stores; default the plain ones), else a
    :class:`BadArgumentError`."""
    try:
        return rows.dtype_name(dtype, allowed)
    except rows.RowFormatError:
        names = ", ".join(f"torch.{d}" for d in allowed)
        raise BadArgumentError(f"dtype must be one of {names}; got {dtype!r}") from None


@dataclass(frozen=True)
class Geometry:
    """Where everything lives in a segment. Built by :func:`plan` or read by :func:`read`."""

    kind: int
    capacity: int
    num_buckets: int
    ways: int
    dim: int
    #: the row dtype's name (``"float32"``); :attr:`dtype` is the torch dtype
    dtype_name: str
    policy: str
    ring_capacity: int
    keys_off: int
    versions_off: int
    counters_off: int
    ring_seq_off: int
    ring_key_off: int
    rows_off: int
    total_size: int
    creator_uid: int = 0
    created_ns: int = 0

    @cached_property
    def row_format(self) -> rows.RowFormat:
        """How a row is stored: its payload, its parameters, its stride."""
        return rows.RowFormat(self.dtype_name, self.dim)

    @cached_property
    def dtype(self) -> torch.dtype:
        """The row dtype (the first read imports torch)."""
        return self.row_format.torch_dtype

    @property
    def elem_size(self) -> int:
        return self.row_format.itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes of a row's payload (``dim * elem_size``)."""
        return self.row_format.row_bytes

    @property
    def row_stride(self) -> int:
        """Bytes from one slot's row to the next (payload and parameters, aligned; in a
        quantized linear table, and the row's seqlock version)."""
        if self.row_versions:
            return rows.align_up(self.row_format.stored_bytes + ROW_VERSION_BYTES)
        return self.row_format.stride

    @property
    def row_versions(self) -> bool:
        """Whether each row carries a seqlock version after its stored bytes (a quantized
        linear table's rows)."""
        return self.kind == KIND_LINEAR and self.row_format.quantized

    @property
    def slots(self) -> int:
        return self.num_buckets * self.ways if self.kind == KIND_HOST_CACHE else self.capacity


def _positive(name: str, value: object, upper: int = 1 << 62) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise BadArgumentError(f"{name} must be an int; got {type(value).__name__}")
    if not 0 < int(value) <= upper:
        raise BadArgumentError(f"{name} must be in 1..{upper}; got {value}")
    return int(value)


def plan(
    kind: int,
    *,
    capacity: int,
    dim: int,
    dtype: object,
    ways: int = 0,
    policy: str = "lfu-da",
    ring_capacity: int = DEFAULT_RING_CAPACITY,
) -> Geometry:
    """Validate the arguments of a new segment and compute its layout."""
    dtype = checked_dtype(dtype, KIND_FORMATS.get(kind, tuple(rows.DTYPES)))
    capacity = _positive("capacity" if kind == KIND_HOST_CACHE else "num_rows", capacity)
    dim = _positive("dim", dim, rows.RowFormat.MAX_DIM)
    ring_capacity = _positive("ring_capacity", ring_capacity, 1 << 30)
    if policy not in POLICY_CODES:
        raise BadArgumentError(f"policy must be one of {sorted(POLICY_CODES)}; got {policy!r}")
    if kind == KIND_HOST_CACHE:
        if ways not in (4, 8, 16, 32):
            raise BadArgumentError(f"ways must be 4, 8, 16 or 32; got {ways!r}")
        num_buckets = (capacity + ways - 1) // ways
        slots = num_buckets * ways
    else:
        num_buckets, ways, slots = 0, 0, capacity
    off = PROC_OFF + PROC_BYTES
    keys_off = versions_off = counters_off = 0
    if kind == KIND_HOST_CACHE:
        keys_off = off
        versions_off = _page_up(keys_off + slots * 8)
        counters_off = _page_up(versions_off + slots * 8)
        off = _page_up(counters_off + slots * 4)
    ring_seq_off = off
    ring_key_off = _page_up(ring_seq_off + ring_capacity * 8)
    rows_off = _page_up(ring_key_off + ring_capacity * 8)
    geo = Geometry(
        kind=kind,
        capacity=slots if kind == KIND_HOST_CACHE else capacity,
        num_buckets=num_buckets,
        ways=ways,
        dim=dim,
        dtype_name=dtype,
        policy=policy,
        ring_capacity=ring_capacity,
        keys_off=keys_off,
        versions_off=versions_off,
        counters_off=counters_off,
        ring_seq_off=ring_seq_off,
        ring_key_off=ring_key_off,
        rows_off=rows_off,
        total_size=0,
    )
    total = _page_up(rows_off + slots * geo.row_stride)
    return replace(geo, total_size=total)


def _checksum(words: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(words[STATIC_WORDS]).tobytes())


def write(header: np.ndarray, geo: Geometry, *, uid: int) -> None:
    """Fill a zeroed header for ``geo``; the magic is written last (readiness flag)."""
    h = header
    h[W_VERSION] = LAYOUT_VERSION
    h[W_KIND] = geo.kind
    h[W_CAPACITY] = geo.capacity
    h[W_BUCKETS] = geo.num_buckets
    h[W_WAYS] = geo.ways
    h[W_DIM] = geo.dim
    h[W_DTYPE] = geo.row_format.code
    h[W_ELEM] = geo.elem_size
    h[W_ROW_BYTES] = geo.row_bytes
    h[W_ROW_STRIDE] = geo.row_stride
    h[W_POLICY] = POLICY_CODES[geo.policy]
    h[W_UID] = uid
    h[W_CREATED] = time.time_ns()
    h[W_TOTAL] = geo.total_size
    h[W_KEYS_OFF] = geo.keys_off
    h[W_VERSIONS_OFF] = geo.versions_off
    h[W_COUNTERS_OFF] = geo.counters_off
    h[W_RING_SEQ_OFF] = geo.ring_seq_off
    h[W_RING_KEY_OFF] = geo.ring_key_off
    h[W_ROWS_OFF] = geo.rows_off
    h[W_RING_CAP] = geo.ring_capacity
    h[W_CHECKSUM] = _checksum(h)
    h[W_MAGIC] = MAGIC


def read(header: np.ndarray, *, name: str, segment_size: int) -> Geometry:
    """Validate a header before trusting anything in it, and return its geometry."""
    h = header
    if int(h[W_MAGIC]) != MAGIC:
        raise CorruptedHeaderError(
            f"segment {name!r} does not start with this package's magic number: it is not "
            "a table of this package, or its creation never finished. Remove it with "
            f"`hostcache rm {name}` if it is stale."
        )
    if int(h[W_VERSION]) != LAYOUT_VERSION:
        raise LayoutVersionError(
            f"segment {name!r} has layout version {int(h[W_VERSION])}; this package reads "
            f"version {LAYOUT_VERSION}. Recreate the table with this version, or use the "
            "package version that created it."
        )
    if int(h[W_CHECKSUM]) != _checksum(h):
        raise CorruptedHeaderError(
            f"segment {name!r} has a damaged header (checksum mismatch); remove it with "
            f"`hostcache rm {name}` and create it again."
        )
    try:
        kind = int(h[W_KIND])
        geo = plan(
            kind,
            capacity=int(h[W_CAPACITY]),
            dim=int(h[W_DIM]),
            dtype=rows.name_of_code(int(h[W_DTYPE])),
            ways=int(h[W_WAYS]),
            policy=CODE_POLICIES.get(int(h[W_POLICY]), "?"),
            ring_capacity=int(h[W_RING_CAP]),
        )
    except (BadArgumentError, rows.RowFormatError) as e:
        raise CorruptedHeaderError(f"segment {name!r} has an invalid header: {e}") from e
    stored = (
        kind, int(h[W_BUCKETS]), int(h[W_KEYS_OFF]), int(h[W_VERSIONS_OFF]),
        int(h[W_COUNTERS_OFF]), int(h[W_RING_SEQ_OFF]), int(h[W_RING_KEY_OFF]),
        int(h[W_ROWS_OFF]), int(h[W_TOTAL]), int(h[W_ROW_STRIDE]),
    )
    planned = (
        geo.kind, geo.num_buckets, geo.keys_off, geo.versions_off, geo.counters_off,
        geo.ring_seq_off, geo.ring_key_off, geo.rows_off, geo.total_size, geo.row_stride,
    )
    if kind not in KIND_NAMES or stored != planned or segment_size < geo.total_size:
        raise CorruptedHeaderError(
            f"segment {name!r}: header geometry is inconsistent with this layout or the "
            f"segment is truncated ({segment_size} bytes, header says {int(h[W_TOTAL])}); "
            f"remove it with `hostcache rm {name}` and create it again."
        )
    return replace(geo, creator_uid=int(h[W_UID]), created_ns=int(h[W_CREATED]))


def expect(geo: Geometry, name: str, kind: int, **want: object) -> None:
    """Raise :class:`GeometryMismatchError` unless ``geo`` has ``kind`` and every ``want``."""
    if geo.kind != kind:
        raise GeometryMismatchError(
            f"segment {name!r} is a {KIND_NAMES[geo.kind]} table, not a {KIND_NAMES[kind]} "
            "table; attach it with the matching class or pick another name."
        )
    for field, value in want.items():
        if value is not None and getattr(geo, field) != value:
            raise GeometryMismatchError(
                f"segment {name!r} has {field}={getattr(geo, field)!r}, not {value!r}; "
                "attach without that argument to use the segment's own geometry, or pick "
                "another name."
            )
