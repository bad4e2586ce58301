"""The linear layer types over quantized tables (int8, float8_e4m3fn): a GPULayer's own table
stored with ``weight_dtype=``, and a quantized SharedMemBlock under a GPULayer, a HostLayer
and a LinearUVM layer (a small GPU cache: lookups hit and miss, admission rounds run).
Lookups, plain and pooled (sum, mean, max, per-sample weights, empty bags), read
``quant.decode(quant.encode(rows, fmt), fmt, dtype)``: bit for bit for rows, within the
output dtype's rounding of an fp32 sum for bags. Output fp32 / fp16 / bf16, odd dims; the
CPU (the torch paths, and the kernels under Triton's interpreter) and CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from gpu import NVEmbedding, NVEmbeddingBag
from gpu.export import aot
from tests.gpu.layer_tables import DEVICES
from tests.gpu.quantized_tables import (
    DTYPES,
    FORMATS,
    KINDS,
    quantized_layer,
    reference,
    rows_of,
)

ROWS = 64
#: lookups of several sizes, with repeated keys and both ends of the table
BATCHES = [torch.tensor([0, 5, 63, 5, 17, 2]), torch.arange(ROWS).flip(0),
           torch.tensor([7]), torch.tensor([63, 0, 0, 31, 32, 12, 12, 40, 9, 5, 17]),
           torch.arange(0, ROWS, 3)]
#: bags (include_last_offset): empty ones first, between and last
KEYS = torch.tensor([3, 9, 9, 63, 0, 41, 17, 5, 28, 3, 50])
OFFSETS = torch.tensor([0, 0, 3, 3, 7, 11, 11])
#: what two fp32 sums of the same terms in different orders may differ by, and one
#: rounding of the output dtype
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-4},
             torch.float16: {"rtol": 2e-3, "atol": 2e-3},
             torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2}}


def check_lookups(dim: int, dtype: torch.dtype, fmt: torch.dtype, kind: str, device: str,
                  backend: str) -> None:
    """Lookups of every batch (and a 2-D one) read the reference rows bit for bit."""
    values = rows_of(ROWS, dim, dtype, seed=dim)
    want = reference(values, fmt, dtype)
    with quantized_layer(kind, values, fmt, dtype, device, NVEmbedding,
                         backend) as (layer, _):
        for i, keys in enumerate(BATCHES):
            got = layer(keys.to(device))
            assert got.dtype == dtype
            assert torch.equal(got.cpu(), want[keys]), i
            if i == 1:
                layer.flush()  # NOTE: a LinearUVM layer admits what it logged
        grid = layer(torch.arange(12).view(3, 4).to(device))  # any key shape
        assert torch.equal(grid.cpu(), want[:12].view(3, 4, dim))
        if kind == "linearuvm":  # NOTE: the cache's rows are dequantized ones
            held = layer.in_gpu_cache(torch.arange(ROWS, device=device))
            assert bool(held.any()) and not bool(held.all())
            stats = layer.stats().gpu
            assert stats.hits > 0 and stats.misses > 0
            again = layer(torch.arange(ROWS, device=device))
            assert torch.equal(again.cpu(), want)


def check_bags(mode: str, dim: int, dtype: torch.dtype, fmt: torch.dtype, kind: str,
               device: str, backend: str) -> None:
    """Bags pool the reference rows: max bit for bit, sums and means within an fp32 sum's
    order and one rounding of the output dtype; empty bags are zero."""
    values = rows_of(ROWS, dim, dtype, seed=3)
    want = reference(values, fmt, dtype)
    weights = (torch.rand(KEYS.numel(), generator=torch.Generator().manual_seed(4)) + 0.5
               ).to(dtype) if mode == "weighted" else None
    pool = "sum" if mode == "weighted" else mode
    if pool == "max":  # NOTE: order-free: bit for bit with torch's over the same rows
        ref = F.embedding_bag(KEYS, want, OFFSETS, mode="max", include_last_offset=True)
    else:  # fp32 sums of the rows as they read, rounded once
        ref = F.embedding_bag(KEYS, want.float(), OFFSETS, mode=pool, include_last_offset=True,
                              per_sample_weights=None if weights is None else weights.float()
                              ).to(dtype)
    with quantized_layer(kind, values, fmt, dtype, device, NVEmbeddingBag, backend,
                         mode=pool, include_last_offset=True) as (bag, _):
        for _ in range(3):  # NOTE: a LinearUVM layer's later calls hit its cache
            got = bag(KEYS.to(device), OFFSETS.to(device),
                      None if weights is None else weights.to(device)).cpu()
            assert got.dtype == dtype and got.shape == (OFFSETS.numel() - 1, dim)
            assert not got[[0, 2, 5]].any()  # the empty bags
            if pool == "max":
                assert torch.equal(got, ref)
            else:
                torch.testing.assert_close(got, ref, **TOLERANCE[dtype])
            bag.flush()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [1, 5, 13, 128])
def test_lookups_read_the_dequantized_rows_bit_for_bit(
        dim: int, dtype: torch.dtype, fmt: torch.dtype, kind: str, device: str) -> None:
    check_lookups(dim, dtype, fmt, kind, device, "auto")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [1, 13, 128])
@pytest.mark.parametrize("mode", ["sum", "mean", "max", "weighted"])
def test_bags_pool_the_dequantized_rows(mode: str, dim: int, dtype: torch.dtype,
                                        fmt: torch.dtype, kind: str, device: str) -> None:
    check_bags(mode, dim, dtype, fmt, kind, device, "auto")


# NOTE: the CPU's lookups above run the torch paths; these run the same kernels as CUDA,
# under Triton's interpreter (slow: an odd dim and the 16-bit rounding of each format)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_kernels_read_the_dequantized_rows_under_the_interpreter(
        dtype: torch.dtype, fmt: torch.dtype, kind: str) -> None:
    check_lookups(13, dtype, fmt, kind, "cpu", "triton")


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("mode", ["sum", "mean", "weighted"])
def test_the_kernels_pool_the_dequantized_rows_under_the_interpreter(
        mode: str, fmt: torch.dtype, kind: str) -> None:
    check_bags(mode, 13, torch.float16, fmt, kind, "cpu", "triton")


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_quantized_lookup_is_not_compiled_into_an_aot_package(kind: str) -> None:
    values = rows_of(ROWS, 8, torch.float32)
    with quantized_layer(kind, values, torch.int8, torch.float32, "cpu",
                         NVEmbedding) as (layer, _):
        # NOTE: the package would gather its stored bytes as rows: it calls the layer's op,
        # whose kernels dequantize them
        assert aot.inline_args(layer) is None
