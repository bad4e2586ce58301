"""The host cache's numpy twin (hostcache.table_twin) against its compiled loops
(hostcache.table_loops): the same results and the same writes for random tables and
batches (repeated keys, absent keys, slots mid-write, empty batches), and the twin's
seqlock read never returning a torn or displaced row while another process writes."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hostcache import HostCache, table_loops, table_twin
from hostcache.layout import EMPTY_KEY
from tests.conftest import fresh_name
from tests.hostcache.twin_workers import DIM, arrays_of, row_of, write_rounds


class Table:
    """A host cache's arrays (as the compiled loops see them) with random contents:
    some slots empty, versions even or odd, counters with ties."""

    def __init__(self, rng: np.random.Generator, num_buckets: int, ways: int,
                 row_stride: int) -> None:
        slots = num_buckets * ways
        self.num_buckets = num_buckets
        self.tkeys = np.where(rng.random(slots) < 0.3, EMPTY_KEY,
                              rng.permutation(4 * slots)[:slots]).astype(np.int64)
        self.tkeys2 = self.tkeys.reshape(num_buckets, ways)
        self.versions = 2 * rng.integers(0, 4, slots) + (rng.random(slots) < 0.2)
        self.raw = rng.integers(0, 256, (slots, row_stride)).astype(np.uint8)
        self.policy = rng.integers(0, 6, slots).astype(np.int32)
        self.policy2 = self.policy.reshape(num_buckets, ways)

    def copy(self) -> Table:
        twin = object.__new__(Table)
        twin.num_buckets = self.num_buckets
        twin.tkeys, twin.versions = self.tkeys.copy(), self.versions.copy()
        twin.raw, twin.policy = self.raw.copy(), self.policy.copy()
        twin.tkeys2 = twin.tkeys.reshape(self.tkeys2.shape)
        twin.policy2 = twin.policy.reshape(self.policy2.shape)
        return twin

    def arrays(self) -> list[np.ndarray]:
        return [self.tkeys, self.versions, self.raw, self.policy]


def batch(rng: np.random.Generator, table: Table, n: int) -> np.ndarray:
    """``n`` keys: cached ones, absent ones and repeats of both."""
    cached = table.tkeys[table.tkeys != EMPTY_KEY]
    pool = np.concatenate([cached, rng.integers(-(2**40), 2**40, max(1, n // 2))])
    return rng.choice(pool, n).astype(np.int64) if n else np.empty(0, np.int64)


def assert_same(a: object, b: object) -> None:
    if isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    else:
        assert a == b


tables = st.tuples(st.integers(0, 2**32 - 1), st.integers(1, 6), st.sampled_from([4, 8, 16]),
                   st.integers(0, 40))


@settings(max_examples=120, deadline=None)
@given(tables, st.booleans())
def test_the_lookup_reads_what_the_compiled_one_reads(case: tuple[int, int, int, int],
                                                       count: bool) -> None:
    seed, num_buckets, ways, n = case
    rng = np.random.default_rng(seed)
    want = Table(rng, num_buckets, ways, 24)
    got = want.copy()
    keys = batch(rng, want, n)
    # NOTE: the keys the seqlock window reads (``tkeys``) differ from the probe's (``tkeys2``)
    # in some slots, as when a writer moved keys between the probe and the window
    moved = rng.random(want.tkeys.size) < 0.2
    window = np.where(moved, rng.permutation(want.tkeys), want.tkeys)
    results = []
    for t, loops in ((want, table_loops), (got, table_twin)):
        out = np.full((n, 20), 7, np.uint8)  # NOTE: the first 20 of 24 bytes, as a table does
        hit = np.zeros(n, np.bool_)
        hits = loops.lookup(window, t.tkeys2, t.versions, t.raw, t.policy, num_buckets,
                            keys, out, hit, count)
        results.append((hits, out, hit))
    assert_same(results[0], results[1])
    for a, b in zip(want.arrays(), got.arrays(), strict=True):  # counters bumped alike
        np.testing.assert_array_equal(a, b)


@settings(max_examples=120, deadline=None)
@given(tables)
def test_probes_hashes_and_dedup_match(case: tuple[int, int, int, int]) -> None:
    seed, num_buckets, ways, n = case
    rng = np.random.default_rng(seed)
    t = Table(rng, num_buckets, ways, 8)
    keys = batch(rng, t, n)
    assert_same(table_loops.buckets(keys, num_buckets), table_twin.buckets(keys, num_buckets))
    assert_same(table_loops.dedup_last(keys), table_twin.dedup_last(keys))
    bucket = table_loops.buckets(keys, num_buckets)
    found = []
    for loops in (table_loops, table_twin):
        slot, hit = np.full(n, -5, np.int64), np.zeros(n, np.bool_)
        loops.find(t.tkeys2, keys, bucket, slot, hit)
        found.append((slot, hit))
    assert_same(found[0], found[1])


@settings(max_examples=150, deadline=None)
@given(tables, st.data())
def test_placement_and_writes_match(case: tuple[int, int, int, int],
                                    data: st.DataObject) -> None:
    seed, num_buckets, ways, n = case
    rng = np.random.default_rng(seed)
    want = Table(rng, num_buckets, ways, 16)
    got = want.copy()
    keys = np.unique(rng.integers(10**6, 10**9, n)).astype(np.int64)  # absent, distinct
    rng.shuffle(keys)
    src = rng.permutation(keys.size).astype(np.int64)
    bucket = table_loops.buckets(keys, num_buckets)
    slots = num_buckets * ways
    protected = np.sort(rng.choice(slots, data.draw(st.integers(0, slots // 2)),
                                   replace=False)).astype(np.int64)
    rows = rng.integers(0, 256, (keys.size, 12)).astype(np.uint8)
    plans = []
    for t, loops in ((want, table_loops), (got, table_twin)):
        plan = loops.plan_new(t.tkeys2, t.policy2, keys, src, bucket, protected)
        plans.append(plan)
        slot, pkeys, psrc, pol, touched, _ = plan
        loops.bump_versions(t.versions, slot)
        loops.write_slots(t.tkeys, t.raw, t.policy, slot, pkeys, rows, psrc, pol, True, True)
        loops.bump_versions(t.versions, slot)
        loops.decay(t.policy2, touched, 3)
        found = slot[: slot.size // 2]
        loops.add_policy(t.policy, np.concatenate([found, found]),
                         np.ones(2 * found.size, np.bool_), 5)
        loops.bump_versions(t.versions, np.concatenate([found, found]))  # a repeated slot
        loops.write_slots(t.tkeys, t.raw, t.policy, found, pkeys[: found.size], rows,
                          psrc[: found.size], pol[: found.size], False, False)
    assert_same(plans[0], plans[1])
    for a, b in zip(want.arrays(), got.arrays(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_an_empty_batch_is_empty_in_both() -> None:
    t = Table(np.random.default_rng(1), 3, 8, 8)
    none = np.empty(0, np.int64)
    for loops in (table_loops, table_twin):
        out, hit = np.empty((0, 8), np.uint8), np.empty(0, np.bool_)
        assert loops.lookup(t.tkeys, t.tkeys2, t.versions, t.raw, t.policy, 3, none, out,
                            hit, True) == 0
        assert [a.size for a in loops.dedup_last(none)] == [0, 0, 0]
        plan = loops.plan_new(t.tkeys2, t.policy2, none, none, none, none)
        assert [a.size for a in plan[:5]] == [0] * 5 and plan[5] == 0


@pytest.mark.slow
@pytest.mark.parametrize("writer", ["compiled", "twin"])
def test_the_twin_reads_no_torn_or_moved_row_while_another_process_writes(
        writer: str) -> None:
    """A writer process updates, erases and re-inserts keys whose rows encode the key and
    the write; every hit the twin's lookup returns is one whole row of its own key."""
    name = fresh_name("twin-")
    keys = torch.arange(64, dtype=torch.int64)
    ctx = mp.get_context("spawn")
    with HostCache.create(name, capacity=128, dim=DIM, ways=8) as hc:
        try:
            hc.insert(keys, row_of(keys, 0))
            stop, writes = ctx.Event(), ctx.Value("q", 0)
            proc = ctx.Process(target=write_rounds, args=(name, writer, stop, writes))
            proc.start()
            try:
                kn = keys.numpy()
                t = arrays_of(hc)
                out = np.empty((keys.numel(), DIM * 4), np.uint8)
                hit = np.empty(keys.numel(), np.bool_)
                hits = reads = 0
                while reads < 2000 or writes.value < 300:
                    if not proc.is_alive():
                        break
                    table_twin.lookup(t.keys, t.bucket_keys, t.versions, t.raw, t.policy,
                                      hc.geometry.num_buckets, kn, out, hit, False)
                    rows = out.view(np.float32)[hit]
                    assert (rows == rows[:, :1]).all(), "a torn row"
                    assert (rows[:, 0] // 100_000 == kn[hit]).all(), "another key's row"
                    hits += int(hit.sum())
                    reads += 1
            finally:
                stop.set()
                proc.join(60)
            assert proc.exitcode == 0
            assert writes.value >= 300 and hits > 0
        finally:
            HostCache.unlink(name)
