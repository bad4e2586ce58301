"""A process that builds a DistMemBlock, says so on stdout, and waits to be killed.

``python -m tests.gpu.distmem_holder MODE``; the test reads one line ``<name> <exists>``
(the journal's name, and whether ``/dev/shm/nvec.<name>`` exists at that moment), then
kills the process; it otherwise waits on stdin forever. Modes:

* ``solo``: a one-process block on the CPU twin, built and written;
* ``group``: one rank of a two-rank block (torch.distributed gloo from the environment
  torchrun sets: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT);
* ``window``: a one-process block over a communicator that stops inside the block's
  construction, after its journal was created and before its name was unlinked (where
  only a kill can leave the journal behind).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from gpu import DistMemBlock
from hostcache import segment


def report_and_wait(name: str) -> None:
    print(name, os.path.exists(segment.shm_path(name)), flush=True)
    sys.stdin.readline()  # until killed (or stdin closes)


class StopInJournal:
    """An mpi4py-like one-process communicator that reports and waits in the journal's
    broadcast (the block's collective after its journal segment was created)."""

    def __init__(self) -> None:
        self.name: str | None = None

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's names
        return 0

    def Get_size(self) -> int:  # noqa: N802
        return 1

    def Barrier(self) -> None:  # noqa: N802
        return None

    def allgather(self, obj: Any) -> list[Any]:
        return [obj]

    def bcast(self, obj: Any, root: int = 0) -> Any:
        if self.name is None and isinstance(obj, str):
            self.name = obj  # the first broadcast is the block's name
        elif obj is None and self.name is not None:
            report_and_wait(self.name)  # the journal's "created" broadcast
        return obj


def main(mode: str) -> None:
    torch.set_num_threads(1)
    if mode == "solo":
        block = DistMemBlock(100, 4, devices="cpu")
        block.write(torch.tensor([3]), torch.ones(1, 4))
        report_and_wait(block.name)
    elif mode == "group":
        block = DistMemBlock(100, 4, devices="cpu", group="torch")
        block.write(torch.tensor([int(os.environ["RANK"])]), torch.ones(1, 4))
        report_and_wait(block.name)
    elif mode == "window":
        DistMemBlock(100, 4, devices="cpu", group=StopInJournal())
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1])
