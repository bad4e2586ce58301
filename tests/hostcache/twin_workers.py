"""A spawned writer for tests/hostcache/test_table_twin.py (importable by the child)."""

from __future__ import annotations

from typing import Any

import torch

DIM = 64


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
