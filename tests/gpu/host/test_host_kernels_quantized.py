"""The host-tier reads of a quantized HostCache (int8, float8_e4m3fn): the Triton kernels
(under the interpreter on the CPU, compiled on CUDA) dequantize in the gather, bit for bit
``quant.decode(stored, fmt, dtype)``, as the torch twin and the table's own lookup do; a
slot written while it is read (its version changed, or odd) is a miss, its row zeros."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from gpu.cuda.registration import register
from gpu.errors import BadArgumentError
from gpu.kernels import host_reads as hk
from gpu.kernels.tiles import DEFAULT_TILES
from hostcache import HostCache
from nvecache.common import quant
from nvecache.common.rows import QUANTIZED, RowFormat
from tests.gpu.host.test_host_kernels import needs_cuda, needs_triton

FORMATS = [getattr(torch, name) for name in QUANTIZED]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _filled(name: str, fmt: torch.dtype, dim: int, n: int = 150, capacity: int = 400
            ) -> tuple[HostCache, torch.Tensor, torch.Tensor]:
    """A quantized cache holding ``n`` rows of random keys (negative ones too), rows of
    another range each; returns it, the keys and their float rows."""
    hc = HostCache.create(name, capacity=capacity, dim=dim, dtype=fmt, ways=8)
    g = torch.Generator().manual_seed(dim)
    keys = torch.randperm(4 * n, generator=g)[:n] - n
    rows = torch.randn(n, dim, generator=g) * torch.rand(n, 1, generator=g) * 10
    rows[0] = 2.5  # NOTE: a constant row (int8: scale 0)
    hc.insert(keys, rows)
    return hc, keys, rows


def _queries(keys: torch.Tensor) -> torch.Tensor:
    """Present keys (some twice) and absent ones, shuffled."""
    g = torch.Generator().manual_seed(7)
    q = torch.cat([keys[:100], keys[:20], torch.randint(10**9, 2 * 10**9, (30,), generator=g)])
    return q[torch.randperm(q.numel(), generator=g)]


def _want(keys: torch.Tensor, rows: torch.Tensor, q: torch.Tensor, fmt: torch.dtype,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``q`` as the cache holds them (encoded once), decoded in ``dtype``;
    zeros and False for keys not held."""
    f = RowFormat(fmt, rows.shape[1])
    held = quant.decode(quant.encode(rows, f), f, dtype)
    pos = {int(k): i for i, k in enumerate(keys)}
    hit = torch.tensor([int(k) in pos for k in q])
    want = torch.zeros(q.numel(), rows.shape[1], dtype=dtype)
    idx = torch.tensor([pos[int(k)] for k in q[hit]], dtype=torch.int64)
    want[hit] = held[idx]
    return want, hit


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().contiguous().view(torch.uint8)


