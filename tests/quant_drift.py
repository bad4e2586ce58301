"""Many small accumulates into quantized rows: the scenario every tier's test runs
(SharedMemBlock, HostCache, the parameter servers, DistMemBlock) and its statistical check.

:func:`scenario` gives rows whose quantization step stays the same while
:data:`ADDS` accumulates of a delta well under half a step (int8: a twentieth of a step;
fp8: about a hundredth) move most elements by 51 steps (int8) or 7 (fp8): the rows' range (int8) or
largest magnitude (fp8) is held by elements that get no delta, and the moving elements
stay inside it. Rounded to nearest, each addition rounds back to the row it started from
and the rows never move (:func:`nearest_run`, the comparison); rounded stochastically
(what every accumulate of a quantized table does: ``quant.encode_sum``) they end near
the exact sum.

The bound (:func:`check_drift`): the error of an element after ``n`` accumulates is a sum
of ``n`` rounding errors, each of mean zero whatever came before and lying in an interval
one step wide (``Drift.step``, the largest step a moving element meets). So the mean
error over the ``m`` moving elements has a standard deviation of at most
``sqrt(n / m) * step / 2``, and by Azuma-Hoeffding it exceeds 6 of those with
probability below ``2 exp(-18)`` (4e-8), whatever the seed: the tests fix their seed
anyway. The tolerance is under a twentieth of what rounding to nearest loses.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from nvecache.common import quant
from nvecache.common.rows import RowFormat

#: accumulates per run
ADDS = 1000
#: rows and dim of a run (each accumulate adds to every row)
ROWS, DIM = 16, 128
#: standard deviations of the bound
SIGMAS = 6.0


@dataclass(frozen=True)
class Drift:
    """One format's scenario."""

    fmt: RowFormat
    #: float32 ``[ROWS, DIM]``: the rows written first
    start: torch.Tensor
    #: float32 ``[ROWS, DIM]``: what each accumulate adds (zero where an element holds the
    #: rows' range)
    delta: torch.Tensor
    #: the largest quantization step a moving element meets along the way
    step: float

    @property
    def moving(self) -> torch.Tensor:
        """bool ``[ROWS, DIM]``: the elements that get a delta."""
        return self.delta != 0


def scenario(dtype: torch.dtype | str, seed: int = 0) -> Drift:
    """The rows and delta of ``dtype``'s run (see the module docstring)."""
    fmt = RowFormat(dtype, DIM)
    gen = torch.Generator().manual_seed(seed)
    sign = torch.where(torch.rand(ROWS, DIM, generator=gen) < 0.5, -1.0, 1.0)
    if fmt.dtype == "int8":
        # range [-1, 1] held by elements 0 and 1: step 2 / 255; the others start in
        # [-0.25, 0.25] and move by 0.4 (51 steps) either way
        start = torch.rand(ROWS, DIM, generator=gen) * 0.5 - 0.25
        start[:, 0], start[:, 1] = -1.0, 1.0
        delta = sign * (0.4 / ADDS)  # 0.05 of a step
        delta[:, :2] = 0.0
        step = 2.0 / 255.0
    else:
        # largest magnitude 1 held by element 0: scale 1 / 448; the others start at
        # magnitudes in [0.15, 0.2] and grow by 0.25 to at most 0.45, below 256 / 448,
        # where e4m3's step of x / scale is at most 16
        start = sign * (torch.rand(ROWS, DIM, generator=gen) * 0.05 + 0.15)
        start[:, 0] = 1.0
        delta = sign * (0.25 / ADDS)  # 0.014 of the step at 64..128, 0.007 above
        delta[:, 0] = 0.0
        step = 16.0 / 448.0
    return Drift(fmt, start, delta, step)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread while a run's thousand small calls go (on a busy machine two
    threads' hand-offs cost tens of milliseconds a call); the count is restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tolerance(case: Drift, n: int = ADDS) -> float:
    """The bound on the mean error over the moving elements after ``n`` accumulates."""
    m = int(case.moving.sum())
    return SIGMAS * math.sqrt(n / m) * case.step / 2


def nearest_run(case: Drift, start: torch.Tensor, n: int = ADDS) -> torch.Tensor:
    """The rows after ``n`` accumulates from ``start`` (as read back) rounded to nearest,
    computed with the codec: the comparison."""
    stored = quant.encode(start, case.fmt)
    with one_thread():
        for _ in range(n):
            stored = quant.encode(quant.decode(stored, case.fmt) + case.delta, case.fmt)
    return quant.decode(stored, case.fmt)


def mean_error(case: Drift, start: torch.Tensor, final: torch.Tensor, n: int = ADDS) -> float:
    """The mean, over the moving elements, of how far ``final`` is from ``start`` plus ``n``
    deltas, signed along each delta (negative: short of the exact sum)."""
    err = (final.double() - start.double() - n * case.delta.double()) * case.delta.sign()
    return float(err[case.moving].mean())


def check_drift(case: Drift, start: torch.Tensor, final: torch.Tensor, n: int = ADDS) -> None:
    """``final`` (rows read back after ``n`` accumulates of ``case.delta`` into rows read
    back as ``start``) is within :func:`tolerance` of the exact sum on average, while
    rounding to nearest would have lost every delta; elements without a delta kept their
    value."""
    start, final = start.cpu().float(), final.cpu().float()
    lost = nearest_run(case, start, n)
    assert torch.equal(lost, start), "the scenario must be one rounding to nearest loses"
    assert mean_error(case, start, lost, n) < -0.9 * n * float(case.delta.abs().max())
    err = mean_error(case, start, final, n)
    assert abs(err) <= tolerance(case, n), (err, tolerance(case, n))
    assert torch.equal(final[~case.moving], start[~case.moving])
