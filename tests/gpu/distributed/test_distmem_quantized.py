"""A quantized DistMemBlock (int8, float8_e4m3fn) on the CPU twin (and on a GPU where there
is one): the range holds each row's stored bytes at ``row_format.stride``; writes quantize
float rows as nvecache.common.quant does (bit for bit) or take stored bytes as they are;
reads dequantize; accumulate decodes, adds in float32 and rounds stochastically (bit for
bit ``quant.encode_sum`` with the same draws; a thousand small deltas add up); NaN and
infinite rows refused with nothing written; ranks joining with another dtype refused, and
two ranks accumulating into one quantized block lose no addition."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as tmp

from gpu import BadArgumentError, DistMemBlock, NonFiniteValuesError
from nvecache.common import quant
from nvecache.common.rows import QUANTIZED, RowFormat
from tests import quant_drift
from tests.conftest import fresh_name
from tests.gpu import distmem_ranks
from tests.servers import free_port

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])]
FORMATS = [getattr(torch, name) for name in QUANTIZED]
DIM = 13


def _devices(device: str, shards: int = 1) -> object:
    return ["cpu"] * shards if device == "cpu" else [torch.device(device)]


def _rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, DIM, generator=torch.Generator().manual_seed(seed)) * 3 + 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_the_range_holds_each_row_s_stored_bytes_at_the_stride(fmt: torch.dtype, device: str,
                                                               table_name: str) -> None:
    f = RowFormat(fmt, DIM)
    rows = 3000  # rows straddle the CPU twin's shard boundaries
    with DistMemBlock(rows, DIM, fmt, devices=_devices(device, 3), name=table_name) as block:
        assert block.quantized and block.row_format == f and block.dtype == fmt
        assert block.row_bytes == f.stride and f.stride % 16 == 0
        view = block.view()
        assert view.dtype == torch.uint8 and view.shape == (rows, f.stride)
        assert view.stride() == (f.stride, 1) and view.data_ptr() == block.base
        assert block.size >= rows * f.stride
        assert not block.read(torch.arange(rows)).any()  # zeroed rows read as zeros
        for given in (torch.float32, torch.float16, torch.bfloat16):
            w = _rows(rows, seed=1).to(given)
            block.write(torch.arange(rows).to(device), w.to(device))
            assert torch.equal(view[:, :f.stored_bytes].cpu(), quant.encode(w, f))
            back = block.read(torch.tensor([0, 1234, rows - 1]))
            assert back.dtype == torch.float32 and back.device.type == device
            assert torch.equal(back.cpu(), quant.decode(quant.encode(w[[0, 1234, -1]], f), f))
        straddler = int(block.shard_bytes // block.row_bytes)
        if device == "cpu":
            assert int(block.shard_of(torch.tensor([straddler + 1]))) == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_stored_bytes_are_written_as_they_are_and_announced(fmt: torch.dtype, device: str,
                                                            table_name: str) -> None:
    f = RowFormat(fmt, DIM)
    with DistMemBlock(64, DIM, fmt, devices=_devices(device), name=table_name) as block:
        stored = quant.encode(_rows(3, seed=2), f)
        cursor = block.change_cursor
        block.write(torch.tensor([5, 9, 5]).to(device), stored.to(device))  # the last wins
        assert torch.equal(block.view()[[5, 9], :f.stored_bytes].cpu(), stored[[2, 1]])
        assert torch.equal(block.read(torch.tensor([5, 9])).cpu(),
                           quant.decode(stored[[2, 1]], f))
        keys, cursor2, overflowed = block.changes_since(cursor)
        assert sorted(keys.tolist()) == [5, 9] and cursor2 > cursor and not overflowed


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_accumulate_decodes_adds_and_rounds_stochastically(fmt: torch.dtype, device: str,
                                                          table_name: str) -> None:
    """Bit for bit ``quant.encode_sum`` of the decoded rows plus the summed deltas, with the
    same draws (the device's rounding generator, seeded), on the block's device; each
    element a step beside the exact sum, within one step of it; announced."""
    f = RowFormat(fmt, DIM)
    with DistMemBlock(300, DIM, fmt, devices=_devices(device), name=table_name) as block:
        block.write(torch.arange(300), _rows(300, seed=3))
        before = block.view()[:, :f.stored_bytes].clone()
        idx = torch.tensor([7, 299, 7, 0, 7, 150, 150])
        deltas = _rows(idx.numel(), seed=4) / 10
        cursor = block.change_cursor
        quant.seed_rounding(5)
        block.accumulate(idx.to(device), deltas.to(device))
        uidx = torch.tensor([0, 7, 150, 299])
        sums = torch.zeros(300, DIM).index_add_(0, idx, deltas)[uidx]
        exact = quant.decode(before[uidx.to(device)], f) + sums.to(device)
        want = quant.encode_sum(exact, f,
                                generator=torch.Generator(device=device).manual_seed(5))
        after = block.view()[:, :f.stored_bytes]
        assert torch.equal(after[uidx.to(device)], want)
        others = torch.ones(300, dtype=torch.bool)
        others[uidx] = False
        assert torch.equal(after[others.to(device)], before[others.to(device)])
        got, exact = quant.decode(want, f).cpu(), exact.cpu()
        below, above = (quant.decode(s, f) for s in quant.steps_around(exact, f))
        assert bool(((got == below) | (got == above)).all())
        assert bool(((got - exact).abs() <= quant.error_bound(want.cpu(), f, stochastic=True)
                     ).all())
        changed, _, overflowed = block.changes_since(cursor)
        assert not overflowed and sorted(changed.tolist()) == uidx.tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_many_small_deltas_add_up(fmt: torch.dtype, device: str, table_name: str) -> None:
    """A thousand accumulates of a delta well under half a step end near the exact sum
    (tests/quant_drift.py), where rounding to nearest would lose every one."""
    case = quant_drift.scenario(fmt)
    idx = torch.arange(quant_drift.ROWS).to(device)
    with DistMemBlock(quant_drift.ROWS, quant_drift.DIM, fmt, devices=_devices(device),
                      name=table_name) as block:
        block.write(idx, case.start.to(device))
        start = block.read(idx.cpu())
        delta = case.delta.to(device)
        quant.seed_rounding(0)
        with quant_drift.one_thread():
            for _ in range(quant_drift.ADDS):
                block.accumulate(idx, delta)
        quant_drift.check_drift(case, start, block.read(idx.cpu()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_refused_rows_and_arguments_write_nothing(fmt: torch.dtype, device: str,
                                                  table_name: str) -> None:
    f = RowFormat(fmt, DIM)
    with DistMemBlock(10, DIM, fmt, devices=_devices(device), name=table_name) as block:
        block.write(torch.arange(10), _rows(10, seed=6))
        before = block.view().clone()
        cursor = block.change_cursor
        nan = _rows(2, seed=7)
        nan[1, 3] = float("nan")
        bad_bytes = quant.encode(_rows(2, seed=8), f)
        bad_bytes[1, f.meta_offset:f.meta_offset + 4] = torch.tensor(
            [float("inf")]).view(torch.uint8)  # a scale of infinity: rows not finite
        huge = torch.full((2, DIM), 3e38)
        for call, error, match in [
                (lambda: block.write(torch.tensor([1, 6]), nan), NonFiniteValuesError,
                 "index 6.*finite rows only"),
                (lambda: block.write(torch.tensor([1, 6]), bad_bytes), NonFiniteValuesError,
                 "stored rows.*index 6"),
                (lambda: block.accumulate(torch.tensor([5, 6]), nan, allow_nonfinite=True),
                 NonFiniteValuesError, "index 6"),
                (lambda: block.write(torch.tensor([2]), torch.ones(1, DIM, dtype=torch.int32)),
                 BadArgumentError, "float rows"),
                (lambda: block.write(torch.tensor([2]), torch.ones(1, 4, dtype=torch.uint8)),
                 BadArgumentError, f"uint8 \\(1, {f.stored_bytes}\\)"),
                (lambda: block.write(torch.tensor([2]), torch.ones(1, DIM + 1)),
                 BadArgumentError, "float rows"),
                (lambda: block.write(torch.tensor([10]), torch.ones(1, DIM)),
                 BadArgumentError, r"\[0, 10\)"),
                (lambda: block.accumulate(torch.tensor([2]), torch.ones(1, DIM).half()),
                 BadArgumentError, "float32"),
                (lambda: block.accumulate(torch.tensor([2]), torch.ones(1, DIM + 1)),
                 BadArgumentError, "deltas")]:
            with pytest.raises(error, match=match):
                call()
        block.write(torch.tensor([3, 4]), huge)
        before = block.view().clone()
        with pytest.raises(NonFiniteValuesError, match="rows plus deltas.*index 3"):
            block.accumulate(torch.tensor([3, 4]), huge)  # a sum float32 cannot hold
        assert torch.equal(block.view(), before)
        assert block.changes_since(cursor)[0].tolist() == [3, 4]  # the write of huge only
    for bad in (torch.int16, torch.uint8, "int8"):
        with pytest.raises(BadArgumentError, match="dtype must be one of"):
            DistMemBlock(10, DIM, bad, devices="cpu", name=fresh_name())


def test_ranks_joining_with_another_dtype_are_refused() -> None:
    tmp.spawn(distmem_ranks.entry, args=(2, free_port(), "mismatch_dtype", "cpu", fresh_name()),
              nprocs=2, join=True)


@pytest.mark.parametrize("kind", [pytest.param("cpu"),
                                  pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])])
def test_two_ranks_share_a_quantized_block_and_lose_no_addition(kind: str) -> None:
    tmp.spawn(distmem_ranks.entry, args=(2, free_port(), "quantized", kind, fresh_name()),
              nprocs=2, join=True)
