# ruff: noqa: N803  (Triton convention: compile-time constants are UPPER_CASE parameters)
"""Triton device functions that read a linear table's rows inside the kernels that gather
them: plain rows as they are, quantized rows dequantized in the same load, a quantized
``SharedMemBlock``'s rows under their seqlock versions.

Loaded only through :func:`gpu.kernels.triton_access.helper_module` by the kernel modules
that read a linear table (:mod:`gpu.kernels.gather`, :mod:`gpu.kernels.cache_lookup`,
:mod:`gpu.kernels.cache_pooled`) or a registered host cache's rows
(:mod:`gpu.kernels.host_tier`). A quantized table (:data:`nvecache.common.rows.QUANTIZED`)
is passed as its stored bytes, uint8 ``[num_rows, >= stored_bytes]`` with the row stride
in bytes, and read as :func:`nvecache.common.quant.decode` reads it, bit for bit:

- ``int8``: ``q * scale + bias``, the product and the sum each rounded (a variant that
  reads int8 rows is compiled without fused multiply-adds: :func:`codec_constexprs`);
- ``float8_e4m3fn``: the element (exact in float32) times ``scale``; decoded by the GPU's
  own conversion (``F2FP.F16.E4M3.UNPACK_B``: two elements an instruction, through float16,
  where every e4m3 value is exact) on GPUs of compute capability 8.9 and later and in
  Triton's interpreter, from its bits by integer operations on older GPUs (Triton has no
  e4m3 type there) and where CUDA was not initialized yet: :func:`fp8_code`.

:func:`to_dtype` rounds float32 to the output's dtype to nearest, ties to even, bfloat16
by its bits (Triton's interpreter would otherwise truncate), so a dequantized row reads the
same whether a GPU cache holds it or the table does, on either backend.

A quantized ``SharedMemBlock`` (its reader told a
:class:`hostcache.row_versions.VersionedFormat`: ``SEQ``) may be written by another process
while a kernel reads it; each row's int32 version follows its stored bytes
(``hostcache.layout``), at byte ``SEQ`` of the row, and :func:`load_rows` reads the row
inside its version's window: the version ``v1``, then the row (payload and parameters),
then the version ``v2``; rows whose ``v1`` is odd or differs from ``v2`` are read again,
in rounds, up to :data:`ROUNDS` of them (a writer that died inside its section; past that
the row is taken as read). Each step's loads are *predicated* on the values the step
before it loaded: the row's loads on ``v1 != s1``, ``v2``'s on the row's values (their
XOR over the row) ``!= s2``, ``s1`` and ``s2`` constants of the round (a row that meets
one is not read that round and is read again in the next, where they differ). A
predicated load cannot be issued before its predicate is known, nor can the compiler
drop a predicate it cannot evaluate, so the three steps are performed in order, over
PCIe too, and every load of the three is volatile (system scope: fetched from host
memory, never served from an earlier load or a cached line; see "Volatile, once a thread"
below); no fence is needed beyond those dependencies. (An opaque zero
added to the addresses does not do it: ``and.b32 x, 0`` in inline PTX is folded by
``ptxas``, which then issued the row's loads beside ``v1``'s; the race test tore about 1
read in 1,000-3,000 on an H100 that way.) ``v2``'s predicate comes from every element of
the row (a reduction over the row, through shared memory where the row spans warps), so
``v2`` is read after every part of the row, its scale and bias with it: a row whose
``v1`` is even and equal to its ``v2`` was read inside a window no write section
overlapped, and one write's payload is never decoded with another write's parameters.
The writer (CPU, TSO) stores the odd version, the row, then the even version
(:mod:`hostcache.row_versions`).

One verdict per row: each thread loads its own copy of a row's versions and judges its own
part of the row by them, so a round's verdicts are joined over the row's threads
(:func:`_any_thread`) before it keeps the row or reads all of it again. Kept part by part,
a part one thread kept in one round and another thread re-read in a later one, after
another write, would join two writes (the race test still tore about 1 read in
1,000-3,000 on an H100 with the predicates alone). A row every thread found clean in one
round is one write's: a thread that saw a newer version before another thread's ``v2``
(read after every part of the row) makes that ``v2`` newer too.

Volatile, once a thread: the loads of a round must each be performed. ``ld.global.cv``
(``tl.load(..., cache_modifier=".cv")``, these kernels' earlier form) is a weak load: ptxas
serves one from an earlier load of the same address when no store or fence lies between
(a compiled loop polling a version with it compared the first load's register with
itself), and against a writer process rewriting every row flat out the rounds ran out and
some lookups returned a torn row. Volatile loads (``ld.volatile``) are each performed; but
a volatile ``tl.load`` is copied by Triton's layout passes into every layout its value is
used in, each copy its own request over PCIe (many times the scalar loads a thread of the
``.cv`` form issued, whose copies LLVM merged). So the versions and a row's parameters
are loaded by :func:`_volatile32`, one predicated ``ld.volatile`` a thread in inline PTX
with side effects, which those passes do not copy; the payload by a volatile ``tl.load``
(its 16-byte vectors are loaded once). With them the race test and the readers' probe tear
no row, and a lookup that reads a quantized block in host memory costs more than it did
with ``.cv`` loads, which a cached line could serve (bench/RESULTS.md, fourteenth session, has
both). Past :data:`ROUNDS` a kernel takes the row as read: a GPU reader cannot take the
writer lock, as a CPU reader does (:mod:`hostcache.row_versions`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

from hostcache.row_versions import is_versioned
from nvecache.common.rows import RowFormat

#: the ``QUANT`` constexpr of a table's format: 0 plain, 1 int8, 2 float8_e4m3fn decoded
#: from its bits, 3 float8_e4m3fn converted by the GPU (:func:`fp8_code` picks 2 or 3)
_CODES = {"int8": 1, "float8_e4m3fn": 2}
#: the first compute capability whose Triton has the e4m3 type (``fp8e4nv``)
_FP8_NATIVE = (8, 9)
_fp8: int | None = None
#: how many times a versioned row is read at most while a writer holds it (see above)
ROUNDS: tl.constexpr = tl.constexpr(1 << 12)
#: 2**120, the scale between an e4m3 element and its bits placed in a float32 (_e4m3)
_TWO_120: tl.constexpr = tl.constexpr(float(2 ** 120))
#: whether this variant of the module is compiled (its scalar volatile loads are inline
#: PTX, loaded once a thread) or run by Triton's interpreter (plain ``tl.load``)
_COMPILED: tl.constexpr = tl.constexpr(not knobs.runtime.interpret)


def codec_constexprs(fmt: RowFormat | None) -> dict[str, object]:
    """The constexprs that tell a kernel how to read a table of format ``fmt`` (None: a
    plain table of the kernel's dtype): ``QUANT``, ``META`` (the byte offset of the row's
    parameters), ``SEQ`` (a versioned format's: the byte offset of the row's version, its
    stored bytes; 0: rows read without versions), and for int8 ``enable_fp_fusion=False``
    (see the module docstring)."""
    if fmt is None or not fmt.quantized:
        return {"QUANT": 0, "META": 0, "SEQ": 0}
    code = fp8_code() if fmt.dtype == "float8_e4m3fn" else _CODES[fmt.dtype]
    cx: dict[str, object] = {"QUANT": code, "META": fmt.meta_offset,
                             "SEQ": fmt.stored_bytes if is_versioned(fmt) else 0}
    if fmt.dtype == "int8":
        cx["enable_fp_fusion"] = False
    return cx


def fp8_code() -> int:
    """``QUANT`` of a float8_e4m3fn table: 3 (the GPU's conversion: fewer instructions an
    element than the integer decode, bench/RESULTS.md) where every GPU of this process has
    compute capability 8.9 or later, or none is there (the interpreter, which converts
    every e4m3 value to the same float); else 2 (decoded from its bits, on any GPU). The
    two read the same values; where CUDA is not initialized yet this answers 2 (asking a
    GPU's capability would initialize CUDA in a process that may still fork)."""
    global _fp8
    if _fp8 is None:
        if torch.cuda.is_available() and not torch.cuda.is_initialized():
            return 2
        caps = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
        _fp8 = 3 if all(c >= _FP8_NATIVE for c in caps) else 2
    return _fp8


@triton.jit
def load_rows(table_ptr, rows, rmask, tstride, d, dmask, QUANT: tl.constexpr,
              META: tl.constexpr, VOLATILE: tl.constexpr, SEQ: tl.constexpr):
    """``[BLOCK_K, BLOCK_D]``: elements ``d`` of rows ``rows`` (int64, masked by ``rmask``,
    ``dmask``: zero there) of a table whose row ``r`` starts ``r * tstride`` elements (bytes,
    quantized) in; a plain table's in its dtype, a quantized one's dequantized in float32.
    ``VOLATILE``: 1 loads every byte volatile (the host tier's seqlocked reads: each
    load performed, the row's parameters as its payload), 0 plain loads. ``SEQ``: not
    0, a quantized table's rows read under their versions, at that byte of each row (see
    the module docstring). NOTE: ints every caller passes, not defaults: Triton 3.6 does
    not make a called function's default a constexpr."""
    if SEQ:
        vptr = (table_ptr + rows * tstride + SEQ).to(tl.pointer_type(tl.int32))
        vals, bad = _versioned_once(table_ptr, vptr, rows, rmask, tstride, d, dmask, QUANT,
                                    META, 1)
        bad = _any_thread(bad, d, tstride)
        rounds = 1
        while (tl.reduce(bad.to(tl.int32), 0, _max) > 0) & (rounds < ROUNDS):
            rounds += 1
            again, still = _versioned_once(table_ptr, vptr, rows, bad, tstride, d, dmask,
                                           QUANT, META, rounds)
            vals = tl.where(bad[:, None], again, vals)
            bad = _any_thread(still, d, tstride)
    else:
        vals = _read_rows(table_ptr, rows, rmask, tstride, d, dmask, QUANT, META, VOLATILE)
    return vals


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _any_thread(bad, d, tstride):
    """``bad`` per row as every thread holding a part of the row sees it: true where any
    of them found its window dirty. Each thread loads its own copy of a row's versions and
    judges its own part of the row by them; a row that one thread keeps and another reads
    again in a later round would join parts of two writes. Reduced over the row's columns
    (``d < tstride``: true for column 0 at least, and not a constant the compiler could
    fold the reduction away with), every part of a row is kept or read again together."""
    spread = bad[:, None] & (d[None, :] < tstride)
    return tl.reduce(spread.to(tl.int32), 1, _max) > 0


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _versioned_once(table_ptr, vptr, rows, rmask, tstride, d, dmask, QUANT: tl.constexpr,
                    META: tl.constexpr, ROUND):
    """Round ``ROUND`` (1, 2, ...) of the seqlocked read of rows ``rows`` (masked by
    ``rmask``; versions at ``vptr``): their values, and which of them to read again (a
    write section overlapped the read, or the row met one of the round's constants).

    The order comes from predicates (see the module docstring): the row's loads wait for
    ``v1`` (``v1 != -1 - ROUND``: a version is never negative until it wraps after 2**31
    writes, and then at most one round is lost), ``v2``'s for every value of the row
    (their XOR ``!= ROUND``)."""
    v1 = _volatile32(vptr, rmask)
    s1 = -1 - ROUND
    vals = _read_rows(table_ptr, rows, rmask & (v1 != s1), tstride, d, dmask, QUANT, META, 1)
    x = tl.reduce(vals.to(tl.int32, bitcast=True), 1, _xor)
    v2 = _volatile32(vptr, rmask & (x != ROUND))
    bad = rmask & ((v1 != v2) | ((v1 & 1) != 0) | (v1 == s1) | (x == ROUND))
    return vals, bad


@triton.jit
def _read_rows(table_ptr, rows, rmask, tstride, d, dmask, QUANT: tl.constexpr,
               META: tl.constexpr, VOLATILE: tl.constexpr):
    """:func:`load_rows` without versions."""
    m = rmask[:, None] & dmask[None, :]
    if QUANT == 0:
        vals = _load(table_ptr + rows[:, None] * tstride + d[None, :], m, 0.0, VOLATILE)
    else:
        base = table_ptr + rows * tstride
        q = _load(base[:, None] + d[None, :], m, 0, VOLATILE)
        par = (base + META).to(tl.pointer_type(tl.float32))
        scale = _load32(par, rmask, VOLATILE)
        if QUANT == 1:
            bias = _load32(par + 1, rmask, VOLATILE)
            # NOTE: a masked row's scale and bias load as 0, its values as 0 with them; a
            # masked column's bias is taken out here, and where dmask is a constant (every
            # column of dim read), this select is folded away at compile time
            vals = _i8(q) * scale[:, None] + tl.where(dmask[None, :], bias[:, None], 0.0)
        elif QUANT == 2:
            vals = _e4m3(q) * scale[:, None]  # NOTE: 0 where q is masked
        else:
            vals = q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]
    return vals


