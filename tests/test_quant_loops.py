"""The quantized codec's compiled loops (nvecache.common.quant_loops) against its torch code
(nvecache.common.quant), the reference: the same stored bytes and the same decoded bits
for random rows of odd dims, every spread and offset, ties, signed zeros, subnormal fp8,
constant rows; every float32 the fp8 conversion can meet near e4m3's steps; non-finite
rows marked, not encoded; and the public functions answering the same whichever serves."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nvecache.common import quant, quant_loops
from nvecache.common.rows import QUANTIZED, RowFormat

DIMS = [1, 2, 5, 13, 128, 129]


def loops_encode(x: torch.Tensor, fmt: RowFormat) -> tuple[torch.Tensor, np.ndarray]:
    out = np.zeros((x.shape[0], fmt.stored_bytes), np.uint8)
    bad = np.zeros(x.shape[0], np.bool_)
    nbad = quant_loops.encode(x.contiguous().numpy(), out, fmt.meta_offset, bad,
                              fmt.dtype != "int8")
    assert nbad == int(bad.sum())
    return torch.from_numpy(out), bad


def loops_decode(stored: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    rows = np.empty((stored.shape[0], fmt.dim), np.float32)
    if fmt.dtype == "int8":
        quant_loops.decode_int8(stored.numpy(), fmt.meta_offset, rows)
    else:
        quant_loops.decode_fp8(stored.numpy(), fmt.meta_offset, quant._E4M3_VALUES.numpy(),
                               rows)
    return torch.from_numpy(rows)


def torch_decode(stored: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    return quant._decode_torch(stored, fmt, torch.empty(stored.shape[0], fmt.dim))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@settings(max_examples=80, deadline=None)
@given(dim=st.sampled_from(DIMS), n=st.integers(1, 40), seed=st.integers(0, 2**31 - 1),
       spread=st.sampled_from([1e-30, 1e-6, 1e-2, 1.0, 1e3, 1e30]),
       offset=st.sampled_from([0.0, -3.0, 1e4]), dtype=st.sampled_from(list(QUANTIZED)),
       grid=st.booleans())
def test_the_loops_store_and_read_the_torch_codes_bits(dim: int, n: int, seed: int,
                                                        spread: float, offset: float,
                                                        dtype: str, grid: bool) -> None:
    fmt = RowFormat(dtype, dim)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=gen) * spread + offset
    if grid:  # NOTE: values on a coarse grid: int8 ties (half steps), repeated extremes
        x = torch.randint(-6, 7, (n, dim), generator=gen).float() / 4 + offset
    x[0, 0] = -0.0
    if n > 1:
        x[1] = x[1, 0]  # a constant row
    want = quant._encode_torch(x, fmt, "nearest", None)
    got, bad = loops_encode(x, fmt)
    assert not bad.any()
    assert torch.equal(got, want)
    assert same_bits(loops_decode(want, fmt), torch_decode(want, fmt))


@pytest.mark.parametrize("dtype", list(QUANTIZED))
def test_rows_of_signed_zeros_store_the_torch_codes_parameters(dtype: str) -> None:
    # NOTE: a row of zeros of both signs: its range is zero and an int8 row stores its least
    # element as the bias, so which zero is the least shows in the stored bytes
    fmt = RowFormat(dtype, 128)
    rows = []
    for p in range(0, 128, 7):
        one_negative = torch.zeros(128)
        one_negative[p] = -0.0
        one_positive = torch.full((128,), -0.0)
        one_positive[p] = 0.0
        rows += [one_negative, one_positive]
    x = torch.stack(rows)
    got, _ = loops_encode(x, fmt)
    assert torch.equal(got, quant._encode_torch(x, fmt, "nearest", None))


def test_every_float32_near_an_e4m3_step_converts_as_torch_converts() -> None:
    # NOTE: each e4m3 magnitude, the float32 values around it and the midpoints to its
    # neighbours (the ties), both signs; a row whose largest magnitude is 448 has scale 1,
    # so the loop converts these very values
    steps = quant._E4M3_VALUES[:0x7F].double()
    mids = (steps[:-1] + steps[1:]) / 2
    centres = torch.cat([steps, mids]).float()
    bits = centres.view(torch.int32)[:, None] + torch.arange(-3, 4, dtype=torch.int32)
    vals = bits.view(torch.float32).reshape(-1)
    vals = vals[(vals.abs() <= 448) & torch.isfinite(vals)]
    vals = torch.cat([vals, -vals, torch.tensor([0.0, -0.0])])
    dim = 127
    pad = (-vals.numel()) % dim
    vals = torch.cat([vals, torch.zeros(pad)]).reshape(-1, dim)
    x = torch.cat([vals, torch.full((vals.shape[0], 1), 448.0)], dim=1)
    fmt = RowFormat("float8_e4m3fn", dim + 1)
    got, _ = loops_encode(x, fmt)
    assert torch.equal(got[:, :dim], x[:, :dim].to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(got, quant._encode_torch(x, fmt, "nearest", None))


@pytest.mark.parametrize("dtype", list(QUANTIZED))
@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), -float("inf")])
def test_a_row_that_is_not_finite_is_marked_and_left_zero(dtype: str,
                                                           bad_value: float) -> None:
    fmt = RowFormat(dtype, 5)
    x = torch.randn(4, 5)
    x[2, 4] = bad_value
    got, bad = loops_encode(x, fmt)
    assert bad.tolist() == [False, False, True, False]
    assert not bool(got[2].any())
    good = torch.tensor([0, 1, 3])
    assert torch.equal(got[good], quant._encode_torch(x[good], fmt, "nearest", None))


@pytest.mark.parametrize("dtype", list(QUANTIZED))
def test_the_public_codec_answers_the_same_whichever_serves(dtype: str) -> None:
    fmt = RowFormat(dtype, 13)
    x = torch.randn(3000, 13, generator=torch.Generator().manual_seed(5)) * 7
    assert quant._LOOPS.wait(300), "the compiled loops did not become ready"
    stored = quant.encode(x, fmt)  # NOTE: the loops, over a few threads (3,000 rows)
    assert torch.equal(stored, quant._encode_torch(x, fmt, "nearest", None))
    for out in (torch.float32, torch.float16, torch.bfloat16):
        assert torch.equal(quant.decode(stored, fmt, out),
                           torch_decode(stored, fmt).to(out))
    padded = torch.full((3000, fmt.stride), 0xAB, dtype=torch.uint8)
    padded[:, :fmt.stored_bytes] = stored
    assert same_bits(quant.decode(padded, fmt), torch_decode(stored, fmt))
    x[7, 3] = float("nan")
    stored2, bad = quant.encode_finite(x, fmt)
    assert bad is not None and bad.nonzero().view(-1).tolist() == [7]
    assert not bool(stored2[7].any())
    keep = torch.ones(3000, dtype=torch.bool)
    keep[7] = False
    assert torch.equal(stored2[keep], stored[keep])
