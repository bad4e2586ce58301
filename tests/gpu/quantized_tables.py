"""The linear layers over quantized tables that the tests of
tests/gpu/quantized/test_linear_quantized*.py
build: a GPULayer's own table stored with ``weight_dtype=``, and a quantized SharedMemBlock
under a GPULayer, a HostLayer and a LinearUVM layer (a small GPU cache, so that lookups
both hit and miss); and the reference rows, ``quant.decode(quant.encode(rows, fmt), fmt,
dtype)``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from gpu import LayerType
from gpu.tier_config import TierConfig
from hostcache import SharedMemBlock
from nvecache.common import quant
from nvecache.common.rows import QUANTIZED, RowFormat
from tests.conftest import fresh_name

#: the quantized formats, as torch dtypes
FORMATS = [getattr(torch, name) for name in QUANTIZED]
#: the layers' output dtypes
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
#: how a layer reads a quantized table: (layer type, over a SharedMemBlock)
KINDS = {"own": (LayerType.GPULayer, False), "gpulayer": (LayerType.GPULayer, True),
         "hostlayer": (LayerType.HostLayer, True), "linearuvm": (LayerType.LinearUVM, True)}


def rows_of(n: int, dim: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """float32 rows exactly representable in ``dtype`` (so that writing them in ``dtype``
    or in float32 stores the same bytes)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, dim, generator=g) * 3).to(dtype).float()


def reference(values: torch.Tensor, fmt: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """What a quantized table of format ``fmt`` holding ``values`` reads, in ``dtype``."""
    f = RowFormat(fmt, values.shape[1])
    return quant.decode(quant.encode(values, f), f, dtype)


def cache_bytes(dim: int, dtype: torch.dtype, slots: int = 16) -> int:
    """A GPU cache of ``slots`` slots (a bucket of 8 ways is the least)."""
    return slots * (12 + dim * dtype.itemsize)


@contextlib.contextmanager
def quantized_block(num_rows: int, dim: int, fmt: torch.dtype,
                    values: torch.Tensor | None = None) -> Iterator[SharedMemBlock]:
    """A quantized SharedMemBlock holding ``values`` (closed and removed at the end)."""
    name = fresh_name("qlin")
    mb = SharedMemBlock.create(name, num_rows=num_rows, dim=dim, dtype=fmt)
    try:
        if values is not None:
            mb.write(torch.arange(num_rows), values)
        yield mb
    finally:
        mb.close()
        SharedMemBlock.unlink(name)


@contextlib.contextmanager
def quantized_layer(kind: str, values: torch.Tensor, fmt: torch.dtype, dtype: torch.dtype,
                    device: str, cls: type, backend: str = "auto", **kw: Any
                    ) -> Iterator[tuple[Any, SharedMemBlock | None]]:
    """A layer of ``kind`` (a key of :data:`KINDS`) over a quantized table holding
    ``values`` (float32 ``[rows, dim]``), and its block (None: the layer's own table)."""
    layer_type, over_block = KINDS[kind]
    rows, dim = values.shape
    tuning = TierConfig(cache_backend=backend)  # type: ignore[arg-type]
    extra: dict[str, Any] = {"tuning": tuning, "device": device, **kw}
    if layer_type is LayerType.LinearUVM:
        extra["gpu_cache_size"] = cache_bytes(dim, dtype)
    if not over_block:
        with cls(rows, dim, dtype, layer_type, weight_init=values.to(dtype), weight_dtype=fmt,
                 **extra) as layer:
            yield layer, None
        return
    with quantized_block(rows, dim, fmt, values) as mb, \
            cls(rows, dim, dtype, layer_type, storage=mb, **extra) as layer:
        yield layer, mb


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
