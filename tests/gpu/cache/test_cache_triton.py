"""GPUCache's Triton kernels against the torch twin: under Triton's CPU interpreter here,
on CUDA where a GPU is present (tests marked ``gpu``)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from gpu.cache import twin
from gpu.cache.gpu_cache import GPUCache, MissCandidates
from gpu.cache.records import PreparedInsert
from gpu.errors import BadArgumentError
from gpu.kernels.tiles import DEFAULT_TILES, Tiles
from gpu.kernels.triton_access import triton_available
from hostcache.layout import EMPTY_KEY

needs_triton = pytest.mark.skipif(
    not triton_available(), reason="needs the triton package (`pip install triton`); "
    "its CPU interpreter runs the kernels on CPU tensors")
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")

Outputs = list[tuple[str, tuple[torch.Tensor, ...]]]

#: small blocks for the interpreter: the tests' small batches then span several programs
SMALL = Tiles(lookup_block_k=8, pooled_block_k=8, insert_block_k=8)


def make(device: str, backend: str, *, buckets: int = 6, ways: int = 4, dim: int = 12,
         dtype: torch.dtype = torch.float32, tiles: Tiles | None = None) -> GPUCache:
    slot = 8 + 4 + dim * torch.empty((), dtype=dtype).element_size()
    if tiles is None:
        tiles = SMALL if device == "cpu" else DEFAULT_TILES
    return GPUCache(buckets * ways * slot, dim, dtype, device, ways=ways,
                    backend=backend, tiles=tiles)  # type: ignore[arg-type]


def seen(cand: MissCandidates, keys: torch.Tensor, hit: torch.Tensor,
         num_rows: int) -> tuple[torch.Tensor, ...]:
    """What a lookup wrote into ``cand``, checked and in a backend-independent form: the
    miss count, and (when every miss fit) the missed positions in batch order."""
    buf, keys, hit = cand.buffer.cpu(), keys.cpu(), hit.cpu()
    count, cap = int(buf[0]), cand.cap
    pos, ck = buf[1 + cap:][:min(count, cap)], buf[1:1 + cap][:min(count, cap)]
    miss = ~hit & (keys >= 0) & (keys < num_rows)
    assert count == int(miss.sum())
    assert torch.equal(ck, keys[pos]) and bool(miss[pos].all())
    assert pos.unique().numel() == pos.numel()  # every occurrence at most once
    if count <= cap:
        return torch.tensor([count]), pos.sort().values
    return (torch.tensor([count]),)


def padded(table: torch.Tensor, pad: int) -> torch.Tensor:
    """``table``'s rows at a row stride of ``dim + pad`` elements (as a SharedMemBlock pads
    rows to 16 bytes), on its device; the padding holds NaN, so a kernel that steps by
    ``dim`` instead of the stride reads NaN where a row should be."""
    if pad == 0:
        return table
    wide = torch.full((table.shape[0], table.shape[1] + pad), float("nan"), dtype=table.dtype,
                      device=table.device)
    wide[:, :table.shape[1]] = table
    return wide[:, :table.shape[1]]


def run_ops(cache: GPUCache, seed: int, steps: int, key_range: int = 60,
            pad: int = 0) -> Outputs:
    """A seeded random op sequence; every result moved to the CPU. ``pad``: the linear
    table's rows are padded by that many elements."""
    gen = torch.Generator().manual_seed(seed)
    dev, dim, dtype = cache.device, cache.dim, cache.dtype
    table = padded(torch.randn(key_range, dim, generator=gen).to(dtype).to(dev), pad)
    out: Outputs = []
    for step in range(steps):
        n = int(torch.randint(0, 40, (1,), generator=gen))
        keys = torch.randint(0, key_range, (n,), generator=gen)
        vals = torch.randn(n, dim, generator=gen).to(dtype)
        cut = sorted(torch.randint(0, n + 1, (3,), generator=gen).tolist())
        offsets = torch.tensor([0, *cut, n])
        w = torch.rand(n, generator=gen)
        op = step % 7
        k, v, o = keys.to(dev), vals.to(dev), offsets.to(dev)
        if op in (0, 4):
            cache.insert(k, v)
            res: tuple[torch.Tensor, ...] = ()
        elif op == 1:
            res = cache.lookup(k)
        elif op == 2:
            res = cache.lookup_pooled(k, o, "sum", w.to(dev), miss_values=v)
        elif op == 3:
            cand = MissCandidates.empty(step % 5 + 2, dev)  # sometimes fewer than the misses
            res = cache.lookup_linear(k, table, candidates=cand)
            res = (*res, *seen(cand, k, res[1], key_range))
        elif op == 5:
            cand = MissCandidates.empty(40, dev)
            pooled, hit = cache.lookup_linear_pooled(k, o, table, "mean",
                                                     candidates=cand)
            res = (pooled, hit, *seen(cand, k, hit, key_range),
                   cache.update(k[: n // 2], v[: n // 2]))
        else:
            cache.erase(k[:3])
            res = (cache.probe(k),)
        out.append((["insert", "lookup", "pooled", "linear", "insert", "linpool", "erase"][op],
                    tuple(r.cpu() for r in res)))
    return out


def assert_same(a: GPUCache, b: GPUCache, out_a: Outputs, out_b: Outputs) -> None:
    for (op, ra), (_, rb) in zip(out_a, out_b, strict=True):
        for x, y in zip(ra, rb, strict=True):
            if op in ("pooled", "linpool") and x.is_floating_point():
                torch.testing.assert_close(x, y)  # summation order differs
            else:
                assert torch.equal(x, y), op  # gathers are bit-exact
    for x, y in zip(a.state(), b.state(), strict=True):
        assert torch.equal(x, y)
    assert a.stats() == b.stats()


@needs_triton
# NOTE: no shrink phase: the interpreter is slow, and a failing seed is printed anyway.
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(seed=st.integers(0, 2**20), ways=st.sampled_from([1, 4, 8]),
       dim=st.sampled_from([12, 16]))
def test_interpreter_matches_twin(seed: int, ways: int, dim: int) -> None:
    a = make("cpu", "torch", ways=ways, dim=dim)
    b = make("cpu", "triton", ways=ways, dim=dim)
    assert b.backend == "triton"
    assert_same(a, b, run_ops(a, seed, 14), run_ops(b, seed, 14))


@needs_triton
def test_interpreter_half_rows() -> None:
    a = make("cpu", "torch", dim=32, dtype=torch.float16)
    b = make("cpu", "triton", dim=32, dtype=torch.float16)
    assert_same(a, b, run_ops(a, 7, 14), run_ops(b, 7, 14))


@needs_triton
def test_page_order_visits_rows_from_the_rotation_on() -> None:
    from gpu.kernels.cache_lookup import page_order

    keys = torch.tensor([7, 2, 9, 0, 3, 2, 12, -4, 5])
    for rotate in (0, 3, 10 + 6):
        order = page_order(keys, 10, rotate)
        assert sorted(order.tolist()) == list(range(keys.numel()))  # every position once
        shifted = ((keys[order] - rotate) % 10).tolist()
        assert shifted == sorted(shifted)
    # in-range keys from row 3 on, wrapping around: 3, 5, 7, 9, 0, 2, 2
    inside = [k for k in keys[page_order(keys, 10, 3)].tolist() if 0 <= k < 10]
    assert inside == [3, 5, 7, 9, 0, 2, 2]


@needs_triton
@pytest.mark.parametrize("buckets", [0, 6])
def test_interpreter_page_ordered_linear_lookups(buckets: int) -> None:
    """Batches visited in host-page order: the same rows, hits, counters, stats and
    listed misses as the twin (and as batch order)."""
    a = make("cpu", "torch", buckets=buckets)
    b = make("cpu", "triton", buckets=buckets, tiles=replace(SMALL, linear_page_order=1))
    assert_same(a, b, run_ops(a, 3, 21), run_ops(b, 3, 21))
    # out-of-range and negative keys read as zero rows, never as another key's row
    table = torch.randn(10, 12)
    keys = torch.tensor([9, -1, 10, 3, 3, 0, 2**62])
    got, hit = b.lookup_linear(keys, table, validate=False)
    want, want_hit = a.lookup_linear(keys, table, validate=False)
    assert torch.equal(got, want) and torch.equal(hit, want_hit)
    assert torch.equal(got[[1, 2, 6]], torch.zeros(3, 12))
    # a table in GPU memory takes the fused launch whatever the batch size: same rows
    got_dev, hit_dev = b.lookup_linear(keys, table, validate=False, host_table=False)
    assert torch.equal(got_dev, want) and torch.equal(hit_dev, want_hit)


@needs_triton
@pytest.mark.parametrize(("dim", "dtype", "pad"), [(12, torch.float32, 4), (3, torch.float16, 5),
                                                   (1, torch.bfloat16, 7)])
def test_interpreter_reads_linear_tables_with_padded_rows(dim: int, dtype: torch.dtype,
                                                          pad: int) -> None:
    """A linear table whose rows are padded (a SharedMemBlock's, 16-byte rows) is read at
    its row stride: the same results and state as the twin over the unpadded table."""
    a = make("cpu", "torch", dim=dim, dtype=dtype)
    b = make("cpu", "triton", dim=dim, dtype=dtype)
    assert_same(a, b, run_ops(a, 7, 14), run_ops(b, 7, 14, pad=pad))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_listed_misses_carry_the_rows_read(dtype: torch.dtype) -> None:
    """Candidates with rows: each listed miss's row is the table row the lookup read, the
    same on the interpreter and the twin, for plain and pooled linear lookups, over two
    lookups appending to one buffer."""
    gen = torch.Generator().manual_seed(4)
    table = torch.randn(50, 12, generator=gen).to(dtype)
    keys = torch.randint(0, 50, (30,), generator=gen)
    offsets = torch.tensor([0, 7, 7, 30])
    for backend in ("torch", "triton"):
        cache = make("cpu", backend, dtype=dtype)
        cache.insert(torch.arange(0, 50, 3), table[::3])
        cand = MissCandidates.empty(40, "cpu", dim=12, dtype=dtype)
        _, hit = cache.lookup_linear(keys, table, candidates=cand)
        cache.lookup_linear_pooled(keys, offsets, table, candidates=cand)
        misses = int((~hit).sum())
        listed = min(int(cand.count), cand.cap)
        assert int(cand.count) == 2 * misses and listed == min(40, 2 * misses) > misses
        got = cand.keys[:listed]
        assert torch.isin(got, keys[~hit]).all()
        assert torch.equal(cand.rows[:listed], table[got])


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=needs_triton),
    pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
@pytest.mark.parametrize("dim", [12, 16])
def test_page_ordered_lookups_list_the_twins_misses_when_the_list_fills(
        device: str, dim: int) -> None:
    """A batch visited in host-page order lists its misses in batch order, as the twin
    does: with more misses than room, the same first keys, positions and rows, in the same
    order, over lookups appending to one buffer (not every miss of a window of rows)."""
    tiles = replace(SMALL if device == "cpu" else DEFAULT_TILES, linear_page_order=1)
    gen = torch.Generator().manual_seed(dim)
    table = torch.randn(300, dim, generator=gen)
    present = torch.arange(0, 300, 3)
    listed = []
    for backend in ("torch", "triton"):
        cache = make(device, backend if device == "cpu" else "auto", buckets=64, dim=dim,
                     tiles=tiles)
        dev = cache.device
        cache.insert(present.to(dev), table[present].to(dev))
        cand = MissCandidates.empty(90, dev, dim=dim)
        g = torch.Generator().manual_seed(1)
        for n in (70, 130):  # the second lookup overflows the list part way
            keys = torch.randint(-2, 302, (n,), generator=g)  # a few out of range
            cache.lookup_linear(keys.to(dev), table.to(dev), candidates=cand, validate=False)
        assert cand.rows is not None
        listed.append((cand.buffer.cpu(), cand.rows.cpu()))
    (buf_a, rows_a), (buf_b, rows_b) = listed
    assert int(buf_a[0]) > 90  # the list filled
    assert torch.equal(buf_a, buf_b) and torch.equal(rows_a, rows_b)
    assert torch.equal(rows_a, table[buf_a[1:91]])


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=needs_triton),
    pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_serve_lists_every_miss_and_its_position(device: str, backend: str) -> None:
    """``GPUCache.serve`` (a stack's lookup that lists its misses in a MissList, pinned
    host memory on CUDA) returns the rows ``lookup`` returns, counts like it, and lists
    exactly the missed keys with their batch positions: none when every key hit, a miss at
    the start, the middle or the end, repeated keys and the reserved empty marker (a key
    like any other here), batch after batch as the list's counter grows, and after the
    list grew."""
    from gpu.stacks.misses.miss_list import MissList

    a = make(device, backend if device == "cpu" else "auto", buckets=16)
    b = make(device, backend if device == "cpu" else "auto", buckets=16)
    g = torch.Generator().manual_seed(3)
    present = torch.arange(0, 60, 3)
    rows = torch.randn(20, 12, generator=g)
    for c in (a, b):
        c.insert(present.to(device), rows.to(device))
    present = present[a.probe(present.to(device), record=False).cpu() >= 0]
    assert present.numel() >= 10
    misses = MissList(torch.device(device))
    total = 0
    batches = [present, torch.cat([torch.tensor([1]), present[:5], torch.tensor([2, 4])]),
               present.flip(0)[:1], torch.tensor([61, 61, EMPTY_KEY, 7]),
               torch.randint(-50, 50, (3000,), generator=g),
               torch.arange(1000, 4000),  # every key a miss: the list full
               present[:3]]

    def serve(keys: torch.Tensor) -> tuple[bool, torch.Tensor, np.ndarray, np.ndarray]:
        """(served rows == looked-up rows, the twin's hit flags, listed keys, positions)"""
        misses.ensure(keys.numel())
        got = a.serve(keys, misses)
        want, want_hit = b.lookup(keys)
        if device == "cuda":
            torch.cuda.synchronize()
        return torch.equal(got.cpu(), want.cpu()), want_hit, *misses.take()

    for keys in batches:
        keys = keys.to(device)
        same, want_hit, listed_keys, listed_pos = serve(keys)
        assert same
        order = listed_pos.argsort()
        want_pos = (~want_hit).nonzero().squeeze(1).cpu()
        assert torch.equal(torch.from_numpy(listed_pos[order]), want_pos)
        assert torch.equal(torch.from_numpy(listed_keys[order]), keys.cpu()[want_pos])
        total += want_pos.numel()
    assert misses.cap == 3000 and misses.start == total > 5000
    # a lookup whose misses were never taken (its call raised before reading them): the
    # next lookup lists only its own
    misses.ensure(4)
    a.serve(torch.tensor([5, 6, 7, 8], device=device), misses)
    b.lookup(torch.tensor([5, 6, 7, 8], device=device))
    same, _, listed_keys, listed_pos = serve(torch.cat([present[:2], torch.tensor([62])])
                                             .to(device))
    assert same and listed_keys.tolist() == [62] and listed_pos.tolist() == [2]
    assert a.stats() == b.stats()


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=needs_triton),
    pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
