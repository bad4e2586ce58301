# ruff: noqa: N803  (Triton convention: compile-time constants are UPPER_CASE parameters)
"""A device probe of a quantized SharedMemBlock's seqlock against a writer process: where
the GPU readers' torn rows came from (``.cv`` loads that ptxas served from earlier loads;
bench/RESULTS.md, thirteenth session), and whether the kernels' volatile loads, since the
fourteenth session (gpu/kernels/stored_rows.py), still tear any.

A spawned writer rewrites every row of a 64 x 512 block flat out, version after version,
as the cross-process race test's writer does (tests/gpu/quantized_workers.py). Then:

* ``readers``: a LinearUVM layer, a GPULayer and the block's CPU ``read`` look the rows
  up in turn for ``--seconds``; per reader: lookups, p50 / p99 / max time of a lookup
  (its hash included), lookups over 10 ms, and lookups that returned a row that is no
  version of its key (torn). ``--rounds`` recompiles the kernels with another
  ``stored_rows.ROUNDS`` (their bound on re-reads), ``--wait`` sets the CPU readers'
  ``row_versions.WAIT_SECONDS``.
* ``rounds``: one program runs ``--polls`` rounds of the kernels' own seqlocked read
  (``stored_rows._versioned_once``: version, row, version, predicated as the lookups do)
  over the 64 rows and counts, per row, the rounds it judged torn: a round that fails
  about as often as the writer is inside a section, or one that keeps failing (the
  writer's own share of time inside a section is printed first, no
  reader running). ``--pause`` slows the writer (on the CPU, where the interpreter takes
  about a second a round, a check that a round between writes is judged whole).

What a GPU load sees of the versions, form by form: ``probe_host_loads.py``.

Run: ``python bench/quantized/probe_seqlock_race.py readers|rounds [--device cuda]
[--fmt int8] [--seconds 60] [--gpu-only] [--rounds N] [--wait S] [--polls N]
[--pause S]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gpu import LayerType, NVEmbedding  # noqa: E402
from hostcache import row_versions  # noqa: E402
from tests.gpu import quantized_workers  # noqa: E402
from tests.gpu.quantized.test_linear_quantized_races import CTX, hashed  # noqa: E402
from tests.gpu.quantized_tables import cache_bytes, quantized_block, reference  # noqa: E402

ROWS, DIM, WRITES = 64, 512, 600


@contextmanager
def writer(mb: Any, pause: float = 0.0) -> Any:
    """The writer process (``pause`` seconds between its writes), started once the
    ``with`` body sets the event it yields."""
    started, stop, last = CTX.Event(), CTX.Event(), CTX.Value("i", -1)
    proc = CTX.Process(target=quantized_workers.write_versions,
                       args=(mb.name, WRITES, started, stop, last, pause))
    proc.start()
    try:
        yield started
    finally:
        stop.set()
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
        print(f"writer exit {proc.exitcode}, last version {last.value}")


def readers(args: argparse.Namespace) -> None:
    fmt = getattr(torch, args.fmt)
    keys = torch.arange(ROWS)
    every = hashed(torch.stack([
        reference(quantized_workers.version_rows(keys, v, DIM), fmt, torch.float32)
        for v in range(WRITES + 1)]))  # [versions, rows]
    with quantized_block(ROWS, DIM, fmt, quantized_workers.version_rows(keys, 0, DIM)) as mb:
        layers = [NVEmbedding(ROWS, DIM, torch.float32, LayerType.LinearUVM, storage=mb,
                              device=args.device,
                              gpu_cache_size=cache_bytes(DIM, torch.float32)),
                  NVEmbedding(ROWS, DIM, torch.float32, LayerType.GPULayer, storage=mb,
                              device=args.device)]
        names = ["LinearUVM", "GPULayer", "SharedMemBlock.read"]
        funcs = [*layers, lambda k: mb.read(k.cpu())]
        use = [0, 1] if args.gpu_only else [0, 1, 2]
        dev_keys = keys.to(args.device)
        for i in use:  # NOTE: compiled before the clock starts
            funcs[i](dev_keys)
        times: dict[str, list[float]] = {names[i]: [] for i in use}
        torn = dict.fromkeys(times, 0)
        try:
            with writer(mb) as started:
                end, n = time.monotonic() + args.seconds, 0
                while time.monotonic() < end:
                    i = use[n % len(use)]
                    t = time.perf_counter()
                    got = hashed(funcs[i](dev_keys).cpu())
                    times[names[i]].append(time.perf_counter() - t)
                    started.set()
                    bad = torch.stack([~torch.isin(got[r:r + 1], every[:, r])
                                       for r in range(ROWS)])
                    torn[names[i]] += int(bool(bad.any()))
                    n += 1
        finally:
            for layer in layers:
                layer.close()
    for name, ts in times.items():
        t = torch.tensor(ts) * 1e3
        print(f"{name:20s} lookups {t.numel():6d}  p50 {t.median():9.3f} ms  p99 "
              f"{t.quantile(.99):9.3f}  max {t.max():9.3f}  over 10 ms "
              f"{int((t > 10).sum()):5d}  torn {torn[name]}")


def _rounds(table_ptr, tstride, n_rows, polls, out_ptr, DIM: tl.constexpr,
            BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr,
            META: tl.constexpr, SEQ: tl.constexpr):
    """One program: ``polls`` rounds of the seqlocked read of rows ``0 .. n_rows - 1``
    (``_versioned_once``, the kernels' own, bound in this module's globals by
    :func:`rounds`); per row, the rounds judged torn, to ``out_ptr``."""
    rows = tl.arange(0, BLOCK_K).to(tl.int64)
    rmask = rows < n_rows
    d = tl.arange(0, BLOCK_D)
    dmask = d < DIM
    vptr = (table_ptr + rows * tstride + SEQ).to(tl.pointer_type(tl.int32))
    torn = tl.full([BLOCK_K], 0, tl.int32)
    for i in range(polls):
        vals, bad = _versioned_once(table_ptr, vptr, rows, rmask, tstride, d,  # noqa: F821
                                    dmask, QUANT, META, i + 1)
        torn += bad.to(tl.int32)
    tl.store(out_ptr + rows, torn, mask=rmask)


def rounds(args: argparse.Namespace) -> None:
    import triton

    from gpu.kernels.triton_access import kernel_module

    cpu = args.device == "cpu"
    stored = kernel_module("stored_rows", interpret=cpu)
    globals()["_versioned_once"] = stored._versioned_once
    from triton import knobs

    knobs.runtime.interpret = cpu
    kernel = triton.jit(_rounds)
    out = torch.zeros(ROWS, dtype=torch.int32, device=args.device)
    with written_block(args, args.pause) as (mb, view):
        cx = stored.codec_constexprs(mb.read_format)
        cx.pop("enable_fp_fusion", None)
        for polls in (min(100, args.polls), args.polls):
            t = time.perf_counter()
            kernel[(1,)](view, view.stride(0), ROWS, polls, out, DIM=DIM, BLOCK_K=ROWS,
                         BLOCK_D=DIM, num_warps=8, **cx)
            o = out.cpu().float()
            dt = time.perf_counter() - t
            print(f"{args.device} kernel, {polls} rounds: {dt / polls * 1e6:.3f} us a round, "
                  f"judged torn in {o.mean() / polls:.2%} of them (the worst row "
                  f"{o.max() / polls:.2%})")


@contextmanager
def written_block(args: argparse.Namespace, pause: float = 0.0) -> Any:
    """(block, its rows as the kernels see them on ``args.device``) of a fresh quantized
    block, the writer's duty printed first, then the writer process running from its first
    write on for the ``with`` body."""
    from gpu.stacks.linear_tables import registered_rows

    keys = torch.arange(ROWS)
    fmt = getattr(torch, args.fmt)
    with quantized_block(ROWS, DIM, fmt, quantized_workers.version_rows(keys, 0, DIM)) as mb:
        duty(mb)
        reg, view = registered_rows(mb, torch.device(args.device))
        try:
            with writer(mb, pause) as started:
                started.set()
                _first_write(mb)
                yield mb, view
        finally:
            if reg is not None:
                reg.close()


def _first_write(mb: Any) -> None:
    """Wait (up to 60 s) for the writer's first write."""
    v0, since = mb.versions, time.monotonic()
    assert v0 is not None
    first = int(v0[0])
    while int(v0[0]) == first and time.monotonic() - since < 60:
        time.sleep(0.001)  # NOTE: measure from the writer's first write on


