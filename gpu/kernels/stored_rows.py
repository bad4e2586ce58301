# ruff: noqa: N803  (Triton convention: compile-time constants are UPPER_CASE parameters)
"""Triton device functions that read a linear table's rows inside the kernels that gather
them: plain rows as they are, quantized rows dequantized in the same load.

Loaded only through :func:`gpu.kernels.triton_access.helper_module` by the kernel modules
that read a linear table (:mod:`gpu.kernels.gather`, :mod:`gpu.kernels.cache_lookup`,
:mod:`gpu.kernels.cache_pooled`) or a registered host cache's rows
(:mod:`gpu.kernels.host_tier`). A quantized table (:data:`nvecache.common.rows.QUANTIZED`)
is passed as its stored bytes, uint8 ``[num_rows, >= stored_bytes]`` with the row stride
in bytes, and read as :func:`nvecache.common.quant.decode` reads it, bit for bit:

- ``int8``: ``q * scale + bias``, the product and the sum each rounded (a variant that
  reads int8 rows is compiled without fused multiply-adds: :func:`codec_constexprs`);
- ``float8_e4m3fn``: the element decoded from its bits (exact in float32, the same in
  Triton's interpreter as compiled), times ``scale``.

:func:`to_dtype` rounds float32 to the output's dtype to nearest, ties to even, bfloat16
by its bits (Triton's interpreter would otherwise truncate), so a dequantized row reads the
same whether a GPU cache holds it or the table does, on either backend.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nvecache.common.rows import RowFormat

#: the ``QUANT`` constexpr of a table's format: 0 plain, 1 int8, 2 float8_e4m3fn
_CODES = {"int8": 1, "float8_e4m3fn": 2}


def codec_constexprs(fmt: RowFormat | None) -> dict[str, object]:
    """The constexprs that tell a kernel how to read a table of format ``fmt`` (None: a
    plain table of the kernel's dtype): ``QUANT``, ``META`` (the byte offset of the row's
    parameters), and for int8 ``enable_fp_fusion=False`` (see the module docstring)."""
    if fmt is None or not fmt.quantized:
        return {"QUANT": 0, "META": 0}
    cx: dict[str, object] = {"QUANT": _CODES[fmt.dtype], "META": fmt.meta_offset}
    if fmt.dtype == "int8":
        cx["enable_fp_fusion"] = False
    return cx


@triton.jit
def load_rows(table_ptr, rows, rmask, tstride, d, dmask, QUANT: tl.constexpr,
              META: tl.constexpr, VOLATILE: tl.constexpr):
    """``[BLOCK_K, BLOCK_D]``: elements ``d`` of rows ``rows`` (int64, masked by ``rmask``,
    ``dmask``: zero there) of a table whose row ``r`` starts ``r * tstride`` elements (bytes,
    quantized) in; a plain table's in its dtype, a quantized one's dequantized in float32.
    ``VOLATILE``: 1 loads with the ``".cv"`` cache modifier (the host tier's seqlocked reads
    fetch every byte again, the row's parameters as its payload), 0 without. NOTE: an int
    every caller passes, not the modifier's string as a default: Triton 3.6 does not make a
    called function's default a constexpr."""
    m = rmask[:, None] & dmask[None, :]
    if QUANT == 0:
        vals = _load(table_ptr + rows[:, None] * tstride + d[None, :], m, 0.0, VOLATILE)
    else:
        base = table_ptr + rows * tstride
        q = _load(base[:, None] + d[None, :], m, 0, VOLATILE)
        par = (base + META).to(tl.pointer_type(tl.float32))
        scale = _load(par, rmask, 0.0, VOLATILE)
        if QUANT == 1:
            bias = _load(par + 1, rmask, 0.0, VOLATILE)
            vals = q.to(tl.int8, bitcast=True).to(tl.float32) * scale[:, None] + bias[:, None]
        else:
            vals = _e4m3(q) * scale[:, None]
        vals = tl.where(m, vals, 0.0)
    return vals


@triton.jit
def _load(ptr, mask, other, VOLATILE: tl.constexpr):
    """``tl.load``, with the ``".cv"`` modifier where ``VOLATILE``."""
    if VOLATILE:
        v = tl.load(ptr, mask=mask, other=other, cache_modifier=".cv")
    else:
        v = tl.load(ptr, mask=mask, other=other)
    return v


@triton.jit
def _e4m3(q):
    """float32 of e4m3fn bits (uint8): sign, 4 exponent bits (bias 7), 3 mantissa bits; no
    infinities (the tables store no NaN: their writes refuse them). The sign goes in as a
    bit: a compiled ``-x`` is ``0 - x``, which makes -0.0 (byte 0x80) +0.0."""
    b = q.to(tl.int32)
    e = (b >> 3) & 15
    m = b & 7
    normal = ((e + 120) << 23) | (m << 20)
    # NOTE: 2**-9: a subnormal is m * 2**-6 / 8 (its magnitude's bits)
    sub = (m.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)
    mag = tl.where(e == 0, sub, normal)
    return (mag | ((b & 128) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def to_dtype(vals, OUT: tl.constexpr):
    """``vals`` in dtype ``OUT``, float32 rounded to nearest, ties to even (bfloat16 by its
    bits); values already of ``OUT`` as they are."""
    if vals.dtype == OUT:
        res = vals
    elif OUT == tl.bfloat16:
        bits = vals.to(tl.float32).to(tl.int32, bitcast=True)
        bits = (bits + 32767 + ((bits >> 16) & 1)) >> 16
        res = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        res = vals.to(OUT)
    return res