@pytest.mark.parametrize("cap", [40, 200])
def test_a_stacks_linear_gather_lists_what_the_twin_lists(device: str, cap: int) -> None:
    """``gather_linear`` (a LinearUVM stack's lookup: a bound launch passing keys, size,
    output, miss list and its rows) returns the twin's rows and lists the twin's misses,
    each listed row the table's row of its key, whether the list fills or not."""
    got = []
    for backend in ("torch", "triton"):
        c = make(device, backend)
        g = torch.Generator().manual_seed(cap)
        table = torch.randn(500, 12, generator=g).to(device)
        c.insert(torch.arange(0, 100, 3, device=device), table[0:100:3])
        cand = MissCandidates.empty(cap, device, dim=12, dtype=torch.float32)
        keys = torch.randint(0, 500, (77,), generator=g).to(device)
        out = c.gather_linear(keys, table, candidates=cand, host_table=False, err=None)
        count = int(cand.buffer[0])
        m = min(count, cap)
        listed, pos = cand.buffer[1:1 + cap][:m], cand.buffer[1 + cap:][:m]
        assert cand.rows is not None
        assert torch.equal(cand.rows[:m], table[listed]) and torch.equal(keys[pos], listed)
        got.append((out.cpu(), count, sorted(pos.tolist()) if count <= cap else None))
    assert torch.equal(got[0][0], got[1][0]) and got[0][1:] == got[1][1:]
    assert got[0][1] > 40  # the small list filled


