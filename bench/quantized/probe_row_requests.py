# ruff: noqa: N803  (Triton convention: compile-time constants are UPPER_CASE parameters)
"""A device probe: what reading random rows of a SharedMemBlock in host memory costs the
GPU, load form by load form (the seqlock's volatile loads cost a LinearUVM lookup over a
quantized block about 3x the ``.cv`` form's: bench/RESULTS.md, fourteenth session).

One kernel gathers ``--keys`` random rows of a ``--rows``-row block (dim 128, larger than
the GPU's L2, registered as the layers register it) into a float32 output, 16 rows a
program, no writer running, each form timed over the same rows (median of ``--reps``
launches, CUDA events):

* ``weak``: :func:`gpu.kernels.stored_rows.load_rows` with plain loads (a device table's
  read; over host memory a cached line may serve it);
* ``volatile``: ``load_rows`` with every load volatile, no versions (the host tier's
  read of a quantized host cache);
* ``seqlock``: ``load_rows`` under the rows' versions (a LinearUVM or GPULayer lookup's
  read of a quantized block: ``v1``, payload and parameters, ``v2``);
* ``payload-volatile`` / ``payload-weak``: the payload alone, no parameters (what the
  parameters' loads add);
* ``pair``: the payload volatile and the scale and bias as one 8-byte volatile load by
  the one thread of the row that holds its column 0, handed to the row's other threads by
  a sum over the row (the kernels' form loads each parameter in every thread of the row;
  a candidate for the seqlock's read, bench/RESULTS.md, fifteenth session; int8 only).

Then the float32 block of the same rows, ``weak`` and ``volatile``: the same bytes a
quantized row's miss would cost as float32. Each line: microseconds a launch, M rows/s,
GB/s of stored bytes, and the ratio to the quantized ``weak`` form.

Run: ``python bench/quantized/probe_row_requests.py [--rows N] [--keys N] [--fmt int8]``
(CUDA; ``--device cpu`` runs each form once in Triton's interpreter, a smoke test).
``--sass`` needs no GPU: it compiles each form for sm_90, specialized as a launch over
16-byte aligned tables is, and counts its machine code's loads a thread by kind (system
scope: ``STRONG.SYS``), shuffles and barriers, with Triton's own ptxas and cuobjdump.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.kernels.bench_host_tier import cuda_time  # noqa: E402
from hostcache import SharedMemBlock  # noqa: E402
from tests.conftest import fresh_name  # noqa: E402
from tests.gpu.quantized_tables import quantized_block  # noqa: E402

DIM = 128
#: the helpers the kernel calls: ``gpu/kernels/stored_rows.py``'s of the kernel's kind, and
#: ``_pair_src`` jitted (set by :func:`kernel`)
load_rows: Any = None
_i8: Any = None
_pair: Any = None
#: form name -> the kernel's FORM constexpr
FORMS = {"weak": 0, "volatile": 1, "seqlock": 2, "payload-volatile": 3, "payload-weak": 4,
         "pair": 5}


def _pair_src(ptr, mask, d):
    """Each row's two 32-bit words at ``ptr`` (8-byte aligned) by one ``ld.volatile.v2``,
    issued by the thread holding the row's column 0 (``d``), summed over the row."""
    p2, lead = tl.broadcast(ptr[:, None], d[None, :] == 0)
    a, b = tl.inline_asm_elementwise(
        "{\n\t.reg .pred p;\n\tsetp.ne.s32 p, $3, 0;\n\tmov.b32 $0, 0;\n\tmov.b32 $1, 0;"
        "\n\t@p ld.volatile.global.v2.b32 {$0, $1}, [$2];\n\t}",
        "=r,=r,l,r", [p2.to(tl.pointer_type(tl.int32)), (mask[:, None] & lead).to(tl.int32)],
        dtype=(tl.int32, tl.int32), is_pure=False, pack=1)
    return tl.sum(a, 1), tl.sum(b, 1)


