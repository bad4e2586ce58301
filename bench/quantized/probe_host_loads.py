# ruff: noqa: N803  (Triton convention: compile-time constants are UPPER_CASE parameters)
"""A device probe: which form of GPU load sees a CPU writer's stores to host memory while
the kernel runs (gpu/kernels/stored_rows.py, "Open": a kernel polling the versions with the
kernels' ``.cv`` loads saw no change at all within one launch).

One program polls the 64 row versions of a quantized SharedMemBlock that a writer process
rewrites flat out (``probe_seqlock_race.written_block``), ``--polls`` times, once per
load form:

* ``cv``: PTX ``ld.global.cv``, the kernels' form (``tl.load(..., cache_modifier=".cv")``);
* ``volatile``: ``ld.volatile.global``;  ``relaxed``: ``ld.relaxed.sys.global``;
* ``acquire``: ``ld.acquire.sys.global``;  ``mmio``: ``ld.mmio.relaxed.sys.global``;
* ``fence``: ``fence.sc.sys`` before each ``ld.global.cv``;
* ``discard``: ``discard.global.L2`` of the line before each ``ld.global.cv``.

Per form: microseconds a poll, changes seen per row and polls that saw an odd version,
beside the writes the CPU counted over the same launch. Then ``launches``: one poll a
launch, many launches, with ``tl.load(.cv)`` (as the kernels load), the ``cv`` PTX and the
``volatile`` one (does a ``.cv`` load that is performed see what a volatile one sees?);
``interleaved``: the same with ``tl.load(.cv)``, a plain ``tl.load`` and the volatile PTX
launched in turn (one writer for the three), with and without a host sync a round; and
``pinned`` / ``registered``: the ``cv`` and ``relaxed`` forms over a torch pinned tensor and
over a registered private tensor, written by a thread of this process.

Run: ``python bench/quantized/probe_host_loads.py [--polls N]`` (CUDA only).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.quantized.probe_seqlock_race import ROWS, written_block  # noqa: E402

#: each form's PTX: one 32-bit load of ``$1`` into ``$0`` (inline, with side effects)
FORMS = {
    # NOTE: not tl.load(.cv): unmasked, that is an LLVM load the loop's invariant address
    # lets LLVM hoist out of the poll loop (its SASS holds no load in the loop)
    "cv": "ld.global.cv.b32 $0, [$1];",
    "volatile": "ld.volatile.global.b32 $0, [$1];",
    "relaxed": "ld.relaxed.sys.global.b32 $0, [$1];",
    "acquire": "ld.acquire.sys.global.b32 $0, [$1];",
    "mmio": "ld.mmio.relaxed.sys.global.b32 $0, [$1];",
    "fence": "fence.sc.sys;\n\tld.global.cv.b32 $0, [$1];",
    "discard": "{\n\t.reg .b64 line;\n\tand.b64 line, $1, -128;\n\t"
               "discard.global.L2 [line], 128;\n\tld.global.cv.b32 $0, [$1];\n\t}",
}


@triton.jit
def _load(ptr, ASM: tl.constexpr):
    return tl.inline_asm_elementwise(ASM, "=r,l", [ptr], dtype=tl.int32, is_pure=False,
                                     pack=1)


@triton.jit
def _poll(rows_ptr, stride, SEQ: tl.constexpr, polls, out_ptr, BLOCK: tl.constexpr,
          ASM: tl.constexpr):
    """One program: ``polls`` polls of rows ``0 .. BLOCK - 1``'s int32 at byte ``SEQ``
    (rows ``stride`` bytes apart); per row, polls that saw it odd, and changes seen."""
    r = tl.arange(0, BLOCK)
    ptr = (rows_ptr + r.to(tl.int64) * stride + SEQ).to(tl.pointer_type(tl.int32))
    prev = _load(ptr, ASM)
    odd = tl.full([BLOCK], 0, tl.int32)
    changes = tl.full([BLOCK], 0, tl.int32)
    for _ in range(polls):
        v = _load(ptr, ASM)
        odd += v & 1
        changes += (v != prev).to(tl.int32)
        prev = v
    tl.store(out_ptr + r, odd)
    tl.store(out_ptr + BLOCK + r, changes)


@triton.jit
def _once(rows_ptr, stride, SEQ: tl.constexpr, prev_ptr, out_ptr, BLOCK: tl.constexpr,
          ASM: tl.constexpr):
    """One poll a launch: changes since the last launch's poll (kept at ``prev_ptr``); the
    load ``tl.load(.cv)`` where ``ASM`` is empty (the kernels' form), else that PTX."""
    r = tl.arange(0, BLOCK)
    ptr = (rows_ptr + r.to(tl.int64) * stride + SEQ).to(tl.pointer_type(tl.int32))
    if ASM == "":
        v = tl.load(ptr, cache_modifier=".cv")
    elif ASM == "plain":
        v = tl.load(ptr)
    else:
        v = _load(ptr, ASM)
    prev = tl.load(prev_ptr + r)
    tl.store(out_ptr + r, tl.load(out_ptr + r) + (v != prev).to(tl.int32))
    tl.store(prev_ptr + r, v)


def interleaved(view: torch.Tensor, seq: int, n: int, versions: torch.Tensor,
                sync: bool) -> str:
    """``n`` rounds of one poll a launch in each of ``tl.load(.cv)``, plain ``tl.load``
    (a weak load without a modifier) and the volatile PTX, the three launches one after
    another in every round, so that each form polls under the same writer; ``sync``: the
    host waits for the GPU after every round (a write's visibility after a sync, as a
    layer's writes wait for the GPU)."""
    forms = {"tl.load": "", "plain": "plain", "volatile": FORMS["volatile"]}
    prev = {f: torch.zeros(ROWS, dtype=torch.int32, device="cuda") for f in forms}
    out = {f: torch.zeros(ROWS, dtype=torch.int32, device="cuda") for f in forms}
    for f, asm in forms.items():
        _once[(1,)](view, view.stride(0), seq, prev[f], out[f], BLOCK=ROWS, ASM=asm)
    torch.cuda.synchronize()
    for o in out.values():
        o.zero_()
    before, t = int(versions[0]), time.perf_counter()
    for _ in range(n):
        for f, asm in forms.items():
            _once[(1,)](view, view.stride(0), seq, prev[f], out[f], BLOCK=ROWS, ASM=asm)
        if sync:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    dt, after = time.perf_counter() - t, int(versions[0])
    seen = " / ".join(f"{f} {out[f].float().mean():.1f}" for f in forms)
    return (f"interleaved{' sync' if sync else ''}: {n} rounds in {dt * 1e3:.1f} ms, changes "
            f"a row {seen} (row 0's version moved {after - before} on the CPU)")


def poll(view: torch.Tensor, seq: int, polls: int, form: str, versions: torch.Tensor) -> str:
    """One program's ``polls`` polls of ``view``'s rows (uint8, their int32 at byte ``seq``)
    in ``form``, beside the change of ``versions[0]`` the CPU saw over the launch."""
    out = torch.zeros(2 * ROWS, dtype=torch.int32, device="cuda")
    stride = view.stride(0)
    _poll[(1,)](view, stride, seq, 1, out, BLOCK=ROWS, ASM=FORMS[form])  # NOTE: compile
    torch.cuda.synchronize()
    out.zero_()
    before = int(versions[0])
    t = time.perf_counter()
    _poll[(1,)](view, stride, seq, polls, out, BLOCK=ROWS, ASM=FORMS[form])
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    after = int(versions[0])
    o = out.cpu().float()
    return (f"{form:9s} {dt / polls * 1e6:8.3f} us a poll  odd {o[:ROWS].mean() / polls:7.2%}"
            f"  changes a row {o[ROWS:].mean():9.1f}  (row 0's version moved {after - before}"
            " on the CPU meanwhile)")


def launches(view: torch.Tensor, seq: int, n: int, versions: torch.Tensor, form: str) -> str:
    """``n`` launches of one poll each in ``form`` (``tl.load``: ``tl.load(.cv)``)."""
    asm = "" if form == "tl.load" else FORMS[form]
    prev = torch.zeros(ROWS, dtype=torch.int32, device="cuda")
    out = torch.zeros(ROWS, dtype=torch.int32, device="cuda")
    _once[(1,)](view, view.stride(0), seq, prev, out, BLOCK=ROWS, ASM=asm)
    torch.cuda.synchronize()
    out.zero_()
    before, t = int(versions[0]), time.perf_counter()
    for _ in range(n):
        _once[(1,)](view, view.stride(0), seq, prev, out, BLOCK=ROWS, ASM=asm)
    torch.cuda.synchronize()
    dt, after = time.perf_counter() - t, int(versions[0])
    return (f"launches {form:9s} {n} of one poll in {dt * 1e3:.1f} ms: changes a row "
            f"{out.float().mean():.1f} (row 0's version moved {after - before} on the CPU)")


def threaded(kind: str, polls: int) -> list[str]:
    """Poll a [ROWS, 8] int32 host tensor (column 0) that a thread of this process keeps
    adding one to; ``kind``: a torch pinned tensor, or a private one registered here."""
    from gpu.stacks.linear_tables import user_rows

    if kind == "pinned":
        host = torch.zeros(ROWS, 8, dtype=torch.int32, pin_memory=True)
        reg, view = None, host.view(torch.uint8)
    else:
        host = torch.zeros(ROWS, 8, dtype=torch.int32)
        reg, rows = user_rows(host, torch.device("cuda"))
        view = rows.view(torch.uint8)
    stop = threading.Event()

    def write() -> None:
        col = host[:, 0]
        while not stop.is_set():
            col.add_(1)

    th = threading.Thread(target=write)
    th.start()
    try:
        lines = [f"{kind:10s} " + poll(view, 0, polls, form, host[:, 0])
                 for form in ("cv", "relaxed")]
    finally:
        stop.set()
        th.join()
        if reg is not None:
            reg.close()
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--polls", type=int, default=200_000)
    p.add_argument("--launches", type=int, default=5_000)
    p.add_argument("--fmt", default="int8", choices=["int8", "float8_e4m3fn"])
    args = p.parse_args()
    args.device, args.pause = "cuda", 0.0  # NOTE: what written_block reads besides --fmt
    with written_block(args) as (mb, view):
        seq = mb.row_format.stored_bytes
        versions = mb.versions
        for form in FORMS:
            try:
                print(poll(view, seq, args.polls, form, versions), flush=True)
            except Exception as e:  # noqa: BLE001  (a form this GPU or PTX lacks)
                print(f"{form:9s} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        for form in ("tl.load", "cv", "volatile"):
            print(launches(view, seq, args.launches, versions, form), flush=True)
        for sync in (False, True):
            print(interleaved(view, seq, args.launches, versions, sync), flush=True)
    for kind in ("pinned", "registered"):
        for line in threaded(kind, args.polls):
            print(line, flush=True)


if __name__ == "__main__":
    main()
