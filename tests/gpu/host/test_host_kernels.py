"""Tests of gpu.kernels.host_reads: the CPU twin, the Triton kernels under the interpreter, CUDA."""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu.cuda.registration import RegistrationClosedError, register
from gpu.errors import BadArgumentError
from gpu.kernels import host_reads as hk
from gpu.kernels.tiles import DEFAULT_TILES
from gpu.kernels.triton_access import kernel_module
from hostcache import HostCache, SharedMemBlock, hashing

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except Exception:  # noqa: BLE001
    HAVE_TRITON = False

needs_triton = pytest.mark.skipif(
    not HAVE_TRITON, reason="needs the triton package (`pip install triton`) for its interpreter"
)
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (torch.cuda.is_available() is False), cuda-python and triton",
)


def _filled_cache(name: str, *, n: int, capacity: int, dim: int, dtype=torch.float32, ways=8):
    hc = HostCache.create(name, capacity=capacity, dim=dim, dtype=dtype, ways=ways)
    keys = torch.randperm(4 * n)[:n] - n  # negative and positive keys
    hc.insert(keys, torch.randn(n, dim).to(dtype))
    return hc, keys


def _queries(keys: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    present = keys[torch.randint(0, keys.numel(), (n,), generator=gen)]
    absent = torch.randint(10**9, 2 * 10**9, (n // 3,), generator=gen)
    q = torch.cat([present, present[: n // 4], absent])  # duplicates and misses
    return q[torch.randperm(q.numel(), generator=gen)]


# -- CPU twin and argument checks ---------------------------------------------------------


def test_cpu_twin_is_the_tables_lookup(table_name: str) -> None:
    hc, keys = _filled_cache(table_name, n=300, capacity=512, dim=7)
    try:
        with register(hc, device="cpu") as reg:
            q = _queries(keys, 200, torch.Generator().manual_seed(1))
            values, hit = hk.hostcache_lookup(reg, q)
            want_v, want_h = hc.lookup(q)
            assert torch.equal(hit, want_h) and torch.equal(values, want_v)
            assert 0 < int(hit.sum()) < q.numel()
            tv, th = hk.hostcache_lookup(reg, q, backend="torch")  # the probe in torch ops
            assert torch.equal(th, want_h) and torch.equal(tv, want_v)
    finally:
        hc.close()
        HostCache.unlink(table_name)


def test_bad_arguments(table_name: str) -> None:
    hc, _ = _filled_cache(table_name, n=10, capacity=64, dim=4)
    try:
        reg = register(hc, device="cpu")
        for bad, match in [
            (torch.arange(4, dtype=torch.int32), "int64"),
            (torch.arange(4).view(2, 2), "1-D"),
            ([1, 2], "torch.Tensor"),
        ]:
            with pytest.raises(BadArgumentError, match=match):
                hk.hostcache_lookup(reg, bad)  # type: ignore[arg-type]
        with pytest.raises(BadArgumentError, match="backend"):
            hk.hostcache_lookup(reg, torch.arange(3), backend="cuda")  # type: ignore[arg-type]
        with pytest.raises(BadArgumentError, match="HostRegistration"):
            hk.hostcache_lookup(hc, torch.arange(3))
        if torch.cuda.is_available():
            with pytest.raises(BadArgumentError, match="registered for cpu"):
                hk.hostcache_lookup(reg, torch.arange(3, device="cuda"))
        reg.close()
        with pytest.raises(RegistrationClosedError):
            hk.hostcache_lookup(reg, torch.arange(3))
    finally:
        hc.close()
        HostCache.unlink(table_name)


def test_a_registered_block_is_no_host_cache(table_name: str) -> None:
    mb = SharedMemBlock.create(table_name, num_rows=50, dim=3, dtype=torch.bfloat16)
    try:
        with register(mb, device="cpu") as reg:
            with pytest.raises(BadArgumentError, match="is not a HostCache"):
                hk.hostcache_lookup(reg, torch.tensor([3, 49]))
    finally:
        mb.close()
        SharedMemBlock.unlink(table_name)


def _gather_block(reg, idx: torch.Tensor, *, page_order: bool, err=None) -> torch.Tensor:
    """Rows ``idx`` of a registered SharedMemBlock read as a GPULayer reads them (the gather
    kernel over the registered rows, in batch or in host-page order)."""
    gather = kernel_module("gather", interpret=reg.device.type != "cuda").gather
    tiles = replace(DEFAULT_TILES, linear_page_order=1 if page_order else 0)
    return gather(idx, reg.rows(), err, host_table=True, tiles=tiles)


# -- the Triton kernels under the interpreter ---------------------------------------------


@needs_triton
def test_bucket_kernel_matches_hashing() -> None:
    k = kernel_module("host_tier", interpret=True)
    keys = torch.cat([
        torch.randint(-(2**62), 2**62, (500,)),
        torch.tensor([0, 1, -1, 2**63 - 1, -(2**63) + 1, -(2**63)]),
    ])
    for nb in (1, 7, 1000, 2**31 + 11):
        out = torch.empty_like(keys)
        k.bucket_kernel[(1,)](keys, out, keys.numel(), nb, BLOCK=1024)
        assert torch.equal(out, hashing.bucket_of(keys, nb))


@needs_triton
@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    dim=st.sampled_from([1, 5, 32]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    ways=st.sampled_from([4, 8]),
    dedup=st.booleans(),
    sort=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_interpreted_kernel_equals_cpu_lookup(
    table_name: str, dim: int, dtype: torch.dtype, ways: int, dedup: bool, sort: bool, seed: int
) -> None:
    torch.manual_seed(seed)
    hc, keys = _filled_cache(table_name, n=150, capacity=160, dim=dim, dtype=dtype, ways=ways)
    try:
        hc.erase(keys[:10])  # erased slots: EMPTY_KEY with an even version
        with register(hc, device="cpu") as reg:
            q = _queries(keys, 120, torch.Generator().manual_seed(seed))
            values, hit = hk.hostcache_lookup(reg, q, backend="triton", dedup=dedup, sort=sort)
            want_v, want_h = hc.lookup(q)
            assert torch.equal(hit, want_h)
            assert torch.equal(values.view(torch.uint8), want_v.view(torch.uint8))  # bit-exact
    finally:
        hc.close()
        HostCache.unlink(table_name)


@needs_triton
def test_odd_version_is_a_miss(table_name: str) -> None:
    hc, keys = _filled_cache(table_name, n=40, capacity=1024, dim=4)
    try:
        assert bool(hc.lookup(keys)[1].all())
        with register(hc, device="cpu") as reg:
            victim = int(keys[5])
            slot = int((reg.keys() == victim).nonzero().item())
            reg.versions()[slot] += 1  # a writer is inside this slot
            values, hit = hk.hostcache_lookup(reg, keys, backend="triton")
            assert not bool(hit[5]) and bool(values[5].eq(0).all())
            assert int(hit.sum()) == keys.numel() - 1
            assert torch.equal(hit, hc.lookup(keys)[1])  # the CPU reader agrees
            reg.versions()[slot] += 1  # the write section ends: a hit again
            assert bool(hk.hostcache_lookup(reg, keys, backend="triton")[1].all())
    finally:
        hc.close()
        HostCache.unlink(table_name)


@needs_triton
@pytest.mark.parametrize("bump", [1, 2])
def test_version_changed_between_the_reads_is_a_miss(table_name: str, bump: int) -> None:
    hc, keys = _filled_cache(table_name, n=40, capacity=1024, dim=4)
    try:
        assert bool(hc.lookup(keys)[1].all())
        with register(hc, device="cpu") as reg:
            victim = int(keys[7])
            slot = int((reg.keys() == victim).nonzero().item())
            # the second version read sees a writer that started (+1) or finished (+2)
            # while the row was being read
            later = reg.versions().clone()
            later[slot] += bump
            values, hit = hk.triton_lookup(reg, keys, versions_again=later)
            assert not bool(hit[7]) and bool(values[7].eq(0).all())
            assert int(hit.sum()) == keys.numel() - 1
            want_v, _ = hc.lookup(keys)
            assert torch.equal(values[hit], want_v[hit])
    finally:
        hc.close()
        HostCache.unlink(table_name)


@needs_triton
def test_triton_backend_runs_the_interpreter_on_the_cpu(table_name: str) -> None:
    hc, keys = _filled_cache(table_name, n=30, capacity=1024, dim=3)
    try:
        with register(hc, device="cpu") as reg:
            values, hit = hk.hostcache_lookup(reg, keys, backend="triton")
            assert "gpu.kernels.host_tier_interpreted" in sys.modules
            assert torch.equal(values, hc.lookup(keys)[0]) and bool(hit.all())
    finally:
        hc.close()
        HostCache.unlink(table_name)


@needs_triton
@pytest.mark.parametrize("page_order", [False, True])
def test_interpreted_gather_of_a_registered_block(table_name: str, page_order: bool) -> None:
    """A registered SharedMemBlock (rows padded to 16 bytes) read by the GPULayer gather:
    its rows bit for bit, out-of-range indices as zero rows reported in the key flag."""
    mb = SharedMemBlock.create(table_name, num_rows=70, dim=6, dtype=torch.float16)
    try:
        data = torch.randn(70, 6).to(torch.float16)
        mb.write(torch.arange(70), data)
        with register(mb, device="cpu") as reg:
            assert reg.rows().stride(0) > 6  # padded rows: read at their stride
            idx = torch.randint(0, 70, (90,))
            assert torch.equal(_gather_block(reg, idx, page_order=page_order), data[idx])
            err = torch.zeros(1, dtype=torch.int64)
            out = _gather_block(reg, torch.tensor([3, 70, 5]), page_order=page_order, err=err)
            assert torch.equal(out[[0, 2]], data[[3, 5]]) and not out[1].any()
            assert int(err) == 70
    finally:
        mb.close()
        SharedMemBlock.unlink(table_name)


@needs_triton
def test_interpreted_unique_then_sort_path(table_name: str) -> None:
    """Both batch pipelines (one sort with run copies; unique, then a sort) give the table's
    own lookup, bit for bit."""
    hc, keys = _filled_cache(table_name, n=150, capacity=160, dim=5)
    try:
        with register(hc, device="cpu") as reg:
            q = _queries(keys, 120, torch.Generator().manual_seed(9))
            want_v, want_h = hc.lookup(q)
            for one_sort_max in (0, 1 << 40):
                tiles = replace(DEFAULT_TILES, host_one_sort_max=one_sort_max)
                values, hit = hk.hostcache_lookup(reg, q, backend="triton", tiles=tiles)
                assert torch.equal(hit, want_h)
                assert torch.equal(values, want_v)
    finally:
        hc.close()
        HostCache.unlink(table_name)


# -- CUDA -------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("dedup", "sort"), [(True, True), (False, True), (False, False)])
def test_cuda_lookup_equals_cpu_lookup(
    table_name: str, dtype: torch.dtype, dedup: bool, sort: bool
) -> None:
    hc, keys = _filled_cache(table_name, n=50_000, capacity=60_000, dim=128, dtype=dtype)
    try:
        hc.erase(keys[:100])
        with register(hc, device="cuda") as reg:
            q = _queries(keys, 40_000, torch.Generator().manual_seed(3))
            values, hit = hk.hostcache_lookup(reg, q.cuda(), dedup=dedup, sort=sort)
            want_v, want_h = hc.lookup(q)
            assert torch.equal(hit.cpu(), want_h)
            assert torch.equal(values.cpu().view(torch.uint8), want_v.view(torch.uint8))
            tv, th = hk.hostcache_lookup(reg, q.cuda(), backend="torch")
            assert torch.equal(th.cpu(), want_h) and torch.equal(tv.cpu(), want_v)
    finally:
        hc.close()
        HostCache.unlink(table_name)


@pytest.mark.gpu
@needs_cuda
def test_cuda_gather_of_a_registered_block_equals_index_select(table_name: str) -> None:
    mb = SharedMemBlock.create(table_name, num_rows=100_000, dim=100, dtype=torch.float32)
    try:
        data = torch.randn(100_000, 100)
        mb.write(torch.arange(100_000), data)
        with register(mb, device="cuda") as reg:
            idx = torch.randint(0, 100_000, (70_000,))
            for page_order in (False, True):
                out = _gather_block(reg, idx.cuda(), page_order=page_order)
                assert torch.equal(out.cpu(), data[idx])
            err = torch.zeros(1, dtype=torch.int64, device="cuda")
            out = _gather_block(reg, torch.tensor([100_000], device="cuda"), page_order=False,
                                err=err)
            assert int(err) == 100_000 and not out.any()
    finally:
        mb.close()
        SharedMemBlock.unlink(table_name)


def _second_process(cache_name: str, block_name: str, keys, idx, out, received) -> None:
    hc = HostCache.attach(cache_name)
    mb = SharedMemBlock.attach(block_name)
    with register(hc, device="cuda") as rc, register(mb, device="cuda") as rb:
        values, hit = hk.hostcache_lookup(rc, keys.cuda())
        rows = _gather_block(rb, idx.cuda(), page_order=False)
        out.put((values.cpu(), hit.cpu(), rows.cpu()))
        # NOTE: tensors travel as shared-memory file descriptors that this process hands
        # out on request: stay alive until the parent has unpickled them.
        received.wait(120)
    hc.close()
    mb.close()


@pytest.mark.gpu
@needs_cuda
def test_second_process_reads_rows_written_by_the_first(table_name: str) -> None:
    block_name = table_name + "-b"
    hc, keys = _filled_cache(table_name, n=5000, capacity=8192, dim=64)
    mb = SharedMemBlock.create(block_name, num_rows=1000, dim=64)
    try:
        with register(mb, device="cuda") as reg:
            gpu_rows = torch.randn(1000, 64, device="cuda")
            reg.rows().copy_(gpu_rows)  # written by this process's GPU into host memory
            torch.cuda.synchronize()
        ctx = mp.get_context("spawn")
        out, received = ctx.Queue(), ctx.Event()
        idx = torch.randint(0, 1000, (3000,))
        p = ctx.Process(target=_second_process,
                        args=(table_name, block_name, keys, idx, out, received))
        p.start()
        values, hit, rows = out.get(timeout=120)
        received.set()
        p.join(timeout=60)
        assert p.exitcode == 0
        want_v, want_h = hc.lookup(keys)
        assert torch.equal(hit, want_h) and torch.equal(values, want_v)
        assert torch.equal(rows, gpu_rows.cpu()[idx])
    finally:
        hc.close()
        mb.close()
        HostCache.unlink(table_name)
        SharedMemBlock.unlink(block_name)


_KEYS = 2048
_DIM = 128
_STEP = 4096.0  # row elements = key * _STEP + epoch % _STEP: exact in fp32 for key < 2048


def _writer(name: str, started, stop, seconds: float, epochs) -> None:
    hc = HostCache.attach(name)
    keys = torch.arange(_KEYS)
    base = (keys.to(torch.float32) * _STEP)[:, None].expand(_KEYS, _DIM)
    started.set()
    deadline = time.monotonic() + seconds
    epoch = 1
    while time.monotonic() < deadline and not stop.is_set():
        hc.update(keys, (base + float(epoch % 4096)).contiguous())
        epoch += 1
    epochs.value = epoch
    hc.close()


@pytest.mark.gpu
@needs_cuda
def test_concurrent_writer_gives_no_torn_rows(table_name: str) -> None:
    hc = HostCache.create(table_name, capacity=4 * _KEYS, dim=_DIM)
    keys = torch.arange(_KEYS)
    try:
        hc.insert(keys, (keys.to(torch.float32) * _STEP)[:, None].expand(_KEYS, _DIM).contiguous())
        assert bool(hc.lookup(keys)[1].all())
        ctx = mp.get_context("spawn")
        started, stop, epochs = ctx.Event(), ctx.Event(), ctx.Value("q", 0)
        writer = ctx.Process(target=_writer, args=(table_name, started, stop, 3.0, epochs))
        writer.start()
        try:
            assert started.wait(60)
            reg = register(hc, device="cuda")
            qk = keys.cuda()
            want_key = (qk.to(torch.float32) * _STEP)[:, None]
            lookups = hits = torn = 0
            while writer.is_alive():
                values, hit = hk.hostcache_lookup(reg, qk)
                key_part = torch.floor(values / _STEP) * _STEP
                bad = hit & ((values != values[:, :1]).any(1) | (key_part != want_key).any(1))
                torn += int(bad.sum())
                hits += int(hit.sum())
                lookups += 1
            reg.close()
        finally:
            stop.set()
            writer.join(timeout=60)
        assert writer.exitcode == 0 and epochs.value > 10
        assert lookups > 10 and hits > 0
        assert torn == 0, f"{torn} torn rows in {lookups} lookups ({hits} hits)"
    finally:
        hc.close()
        HostCache.unlink(table_name)
