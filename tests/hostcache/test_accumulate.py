"""HostCache.accumulate and SharedMemBlock.accumulate: rows against torch (every dtype,
duplicates summed, float16/bfloat16 added in float32 and rounded once), keys not cached
neither written nor inserted, the change announced on the ring, refused arguments writing
nothing, and accumulates from several processes losing no addition (into int8 and fp8
tables too)."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from hostcache import (
    BadArgumentError,
    HostCache,
    NonFiniteValuesError,
    SharedMemBlock,
    table_loops,
    table_twin,
)

DIM = 6
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@pytest.fixture
def cache_of(table_name: str) -> Iterator[Any]:
    made: list[HostCache] = []

    def make(dtype: torch.dtype) -> HostCache:
        hc = HostCache.create(table_name, capacity=512, dim=DIM, dtype=dtype)
        made.append(hc)
        return hc

    yield make
    for hc in made:
        hc.close()
    if made:
        HostCache.unlink(table_name)


@pytest.fixture
def block_of(table_name: str) -> Iterator[Any]:
    made: list[SharedMemBlock] = []

    def make(dtype: torch.dtype, rows: int = 64) -> SharedMemBlock:
        mb = SharedMemBlock.create(table_name + "-b", num_rows=rows, dim=DIM, dtype=dtype)
        made.append(mb)
        return mb

    yield make
    for mb in made:
        mb.close()
    if made:
        SharedMemBlock.unlink(table_name + "-b")


def reference(rows: dict[int, torch.Tensor], keys: torch.Tensor, deltas: torch.Tensor,
              dtype: torch.dtype) -> dict[int, torch.Tensor]:
    """Key by key: duplicates summed in batch order in the accumulator dtype, added to the
    row in it, rounded once."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    sums: dict[int, torch.Tensor] = {}
    for k, d in zip(keys.tolist(), deltas, strict=True):
        sums[k] = sums.get(k, torch.zeros(DIM, dtype=acc)) + d.to(acc)
    out = dict(rows)
    for k, s in sums.items():
        if k in rows:
            out[k] = (rows[k].to(acc) + s).to(dtype)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp32_deltas", [False, True])
def test_host_cache_accumulate_matches_torch(cache_of: Any, dtype: torch.dtype,
                                             fp32_deltas: bool) -> None:
    hc = cache_of(dtype)
    gen = torch.Generator().manual_seed(3)
    keys = torch.arange(0, 200, 2, dtype=torch.int64)
    rows = (torch.randn(keys.numel(), DIM, generator=gen) * 50).to(dtype)
    hc.insert(keys, rows)
    cached = hc.contains(keys)
    stored = {k: r for k, r, c in zip(keys.tolist(), rows, cached.tolist(), strict=True) if c}
    ask = torch.tensor([0, 1, 0, 50, 51, 50, 50, 198, 2**62, 7], dtype=torch.int64)
    deltas = torch.randn(ask.numel(), DIM, generator=gen) * 4
    if not (fp32_deltas and dtype != torch.float64):
        deltas = deltas.to(dtype)
    cursor = hc.change_cursor
    size = len(hc)
    got = hc.accumulate(ask, deltas)
    assert got.tolist() == [k in stored for k in ask.tolist()]
    assert len(hc) == size and not hc.contains(torch.tensor([1, 51, 2**62, 7])).any()
    want = reference(stored, ask, deltas, dtype)
    everything = torch.tensor(sorted(want), dtype=torch.int64)
    values, hit = hc.lookup(everything, count=False)
    assert bool(hit.all())
    for i, k in enumerate(everything.tolist()):
        assert torch.equal(values[i], want[k]), k
    announced, _, overflowed = hc.changes_since(cursor)
    assert not overflowed and sorted(announced.tolist()) == sorted(
        {k for k in ask.tolist() if k in stored})


def test_float16_rounds_once_not_per_duplicate(cache_of: Any, block_of: Any) -> None:
    """Four quarters of a float16 ulp: rounded away one by one, one ulp summed first."""
    hc = cache_of(torch.float16)
    mb = block_of(torch.float16)
    for table, key in ((hc, 9), (mb, 9)):
        start = torch.full((1, DIM), 2048.0, dtype=torch.float16)
        (table.insert if table is hc else table.write)(torch.tensor([key]), start)
        table.accumulate(torch.tensor([key] * 4), torch.full((4, DIM), 0.5))
        row = (hc.lookup(torch.tensor([key]))[0] if table is hc
               else mb.read(torch.tensor([key])))
        assert bool((row == 2050.0).all())


