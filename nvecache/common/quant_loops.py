"""Quantized rows encoded (rounded to nearest) and decoded on the CPU in compiled loops
(numba): one pass over a row's elements for its range, one to write them, instead of a
dozen torch operations over the batch, each a pass of its own.

The same bits as :mod:`nvecache.common.quant`'s torch code, its twin (tests hold the two
equal): every step is float32 arithmetic, each operation rounded on its own (no fused
multiply-adds: numba emits none without ``fastmath``), rounding half to even, e4m3fn's
conversion by the bits of the float32 value. Only arrays cross the boundary: float32
``[N, dim]`` rows, uint8 ``[N, >= stored_bytes]`` stored rows (the parameters, float32,
from byte ``meta``). Imports numpy and numba only (the loop gate's child compiles it
without its package).
"""

from __future__ import annotations

import threading

import numpy as np
from numba import njit

_jit = njit(cache=True, nogil=True, boundscheck=False)

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_STEPS = np.float32(255.0)
_HALF_RANGE = np.float32(128.0)
_FP8_MAX = np.float32(448.0)
#: float32 bits of e4m3fn's smallest normal magnitude, 2**-6
_MIN_NORMAL_BITS = np.uint32(0x3C800000)
#: float32 to e4m3fn exponent bias, applied in the float32 bits: (7 - 127) << 23
_REBIAS = np.uint32((1 << 32) - (120 << 23))
_SUBNORMAL_STEPS = np.float32(512.0)  # 2**9: a subnormal e4m3 is m * 2**-9


@_jit
def _put_params(out: np.ndarray, i: int, meta: int, params: np.ndarray, count: int) -> None:
    """Row ``i``'s first ``count`` float32 ``params`` into its stored bytes from ``meta``
    (little-endian: this machine's order, as the stored rows' are)."""
    raw = params.view(np.uint8)
    for j in range(4 * count):
        out[i, meta + j] = raw[j]


@_jit
def _row_range(x: np.ndarray, i: int) -> tuple[bool, np.float32, np.float32]:
    """``(finite, lo, hi)``: whether row ``i`` of ``x`` is finite, and its least and
    greatest element (meaningful only where it is)."""
    lo = x[i, 0]
    hi = x[i, 0]
    for j in range(x.shape[1]):
        v = x[i, j]
        if not np.isfinite(v):
            return False, lo, hi
        lo = min(lo, v)
        hi = max(hi, v)
    return True, lo, hi


@_jit
def encode(x: np.ndarray, out: np.ndarray, meta: int, bad: np.ndarray, fp8: bool) -> int:
    """Rows ``x`` (float32 ``[N, dim]``) into ``out`` (uint8 ``[N, stored_bytes]``, zeros),
    each element rounded to the nearest step: row-wise int8, or (``fp8``) float8_e4m3fn
    with a per-row scale. A row holding NaN or an infinity is left zero and marked in
    ``bad``. Returns how many were."""
    nbad = 0
    params = np.empty(2, np.float32)
    y = np.empty(x.shape[1], np.float32)
    for i in range(x.shape[0]):
        finite, lo, hi = _row_range(x, i)
        if not finite:
            bad[i] = True
            nbad += 1
        elif fp8:
            _fp8_row(x, i, lo, hi, out, meta, params, y)
        else:
            _int8_row(x, i, lo, hi, out, meta, params)
    return nbad


@_jit
def _int8_row(x: np.ndarray, i: int, lo: np.float32, hi: np.float32, out: np.ndarray,
              meta: int, params: np.ndarray) -> None:
    """Row ``i`` (finite, from ``lo`` to ``hi``) as row-wise int8: its range in 255 steps
    from ``bias``, the element ``-128`` reading ``lo``."""
    scale = np.float32(hi - lo) / _STEPS
    if scale > _F0:
        bias = np.float32(lo + np.float32(_HALF_RANGE * scale))
        for j in range(x.shape[1]):
            t = np.float32(x[i, j] - bias) / scale
            q = min(max(np.rint(t), np.float32(-128.0)), np.float32(127.0))
            out[i, j] = np.uint8(np.int32(q) & 255)
        params[1] = bias
    else:
        params[1] = lo
    params[0] = scale
    _put_params(out, i, meta, params, 2)


