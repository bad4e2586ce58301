"""The change-feed contract (hostcache.ChangeFeed) that every follower relies on, checked
against each table that offers one: HostCache, SharedMemBlock, gpu.DistMemBlock."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from gpu import DistMemBlock
from hostcache import ChangeFeed, HostCache, SharedMemBlock
from tests.conftest import fresh_name

Write = Callable[[torch.Tensor], None]


@pytest.fixture(params=["host_cache", "memblock", "distmem"])
def feed(request: pytest.FixtureRequest) -> Iterator[tuple[Any, Write]]:
    """(a table, a function that changes some of its keys through the table's own API)."""
    name = fresh_name()
    if request.param == "host_cache":
        hc = HostCache.create(name, capacity=64, dim=2)
        hc.insert(torch.arange(8), torch.zeros(8, 2))
        yield hc, lambda k: hc.update(k, torch.ones(k.numel(), 2))
        hc.close()
        HostCache.unlink(name)
    elif request.param == "memblock":
        mb = SharedMemBlock.create(name, num_rows=8, dim=2)
        yield mb, lambda k: mb.write(k, torch.ones(k.numel(), 2))
        mb.close()
        SharedMemBlock.unlink(name)
    else:
        block = DistMemBlock(8, 2, devices="cpu", name=name)
        yield block, lambda k: block.write(k, torch.ones(k.numel(), 2))
        block.close()


def test_every_shared_table_is_a_change_feed_that_reports_its_writes(
        feed: tuple[Any, Write]) -> None:
    table, write = feed
    assert isinstance(table, ChangeFeed)
    start = table.change_cursor
    keys, cursor, overflowed = table.changes_since(start)
    assert keys.numel() == 0 and cursor == start and not overflowed
    write(torch.tensor([3, 5, 3]))
    keys, cursor, overflowed = table.changes_since(start)
    assert sorted(keys.unique().tolist()) == [3, 5] and not overflowed
    assert cursor == table.change_cursor > start
    assert table.changes_since(cursor)[0].numel() == 0  # nothing new after it


def test_a_follower_behind_a_clear_is_told_to_drop_everything(table_name: str) -> None:
    with HostCache.create(table_name, capacity=64, dim=2) as hc:
        try:
            start = hc.change_cursor
            hc.clear()
            assert hc.changes_since(start)[2]  # overflowed
        finally:
            HostCache.unlink(table_name)