def test_host_cache_refuses_bad_arguments_and_writes_nothing(cache_of: Any) -> None:
    hc = cache_of(torch.float16)
    keys = torch.tensor([1, 2, 3])
    rows = torch.ones(3, DIM, dtype=torch.float16)
    hc.insert(keys, rows)
    cursor = hc.change_cursor
    for bad in (torch.ones(3, DIM, dtype=torch.float64), torch.ones(2, DIM),
                torch.ones(3, DIM + 1), "deltas"):
        with pytest.raises(BadArgumentError, match="deltas"):
            hc.accumulate(keys, bad)  # type: ignore[arg-type]
    with pytest.raises(BadArgumentError, match="INT64_MIN|reserved"):
        hc.accumulate(torch.tensor([1, -(2**63)]), torch.ones(2, DIM))
    nonfinite = torch.ones(3, DIM)
    nonfinite[2, 0] = float("nan")
    with pytest.raises(NonFiniteValuesError, match="key 3"):
        hc.accumulate(keys, nonfinite)
    assert torch.equal(hc.lookup(keys)[0], rows)
    assert hc.changes_since(cursor)[0].numel() == 0
    assert hc.accumulate(keys, nonfinite, allow_nonfinite=True).all()
    assert bool(hc.lookup(torch.tensor([3]))[0].isnan()[0, 0])
    assert hc.accumulate(torch.empty(0, dtype=torch.int64), torch.empty(0, DIM)).numel() == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_memblock_accumulate_matches_torch(block_of: Any, dtype: torch.dtype) -> None:
    mb = block_of(dtype)
    gen = torch.Generator().manual_seed(5)
    rows = (torch.randn(64, DIM, generator=gen) * 20).to(dtype)
    mb.write(torch.arange(64), rows)
    idx = torch.tensor([3, 63, 3, 0, 3, 17])
    deltas = (torch.randn(idx.numel(), DIM, generator=gen)).to(dtype)
    cursor = mb.change_cursor
    mb.accumulate(idx, deltas)
    want = reference(dict(enumerate(rows)), idx, deltas, dtype)
    got = mb.read(torch.arange(64))
    for i in range(64):
        assert torch.equal(got[i], want[i]), i
    assert sorted(mb.changes_since(cursor)[0].tolist()) == [0, 3, 17, 63]


def test_memblock_refuses_bad_arguments_and_writes_nothing(block_of: Any) -> None:
    mb = block_of(torch.float32)
    cursor = mb.change_cursor
    with pytest.raises(BadArgumentError, match=r"\[0, 64\)"):
        mb.accumulate(torch.tensor([64]), torch.ones(1, DIM))
    with pytest.raises(BadArgumentError, match="deltas"):
        mb.accumulate(torch.tensor([1]), torch.ones(1, DIM, dtype=torch.float16))
    inf = torch.ones(2, DIM)
    inf[1, 1] = float("inf")
    with pytest.raises(NonFiniteValuesError, match="index 5"):
        mb.accumulate(torch.tensor([4, 5]), inf)
    assert not mb.tensor.any() and mb.changes_since(cursor)[0].numel() == 0


def test_read_slots_twin_matches_the_compiled_loop() -> None:
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (16, 24), dtype=np.uint8)
    slot = np.array([5, 0, 15, 7], dtype=np.int64)
    a = np.empty((4, 20), np.uint8)
    b = np.empty((4, 20), np.uint8)
    table_loops.read_slots(raw, slot, a)
    table_twin.read_slots(raw, slot, b)
    assert np.array_equal(a, b) and np.array_equal(a, raw[slot, :20])


def add_ones(table: HostCache | SharedMemBlock, keys: list[int], rounds: int,
             start: Any, unit: float = 1.0) -> int:
    """Add ``unit`` to every key (twice to the first, a duplicate) ``rounds`` times."""
    try:
        k = torch.tensor([keys[0], *keys])
        ones = torch.full((k.numel(), DIM), unit)
        start.wait()
        for _ in range(rounds):
            table.accumulate(k, ones)
        return rounds
    finally:
        table.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("kind", ["cache", "block"])
def test_concurrent_accumulates_from_processes_lose_no_addition(
        kind: str, dtype: torch.dtype, table_name: str) -> None:
    """Each call's read-add-write spans a few thousand rows, so the processes' calls
    overlap. A quantized table's rows are constant rows of multiples of ``unit``, which its
    format stores exactly (int8: scale 0; fp8: scale a whole number, every element 448), so
    its stochastic rounding has nothing to round: any lost addition shows."""
    procs, rounds, n = 3, 60, 3000
    unit = 448.0 if dtype == torch.float8_e4m3fn else 1.0
    keys = list(range(0, 2 * n, 2))
    name = f"{table_name}-c"
    table: HostCache | SharedMemBlock
    if kind == "cache":
        table = HostCache.create(name, capacity=4 * n, dim=DIM, ways=32, dtype=dtype)
        table.insert(torch.tensor(keys), torch.zeros(n, DIM))
        assert bool(table.contains(torch.tensor(keys)).all())
    else:
        table = SharedMemBlock.create(name, num_rows=2 * n, dim=DIM, dtype=dtype)
    try:
        ctx = mp.get_context("spawn")
        with ctx.Manager() as manager:
            start = manager.Barrier(procs + 1)
            with ctx.Pool(procs) as pool:
                jobs = [pool.apply_async(add_ones, (table, keys, rounds, start, unit))
                        for _ in range(procs)]
                start.wait()
                assert [j.get(timeout=300) for j in jobs] == [rounds] * procs
        got = (table.lookup(torch.tensor(keys))[0] if isinstance(table, HostCache)
               else table.read(torch.tensor(keys)))
        want = torch.full((n, DIM), float(procs * rounds) * unit)
        want[0] *= 2
        assert torch.equal(got, want)
    finally:
        table.close()
        table.unlink(name)
