"""Tables a test builds a layer of each type over, and the devices it runs on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import psclient
from gpu import LayerType
from hostcache import HostCache, SharedMemBlock
from tests.conftest import fresh_name

#: the CPU, and CUDA where there is one (marked ``gpu``)
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
])]


@contextlib.contextmanager
def tables(layer_type: LayerType, tmp_path: Path, w: torch.Tensor) -> Iterator[dict[str, Any]]:
    """Layer arguments of ``layer_type`` over tables holding ``w``'s rows, the test's own
    (closed and removed at the end): a GPULayer's own table, a SharedMemBlock under a
    LinearUVM cache, a host cache over a ``file://`` parameter server."""
    name = fresh_name()
    rows, dim = w.shape
    if layer_type is LayerType.GPULayer:
        yield {"weight_init": w}
    elif layer_type is LayerType.LinearUVM:
        with SharedMemBlock.create(name, num_rows=rows, dim=dim) as mb:
            try:
                mb.write(torch.arange(rows), w)
                yield {"storage": mb, "gpu_cache_size": 16 * 64}
            finally:
                SharedMemBlock.unlink(name)
    else:
        with HostCache.create(name, capacity=32, dim=dim, ways=4) as hc:
            try:
                with psclient.connect(f"file://{tmp_path}/{name}", table=name, dim=dim,
                                      dtype=w.dtype) as ps:
                    ps.load(w, progress=False)
                    yield {"host_cache": hc, "storage": ps, "gpu_cache_size": 16 * 64}
            finally:
                HostCache.unlink(name)
