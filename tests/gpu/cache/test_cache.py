"""GPUCache on the CPU (the torch twin): against a plain dict model, embedding_bag, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu.cache import twin
from gpu.cache.gpu_cache import GPUCache, MissCandidates
from gpu.errors import BadArgumentError, CUDAUnavailableError, GPUError
from hostcache.hashing import bucket_of
from hostcache.layout import EMPTY_KEY

DIM = 4


def small_cache(buckets: int, ways: int = 4, dim: int = DIM, **kw: object) -> GPUCache:
    slot_bytes = 8 + 4 + dim * 4
    return GPUCache(buckets * ways * slot_bytes, dim, torch.float32, "cpu", ways=ways,
                    backend="torch", **kw)  # type: ignore[arg-type]


class DictModel:
    """The cache's documented rules, one key at a time, in plain Python."""

    def __init__(self, num_buckets: int, ways: int) -> None:
        self.nb, self.ways = num_buckets, ways
        self.keys = [EMPTY_KEY] * (num_buckets * ways)
        self.counters = [0] * (num_buckets * ways)
        self.rows: dict[int, torch.Tensor] = {}  # key -> row
        self.hits = self.lookups = self.evictions = self.inserts = 0

    def bucket(self, key: int) -> int:
        return int(bucket_of(torch.tensor([key]), self.nb)[0])

    def slot_of(self, key: int) -> int:
        if self.nb == 0 or key == EMPTY_KEY:
            return -1
        b = self.bucket(key)
        for w in range(self.ways):
            if self.keys[b * self.ways + w] == key:
                return b * self.ways + w
        return -1

    def lookup(self, keys: list[int]) -> tuple[list[torch.Tensor | None], list[bool]]:
        out: list[torch.Tensor | None] = []
        hits = []
        for k in keys:
            s = self.slot_of(k)
            self.lookups += 1
            if s >= 0:
                self.counters[s] = min(self.counters[s] + 1, twin.COUNTER_MAX)
                self.hits += 1
                out.append(self.rows[k])
            else:
                out.append(None)
            hits.append(s >= 0)
        return out, hits

    def insert(self, keys: list[int], values: torch.Tensor) -> None:
        last = {k: i for i, k in enumerate(keys)}
        present = {k for k in last if self.slot_of(k) >= 0}
        for k in present:
            self.rows[k] = values[last[k]]
        fresh = sorted(k for k in last if k not in present)
        if self.nb == 0:
            return
        by_bucket: dict[int, list[int]] = {}
        for k in fresh:
            by_bucket.setdefault(self.bucket(k), []).append(k)
        for b, ks in by_bucket.items():
            ways = range(b * self.ways, (b + 1) * self.ways)
            if max(self.counters[s] for s in ways) >= twin.DECAY_AT:
                for s in ways:
                    self.counters[s] >>= 1
            cand = [s for s in ways if self.keys[s] not in present]
            cand.sort(key=lambda s: (-1 if self.keys[s] == EMPTY_KEY else self.counters[s], s))
            for k, s in zip(ks, cand, strict=False):
                if self.keys[s] != EMPTY_KEY:
                    self.evictions += 1
                    del self.rows[self.keys[s]]
                self.keys[s] = k
                self.counters[s] = min(self.counters[s] + 1, twin.COUNTER_MAX)
                self.rows[k] = values[last[k]]
                self.inserts += 1

    def update(self, keys: list[int], values: torch.Tensor) -> list[bool]:
        found = []
        for i, k in enumerate(keys):
            if self.slot_of(k) >= 0:
                self.rows[k] = values[i]
                found.append(True)
            else:
                found.append(False)
        return found

    def erase(self, keys: list[int]) -> None:
        for k in set(keys):
            s = self.slot_of(k)
            if s >= 0:
                self.keys[s] = EMPTY_KEY
                self.counters[s] = 0
                del self.rows[k]


def check_same(cache: GPUCache, model: DictModel) -> None:
    tkeys, counters, rows = cache.state()
    assert tkeys.tolist() == model.keys
    assert counters.tolist() == model.counters
    for s, k in enumerate(model.keys):
        if k != EMPTY_KEY:
            assert torch.equal(rows[s], model.rows[k])


KEYS = st.lists(st.integers(-6, 40) | st.sampled_from([2**63 - 1, -(2**62)]), max_size=24)
OPS = st.lists(
    st.tuples(st.sampled_from(["insert", "lookup", "update", "erase", "pooled"]), KEYS),
    min_size=1, max_size=14)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, buckets=st.sampled_from([0, 1, 2, 5]), ways=st.sampled_from([1, 2, 4]),
       seed=st.integers(0, 2**16))
