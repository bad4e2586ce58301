"""A GPULayer's bound pooled lookups (``gpu.kernels.cache_pooled.BoundPooled``) against
the unbound pooled kernel over a cacheless ``GPUCache`` (bit for bit: the same kernel,
the same order of sums) and against torch's ``embedding_bag`` over the decoded rows: plain
and quantized tables, odd and power-of-two dims, sum, mean and weighted bags, empty bags,
bags split over several programs, and keys outside the table (zero rows; reported in the
flag only when the call checks). Interpreted on the CPU, compiled on CUDA."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from gpu.cache.gpu_cache import GPUCache
from gpu.cache.records import MissCandidates
from gpu.kernels.tiles import DEFAULT_TILES
from gpu.kernels.triton_access import kernel_module
from nvecache.common import quant
from nvecache.common.rows import RowFormat

pytest.importorskip("triton")

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                        reason="needs a CUDA GPU")])]
ROWS = 50
#: one program per bag, or bags split over 4 programs (a second launch sums the parts)
TILES = {"whole": dataclasses.replace(DEFAULT_TILES, pooled_block_k=16, pooled_programs=1),
         "split": dataclasses.replace(DEFAULT_TILES, pooled_block_k=16, pooled_programs=16,
                                      pooled_max_split=4)}


def _table(fmt: RowFormat | None, dim: int, dtype: torch.dtype, device: str,
           gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(the table as the kernels read it, its rows as a lookup returns them)."""
    rows = torch.randn(ROWS, dim, generator=gen)
    if fmt is None:
        return rows.to(dtype).to(device), rows.to(dtype)
    stored = quant.encode(rows, fmt)
    return stored.to(device), quant.decode(stored, fmt, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiles", sorted(TILES))
@pytest.mark.parametrize("fmt_name,dim,dtype", [
    (None, 13, torch.float32), (None, 32, torch.float16), ("int8", 13, torch.float16),
    ("int8", 32, torch.float32), ("float8_e4m3fn", 17, torch.bfloat16)])
def test_bound_pooled_equals_the_unbound_kernel_and_torch(
        device: str, tiles: str, fmt_name: str | None, dim: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(dim)
    fmt = RowFormat(fmt_name, dim) if fmt_name else None
    table, decoded = _table(fmt, dim, dtype, device, gen)
    err = torch.zeros(1, dtype=torch.int64, device=device)
    t = TILES[tiles]
    bound = kernel_module("cache_pooled", interpret=device == "cpu").BoundPooled(
        table, err, dim=dim, dtype=dtype, tiles=t, fmt=fmt, device=torch.device(device))
    cacheless = GPUCache(0, dim, dtype, device, backend="triton", tiles=t)
    lengths = [0, 40, 1, 0, 70, 7]  # NOTE: empty bags; long ones split over programs
    n = sum(lengths)
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    keys = torch.randint(0, ROWS, (n,), generator=gen)
    module = kernel_module("cache_pooled", interpret=device == "cpu")
    assert module.pooled_split(n, len(lengths), t, module._block_d(dim)) == \
        (2 if tiles == "split" else 1)
    psw = torch.rand(n, generator=gen).to(dtype)
    for mode, w in (("sum", None), ("mean", None), ("sum", psw)):
        args = (keys.to(device), offsets.to(device), None if w is None else w.to(device))
        got = bound(*args, mode == "mean", True)
        old = cacheless.lookup_linear_pooled(args[0], args[1], table, mode, args[2],
                                             validate=False, err=err, table_format=fmt)[0]
        assert got.dtype == dtype and got.shape == (len(lengths), dim)
        assert torch.equal(got.cpu(), old.cpu()), (mode, w is not None)
        want = F.embedding_bag(keys, decoded.float(), offsets[:-1], mode=mode,
                               per_sample_weights=None if w is None else w.float())
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.cpu().float(), want, atol=tol, rtol=tol)
    assert int(err) == 0
    # keys outside the table: zero rows; in the flag when the call checks, else not
    bad = keys.clone()
    bad[[3, 50]] = torch.tensor([-1, ROWS])
    clean = bad.clamp(0, ROWS - 1)
    want = F.embedding_bag(clean, decoded.float(), offsets[:-1], mode="sum",
                           per_sample_weights=(bad == clean).float())
    for check in (False, True):
        got = bound(bad.to(device), offsets.to(device), None, False, check)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.cpu().float(), want, atol=tol, rtol=tol)
        assert int(err) in ((-1, ROWS) if check else (0,)), (check, int(err))
    # no bags: an empty output, nothing launched
    assert bound(keys[:0].to(device), offsets[:1].to(device), None, False, True).shape == (0, dim)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiles", sorted(TILES))
