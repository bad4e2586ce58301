"""Names the seed's snippet uses (``pynve.nve``), so it runs with only its imports changed.

``DataType_t`` maps the seed's element types to torch dtypes. ``MPIMemBlock`` is a
:class:`gpu.DistMemBlock` over an MPI communicator: each rank puts one shard in the memory
of its GPU (``rank % device_count``, the seed's convention) and maps everyone's into one
range; without CUDA the CPU twin does the same with host-memory shards.

``MPI`` is mpi4py's when the process was launched by an MPI launcher; under torchrun it is
a ``COMM_WORLD`` over ``torch.distributed`` (gloo), so the seed's snippet runs unchanged
with either launcher; alone, it is a one-process ``COMM_WORLD``.
"""

from __future__ import annotations

import enum
import os
from typing import Any

import torch

from gpu.dist.distmem import DistMemBlock
from gpu.dist.groups import TorchGroup
from gpu.errors import BadArgumentError


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


def MPIMemBlock(  # noqa: N802 - the seed's name
    embedding_dim: int, num_rows: int, dtype: object = DataType_t.Float32, *, comm: Any = None,
    name: str | None = None,
) -> DistMemBlock:
    """``MPIMemBlock(embedding_dim, num_rows, dtype)``: the seed's sharded linear table.

    Collective over ``comm`` (default ``MPI.COMM_WORLD``): one shard per rank on GPU
    ``rank % torch.cuda.device_count()`` (the CPU without CUDA). Destroy it on every rank,
    after the layers that use it (``comm.Barrier(); del layer; del memblock``)."""
    comm = comm if comm is not None else MPI.COMM_WORLD
    if torch.cuda.is_available():
        device: object = torch.device("cuda", comm.Get_rank() % torch.cuda.device_count())
    else:
        device = "cpu"
    return DistMemBlock(num_rows, embedding_dim, _torch_dtype(dtype), devices=device,
                        group=comm, name=name)


class _OneProcessComm:
    """mpi4py's COMM_WORLD for a single process."""

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's names
        return 0

    def Get_size(self) -> int:  # noqa: N802
        return 1

    def Barrier(self) -> None:  # noqa: N802
        return None

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return obj

    def allgather(self, obj: Any) -> list[Any]:
        return [obj]


class _TorchComm:
    """mpi4py's COMM_WORLD over torch.distributed (for processes launched by torchrun)."""

    def __init__(self) -> None:
        self._group: TorchGroup | None = None

    def _g(self) -> TorchGroup:
        if self._group is None:
            self._group = TorchGroup(None)  # initialises the default group from the env
        return self._group

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's names
        return self._g().rank

    def Get_size(self) -> int:  # noqa: N802
        return self._g().size

    def Barrier(self) -> None:  # noqa: N802
        self._g().barrier()

    def bcast(self, obj: Any, root: int = 0) -> Any:
        if root != 0:
            raise BadArgumentError("this COMM_WORLD broadcasts from rank 0 only")
        return self._g().bcast(obj)

    def allgather(self, obj: Any) -> list[Any]:
        return self._g().allgather(obj)


class _StandInMPI:
    def __init__(self, comm: Any) -> None:
        self.COMM_WORLD = comm


#: variables an MPI launcher sets for each rank it starts (Open MPI, MPICH/Hydra, PMIx)
_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


def _launched_by_mpi() -> bool:
    return any(k in os.environ for k in _MPI_RANK_VARS)


def _pick_mpi() -> Any:
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ
    if torchrun and not _launched_by_mpi():
        return _StandInMPI(_TorchComm())
    try:  # pragma: no cover - depends on the machine
        # NOTE: lazy: mpi4py is optional, and importing it initialises MPI (only when no
        # torchrun stand-in was picked above)
        import mpi4py.MPI

        return mpi4py.MPI
    except ImportError:
        return _StandInMPI(_OneProcessComm())


MPI = _pick_mpi()
