"""The node's compiled code made ready once, at service start, for every replica after it.

A replica's first lookups run code compiled on first use: the per-key loops (numba, cached
on disk beside their source or under ``NUMBA_CACHE_DIR``) and the GPU kernels (Triton,
cached under ``TRITON_CACHE_DIR``, default ``~/.triton/cache``). Compiling them in the
replica puts seconds in front of its first lookup; loading them from those caches,
milliseconds. So ``hostcache serve`` starts one child process (:class:`CompiledWarmer`)
that compiles, into the node's caches, the loops and, on a CUDA node, the kernels of
every layer type that can read each configured table (its dim and stored format, each
output dtype it can be read in) on every visible GPU, then exits: the service's own
process never holds a CUDA context, and a service that stops first stops the child.
Both caches key their entries by the code's source and the compiler's version, so an
upgrade compiles again, once.

The child builds small private tables of each format (the configured ones are never
touched) and runs each layer's lookups through the paths a replica takes: GPU-cache hits,
misses read on the CPU and by the GPU, admission, pooled bags. Run by hand:
``python -m nvecache.apps.service.compiled DIM:DTYPE:KIND ...`` (KIND ``hostcache`` or
``linear``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Any

from hostcache.errors import HostCacheError

logger = logging.getLogger(__name__)

#: the per-key loop modules (numba); each has a ``warm_up()``
LOOP_MODULES = ("hostcache.table_loops", "psclient.file.mirror_loops",
                "gpu.stacks.misses.miss_loops", "nvecache.common.quant_loops")


def table_spec(dim: int, dtype: str, kind: str) -> str:
    """One table's argument to the child: ``DIM:DTYPE:KIND``."""
    return f"{dim}:{dtype}:{kind}"


class CompiledWarmer:
    """The service's child process that fills the node's compiled caches.

    Args:
        specs: :func:`table_spec` of each configured table (repeats are warmed once).
    """

    def __init__(self, specs: Iterable[str]) -> None:
        self.specs = sorted(set(specs))
        self._child: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopped = False
        #: "warming", "ready" or "failed" (None before :meth:`start`)
        self.state: str | None = None
        #: seconds the child took (None until it ended)
        self.seconds: float | None = None

    def start(self) -> None:
        """Start the child (it lowers its own priority); a thread logs how it ended."""
        cmd = [sys.executable, "-m", __name__, *self.specs]
        with self._lock:
            if self._stopped:
                return
            try:
                self._child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL,
                                               stdout=subprocess.DEVNULL,
                                               stderr=subprocess.PIPE)
            except OSError as e:
                self.state = "failed"
                logger.warning("could not start the compiled-code warm-up (%s); each "
                               "replica compiles on its first lookups", e)
                return
            self.state = "warming"
        self._thread = threading.Thread(target=self._wait, name="nvecache-warm-compiled",
                                        daemon=True)
        self._thread.start()
        logger.info("warming the node's compiled caches (numba loops; on a CUDA node the "
                    "Triton kernels of %d table formats) in pid %d", len(self.specs),
                    self._child.pid)

    @property
    def pid(self) -> int | None:
        """The child's process id (None before :meth:`start`, or when it could not
        start)."""
        return None if self._child is None else self._child.pid

    def _wait(self) -> None:
        child = self._child
        assert child is not None
        t0 = time.monotonic()
        _, err = child.communicate()
        self.seconds = time.monotonic() - t0
        with self._lock:
            if self._stopped:
                return
            if child.returncode == 0:
                self.state = "ready"
                logger.info("compiled caches warm (%.1f s): replicas load their loops and "
                            "kernels instead of compiling them", self.seconds)
            else:
                self.state = "failed"
                logger.warning("the compiled-code warm-up failed (exit status %s); each "
                               "replica compiles on its first lookups: %s", child.returncode,
                               err.decode(errors="replace")[-2000:])

    def wait(self, timeout: float | None = None) -> str | None:
        """Wait up to ``timeout`` seconds for the child; its :attr:`state`."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.state

    def stop(self) -> None:
        """Stop the child if it still runs (what it compiled stays cached)."""
        with self._lock:
            self._stopped = True
            child = self._child
        if child is not None and child.poll() is None:
            child.terminate()  # NOTE: the child removes its private tables, then exits
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        if self._thread is not None:
            self._thread.join()
        if child is not None:
            _remove_private_tables(child.pid)
        if self.state == "warming":
            self.state = "stopped"


def _private_name(pid: int) -> str:
    """The name of a private table of the child ``pid`` (a unique suffix follows)."""
    return f"nvecache-warm-{pid}-"


def _remove_private_tables(pid: int) -> None:
    """Remove tables the child ``pid`` left (it was killed while it held one)."""
    from hostcache import segment

    for name in list(segment.list_names()):
        if name.startswith(_private_name(pid)):
            with contextlib.suppress(HostCacheError):
                segment.unlink(name)


# -- the child ------------------------------------------------------------------------------


def warm_loops() -> None:
    """Compile every per-key loop into numba's cache (or load it from there)."""
    import importlib

    for name in LOOP_MODULES:
        importlib.import_module(name).warm_up()