def test_unchecked_offsets_read_no_key_outside_the_batch(device: str, tiles: str) -> None:
    """Offsets a caller did not check (validate=False on CUDA): a bag past the keys' end
    is cut there, a negative bound taken as 0, a bag that ends before it starts is empty;
    the mean divides by what was read. Bit for bit the unbound kernel's, equal to torch
    over the clamped bags."""
    gen = torch.Generator().manual_seed(3)
    dim, t = 16, TILES[tiles]
    table = torch.randn(ROWS, dim, generator=gen)
    err = torch.zeros(1, dtype=torch.int64, device=device)
    bound = kernel_module("cache_pooled", interpret=device == "cpu").BoundPooled(
        table.to(device), err, dim=dim, dtype=torch.float32, tiles=t, fmt=None,
        device=torch.device(device))
    cacheless = GPUCache(0, dim, torch.float32, device, backend="triton", tiles=t)
    n = 60
    keys = torch.randint(0, ROWS, (n,), generator=gen)
    offsets = torch.tensor([-5, 20, 10, 45, n + 1000])  # NOTE: the last bag ends far past n
    clamped = [(0, 20), (10, 10), (10, 45), (45, n)]
    for mode in ("sum", "mean"):
        got = bound(keys.to(device), offsets.to(device), None, mode == "mean", True)
        old = cacheless.lookup_linear_pooled(keys.to(device), offsets.to(device),
                                             table.to(device), mode, validate=False,
                                             err=err)[0]
        assert torch.equal(got.cpu(), old.cpu())
        want = torch.stack([getattr(table[keys[a:b]], mode)(0) if b > a
                            else torch.zeros(dim) for a, b in clamped])
        torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    assert int(err) == 0


