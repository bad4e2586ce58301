"""A HostCache storing quantized rows (int8, float8_e4m3fn): inserts and updates quantize
as nvecache.common.quant does (differential against it), lookups return the rows
dequantized in float32 and never a row whose bytes and parameters are of two writes
(a writer process against a reader process), accumulate decodes, adds in float32 and
quantizes again with stochastic rounding (many small deltas add up), non-finite rows
refused with nothing written, the header's format checked on attach; a Hierarchical layer
does not take a quantized host cache yet."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from gpu import LayerType, NVEmbedding
from gpu.errors import BadArgumentError as LayerArgumentError
from hostcache import (
    BadArgumentError,
    GeometryMismatchError,
    HostCache,
    NonFiniteValuesError,
    files,
)
from nvecache.common import quant
from nvecache.common.rows import QUANTIZED, RowFormat
from psclient import connect
from tests import quant_drift
from tests.hostcache import quant_workers

CTX = mp.get_context("spawn")
FORMATS = [getattr(torch, name) for name in QUANTIZED]


@pytest.fixture(params=FORMATS, ids=str)
def qcache(request: pytest.FixtureRequest, table_name: str):
    hc = HostCache.create(table_name, capacity=256, dim=13, dtype=request.param, ways=8)
    yield hc
    hc.close()
    HostCache.unlink(table_name)


def _rows(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 13, generator=gen) * 2 - 1).to(dtype)


def test_the_header_records_the_format(qcache: HostCache) -> None:
    assert qcache.geometry.row_format.quantized
    assert qcache.geometry.row_stride == RowFormat(qcache.geometry.dtype, 13).stride
    with HostCache.attach(qcache.name) as again:
        assert again.geometry.dtype == qcache.geometry.dtype
    with pytest.raises(GeometryMismatchError):
        HostCache.attach(qcache.name, dtype=torch.float32)


@pytest.mark.parametrize("given", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_inserts_quantize_and_lookups_dequantize(qcache: HostCache, given: torch.dtype
                                                 ) -> None:
    fmt = qcache.geometry.row_format
    keys = torch.tensor([5, 900, 5, -7])
    vals = _rows(4, seed=1, dtype=given)
    qcache.insert(keys, vals)  # NOTE: the last of a duplicate wins
    got, hit = qcache.lookup(torch.tensor([5, 900, -7, 12345]))
    assert hit.tolist() == [True, True, True, False]
    assert got.dtype == torch.float32
    want = quant.decode(quant.encode(vals[[2, 1, 3]], fmt), fmt)
    assert torch.equal(got[:3], want) and torch.equal(got[3], torch.zeros(13))
    out = torch.empty(2, 13)
    assert qcache.lookup(torch.tensor([900, 5]), out=out)[0] is out
    assert torch.equal(out, want[[1, 0]])
    with pytest.raises(BadArgumentError, match="float32"):
        qcache.lookup(torch.tensor([5]), out=torch.empty(1, 13, dtype=torch.int8))
    new = _rows(2, seed=2)
    assert qcache.update(torch.tensor([900, 77]), new).tolist() == [True, False]
    assert torch.equal(qcache.lookup(torch.tensor([900]))[0],
                       quant.decode(quant.encode(new[:1], fmt), fmt))
    qcache.update(torch.tensor([77]), new[1:], insert_missing=True)
    assert bool(qcache.lookup(torch.tensor([77]))[1][0])


def test_accumulate_decodes_adds_in_float32_and_rounds_stochastically(qcache: HostCache
                                                                     ) -> None:
    """Bit for bit the codec's ``encode_sum`` of the decoded rows plus their deltas, with
    the same draws (the rounding generator, seeded); each element one of the two steps
    around the sum, within one step of it."""
    fmt = qcache.geometry.row_format
    keys = torch.tensor([1, 2, 3])
    qcache.insert(keys, _rows(3, seed=3))
    cur = qcache.lookup(keys)[0]
    deltas = _rows(4, seed=4)
    idx = torch.tensor([3, 1, 3, 99])
    quant.seed_rounding(21)
    found = qcache.accumulate(idx, deltas)
    assert found.tolist() == [True, True, True, False]
    sums = torch.zeros(3, 13)
    sums[0] = deltas[1]
    sums[2] = deltas[0] + deltas[2]
    exact = (cur + sums)[[0, 2]]
    want = quant.decode(quant.encode_sum(exact, fmt,
                                         generator=torch.Generator().manual_seed(21)), fmt)
    got = qcache.lookup(keys)[0]
    assert torch.equal(got[[0, 2]], want) and torch.equal(got[1], cur[1])
    below, above = (quant.decode(s, fmt) for s in quant.steps_around(exact, fmt))
    assert bool(((want == below) | (want == above)).all())
    bound = quant.error_bound(quant.encode(exact, fmt), fmt, stochastic=True)
    assert bool(((want - exact).abs() <= bound).all())
    with pytest.raises(BadArgumentError, match="float32"):
        qcache.accumulate(idx, deltas.half())


@pytest.mark.parametrize("dtype", FORMATS, ids=str)
def test_many_small_deltas_add_up(dtype: torch.dtype, table_name: str) -> None:
    """A thousand accumulates of a delta well under half a step end near the exact sum
    (tests/quant_drift.py), where rounding to nearest would lose every one."""
    case = quant_drift.scenario(dtype)
    keys = torch.arange(quant_drift.ROWS) * 7 - 20
    with HostCache.create(table_name, capacity=64, dim=quant_drift.DIM, dtype=dtype,
                          ways=8) as hc:
        try:
            hc.insert(keys, case.start)
            start, hit = hc.lookup(keys)
            assert bool(hit.all())
            quant.seed_rounding(0)
            with quant_drift.one_thread():
                for _ in range(quant_drift.ADDS):
                    assert bool(hc.accumulate(keys, case.delta).all())
            quant_drift.check_drift(case, start, hc.lookup(keys)[0])
        finally:
            HostCache.unlink(table_name)


@pytest.mark.parametrize("allow", [False, True])
def test_rows_that_are_not_finite_are_refused(qcache: HostCache, allow: bool) -> None:
    qcache.insert(torch.tensor([1]), _rows(1, seed=5))
    before = qcache.lookup(torch.tensor([1, 2]))
    bad = _rows(2, seed=6)
    bad[1, 0] = float("inf")
    start = qcache.change_cursor
    with pytest.raises(NonFiniteValuesError, match="finite rows only"):
        qcache.insert(torch.tensor([1, 2]), bad, allow_nonfinite=allow)
    with pytest.raises(NonFiniteValuesError):
        qcache.update(torch.tensor([1, 2]), bad, allow_nonfinite=allow)
    with pytest.raises(NonFiniteValuesError):
        qcache.accumulate(torch.tensor([1, 1]), bad, allow_nonfinite=allow)
    after = qcache.lookup(torch.tensor([1, 2]))
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
    assert qcache.change_cursor == start


def test_a_reader_never_sees_a_row_of_two_writes(table_name: str) -> None:
    """A writer process cycles every row through versions of other scales and biases
    while a reader process looks them up: every hit is one version's whole row."""
    keys = torch.arange(200)
    hc = HostCache.create(table_name, capacity=512, dim=quant_workers.DIM, dtype=torch.int8)
    try:
        hc.insert(keys, quant_workers.version_rows(keys, 0))
        out = CTX.Queue()
        go, done = CTX.Event(), CTX.Event()
        ready = [CTX.Event(), CTX.Event()]
        w = CTX.Process(target=quant_workers.writer,
                        args=(table_name, keys, 2000, ready[0], go, out))
        r = CTX.Process(target=quant_workers.reader,
                        args=(table_name, keys, done, ready[1], go, out))
        w.start()
        r.start()
        assert ready[0].wait(120) and ready[1].wait(120)
        go.set()
        first = out.get(timeout=300)
        done.set()
        second = out.get(timeout=120)
        for p in (w, r):
            p.join(timeout=30)
            assert p.exitcode == 0
        (reader,) = [x for x in (first, second) if x[0] == "reader"]
        assert reader[1] >= 50 and reader[2] == 0
        fmt = hc.geometry.row_format
        final = quant_workers.expected(keys, (2000 - 1) % quant_workers.VERSIONS, fmt)
        assert torch.equal(hc.lookup(keys)[0], final)
    finally:
        hc.close()
        HostCache.unlink(table_name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_a_lookup_decodes_into_out_of_a_layers_dtype(qcache: HostCache,
                                                      dtype: torch.dtype) -> None:
    keys = torch.arange(5)
    qcache.insert(keys, _rows(5, seed=3))
    want = quant.decode(_stored(qcache, keys), qcache.row_format, dtype)
    out = torch.full((6, 13), 7.0, dtype=dtype)
    values, hit = qcache.lookup(torch.cat([keys, torch.tensor([99])]), out=out)
    assert values is out and hit.tolist() == [True] * 5 + [False]
    assert torch.equal(out[:5].view(torch.uint8), want.view(torch.uint8))
    assert not out[5].any()  # a miss: zeros
    with pytest.raises(BadArgumentError, match="bfloat16"):
        qcache.lookup(keys, out=torch.empty(5, 13, dtype=torch.float64))


def test_a_hierarchical_layer_reads_a_quantized_host_cache(qcache: HostCache) -> None:
    keys = torch.arange(3)
    qcache.insert(keys, _rows(3, seed=4))
    with NVEmbedding(256, 13, torch.float16, LayerType.Hierarchical, device="cpu",
                     host_cache=qcache) as layer:
        want = qcache.lookup(keys, out=torch.empty(3, 13, dtype=torch.float16))[0]
        assert torch.equal(layer(keys), want)
    with pytest.raises(LayerArgumentError, match="host cache"):
        NVEmbedding(256, 12, torch.float32, LayerType.Hierarchical, device="cpu",
                    host_cache=qcache)


def _stored(hc: HostCache, keys: torch.Tensor) -> torch.Tensor:
    return torch.stack([hc._rows[int(s)] for s in hc._probe(keys.numpy())[0]])  # noqa: SLF001


def test_a_saved_cache_restores_bit_for_bit(qcache: HostCache, table_name: str,
                                            tmp_path: Path) -> None:
    keys = torch.arange(0, 400, 3)[:100]
    qcache.insert(keys, _rows(100, seed=9))
    held = keys[qcache.contains(keys)]
    path = tmp_path / "c.safetensors"
    assert files.save(qcache, path) == held.numel()
    with files.restore(table_name + "r", path) as back:
        try:
            assert isinstance(back, HostCache)
            assert back.geometry.dtype == qcache.geometry.dtype
            assert torch.equal(_stored(back, held), _stored(qcache, held))
            assert torch.equal(back.lookup(held)[0], qcache.lookup(held)[0])
        finally:
            HostCache.unlink(table_name + "r")


def test_a_parameter_servers_dump_restores_into_a_host_cache(
        qcache: HostCache, table_name: str, tmp_path: Path) -> None:
    """``psclient dump`` of a quantized table: its stored bytes, loaded as they are."""
    dtype = qcache.geometry.dtype
    keys = torch.tensor([3, 1 << 40, -5])
    with connect(f"file://{tmp_path / 'ps'}", table="q", dim=13, dtype=dtype) as ps:
        ps.insert(keys, _rows(3, seed=10))
        want, _ = ps.lookup(keys)
        ps.dump(tmp_path / "d.safetensors")
    with files.restore(table_name + "d", tmp_path / "d.safetensors") as back:
        try:
            got, hit = back.lookup(keys)
            assert bool(hit.all()) and torch.equal(got, want)
        finally:
            HostCache.unlink(table_name + "d")