def read_dtypes(dtype: str) -> list[Any]:
    """The torch dtypes the layers read a table of stored format ``dtype`` in on the GPU:
    a quantized one in every dtype a layer computes in, a plain one in its own (none for
    float64, which the kernels do not read)."""
    from nvecache.common import rows as row_formats

    if dtype in row_formats.QUANTIZED:
        return [row_formats.torch_dtype(o) for o in row_formats.LAYER_DTYPES]
    return [row_formats.torch_dtype(dtype)] if dtype in row_formats.LAYER_DTYPES else []


def warm_kernels(dim: int, dtype: str, kind: str, device: Any, tuning: Any = None, *,
                 rows: int = 8192, small: int = 64, large: int = 5000) -> None:
    """Run, on ``device``, the lookups of every layer type that can read a table of
    ``dim`` x ``dtype`` (``kind`` ``hostcache``: Hierarchical; ``linear``: LinearUVM,
    HostLayer and GPULayer), in each output dtype it can be read in, so their kernels
    compile. ``tuning``: the replicas' ``gpu.TierConfig`` (its tiles choose kernel
    variants; default the layers' default). ``rows``: the private tables' rows; ``small``
    and ``large``: the two batches' keys (the default ``large`` is over
    ``TierConfig.host_gpu_read_keys``: the GPU reads the host cache itself)."""
    import torch

    from gpu import LayerType, NVEmbedding, NVEmbeddingBag
    from hostcache import HostCache, SharedMemBlock
    from nvecache.common import rows as row_formats

    stored = row_formats.torch_dtype(dtype)
    quantized = dtype in row_formats.QUANTIZED
    outputs = read_dtypes(dtype)
    if not outputs:
        return  # NOTE: no layer reads it on the GPU (float64): no kernel to compile
    n = rows
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(n, dim, generator=gen)
    if not quantized:
        values = values.to(stored)
    name = _private_name(os.getpid()) + uuid.uuid4().hex[:8]
    # NOTE: a batch under TierConfig.host_gpu_read_keys (misses read on the CPU), one
    # over it (the GPU reads the host cache), then both again (GPU-cache hits)
    first = torch.arange(small, device=device)
    second = torch.arange(small, small + large, device=device)
    batches = [first, second, first, second]
    if kind == "hostcache":
        table = HostCache.create(name, capacity=2 * n, dim=dim, dtype=stored)
        try:
            table.insert(torch.arange(n), values)
            for out in outputs:
                for cls in (NVEmbedding, NVEmbeddingBag):
                    # NOTE: a GPU cache of a quarter of the rows (float32): the large
                    # batch's admissions evict, as a replica's do
                    layer = cls(n, dim, out, LayerType.Hierarchical, host_cache=table,
                                gpu_cache_size=n * dim, device=device,
                                default_row=0.0, tuning=tuning)
                    _lookups(layer, batches)
        finally:
            table.close()
            HostCache.unlink(name)
        return
    block = SharedMemBlock.create(name, num_rows=n, dim=dim, dtype=stored)
    try:
        block.write(torch.arange(n), values)
        for out in outputs:
            for layer_type in (LayerType.LinearUVM, LayerType.HostLayer, LayerType.GPULayer):
                for cls in (NVEmbedding, NVEmbeddingBag):
                    kwargs: dict[str, Any] = (
                        {"weight_dtype": stored if quantized else None,
                         "weight_init": values.to(out)}
                        if layer_type is LayerType.GPULayer else {"storage": block})
                    if layer_type is LayerType.LinearUVM:
                        kwargs["gpu_cache_size"] = n * dim
                    layer = cls(n, dim, out, layer_type, device=device, tuning=tuning,
                                **kwargs)
                    _lookups(layer, batches)
    finally:
        block.close()
        SharedMemBlock.unlink(name)


def _lookups(layer: Any, batches: list[Any]) -> None:
    """Each batch looked up (a bag layer: in 8 bags), then the layer closed."""
    import torch

    from gpu import NVEmbeddingBag

    try:
        for keys in batches:
            if isinstance(layer, NVEmbeddingBag):
                n = keys.numel()
                layer(keys, torch.arange(0, n, n // 8, device=keys.device)[:8])
            else:
                layer(keys)
    finally:
        layer.close()


def main(argv: list[str]) -> int:
    # NOTE: the service stops this child with SIGTERM: exit through the finally blocks,
    # which remove the private tables
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    with contextlib.suppress(OSError):
        os.nice(10)  # NOTE: below the replicas and the service
    warm_loops()
    import torch

    if not torch.cuda.is_available():
        return 0
    for spec in argv:
        dim, dtype, kind = spec.split(":")
        for d in range(torch.cuda.device_count()):
            warm_kernels(int(dim), dtype, kind, torch.device("cuda", d))
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
