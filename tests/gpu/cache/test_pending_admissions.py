"""Hierarchical admissions (gpu.stacks.misses.admission): fetched rows wait in a log on the
device; a round admits them when the log is full or enough lookups offered; a warm
cache's kept log runs its round in three steps (on the CPU: sorted when it starts, the
table written at a later offer); no row read before a change to its key ever goes in.

The change feed is a real ``SharedMemBlock``'s: its writes announce their keys."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

import psclient
from gpu import LayerType, NVEmbedding, TierConfig
from gpu.cache.gpu_cache import GPUCache
from gpu.cache.guard import CacheGuard
from gpu.stacks.misses.admission import PendingAdmissions, RoundBudget
from gpu.stacks.misses.change_follower import ChangeFollower
from hostcache import HostCache, SharedMemBlock
from hostcache.layout import EMPTY_KEY

DIM, SLOTS = 4, 512
SLOT = 8 + 4 + DIM * 4
CPU = torch.device("cpu")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (torch.cuda.is_available() is False)")])]


@dataclass
class Stack:
    """What a Hierarchical stack wires around its admissions, over a block's feed."""

    cache: GPUCache
    follower: ChangeFollower
    budget: RoundBudget
    pending: PendingAdmissions
    block: SharedMemBlock

    def sync(self) -> int:
        """A lookup's first step: follow the feed; the cursor its reads come after."""
        return self.follower.sync()

    def cached(self, keys: torch.Tensor) -> torch.Tensor:
        return self.cache.probe(keys, record=False) >= 0


def rows_of(keys: torch.Tensor) -> torch.Tensor:
    return keys[:, None].float().expand(-1, DIM) + torch.arange(DIM) / 10


@pytest.fixture
def block(table_name: str) -> Iterator[SharedMemBlock]:
    mb = SharedMemBlock.create(table_name, num_rows=1024, dim=DIM)
    yield mb
    mb.close()
    SharedMemBlock.unlink(table_name)


def stack_over(block: SharedMemBlock, *, warm: bool, kept: bool = False,
               **tuning: float) -> Stack:
    # 8 ways per bucket over few keys: no bucket overflows, every admitted key stays
    cfg = TierConfig(**tuning)
    cache = GPUCache(SLOTS * SLOT, DIM, torch.float32, CPU)
    guard = CacheGuard(CPU)
    budget = RoundBudget(cache, cfg)
    follower = ChangeFollower(block, cache, budget.reset)
    pending = PendingAdmissions(cache, guard, follower, budget, cfg)
    follower.on_change = pending.changed
    if kept:
        assert pending.keep() is False  # kept, no graph on the CPU
    if warm:
        budget.make_warm()
    return Stack(cache, follower, budget, pending, block)


def test_a_warm_round_starts_when_the_log_is_full_and_lands_at_a_later_offer(block) -> None:
    # the warm log holds 1/8 of 512 slots: 64 rows
    s = stack_over(block, warm=True, kept=True, admit_batches=1000)
    a, b, c = torch.arange(0, 40), torch.arange(40, 80), torch.arange(100, 110)
    s.pending.offer(a, rows_of(a), s.sync(), 1.0)
    assert s.pending.waiting == 40 and s.pending.rounds == 0
    s.pending.offer(b, rows_of(b), s.sync(), 1.0)  # full at 64: the round starts
    assert s.pending.rounds == 1
    assert not s.cached(torch.cat([a, b])).any()  # sorted, not yet written
    s.pending.offer(c, rows_of(c), s.sync(), 1.0)  # the table half first, then c logged
    taken = torch.cat([a, b])[:64]
    assert s.cached(taken).all() and not s.cached(torch.arange(64, 80)).any()
    assert torch.equal(s.cache.lookup(taken)[0], rows_of(taken))
    assert s.pending.waiting == c.numel() and not s.cached(c).any()
    s.pending.settle()  # nothing started: c waits for its round
    assert not s.cached(c).any()
    s.pending.close()