@triton.jit
def _load32(ptr, mask, VOLATILE: tl.constexpr):
    """A row's float32 parameter at ``ptr`` (0 where masked), volatile where ``VOLATILE``
    (once a thread: :func:`_volatile32`)."""
    if VOLATILE:
        v = _volatile32(ptr, mask).to(tl.float32, bitcast=True)
    else:
        v = tl.load(ptr, mask=mask, other=0.0)
    return v


@triton.jit
def _volatile32(ptr, mask):
    """The 32-bit word at ``ptr`` (int32; 0 where masked) by one ``ld.volatile`` a thread:
    inline PTX with side effects, which Triton's layout passes do not copy into every
    layout its value is used in (a volatile ``tl.load`` is copied, each copy its own
    request over PCIe: the module docstring). Interpreted, a plain ``tl.load``."""
    if _COMPILED:
        v = tl.inline_asm_elementwise(
            "{\n\t.reg .pred p;\n\tsetp.ne.s32 p, $2, 0;\n\tmov.b32 $0, 0;"
            "\n\t@p ld.volatile.global.b32 $0, [$1];\n\t}",
            "=r,l,r", [ptr.to(tl.pointer_type(tl.int32)), mask.to(tl.int32)],
            dtype=tl.int32, is_pure=False, pack=1)
    else:
        v = tl.load(ptr.to(tl.pointer_type(tl.int32)), mask=mask, other=0)
    return v