@_jit
def _e4m3_bits(y: np.float32, a: np.uint32) -> np.uint8:
    """e4m3fn's bits of ``y`` (finite, within +-448; ``a``: its float32 bits) rounded to
    nearest, ties to even."""
    sign = (a >> np.uint32(24)) & np.uint32(128)
    u = a & np.uint32(0x7FFFFFFF)
    if u >= _MIN_NORMAL_BITS:
        odd = (u >> np.uint32(20)) & np.uint32(1)
        r = ((u + _REBIAS + np.uint32(0x7FFFF) + odd) >> np.uint32(20)) & np.uint32(127)
    else:
        # NOTE: a subnormal's step is 2**-9: the magnitude scaled by 2**9 (exact), rounded
        r = np.uint32(np.rint(abs(y) * _SUBNORMAL_STEPS))
    return np.uint8(r | sign)


@_jit
def _fp8_row(x: np.ndarray, i: int, lo: np.float32, hi: np.float32, out: np.ndarray,
             meta: int, params: np.ndarray, y: np.ndarray) -> None:
    """Row ``i`` (finite, from ``lo`` to ``hi``) as float8_e4m3fn scaled so that its
    largest magnitude, ``max(|lo|, |hi|)`` exactly, is e4m3's 448 (``y``: scratch)."""
    scale = max(abs(lo), abs(hi)) / _FP8_MAX
    safe = scale if scale > _F0 else _F1
    dim = x.shape[1]
    for j in range(dim):
        y[j] = min(max(x[i, j] / safe, -_FP8_MAX), _FP8_MAX)
    bits = y.view(np.uint32)
    for j in range(dim):
        out[i, j] = _e4m3_bits(y[j], bits[j])
    params[0] = scale
    _put_params(out, i, meta, params, 1)


@_jit
def _get_params(stored: np.ndarray, i: int, meta: int, params: np.ndarray, count: int
                ) -> None:
    """Row ``i``'s first ``count`` float32 parameters into ``params``."""
    raw = params.view(np.uint8)
    for j in range(4 * count):
        raw[j] = stored[i, meta + j]


@_jit
def decode_int8(stored: np.ndarray, meta: int, out: np.ndarray) -> None:
    """``out`` (float32 ``[N, dim]``) = stored int8 rows read: ``q * scale + bias``, the
    product and the sum each rounded."""
    n, dim = out.shape
    params = np.empty(2, np.float32)
    for i in range(n):
        _get_params(stored, i, meta, params, 2)
        scale, bias = params[0], params[1]
        for j in range(dim):
            q = np.int8(stored[i, j])
            out[i, j] = np.float32(np.float32(q) * scale) + bias


@_jit
def decode_fp8(stored: np.ndarray, meta: int, values: np.ndarray, out: np.ndarray) -> None:
    """``out`` (float32 ``[N, dim]``) = stored e4m3fn rows read: the value of each
    element's bits (``values``: float32 of the 256 patterns) times the row's scale."""
    n, dim = out.shape
    params = np.empty(1, np.float32)
    for i in range(n):
        _get_params(stored, i, meta, params, 1)
        scale = params[0]
        for j in range(dim):
            out[i, j] = values[stored[i, j]] * scale


_warm = False
_warm_lock = threading.Lock()


def warm_up() -> None:
    """Compile every loop (or load it from numba's cache beside this module) once per
    process, in the argument types :mod:`nvecache.common.quant` calls them with."""
    global _warm
    if _warm:
        return
    with _warm_lock:
        if _warm:
            return
        x = np.zeros((1, 4), np.float32)
        out = np.zeros((1, 16), np.uint8)
        bad = np.zeros(1, np.bool_)
        rows = np.zeros((1, 4), np.float32)
        encode(x, out, 8, bad, False)
        encode(x, out, 8, bad, True)
        decode_int8(out, 8, rows)
        decode_fp8(out, 8, np.zeros(256, np.float32), rows)
        # NOTE: the stored rows a lookup decodes are often a strided view (a wider stride)
        decode_int8(out[:, :12], 8, rows)
        decode_fp8(out[:, :12], 8, np.zeros(256, np.float32), rows)
        _warm = True
