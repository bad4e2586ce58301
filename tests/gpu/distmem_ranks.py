"""Rank bodies of the DistMemBlock group tests (spawn-importable; one process per rank).

Each rank joins a gloo process group, builds the block collectively and checks what it
sees; an assertion in any rank fails the test (torch.multiprocessing.spawn re-raises it).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812


def device_of(kind: str, rank: int) -> torch.device:
    """``cpu``; ``cuda`` (every rank on GPU rank % count); ``cuda-each`` (rank r on GPU r)."""
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", rank % torch.cuda.device_count())


def expected_rows(num_rows: int, dim: int) -> torch.Tensor:
    """The rows every test writes: row i = i * 1000 + column."""
    return (torch.arange(num_rows, dtype=torch.float32)[:, None] * 1000
            + torch.arange(dim, dtype=torch.float32)[None, :])


@contextlib.contextmanager
def joined(rank: int, world: int, port: int, kind: str) -> Iterator[torch.device]:
    """This rank in a gloo group of ``world`` (left at the end), on its device."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast (the device tool asks)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    dev = device_of(kind, rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    try:
        yield dev
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def entry(rank: int, world: int, port: int, scenario: str, kind: str, name: str) -> None:
    with joined(rank, world, port, kind) as dev:
        globals()[f"scenario_{scenario}"](rank, world, dev, name)


def scenario_rows(rank: int, world: int, dev: torch.device, name: str) -> None:
    """Shards from every rank in one range; a LinearUVM layer over it; read-after-write."""
    from gpu import DestructionOrderError, DistMemBlock, LayerType, NVEmbedding
    from hostcache import segment

    rows, dim = 3001, 24  # rows straddle shard boundaries
    block = DistMemBlock(rows, dim, torch.float32, devices=dev, group="torch", name=name)
    assert block.num_shards == world and block.shard_ranks == list(range(world))
    assert block.size >= rows * dim * 4 and block.size % block.granularity == 0
    want = expected_rows(rows, dim)
    mine = torch.arange(rank, rows, world)  # each rank writes its stripe, through the view
    view = block.view(dev)
    view[mine.to(dev)] = want[mine].to(dev)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    dist.barrier()
    assert torch.equal(view.cpu(), want), "a rank sees other ranks' rows wrong"
    same = torch.Generator().manual_seed(7)  # the same keys in every rank
    keys = torch.randint(0, rows, (4000,), generator=same)
    keys[:50] = keys[50:100]  # duplicates
    layer = NVEmbedding(rows, dim, torch.float32, LayerType.LinearUVM,
                        gpu_cache_size=256 * dim * 4, storage=block, device=dev)
    for _ in range(3):  # misses, then GPU-cache hits
        assert torch.equal(layer(keys.to(dev)).cpu(), F.embedding(keys, want))
    assert layer.stats().gpu.hits > 0
    dist.barrier()
    hot = keys[:64].unique()
    new = torch.full((hot.numel(), dim), -7.0)
    if rank == world - 1:
        layer.update(hot.to(dev), new.to(dev))  # announced in the block's journal
    dist.barrier()
    got = layer(hot.to(dev)).cpu()  # every rank's very next lookup
    assert torch.equal(got, new), f"rank {rank} served a stale row after an update"
    dist.barrier()
    try:
        block.close()
    except DestructionOrderError as e:
        assert "layer" in str(e)
    else:
        raise AssertionError("closing a block under a live layer must raise")
    assert torch.equal(layer(hot.to(dev)).cpu(), new), "the failed close changed something"
    del layer, view
    block.close()
    assert block.closed
    dist.barrier()
    assert name not in segment.list_names(), "the journal segment outlived the block"


def scenario_order(rank: int, world: int, dev: torch.device, name: str) -> None:
    """Blocks close in the reverse order of creation, and before the group goes."""
    from gpu import DestructionOrderError, DistMemBlock

    a = DistMemBlock(100, 8, devices=dev, group="torch", name=name + "a")
    b = DistMemBlock(100, 8, devices=dev, group="torch", name=name + "b")
    try:
        a.close()
    except DestructionOrderError as e:
        assert name + "b" in str(e)
    else:
        raise AssertionError("closing the first block before the second must raise")
    assert not a.closed and a.read(torch.tensor([1])).shape == (1, 8)
    b.close()
    a.close()
    c = DistMemBlock(100, 8, devices=dev, group="torch", name=name + "c")
    dist.barrier()
    dist.destroy_process_group()
    try:
        c.close()
    except DestructionOrderError as e:
        assert "process group" in str(e)
    else:
        raise AssertionError("closing a block after its group is gone must raise")
    c.release_local()
    assert c.closed


