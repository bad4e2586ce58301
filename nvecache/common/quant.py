"""Quantized rows: encoding float rows into a quantized :class:`~nvecache.common.rows.RowFormat`'s
stored bytes, and decoding them, in torch (the reference every kernel that dequantizes is
tested against, and the CPU tiers' own path), vectorized over the batch.

A stored row is ``fmt.stored_bytes`` bytes: the payload (``dim`` one-byte elements), then,
from ``fmt.meta_offset``, little-endian float32 parameters:

- ``int8``: ``scale, bias``; element ``q`` (-128..127) reads as ``q * scale + bias``. The
  row's range ``[min, max]`` maps onto the 256 steps (``scale = (max - min) / 255``), so
  each element reads back within half a step (``scale / 2``) of what was written, plus
  float32 rounding (rounded to nearest; one step when rounded stochastically, below); a
  constant row reads back exactly (``scale = 0``, ``bias`` the value).
- ``float8_e4m3fn``: ``scale``; element ``q`` reads as ``float(q) * scale``, where
  ``scale = max|x| / 448`` (448: e4m3fn's largest finite value), so each element reads back
  within e4m3's rounding of ``x / scale`` (3 mantissa bits: a relative error of at most
  2**-4 for the normal range, an absolute one of 2**-10 * scale below it; twice that when
  rounded stochastically); a zero row reads back as zeros.

Writes (insert, update, loads) round each element to the nearest step. An accumulate
stores the sum of a decoded row and its deltas with stochastic rounding instead
(:func:`encode_sum`, the one rule every tier's accumulate and a training step over a
quantized table apply): each element is rounded to the step below or above it, the upper
with probability equal to where it lies between them, so the stored row equals the sum in
expectation and repeated deltas under half a step add up instead of rounding away (to
nearest, a row accumulated a thousand times by a twentieth of a step never moves). The
price: such an element reads back within one step of the sum, not half of one
(:func:`error_bound` with ``stochastic=True``), and as each accumulate's rounding error
has mean zero whatever the row was before, the error of many accumulates grows as the
square root of their number (standard deviation at most ``sqrt(n) / 2`` steps), not
linearly.

Rows holding NaN or an infinity cannot be encoded (their range is not finite): the tiers
refuse them before encoding, with their own typed error; :func:`encode` raises
:class:`~nvecache.common.rows.RowFormatError` if given one.

On the CPU, encoding to nearest and decoding run in compiled loops once they are ready
(:mod:`nvecache.common.quant_loops`: a pass or two over each row, the same bits; the
batch split over a few threads when large), this module's torch code until then and
everywhere else (CUDA tensors, stochastic rounding): the reference the loops and every
kernel that dequantizes are tested against.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import numpy as np
import torch

from nvecache.common.fanout import split_run
from nvecache.common.finite import nonfinite_rows
from nvecache.common.loop_gate import LoopGate
from nvecache.common.rows import RowFormat, RowFormatError

__all__ = ["decode", "encode", "encode_finite", "encode_sum", "error_bound", "parameters",
           "rounding_generator", "seed_rounding", "steps_around"]

#: e4m3fn's largest finite magnitude
FP8_MAX = 448.0


def _check(fmt: RowFormat) -> None:
    if not fmt.quantized:
        raise RowFormatError(f"{fmt.dtype} rows are not quantized: store them as they are")


def encode(values: torch.Tensor, fmt: RowFormat, *, stochastic: bool = False,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """``[N, fmt.stored_bytes]`` uint8: rows ``values`` (``[N, fmt.dim]``, any float dtype,
    finite) in ``fmt``'s quantized bytes (the padding between payload and parameters zero).

    By default each element is rounded to the nearest step. With ``stochastic=True`` it is
    rounded to one of the two steps around it (:func:`steps_around`), the upper one with
    probability equal to where it lies between them (uniform draws from ``generator``, on
    the rows' device), so the decoded row equals the written one in expectation: what an
    accumulate writes (:func:`encode_sum`), so that repeated deltas under half a step add
    up instead of rounding away (each element then reads back within one step, not half
    of one). The row's parameters (scale, bias) are the same either way: they depend on
    its range only.

    Raises:
        RowFormatError: ``fmt`` is not quantized, ``values`` is not ``[N, fmt.dim]`` of a
            floating dtype, or a row holds NaN or an infinity.
    """
    return _encode(values, fmt, "stochastic" if stochastic else "nearest", generator)


def encode_finite(values: torch.Tensor, fmt: RowFormat
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(stored, bad)``: rows ``values`` encoded as :func:`encode` encodes them, except
    that a row holding NaN or an infinity is left zeros instead of refused; ``bad``: bool
    ``[N]`` marking those rows (None: every row is finite).

    Raises:
        RowFormatError: as :func:`encode`, a non-finite row excepted.
    """
    x = _rows_of(values, fmt)
    loops = _loops(x)
    if loops is not None:
        return _encode_loops(loops, x, fmt)
    bad = nonfinite_rows(x)
    if bad is None:
        return _encode_torch(x, fmt, "nearest", None), None
    stored = torch.zeros(x.shape[0], fmt.stored_bytes, dtype=torch.uint8, device=x.device)
    good = ~bad
    stored[good] = _encode_torch(x[good], fmt, "nearest", None)
    return stored, bad


#: the compiled loops once ready; this module's torch code serves until then
_LOOPS = LoopGate("nvecache.common.quant_loops", sys.modules[__name__])


def _loops(t: torch.Tensor) -> Any:
    """The compiled loops for a tensor on the CPU once they are ready (asked for on the
    first call), else None: the torch code serves."""
    if t.device.type != "cpu":
        return None
    m = _LOOPS.pick()
    return None if m is _LOOPS.twin else m


def _encode_loops(loops: Any, x: torch.Tensor, fmt: RowFormat
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`encode_finite` by the compiled loops: ``x`` float32 ``[N, dim]`` on the CPU."""
    xs = x.detach().contiguous().numpy()
    n = xs.shape[0]
    out = np.zeros((n, fmt.stored_bytes), np.uint8)
    bad = np.zeros(n, np.bool_)
    fp8 = fmt.dtype != "int8"
    nbad = sum(split_run(lambda lo, hi: loops.encode(xs[lo:hi], out[lo:hi], fmt.meta_offset,
                                                     bad[lo:hi], fp8), n))
    return torch.from_numpy(out), torch.from_numpy(bad) if nbad else None


def encode_sum(values: torch.Tensor, fmt: RowFormat, *,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """What an accumulate stores of ``values``, rows that are a decoded row plus its summed
    float32 deltas: :func:`encode` with stochastic rounding (the module docstring says
    why). The one rule of every quantized table's accumulate (the host tables, the
    parameter servers, a ``gpu.DistMemBlock``) and of a training step written to one;
    writes of new rows (insert, update, loads) round to nearest.

    Draws come from ``generator``, by default this process's rounding generator of the
    rows' device (:func:`rounding_generator`: processes round independently, the caller's
    torch random streams are left alone; :func:`seed_rounding` makes a run repeatable).

    Raises:
        RowFormatError: as :func:`encode`.
    """
    if generator is None and isinstance(values, torch.Tensor):
        generator = rounding_generator(values.device)
    return encode(values, fmt, stochastic=True, generator=generator)


class _Rounding:
    """This process's rounding generators, one per device (see :func:`rounding_generator`)."""

    lock = threading.Lock()
    pid = os.getpid()
    seed: int | None = None
    generators: dict[str, torch.Generator] = {}