@needs_triton
@pytest.mark.parametrize("dim", [1, 5, 13, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_interpreted_gather_dequantizes_as_the_twin_and_the_table(
        table_name: str, fmt: torch.dtype, dtype: torch.dtype, dim: int) -> None:
    hc, keys, rows = _filled(table_name, fmt, dim)
    try:
        q = _queries(keys)
        want, want_hit = _want(keys, rows, q, fmt, dtype)
        assert bool(hc.contains(keys).all())
        with register(hc, device="cpu") as reg:
            assert reg.rows().dtype == torch.uint8  # NOTE: the stored bytes, not floats
            table = hc.lookup(q, out=torch.empty(q.numel(), dim, dtype=dtype))
            twin = hk.hostcache_lookup(reg, q, backend="torch", out_dtype=dtype)
            auto = hk.hostcache_lookup(reg, q, out_dtype=dtype)  # the CPU: the table's
            runs = [table, twin, auto]
            for one_sort_max in (0, 1 << 40):  # NOTE: both batch pipelines
                for dedup, sort in ((True, True), (False, True), (False, False)):
                    tiles = replace(DEFAULT_TILES, host_one_sort_max=one_sort_max)
                    runs.append(hk.hostcache_lookup(reg, q, backend="triton", dedup=dedup,
                                                    sort=sort, tiles=tiles, out_dtype=dtype))
            for values, hit in runs:
                assert values.dtype == dtype
                assert torch.equal(hit, want_hit)
                assert torch.equal(_bits(values), _bits(want))
    finally:
        hc.close()
        HostCache.unlink(table_name)


@needs_triton
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_the_default_is_float32_and_other_dtypes_are_refused(table_name: str,
                                                             fmt: torch.dtype) -> None:
    hc, keys, _ = _filled(table_name, fmt, 5, n=20, capacity=64)
    plain = HostCache.create(table_name + "p", capacity=64, dim=5, dtype=torch.float16)
    try:
        with register(hc, device="cpu") as reg, register(plain, device="cpu") as preg:
            for backend in ("torch", "triton", "auto"):
                values, _ = hk.hostcache_lookup(reg, keys, backend=backend)
                assert values.dtype == torch.float32
                assert torch.equal(values, hc.lookup(keys)[0])
                for bad in (torch.int8, torch.float64, torch.uint8):
                    with pytest.raises(BadArgumentError, match="is read as"):
                        hk.hostcache_lookup(reg, keys, backend=backend, out_dtype=bad)
                with pytest.raises(BadArgumentError, match="is read as torch.float16"):
                    hk.hostcache_lookup(preg, keys, backend=backend, out_dtype=torch.float32)
                assert hk.hostcache_lookup(preg, keys, backend=backend,
                                           out_dtype=torch.float16)[0].dtype == torch.float16
    finally:
        hc.close()
        plain.close()
        HostCache.unlink(table_name)
        HostCache.unlink(table_name + "p")


@needs_triton
@pytest.mark.parametrize("bump", [1, 2])
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_a_slot_written_while_its_row_is_read_is_a_miss(table_name: str, fmt: torch.dtype,
                                                        bump: int) -> None:
    """The check launch reads the version again after the gather read payload, scale and
    bias: a writer that started (+1) or finished (+2) meanwhile makes the key a miss; an
    odd version at the probe does too."""
    hc, keys, rows = _filled(table_name, fmt, 13, n=40, capacity=1024)
    try:
        want, _ = _want(keys, rows, keys, fmt, torch.bfloat16)
        with register(hc, device="cpu") as reg:
            slot = int((reg.keys() == int(keys[7])).nonzero().item())
            later = reg.versions().clone()
            later[slot] += bump
            values, hit = hk.triton_lookup(reg, keys, versions_again=later,
                                           out_dtype=torch.bfloat16)
            assert not bool(hit[7]) and not values[7].any()
            assert int(hit.sum()) == keys.numel() - 1
            assert torch.equal(_bits(values[hit]), _bits(want[hit]))
            reg.versions()[slot] += 1  # a writer is inside the slot
            for backend in ("triton", "torch"):
                values, hit = hk.hostcache_lookup(reg, keys, backend=backend)
                assert not bool(hit[7]) and not values[7].any() and int(hit.sum()) == 39
            reg.versions()[slot] += 1
            assert bool(hk.hostcache_lookup(reg, keys, backend="triton")[1].all())
    finally:
        hc.close()
        HostCache.unlink(table_name)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dim", [1, 13, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_cuda_gather_dequantizes_as_the_cpu(table_name: str, fmt: torch.dtype,
                                            dtype: torch.dtype, dim: int) -> None:
    hc, keys, rows = _filled(table_name, fmt, dim, n=20_000, capacity=40_000)
    try:
        g = torch.Generator().manual_seed(3)
        q = torch.cat([keys[torch.randint(0, keys.numel(), (30_000,), generator=g)],
                       torch.randint(10**9, 2 * 10**9, (5000,), generator=g)])
        want_v, want_h = hc.lookup(q, out=torch.empty(q.numel(), dim, dtype=dtype))
        assert int(want_h.sum()) > 20_000
        with register(hc, device="cuda") as reg:
            for dedup, sort in ((True, True), (False, True), (False, False)):
                for one_sort_max in (0, 1 << 40):
                    tiles = replace(DEFAULT_TILES, host_one_sort_max=one_sort_max)
                    values, hit = hk.hostcache_lookup(reg, q.cuda(), dedup=dedup, sort=sort,
                                                      tiles=tiles, out_dtype=dtype)
                    assert torch.equal(hit.cpu(), want_h)
                    assert torch.equal(_bits(values), _bits(want_v))
            tv, th = hk.hostcache_lookup(reg, q.cuda(), backend="torch", out_dtype=dtype)
            assert torch.equal(th.cpu(), want_h) and torch.equal(_bits(tv), _bits(want_v))
    finally:
        hc.close()
        HostCache.unlink(table_name)