def duty(mb: Any) -> None:
    """The writer's share of time inside a section, written in this process alone."""
    inside = [0.0]
    section = row_versions.section

    @contextmanager
    def timed(v: torch.Tensor, r: Any) -> Any:
        t = time.perf_counter()
        with section(v, r):
            yield
        inside[0] += time.perf_counter() - t

    keys = torch.arange(ROWS)
    row_versions.section = timed  # type: ignore[assignment]
    try:
        end, n, t0 = time.monotonic() + 2, 0, time.perf_counter()
        while time.monotonic() < end:
            n += 1
            mb.write(keys, quantized_workers.version_rows(keys, n % WRITES + 1, DIM))
        total = time.perf_counter() - t0
    finally:
        row_versions.section = section  # type: ignore[assignment]
    print(f"writer alone: {n} writes, {total / n * 1e6:.1f} us a write, "
          f"{inside[0] / total:.2%} of the time inside a section")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["readers", "rounds"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--fmt", default="int8", choices=["int8", "float8_e4m3fn"])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--gpu-only", action="store_true", help="the two layers only")
    p.add_argument("--rounds", type=int, help="stored_rows.ROUNDS for this run")
    p.add_argument("--wait", type=float, help="row_versions.WAIT_SECONDS for this run")
    p.add_argument("--polls", type=int, default=1_000_000)
    p.add_argument("--pause", type=float, default=0.0,
                   help="rounds: seconds the writer waits between writes (0: flat out)")
    args = p.parse_args()
    if args.rounds:
        import triton.language as tl

        from gpu.kernels.triton_access import kernel_module

        # NOTE: before any kernel compiles: the kernels take the module's global then
        kernel_module("stored_rows", interpret=False).ROUNDS = tl.constexpr(args.rounds)
    if args.wait:
        row_versions.WAIT_SECONDS = args.wait
    {"readers": readers, "rounds": rounds}[args.what](args)


if __name__ == "__main__":
    main()