def test_twin_matches_dict_model(
    ops: list[tuple[str, list[int]]], buckets: int, ways: int, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    cache = small_cache(buckets, ways)
    model = DictModel(cache.num_buckets, ways)
    assert cache.capacity == buckets * ways
    for op, keys in ops:
        kt = torch.tensor(keys, dtype=torch.int64)
        vals = torch.randn(len(keys), DIM, generator=gen)
        if op == "insert":
            cache.insert(kt, vals)
            model.insert(keys, vals)
        elif op == "lookup":
            got, hit = cache.lookup(kt)
            want, want_hit = model.lookup(keys)
            assert hit.tolist() == want_hit
            for row, w in zip(got, want, strict=True):
                assert torch.equal(row, w if w is not None else torch.zeros(DIM))
        elif op == "pooled":
            offsets = torch.tensor([0, len(keys) // 2, len(keys)])
            got, hit = cache.lookup_pooled(kt, offsets, "sum")
            want, want_hit = model.lookup(keys)
            assert hit.tolist() == want_hit
            rows = torch.stack([w if w is not None else torch.zeros(DIM) for w in want]) \
                if keys else torch.zeros(0, DIM)
            ref = F.embedding_bag(torch.arange(len(keys)), rows, offsets[:-1], mode="sum")
            torch.testing.assert_close(got, ref)
        elif op == "update":
            found = cache.update(kt, vals)
            assert found.tolist() == model.update(keys, vals)
        else:
            cache.erase(kt)
            model.erase(keys)
        check_same(cache, model)
    s = cache.stats()
    assert (s.hits, s.hits + s.misses) == (model.hits, model.lookups)
    assert (s.inserts, s.evictions) == (model.inserts, model.evictions)
    assert s.size == sum(k != EMPTY_KEY for k in model.keys)


def test_eviction_order_is_lfu_with_aging() -> None:
    cache = small_cache(1, ways=4)
    keys = torch.tensor([10, 11, 12, 13])
    cache.insert(keys, torch.arange(16.0).reshape(4, 4))
    for _ in range(3):
        cache.lookup(torch.tensor([10, 12, 13]))
    cache.lookup(torch.tensor([10, 13]))
    # ways 0..3 hold 10..13 with counters 5, 1, 4, 5: 11 (lowest) goes first
    cache.insert(torch.tensor([20]), torch.ones(1, 4))
    assert cache.lookup(torch.tensor([11]))[1].tolist() == [False]
    tkeys, counters, _ = cache.state()
    assert counters[tkeys.tolist().index(20)] == 2  # victim's counter + 1
    # counters now 5, 2, 4, 5: 21 takes way 1 (evicting 20), 22 way 2 (evicting 12);
    # 10 and 13 tie at 5 and stay
    cache.insert(torch.tensor([21, 22]), torch.ones(2, 4))
    assert cache.state()[0].tolist() == [10, 21, 22, 13]
    assert cache.stats().evictions == 3


def test_insert_batch_rules() -> None:
    cache = small_cache(1, ways=2)
    vals = torch.arange(20.0).reshape(5, 4)
    # duplicates: last occurrence wins; 3 new keys for 2 ways: the two smallest are kept
    cache.insert(torch.tensor([7, 5, 7, 9, 5]), vals)
    got, hit = cache.lookup(torch.tensor([5, 7, 9]))
    assert hit.tolist() == [True, True, False]
    assert torch.equal(got[0], vals[4]) and torch.equal(got[1], vals[2])
    # a key of the batch already present is never the victim of a new key of the batch
    cache.insert(torch.tensor([5, 1]), vals[:2])
    assert cache.lookup(torch.tensor([5, 1, 7]))[1].tolist() == [True, True, False]


def test_decay_and_saturation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(twin, "DECAY_AT", 8)
    monkeypatch.setattr(twin, "COUNTER_MAX", 10)
    cache = small_cache(1, ways=2)
    cache.insert(torch.tensor([1, 2]), torch.zeros(2, 4))
    cache.lookup(torch.full((30,), 1))
    cache.lookup(torch.full((3,), 2))
    _, counters, _ = cache.state()
    assert sorted(counters.tolist()) == [4, 10]  # 1 + 30 saturates at 10; 1 + 3
    cache.insert(torch.tensor([3]), torch.zeros(1, 4))  # bucket max 10 >= 8: halved first
    tkeys, counters, _ = cache.state()
    assert sorted(zip(tkeys.tolist(), counters.tolist(), strict=True)) == [(1, 5), (3, 3)]


@pytest.mark.parametrize("mode", ["sum", "mean", "weighted"])
def test_pooled_matches_embedding_bag(mode: str) -> None:
    gen = torch.Generator().manual_seed(3)
    cache = small_cache(64, ways=8, dim=8)
    keys = torch.randint(0, 1000, (300,), generator=gen)
    cache.insert(keys[:200], torch.randn(200, 8, generator=gen))
    q = torch.randint(0, 1000, (120,), generator=gen)
    q[:60] = keys[:60]
    offsets = torch.tensor([0, 0, 7, 7, 50, 119, 120])  # empty bags included
    rows, hit = cache.lookup(q)
    misses = torch.randn(120, 8, generator=gen)
    w = torch.rand(120, generator=gen) if mode == "weighted" else None
    m = "sum" if mode == "weighted" else mode
    for mv in (None, misses):
        got, ghit = cache.lookup_pooled(q, offsets, m, w, miss_values=mv)  # type: ignore[arg-type]
        src = rows if mv is None else torch.where(hit[:, None], rows, mv)
        ref = F.embedding_bag(torch.arange(120), src, offsets, mode=m, per_sample_weights=w,
                              include_last_offset=True)
        assert torch.equal(ghit, hit)
        torch.testing.assert_close(got, ref)
    assert cache.lookup_pooled(q[:0], torch.zeros(1, dtype=torch.int64))[0].shape == (0, 8)


def test_linear_serves_misses_from_table() -> None:
    cache = small_cache(16, ways=4)
    table = torch.randn(50, DIM)
    cache.insert(torch.tensor([3, 4]), torch.ones(2, DIM))
    keys = torch.tensor([3, 10, 4, 49, 0, 10])
    got, hit = cache.lookup_linear(keys, table)
    assert hit.tolist() == [True, False, True, False, False, False]
    assert torch.equal(got[0], torch.ones(DIM)) and torch.equal(got[1], table[10])
    assert torch.equal(got[3], table[49])
    pooled, phit = cache.lookup_linear_pooled(keys, torch.tensor([0, 2, 6]), table)
    torch.testing.assert_close(pooled[0], torch.ones(DIM) + table[10])
    assert torch.equal(phit, hit)
    with pytest.raises(BadArgumentError, match=r"\[0, 50\)"):
        cache.lookup_linear(torch.tensor([50]), table)
    with pytest.raises(BadArgumentError, match="num_rows"):
        cache.lookup_linear(keys, torch.randn(50, DIM + 1))


def test_disabled_cache_and_clear() -> None:
    cache = small_cache(0)
    assert cache.capacity == 0
    cache.insert(torch.tensor([1, 2]), torch.ones(2, DIM))
    got, hit = cache.lookup(torch.tensor([1, 2]))
    assert not hit.any() and not got.any()
    assert cache.probe(torch.tensor([1])).tolist() == [-1]
    full = small_cache(4)
    full.insert(torch.tensor([1, 2]), torch.ones(2, DIM))
    slots = full.probe(torch.tensor([1, 5, 2]))
    assert slots[1] == -1 and (slots[[0, 2]] >= 0).all()
    assert torch.equal(full.gather(slots), full.lookup(torch.tensor([1, 5, 2]))[0])
    full.clear()
    assert full.stats().size == 0 and not full.lookup(torch.tensor([1, 2]))[1].any()


def test_warming_up_leaves_no_rows_and_the_statistics_as_they_were() -> None:
    cache = small_cache(8)
    cache.insert(torch.tensor([1, 2]), torch.ones(2, DIM))
    cache.lookup(torch.tensor([1, 3]))
    before = cache.stats()
    with cache.warming_up():
        cache.insert(torch.arange(10, 20), torch.ones(10, DIM))
        cache.lookup(torch.arange(10, 30))
        assert cache.stats() != before  # the work counted while it ran
    after = cache.stats()
    assert after.size == 0
    assert (after.hits, after.misses, after.inserts, after.evictions) == (
        before.hits, before.misses, before.inserts, before.evictions)


def test_bad_arguments_raise_typed_errors_and_change_nothing() -> None:
    cache = small_cache(4)
    cache.insert(torch.tensor([1]), torch.ones(1, DIM))
    before = cache.state()
    bad_calls = [
        lambda: cache.lookup(torch.tensor([1], dtype=torch.int32)),
        lambda: cache.lookup(torch.tensor([[1]])),
        lambda: cache.lookup([1]),  # type: ignore[arg-type]
        lambda: cache.insert(torch.tensor([1]), torch.ones(1, DIM, dtype=torch.float64)),
        lambda: cache.insert(torch.tensor([1, 2]), torch.ones(1, DIM)),
        lambda: cache.insert(torch.tensor([EMPTY_KEY]), torch.ones(1, DIM)),
        lambda: cache.update(torch.tensor([1]), torch.ones(1, DIM + 1)),
        lambda: cache.lookup_pooled(torch.tensor([1]), torch.tensor([0, 2])),
        lambda: cache.lookup_pooled(torch.tensor([1]), torch.tensor([0, 1]), "max"),
        lambda: cache.lookup_pooled(torch.tensor([1]), torch.tensor([0, 1]), "mean",
                                    torch.ones(1)),
        lambda: cache.gather(torch.tensor([10**6])),
        lambda: MissCandidates.empty(-1, "cpu"),
        lambda: MissCandidates.empty(2.5, "cpu"),  # type: ignore[arg-type]
        lambda: cache.lookup_linear(torch.tensor([1]), torch.randn(50, DIM), candidates=(
            MissCandidates(torch.zeros(3, dtype=torch.int32)))),
        lambda: cache.lookup_linear_pooled(torch.tensor([1]), torch.tensor([0, 1]),
                                           torch.randn(50, DIM),
                                           candidates=MissCandidates(torch.zeros(4).long())),
        lambda: GPUCache(-1, DIM, torch.float32),
        lambda: GPUCache(1024, 0, torch.float32),
        lambda: GPUCache(1024, DIM, torch.int32),
        lambda: GPUCache(1024, DIM, torch.float32, ways=3),
        lambda: GPUCache(1024, DIM, torch.float32, backend="cuda"),  # type: ignore[arg-type]
        lambda: GPUCache(1024, DIM, torch.float32, "meta"),
    ]
    for call in bad_calls:
        with pytest.raises(BadArgumentError) as info:
            call()
        assert isinstance(info.value, GPUError) and isinstance(info.value, ValueError)
    after = cache.state()
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert cache.stats().hits == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_device_without_cuda() -> None:
    with pytest.raises(CUDAUnavailableError, match="device='cpu'"):
        GPUCache(1024, DIM, torch.float32, "cuda")


def test_sizing_counts_keys_counters_and_rows() -> None:
    cache = GPUCache(10 * 8 * (12 + 128 * 4) + 100, 128, torch.float32, ways=8)
    assert (cache.num_buckets, cache.capacity) == (10, 80)
    half = GPUCache(10 * 8 * (12 + 128 * 2), 128, torch.float16, ways=8)
    assert half.capacity == 80


@pytest.mark.parametrize("ways", [4, 8, 16])
def test_the_twins_first_matching_way_is_the_lowest(ways: int) -> None:
    """The twin's probe finds the lowest matching way of every row (8 ways: through the
    row read as one int64) exactly as a masked minimum does, rows with several matches
    and none included."""
    from gpu.cache.twin import _first_way

    gen = torch.Generator().manual_seed(ways)
    match = torch.rand(4096, ways, generator=gen) < 0.15  # 0, 1 or several per row
    match[:ways] = torch.eye(ways, dtype=torch.bool)  # each way alone
    match[ways] = True
    match[ways + 1] = False
    way = torch.arange(ways)
    want = torch.where(match, way[None, :], ways).amin(dim=1)
    assert torch.equal(_first_way(match, ways), want)
    assert int((match.sum(1) > 1).sum()) > 100  # several matches did occur


def test_the_backend_is_chosen_by_device_unless_named() -> None:
    """A CPU cache runs the torch twin by default; naming a backend or giving launch settings
    that are not a Tiles is refused with a typed error naming what is allowed."""
    from gpu.kernels.tiles import Tiles

    assert GPUCache(1024, DIM, torch.float32).backend == "torch"
    assert GPUCache(1024, DIM, torch.float32, backend="torch").ops.name == "torch"
    with pytest.raises(BadArgumentError, match="'auto', 'torch' or 'triton'"):
        GPUCache(1024, DIM, torch.float32, backend="numpy")  # type: ignore[arg-type]
    with pytest.raises(BadArgumentError, match="tiles must be a gpu.kernels.tiles.Tiles"):
        GPUCache(1024, DIM, torch.float32, tiles={"lookup_block_k": 8})  # type: ignore[arg-type]
    for field, value in (("lookup_block_k", 12), ("pooled_warps", 0), ("insert_block_k", True),
                         ("linear_page_order", -1)):
        with pytest.raises(BadArgumentError, match=f"Tiles.{field}"):
            Tiles(**{field: value})
    assert Tiles(linear_page_order=0).linear_page_order == 0  # 0: never page order


def test_tier_config_names_the_cache_backend_and_tiles() -> None:
    from gpu import TierConfig
    from gpu.kernels.tiles import DEFAULT_TILES

    assert TierConfig().cache_backend == "auto" and TierConfig().tiles is DEFAULT_TILES
    with pytest.raises(BadArgumentError, match="TierConfig.cache_backend"):
        TierConfig(cache_backend="cuda")  # type: ignore[arg-type]
    with pytest.raises(BadArgumentError, match="TierConfig.tiles"):
        TierConfig(tiles=None)  # type: ignore[arg-type]