def test_offers_while_a_round_is_pending_are_not_taken(block) -> None:
    s = stack_over(block, warm=True, kept=True, admit_batches=1)
    a, b = torch.arange(0, 10), torch.arange(10, 20)
    s.pending.offer(a, rows_of(a), s.sync(), 1.0)  # one offer is enough: started
    assert s.pending.rounds == 1
    s.pending.settle()  # what a statistics call does: the round finished
    assert s.cached(a).all() and s.pending.waiting == 0
    s.pending.offer(b, rows_of(b), s.sync(), 1.0)  # started again
    s.pending.offer(a + 100, rows_of(a + 100), s.sync(), 1.0)  # written b; took a + 100
    assert s.cached(b).all() and s.pending.waiting == 10
    s.pending.close()


@pytest.mark.parametrize("kept", [False, True])
def test_a_change_applied_while_rows_wait_keeps_those_keys_out(block, kept: bool) -> None:
    """Rows logged, then a write to two of their keys announced and applied by the next
    lookup: those two never go in, with the round not yet started or started (its
    sorted copy cancelled), and the other rows do."""
    s = stack_over(block, warm=True, kept=kept, admit_batches=2)
    a = torch.arange(0, 30)
    s.pending.offer(a, rows_of(a), s.sync(), 1.0)
    if kept:
        s.pending.offer(a[:0] + 500, rows_of(a[:1] + 500)[:0], s.sync(), 1.0)  # no rows
        s.pending.offer(a[:1] + 500, rows_of(a[:1] + 500), s.sync(), 1.0)  # due: started
        assert s.pending.rounds == 1
    block.write(torch.tensor([3, 5]), torch.full((2, DIM), 9.0))  # announced
    s.sync()  # the next lookup applies it
    b = torch.arange(600, 610)
    for _ in range(3):  # later offers start and finish the round again
        s.pending.offer(b, rows_of(b), s.sync(), 1.0)
        b = b + 10
    s.pending.settle()
    s.pending.offer(b, rows_of(b), s.sync(), 1.0)  # the round of the last offers
    s.pending.settle()
    assert not s.cached(torch.tensor([3, 5])).any()
    others = a[(a != 3) & (a != 5)]
    assert s.cached(others).all()
    s.pending.close()


def test_rows_read_before_a_change_another_lookup_applied_are_refused(block) -> None:
    s = stack_over(block, warm=False, admit_batches=1)
    since = s.sync()  # a lookup begins, reads its rows ...
    block.write(torch.tensor([7]), torch.full((1, DIM), 9.0))
    s.sync()  # ... meanwhile another lookup applies a write to one of them
    a = torch.arange(0, 10)
    s.pending.offer(a, rows_of(a), since, 1.0)  # offered after: 7 is refused
    assert s.pending.rounds == 1
    assert not s.cached(torch.tensor([7])).any()
    assert s.cached(a[a != 7]).all()
    s.pending.close()


def test_rows_not_found_and_not_picked_are_not_admitted(block) -> None:
    s = stack_over(block, warm=False, admit_batches=1)
    a = torch.arange(0, 20)
    found = a % 2 == 0  # the odd keys were default rows
    s.pending.offer(a, rows_of(a), s.sync(), 1.0, found)
    assert s.cached(a[found]).all() and not s.cached(a[~found]).any()
    b = torch.arange(100, 400)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        s.pending.offer(b, rows_of(b), s.sync(), 0.5)  # each offered row with p = 0.5
    took = int(s.cached(b).sum())
    assert 100 < took < 200, took
    s.pending.close()


def test_a_cold_cache_takes_a_large_offer_in_a_round_of_its_own(block) -> None:
    """Cold, the log holds a quarter of the slots (128); an offer past its room is a round
    of its own at once, with what waits, at most the cache's slots of it."""
    s = stack_over(block, warm=False, admit_batches=1000)
    a = torch.arange(0, 100)
    s.pending.offer(a, rows_of(a), s.sync(), 1.0)
    assert s.pending.rounds == 0 and s.pending.waiting == 100
    b = torch.arange(1000, 1000 + 600)
    s.pending.offer(b, rows_of(b), s.sync(), 1.0)
    assert s.pending.rounds == 1 and s.pending.waiting == 0
    assert s.budget.admitted == SLOTS  # a random sample of the 700, the cache's slots
    every = torch.cat([a, b])
    assert 0 < int(s.cached(every).sum()) <= SLOTS
    s.pending.close()


