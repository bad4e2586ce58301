"""LinearUVM admissions (gpu.stacks.misses.miss_log): the lookup kernel logs its misses on the
device,
a round admits them with no host sync, at the cadence of gpu.TierConfig; lookups on two
streams and their rounds are ordered (gpu.cache.guard)."""

from __future__ import annotations

import pytest
import torch

from gpu import InsertPolicy, LayerType, NVEmbedding, TierConfig
from gpu.cache.gpu_cache import GPUCache
from gpu.stacks.misses.admission import RoundBudget
from gpu.stacks.misses.miss_log import MissLog
from hostcache import SharedMemBlock
from hostcache.layout import EMPTY_KEY

ROWS, DIM = 4096, 4
SLOT = 8 + 4 + DIM * 4
CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")])]


@pytest.fixture
def block(table_name: str):
    mb = SharedMemBlock.create(table_name, num_rows=ROWS, dim=DIM)
    mb.write(torch.arange(ROWS), torch.randn(ROWS, DIM, generator=torch.Generator()
                                             .manual_seed(2)))
    yield mb
    mb.close()
    SharedMemBlock.unlink(table_name)


def layer_on(block: SharedMemBlock, device: str, slots: int, **kw: object) -> NVEmbedding:
    tuning = kw.pop("tuning", None)
    return NVEmbedding(ROWS, DIM, torch.float32, LayerType.LinearUVM, storage=block,
                       gpu_cache_size=slots * SLOT, device=device, tuning=tuning, **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_rounds_come_at_the_configured_cadence(block: SharedMemBlock, device: str) -> None:
    # 8 slots per row: no bucket overflows, every logged key goes in
    layer = layer_on(block, device, 8 * ROWS,
                     tuning=TierConfig(admit_fraction=1.0, round_lookups=5,
                                       round_capacities=1e9, warm_capacities=1.0))
    keys = torch.arange(ROWS, device=device)
    inserts = []
    for _ in range(8):  # cold: a round once as many keys as slots were looked up
        layer(keys)
        inserts.append(layer.stats().gpu.inserts)
    assert inserts == [0] * 7 + [ROWS]
    assert layer.in_gpu_cache(keys).all()
    # warm now (offered as many keys as it has slots): a round every 5 lookups
    fresh = torch.arange(100, 200, device=device)
    layer.erase(fresh)
    assert not layer.in_gpu_cache(fresh).any()
    inserts = []
    for _ in range(5):
        assert torch.equal(layer(fresh).cpu(), block.tensor[100:200])
        inserts.append(layer.stats().gpu.inserts - ROWS)
    assert inserts == [0, 0, 0, 0, 100]
    assert layer.in_gpu_cache(fresh).all()
    layer.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_large_lookup_of_a_cold_cache_admits_all_its_misses_in_one_round(
        block: SharedMemBlock, device: str) -> None:
    """The log holds a quarter of the slots while the cache fills, or a larger lookup's
    keys: one lookup of ROWS keys (twice the quarter) admits every one of them."""
    layer = layer_on(block, device, 8 * ROWS, tuning=TierConfig(admit_fraction=1 / 16))
    keys = torch.arange(ROWS, device=device)
    assert torch.equal(layer(keys).cpu(), block.tensor)  # ROWS >= a sixteenth: a round
    assert layer.stats().gpu.inserts == ROWS
    assert layer.in_gpu_cache(keys).all()
    layer.close()


@pytest.mark.parametrize("device", DEVICES)
def test_policy_zero_admits_nothing_and_half_admits_some(block: SharedMemBlock,
                                                         device: str) -> None:
    keys = torch.arange(0, 1000, device=device)
    none = layer_on(block, device, 4 * ROWS, insert_policy=InsertPolicy(gpu=0.0))
    some = layer_on(block, device, 4 * ROWS, insert_policy=InsertPolicy(gpu=0.5))
    for layer in (none, some):
        layer(keys)
        layer.flush()
    assert not none.in_gpu_cache(keys).any()
    admitted = int(some.in_gpu_cache(keys).sum())
    assert 300 < admitted < 700
    for layer in (none, some):
        assert torch.equal(layer(keys).cpu(), block.tensor[:1000])
        layer.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_write_announced_by_the_block_reaches_cached_and_logged_keys(
        block: SharedMemBlock, device: str) -> None:
    """A write through the block itself (as another process would make it): the cache
    drops the key before the next lookup, and a round after it admits the new row."""
    layer = layer_on(block, device, 4 * ROWS)
    keys = torch.arange(0, 64, device=device)
    layer(keys)
    layer.flush()
    assert layer.in_gpu_cache(keys).all()
    block.write(torch.tensor([3, 5]), torch.full((2, DIM), 9.0))  # announced
    got = layer(keys).cpu()
    assert torch.equal(got, block.tensor[:64])
    assert got[3].eq(9.0).all()
    assert layer.in_gpu_cache(keys).sum() == 62
    layer.flush()
    assert torch.equal(layer(keys).cpu(), block.tensor[:64])
    layer.close()


@pytest.mark.parametrize("device", DEVICES)
def test_rows_logged_before_an_announced_write_are_never_admitted(block: SharedMemBlock,
                                                                  device: str) -> None:
    """The log holds the rows its lookups read: a write announced after them (as another
    process makes it) empties the log, so the next round cannot admit the old rows."""
    layer = layer_on(block, device, 4 * ROWS, tuning=TierConfig(round_lookups=1000))
    keys = torch.arange(0, 64, device=device)
    assert torch.equal(layer(keys).cpu(), block.tensor[:64])  # logged, no round yet
    block.write(torch.tensor([3, 5]), torch.full((2, DIM), 9.0))  # announced
    layer.flush()  # follows the feed first: the log is dropped, the round admits nothing
    assert not layer.in_gpu_cache(keys).any()
    assert layer.stats().gpu.inserts == 0
    assert torch.equal(layer(keys).cpu(), block.tensor[:64])  # logs the new rows
    layer.flush()
    assert layer.in_gpu_cache(keys).all()
    got = layer(keys).cpu()  # every row from the cache now
    assert torch.equal(got, block.tensor[:64]) and got[[3, 5]].eq(9.0).all()
    layer.close()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (two streams)")
def test_lookups_on_two_streams_are_ordered_with_their_rounds(block: SharedMemBlock) -> None:
    """Stream A is busy when its lookup logs misses; stream B's lookup runs the round: B
    waits for A, so the round admits A's misses with their rows."""
    layer = layer_on(block, "cuda", 4 * ROWS,
                     tuning=TierConfig(admit_fraction=600 / (4 * ROWS)))
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    keys_a = torch.arange(0, 16, device="cuda")
    keys_b = torch.arange(16, 600, device="cuda")  # 600 keys in all: the round, a full log
    with torch.cuda.stream(a):
        torch.cuda._sleep(200_000_000)  # A is busy for a while (~0.1 s)
        out_a = layer(keys_a)
    with torch.cuda.stream(b):
        out_b = layer(keys_b)
    torch.cuda.synchronize()
    assert layer.in_gpu_cache(keys_a).all() and layer.in_gpu_cache(keys_b).all()
    assert torch.equal(out_a.cpu(), block.tensor[:16])
    assert torch.equal(out_b.cpu(), block.tensor[16:600])
    assert torch.equal(layer(keys_a).cpu(), block.tensor[:16])
    layer.close()


@pytest.mark.parametrize("field,value", [("admit_fraction", 1.5), ("round_lookups", 0),
                                         ("warm_round_fraction", -0.1), ("admit_keys", True),
                                         ("host_linger_s", -1.0), ("host_batch_keys", 0),
                                         ("host_gpu_read_keys", "4k"),
                                         ("warm_capacities", 0.0)])
def test_bad_tuning_is_refused_and_builds_nothing(field: str, value: object,
                                                  block: SharedMemBlock) -> None:
    from gpu import BadArgumentError

    with pytest.raises(BadArgumentError, match=f"TierConfig.{field}"):
        TierConfig(**{field: value})
    with pytest.raises(BadArgumentError, match="tuning must be a gpu.TierConfig"):
        layer_on(block, "cpu", 64, tuning={"admit_fraction": 0.5})


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_construction_loads_the_kernels_a_lookup_and_its_rounds_launch(
        block: SharedMemBlock) -> None:
    """The first forward and the first rounds (filling and warm) load no kernel variant
    (gpu.kernels.launch.loaded_variants: every kernel launched through a DirectLaunch):
    the layer's construction did, and left its cache empty with no statistics."""
    from gpu.kernels.launch import loaded_variants

    layer = layer_on(block, "cuda", 4 * ROWS)
    stats = layer.stats().gpu
    assert (stats.hits, stats.misses, stats.inserts) == (0, 0, 0)
    assert not layer.in_gpu_cache(torch.arange(ROWS, device="cuda")).any()
    loaded = loaded_variants()
    assert loaded, "the construction loaded no kernel"
    keys = torch.arange(ROWS, device="cuda")
    for _ in range(6):  # the cache fills (a filling round), then warm rounds
        assert torch.equal(layer(keys).cpu(), block.tensor)
    layer.flush()
    torch.cuda.synchronize()
    assert layer.stats().gpu.inserts > 0
    assert loaded_variants() == loaded
    layer.close()


def test_the_kept_log_is_reused_empty_after_the_cache_went_cold() -> None:
    """A warm cache's kept log (a CUDA layer keeps one from its construction; here on the
    CPU, its round eager) holds misses when the cache goes cold; when it is warm again the
    same log comes back, empty: nothing logged before is admitted."""
    cfg = TierConfig(round_lookups=1000, round_capacities=1e9)
    cache = GPUCache(512 * SLOT, DIM, torch.float32, torch.device("cpu"))
    budget = RoundBudget(cache, cfg)
    log = MissLog(cache, budget, cfg, 1.0)
    table = torch.randn(ROWS, DIM)
    budget.make_warm()
    kept = log.candidates(1)
    assert kept is not None
    assert log.keep() is False  # kept, no graph on the CPU
    old = torch.arange(10)
    cache.gather_linear(old, table, candidates=kept, host_table=False, err=None)
    log.logged(old.numel())
    assert int(kept.count) == 10
    budget.reset()  # cold again (a clear, an overflowed change feed)
    log.drop()
    assert int(kept.count) == 0 and bool((kept.keys == EMPTY_KEY).all())
    budget.make_warm()  # warm again
    assert log.candidates(1) is kept
    new = torch.arange(20, 30)
    cache.gather_linear(new, table, candidates=kept, host_table=False, err=None)
    log.logged(new.numel())
    log.round()
    assert not (cache.probe(old, record=False) >= 0).any()
    assert (cache.probe(new, record=False) >= 0).all()
    assert torch.equal(cache.lookup(new)[0], table[new])
    assert int(kept.count) == 0  # the round emptied it
    log.close()


def _kept_log(device: str, cfg: TierConfig) -> tuple[GPUCache, MissLog, RoundBudget]:
    cache = GPUCache(512 * SLOT, DIM, torch.float32, torch.device(device))
    budget = RoundBudget(cache, cfg)
    log = MissLog(cache, budget, cfg, 1.0, ROWS)
    budget.make_warm()
    assert log.candidates(1) is not None
    log.keep()
    return cache, log, budget


def _look(cache: GPUCache, log: MissLog, keys: torch.Tensor, table: torch.Tensor) -> None:
    cand = log.candidates(keys.numel())
    out = cache.gather_linear(keys, table, candidates=cand, host_table=False, err=None)
    assert torch.equal(out, table[keys])
    log.logged(keys.numel())


def test_a_split_round_writes_the_table_at_the_next_lookup_and_a_change_cancels_it() -> None:
    """A kept log's round (gpu.stacks.misses.split_round; its halves eager on the CPU): the lookup
    that
    makes it due sorts the log, the next lookup writes the table; a change announced
    between the halves (the log dropped) cancels the writes, so rows logged before it
    never go in."""
    cfg = TierConfig(round_lookups=2, round_capacities=1e9)
    cache, log, _ = _kept_log("cpu", cfg)
    table = torch.randn(ROWS, DIM)
    a, b, c = torch.arange(0, 10), torch.arange(10, 20), torch.arange(20, 30)
    _look(cache, log, a, table)
    _look(cache, log, b, table)  # the round is due: its sorts run, its writes wait
    assert log.rounds == 1
    assert not (cache.probe(torch.cat([a, b]), record=False) >= 0).any()
    _look(cache, log, c, table)  # the writes land first, then c is logged ...
    assert (cache.probe(torch.cat([a, b]), record=False) >= 0).all()
    assert not (cache.probe(c, record=False) >= 0).any()  # ... and dropped with the log
    assert torch.equal(cache.lookup(b)[0], table[b])
    _look(cache, log, c, table)  # the next round is due: sorted, writes pending
    assert log.rounds == 2
    log.drop()  # a change was announced: the logged rows may be stale
    _look(cache, log, a, table)
    log.settle()
    assert not (cache.probe(c, record=False) >= 0).any()
    assert cache.stats().inserts == 20
    log.close()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (two streams)")
def test_the_lookup_that_makes_a_round_due_does_not_wait_for_its_sorts() -> None:
    """The sorts run on the round's side stream: with that stream held busy, the caller's
    stream still finishes its lookups; the table half waits for the sorts (settle), and
    then the logged keys are in."""
    from gpu.stacks.misses.split_round import SplitRound

    cfg = TierConfig(round_lookups=2, round_capacities=1e9)
    cache, log, _ = _kept_log("cuda", cfg)
    split = log._kept[1]  # noqa: SLF001  (the round's own side stream, to hold busy)
    assert isinstance(split, SplitRound)
    table = torch.randn(ROWS, DIM, device="cuda")
    keys = torch.arange(0, 40, device="cuda")
    _look(cache, log, keys[:20], table)  # NOTE: the lookup's kernel loaded now, not below
    log.drop()
    with torch.cuda.stream(split._side):  # noqa: SLF001
        torch.cuda._sleep(1_000_000_000)  # the side stream busy for ~0.5 s
    _look(cache, log, keys[:20], table)
    _look(cache, log, keys[20:], table)  # due: the sorts queue behind the sleep
    torch.cuda.current_stream().synchronize()
    assert not split._side.query()  # noqa: SLF001  (the caller did not wait for it)
    assert split.pending and not split.poll()
    log.settle()
    assert (cache.probe(keys, record=False) >= 0).all()
    assert torch.equal(cache.lookup(keys)[0], table[keys])
    log.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_write_announced_while_a_round_is_pending_is_never_undone(
        block: SharedMemBlock, device: str) -> None:
    """A warm layer's round started (on CUDA its sorts queued, its table writes waiting for
    a later lookup), then a write announced through the block: the next lookup follows the
    feed, which cancels the pending writes with the log, so the old rows never go in; every
    lookup and, after a flush, the cache hold the new rows."""
    layer = layer_on(block, device, 8 * ROWS,
                     tuning=TierConfig(admit_fraction=1.0, round_lookups=2,
                                       round_capacities=1e9, warm_capacities=1.0))
    everything = torch.arange(ROWS, device=device)
    for _ in range(8):  # cold: a round once as many keys as slots were looked up; warm
        layer(everything)
    assert layer.in_gpu_cache(everything).all()
    layer.erase(everything)  # NOTE: still warm, the cache empty
    keys = torch.arange(0, 64, device=device)
    assert torch.equal(layer(keys).cpu(), block.tensor[:64])
    assert torch.equal(layer(keys).cpu(), block.tensor[:64])  # the round is due: started
    block.write(torch.tensor([3, 5]), torch.full((2, DIM), 9.0))  # announced
    for _ in range(3):  # each follows the feed first; the old round never lands
        got = layer(keys).cpu()
        assert torch.equal(got, block.tensor[:64]) and got[[3, 5]].eq(9.0).all()
    layer.flush()
    cached = layer.in_gpu_cache(keys)
    assert cached.any()
    got = layer(keys).cpu()  # rows from the cache where cached: the new ones
    assert torch.equal(got, block.tensor[:64]) and got[[3, 5]].eq(9.0).all()
    layer.close()
