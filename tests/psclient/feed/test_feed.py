"""The change-feed contract (follow/changes/FeedBatch/gaps), the same on every backend:
file://, the shared Redis, and the real 3-master cluster."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

import psclient
from tests.psclient.conftest import opened_tables


@pytest.fixture
def open_ps(store_url: str, table_name: str) -> Iterator:
    with opened_tables(store_url, table_name) as make:
        yield make


def test_follow_lists_changed_keys_with_server_times(open_ps) -> None:  # noqa: ANN001
    ps = open_ps(dim=2, partitions=8)
    start = ps.follow()
    assert isinstance(start, psclient.FeedBatch)
    assert start.keys.numel() == 0 and start.keys.dtype == torch.int64
    assert start.oldest_ns is None and start.newest_ns is None
    ps.insert(torch.tensor([1, 2, 3]), torch.zeros(3, 2))           # new keys: no notice
    same = ps.follow(start.cursor)
    assert same.keys.numel() == 0 and same.oldest_ns is None
    before = time.time_ns()
    assert ps.update(torch.tensor([2, 7]), torch.ones(2, 2)).tolist() == [True, False]
    ps.erase(torch.tensor([3, 99]))
    ps.insert(torch.tensor([1, 50]), torch.ones(2, 2))               # 1 existed, 50 did not
    b = ps.follow(same.cursor)
    assert b.keys.tolist() == [1, 2, 3]                              # exact on every backend
    assert b.oldest_ns is not None and b.newest_ns is not None
    assert before - 2_000_000_000 < b.oldest_ns <= b.newest_ns < time.time_ns() + 2_000_000_000
    assert ps.follow(b.cursor).keys.numel() == 0
    keys, cur = ps.changes(b.cursor)                                 # the tuple form
    assert keys.numel() == 0 and isinstance(cur, str)


def test_follow_blocks_until_a_write_commits(open_ps) -> None:  # noqa: ANN001
    ps = open_ps(dim=2, partitions=8)
    writer = open_ps(dim=2)
    writer.insert(torch.arange(10), torch.zeros(10, 2))
    cur = ps.follow().cursor
    t0 = time.monotonic()
    idle = ps.follow(cur, block_ms=300)                              # nothing: waits it out
    assert 0.25 < time.monotonic() - t0 < 3 and idle.keys.numel() == 0
    assert idle.cursor == cur

    def later() -> None:
        time.sleep(0.3)
        writer.update(torch.tensor([4]), torch.ones(1, 2))

    t = threading.Thread(target=later)
    t.start()
    t0 = time.monotonic()
    got = ps.follow(cur, block_ms=10_000)
    waited = time.monotonic() - t0
    t.join()
    assert got.keys.tolist() == [4]
    assert 0.2 < waited < 5, waited                                  # woke on the write


def test_gap_on_trim_and_on_clear_and_bad_cursor(open_ps) -> None:  # noqa: ANN001
    ps = open_ps(dim=2, partitions=2, changes_maxlen=2)
    ps.insert(torch.arange(400), torch.zeros(400, 2))
    cur = ps.follow().cursor
    for i in range(250):              # many entries (Redis trims whole nodes of 100 entries)
        ps.update(torch.arange(i % 100 * 4, i % 100 * 4 + 4), torch.ones(4, 2))
    with pytest.raises(psclient.ChangeFeedGapError) as gap:
        ps.follow(cur)
    resumed = ps.follow(gap.value.cursor)
    assert resumed.keys.numel() == 0
    ps.clear()
    with pytest.raises(psclient.ChangeFeedGapError, match="cleared") as gap:
        ps.follow(resumed.cursor)
    assert ps.follow(gap.value.cursor).keys.numel() == 0
    with pytest.raises(psclient.BadArgumentError, match="cursor"):
        ps.follow("not-a-cursor")
    with pytest.raises(psclient.BadArgumentError, match="limit"):
        ps.follow(None, limit=0)
    with pytest.raises(psclient.BadArgumentError, match="block_ms"):
        ps.follow(None, block_ms=-1)


def test_cursor_of_a_dropped_table_is_a_gap(open_ps) -> None:  # noqa: ANN001
    ps = open_ps(dim=2, partitions=4)
    ps.insert(torch.arange(8), torch.zeros(8, 2))
    ps.update(torch.arange(8), torch.ones(8, 2))
    cur = ps.follow().cursor
    ps.drop()
    again = open_ps(dim=2, partitions=4)
    again.insert(torch.arange(8), torch.zeros(8, 2))
    for _ in range(5):
        again.update(torch.arange(8), torch.ones(8, 2))
    with pytest.raises(psclient.ChangeFeedGapError):
        again.follow(cur)