def _pairs(cand: MissCandidates) -> list[tuple[int, int]]:
    """The listed misses as sorted (key, batch position) pairs (the kernel's order of
    blocks may differ between two launches on a GPU)."""
    count = min(int(cand.buffer[0]), cand.cap)
    keys, pos = cand.buffer[1:1 + count].tolist(), cand.buffer[1 + cand.cap:][:count].tolist()
    return sorted(zip(keys, pos, strict=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiles", sorted(TILES))
@pytest.mark.parametrize("fmt_name,dtype", [(None, torch.float32), ("int8", torch.float16)])
def test_a_cached_bound_pooled_lookup_equals_the_unbound_one(
        device: str, tiles: str, fmt_name: str | None, dtype: torch.dtype) -> None:
    """A LinearUVM's pooled lookups (``GPUCache.pool_linear``: the pooled kernel bound to
    the table, the key flag and the cache's tables) against ``lookup_linear_pooled`` on a
    cache in the same state: the same pooled rows bit for bit, the same misses listed with
    the same rows, the same counters bumped and hits counted; and the torch twin's."""
    gen = torch.Generator().manual_seed(11)
    dim, t = 24, TILES[tiles]
    fmt = RowFormat(fmt_name, dim) if fmt_name else None
    table, decoded = _table(fmt, dim, dtype, device, gen)
    err = torch.zeros(1, dtype=torch.int64, device=device)
    slots = 64 * dim * dtype.itemsize  # NOTE: 64 rows' bytes: room for the third cached
    caches = {name: GPUCache(slots, dim, dtype, device, ways=4, backend=backend, tiles=t)
              for name, backend in (("bound", "triton"), ("unbound", "triton"),
                                    ("twin", "torch"))}
    for cache in caches.values():  # NOTE: about a third of the rows hit
        cache.insert(torch.arange(0, ROWS, 3).to(device), decoded[::3].to(device))
    cached = caches["bound"].state()[0]
    assert all(torch.equal(cached, c.state()[0]) for c in caches.values())
    assert int((cached >= 0).sum()) > 10
    lengths = [33, 0, 5, 40, 1]
    n = sum(lengths)
    offsets = torch.tensor([0, *lengths]).cumsum(0).to(device)
    keys = torch.randint(0, ROWS, (n,), generator=gen).to(device)
    psw = torch.rand(n, generator=gen).to(dtype).to(device)
    for mode, w, cap in (("sum", None, 2 * n), ("mean", None, 7), ("sum", psw, 2 * n)):
        cands = {name: MissCandidates.empty(cap, device, dim=dim, dtype=dtype)
                 for name in caches}
        got = caches["bound"].pool_linear(keys, offsets, table, mode == "mean", w,
                                          candidates=cands["bound"], err=err, check=True,
                                          table_format=fmt)
        old = caches["unbound"].lookup_linear_pooled(
            keys, offsets, table, mode, w, validate=False, candidates=cands["unbound"],
            err=err, table_format=fmt)[0]
        twin = caches["twin"].pool_linear(keys, offsets, table, mode == "mean", w,
                                          candidates=cands["twin"], err=err, check=True,
                                          table_format=fmt)
        assert got.dtype == dtype and torch.equal(got.cpu(), old.cpu()), mode
        torch.testing.assert_close(twin.cpu(), got.cpu(), atol=1e-5, rtol=1e-3)
        is_miss = ~torch.isin(keys.cpu(), cached)
        misses = int(is_miss.sum())
        assert int(cands["bound"].buffer[0]) == int(cands["unbound"].buffer[0]) == misses
        missed = sorted(zip(keys.cpu()[is_miss].tolist(),
                            is_miss.nonzero().squeeze(1).tolist(), strict=True))
        if cap < misses:  # NOTE: which misses fill the buffer is the blocks' order on a GPU
            for c in (cands["bound"], cands["unbound"]):
                listed = _pairs(c)
                assert len(listed) == cap and set(listed) <= set(missed)
        else:
            assert _pairs(cands["bound"]) == _pairs(cands["unbound"]) == missed
        if cap == 2 * n:  # NOTE: every miss listed: each with the row it read
            assert _pairs(cands["bound"]) == _pairs(cands["twin"])
            for c in cands.values():
                listed = c.buffer[1:1 + misses].cpu()
                assert c.rows is not None
                assert torch.equal(c.rows[:misses].cpu().float(), decoded[listed].float())
    stats = {name: cache.stats() for name, cache in caches.items()}
    assert stats["bound"].hits == stats["unbound"].hits == stats["twin"].hits > 0
    assert stats["bound"].misses == stats["unbound"].misses
    counters = {name: cache.state()[1].cpu() for name, cache in caches.items()}
    assert torch.equal(counters["bound"], counters["unbound"])
    assert torch.equal(counters["bound"], counters["twin"])
    assert int(err) == 0
    if device == "cuda":  # NOTE: a variant's later calls launch directly, not by the JIT
        cand = MissCandidates.empty(2 * n, device, dim=dim, dtype=dtype)
        for _ in range(2):
            caches["bound"].pool_linear(keys, offsets, table, False, None, candidates=cand,
                                        err=err, check=True, table_format=fmt)
        bound = [b for b in caches["bound"].ops.bound.values() if hasattr(b, "_launches")]
        assert len(bound) == 1
        assert max(main.variants for main, _ in bound[0]._launches.values()) > 0
