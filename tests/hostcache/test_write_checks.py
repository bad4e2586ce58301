"""The host tables refuse rows holding NaN or an infinity unless the caller allows them:
``HostCache.insert`` / ``update`` (also with ``insert_missing``) and ``SharedMemBlock.write``.
A refused write changes no row and announces nothing to the other processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from hostcache import BadArgumentError, HostCache, NonFiniteValuesError, SharedMemBlock, layout
from nvecache.common.keys import RESERVED_KEY, RESERVED_KEY_RULE

DIM = 4
NONFINITE = [float("nan"), float("inf"), float("-inf")]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def rows(n: int, dtype: torch.dtype, start: float = 0.0) -> torch.Tensor:
    return (torch.arange(n * DIM, dtype=torch.float32).reshape(n, DIM) + start).to(dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN equal to NaN."""
    return bool(torch.equal(a.isnan(), b.isnan())
                and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)))


@pytest.fixture(params=DTYPES, ids=str)
def cache(request: pytest.FixtureRequest, table_name: str) -> Iterator[HostCache]:
    hc = HostCache.create(table_name, capacity=1024, dim=DIM, dtype=request.param)
    yield hc
    hc.close()
    HostCache.unlink(table_name)


@pytest.fixture(params=DTYPES, ids=str)
def block(request: pytest.FixtureRequest, table_name: str) -> Iterator[SharedMemBlock]:
    mb = SharedMemBlock.create(table_name, num_rows=64, dim=DIM, dtype=request.param)
    yield mb
    mb.close()
    SharedMemBlock.unlink(table_name)


@pytest.mark.parametrize("bad", NONFINITE)
def test_host_cache_writes_refuse_nonfinite_rows_unless_allowed(cache: HostCache,
                                                                bad: float) -> None:
    keys = torch.tensor([7, 8, 9])
    before = rows(3, cache.geometry.dtype)
    cache.insert(keys, before)
    cursor = cache.change_cursor
    new = rows(3, cache.geometry.dtype, start=50.0)
    new[2, 1] = bad
    writes = {
        "insert": lambda **kw: cache.insert(keys, new, **kw),
        "insert(overwrite=False)": lambda **kw: cache.insert(torch.tensor([1, 2, 3]), new,
                                                             overwrite=False, **kw),
        "update": lambda **kw: cache.update(keys, new, **kw),
        "update(insert_missing)": lambda **kw: cache.update(torch.tensor([7, 8, 10]), new,
                                                            insert_missing=True, **kw),
    }
    for name, write in writes.items():
        with pytest.raises(NonFiniteValuesError,
                           match=r"1 row\(s\) hold NaN or infinite values \(the first: key "
                           r"(9|3|10)\).*allow_nonfinite=True") as err:
            write()
        assert isinstance(err.value, BadArgumentError), name
        got, hit = cache.lookup(torch.tensor([7, 8, 9, 1, 2, 3, 10]))
        assert hit.tolist() == [True] * 3 + [False] * 4, name  # nothing written
        assert torch.equal(got[:3], before), name
    assert cache.change_cursor == cursor  # nothing announced
    cache.update(keys, new, allow_nonfinite=True)
    assert same(cache.lookup(keys)[0], new)
    cache.insert(torch.tensor([11]), new[2:], allow_nonfinite=True)
    assert same(cache.lookup(torch.tensor([11]))[0], new[2:])


def test_the_empty_slot_marker_is_the_one_reserved_key(cache: HostCache) -> None:
    assert layout.EMPTY_KEY == RESERVED_KEY  # NOTE: psclient's, which every tier refuses
    with pytest.raises(BadArgumentError) as err:
        cache.insert(torch.tensor([1, RESERVED_KEY]), rows(2, cache.geometry.dtype))
    assert str(err.value) == RESERVED_KEY_RULE
    assert len(cache) == 0


@pytest.mark.parametrize("bad", NONFINITE)
def test_shared_memblock_write_refuses_nonfinite_rows_unless_allowed(block: SharedMemBlock,
                                                                     bad: float) -> None:
    idx = torch.tensor([3, 4, 5])
    before = rows(3, block.dtype)
    block.write(idx, before)
    cursor = block.change_cursor
    new = rows(3, block.dtype, start=50.0)
    new[0, 3] = bad
    with pytest.raises(NonFiniteValuesError,
                       match=r"1 row\(s\) hold NaN or infinite values \(the first: index 3\)"):
        block.write(idx, new)
    assert torch.equal(block.read(idx), before)
    assert block.change_cursor == cursor
    block.write(idx, new, allow_nonfinite=True)
    assert same(block.read(idx), new)
