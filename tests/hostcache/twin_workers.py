"""A spawned writer for tests/hostcache/test_table_twin.py (importable by the child), and
a host cache's arrays as its loops see them, read through its public segment layout."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

DIM = 64


class Arrays(NamedTuple):
    """A host cache's slots as :mod:`hostcache.table_loops` takes them (numpy views of the
    shared pages: writes through them are the table's)."""

    keys: np.ndarray  #: int64 ``[slots]``
    bucket_keys: np.ndarray  #: the same, ``[buckets, ways]``
    versions: np.ndarray  #: int64 seqlock version per slot
    raw: np.ndarray  #: uint8 ``[slots, row_stride]``
    policy: np.ndarray  #: int32 eviction counter per slot


def arrays_of(hc: Any) -> Arrays:
    """``hc``'s slot arrays, found from its public ``buffer`` and ``geometry`` (the
    segment layout of ``hostcache.layout``)."""
    geo, buf = hc.geometry, hc.buffer.numpy()
    slots = geo.slots

    def at(off: int, count: int, dtype: Any) -> np.ndarray:
        return buf[off:off + count * np.dtype(dtype).itemsize].view(dtype)

    keys = at(geo.keys_off, slots, np.int64)
    raw = at(geo.rows_off, slots * geo.row_stride, np.uint8).reshape(slots, geo.row_stride)
    return Arrays(keys, keys.reshape(-1, geo.ways), at(geo.versions_off, slots, np.int64),
                  raw, at(geo.counters_off, slots, np.int32))


def row_of(keys: torch.Tensor, write: int) -> torch.Tensor:
    """float32 ``[N, DIM]`` rows whose every element is ``key * 100000 + write`` (exact in
    float32 for keys below 100): a torn row has two values, another key's row another."""
    value = (keys * 100_000 + write % 100_000).to(torch.float32)
    return value[:, None].expand(-1, DIM).contiguous()


def write_rounds(name: str, writer: str, stop: Any, writes: Any) -> None:
    """Until ``stop``: update every key, erase half of them and insert them again (they
    may land in other ways), with the compiled loops or their twin (``writer``);
    ``writes`` counts the rounds."""
    from hostcache import HostCache, cache, table_loops, table_twin

    loops = table_twin if writer == "twin" else table_loops
    cache._loops = lambda: loops  # NOTE: this process writes with the loops under test
    keys = torch.arange(64, dtype=torch.int64)
    with HostCache.attach(name) as hc:
        write = 0
        while not stop.is_set():
            write += 1
            half = keys[write % 2::2]
            hc.update(keys, row_of(keys, write))
            hc.erase(half)
            hc.insert(half, row_of(half, write))
            writes.value = write