def rounding_generator(device: torch.device | str) -> torch.Generator:
    """The generator an accumulate's stochastic rounding draws from on ``device``
    (:func:`encode_sum`): one per process and device, seeded from the OS's entropy when
    first used (and again in a forked child), so that processes adding to one shared table
    round independently of each other, and the caller's own torch random streams (dropout,
    sampling) are not consumed; :func:`seed_rounding` seeds them all instead."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    key = str(dev)
    with _Rounding.lock:
        if _Rounding.pid != os.getpid():  # NOTE: a forked child: not its parent's draws
            _Rounding.pid, _Rounding.generators = os.getpid(), {}
        g = _Rounding.generators.get(key)
        if g is None:
            g = torch.Generator(device=dev)
            seed = _Rounding.seed
            g.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1 if seed is None
                          else seed)
            _Rounding.generators[key] = g
    return g


def seed_rounding(seed: int) -> None:
    """Seed this process's rounding generators (:func:`rounding_generator`), those of
    devices used later too, with ``seed``: an accumulate's draws on a device are then those
    of ``torch.Generator(device).manual_seed(seed)``, so a run repeats (tests, benches)."""
    with _Rounding.lock:
        _Rounding.seed = int(seed)
        for g in _Rounding.generators.values():
            g.manual_seed(int(seed))


def steps_around(values: torch.Tensor, fmt: RowFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``(below, above)``: rows ``values`` encoded as :func:`encode` does (the same
    parameters), each element rounded to the step at or below it, and to a step above it
    (int8: the next step up; fp8: the step at or above it in magnitude, so a positive
    element lying on a step gets that step in both). Stochastic rounding picks each
    element from these two; rounding to nearest picks one of them too.

    Raises:
        RowFormatError: as :func:`encode`.
    """
    return (_encode(values, fmt, "below", None), _encode(values, fmt, "above", None))


