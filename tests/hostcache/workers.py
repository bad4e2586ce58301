"""Process bodies for the multi-process tests (importable by spawned children)."""

from __future__ import annotations

from typing import Any

import torch

from hostcache import HostCache

DIM = 16
SCALE = 1 << 20  # a row of key k written at version v holds k * SCALE + v in every element


def encoded_rows(keys: torch.Tensor, version: int) -> torch.Tensor:
    return (keys.to(torch.float64) * SCALE + version)[:, None].expand(-1, DIM).contiguous()


def count_torn(keys: torch.Tensor, values: torch.Tensor, hit: torch.Tensor) -> int:
    """Hit rows whose elements disagree with each other or with their key."""
    rows = values[hit]
    mixed = (rows != rows[:, :1]).any(dim=1)
    foreign = torch.div(rows[:, 0], SCALE, rounding_mode="floor") != keys[hit].to(torch.float64)
    return int((mixed | foreign).sum())


def writer(name: str, key_space: int, seed: int, min_writes: int, reads: Any,
           min_reads: int, ready: Any, go: Any, out: Any) -> None:
    """Write batches (insert, update, erase in turn) until it has made ``min_writes`` and
    the readers have counted ``min_reads`` lookups meanwhile (``reads``, shared)."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(seed)
    hc = HostCache.attach(name)
    ready.set()
    go.wait()
    version = 0
    while version < min_writes or reads.value < min_reads:
        version = (version + 1) % SCALE
        keys = torch.randint(0, key_space, (512,), generator=gen)
        op = version % 3
        if op == 0:
            hc.insert(keys, encoded_rows(keys, version))
        elif op == 1:
            hc.update(keys, encoded_rows(keys, version))
        else:
            hc.erase(keys[:64])
    out.put(("writer", version))
    hc.close()


def reader(name: str, key_space: int, seed: int, writers_done: Any, reads: Any, ready: Any,
           go: Any, out: Any) -> None:
    """Look keys up until every writer is done; count the lookups that started while the
    writers were still writing (``reads``, shared with them) and the torn rows."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(seed)
    hc = HostCache.attach(name)
    ready.set()
    go.wait()
    lookups = hits = torn = 0
    while not writers_done.is_set():
        keys = torch.randint(0, key_space, (4096,), generator=gen)
        values, hit = hc.lookup(keys)
        lookups += 1
        hits += int(hit.sum())
        torn += count_torn(keys, values, hit)
        with reads.get_lock():
            reads.value += 1
    out.put(("reader", lookups, hits, torn))
    hc.close()


def busy_writer(name: str, key_space: int, ready: Any = None) -> None:
    """Writes big batches forever (until SIGKILLed): mostly inside the writer lock.
    ``ready`` (an event) is set once the first batch is written (the compiled loops
    loaded, which takes long on a busy machine the first time)."""
    torch.set_num_threads(1)
    hc = HostCache.attach(name)
    gen = torch.Generator().manual_seed(0)
    version = 0
    while True:
        version = (version + 1) % SCALE
        keys = torch.randint(0, key_space, (20_000,), generator=gen)
        if version % 2:
            hc.insert(keys, encoded_rows(keys, version))
        else:
            hc.update(keys, encoded_rows(keys, version))
        if ready is not None and not ready.is_set():
            ready.set()
