"""A Hierarchical layer over a quantized shared HostCache (int8, float8_e4m3fn): lookups
(plain and pooled) return, in the layer's dtype (fp32, fp16, bf16), exactly what
``quant.decode(quant.encode(rows, fmt), fmt, dtype)`` gives, whichever tier answers (the
parameter server, the host cache read on the CPU or by the GPU kernel, the GPU cache);
writes (update, insert, accumulate; every tier, or one) leave every tier reading the same
values. Plain file:// and Redis servers, a quantized server, and a host cache alone; the
CPU and CUDA."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import psclient
from gpu import LayerType, NonFiniteValuesError, NVEmbedding, NVEmbeddingBag
from gpu.tier_config import TierConfig
from hostcache import HostCache
from nvecache.common import quant
from nvecache.common.rows import QUANTIZED, RowFormat
from tests.conftest import fresh_name
from tests.gpu.layer_tables import DEVICES

ROWS = 200
FORMATS = [getattr(torch, name) for name in QUANTIZED]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
#: plain file:// and Redis servers (of the layer's dtype), a quantized (int8) file://
#: server, and no server (the host cache alone)
STORES = ["file", pytest.param("redis", marks=pytest.mark.redis), "qfile", "none"]
_CUDA = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")]
#: the layer's device, and how it reads the host cache: on the CPU (HostCache.lookup into
#: the staging buffer), or by the GPU read kernel (CUDA only: from one distinct miss on)
PATHS = [pytest.param("cpu", "cpu", id="cpu"),
         pytest.param("cuda", "cpu", id="cuda-cpu_reads", marks=_CUDA),
         pytest.param("cuda", "gpu", id="cuda-gpu_reads", marks=_CUDA)]
PS_FORMAT = torch.int8


def initial(dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(dim)
    return torch.randn(ROWS, dim, generator=g) * 3


def round_trip(rows: torch.Tensor, fmt: torch.dtype, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """``quant.decode(quant.encode(rows, fmt), fmt, dtype)``."""
    f = RowFormat(fmt, rows.shape[1])
    return quant.decode(quant.encode(rows, f), f, dtype)


def expected(rows: torch.Tensor, store: str, fmt: torch.dtype, dtype: torch.dtype
             ) -> torch.Tensor:
    """What every tier reads of ``rows`` written as ``store`` holds them: a plain server
    the rows in the layer's dtype; a quantized one of the host cache's format the round
    trip (the host cache holds the server's stored bytes); of another format its own round
    trip (float32), which the host cache then encodes."""
    if store == "qfile":
        if fmt == PS_FORMAT:
            return round_trip(rows, fmt, dtype)
        return round_trip(round_trip(rows, PS_FORMAT), fmt, dtype)
    return round_trip(rows.to(dtype), fmt, dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().contiguous().view(torch.uint8)


@contextlib.contextmanager
def tables(store: str, fmt: torch.dtype, dtype: torch.dtype, dim: int, tmp_path: Path,
           request: pytest.FixtureRequest, *, fill: bool = True
           ) -> Iterator[tuple[HostCache, Any]]:
    """A quantized host cache of ``fmt`` and the server ``store`` names, holding
    :func:`initial` rows (the server; without one, the host cache), removed at the end."""
    name = fresh_name()
    hc = HostCache.create(name, capacity=8 * ROWS, dim=dim, dtype=fmt, ways=8)
    ps = None
    try:
        if store != "none":
            url = (request.getfixturevalue("redis_url") if store == "redis"
                   else f"file://{tmp_path}/{name}")
            ps_dtype = PS_FORMAT if store == "qfile" else dtype
            ps = psclient.connect(url, table=name, dim=dim, dtype=ps_dtype)
            if fill:
                rows = initial(dim)
                ps.insert(torch.arange(ROWS), rows if store == "qfile" else rows.to(dtype))
        elif fill:
            hc.insert(torch.arange(ROWS), initial(dim).to(dtype))
        yield hc, ps
    finally:
        if ps is not None:
            ps.drop()
            ps.close()
        hc.close()
        HostCache.unlink(name)


def tuning(reads: str) -> TierConfig:
    return TierConfig(admit_batches=1, host_gpu_read_keys=1 if reads == "gpu" else 1 << 20)


def layer_on(hc: HostCache, ps: Any, device: str, dtype: torch.dtype, reads: str,
             cls: type = NVEmbedding, **kw: Any) -> Any:
    dim = hc.geometry.dim
    return cls(ROWS, dim, dtype, LayerType.Hierarchical, host_cache=hc, storage=ps,
               device=device, gpu_cache_size=4 * ROWS * (dim * 4 + 16), tuning=tuning(reads),
               **kw)


def through_every_tier(layer: Any, call: Any, keys: torch.Tensor, has_ps: bool
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """``call()`` answered by each tier in turn, with the tier's counters checked: the
    parameter server (an empty host cache), the host cache (the GPU cache's copies
    dropped), the GPU cache."""
    distinct = int(torch.unique(keys).numel())

    def counters() -> tuple[int, int, int]:
        s = layer.stats()
        return (s.storage.hits if s.storage else 0, s.host.hits, s.gpu.hits)

    if has_ps:
        before = counters()
        got = call()
        layer.flush()
        after = counters()
        assert after[0] - before[0] == distinct and after[1] == before[1]
        yield "storage", got
        layer.erase(keys, tier="gpu")
    before = counters()
    got = call()
    layer.flush()
    after = counters()
    assert after[1] - before[1] == distinct and after[0] == before[0]
    yield "host", got
    call()  # NOTE: admitted with the rows of the call before (one lookup per round)
    assert bool(layer.in_gpu_cache(keys).all())
    before = counters()
    got = call()
    after = counters()
    assert after[2] - before[2] == keys.numel() and after[:2] == before[:2]
    yield "gpu", got


@pytest.mark.parametrize(("device", "reads"), PATHS)
@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("dim", [1, 5, 13, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_every_tier_returns_the_round_trip_in_the_layers_dtype(
        fmt: torch.dtype, dtype: torch.dtype, dim: int, store: str, device: str, reads: str,
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    want = expected(initial(dim), store, fmt, dtype)
    keys = torch.tensor([0, 7, 7, 199, 150, 3, 64])
    with tables(store, fmt, dtype, dim, tmp_path, request) as (hc, ps), \
            layer_on(hc, ps, device, dtype, reads) as layer:
        k = keys.to(device)
        for tier, got in through_every_tier(layer, lambda: layer(k), k, ps is not None):
            assert got.dtype == dtype and got.device.type == device
            assert torch.equal(bits(got), bits(want[keys])), tier
        # NOTE: the host cache holds what it would have been written: the same bytes
        out = torch.empty(keys.numel(), dim, dtype=dtype)
        assert torch.equal(bits(hc.lookup(keys, out=out)[0]), bits(want[keys]))


POOLING = [("sum", False), ("mean", False), ("max", False), ("sum", True)]


@pytest.mark.parametrize(("device", "reads"), PATHS)
@pytest.mark.parametrize("store", ["file", "none"])
@pytest.mark.parametrize("dim", [1, 5, 13, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize(("mode", "weighted"), POOLING, ids=["sum", "mean", "max", "weighted"])
def test_bags_pool_the_round_trip(
        mode: str, weighted: bool, fmt: torch.dtype, dtype: torch.dtype, dim: int, store: str,
        device: str, reads: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    want = expected(initial(dim), store, fmt, dtype)
    keys = torch.tensor([0, 7, 7, 199, 150, 3, 64, 9])
    offsets = torch.tensor([0, 2, 2, 5, 8])  # NOTE: two empty bags (the second, the last)
    weights = torch.linspace(-1.0, 2.0, keys.numel()).to(dtype) if weighted else None
    ref = F.embedding_bag(keys, want.float(), offsets, mode=mode,
                          per_sample_weights=None if weights is None else weights.float())
    with tables(store, fmt, dtype, dim, tmp_path, request) as (hc, ps), \
            layer_on(hc, ps, device, dtype, reads, NVEmbeddingBag, mode=mode) as bag:
        k, o = keys.to(device), offsets.to(device)
        w = None if weights is None else weights.to(device)
        for tier, got in through_every_tier(bag, lambda: bag(k, o, w), k, ps is not None):
            assert got.dtype == dtype and got.shape == (offsets.numel(), dim)
            if mode == "max":  # NOTE: a max of the same values: exact
                assert torch.equal(bits(got), bits(ref.to(dtype))), tier
            else:
                tol = 1e-5 if dtype == torch.float32 else 2e-2
                torch.testing.assert_close(got.cpu().float(), ref, rtol=tol, atol=tol)
            assert not got[1].any() and not got[4].any()  # empty bags


@pytest.mark.parametrize(("device", "reads"), PATHS)
@pytest.mark.parametrize("store", ["file", "qfile", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_writes_leave_every_tier_reading_the_same_values(
        fmt: torch.dtype, dtype: torch.dtype, store: str, device: str, reads: str,
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    dim = 13
    g = torch.Generator().manual_seed(11)
    keys = torch.tensor([4, 5, 6])
    new = (torch.randn(3, dim, generator=g) * 2).to(dtype)
    with tables(store, fmt, dtype, dim, tmp_path, request) as (hc, ps), \
            layer_on(hc, ps, device, dtype, reads) as layer:

        def reads_everywhere(k: torch.Tensor, want: torch.Tensor) -> None:
            """The layer (GPU cache dropped: the host cache), the host cache itself, the
            server (the host cache dropped), then the GPU cache: ``want``, bit for bit."""
            dk = k.to(device)
            layer.erase(dk, tier="gpu")
            assert torch.equal(bits(layer(dk)), bits(want))
            out = torch.empty(k.numel(), dim, dtype=dtype)
            assert torch.equal(bits(hc.lookup(k, out=out)[0]), bits(want))
            if ps is not None:
                layer.erase(dk, tier="host")
                assert torch.equal(bits(layer(dk)), bits(want))
                layer.flush()
                assert bool(hc.contains(k).all())  # NOTE: filled again, its bytes as before
                assert torch.equal(bits(hc.lookup(k, out=out)[0]), bits(want))
            layer(dk)
            assert bool(layer.in_gpu_cache(dk).all())
            assert torch.equal(bits(layer(dk)), bits(want))

        layer(keys.to(device))  # NOTE: cached everywhere, then written
        layer.flush()
        found = layer.update(keys.to(device), new.to(device))
        assert bool(found.all())
        reads_everywhere(keys, expected(new.float(), store, fmt, dtype))
        fresh = torch.tensor([ROWS + 1, ROWS + 2])  # NOTE: in no tier yet
        layer.insert(fresh.to(device), new[:2].to(device))
        reads_everywhere(fresh, expected(new[:2].float(), store, fmt, dtype))
        # accumulate: at the server (decoded, added, encoded again where quantized), whose
        # rows the host cache is then written; without one, in the host cache (decoded,
        # added in float32, encoded again)
        acc = torch.tensor([4, 6])
        before = hc.lookup(acc)[0] if ps is None else ps.lookup(acc)[0]
        deltas = torch.full((4, dim), 0.25, dtype=dtype)
        quant.seed_rounding(11)  # NOTE: an accumulate rounds stochastically: these draws
        found = layer.accumulate(torch.tensor([4, 4, 6, 7]).to(device), deltas.to(device))
        assert bool(found.all())
        if ps is None:
            at_host = before + torch.tensor([0.5, 0.25])[:, None]
            f = RowFormat(fmt, dim)
            draws = torch.Generator().manual_seed(11)
            want = quant.decode(quant.encode_sum(at_host, f, generator=draws), f, dtype)
        else:  # NOTE: what the server's lookups return of it, through the host cache
            after = ps.lookup(acc)[0]
            torch.testing.assert_close(after.float() - before.float(),
                                       torch.tensor([0.5, 0.25])[:, None].expand(2, dim),
                                       rtol=0.0, atol=0.2)
            # NOTE: a server of the host cache's format: its new stored bytes themselves
            want = (after.to(dtype) if store == "qfile" and fmt == PS_FORMAT
                    else round_trip(after, fmt, dtype))
        reads_everywhere(acc, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_one_tier_writes(fmt: torch.dtype, device: str, tmp_path: Path,
                         request: pytest.FixtureRequest) -> None:
    """``tier="host"``: the host cache encodes the rows (the server keeps its own);
    ``tier="gpu"``: the GPU cache holds the rows a write through every tier reads back,
    not the float rows given; ``tier="storage"``: the caches keep what they hold."""
    dim, dtype = 13, torch.bfloat16
    g = torch.Generator().manual_seed(12)
    rows = (torch.randn(2, dim, generator=g) * 4).to(dtype)
    keys = torch.tensor([10, 11])
    dk = keys.to(device)
    with tables("file", fmt, dtype, dim, tmp_path, request) as (hc, ps), \
            layer_on(hc, ps, device, dtype, "cpu") as layer:
        want = round_trip(rows, fmt, dtype)
        layer.insert(dk, rows.to(device), tier="host")
        layer.erase(dk, tier="gpu")
        assert torch.equal(bits(layer(dk)), bits(want))
        assert torch.equal(bits(ps.lookup(keys)[0]), bits(initial(dim)[keys].to(dtype)))
        layer.insert(dk, (rows + 1).to(device), tier="gpu")
        assert bool(layer.in_gpu_cache(dk).all())
        assert not torch.equal(bits(want), bits(rows))  # NOTE: the round trip is not the rows
        assert torch.equal(bits(layer(dk)), bits(round_trip((rows + 1), fmt, dtype)))
        layer.insert(dk, rows.to(device), tier="storage")
        assert torch.equal(bits(ps.lookup(keys)[0]), bits(rows))
        layer.insert(dk, rows.to(device), tier="gpu")  # NOTE: what every tier reads now
        got_gpu = layer(dk)
        layer.erase(dk, tier="gpu")
        layer.erase(dk, tier="host")
        assert torch.equal(bits(layer(dk)), bits(got_gpu))  # from the server, as from the GPU


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_rows_a_quantized_host_cache_cannot_hold(fmt: torch.dtype, tmp_path: Path,
                                                 request: pytest.FixtureRequest) -> None:
    """A write of a row with a NaN or an infinity is refused before any tier, even with
    allow_nonfinite=True; such a row written to a plain server by another client is served
    as the server holds it and kept out of the host cache."""
    dim = 5
    with tables("file", fmt, torch.float32, dim, tmp_path, request) as (hc, ps), \
            layer_on(hc, ps, "cpu", torch.float32, "cpu") as layer:
        bad = torch.ones(2, dim)
        bad[1, 2] = float("nan")
        for write in (layer.update, layer.insert):
            with pytest.raises(NonFiniteValuesError):
                write(torch.tensor([1, 2]), bad, allow_nonfinite=True)
        assert torch.equal(ps.lookup(torch.tensor([1, 2]))[0], initial(dim)[[1, 2]])
        assert not bool(hc.contains(torch.tensor([1, 2])).any())
        ps.update(torch.tensor([3]), bad[1:], allow_nonfinite=True)
        got = layer(torch.tensor([3, 4]))
        layer.flush()
        torch.testing.assert_close(got[0], bad[1], rtol=0.0, atol=0.0, equal_nan=True)
        assert torch.equal(got[1], round_trip(initial(dim)[4:5], fmt)[0])
        assert hc.contains(torch.tensor([3, 4])).tolist() == [False, True]


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_an_export_reopens_the_quantized_host_cache(fmt: torch.dtype, tmp_path: Path,
                                                    request: pytest.FixtureRequest) -> None:
    from gpu import export

    keys = torch.tensor([1, 2, 3])
    with tables("file", fmt, torch.float16, 5, tmp_path, request) as (hc, ps):
        model = torch.nn.Sequential(layer_on(hc, ps, "cpu", torch.float16, "cpu"))
        want = model(keys)
        export.save(model, (keys,), tmp_path / "exp")
        model[0].close()
        with export.load(tmp_path / "exp") as loaded:
            assert torch.equal(bits(loaded(keys)), bits(want))