def _gather_src(table_ptr, rows_ptr, out_ptr, n, tstride, BLOCK_K: tl.constexpr,
            BLOCK_D: tl.constexpr, QUANT: tl.constexpr, META: tl.constexpr,
            SEQ: tl.constexpr, FORM: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    m = offs < n
    rows = tl.load(rows_ptr + offs, mask=m, other=0)
    d = tl.arange(0, BLOCK_D)
    dmask = d < BLOCK_D
    mm = m[:, None] & dmask[None, :]
    if FORM == 0:
        vals = load_rows(table_ptr, rows, m, tstride, d, dmask, QUANT, META, 0, 0)
    elif FORM == 1:
        vals = load_rows(table_ptr, rows, m, tstride, d, dmask, QUANT, META, 1, 0)
    elif FORM == 2:
        vals = load_rows(table_ptr, rows, m, tstride, d, dmask, QUANT, META, 1, SEQ)
    elif FORM == 3:
        q = tl.load(table_ptr + rows[:, None] * tstride + d[None, :], mask=mm, other=0,
                    volatile=True)
        vals = q.to(tl.float32)
    elif FORM == 4:
        q = tl.load(table_ptr + rows[:, None] * tstride + d[None, :], mask=mm, other=0)
        vals = q.to(tl.float32)
    else:
        q = tl.load(table_ptr + rows[:, None] * tstride + d[None, :], mask=mm, other=0,
                    volatile=True)
        s, b = _pair(table_ptr + rows * tstride + META, m, d)
        vals = (_i8(q) * s.to(tl.float32, bitcast=True)[:, None]
                + b.to(tl.float32, bitcast=True)[:, None])
    tl.store(out_ptr + offs[:, None] * BLOCK_D + d[None, :], vals, mask=mm)


def kernel(device: str) -> Any:
    """``_gather_src`` jitted for ``device`` (interpreted on the CPU), with the helpers of
    ``gpu/kernels/stored_rows.py`` of the same kind."""
    from triton import knobs

    from gpu.kernels.triton_access import kernel_module

    cpu = device == "cpu"
    stored = kernel_module("stored_rows", interpret=cpu)
    globals().update(load_rows=stored.load_rows, _i8=stored._i8)
    previous = knobs.runtime.interpret
    knobs.runtime.interpret = cpu
    try:
        globals()["_pair"] = triton.jit(_pair_src)
        return stored, triton.jit(_gather_src)
    finally:
        knobs.runtime.interpret = previous


def timed(launch: Any, reps: int, device: str) -> float:
    """Median microseconds of ``launch()`` over ``reps`` launches, CUDA events (on the CPU:
    one launch, untimed)."""
    if device == "cpu":
        launch()
        return float("nan")
    return cuda_time(launch, reps) * 1e6


def measure(block: Any, label: str, forms: list[str], keys: torch.Tensor, reps: int,
            device: str, stored: Any, gather: Any, base: list[float]) -> None:
    """One line a form: ``block``'s rows ``keys`` read in that form."""
    from gpu.stacks.linear_tables import registered_rows

    reg, view = registered_rows(block, torch.device(device))
    try:
        cx = stored.codec_constexprs(block.read_format if block.quantized else None)
        n = keys.numel()
        if block.quantized:
            from nvecache.common import quant

            want = quant.decode(block.tensor.index_select(0, keys.cpu()), block.read_format)
        else:
            want = block.tensor.index_select(0, keys.cpu())
        out = torch.empty(n, DIM, dtype=torch.float32, device=device)
        row_bytes = block.row_format.stored_bytes
        for form in forms:
            def launch(f: int = FORMS[form]) -> None:
                gather[(triton.cdiv(n, 16),)](view, keys, out, n, view.stride(0), BLOCK_K=16,
                                              BLOCK_D=DIM, FORM=f, **cx)
            us = timed(launch, reps, device)
            if not form.startswith("payload"):
                assert torch.equal(out.cpu(), want), f"{label} {form}: rows read wrong"
            if not base:
                base.append(us)
            print(f"{label:8s} {form:17s} {us:10.1f} us a launch  {n / us:8.1f} M rows/s  "
                  f"{n * row_bytes / us / 1e3:6.2f} GB/s  {us / base[0]:5.2f}x the first",
                  flush=True)
    finally:
        if reg is not None:
            reg.close()


def sass_counts(fmt: str) -> None:
    """One line a form: its loads, shuffles and barriers a thread, compiled for sm_90."""
    from hostcache.row_versions import VersionedFormat
    from nvecache.common.rows import RowFormat
    from tests.gpu.sass import sass_text

    stored, gather = kernel("cuda")
    cx = stored.codec_constexprs(VersionedFormat.of(RowFormat(fmt, DIM)))
    options = {"enable_fp_fusion": cx.pop("enable_fp_fusion", True)}
    sig = {"table_ptr": "*u8", "rows_ptr": "*i64", "out_ptr": "*fp32", "n": "i32",
           "tstride": "i32"}
    # NOTE: the pointers and the row stride 16-divisible, as a launch specializes them
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 4)}
    op = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", re.M)
    for form, code in FORMS.items():
        if form == "pair" and fmt != "int8":
            continue
        consts = dict(cx, BLOCK_K=16, BLOCK_D=DIM, FORM=code)
        ops = op.findall(sass_text(gather, dict(sig, **dict.fromkeys(consts, "constexpr")),
                                   consts, options, attrs))
        kinds = Counter(o for o in ops if o.startswith(("LDG", "SHFL", "BAR", "REDUX")))
        print(f"{fmt:8s} {form:17s} {len(ops):5d} instructions  "
              + "  ".join(f"{k} {v}" for k, v in sorted(kinds.items())), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1 << 20)
    p.add_argument("--keys", type=int, default=1 << 18)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--fmt", default="int8", choices=["int8", "float8_e4m3fn"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--sass", action="store_true",
                   help="count each form's compiled loads for sm_90 (no GPU needed)")
    args = p.parse_args()
    if args.sass:
        sass_counts(args.fmt)
        return
    if args.device == "cpu":  # NOTE: the interpreter: a smoke test at a small size
        args.rows, args.keys = min(args.rows, 256), min(args.keys, 64)
    stored, gather = kernel(args.device)
    g = torch.Generator().manual_seed(0)
    values = torch.randn(args.rows, DIM, generator=g)
    keys = torch.randint(0, args.rows, (args.keys,), generator=g).to(args.device)
    fmt = getattr(torch, args.fmt)
    forms = [f for f in FORMS if f != "pair" or (fmt == torch.int8 and args.device != "cpu")]
    base: list[float] = []
    with quantized_block(args.rows, DIM, fmt, values) as mb:
        measure(mb, args.fmt, forms, keys, args.reps, args.device, stored, gather, base)
    name = fresh_name("rowreq")
    plain = SharedMemBlock.create(name, num_rows=args.rows, dim=DIM)
    try:
        plain.write(torch.arange(args.rows), values)
        measure(plain, "float32", ["weak", "volatile"], keys, args.reps, args.device, stored,
                gather, base)
    finally:
        plain.close()
        SharedMemBlock.unlink(name)


if __name__ == "__main__":
    main()
