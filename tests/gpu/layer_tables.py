"""Tables a test builds a layer of each type over, and the devices it runs on."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
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


def race(write: Callable[[], None], read: Callable[[Any], None], readers: list[Any],
         done: threading.Event) -> None:
    """``write()`` on one thread and ``read(layer)`` on one thread per reader, all joined;
    the first exception any of them raised is raised here (it sets ``done`` first, so the
    others stop: ``write`` sets it when it ends, the readers read until it is set)."""
    errors: list[BaseException] = []

    def guarded(fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - reported by the calling thread
            errors.append(e)
            done.set()

    threads = [threading.Thread(target=guarded, args=(write,))] + [
        threading.Thread(target=guarded, args=(read, r)) for r in readers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