def _encode(values: torch.Tensor, fmt: RowFormat, how: str,
            generator: torch.Generator | None) -> torch.Tensor:
    """:func:`encode`, each element rounded ``how``: ``"nearest"``, ``"stochastic"``,
    ``"below"`` or ``"above"`` (:func:`steps_around`)."""
    x = _rows_of(values, fmt)
    n = x.shape[0]
    loops = _loops(x) if how == "nearest" and n else None
    if loops is not None:
        stored, bad = _encode_loops(loops, x, fmt)
        if bad is not None:
            raise RowFormatError("a row holds NaN or an infinity: quantized rows must be "
                                 "finite")
        return stored
    return _encode_torch(x, fmt, how, generator)


def _encode_torch(x: torch.Tensor, fmt: RowFormat, how: str,
                  generator: torch.Generator | None) -> torch.Tensor:
    """:func:`_encode` in torch (float32 rows ``x``, checked): the reference."""
    n = x.shape[0]
    out = torch.zeros(n, fmt.stored_bytes, dtype=torch.uint8, device=x.device)
    if n == 0:
        return out
    if not bool(torch.isfinite(x).all()):
        raise RowFormatError("a row holds NaN or an infinity: quantized rows must be finite")
    if fmt.dtype == "int8":
        lo, hi = x.aminmax(dim=1, keepdim=True)
        scale = (hi - lo) / _divisor(x, 255.0)
        bias = lo + 128.0 * scale
        safe = torch.where(scale > 0, scale, 1.0)
        t = (x - bias) / safe
        down = torch.floor(t)
        # NOTE: stochastic: floor(t) + 1 with probability t - floor(t), so an element on
        # a step (the row's min and max) stays on it; floor(t + u) would now and then
        # round t + u up to the next step (a 2**-18 chance at t = -128)
        q = (torch.round(t) if how == "nearest" else down if how == "below"
             else down + 1 if how == "above"
             else down + (_uniform(t, generator) < t - down).float())
        q = torch.where(scale > 0, q.clamp_(-128, 127), 0.0).to(torch.int8)
        params = torch.cat([scale, torch.where(scale > 0, bias, lo)], dim=1)
    else:
        scale = x.abs().amax(dim=1, keepdim=True) / _divisor(x, FP8_MAX)
        safe = torch.where(scale > 0, scale, 1.0)
        y = (x / safe).clamp_(-FP8_MAX, FP8_MAX)
        q = (y.to(torch.float8_e4m3fn) if how == "nearest"
             else _e4m3_stochastic(y, generator) if how == "stochastic"
             else _e4m3(y, how))
        params = scale
    out[:, :fmt.dim] = q.view(torch.uint8)
    out[:, fmt.meta_offset:fmt.stored_bytes] = params.contiguous().view(torch.uint8)
    return out


