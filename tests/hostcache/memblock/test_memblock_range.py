"""SharedMemBlock.write_range and write's consecutive-rows path: the same rows, announcements
and refusals as a write of the indices one by one."""

from __future__ import annotations

import pytest
import torch

from hostcache import BadArgumentError, NonFiniteValuesError, SharedMemBlock
from hostcache.errors import HandleClosedError
from tests.conftest import fresh_name

ROWS, DIM = 100, 6


@pytest.fixture
def blocks():
    """Two blocks of the same geometry (the write under test, and the reference)."""
    made = [SharedMemBlock.create(fresh_name(), num_rows=ROWS, dim=DIM) for _ in range(2)]
    yield made
    for mb in made:
        mb.close()
        SharedMemBlock.unlink(mb.name)


def _state(mb: SharedMemBlock, cursor: int) -> tuple[torch.Tensor, list[int], int]:
    keys, end, overflowed = mb.changes_since(cursor)
    assert not overflowed
    return mb.tensor.clone(), keys.tolist(), end - cursor


def test_write_range_matches_write_of_the_same_indices(blocks) -> None:
    fast, ref = blocks
    gen = torch.Generator().manual_seed(7)
    for _ in range(30):
        start = int(torch.randint(0, ROWS, (1,), generator=gen))
        n = int(torch.randint(0, ROWS - start + 1, (1,), generator=gen))
        vals = torch.randn(n, DIM, generator=gen)
        c_fast, c_ref = fast.change_cursor, ref.change_cursor
        fast.write_range(start, vals)
        ref.write(torch.arange(start, start + n), vals)
        rows, keys, count = _state(fast, c_fast)
        assert keys == list(range(start, start + n)) and count == n
        assert torch.equal(rows, _state(ref, c_ref)[0])
        assert _state(ref, c_ref)[1] == keys


def test_write_of_consecutive_indices_takes_one_copy_and_others_still_dedup(blocks) -> None:
    mb, _ = blocks
    vals = torch.arange(10 * DIM, dtype=torch.float32).view(10, DIM)
    cursor = mb.change_cursor
    mb.write(torch.arange(20, 30), vals)
    assert torch.equal(mb.tensor[20:30], vals)
    assert mb.changes_since(cursor)[0].tolist() == list(range(20, 30))
    # first-to-last span of n-1 but not consecutive, and duplicates: last one wins
    cursor = mb.change_cursor
    mb.write(torch.tensor([40, 42, 41, 42]), vals[:4])
    assert torch.equal(mb.tensor[40:43], vals[[0, 2, 3]])
    assert sorted(mb.changes_since(cursor)[0].tolist()) == [40, 41, 42]


def test_a_second_handle_sees_the_rows_and_the_announcement(blocks) -> None:
    mb, _ = blocks
    with SharedMemBlock.attach(mb.name) as other:
        cursor = other.change_cursor
        vals = torch.full((5, DIM), 3.5)
        mb.write_range(95, vals)
        keys, end, overflowed = other.changes_since(cursor)
        assert keys.tolist() == [95, 96, 97, 98, 99] and end == cursor + 5 and not overflowed
        assert torch.equal(other.read(torch.arange(95, 100)), vals)


def test_the_write_goes_through_the_gate(blocks) -> None:
    mb, _ = blocks
    seen = []
    mb.gate.add_drain("test", lambda: seen.append((mb.gate.state.writing,
                                                   float(mb.tensor[3, 0]))))
    mb.write_range(3, torch.ones(2, DIM))
    assert seen == [(True, 0.0)]  # the drain ran before the copy, with the write side held


def test_rows_copied_from_the_table_itself(blocks) -> None:
    fast, ref = blocks
    init = torch.randn(ROWS, DIM)
    for mb in blocks:
        mb.write_range(0, init)
    fast.write_range(0, fast.tensor[2:12])
    ref.write(torch.arange(0, 10), ref.tensor[2:12])
    assert torch.equal(fast.tensor, ref.tensor)
    assert torch.equal(fast.tensor[:10], init[2:12])


@pytest.mark.parametrize(
    ("start", "vals", "match"),
    [
        (96, torch.zeros(5, DIM), r"rows 96..100 do not fit.*\[0, 100\).*at most 4"),
        (-1, torch.zeros(1, DIM), r"\[0, 100\)"),
        (True, torch.zeros(1, DIM), "start must be an int"),
        (1.0, torch.zeros(1, DIM), "start must be an int"),
        (0, torch.zeros(1, DIM - 1), "shape"),
        (0, torch.zeros(DIM), "shape"),
        (0, torch.zeros(1, DIM, dtype=torch.float16), "dtype"),
        (0, [[0.0] * DIM], "torch.Tensor"),
    ],
)
def test_bad_range_writes_change_nothing(blocks, start, vals, match) -> None:
    mb, _ = blocks
    cursor = mb.change_cursor
    with pytest.raises(BadArgumentError, match=match):
        mb.write_range(start, vals)
    assert not mb.tensor.any() and mb.change_cursor == cursor


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_rows_are_refused_unless_allowed(blocks, bad: float) -> None:
    mb, _ = blocks
    vals = torch.ones(8, DIM)
    vals[5, 2] = bad
    cursor = mb.change_cursor
    with pytest.raises(NonFiniteValuesError, match=r"1 row\(s\).*index 15"):
        mb.write_range(10, vals)
    with pytest.raises(NonFiniteValuesError, match="index 15"):
        mb.write(torch.arange(10, 18), vals)
    assert not mb.tensor.any() and mb.change_cursor == cursor
    mb.write_range(10, vals, allow_nonfinite=True)
    assert torch.allclose(mb.tensor[10:18], vals, equal_nan=True)
    assert mb.changes_since(cursor)[0].tolist() == list(range(10, 18))


def test_an_empty_range_announces_nothing_and_a_closed_handle_is_refused(blocks) -> None:
    mb, _ = blocks
    cursor = mb.change_cursor
    mb.write_range(ROWS, torch.zeros(0, DIM))
    assert mb.change_cursor == cursor
    with SharedMemBlock.attach(mb.name) as other:
        pass
    with pytest.raises(HandleClosedError):
        other.write_range(0, torch.zeros(1, DIM))
    assert not mb.tensor.any() and mb.change_cursor == cursor
