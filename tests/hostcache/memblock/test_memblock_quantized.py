"""A SharedMemBlock storing quantized rows (int8, float8_e4m3fn): the header records the
format and attaching with another is refused; writes quantize as nvecache.common.quant
does (differential against it), reads dequantize; non-finite rows refused with nothing
written; accumulate reads, adds in float32 and quantizes again with stochastic rounding
(many small deltas add up where rounding to nearest loses them); another process reads the
same rows; the bytes a row takes; what does not take a quantized table yet refuses it (the
layers read one: tests/gpu/quantized/test_linear_quantized*.py)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from hostcache import (
    BadArgumentError,
    GeometryMismatchError,
    HostCache,
    NonFiniteValuesError,
    SharedMemBlock,
    files,
)
from hostcache.cli import main as hostcache_main
from nvecache.common import quant
from nvecache.common.rows import QUANTIZED, RowFormat
from tests import quant_drift

FORMATS = [getattr(torch, name) for name in QUANTIZED]


@pytest.fixture(params=FORMATS, ids=str)
def qblock(request: pytest.FixtureRequest, table_name: str):
    mb = SharedMemBlock.create(table_name, num_rows=64, dim=13, dtype=request.param)
    yield mb
    mb.close()
    SharedMemBlock.unlink(table_name)


def _rows(n: int, dim: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, dim, generator=gen) * 3 + 1).to(dtype)


def test_the_header_records_the_format_and_another_is_refused(qblock: SharedMemBlock) -> None:
    fmt = RowFormat(qblock.dtype, 13)
    assert qblock.quantized and fmt.quantized
    assert qblock.tensor.dtype == torch.uint8 and qblock.tensor.shape == (64, fmt.stored_bytes)
    assert qblock.geometry.row_stride == fmt.stride
    with SharedMemBlock.attach(qblock.name) as again:
        assert again.dtype == qblock.dtype and again.quantized
    with SharedMemBlock.attach(qblock.name, dtype=qblock.dtype) as again:
        assert again.dim == 13
    for other in (torch.float32, *(f for f in FORMATS if f != qblock.dtype)):
        with pytest.raises(GeometryMismatchError):
            SharedMemBlock.attach(qblock.name, dtype=other)
    # zeroed rows read as zeros
    assert torch.equal(qblock.read(torch.arange(64)), torch.zeros(64, 13))


@pytest.mark.parametrize("given", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_writes_quantize_as_the_codec_does_and_reads_dequantize(
        qblock: SharedMemBlock, given: torch.dtype) -> None:
    fmt = RowFormat(qblock.dtype, 13)
    vals = _rows(5, 13, seed=1, dtype=given)
    idx = torch.tensor([3, 60, 3, 9, 0])  # NOTE: the last of a duplicate wins
    start = qblock.change_cursor
    qblock.write(idx, vals)
    want = quant.encode(vals[[4, 2, 3, 1]], fmt)
    got = qblock.tensor[[0, 3, 9, 60]]
    assert torch.equal(got, want)
    back = qblock.read(torch.tensor([0, 3, 9, 60]))
    assert back.dtype == torch.float32
    assert torch.equal(back, quant.decode(want, fmt))
    assert bool(((back - vals[[4, 2, 3, 1]].float()).abs() <= quant.error_bound(want, fmt)).all())
    assert sorted(qblock.changes_since(start)[0].tolist()) == [0, 3, 9, 60]
    qblock.write_range(20, vals)
    assert torch.equal(qblock.tensor[20:25], quant.encode(vals, fmt))


def test_fill_range_stages_float_rows_and_quantizes_them(qblock: SharedMemBlock) -> None:
    fmt = RowFormat(qblock.dtype, 13)
    vals = _rows(30, 13, seed=2)

    def fill(i: int, out: torch.Tensor) -> None:
        out.copy_(vals[i:i + out.shape[0]])

    qblock.fill_range(10, 30, fill, stage=torch.empty(7, 13))
    assert torch.equal(qblock.tensor[10:40], quant.encode(vals, fmt))
    with pytest.raises(BadArgumentError, match="float32"):
        qblock.fill_range(0, 4, fill, stage=torch.empty(4, 13, dtype=torch.int8))


@pytest.mark.parametrize("allow", [False, True])
def test_rows_that_are_not_finite_are_refused_with_nothing_written(
        qblock: SharedMemBlock, allow: bool) -> None:
    vals = _rows(3, 13, seed=3)
    vals[1, 4] = float("nan")
    start, before = qblock.change_cursor, qblock.tensor.clone()
    with pytest.raises(NonFiniteValuesError, match="finite rows only"):
        qblock.write(torch.tensor([1, 2, 3]), vals, allow_nonfinite=allow)
    with pytest.raises(NonFiniteValuesError, match="index 6"):
        qblock.write_range(5, vals, allow_nonfinite=allow)
    with pytest.raises(NonFiniteValuesError):
        qblock.accumulate(torch.tensor([1, 2, 3]), vals, allow_nonfinite=allow)
    assert torch.equal(qblock.tensor, before) and qblock.change_cursor == start


def test_accumulate_adds_in_float32_and_rounds_stochastically(qblock: SharedMemBlock) -> None:
    """Decoded, added in float32, encoded with stochastic rounding: bit for bit the codec's
    ``encode_sum`` with the same draws (the rounding generator, seeded), each element
    one of the two steps around the sum, within one step of it."""
    fmt = RowFormat(qblock.dtype, 13)
    qblock.write(torch.arange(4), _rows(4, 13, seed=4))
    before = qblock.tensor[:4].clone()
    deltas = _rows(5, 13, seed=5)
    idx = torch.tensor([2, 0, 2, 3, 0])
    quant.seed_rounding(12)
    qblock.accumulate(idx, deltas)
    sums = torch.zeros(4, 13).index_add_(0, idx, deltas)
    exact = (quant.decode(before, fmt) + sums)[[0, 2, 3]]
    want = quant.encode_sum(exact, fmt, generator=torch.Generator().manual_seed(12))
    got = qblock.tensor[[0, 2, 3]]
    assert torch.equal(got, want)
    below, above = quant.steps_around(exact, fmt)
    back = quant.decode(got, fmt)
    assert bool(((back == quant.decode(below, fmt)) | (back == quant.decode(above, fmt))).all())
    assert bool(((back - exact).abs() <= quant.error_bound(got, fmt, stochastic=True)).all())
    assert torch.equal(qblock.tensor[1], before[1])
    with pytest.raises(BadArgumentError, match="float32"):
        qblock.accumulate(idx, deltas.half())


@pytest.mark.parametrize("dtype", FORMATS, ids=str)
def test_many_small_deltas_add_up(dtype: torch.dtype, table_name: str) -> None:
    """A thousand accumulates of a delta well under half a step end near the exact sum
    (tests/quant_drift.py: within 6 standard deviations of the rounding, on average),
    where rounding to nearest would lose every one."""
    case = quant_drift.scenario(dtype)
    idx = torch.arange(quant_drift.ROWS)
    with SharedMemBlock.create(table_name, num_rows=quant_drift.ROWS, dim=quant_drift.DIM,
                               dtype=dtype) as mb:
        try:
            mb.write(idx, case.start)
            start = mb.read(idx)
            quant.seed_rounding(0)
            with quant_drift.one_thread():
                for _ in range(quant_drift.ADDS):
                    mb.accumulate(idx, case.delta)
            quant_drift.check_drift(case, start, mb.read(idx))
        finally:
            SharedMemBlock.unlink(table_name)


def test_another_process_reads_the_dequantized_rows(qblock: SharedMemBlock) -> None:
    vals = _rows(2, 13, seed=6)
    qblock.write(torch.tensor([7, 8]), vals)
    with mp.get_context("spawn").Pool(1) as pool:
        got = pool.apply(_read_rows, (qblock.name, [7, 8]))
    assert torch.equal(torch.tensor(got), qblock.read(torch.tensor([7, 8])))


def _read_rows(name: str, idx: list[int]) -> list[list[float]]:
    with SharedMemBlock.attach(name) as mb:
        return mb.read(torch.tensor(idx)).tolist()


def test_an_int8_row_of_dim_128_takes_its_bytes_within_a_tenth(table_name: str) -> None:
    with SharedMemBlock.create(table_name, num_rows=1000, dim=128, dtype=torch.int8) as mb:
        try:
            g = mb.geometry
            # each row's seqlock version in the 4 bytes after its stored bytes
            assert g.row_stride >= g.row_format.stored_bytes + 4
            assert g.row_stride <= 1.1 * (128 + 8)
            versions = mb.versions
            assert versions is not None and versions.shape == (1000,)
            assert versions.data_ptr() - mb.tensor.data_ptr() == g.row_format.stored_bytes
            assert versions.stride(0) * 4 == g.row_stride
            rows_area = g.total_size - g.rows_off
            assert rows_area <= 1000 * 1.1 * (128 + 8) + 4096
        finally:
            SharedMemBlock.unlink(table_name)


def test_a_saved_table_restores_bit_for_bit(qblock: SharedMemBlock, table_name: str,
                                            tmp_path: Path) -> None:
    """A file holds the stored bytes: restored into a new table (created in the format) or
    the same one, the rows are those bytes; another format's table refuses the file."""
    qblock.write(torch.arange(64), _rows(64, 13, seed=7))
    path = tmp_path / "q.safetensors"
    assert files.save(qblock, path) == 64
    with files.restore(table_name + "r", path) as back:
        try:
            assert isinstance(back, SharedMemBlock) and back.dtype == qblock.dtype
            assert torch.equal(back.tensor, qblock.tensor)
        finally:
            SharedMemBlock.unlink(table_name + "r")
    qblock.write(torch.arange(3), torch.zeros(3, 13))
    files.restore(qblock.name, path, create=False).close()
    with files.restore(table_name + "r2", path) as again:
        try:
            assert torch.equal(again.tensor, qblock.tensor)
        finally:
            SharedMemBlock.unlink(table_name + "r2")
    other = next(f for f in (torch.float32, *FORMATS) if f != qblock.dtype)
    with SharedMemBlock.create(table_name + "o", num_rows=64, dim=13, dtype=other) as o:
        try:
            before = o.tensor.clone()
            with pytest.raises(GeometryMismatchError):
                files.restore(o.name, path, create=False)
            assert torch.equal(o.tensor, before)
        finally:
            SharedMemBlock.unlink(table_name + "o")