@triton.jit
def _load(ptr, mask, other, VOLATILE: tl.constexpr):
    """``tl.load``, volatile where ``VOLATILE`` (see the module docstring)."""
    if VOLATILE:
        v = tl.load(ptr, mask=mask, other=other, volatile=True)
    else:
        v = tl.load(ptr, mask=mask, other=other)
    return v


@triton.jit
def _i8(q):
    """float32 of int8 bits (uint8), exact, without an integer-to-float conversion (a
    slow-pipe instruction, a quarter of the rate of the float adds beside it): the byte
    biased by 128 placed in the mantissa of 2**23, that float less 2**23 + 128."""
    return (q.to(tl.int32) ^ 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _e4m3(q):
    """float32 of e4m3fn bits (uint8): sign, 4 exponent bits (bias 7), 3 mantissa bits; no
    infinities (the tables store no NaN: their writes refuse them). The byte's sign goes to
    bit 31 and its other 7 bits to bits 26..20 (the low end of float32's exponent and the
    top of its mantissa): that float is the element times 2**-120 exactly, a subnormal
    element (exponent 0) a float32 subnormal, so one multiply by 2**120 (exact: float32
    subnormals are kept, never flushed, by these kernels' multiplies) gives the element.
    Three integer operations and a multiply an element."""
    w = (q.to(tl.int32) << 24) >> 4  # NOTE: arithmetic: the sign smeared over bits 31..27
    bits = w & -2014314496  # 0x87F00000: the sign at 31, bits 30..27 cleared
    return bits.to(tl.float32, bitcast=True) * _TWO_120


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