def scenario_mismatch(rank: int, world: int, dev: torch.device, name: str) -> None:
    """Ranks that disagree on the geometry all get a typed error, and nothing is left."""
    from gpu import BadArgumentError, DistMemBlock

    try:
        DistMemBlock(100, 8 + rank, devices=dev, group="torch", name=name)
    except BadArgumentError as e:
        assert "disagree" in str(e)
    else:
        raise AssertionError("a geometry mismatch between ranks must raise")


def scenario_mpi(rank: int, world: int, dev: torch.device, name: str) -> Any:
    """gpu.compat.MPIMemBlock over an mpi4py-like communicator (here over torch)."""
    from gpu.compat import MPIMemBlock, _TorchComm

    comm = _TorchComm()
    block = MPIMemBlock(16, 1000, comm=comm, name=name)
    # the seed's rule: rank r on GPU r % count (the CPU twin without CUDA)
    want = device_of("cuda" if torch.cuda.is_available() else "cpu", rank)
    assert block.world_size == world and block.devices == [want]
    if rank == 0:
        block.write(torch.arange(1000), expected_rows(1000, 16))
    comm.Barrier()
    assert torch.equal(block.read(torch.arange(1000)).cpu(), expected_rows(1000, 16))
    comm.Barrier()
    block.close()


def scenario_quantized(rank: int, world: int, dev: torch.device, name: str) -> None:
    """An int8 block over every rank's shard: each rank writes its stripe of rows and reads
    everyone's dequantized; then every rank accumulates into the same rows at once and no
    addition is lost (rows every step of which int8 stores exactly: constant rows)."""
    from gpu import DistMemBlock
    from nvecache.common import quant

    rows, dim, rounds = 513, 20, 30
    block = DistMemBlock(rows, dim, torch.int8, devices=dev, group="torch", name=name)
    assert block.quantized and block.row_format.dtype == "int8"
    fmt = block.row_format
    want = expected_rows(rows, dim) / 1000
    mine = torch.arange(rank, rows, world)
    block.write(mine.to(dev), want[mine].to(dev))
    dist.barrier()
    assert torch.equal(block.read(torch.arange(rows)).cpu(),
                       quant.decode(quant.encode(want, fmt), fmt))
    assert torch.equal(block.view(dev)[:, :fmt.stored_bytes].cpu(), quant.encode(want, fmt))
    dist.barrier()
    hot = torch.arange(0, rows, 7)
    if rank == 0:
        block.write(hot.to(dev), torch.full((hot.numel(), dim), 2.0, device=dev))
    dist.barrier()
    idx = torch.cat([hot[:1], hot]).to(dev)  # the first row twice a call
    for _ in range(rounds):
        block.accumulate(idx, torch.ones(idx.numel(), dim, device=dev))
    dist.barrier()
    got = block.read(hot).cpu()
    added = torch.full((hot.numel(), 1), float(world * rounds))
    added[0] *= 2
    assert torch.equal(got, (2.0 + added).expand(-1, dim)), got[:, 0].tolist()
    dist.barrier()
    block.close()


def scenario_mismatch_dtype(rank: int, world: int, dev: torch.device, name: str) -> None:
    """A rank joining with another dtype (a quantized format against float32, or the other
    format) gets a typed error on every rank, and nothing is left."""
    from gpu import BadArgumentError, DistMemBlock

    for mine in ([torch.int8, torch.float32], [torch.int8, torch.float8_e4m3fn]):
        try:
            DistMemBlock(100, 8, mine[rank % 2], devices=dev, group="torch", name=name)
        except BadArgumentError as e:
            assert "disagree" in str(e)
        else:
            raise AssertionError("ranks joining with another dtype must raise")
        dist.barrier()