def test_stored_bytes_are_written_as_they_are_once_they_decode_finite(
        qblock: SharedMemBlock) -> None:
    fmt = RowFormat(qblock.dtype, 13)
    stored = quant.encode(_rows(4, 13, seed=8), fmt)
    qblock.write(torch.tensor([1, 2, 3, 4]), stored)
    assert torch.equal(qblock.tensor[1:5], stored)
    bad = stored.clone()
    bad[2, fmt.meta_offset:fmt.meta_offset + 4] = torch.tensor(
        [float("inf")]).view(torch.uint8)  # NOTE: an infinite scale
    with pytest.raises(NonFiniteValuesError, match="finite rows only"):
        qblock.write(torch.tensor([5, 6, 7, 8]), bad)
    with pytest.raises(BadArgumentError, match="shape"):
        qblock.write(torch.tensor([5]), stored[:1, :-1])
    assert not qblock.tensor[5:9].any()


def test_what_does_not_take_quantized_tables_yet_refuses_them(
        qblock: SharedMemBlock, tmp_path: Path) -> None:
    with pytest.raises(BadArgumentError, match="quantized"):
        files.load_rows(qblock, tmp_path / "missing.npy")


def test_the_command_line_creates_quantized_tables(table_name: str, capsys) -> None:
    assert hostcache_main(["create", table_name, "--linear", "--rows", "10", "--dim", "8",
                           "--dtype", "int8"]) == 0
    try:
        with SharedMemBlock.attach(table_name) as mb:
            assert mb.dtype == torch.int8 and mb.tensor.shape == (10, 16)
    finally:
        SharedMemBlock.unlink(table_name)
    assert hostcache_main(["create", table_name, "--capacity", "10", "--dim", "8",
                           "--dtype", "float8_e4m3fn"]) == 0
    try:
        with HostCache.attach(table_name) as hc:
            assert hc.geometry.dtype == torch.float8_e4m3fn
    finally:
        HostCache.unlink(table_name)
    assert "float8_e4m3fn" in capsys.readouterr().out