def test_candidate_rows_of_the_wrong_shape_are_refused() -> None:
    cache = make("cpu", "torch")
    table = torch.randn(50, 12)
    bad = MissCandidates.empty(8, "cpu", dim=11, dtype=torch.float32)
    with pytest.raises(BadArgumentError, match=r"rows must be \[cap, 12\]"):
        cache.lookup_linear(torch.arange(4), table, candidates=bad)
    assert cache.stats().misses == 0  # refused before anything was counted


@needs_triton
def test_interpreter_saturating_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(twin, "COUNTER_MAX", 5)
    a = make("cpu", "torch", buckets=1, ways=2)
    b = make("cpu", "triton", buckets=1, ways=2)
    for c in (a, b):
        c.insert(torch.tensor([1, 2]), torch.ones(2, 12))
        c.lookup(torch.tensor([1] * 9 + [2]))
        c.lookup_pooled(torch.tensor([2, 2, 1]), torch.tensor([0, 1, 3]))
    assert a.state()[1].tolist() == [5, 4]
    assert torch.equal(a.state()[1], b.state()[1])


@needs_triton
def test_interpreter_skips_saturated_counters_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counters that saturate (and buckets that decay) within a few ops: the kernels skip
    the atomics of saturated slots and end in the twin's state after every op."""
    monkeypatch.setattr(twin, "COUNTER_MAX", 3)
    monkeypatch.setattr(twin, "DECAY_AT", 3)
    a = make("cpu", "torch", buckets=2, ways=4)
    b = make("cpu", "triton", buckets=2, ways=4)
    assert_same(a, b, run_ops(a, 11, 21, key_range=12), run_ops(b, 11, 21, key_range=12))
    counters = b.state()[1]
    assert int(counters.max()) <= 3 and bool((counters == 3).any())  # some slot saturated


