"""The quantized tables a training test builds a layer over (tests/gpu/train/test_quantized.py).

Each kind names the layer type and the quantized table(s) it reads; the rows ``w`` are
written quantized (rounded to nearest).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import psclient
from gpu import DistMemBlock, LayerType, NVEmbedding
from gpu.tier_config import TierConfig
from hostcache import HostCache, SharedMemBlock
from tests.conftest import fresh_name

#: every table a layer trains over quantized: a Hierarchical layer over a quantized parameter
#: server (file://, Redis; a plain or a quantized host cache in front, or none), over a
#: quantized host cache alone; a GPULayer's own table (weight_dtype=); GPULayer and
#: LinearUVM over a quantized SharedMemBlock or DistMemBlock
KINDS = ["ps-file", pytest.param("ps-redis", marks=pytest.mark.redis), "ps-file+host",
         "host", "ps-file+qhost", "own-GPULayer", "memblock-GPULayer", "memblock-LinearUVM",
         "distmem-GPULayer", "distmem-LinearUVM"]
#: admissions at once (the GPU cache holds what a lookup read)
TUNING = TierConfig(admit_batches=1)


@contextlib.contextmanager
def tables(kind: str, fmt: torch.dtype, w: torch.Tensor, device: str, tmp_path: Path,
           request: pytest.FixtureRequest) -> Iterator[tuple[LayerType, dict[str, Any]]]:
    """``(layer type, layer arguments)`` over tables of ``kind`` holding ``w``'s rows in
    ``fmt``; every table closed and removed at the end."""
    rows, dim = w.shape
    name = fresh_name()
    cache = {"gpu_cache_size": 16 * dim * 4}
    with contextlib.ExitStack() as stack:
        if kind == "own-GPULayer":
            yield LayerType.GPULayer, {"weight_dtype": fmt, "weight_init": w}
            return
        if kind.startswith("memblock-"):
            mb = stack.enter_context(SharedMemBlock.create(name, num_rows=rows, dim=dim,
                                                           dtype=fmt))
            stack.callback(SharedMemBlock.unlink, name)
            mb.write(torch.arange(rows), w)
            layer_type = LayerType[kind.split("-")[1]]
            yield layer_type, {"storage": mb, **(cache if layer_type is LayerType.LinearUVM
                                                 else {})}
            return
        if kind.startswith("distmem-"):
            devs = "cpu" if device == "cpu" else [torch.device(device)]
            block = stack.enter_context(DistMemBlock(rows, dim, fmt, devices=devs, name=name))
            block.write(torch.arange(rows), w.to(device))
            layer_type = LayerType[kind.split("-")[1]]
            yield layer_type, {"storage": block, **(cache if layer_type is LayerType.LinearUVM
                                                    else {})}
            return
        args: dict[str, Any] = dict(cache)
        if kind in ("host", "ps-file+qhost", "ps-file+host"):
            host_fmt = torch.float32 if kind == "ps-file+host" else fmt
            # NOTE: room for every row (without a parameter server the host cache is the
            # table: no row may be evicted)
            hc = stack.enter_context(HostCache.create(name, capacity=4 * rows, dim=dim,
                                                      dtype=host_fmt, ways=4))
            stack.callback(HostCache.unlink, name)
            args["host_cache"] = hc
            if kind == "host":
                hc.insert(torch.arange(rows), w)
                assert bool(hc.lookup(torch.arange(rows))[1].all())
        if kind.startswith("ps-"):
            url = (request.getfixturevalue("redis_url") if kind == "ps-redis"
                   else f"file://{tmp_path}/{name}")
            ps = stack.enter_context(psclient.connect(url, table=name, dim=dim, dtype=fmt))
            stack.callback(ps.drop)
            ps.insert(torch.arange(rows), w)
            args["storage"] = ps
        yield LayerType.Hierarchical, args


def build(layer_type: LayerType, args: dict[str, Any], fmt: torch.dtype, device: str,
          optimizer: Any, rows: int, dim: int) -> Any:
    """A float32 training layer over the tables (``fmt`` is theirs, in ``args``)."""
    return NVEmbedding(rows, dim, torch.float32, layer_type, device=device,
                       optimize_for_training=True, optimizer=optimizer, tuning=TUNING, **args)
