"""Checkpoints of a layer over a ``DistMemBlock`` of a torch process group (gpu.state):
its ``weight`` is a DTensor sharded by rows over the ranks, ``dcp.save`` writes each rank's
share once and ``dcp.load`` fills it in place; a plain tensor loaded on every rank is
written by each rank for its share. 2 and 3 gloo ranks, rows that do or do not divide by
the ranks, on the CPU twin and (when present) CUDA, every rank on one GPU."""

from __future__ import annotations

import tempfile
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as tmp

from gpu import state
from tests.conftest import fresh_name
from tests.gpu import state_ranks
from tests.servers import free_port

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
KINDS = [pytest.param("cpu"), pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])]
#: (ranks, rows, layer type): even; uneven; uneven with an empty last share
CASES = [(2, 40, "LinearUVM"), (3, 40, "GPULayer"), (3, 4, "LinearUVM")]


def run_ranks(world: int, kind: str, num_rows: int, ckpt: str, layer_type: str) -> None:
    tmp.spawn(state_ranks.entry, args=(world, free_port(), kind, fresh_name(), num_rows,
                                       ckpt, layer_type), nprocs=world, join=True)


def chunks(ckpt: str, key: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of every chunk the checkpoint's metadata records for ``key``."""
    md = dcp.FileSystemReader(ckpt).read_metadata()
    return sorted((tuple(c.offsets), tuple(c.sizes))
                  for c in md.state_dict_metadata[key].chunks)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("world", "num_rows", "layer_type"), CASES)
def test_each_rank_saves_and_loads_its_share(kind: str, world: int, num_rows: int,
                                             layer_type: str) -> None:
    with tempfile.TemporaryDirectory() as ckpt:
        run_ranks(world, kind, num_rows, ckpt, layer_type)
        # one chunk per rank, at its share's rows (an empty share: a chunk of no row):
        # every row saved exactly once
        dim = state_ranks.DIM
        want = [((start, 0), (stop - start, dim))
                for start, stop in (state.share(num_rows, world, r) for r in range(world))]
        assert chunks(ckpt, "emb.weight") == want
        assert sum(size[0] for _, size in want) == num_rows
        # a replicated tensor (the dense layer's) is saved once
        assert chunks(ckpt, "dense.weight") == [((0, 0), (2, dim))]
        # the rows, read back whole in this one process
        full = {"emb.weight": torch.zeros(num_rows, dim)}
        with warnings.catch_warnings():  # NOTE: "assuming ... a single process": it is
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.load(full, checkpoint_id=ckpt, no_dist=True)
        assert torch.equal(full["emb.weight"], state_ranks.want_rows(num_rows, seed=1))


@pytest.mark.parametrize(("num_rows", "world"), [(40, 1), (40, 2), (40, 3), (4, 3), (1, 2),
                                                 (7, 7), (10, 4)])
def test_shares_are_torch_chunks_split(num_rows: int, world: int) -> None:
    rows = torch.arange(num_rows)
    parts = list(torch.chunk(rows, world))
    parts += [rows[:0]] * (world - len(parts))  # torch.chunk may return fewer pieces
    for rank, part in enumerate(parts):
        start, stop = state.share(num_rows, world, rank)
        assert torch.equal(rows[start:stop], part)
