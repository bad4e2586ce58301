"""The tables a benchmark's layers read, filled with one table's rows: a SharedMemBlock
(LinearUVM's storage), a ``file://`` parameter-server table and a host cache of a fifth of
the rows (Hierarchical's); every one removed on exit."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator

import torch

import psclient
from hostcache import HostCache, SharedMemBlock


@contextlib.contextmanager
def shared_tables(prefix: str, weights: torch.Tensor) -> Iterator[tuple[SharedMemBlock, object,
                                                                         HostCache]]:
    """``(block, ps, host_cache)`` over ``weights`` (fp32 ``[rows, dim]``), named from
    ``prefix`` (unique per process)."""
    rows, dim = weights.shape
    tmp = tempfile.mkdtemp(prefix="nvec-bench-")
    mb = SharedMemBlock.create(prefix + "-lin", num_rows=rows, dim=dim)
    try:
        ps = psclient.connect(f"file://{tmp}/ps", table=prefix, dim=dim, dtype=torch.float32)
        try:
            hc = HostCache.create(prefix, capacity=rows // 5, dim=dim)
            try:
                mb.write(torch.arange(rows), weights)
                ps.load(weights, progress=False)
                yield mb, ps, hc
            finally:
                hc.close()
                HostCache.unlink(prefix)
        finally:
            ps.drop()
            ps.close()
    finally:
        mb.close()
        SharedMemBlock.unlink(prefix + "-lin")
        shutil.rmtree(tmp, ignore_errors=True)
