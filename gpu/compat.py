"""Names the seed's snippet uses (``pynve.nve``), so it runs with only its imports changed.

``DataType_t`` maps the seed's element types to torch dtypes. ``MPIMemBlock`` here is the
node-local stand-in: every process of the node shares one ``SharedMemBlock`` (the table in
host memory, read zero-copy by each GPU), which is what one GPU (or one node) needs; the
table sharded over several GPUs' memory is the multi-GPU issue's ``DistMemBlock``.
``MPI`` is mpi4py's when it is installed, else a one-process ``COMM_WORLD``.
"""

from __future__ import annotations

import enum
import os
import uuid
from typing import Any

import torch

from hostcache import SharedMemBlock

from .errors import BadArgumentError


class DataType_t(enum.Enum):  # noqa: N801 - the seed's name
    """The seed's element types."""

    Float32 = torch.float32
    Float16 = torch.float16
    BFloat16 = torch.bfloat16


def _torch_dtype(dtype: object) -> torch.dtype:
    if isinstance(dtype, DataType_t):
        return dtype.value
    if isinstance(dtype, torch.dtype):
        return dtype
    raise BadArgumentError(f"dtype must be a DataType_t or torch.dtype; got {dtype!r}")


class NodeMemBlock(SharedMemBlock):
    """A SharedMemBlock that the rank which created it removes when it closes it."""

    _owner = False

    def close(self) -> None:
        owner, name = self._owner, self.name
        self._owner = False
        super().close()
        if owner:
            try:
                SharedMemBlock.unlink(name)
            except Exception:  # noqa: BLE001 - already removed by someone else
                pass


def MPIMemBlock(  # noqa: N802 - the seed's name
    embedding_dim: int, num_rows: int, dtype: object = DataType_t.Float32, *, comm: Any = None
) -> NodeMemBlock:
    """``MPIMemBlock(embedding_dim, num_rows, dtype)``: one linear table for every rank of
    the node, in shared memory. Rank 0 creates it (and removes it when it closes it); the
    other ranks attach it by the name rank 0 broadcasts (``NVEC_MEMBLOCK_NAME`` names it)."""
    comm = comm if comm is not None else MPI.COMM_WORLD
    rank = comm.Get_rank()
    name = os.environ.get("NVEC_MEMBLOCK_NAME") or f"memblock-{uuid.uuid4().hex[:12]}"
    if comm.Get_size() > 1:
        name = comm.bcast(name, root=0)
    torch_dtype = _torch_dtype(dtype)
    if rank == 0:
        block = NodeMemBlock.create(name, num_rows=num_rows, dim=embedding_dim, dtype=torch_dtype)
        block._owner = True
    comm.Barrier()
    if rank != 0:
        block = NodeMemBlock.attach(name, num_rows=num_rows, dim=embedding_dim, dtype=torch_dtype)
    return block


class _OneProcessComm:
    """mpi4py's COMM_WORLD for a single process (when mpi4py is not installed)."""

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's names
        return 0

    def Get_size(self) -> int:  # noqa: N802
        return 1

    def Barrier(self) -> None:  # noqa: N802
        return None

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return obj


class _OneProcessMPI:
    COMM_WORLD = _OneProcessComm()


try:  # pragma: no cover - depends on the machine
    from mpi4py import MPI
except ImportError:
    MPI = _OneProcessMPI()
