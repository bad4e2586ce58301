"""DistMemBlock.accumulate on the CPU twin (and on a GPU where there is one): rows against
torch for every dtype (duplicates summed, float16/bfloat16 added in float32 and rounded
once), announced in the journal (a LinearUVM layer over the block serves the new rows),
refused arguments writing nothing, and two ranks adding to the same rows losing no
addition."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from gpu import BadArgumentError, DistMemBlock, LayerType, NonFiniteValuesError, NVEmbedding
from tests.conftest import fresh_name
from tests.servers import free_port

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])]
DIM = 4


def reference(rows: torch.Tensor, idx: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """Row by row: duplicates summed in batch order in float32, added in it, rounded once."""
    sums: dict[int, torch.Tensor] = {}
    for i, d in zip(idx.tolist(), deltas.cpu(), strict=True):
        sums[i] = sums.get(i, torch.zeros(DIM)) + d.float()
    out = rows.clone()
    for i, s in sums.items():
        out[i] = (rows[i].float() + s).to(rows.dtype)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fp32_deltas", [False, True])
def test_accumulate_matches_torch(device: str, dtype: torch.dtype, fp32_deltas: bool,
                                  table_name: str) -> None:
    gen = torch.Generator().manual_seed(1)
    with DistMemBlock(300, DIM, dtype, devices=device, name=table_name) as block:
        rows = (torch.randn(300, DIM, generator=gen) * 30).to(dtype)
        block.write(torch.arange(300), rows.to(device))
        idx = torch.tensor([7, 299, 7, 0, 7, 150, 150])
        deltas = torch.randn(idx.numel(), DIM, generator=gen)
        deltas = deltas if fp32_deltas else deltas.to(dtype)
        cursor = block.change_cursor
        block.accumulate(idx.to(device), deltas.to(device))
        assert torch.equal(block.read(torch.arange(300)).cpu(), reference(rows, idx, deltas))
        changed, _, overflowed = block.changes_since(cursor)
        assert not overflowed and sorted(changed.tolist()) == [0, 7, 150, 299]


def test_float16_rounds_once_not_per_duplicate(table_name: str) -> None:
    with DistMemBlock(4, DIM, torch.float16, devices="cpu", name=table_name) as block:
        block.write(torch.tensor([2]), torch.full((1, DIM), 2048.0, dtype=torch.float16))
        block.accumulate(torch.tensor([2, 2, 2, 2]), torch.full((4, DIM), 0.5))
        assert bool((block.read(torch.tensor([2])) == 2050.0).all())


def test_refused_arguments_write_nothing(table_name: str) -> None:
    with DistMemBlock(10, DIM, devices="cpu", name=table_name) as block:
        block.write(torch.arange(10), torch.ones(10, DIM))
        cursor = block.change_cursor
        for idx, deltas, match in [
                (torch.tensor([10]), torch.zeros(1, DIM), r"\[0, 10\)"),
                (torch.tensor([1.0]), torch.zeros(1, DIM), "int64"),
                (torch.tensor([1]), torch.zeros(1, DIM + 1), "deltas"),
                (torch.tensor([1, 2]), torch.zeros(1, DIM), "deltas"),
                (torch.tensor([1]), torch.zeros(1, DIM, dtype=torch.float64), "deltas")]:
            with pytest.raises(BadArgumentError, match=match):
                block.accumulate(idx, deltas)
        nan = torch.zeros(2, DIM)
        nan[1, 3] = float("nan")
        with pytest.raises(NonFiniteValuesError, match="index 6"):
            block.accumulate(torch.tensor([5, 6]), nan)
        assert torch.equal(block.read(torch.arange(10)), torch.ones(10, DIM))
        assert block.changes_since(cursor)[0].numel() == 0
        block.accumulate(torch.tensor([5, 6]), nan, allow_nonfinite=True)
        assert bool(block.read(torch.tensor([6]))[0, 3].isnan())


def test_a_layer_over_the_block_serves_the_new_rows(table_name: str) -> None:
    rows = 256
    block = DistMemBlock(rows, DIM, devices="cpu", name=table_name)
    try:
        block.write(torch.arange(rows), torch.zeros(rows, DIM))
        layer = NVEmbedding(rows, DIM, torch.float32, LayerType.LinearUVM,
                            gpu_cache_size=64 * DIM * 4, storage=block, device="cpu")
        try:
            keys = torch.tensor([3, 9, 3, 200])
            assert not layer(keys).any()
            assert not layer(keys).any()  # now from the layer's cache
            block.accumulate(torch.tensor([9, 200, 9]), torch.ones(3, DIM))
            got = layer(keys)
            assert got[:, 0].tolist() == [0.0, 2.0, 0.0, 1.0]
        finally:
            layer.close()
    finally:
        block.close()


def rank_adds(rank: int, world: int, port: int, name: str, rounds: int) -> None:
    """Every rank adds 1 to every row (row 5 twice per call), ``rounds`` times: each call's
    read-add-write spans the table, so the ranks' calls overlap."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        rows, dim = 8192, 32
        block = DistMemBlock(rows, dim, devices="cpu", group="torch", name=name)
        idx = torch.cat([torch.tensor([5]), torch.arange(rows)])
        ones = torch.ones(idx.numel(), dim)
        dist.barrier()
        for _ in range(rounds):
            block.accumulate(idx, ones)
        dist.barrier()
        want = torch.full((rows, dim), float(world * rounds))
        want[5] *= 2
        got = block.read(torch.arange(rows))
        assert torch.equal(got, want), f"rank {rank}: {got[:, 0].unique().tolist()}"
        dist.barrier()
        block.close()
    finally:
        dist.destroy_process_group()


def test_ranks_adding_to_the_same_rows_lose_no_addition() -> None:
    tmp.spawn(rank_adds, args=(2, free_port(), fresh_name(), 100), nprocs=2, join=True)
