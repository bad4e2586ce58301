"""LinearUVM admissions wait for their lookup's miss count (gpu.tiers._drain).

On CUDA the count travels to the host with a non-blocking copy and an event; these tests
drive the same waiting logic on the CPU with a stand-in for the event (CUDA events do not
run here): candidates wait until their count has arrived, only the first ``count`` of them
are admitted, the oldest is waited for past ``MAX_DEFERRED``, and a write drops them.
"""

from __future__ import annotations

import pytest
import torch

from gpu import LayerType, NVEmbedding, tiers
from hostcache import SharedMemBlock
from tests.conftest import fresh_name

ROWS, DIM = 256, 4


class Arrival:
    """Stands in for the CUDA event recorded after a lookup's miss-count copy."""

    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = self.done = True


@pytest.fixture(autouse=True)
def rounds_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests follow candidates from a lookup to the cache: admission rounds start
    as soon as one key waits (64 slots * 1/64), not after a quarter of the cache."""
    monkeypatch.setattr(tiers, "ADMIT_FRACTION", 1 / 64)


def layer_and_table() -> tuple[NVEmbedding, torch.Tensor]:
    table = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(1))
    # 64 slots: an admission round starts at once (see rounds_at_once)
    layer = NVEmbedding(ROWS, DIM, torch.float32, LayerType.LinearUVM,
                        gpu_cache_size=64 * (8 + 4 + DIM * 4), storage=table, device="cpu")
    return layer, table


def defer(layer: NVEmbedding, table: torch.Tensor, keys: list[int], count: int,
          pooled: bool = False) -> Arrival:
    t = layer._tiers
    arrival = Arrival()
    cand = torch.tensor(keys)
    rows = None if pooled else table[cand].clone()
    t._deferred.append((cand, rows, torch.tensor(count), arrival, t._cursor))
    return arrival


def cached(layer: NVEmbedding, keys: list[int]) -> list[bool]:
    return (layer._tiers.cache.probe(torch.tensor(keys), record=False) >= 0).tolist()


def test_candidates_wait_for_their_count_and_only_the_misses_go_in() -> None:
    layer, table = layer_and_table()
    arrival = defer(layer, table, [5, 7, 9], count=2)  # 9 was a hit moved behind the misses
    layer._tiers._drain()
    assert cached(layer, [5, 7, 9]) == [False, False, False]
    assert len(layer._tiers._deferred) == 1
    arrival.done = True
    out = layer(torch.tensor([1]))  # a lookup drains what has arrived first
    assert torch.equal(out, table[[1]])
    assert cached(layer, [5, 7, 9]) == [True, True, False]
    assert not layer._tiers._deferred
    # the admitted rows are the table's
    assert torch.equal(layer(torch.tensor([5, 7])), table[[5, 7]])


def test_pooled_candidates_read_their_rows_when_admitted() -> None:
    layer, table = layer_and_table()
    defer(layer, table, [11, 12], count=2, pooled=True).done = True
    layer._tiers._drain()
    assert cached(layer, [11, 12]) == [True, True]
    assert torch.equal(layer._tiers.cache.lookup(torch.tensor([11, 12]))[0], table[[11, 12]])


def test_past_max_deferred_the_oldest_is_waited_for() -> None:
    layer, table = layer_and_table()
    arrivals = [defer(layer, table, [20 + i], count=1) for i in range(tiers.MAX_DEFERRED + 1)]
    layer._tiers._drain()
    assert arrivals[0].waited and not any(a.waited for a in arrivals[1:])
    assert cached(layer, [20, 21]) == [True, False]
    assert len(layer._tiers._deferred) == tiers.MAX_DEFERRED


def test_a_write_through_the_layer_drops_waiting_candidates() -> None:
    layer, table = layer_and_table()
    arrival = defer(layer, table, [30, 31], count=2)
    layer.update(torch.tensor([30]), torch.full((1, DIM), 7.0))
    assert not layer._tiers._deferred
    arrival.done = True
    layer._tiers._drain()
    assert cached(layer, [30, 31]) == [False, False]
    assert torch.equal(layer(torch.tensor([30])), torch.full((1, DIM), 7.0))


@pytest.mark.parametrize("sync_free", [True, False])
def test_cpu_lookups_leave_nothing_waiting_and_admit_their_misses(
        monkeypatch: pytest.MonkeyPatch, sync_free: bool) -> None:
    monkeypatch.setattr(tiers, "SYNC_FREE_ADMISSION", sync_free)
    layer, table = layer_and_table()
    keys = torch.tensor([3, 4, 3, 200])
    assert torch.equal(layer(keys), table[keys])
    assert not layer._tiers._deferred
    assert cached(layer, [3, 4, 200]) == [True, True, True]


def test_a_lookup_copies_out_about_as_many_candidates_as_the_last_one_missed() -> None:
    rows = 1 << 14
    table = torch.randn(rows, DIM, generator=torch.Generator().manual_seed(2))
    layer = NVEmbedding(rows, DIM, torch.float32, LayerType.LinearUVM,
                        # 4 slots per row: no bucket overflows, every candidate goes in
                        gpu_cache_size=4 * rows * (8 + 4 + DIM * 4), storage=table,
                        device="cpu")
    t = layer._tiers
    layer(torch.arange(10))  # 10 misses: the next lookup expects about that many
    assert t._last_misses == 10
    before = t.cache.stats().inserts
    keys = torch.arange(100, 100 + 3 * tiers.MIN_CANDIDATES)
    assert torch.equal(layer(keys), table[keys])
    assert t._last_misses == keys.numel()
    admitted = t.cache.stats().inserts - before
    # the 10 that waited for a round, and the first MIN_CANDIDATES of this lookup's 3,072
    # misses (on the CPU in batch order; on CUDA in the order the kernel's blocks ran)
    assert admitted == 10 + tiers.MIN_CANDIDATES
    in_cache = t.cache.probe(keys, record=False) >= 0
    assert bool(in_cache[:tiers.MIN_CANDIDATES].all()) and not bool(
        in_cache[tiers.MIN_CANDIDATES:].any())
    # the one after copies out up to twice this lookup's misses: all of them fit
    more = torch.arange(5000, 5000 + 2 * tiers.MIN_CANDIDATES)
    layer(more)
    assert bool((t.cache.probe(more, record=False) >= 0).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU (two streams; torch.cuda.is_available() is False)")
def test_a_round_on_another_stream_waits_for_the_rows_it_admits() -> None:
    """Rows offered on stream A (computed late: A is busy) and admitted by a round that
    stream B runs: B waits for A, so the cache holds the rows, not what the memory held."""
    rows_n = 4096
    table = torch.randn(rows_n, DIM)
    block = SharedMemBlock.create(fresh_name(), num_rows=rows_n, dim=DIM)
    block.write(torch.arange(rows_n), table)
    try:
        layer = NVEmbedding(rows_n, DIM, torch.float32, LayerType.LinearUVM,
                            # 4 slots per row: no bucket overflows, every offered key goes in
                            gpu_cache_size=4 * rows_n * (8 + 4 + DIM * 4), storage=block,
                            device="cuda")
        t = layer._tiers
        a, b = torch.cuda.Stream(), torch.cuda.Stream()
        keys_a = torch.arange(0, 16, device="cuda")
        keys_b = torch.arange(16, 16 + 512, device="cuda")  # enough to start a round
        src = table.cuda()
        with torch.cuda.stream(a):
            torch.cuda._sleep(200_000_000)  # A is busy for a while (~0.1 s)
            rows_a = src[keys_a] * 1.0  # computed only after the sleep
            t._admit(keys_a, rows_a, t._cursor, 1.0)
        assert t._pending  # waiting for a round
        with torch.cuda.stream(b):
            t._admit(keys_b, src[keys_b], t._cursor, 1.0)  # runs the round on B
        torch.cuda.synchronize()
        assert not t._pending
        got, hit = t.cache.lookup(keys_a)
        assert bool(hit.all())
        assert torch.equal(got.cpu(), table[:16])
        layer.close()
    finally:
        block.close()
        SharedMemBlock.unlink(block.name)
