# ruff: noqa: N803  (Triton convention: compile-time constants are UPPER_CASE parameters)
"""A/B of a training step's row add (fused SGD on a GPULayer's own table), kernel only:
the shipped kernel (:func:`gpu.kernels.row_add.add_rows`: one float32 atomic add per
occurrence and element), a candidate defined here that sorts the keys first and adds each
run of equal keys once per program (a segmented scan, then one atomic add per key and
program), ``torch.Tensor.index_add_`` and ``torch.sort`` alone, over 4M x 128 float32
rows, Zipf(1.05) and uniform keys, 4k to 1M per step.

Why the candidate: on the H200 the shipped kernel's time tracks the number of element
atomics (about 175 G float32 reductions a second; PTX ``red.global.add.v4.f32`` measured
the same as scalar reductions, so wider atomics do not help, fewer do), and a Zipf batch
holds 22-37% distinct keys. It replaces the shipped kernel where this A/B shows it faster
at the sizes a training step takes (bench/RESULTS.md, "Training (H200)").

Prints one JSON line per size (times in us, CUDA events over 20 launches) and the
candidate's largest difference from ``index_add_``. Without CUDA (``--check``) it runs the
candidate in Triton's interpreter against the shipped kernel's torch twin at a small size.
Run: ``python bench/kernels/bench_row_add.py [--check]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.workloads import ZipfKeys  # noqa: E402
from gpu.kernels.triton_access import kernel_module  # noqa: E402
from gpu.stacks.linear_tables import add_occurrences  # noqa: E402

DIM = 128
ROWS = 4 << 20

if not torch.cuda.is_available():
    triton.knobs.runtime.interpret = True  # NOTE: before the decorators below read it


@triton.jit
def _plus(a, b):
    return a + b


@triton.jit
def _run_sum(head_a, a, head_b, b):
    # a segmented scan's combine: b starts a new run of equal keys, or adds to a's run
    return head_a | head_b, tl.where(head_b != 0, b, a + b)


@triton.jit
def _sorted_add(sorted_ptr, order_ptr, n, grad_ptr, table_ptr, num_rows, tstride,
                skipped_ptr, alpha, DIM: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    lane = tl.arange(0, BLOCK_K)
    offs = pid.to(tl.int64) * BLOCK_K + lane
    live = offs < n
    keys = tl.load(sorted_ptr + offs, mask=live, other=-1)
    before = tl.load(sorted_ptr + offs - 1, mask=live & (lane > 0), other=-1)
    after = tl.load(sorted_ptr + offs + 1, mask=(offs + 1 < n) & (lane < BLOCK_K - 1),
                    other=-1)
    src = tl.load(order_ptr + offs, mask=live, other=0)
    d = tl.arange(0, BLOCK_D)
    dmask = d < DIM
    g = tl.load(grad_ptr + src[:, None] * DIM + d[None, :],
                mask=live[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    bad = tl.reduce(((g - g) != 0).to(tl.int32), 1, _plus) > 0  # x - x: NaN unless finite
    nbad = tl.reduce((bad & live).to(tl.int64), 0, _plus)
    if nbad > 0:
        tl.atomic_add(skipped_ptr, nbad)
    g = tl.where(bad[:, None], 0.0, g)
    head = tl.broadcast_to(((keys != before) | (lane == 0)).to(tl.int32)[:, None],
                           (BLOCK_K, BLOCK_D))
    _, run = tl.associative_scan((head, g), 0, _run_sum)
    last = live & ((keys != after) | (lane == BLOCK_K - 1))  # holds its run's sum
    ok = last & (keys >= 0) & (keys < num_rows)
    tl.atomic_add(table_ptr + keys[:, None] * tstride + d[None, :], run * alpha,
                  mask=ok[:, None] & dmask[None, :], sem="relaxed")


def sorted_add(table: torch.Tensor, keys: torch.Tensor, grad: torch.Tensor, alpha: float,
               skipped: torch.Tensor, block_k: int = 64, num_warps: int = 4) -> None:
    """The candidate: ``torch.sort`` of the keys, then one launch of :func:`_sorted_add`."""
    n = keys.numel()
    ordered, order = torch.sort(keys)
    _sorted_add[(triton.cdiv(n, block_k),)](
        ordered, order, n, grad, table, table.shape[0], table.stride(0), skipped,
        float(alpha), DIM=grad.shape[1], BLOCK_K=block_k,
        BLOCK_D=max(16, 1 << (grad.shape[1] - 1).bit_length()), num_warps=num_warps)


def event_us(fn: Callable[[], object], reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / reps * 1e3, 1)


def check() -> None:
    """The candidate against the torch twin, in the interpreter (duplicates, keys outside
    the table, non-finite gradient rows)."""
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(50, 37, generator=gen)
    keys = torch.randint(-2, 53, (300,), generator=gen)
    grad = torch.randn(300, 37, generator=gen)
    grad[3, 5], grad[8, 0] = float("nan"), float("inf")
    want, got = table.clone(), table.clone()
    skip_want, skip_got = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    add_occurrences(want, keys, grad, -0.25, skip_want)
    sorted_add(got, keys, grad, -0.25, skip_got)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert int(skip_got) == int(skip_want) == 2
    print(json.dumps({"check": "ok", "max_diff": (got - want).abs().max().item()}))


def figures(shipped: object, table: torch.Tensor, keys: torch.Tensor, grad: torch.Tensor,
            skipped: torch.Tensor) -> dict[str, object]:
    """One size's times (us) and the candidate's largest difference from ``index_add_``."""
    fig: dict[str, object] = {
        "shipped_us": event_us(lambda: shipped.add_rows(  # type: ignore[attr-defined]
            table, keys, grad, -0.01, skipped)),
        "index_add_us": event_us(lambda: table.index_add_(0, keys, grad, alpha=-0.01)),
        "sort_us": event_us(lambda: torch.sort(keys))}
    for bk, nw in ((32, 4), (32, 8), (64, 4), (64, 8), (128, 4), (128, 8)):
        fig[f"candidate_bk{bk}_w{nw}_us"] = event_us(
            lambda bk=bk, nw=nw: sorted_add(table, keys, grad, -0.01, skipped, bk, nw))
    a, b = table[:1 << 16].clone(), table[:1 << 16].clone()
    small = keys % (1 << 16)
    sorted_add(a, small, grad, -0.5, skipped)
    b.index_add_(0, small, grad, alpha=-0.5)
    fig["candidate_max_diff"] = (a - b).abs().max().item()
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    if args.check or not torch.cuda.is_available():
        check()
        return
    shipped = kernel_module("row_add", interpret=False)
    dev = torch.device("cuda")
    table = torch.randn(ROWS, DIM, device=dev)
    skipped = torch.zeros((), dtype=torch.int64, device=dev)
    for dist in ("zipf", "uniform"):
        for n in (1 << 12, 1 << 16, 1 << 18, 1 << 20):
            keys = (ZipfKeys(ROWS, 1.05, seed=n).sample(n) if dist == "zipf"
                    else torch.randint(0, ROWS, (n,))).to(dev)
            grad = torch.randn(n, DIM, device=dev)
            fig: dict[str, object] = {"bench": "row_add", "keys": dist, "n": n,
                                      "distinct": round(keys.unique().numel() / n, 3)}
            fig.update(figures(shipped, table, keys, grad, skipped))
            print(json.dumps(fig), flush=True)


if __name__ == "__main__":
    main()
