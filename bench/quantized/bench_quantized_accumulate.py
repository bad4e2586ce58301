"""Accumulating into quantized rows: how far a row drifts from the exact sum after many
small accumulates, rounded to nearest vs stochastically (what every accumulate stores:
``nvecache.common.quant.encode_sum``), int8 and fp8; and what stochastic rounding costs per
accumulate on the CPU.

Drift: the scenario of the tests (tests/quant_drift.py): 16 rows of dim 128 whose
quantization step stays fixed while ``--adds`` accumulates of a delta well under half a
step (int8: 1/20 of a step; fp8: 1/71 to 1/143 of one) move most elements by 51 steps
(int8) or 7 (fp8). Run through a real ``SharedMemBlock`` (stochastic, its accumulate)
and through the codec alone, each rule (decode, add the delta, encode: what a tier's
accumulate does). Each
line gives the mean error over the moving elements, signed along the delta (negative:
short of the exact sum), its mean magnitude and the largest, in steps and as the fraction
of the exact movement kept.

Cost: one accumulate of ``rows`` rows of dim 128 as a tier computes it (decode, add,
encode), rounded to nearest vs stochastically, and a ``SharedMemBlock.accumulate`` of the
same rows (the whole call: checks, the writer lock, the ring; stochastic), interleaved
call by call (median of ``--reps``). One torch thread (two threads on a busy 2-core
machine wait on each other).

Prints one JSON line per figure. Run: ``python bench/quantized/bench_quantized_accumulate.py
[--quick] [--adds 1000] [--reps 200]``.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hostcache import SharedMemBlock  # noqa: E402
from nvecache.common import quant  # noqa: E402
from tests import quant_drift  # noqa: E402
from tests.conftest import fresh_name  # noqa: E402

FORMATS = (torch.int8, torch.float8_e4m3fn)
DIM = 128


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def drift_fields(case: quant_drift.Drift, start: torch.Tensor, final: torch.Tensor,
                 adds: int) -> dict[str, Any]:
    """The drift figures of a run (module docstring), in steps of ``case.step``."""
    moving = case.moving
    exact = adds * case.delta.double()
    err = (final.double() - start.double() - exact) * case.delta.sign()
    err = err[moving]
    kept = ((final.double() - start.double()) * case.delta.sign())[moving].sum() / \
        exact.abs()[moving].sum()
    return {"mean_error_steps": round(float(err.mean()) / case.step, 4),
            "mean_abs_error_steps": round(float(err.abs().mean()) / case.step, 3),
            "max_abs_error_steps": round(float(err.abs().max()) / case.step, 3),
            "exact_movement_steps": round(float(exact.abs()[moving].mean()) / case.step, 2),
            "movement_kept": round(float(kept), 4),
            "bound_6_sigma_steps": round(quant_drift.tolerance(case, adds) / case.step, 4)}


def codec_run(case: quant_drift.Drift, start: torch.Tensor, adds: int, stochastic: bool,
              gen: torch.Generator) -> torch.Tensor:
    stored = quant.encode(start, case.fmt)
    for _ in range(adds):
        stored = quant.encode(quant.decode(stored, case.fmt) + case.delta, case.fmt,
                              stochastic=stochastic, generator=gen)
    return quant.decode(stored, case.fmt)


def drift(adds: int) -> None:
    for dtype in FORMATS:
        case = quant_drift.scenario(dtype)
        name = fresh_name("bqa")
        idx = torch.arange(quant_drift.ROWS)
        with SharedMemBlock.create(name, num_rows=quant_drift.ROWS, dim=quant_drift.DIM,
                                   dtype=dtype) as mb:
            try:
                mb.write(idx, case.start)
                start = mb.read(idx)
                quant.seed_rounding(0)
                for _ in range(adds):
                    mb.accumulate(idx, case.delta)
                emit(bench="drift", dtype=str(dtype), adds=adds, rows=quant_drift.ROWS,
                     dim=quant_drift.DIM, path="SharedMemBlock.accumulate",
                     rounding="stochastic", step=case.step,
                     delta_steps=round(float(case.delta.abs().max()) / case.step, 4),
                     **drift_fields(case, start, mb.read(idx), adds))
            finally:
                SharedMemBlock.unlink(name)
        for stochastic in (False, True):
            gen = torch.Generator().manual_seed(0)
            final = codec_run(case, start, adds, stochastic, gen)
            emit(bench="drift", dtype=str(dtype), adds=adds, rows=quant_drift.ROWS,
                 dim=quant_drift.DIM, path="codec (decode, add, encode)",
                 rounding="stochastic" if stochastic else "nearest", step=case.step,
                 delta_steps=round(float(case.delta.abs().max()) / case.step, 4),
                 **drift_fields(case, start, final, adds))


def timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def add_encode(stored: torch.Tensor, delta: torch.Tensor, fmt: Any, stochastic: bool
               ) -> torch.Tensor:
    """An accumulate as a tier computes it: decode, add, encode by the rule given."""
    return quant.encode(quant.decode(stored, fmt) + delta, fmt, stochastic=stochastic)


def cost(rows: int, reps: int) -> None:
    gen = torch.Generator().manual_seed(1)
    for dtype in FORMATS:
        fmt = quant_drift.scenario(dtype).fmt
        stored = quant.encode(torch.randn(rows, DIM, generator=gen), fmt)
        delta = torch.randn(rows, DIM, generator=gen) * 1e-3
        name = fresh_name("bqa")
        idx = torch.arange(rows)
        with SharedMemBlock.create(name, num_rows=rows, dim=DIM, dtype=dtype) as mb:
            try:
                mb.write(idx, quant.decode(stored, fmt))
                ways = {"nearest": functools.partial(add_encode, stored, delta, fmt, False),
                        "stochastic": functools.partial(add_encode, stored, delta, fmt, True),
                        "memblock": functools.partial(mb.accumulate, idx, delta)}
                for fn in ways.values():
                    fn()  # NOTE: warm-up
                times: dict[str, list[float]] = {k: [] for k in ways}
                for _ in range(reps):  # NOTE: interleaved call by call
                    for k, fn in ways.items():
                        times[k].append(timed(fn))
            finally:
                SharedMemBlock.unlink(name)
        med = {k: statistics.median(v) for k, v in times.items()}
        emit(bench="accumulate_cost", dtype=str(dtype), rows=rows, dim=DIM, reps=reps,
             nearest_us=round(med["nearest"] * 1e6, 1),
             stochastic_us=round(med["stochastic"] * 1e6, 1),
             stochastic_over_nearest=round(med["stochastic"] / med["nearest"], 3),
             extra_us_per_row=round((med["stochastic"] - med["nearest"]) * 1e6 / rows, 4),
             memblock_accumulate_us=round(med["memblock"] * 1e6, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 200 adds, 20 reps")
    ap.add_argument("--adds", type=int, default=quant_drift.ADDS)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.quick:
        args.adds, args.reps = 200, 20
    torch.set_num_threads(args.threads)
    emit(bench="settings", adds=args.adds, reps=args.reps, threads=args.threads,
         torch=torch.__version__)
    drift(args.adds)
    for rows in (16, 1024, 16384):
        cost(rows, args.reps if rows < 16384 else max(5, args.reps // 10))


if __name__ == "__main__":
    main()
