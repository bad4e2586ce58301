"""HostCache against a plain dict model, duplicate keys, eviction order, bad input."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hostcache import BadArgumentError, GeometryMismatchError, HandleClosedError, HostCache
from hostcache.hashing import bucket_of
from hostcache.layout import EMPTY_KEY
from tests.conftest import fresh_name
from tests.hostcache.twin_workers import arrays_of

DIM = 4


def rows_for(keys: torch.Tensor, tag: int = 0) -> torch.Tensor:
    """Rows that encode their key and a tag, so a foreign or stale row is detectable."""
    base = keys.to(torch.float64)[:, None] * 1000 + tag
    return (base + torch.arange(DIM, dtype=torch.float64)).to(torch.float32)


@pytest.fixture
def cache(table_name: str):
    hc = HostCache.create(table_name, capacity=4096, dim=DIM)
    yield hc
    hc.close()
    HostCache.unlink(table_name)


keys_st = st.lists(st.integers(-(2**63) + 1, 2**63 - 1) | st.integers(-50, 50), max_size=40)
op_st = st.tuples(st.sampled_from(["insert", "update", "erase", "lookup", "clear"]), keys_st)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=st.lists(op_st, max_size=25))
def test_differential_against_dict(cache: HostCache, ops: list) -> None:
    """With room for every key, the cache behaves exactly like a dict (last write wins)."""
    cache.clear()
    model: dict[int, torch.Tensor] = {}
    for step, (op, klist) in enumerate(ops):
        keys = torch.tensor(klist, dtype=torch.int64)
        if op == "insert":
            vals = rows_for(keys, step)
            cache.insert(keys, vals)
            for i, k in enumerate(klist):
                model[k] = vals[i]
        elif op == "update":
            vals = rows_for(keys, step)
            found = cache.update(keys, vals)
            assert found.tolist() == [k in model for k in klist]
            for i, k in enumerate(klist):
                if k in model:
                    model[k] = vals[i]
        elif op == "erase":
            found = cache.erase(keys)
            assert found.tolist() == [k in model for k in klist]
            for k in klist:
                model.pop(k, None)
        elif op == "clear":
            cache.clear()
            model.clear()
        values, hit = cache.lookup(keys)
        assert hit.tolist() == [k in model for k in klist]
        for i, k in enumerate(klist):
            expected = model[k] if k in model else torch.zeros(DIM)
            assert torch.equal(values[i], expected)
        assert len(cache) == len(model)


def test_duplicates_last_write_wins_and_lookup_repeats(cache: HostCache) -> None:
    keys = torch.tensor([7, 8, 7, 7])
    vals = torch.arange(16, dtype=torch.float32).view(4, DIM)
    cache.insert(keys, vals)
    out, hit = cache.lookup(torch.tensor([7, 7, 8]))
    assert hit.all()
    assert torch.equal(out[0], vals[3]) and torch.equal(out[1], vals[3])
    assert torch.equal(out[2], vals[1])
    found = cache.update(torch.tensor([8, 8, 9]), torch.stack([vals[0], vals[2], vals[0]]))
    assert found.tolist() == [True, True, False]
    assert torch.equal(cache.lookup(torch.tensor([8]))[0][0], vals[2])


def keys_in_one_bucket(hc: HostCache, count: int, start: int = 0) -> torch.Tensor:
    candidates = torch.arange(start, start + 200_000)
    b = bucket_of(candidates, hc.geometry.num_buckets)
    return candidates[b == b[0]][:count]


def test_eviction_takes_the_coldest_way(table_name: str) -> None:
    with HostCache.create(table_name, capacity=64, dim=DIM, ways=4) as hc:
        try:
            same = keys_in_one_bucket(hc, 6)
            first = same[:4]
            assert hc.insert(first, rows_for(first)) == (4, 0)  # (written, evicted)
            for _ in range(3):  # make all but first[2] hot
                hc.lookup(first[[0, 1, 3]])
            assert hc.insert(same[4:5], rows_for(same[4:5])) == (1, 1)
            _, hit = hc.lookup(same[:5])
            assert hit.tolist() == [True, True, False, True, True]
            stats = hc.stats()
            assert stats.evictions == 1 and stats.size == 4
            # the newcomer starts at the victim's count + 1: the next newcomer evicts it
            # only if it is now the coldest; first[0,1,3] have 3+ hits, so it is.
            hc.insert(same[5:6], rows_for(same[5:6]))
            _, hit = hc.lookup(same)
            assert hit.tolist() == [True, True, False, True, False, True]
        finally:
            HostCache.unlink(table_name)


@pytest.mark.parametrize("overwrite", [False, True])
def test_keys_of_the_batch_already_cached_are_never_its_victims(table_name: str,
                                                                overwrite: bool) -> None:
    """Cold cached keys written again in the batch that places new keys in their bucket
    stay; the new keys take the next coldest ways (in a table of many buckets, so the
    protected ways are found among others)."""
    with HostCache.create(table_name, capacity=4096, dim=DIM, ways=8) as hc:
        try:
            same = keys_in_one_bucket(hc, 10)
            old, new = same[:8], same[8:]
            other = torch.arange(10**6, 10**6 + 500)  # other buckets, touched by the batch
            hc.insert(torch.cat([old, other]), rows_for(torch.cat([old, other])))
            for _ in range(3):  # old[4:] hot; old[:4] coldest, ties by way: old[0] first
                hc.lookup(old[4:])
            batch = torch.cat([old[:2], new, other[:50]])
            hc.insert(batch, rows_for(batch, tag=1), overwrite=overwrite)
            _, hit = hc.lookup(torch.cat([old, new]), count=False)
            assert hit.tolist() == [True, True, False, False] + [True] * 4 + [True, True]
            got, _ = hc.lookup(old[:2], count=False)
            assert torch.equal(got, rows_for(old[:2], tag=1 if overwrite else 0))
        finally:
            HostCache.unlink(table_name)


def test_lookup_counts_each_hit_occurrence_and_leaves_missed_slots_alone(table_name: str) -> None:
    with HostCache.create(table_name, capacity=64, dim=DIM, ways=4) as hc:
        try:
            same = keys_in_one_bucket(hc, 5)
            hc.insert(same[:3], rows_for(same[:3]))
            before = hc.policy(same)
            assert (before[:3] >= 0).all() and (before[3:] == -1).all()
            # same[1] twice, same[0] once, same[3] and same[4] absent (their probe lands on
            # the same bucket), same[2] not looked up
            _, hit = hc.lookup(same[[1, 3, 1, 0, 4]])
            assert hit.tolist() == [True, False, True, True, False]
            assert (hc.policy(same) - before).tolist() == [1, 2, 0, 0, 0]  # misses: nothing
            hc.lookup(same, count=False)  # a peek counts nothing
            assert (hc.policy(same) - before).tolist() == [1, 2, 0, 0, 0]
        finally:
            HostCache.unlink(table_name)


def test_touch_counts_hits_for_eviction_like_lookup_without_reading(table_name: str) -> None:
    with HostCache.create(table_name, capacity=64, dim=DIM, ways=4) as hc:
        try:
            same = keys_in_one_bucket(hc, 5)
            first = same[:4]
            hc.insert(first, rows_for(first))
            before = hc.stats()
            hc.touch(first[[0, 1, 3]], weight=3)  # as hot as three lookups each
            hc.touch(torch.tensor([10**15]))  # absent: ignored
            after = hc.stats()
            assert (after.hits, after.misses) == (before.hits, before.misses)
            hc.insert(same[4:5], rows_for(same[4:5]))
            _, hit = hc.lookup(same)
            assert hit.tolist() == [True, True, False, True, True]  # the untouched one went
            for bad in (0, -1, 1.5, True):
                with pytest.raises(BadArgumentError):
                    hc.touch(first, weight=bad)
        finally:
            HostCache.unlink(table_name)


def test_more_new_keys_than_ways_in_one_batch_is_best_effort(table_name: str) -> None:
    with HostCache.create(table_name, capacity=64, dim=DIM, ways=4) as hc:
        try:
            same = keys_in_one_bucket(hc, 7)
            hc.insert(same, rows_for(same))
            values, hit = hc.lookup(same)
            assert int(hit.sum()) == 4
            assert torch.equal(values[hit], rows_for(same[hit]))
            assert len(hc) == 4
        finally:
            HostCache.unlink(table_name)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_small_cache_never_returns_a_stale_or_foreign_row(seed: int) -> None:
    """Under eviction pressure a hit always carries the latest row written for its key."""
    name = fresh_name("small-")
    gen = torch.Generator().manual_seed(seed)
    with HostCache.create(name, capacity=32, dim=DIM, ways=4) as hc:
        try:
            written: dict[int, int] = {}
            for step in range(20):
                keys = torch.randint(0, 200, (16,), generator=gen)
                if step % 3 == 2:
                    found = hc.update(keys, rows_for(keys, step))
                    written.update({k: step for k in keys[found].tolist()})
                else:
                    hc.insert(keys, rows_for(keys, step))
                    written.update({k: step for k in keys.tolist()})
                probe = torch.randint(0, 200, (64,), generator=gen)
                values, hit = hc.lookup(probe)
                assert len(hc) <= hc.geometry.capacity
                expected = torch.stack(
                    [
                        rows_for(probe[i : i + 1], written.get(int(probe[i]), -1))[0]
                        for i in range(probe.numel())
                    ]
                )
                assert torch.equal(values[hit], expected[hit])
                assert not values[~hit].any()
        finally:
            HostCache.unlink(name)


def test_stats_per_process_and_node(cache: HostCache) -> None:
    other = HostCache.attach(cache.name)
    try:
        cache.insert(torch.arange(10), rows_for(torch.arange(10)))
        other.lookup(torch.arange(20))
        mine, theirs, node = cache.stats("process"), other.stats("process"), cache.stats()
        assert (mine.inserts, mine.hits) == (10, 0)
        assert (theirs.hits, theirs.misses) == (10, 10)
        assert (node.inserts, node.hits, node.misses, node.size) == (10, 10, 10, 10)
        assert node.hit_rate == pytest.approx(0.5)
        assert node.processes == 1  # both handles live in this process
    finally:
        other.close()
    # a closed handle's counters are retired into the node-wide totals, not lost
    assert cache.stats().hits == 10


def test_pickles_by_name(cache: HostCache) -> None:
    cache.insert(torch.tensor([5]), rows_for(torch.tensor([5])))
    clone = pickle.loads(pickle.dumps(cache))
    try:
        assert len(pickle.dumps(cache)) < 200  # by name, not by content
        assert clone.lookup(torch.tensor([5]))[1].item()
    finally:
        clone.close()


def test_changes_since_reports_updates_and_overflow(cache: HostCache) -> None:
    cursor = cache.change_cursor
    cache.insert(torch.tensor([1, 2]), rows_for(torch.tensor([1, 2])))
    keys, cursor2, overflowed = cache.changes_since(cursor)
    assert keys.numel() == 0 and not overflowed  # new keys are no invalidation
    cache.update(torch.tensor([2, 3]), rows_for(torch.tensor([2, 3]), 1))
    cache.insert(torch.tensor([1]), rows_for(torch.tensor([1]), 2))
    cache.erase(torch.tensor([1]))
    keys, cursor3, overflowed = cache.changes_since(cursor2)
    assert keys.tolist() == [2, 1, 1] and not overflowed
    cache.clear()
    keys, _, overflowed = cache.changes_since(cursor3)
    assert overflowed


def test_ring_overflow_when_reader_falls_behind(table_name: str) -> None:
    with HostCache.create(table_name, capacity=256, dim=DIM, ring_capacity=8) as hc:
        try:
            keys = torch.arange(20)
            hc.insert(keys, rows_for(keys))
            start = hc.change_cursor
            hc.update(keys[:5], rows_for(keys[:5], 1))
            assert hc.changes_since(start)[0].tolist() == list(range(5))
            hc.update(keys[5:], rows_for(keys[5:], 1))
            assert hc.changes_since(start)[2] is True
            assert hc.changes_since(start + 5)[2] is True  # 15 behind a ring of 8
        finally:
            HostCache.unlink(table_name)


@pytest.mark.parametrize(
    ("keys", "values", "match"),
    [
        (torch.tensor([1.0]), torch.zeros(1, DIM), "int64"),
        (torch.tensor([[1]]), torch.zeros(1, DIM), "1-D"),
        ([1, 2], torch.zeros(2, DIM), "torch.Tensor"),
        (torch.tensor([EMPTY_KEY]), torch.zeros(1, DIM), "reserved"),
        (torch.tensor([1]), torch.zeros(1, DIM, dtype=torch.float64), "dtype"),
        (torch.tensor([1]), torch.zeros(2, DIM), "shape"),
        (torch.tensor([1]), torch.zeros(1, DIM + 1), "shape"),
    ],
)
def test_bad_input_raises_and_changes_nothing(cache: HostCache, keys, values, match) -> None:
    cache.insert(torch.tensor([1]), rows_for(torch.tensor([1])))
    before = cache.stats()
    with pytest.raises(BadArgumentError, match=match):
        cache.insert(keys, values)
    with pytest.raises(BadArgumentError):
        cache.update(keys, values)
    after = cache.stats()
    assert (after.size, after.inserts, after.updates) == (before.size, before.inserts, 0)
    assert torch.equal(cache.lookup(torch.tensor([1]))[0], rows_for(torch.tensor([1])))


def test_attach_checks_geometry_and_closed_handles_refuse(cache: HostCache) -> None:
    with pytest.raises(GeometryMismatchError, match="dim"):
        HostCache.attach(cache.name, dim=DIM + 1)
    with pytest.raises(GeometryMismatchError, match="dtype"):
        HostCache.attach(cache.name, dtype=torch.float16)
    other = HostCache.attach(cache.name, dim=DIM, dtype=torch.float32)
    other.close()
    other.close()  # idempotent
    with pytest.raises(HandleClosedError):
        other.lookup(torch.tensor([1]))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity": 0, "dim": 4},
        {"capacity": -5, "dim": 4},
        {"capacity": 10, "dim": 0},
        {"capacity": 10, "dim": 4, "ways": 3},
        {"capacity": 10, "dim": 4, "dtype": torch.int32},
        {"capacity": 10, "dim": 4, "policy": "random"},
        {"capacity": 10, "dim": 4, "mode": 0o777},
        {"capacity": 2.5, "dim": 4},
    ],
)
def test_bad_geometry_is_refused_and_creates_nothing(table_name: str, kwargs: dict) -> None:
    with pytest.raises(BadArgumentError):
        HostCache.create(table_name, **kwargs)
    assert not os.path.exists(f"/dev/shm/nvec.{table_name}")


def test_fp16_and_bf16_rows_round_trip(table_name: str) -> None:
    for i, dtype in enumerate([torch.float16, torch.bfloat16, torch.float64]):
        name = f"{table_name}-{i}"
        with HostCache.create(name, capacity=64, dim=3, dtype=dtype) as hc:
            try:
                vals = torch.randn(5, 3).to(dtype)
                hc.insert(torch.arange(5), vals)
                out, hit = hc.lookup(torch.arange(5))
                assert hit.all() and out.dtype == dtype and torch.equal(out, vals)
            finally:
                HostCache.unlink(name)


def test_fill_without_overwrite_never_replaces_a_newer_row(cache: HostCache) -> None:
    """insert(overwrite=False) is how PS rows fill the cache: a concurrent update wins."""
    keys = torch.tensor([1, 2])
    cache.update(keys[:1], rows_for(keys[:1], 9), insert_missing=True)  # the newer row
    start = cache.change_cursor
    cache.insert(keys, rows_for(keys, 0), overwrite=False)  # an older read of both rows
    values, hit = cache.lookup(keys)
    assert hit.all()
    assert torch.equal(values, torch.cat([rows_for(keys[:1], 9), rows_for(keys[1:], 0)]))
    assert cache.changes_since(start)[0].numel() == 0


def test_update_insert_missing_announces_every_key(cache: HostCache) -> None:
    cache.insert(torch.tensor([1]), rows_for(torch.tensor([1])))
    start = cache.change_cursor
    found = cache.update(
        torch.tensor([1, 2]), rows_for(torch.tensor([1, 2]), 4), insert_missing=True
    )
    assert found.tolist() == [True, False]
    assert sorted(cache.changes_since(start)[0].tolist()) == [1, 2]
    assert cache.lookup(torch.tensor([2]))[1].item()


def test_fill_since_a_cursor_refuses_keys_announced_meanwhile(cache: HostCache) -> None:
    """A fill read before a change (announced or written) never lands after it."""
    keys = torch.tensor([1, 2, 3])
    cursor = cache.change_cursor  # a replica takes the cursor, then reads the PS (old rows)
    cache.announce(torch.tensor([2]))  # another node changed key 2 (the service announces)
    cache.update(torch.tensor([3]), rows_for(torch.tensor([3]), 5), insert_missing=True)
    done = cache.insert(keys, rows_for(keys, 0), overwrite=False, since=cursor)
    assert (done.written, done.evicted) == (1, 0)  # key 1 only
    values, hit = cache.lookup(keys)
    assert hit.tolist() == [True, False, True]
    assert torch.equal(values[2], rows_for(torch.tensor([3]), 5)[0])  # the update stands
    cache.clear()  # overflow: a fill from before a clear is refused entirely
    assert cache.insert(keys, rows_for(keys, 0), overwrite=False, since=cursor) == (0, 0)
    assert not cache.lookup(keys)[1].any()


def test_peek_changes_no_counter(cache: HostCache) -> None:
    cache.insert(torch.tensor([1]), rows_for(torch.tensor([1])))
    before = cache.stats()
    _, hit = cache.lookup(torch.tensor([1, 2]), count=False)
    assert hit.tolist() == [True, False]
    after = cache.stats()
    assert (after.hits, after.misses, after.lookups) == (before.hits, before.misses, before.lookups)


def test_a_slot_mid_write_reads_as_a_miss_until_its_write_commits(table_name: str) -> None:
    """The seqlock from the reader's side: a slot whose version is odd (a writer inside)
    is a miss with a zero row; the same slot is a hit again once the version is even."""
    with HostCache.create(table_name, capacity=64, dim=4) as hc:
        try:
            keys = torch.tensor([5, 6])
            hc.insert(keys, torch.ones(2, 4))
            versions = arrays_of(hc).versions  # the shared pages, through the layout
            (slot,) = (arrays_of(hc).keys == 5).nonzero()[0]
            assert hc.audit().mid_write == 0
            versions[slot] += 1  # what a writer does first
            assert hc.audit().mid_write == 1
            values, hit = hc.lookup(keys)
            assert hit.tolist() == [False, True]
            assert not values[0].any() and bool((values[1] == 1).all())
            versions[slot] += 1  # ... and last
            assert hc.lookup(keys)[1].tolist() == [True, True]
        finally:
            HostCache.unlink(table_name)


def test_lookup_into_a_given_tensor(table_name: str) -> None:
    """``out=`` gets exactly what a lookup returns (rows of hits, zeros for misses, odd
    dims and every dtype); a wrong ``out`` raises before anything is read or counted."""
    for i, (dim, dtype) in enumerate([(3, torch.float16), (5, torch.bfloat16),
                                      (7, torch.float32), (1, torch.float64)]):
        name = f"{table_name}-o{i}"
        with HostCache.create(name, capacity=64, dim=dim, dtype=dtype) as hc:
            try:
                hc.insert(torch.arange(0, 20, 2), torch.randn(10, dim).to(dtype))
                keys = torch.tensor([0, 1, 2, 18, 19, 2])
                want, want_hit = hc.lookup(keys, count=False)
                out = torch.full((6, dim), 7.0, dtype=dtype)
                got, hit = hc.lookup(keys, out=out)
                assert got.data_ptr() == out.data_ptr()
                assert torch.equal(hit, want_hit) and torch.equal(out, want)
                assert hit.tolist() == [True, False, True, True, False, True]
                lookups = hc.stats().lookups
                for bad in (torch.empty(6, dim + 1, dtype=dtype),
                            torch.empty(5, dim, dtype=dtype),
                            torch.empty(6, dim, dtype=torch.int32),
                            torch.empty(dim, 6, dtype=dtype).t()):
                    with pytest.raises(BadArgumentError, match="out must be"):
                        hc.lookup(keys, out=bad)
                assert hc.stats().lookups == lookups
            finally:
                HostCache.unlink(name)


def test_a_large_lookup_read_by_several_threads_equals_small_ones(table_name: str) -> None:
    """A batch large enough to be split over threads (nvecache.common.fanout) returns what its
    pieces return one by one, and counts each hit once."""
    with HostCache.create(table_name, capacity=32768, dim=DIM) as hc:
        try:
            keys = torch.randperm(40000)[:16000]
            hc.insert(keys, rows_for(keys))
            probe = torch.cat([keys[:7000], torch.arange(40000, 43000), keys[:2000]])
            probe = probe[torch.randperm(probe.numel())]
            want = [hc.lookup(p, count=False) for p in probe.split(100)]
            before = hc.stats().hits
            got, hit = hc.lookup(probe)
            assert torch.equal(hit, torch.cat([h for _, h in want]))
            assert torch.equal(got, torch.cat([v for v, _ in want]))
            assert torch.equal(got[hit], rows_for(probe[hit]))
            assert hc.stats().hits - before == int(hit.sum()) > 8000
        finally:
            HostCache.unlink(table_name)
