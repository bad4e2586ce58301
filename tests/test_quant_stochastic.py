"""Stochastic rounding in the quantized codec (``quant.encode(stochastic=True)``,
``quant.encode_sum``: what every accumulate stores): each element is one of the two steps
around it (``quant.steps_around``) with the parameters of rounding to nearest, within the
documented one-step bound, unbiased, an element on a step kept exactly, repeatable with a
generator; and many small deltas add up where rounding to nearest loses them."""

from __future__ import annotations

import math
import multiprocessing as mp

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nvecache.common import quant
from nvecache.common.rows import QUANTIZED, RowFormat
from tests import quant_drift

DIMS = [1, 2, 5, 13, 128, 129]


def one_of_the_steps(stored: torch.Tensor, values: torch.Tensor, fmt: RowFormat) -> bool:
    """Whether every element of ``stored`` reads as the step below or above its value, with
    the parameters rounding to nearest gives."""
    below, above = (quant.decode(s, fmt) for s in quant.steps_around(values, fmt))
    got = quant.decode(stored, fmt)
    same = torch.equal(quant.parameters(stored, fmt),
                       quant.parameters(quant.encode(values, fmt), fmt))
    return same and bool(((got == below) | (got == above)).all())


@settings(max_examples=60, deadline=None)
@given(dim=st.sampled_from(DIMS), n=st.integers(0, 20), seed=st.integers(0, 2**31 - 1),
       spread=st.sampled_from([1e-6, 1e-2, 1.0, 1e3, 1e6]),
       offset=st.sampled_from([0.0, -3.0, 1e4]), dtype=st.sampled_from(list(QUANTIZED)))
def test_each_element_is_a_step_beside_it_within_one_step(
        dim: int, n: int, seed: int, spread: float, offset: float, dtype: str) -> None:
    fmt = RowFormat(dtype, dim)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=gen) * spread + offset
    stored = quant.encode_sum(x, fmt, generator=gen)
    assert stored.shape == (n, fmt.stored_bytes)
    assert one_of_the_steps(stored, x, fmt)
    err = (quant.decode(stored, fmt) - x).abs()
    assert bool((err <= quant.error_bound(stored, fmt, stochastic=True)).all())
    near = quant.encode(x, fmt)
    assert one_of_the_steps(near, x, fmt)  # NOTE: nearest is one of the two as well
    assert torch.equal(quant.error_bound(stored, fmt, stochastic=True),
                       quant.error_bound(near, fmt, stochastic=True))


@pytest.mark.parametrize("dtype", list(QUANTIZED))
def test_rounding_is_unbiased(dtype: str) -> None:
    """The mean of many encodings of one row is the row: each element's draws lie on two
    steps one step apart, so over K encodings the mean's error has a standard deviation of
    at most step / (2 sqrt(K)); the bound is 6 of those."""
    fmt = RowFormat(dtype, 64)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, 64, generator=gen)
    k = 4000
    stored = quant.encode_sum(x.expand(k, 64), fmt, generator=gen)
    mean = quant.decode(stored, fmt).double().mean(dim=0)
    below, above = (quant.decode(s, fmt)[0].double() for s in quant.steps_around(x, fmt))
    step = above - below  # NOTE: 0 at the row's max (clamped): float32 rounding only
    slack = x[0].double().abs() * 2.0 ** -20
    assert bool(((mean - x[0].double()).abs() <= 6 * step / (2 * math.sqrt(k)) + slack).all())
    # nearest, for comparison, is biased by up to half a step per element
    near = quant.decode(quant.encode(x, fmt), fmt)[0].double()
    assert float((near - x[0].double()).abs().max()) > 10 * float(
        (mean - x[0].double()).abs().max())


@pytest.mark.parametrize("dtype", list(QUANTIZED))
def test_elements_on_a_step_are_kept_and_a_generator_repeats(dtype: str) -> None:
    fmt = RowFormat(dtype, 5)
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0, 255.0], [-1.0, 1.0, 0.25, 0.5, -0.75]])
    exact = quant.decode(quant.encode(x, fmt), fmt)  # every element on a step
    for seed in range(20):
        got = quant.encode_sum(exact, fmt, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(quant.decode(got, fmt), exact)
    y = torch.randn(8, 5, generator=torch.Generator().manual_seed(1))
    a = quant.encode_sum(y, fmt, generator=torch.Generator().manual_seed(9))
    b = quant.encode_sum(y, fmt, generator=torch.Generator().manual_seed(9))
    assert torch.equal(a, b)
    quant.seed_rounding(9)
    c = quant.encode_sum(y, fmt)  # NOTE: the rounding generator, seeded
    assert torch.equal(c, a)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=str)
def test_many_small_deltas_add_up_in_the_codec(dtype: torch.dtype) -> None:
    """The tiers' scenario (tests/quant_drift.py) run on the codec alone: rounding to
    nearest never moves the rows, stochastic rounding ends within the bound."""
    case = quant_drift.scenario(dtype)
    start = quant.decode(quant.encode(case.start, case.fmt), case.fmt)
    stored = quant.encode(start, case.fmt)
    gen = torch.Generator().manual_seed(0)
    with quant_drift.one_thread():
        for _ in range(quant_drift.ADDS):
            stored = quant.encode_sum(quant.decode(stored, case.fmt) + case.delta,
                                      case.fmt, generator=gen)
    quant_drift.check_drift(case, start, quant.decode(stored, case.fmt))


def _rounding_seed() -> int:
    return quant.rounding_generator("cpu").initial_seed()


def test_rounding_draws_from_a_generator_of_its_own_per_process() -> None:
    """An accumulate's rounding leaves torch's default generator alone (a training loop's
    dropout draws the same with or without it), and another process draws other numbers
    (two processes adding to one table do not round alike)."""
    fmt = RowFormat("int8", 16)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(3)
    want = torch.rand(4)
    torch.manual_seed(3)
    quant.encode_sum(x, fmt)
    assert torch.equal(torch.rand(4), want)
    seeds = []
    for _ in range(2):  # NOTE: a process each
        with mp.get_context("spawn").Pool(1) as pool:
            seeds.append(pool.apply(_rounding_seed))
    assert len({*seeds, _rounding_seed()}) == 3
    quant.seed_rounding(4)  # NOTE: seeds the generators that exist and those made later
    assert quant.rounding_generator("cpu").initial_seed() == 4