def _rows_of(values: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    """``values`` in float32, checked to be rows ``fmt`` can encode."""
    _check(fmt)
    if (not isinstance(values, torch.Tensor) or values.dim() != 2
            or values.shape[1] != fmt.dim or not values.is_floating_point()):
        raise RowFormatError(f"rows to quantize must be a float [N, {fmt.dim}] tensor")
    return values.float()


def _divisor(like: torch.Tensor, value: float) -> torch.Tensor:
    """``value`` as a float32 tensor on ``like``'s device, to divide by: CUDA divides by a
    Python number as a multiplication by its reciprocal, which rounds differently from the
    CPU's division (a row's scale would then differ by a bit between the devices)."""
    return torch.full((1, 1), value, dtype=torch.float32, device=like.device)


def _uniform(like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Uniform draws in ``[0, 1)`` of ``like``'s shape, float32, on its device."""
    return torch.rand(like.shape, generator=generator, device=like.device,
                      dtype=torch.float32)


#: e4m3fn's smallest normal magnitude (below it the step is 2**-9 throughout)
FP8_MIN_NORMAL = 2.0 ** -6
#: float32 mantissa bits below e4m3's 3
_DROPPED = 23 - 3


def _e4m3_stochastic(y: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``y`` (float32, within +-448) rounded stochastically to e4m3fn: its magnitude to the
    step below or above it, the upper with probability by where it lies between them. A
    uniform integer below ``2**20`` is added to the magnitude's float32 bits before the 20
    bits e4m3 does not keep are cut (a carry is the step up, exact in float32, and 448 is
    a step: nothing passes it). Below e4m3's smallest normal the step is ``2**-9``
    throughout: those magnitudes get ``2**-6`` added first, which puts them in the binade
    whose step is that, and taken off after (exact)."""
    mag = y.abs()
    bits = torch.randint(0, 1 << _DROPPED, mag.shape, generator=generator, device=mag.device,
                         dtype=torch.int32)
    off = torch.where(mag < FP8_MIN_NORMAL, FP8_MIN_NORMAL, 0.0)
    bits += (mag + off).view(torch.int32)
    pick = (bits & ~((1 << _DROPPED) - 1)).view(torch.float32) - off
    return torch.copysign(pick, y).to(torch.float8_e4m3fn)


def _e4m3(y: torch.Tensor, how: str) -> torch.Tensor:
    """``y`` (float32, within +-448) rounded to the e4m3fn step below or above it in value
    (``how``: ``"below"``, ``"above"``; :func:`steps_around`): its magnitude's neighbours by
    their bits (e4m3fn's positive values are ordered as their bit patterns)."""
    mag = y.abs()
    near = mag.to(torch.float8_e4m3fn)
    bits = near.view(torch.uint8).to(torch.int16)
    nearf = near.float()
    # NOTE: the other neighbour is one bit pattern up or down; |y| <= 448 = 0x7E, so up
    # stays finite (a nearest of 0x7E is never below |y|), and down never passes zero
    up = nearf < mag
    other = torch.where(up, bits + 1, bits - 1).clamp_(0, 0x7E)
    otherf = other.to(torch.uint8).view(torch.float8_e4m3fn).float()
    lo = torch.where(up, nearf, otherf)
    hi = torch.where(up, otherf, nearf)
    neg = y < 0
    if how == "below":  # NOTE: in value: a negative y's step below has the larger magnitude
        pick = torch.where(neg, hi, torch.where(mag < hi, lo, hi))
    else:
        pick = torch.where(neg, lo, hi)
    return torch.where(neg, -pick, pick).to(torch.float8_e4m3fn)


def parameters(stored: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    """float32 ``[N, 2]`` (int8: scale, bias) or ``[N, 1]`` (fp8: scale) of stored rows
    ``[N, >= fmt.stored_bytes]`` uint8."""
    _check(fmt)
    raw = stored[:, fmt.meta_offset:fmt.stored_bytes].contiguous()
    return raw.view(torch.float32)


def decode(stored: torch.Tensor, fmt: RowFormat, dtype: torch.dtype = torch.float32, *,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``[N, fmt.dim]`` of ``dtype`` read from stored rows ``[N, >= fmt.stored_bytes]``
    uint8 (bytes past ``stored_bytes``, a stride's padding, ignored); computed in float32,
    rounded once to ``dtype`` (to nearest, ties to even).

    ``out``: a ``[N, fmt.dim]`` tensor on ``stored``'s device to decode into (its dtype, not
    ``dtype``, is the rows'), returned; the same values bit for bit, without the payload's
    float32 copy (a float32 ``out`` is computed in place; another dtype through one float32
    buffer)."""
    if out is None:
        out = torch.empty((stored.shape[0], fmt.dim), dtype=dtype, device=stored.device)
    return _decode_into(stored, fmt, out)


def _decode_into(stored: torch.Tensor, fmt: RowFormat, out: torch.Tensor) -> torch.Tensor:
    """:func:`decode` into ``out``: the payload converted (exactly) into float32, then the
    product and the sum each rounded (no fused multiply-add: the GPU kernels that dequantize
    compute it the same way, so every reader gets the same bits), then rounded once to
    ``out``'s dtype."""
    _check(fmt)
    if out.shape != (stored.shape[0], fmt.dim) or not out.is_floating_point():
        raise RowFormatError(f"out must be a float [{stored.shape[0]}, {fmt.dim}] tensor")
    loops = _loops(stored)
    if loops is not None and stored.shape[0]:
        _decode_loops(loops, stored, fmt, out)
        return out
    return _decode_torch(stored, fmt, out)


def _decode_torch(stored: torch.Tensor, fmt: RowFormat, out: torch.Tensor) -> torch.Tensor:
    """:func:`_decode_into` in torch: the reference."""
    params = parameters(stored, fmt)
    payload = stored[:, :fmt.dim].view(torch.int8 if fmt.dtype == "int8"
                                       else torch.float8_e4m3fn)
    rows = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32,
                                                              device=out.device)
    if fmt.dtype == "int8" or payload.device.type != "cpu":
        rows.copy_(payload)
    else:
        _fp8_on_cpu(payload, rows)
    rows.mul_(params[:, 0:1])
    if fmt.dtype == "int8":
        rows.add_(params[:, 1:2])
    if rows is not out:
        out.copy_(rows)
    return out


def _decode_loops(loops: Any, stored: torch.Tensor, fmt: RowFormat, out: torch.Tensor
                  ) -> None:
    """:func:`_decode_into` by the compiled loops (``stored`` and ``out`` on the CPU)."""
    direct = out.dtype == torch.float32 and out.is_contiguous()
    rows = out if direct else torch.empty(out.shape, dtype=torch.float32)
    src, dst = stored[:, :fmt.stored_bytes].numpy(), rows.detach().numpy()
    meta = fmt.meta_offset
    if fmt.dtype == "int8":
        split_run(lambda lo, hi: loops.decode_int8(src[lo:hi], meta, dst[lo:hi]),
                  dst.shape[0])
    else:
        table = _E4M3_VALUES.numpy()
        split_run(lambda lo, hi: loops.decode_fp8(src[lo:hi], meta, table, dst[lo:hi]),
                  dst.shape[0])
    if not direct:
        out.copy_(rows)


#: float32 of each of e4m3fn's 256 bit patterns (torch's conversion of each, once)
_E4M3_VALUES = torch.arange(256).to(torch.uint8).view(torch.float8_e4m3fn).float()


def _fp8_on_cpu(payload: torch.Tensor, rows: torch.Tensor) -> None:
    """``rows`` (float32) = e4m3fn ``payload`` on the CPU, by a table of the 256 bit
    patterns' values (exact, the values torch's conversion gives), faster than torch's
    element-wise CPU conversion (bench/RESULTS.md, "Quantized rows: layers")."""
    idx = payload.view(torch.uint8).to(torch.int64)
    if rows.is_contiguous():
        torch.index_select(_E4M3_VALUES, 0, idx.view(-1), out=rows.view(-1))
    else:
        rows.copy_(_E4M3_VALUES[idx])


def error_bound(stored: torch.Tensor, fmt: RowFormat, *, stochastic: bool = False
                ) -> torch.Tensor:
    """float32 ``[N, 1]``: the most an element of each stored row may differ from the value
    it was encoded from: rounded to nearest, int8: half a step and float32 rounding; fp8:
    e4m3's rounding of the row's largest magnitude, ``2**-4 * 448 * scale``, an upper bound
    for every element. Rounded stochastically (``stochastic=True``: an accumulate's rows,
    :func:`encode_sum`), one step instead of half: int8 ``scale`` and float32 rounding;
    fp8 ``2**-3 * 448 * scale``."""
    params = parameters(stored, fmt)
    steps = 1.0 if stochastic else 0.5
    if fmt.dtype == "int8":
        scale, bias = params[:, 0:1], params[:, 1:2]
        magnitude = bias.abs() + 128.0 * scale
        return scale * steps + magnitude * 2.0 ** -22
    return params * (FP8_MAX * 2.0 ** -3 * steps)