def test_drop_forgets_what_waits_and_a_started_round(block) -> None:
    s = stack_over(block, warm=True, kept=True, admit_batches=2)
    a, b = torch.arange(0, 10), torch.arange(10, 20)
    s.pending.offer(a, rows_of(a), s.sync(), 1.0)
    s.pending.offer(b, rows_of(b), s.sync(), 1.0)  # due: started
    assert s.pending.rounds == 1
    s.pending.drop()  # a write through the layer
    s.pending.settle()
    assert not s.cached(torch.cat([a, b])).any()
    kept = s.pending._kept  # noqa: SLF001  (the kept log: every slot empty again)
    assert kept is not None and bool((kept[0].keys == EMPTY_KEY).all())
    c = torch.arange(20, 25)
    s.pending.offer(c, rows_of(c), s.sync(), 1.0)
    s.pending.offer(c, rows_of(c), s.sync(), 1.0)
    s.pending.settle()
    assert s.cached(c).all() and not s.cached(torch.cat([a, b])).any()
    s.pending.close()


def test_a_feed_that_overflowed_clears_and_what_waits_goes(block) -> None:
    s = stack_over(block, warm=True, kept=True, admit_batches=1000)
    a = torch.arange(0, 10)
    s.pending.offer(a, rows_of(a), s.sync(), 1.0)
    s.pending.changed(None)  # what the follower reports when it clears the cache
    assert s.pending.waiting == 0
    s.budget.reset()
    b = torch.arange(10, 20)
    s.pending.offer(b, rows_of(b), s.sync(), 1.0)  # a cold log now
    assert s.pending.waiting == 10
    s.pending.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_layers_waiting_rows_of_keys_another_layer_updated_never_go_in(
        table_name: str, tmp_path, device: str) -> None:
    """Through the public API: a Hierarchical layer's lookup fetched rows that wait for
    their round; another layer updates two of those keys (announced on the shared host
    cache's feed); the next lookups apply the change, the round comes, and every later
    lookup returns the new rows, never the waiting old ones."""
    rows, dim = 256, 8
    old = torch.arange(rows, dtype=torch.float32)[:, None].expand(-1, dim).contiguous()
    ps = psclient.connect(f"file://{tmp_path}/ps", table=table_name, dim=dim)
    hc = HostCache.create(table_name, capacity=rows, dim=dim)
    try:
        ps.insert(torch.arange(rows), old)
        layers = [NVEmbedding(rows, dim, torch.float32, LayerType.Hierarchical,
                              gpu_cache_size=rows * (12 + 4 * dim), host_cache=hc,
                              storage=ps, device=device,
                              tuning=TierConfig(admit_batches=3))
                  for _ in range(2)]
        reader, writer = layers
        a, b, c = (torch.arange(i, i + 32, device=device) for i in (0, 64, 128))
        assert torch.equal(reader(a).cpu(), old[:32])  # a's rows wait for the round
        new = torch.full((2, dim), 1000.0)
        assert writer.update(a[:2], new.to(device)).all()  # announced
        reader(b)  # applies the change first
        reader(c)  # the third lookup with misses: the round
        reader.flush()
        assert reader.in_gpu_cache(a[2:]).all()
        assert not reader.in_gpu_cache(a[:2]).any()  # their old rows never went in
        for _ in range(2):
            got = reader(a).cpu()
            assert torch.equal(got[:2], new) and torch.equal(got[2:], old[2:32])
        for layer in layers:
            layer.close()
    finally:
        hc.close()
        HostCache.unlink(table_name)
        ps.drop()
        ps.close()
