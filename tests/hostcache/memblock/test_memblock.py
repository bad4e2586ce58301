"""SharedMemBlock: a linear table every process maps; writes announced through its ring."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from hostcache import BadArgumentError, SharedMemBlock


@pytest.fixture
def block(table_name: str):
    mb = SharedMemBlock.create(table_name, num_rows=100, dim=6, dtype=torch.float32)
    yield mb
    mb.close()
    SharedMemBlock.unlink(table_name)


def test_rows_start_zero_and_write_read_round_trip(block: SharedMemBlock) -> None:
    assert block.tensor.shape == (100, 6) and not block.tensor.any()
    idx = torch.tensor([3, 99, 3])
    vals = torch.arange(18, dtype=torch.float32).view(3, 6)
    block.write(idx, vals)
    assert torch.equal(block.read(torch.tensor([3, 99])), vals[[2, 1]])
    assert torch.equal(block.tensor[99], vals[1])
    keys, cursor, overflowed = block.changes_since(0)
    assert sorted(keys.tolist()) == [3, 99] and cursor == 2 and not overflowed


def test_direct_writes_are_announced_with_invalidate(block: SharedMemBlock) -> None:
    start = block.change_cursor
    block.tensor[5] = 1.0
    assert block.changes_since(start)[0].numel() == 0
    block.invalidate(torch.tensor([5, 5]))
    assert block.changes_since(start)[0].tolist() == [5]


def test_another_process_sees_writes(block: SharedMemBlock) -> None:
    block.write(torch.tensor([7]), torch.full((1, 6), 2.5))
    with mp.get_context("spawn").Pool(1) as pool:
        row = pool.apply(_read_row, (block, 7))
    assert row == [2.5] * 6


def _read_row(mb: SharedMemBlock, i: int) -> list[float]:
    try:
        return mb.read(torch.tensor([i]))[0].tolist()
    finally:
        mb.close()


@pytest.mark.parametrize(
    ("idx", "vals", "match"),
    [
        (torch.tensor([100]), torch.zeros(1, 6), r"\[0, 100\)"),
        (torch.tensor([-1]), torch.zeros(1, 6), r"\[0, 100\)"),
        (torch.tensor([1.0]), torch.zeros(1, 6), "int64"),
        (torch.tensor([1]), torch.zeros(1, 5), "shape"),
        (torch.tensor([1]), torch.zeros(1, 6, dtype=torch.float16), "dtype"),
    ],
)
def test_bad_writes_change_nothing(block: SharedMemBlock, idx, vals, match) -> None:
    start = block.change_cursor
    with pytest.raises(BadArgumentError, match=match):
        block.write(idx, vals)
    assert not block.tensor.any() and block.change_cursor == start


def test_odd_row_width_is_padded_to_16_bytes(table_name: str) -> None:
    with SharedMemBlock.create(table_name, num_rows=10, dim=3) as mb:
        try:
            assert mb.tensor.stride() == (4, 1)
            mb.write(torch.arange(10), torch.arange(30, dtype=torch.float32).view(10, 3))
            assert torch.equal(mb.read(torch.arange(10)).flatten(), torch.arange(30.0))
        finally:
            SharedMemBlock.unlink(table_name)
