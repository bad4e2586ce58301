"""The training-write kernels (gpu.kernels.row_add) against their torch twins: per
occurrence adds with duplicate keys, rows of NaN or infinity skipped and counted, keys
outside the table writing nothing, odd dims, every gradient dtype; stores of distinct
rows. Interpreted by Triton on the CPU, compiled on CUDA."""

from __future__ import annotations

import pytest
import torch

from gpu.kernels.triton_access import kernel_module, triton_available
from gpu.stacks.linear_tables import add_occurrences
from tests.gpu.layer_tables import DEVICES

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs triton")


def _kernels(device: str) -> object:
    return kernel_module("row_add", interpret=device == "cpu")


def _batch(rows: int, dim: int, n: int, dtype: torch.dtype, device: str, seed: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(rows, dim, generator=gen)
    keys = torch.randint(0, rows // 3, (n,), generator=gen)  # NOTE: many duplicates
    keys[::7] = torch.tensor([-1, rows, rows + 5])[torch.arange(keys[::7].numel()) % 3]
    grad = torch.randn(n, dim, generator=gen)
    grad[3, dim // 2] = float("nan")
    grad[5, 0] = float("inf")
    grad[9, dim - 1] = -float("inf")
    return table.to(device), keys.to(device), grad.to(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dim", [1, 5, 37, 130])
def test_add_rows_matches_the_torch_twin(dim: int, dtype: torch.dtype, device: str) -> None:
    n = 300 if dim < 64 or device != "cpu" else 40  # NOTE: the interpreter is slow
    table, keys, grad = _batch(50, dim, n, dtype, device, seed=dim)
    want, got = table.clone(), table.clone()
    want_skip = torch.zeros((), dtype=torch.int64, device=device)
    got_skip = torch.zeros((), dtype=torch.int64, device=device)
    add_occurrences(want, keys, grad, -0.25, want_skip)
    _kernels(device).add_rows(got, keys, grad, -0.25, got_skip)
    assert int(got_skip) == int(want_skip) == 3
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the reference by hand: each good occurrence of a key in range added once
    ref = table.clone()
    for i in range(keys.numel()):
        k = int(keys[i])
        if 0 <= k < ref.shape[0] and bool(torch.isfinite(grad[i]).all()):
            ref[k] += -0.25 * grad[i].float()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_add_rows_reads_padded_rows(device: str) -> None:
    """A table whose rows are wider than the gradient (a row's optimizer state after it)
    gets the first ``dim`` columns added, the rest untouched."""
    table, keys, grad = _batch(40, 9, 100, torch.float32, device, seed=1)
    wide = torch.cat([table, torch.full((40, 3), 7.0, device=device)], dim=1)
    view = wide[:, :9]
    skipped = torch.zeros((), dtype=torch.int64, device=device)
    _kernels(device).add_rows(view, keys, grad, 0.5, skipped)
    want = table.clone()
    add_occurrences(want, keys, grad, 0.5, torch.zeros_like(skipped))
    torch.testing.assert_close(wide[:, :9], want, atol=1e-5, rtol=1e-5)
    assert bool((wide[:, 9:] == 7.0).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_store_rows_writes_distinct_rows_in_range(dtype: torch.dtype, device: str) -> None:
    gen = torch.Generator().manual_seed(4)
    table = torch.randn(64, 33, generator=gen).to(dtype).to(device)
    keys = torch.randperm(64, generator=gen)[:20]
    keys[4] = 64  # NOTE: outside the table: written nowhere
    keys = keys.to(device)
    rows = torch.randn(20, 33, generator=gen).to(dtype).to(device)
    got = table.clone()
    _kernels(device).store_rows(got, keys, rows)
    ok = keys < 64
    want = table.clone()
    want.index_copy_(0, keys[ok], rows[ok])
    assert torch.equal(got, want)