@needs_triton
def test_pooled_programs_take_fewer_keys_for_wide_rows() -> None:
    """A pooled program's [keys, row] tile stays within ``Tiles.pooled_max_tile`` elements
    (at least 16 keys), and a wide row's bags pool like torch's under that block."""
    from gpu.kernels.triton_access import kernel_module

    pooled = kernel_module("cache_pooled", interpret=True)
    assert [pooled.pooled_block_k(DEFAULT_TILES, bd) for bd in (16, 128, 256, 512, 4096)] \
        == [128, 128, 64, 32, 16]
    assert pooled.pooled_block_k(replace(DEFAULT_TILES, pooled_block_k=8), 4096) == 8
    with pytest.raises(BadArgumentError, match="pooled_max_tile"):
        Tiles(pooled_max_tile=1000)
    dim = 300  # NOTE: rows of 512 elements a tile: 32 keys a program, bags split in 4
    gen = torch.Generator().manual_seed(9)
    table = torch.randn(50, dim, generator=gen)
    keys = torch.randint(0, 50, (300,), generator=gen)
    offsets = torch.tensor([0, 130, 130, 300])
    assert pooled.pooled_split(300, 3, DEFAULT_TILES, 512) == 4
    cache = make("cpu", "triton", buckets=0, dim=dim, tiles=DEFAULT_TILES)
    got, _ = cache.lookup_linear_pooled(keys, offsets, table, "sum")
    want = torch.nn.functional.embedding_bag(keys, table, offsets, mode="sum",
                                             include_last_offset=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@needs_triton
@pytest.mark.parametrize("cache_buckets", [0, 6])
def test_interpreter_split_bags(cache_buckets: int) -> None:
    """Bags split over several programs (partial rows summed by a second launch) pool like
    the twin: sum, mean, weighted, miss rows, linear misses, an empty bag, a long bag."""
    from gpu.kernels.triton_access import kernel_module

    tiles = replace(SMALL, pooled_block_k=4, pooled_programs=64)
    assert kernel_module("cache_pooled", interpret=True).pooled_split(200, 5, tiles, 16) == 8
    gen = torch.Generator().manual_seed(3)
    a = make("cpu", "torch", buckets=cache_buckets)
    b = make("cpu", "triton", buckets=cache_buckets, tiles=tiles)
    table = torch.randn(60, 12, generator=gen)
    ins = torch.randint(0, 60, (40,), generator=gen)
    keys = torch.randint(0, 60, (200,), generator=gen)
    offsets = torch.tensor([0, 13, 13, 50, 71, 200])
    w = torch.rand(200, generator=gen)
    mv = torch.randn(200, 12, generator=gen)
    for c in (a, b):
        c.insert(ins, table[ins])
    for args, kw in [((offsets, "sum"), {}), ((offsets, "mean"), {}), ((offsets, "sum", w), {}),
                     ((offsets, "sum"), {"miss_values": mv})]:
        (pa, ha), (pb, hb) = a.lookup_pooled(keys, *args, **kw), b.lookup_pooled(keys, *args, **kw)
        torch.testing.assert_close(pa, pb)
        assert torch.equal(ha, hb)
    (pa, ha) = a.lookup_linear_pooled(keys, offsets, table, "mean")
    (pb, hb) = b.lookup_linear_pooled(keys, offsets, table, "mean")
    torch.testing.assert_close(pa, pb)
    assert torch.equal(ha, hb) and torch.equal(pb[1], torch.zeros(12))
    for x, y in zip(a.state(), b.state(), strict=True):
        assert torch.equal(x, y)
    assert a.stats() == b.stats()


@needs_triton
def test_interpreter_lazy_counter_clamp(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels add hits unsaturated; the cache clamps on read and before an int32
    overflow could happen: the state stays the twin's, stored counters stay in range."""
    import gpu.cache.gpu_cache as cache_mod

    monkeypatch.setattr(twin, "COUNTER_MAX", 5)
    monkeypatch.setattr(cache_mod, "_INT32_MAX", 12)  # 7 unclamped adds allowed
    a = make("cpu", "torch", buckets=2, ways=2)
    b = make("cpu", "triton", buckets=2, ways=2)
    for c in (a, b):
        c.insert(torch.tensor([1, 2, 3]), torch.ones(3, 12))
    for q in ([1] * 6, [1, 2] * 3, [3], [2] * 7, [1, 3, 3]):
        for c in (a, b):
            c.lookup(torch.tensor(q))
            c.lookup_pooled(torch.tensor(q), torch.tensor([0, len(q)]))
        assert int(b.tables.counters.max()) <= 12
        assert torch.equal(a.state()[1], b.state()[1])
    b.insert(torch.tensor([4, 5]), torch.ones(2, 12))
    a.insert(torch.tensor([4, 5]), torch.ones(2, 12))
    for x, y in zip(a.state(), b.state(), strict=True):
        assert torch.equal(x, y)


@needs_triton
def test_interpreter_disabled_cache() -> None:
    b = make("cpu", "triton", buckets=0)
    table = torch.randn(10, 12)
    got, hit = b.lookup_linear(torch.tensor([3, 9]), table)
    assert not hit.any() and torch.equal(got, table[[3, 9]])
    assert b.lookup(torch.tensor([3]))[1].tolist() == [False]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_cuda_matches_cpu_twin(backend: str) -> None:
    for ways, dim, dtype in [(8, 128, torch.float32), (4, 12, torch.float32),
                             (8, 64, torch.bfloat16)]:
        a = make("cpu", "torch", ways=ways, dim=dim, dtype=dtype)
        b = make("cuda", backend, ways=ways, dim=dim, dtype=dtype)
        assert_same(a, b, run_ops(a, 11, 40), run_ops(b, 11, 40))


@pytest.mark.gpu
@needs_cuda
def test_cuda_reads_linear_tables_with_padded_rows() -> None:
    for dim, dtype, pad in [(12, torch.float32, 4), (3, torch.float16, 5), (7, torch.bfloat16, 1),
                            (130, torch.float32, 2)]:
        a = make("cpu", "torch", dim=dim, dtype=dtype)
        b = make("cuda", "auto", dim=dim, dtype=dtype)
        assert_same(a, b, run_ops(a, 17, 42), run_ops(b, 17, 42, pad=pad))


@pytest.mark.gpu
@needs_cuda
def test_cuda_page_ordered_linear_lookups_match_cpu_twin() -> None:
    for buckets, dim in [(6, 128), (0, 12)]:
        a = make("cpu", "torch", buckets=buckets, dim=dim)
        b = make("cuda", "auto", buckets=buckets, dim=dim,
                 tiles=replace(DEFAULT_TILES, linear_page_order=1))
        assert_same(a, b, run_ops(a, 13, 42), run_ops(b, 13, 42))


@pytest.mark.gpu
@needs_cuda
def test_cuda_large_batch_matches_cpu_twin() -> None:
    gen = torch.Generator().manual_seed(5)
    a = make("cpu", "torch", buckets=4096, ways=8, dim=128)
    b = make("cuda", "auto", buckets=4096, ways=8, dim=128)
    keys = torch.randint(0, 60_000, (50_000,), generator=gen)
    vals = torch.randn(50_000, 128, generator=gen)
    q = torch.randint(0, 60_000, (200_000,), generator=gen)
    offsets = torch.arange(0, 200_001, 1000)
    for c in (a, b):
        c.insert(keys.to(c.device), vals.to(c.device))
    ra, ha = a.lookup(q)
    rb, hb = b.lookup(q.cuda())
    assert torch.equal(ha, hb.cpu()) and torch.equal(ra, rb.cpu())
    pa, _ = a.lookup_pooled(q, offsets)
    pb, _ = b.lookup_pooled(q.cuda(), offsets.cuda())
    torch.testing.assert_close(pa, pb.cpu(), rtol=1e-5, atol=1e-4)
    for x, y in zip(a.state(), b.state(), strict=True):
        assert torch.equal(x, y)


@needs_triton
@pytest.mark.parametrize("ways", [1, 4, 8])
def test_interpreter_insert_decays_and_evicts_like_the_twin(
        monkeypatch: pytest.MonkeyPatch, ways: int) -> None:
    """Inserts into hot, full buckets (counters past the decay threshold) and batches with
    duplicates and keys already present: the Triton insert's placements are the twin's."""
    decay_at = 16
    monkeypatch.setattr(twin, "COUNTER_MAX", decay_at)
    monkeypatch.setattr(twin, "DECAY_AT", decay_at)
    a = make("cpu", "torch", ways=ways, dim=12, buckets=3)
    b = make("cpu", "triton", ways=ways, dim=12, buckets=3)
    gen = torch.Generator().manual_seed(ways)
    halved = False
    for step in range(12):
        keys = torch.randint(-30, 30, (int(torch.randint(1, 40, (1,), generator=gen)),),
                             generator=gen)
        vals = torch.randn(keys.numel(), 12, generator=gen)
        for c in (a, b):
            c.insert(keys, vals)
            if step % 3 == 2:  # make every resident hot: the next insert halves its bucket
                resident = c.state()[0]
                c.lookup(resident[resident != EMPTY_KEY].repeat(decay_at))
        for x, y in zip(a.state(), b.state(), strict=True):
            assert torch.equal(x, y), step
        counters = a.state()[1]
        halved |= bool(((counters >= decay_at // 2) & (counters < decay_at)).any())
    assert halved, "no bucket was decayed: the test lost its point"
    assert a.stats() == b.stats() and a.stats().evictions > 0


@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=needs_triton),
    pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
def test_an_insert_prepared_before_the_table_changed_places_as_one_made_after(
        device: str, small: bool) -> None:
    """An insert's sorts (``sort_insert_keys``, ``sort_insert_buckets``) read nothing of the
    table: writes, erases and lookups between them and ``apply_insert`` leave the
    placements those of an insert made after them; the keys were copied (their source may
    change meanwhile). ``small`` keys (row indices, and the empty marker as padding) sort
    as int32 to the same order."""
    twin_cache = make("cpu", "torch", buckets=3, ways=4)
    cache = make(device, "triton" if device == "cpu" else "auto", buckets=3, ways=4)
    gen = torch.Generator().manual_seed(11)
    for step in range(6):
        size = int(torch.randint(1, 30, (1,), generator=gen))
        if small:
            batch = torch.randint(0, 40, (size,), generator=gen)
            batch[torch.rand(size, generator=gen) < 0.2] = EMPTY_KEY  # a log's padding
        else:
            batch = torch.randint(-20, 20, (size,), generator=gen)
        rows = torch.randn(size, 12, generator=gen)
        source = batch.to(device, copy=True)
        prepared = PreparedInsert.empty(size, cache.device)
        cache.sort_insert_keys(source, prepared, small=small)
        source.fill_(7)  # NOTE: the log a round sorted, appended to meanwhile
        cache.sort_insert_buckets(prepared)
        other = torch.randint(-20, 20, (12,), generator=gen)
        other_rows = torch.randn(12, 12, generator=gen)
        for c in (twin_cache, cache):  # the table changes between the halves
            c.insert(other.to(c.device), other_rows.to(c.device))
            c.erase(other[:3].to(c.device))
            c.lookup(other.to(c.device))
        twin_cache.insert(batch, rows, validate=False)
        cache.apply_insert(prepared, rows.to(device))
        for x, y in zip(twin_cache.state(), cache.state(), strict=True):
            assert torch.equal(x, y.cpu()), step
    assert twin_cache.stats() == cache.stats() and cache.stats().evictions > 0
