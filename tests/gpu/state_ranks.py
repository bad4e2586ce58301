"""Rank bodies of the multi-rank checkpoint tests (spawn-importable; one process per rank).

Each rank joins a gloo process group, builds a ``DistMemBlock`` over it collectively and a
layer over the block, and checks what its ``state_dict``, ``load_state_dict`` and
``torch.distributed.checkpoint`` do with its share; an assertion in any rank fails the
test (torch.multiprocessing.spawn re-raises it). The test process reads the checkpoint's
metadata afterwards.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tests.gpu.distmem_ranks import joined

DIM = 8


def want_rows(num_rows: int, seed: int) -> torch.Tensor:
    """The same rows in every rank."""
    return torch.randn(num_rows, DIM, generator=torch.Generator().manual_seed(seed))


class Model(torch.nn.Module):
    """A dense layer (of ``seed``, the same in every rank) and an embedding layer named ``emb``."""

    def __init__(self, emb: torch.nn.Module, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.dense = torch.nn.Linear(DIM, 2)
        self.emb = emb


def entry(rank: int, world: int, port: int, kind: str, name: str, num_rows: int,
          ckpt: str, layer_type: str) -> None:
    with joined(rank, world, port, kind) as dev:
        round_trip(rank, world, dev, name, num_rows, ckpt, layer_type)


class Spy:
    """Records the rows a stack writes (``write_rows``) and announces (``rows_changed``)."""

    def __init__(self, stack: Any) -> None:
        self.written: list[int] = []
        self.announced: list[int] = []
        write, changed = stack.write_rows, stack.rows_changed

        def write_rows(start: int, values: torch.Tensor) -> None:
            self.written += range(start, start + values.shape[0])
            write(start, values)

        def rows_changed(start: int, stop: int) -> None:
            self.announced += range(start, stop)
            changed(start, stop)

        stack.write_rows, stack.rows_changed = write_rows, rows_changed

    def take(self) -> tuple[list[int], list[int]]:
        out = (self.written, self.announced)
        self.written, self.announced = [], []
        return out


def every_rank(mine: list[int]) -> list[list[int]]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def lookup_all(layer: Any, num_rows: int, dev: torch.device) -> torch.Tensor:
    return layer(torch.arange(num_rows, device=dev)).cpu()


def round_trip(rank: int, world: int, dev: torch.device, name: str, num_rows: int,
               ckpt: str, layer_type: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Shard

    from gpu import DistMemBlock, LayerType, NVEmbedding, state
    from gpu.errors import GroupError

    lt = LayerType[layer_type]
    cache = 0 if lt is LayerType.GPULayer else num_rows * (12 + 4 * DIM)

    def build(block_name: str, seed: int) -> tuple[Any, Model, Spy]:
        block = DistMemBlock(num_rows, DIM, devices=dev, group="torch", name=block_name)
        layer = NVEmbedding(num_rows, DIM, torch.float32, lt, gpu_cache_size=cache,
                            storage=block, device=dev)
        return block, Model(layer, seed), Spy(layer._tiers)

    block, model, spy = build(name, seed=0)
    want = want_rows(num_rows, seed=1)
    start, stop = state.share(num_rows, world, rank)
    shares = every_rank([start, stop])
    assert shares[0][0] == 0 and shares[-1][1] == num_rows
    assert all(a[1] == b[0] for a, b in zip(shares, shares[1:], strict=False))

    # a plain full tensor on every rank: each rank writes its share, all rows once
    model.load_state_dict({**model.state_dict(), "emb.weight": want}, strict=True)
    written, announced = spy.take()
    assert written == list(range(start, stop)) and not announced, (rank, written)
    dist.barrier()
    assert torch.equal(block.view(dev).cpu(), want)
    assert torch.equal(lookup_all(model.emb, num_rows, dev), want)

    # the state_dict: a DTensor, Shard(0), the local part a view of this rank's rows
    sd = model.state_dict()
    weight = sd["emb.weight"]
    assert isinstance(weight, DTensor) and tuple(weight.placements) == (Shard(0),)
    assert tuple(weight.shape) == (num_rows, DIM)
    local = weight.to_local()
    assert local.shape == (stop - start, DIM)
    assert local.data_ptr() == block.view(dev)[start:stop].data_ptr()
    assert not isinstance(sd["dense.weight"], DTensor)
    dcp.save(sd, checkpoint_id=ckpt)

    # the rows change after the save, and every rank's layer reads (caches) the new ones
    if rank == 0:
        model.emb.update(torch.arange(num_rows, device=dev),
                         torch.zeros(num_rows, DIM, device=dev))
    dist.barrier()
    zeros = torch.zeros(num_rows, DIM)
    assert torch.equal(lookup_all(model.emb, num_rows, dev), zeros)
    spy.take()

    # dcp.load fills each rank's share in place; load_state_dict announces it only
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=ckpt)
    model.load_state_dict(sd)
    written, announced = spy.take()
    assert not written and announced == list(range(start, stop)), (rank, announced)
    dist.barrier()
    assert torch.equal(block.view(dev).cpu(), want)
    # every cache dropped the zero rows: each rank's announcement reached every rank
    assert torch.equal(lookup_all(model.emb, num_rows, dev), want)

    # a DTensor that is not the layer's own view is refused on every rank with rows (a rank
    # whose share is empty has no row to write or tell apart), nothing written
    other = sd["emb.weight"]
    foreign = DTensor.from_local(torch.zeros(stop - start, DIM, device=dev),
                                 other.device_mesh, [Shard(0)], run_check=False,
                                 shape=other.shape, stride=other.stride())
    try:
        model.emb.load_state_dict({"weight": foreign})
    except state.StateDictError as e:
        assert "DTensor" in str(e) and "nothing was written" in str(e), str(e)
    else:
        assert stop == start, "a foreign DTensor must be refused"
    assert spy.take() == ([], [])
    dist.barrier()
    assert torch.equal(block.view(dev).cpu(), want)

    # a fresh block and layer (rows of zeros): dcp.load restores every row
    fresh_block, fresh, fresh_spy = build(name + "f", seed=2)
    if rank == 0:  # NOTE: GPU memory of a new block holds whatever it held
        fresh.emb.update(torch.arange(num_rows, device=dev),
                         torch.zeros(num_rows, DIM, device=dev))
    dist.barrier()
    fresh_spy.take()
    assert torch.equal(lookup_all(fresh.emb, num_rows, dev), zeros)
    assert not torch.equal(fresh.dense.weight, model.dense.weight)
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=ckpt)
    fresh.load_state_dict(sd, strict=True)
    written, announced = fresh_spy.take()
    assert not written and announced == list(range(start, stop))
    dist.barrier()
    assert torch.equal(fresh_block.view(dev).cpu(), want)
    assert torch.equal(lookup_all(fresh.emb, num_rows, dev), want)
    assert torch.equal(fresh.dense.weight, model.dense.weight)

    for m, b in ((fresh, fresh_block), (model, block)):  # layers, then blocks (reversed)
        m.emb.close()
        b.close()

    # the group gone first: a typed error, not a DTensor over a dead group
    last, model, _ = build(name + "g", seed=0)
    dist.barrier()
    dist.destroy_process_group()
    try:
        model.state_dict()
    except GroupError as e:
        assert "state_dict" in str(e), str(e)
    else:
        raise AssertionError("a state_dict over a destroyed group must raise")
    model.emb.close()
    last.release_local()
