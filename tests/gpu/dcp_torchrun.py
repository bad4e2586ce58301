"""A torchrun script: a layer over a ``DistMemBlock`` of the launch's gloo group, saved or
loaded with ``torch.distributed.checkpoint``.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        tests/gpu/dcp_torchrun.py CKPT_DIR save|load --name NAME [--device cpu|cuda]

with the project root on ``PYTHONPATH``. Every rank reads its place from the environment
torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``)
and joins a gloo group through ``env://``.
``save`` writes known rows (each rank its share) and ``dcp.save``\\ s the model;
``load`` builds a fresh block of zeros, ``dcp.load``\\ s into the model's state_dict and
checks that every rank's lookups return the saved rows and the dense layer round-trips.
A mismatch on any rank makes every rank exit with status 1. The layer, then the block,
then the process group are released at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.gpu.distmem_ranks import device_of
from tests.gpu.state_ranks import DIM, Model, want_rows

SAVE_DENSE_SEED, LOAD_DENSE_SEED, ROWS_SEED = 0, 2, 1


def saved_dense() -> torch.Tensor:
    """The dense weight a ``save`` run holds (the same in every rank and every launch)."""
    return Model(torch.nn.Identity(), SAVE_DENSE_SEED).dense.weight.detach()


def build(args: argparse.Namespace, dev: torch.device, seed: int) -> tuple[Any, Model]:
    """A block over the default group and a model whose ``emb`` is a layer over it."""
    from gpu import DistMemBlock, LayerType, NVEmbedding

    lt = LayerType[args.layer_type]
    cache = 0 if lt is LayerType.GPULayer else args.rows * (12 + 4 * DIM)
    block = DistMemBlock(args.rows, DIM, devices=dev, group="torch", name=args.name)
    layer = NVEmbedding(args.rows, DIM, torch.float32, lt, gpu_cache_size=cache,
                        storage=block, device=dev)
    return block, Model(layer, seed)


def lookups(model: Model, num_rows: int, dev: torch.device) -> torch.Tensor:
    return model.emb(torch.arange(num_rows, device=dev)).cpu()


def save(args: argparse.Namespace, rank: int, world: int, dev: torch.device,
         model: Model) -> list[str]:
    from gpu import state

    want = want_rows(args.rows, ROWS_SEED)
    start, stop = state.share(args.rows, world, rank)
    if stop > start:
        model.emb.update(torch.arange(start, stop, device=dev), want[start:stop].to(dev))
    dist.barrier()
    errors = []
    if not torch.equal(lookups(model, args.rows, dev), want):
        errors.append("the rows written before the save read back wrong")
    dcp.save(model.state_dict(), checkpoint_id=args.ckpt)
    return errors


def load(args: argparse.Namespace, rank: int, world: int, dev: torch.device,
         model: Model) -> list[str]:
    zeros = torch.zeros(args.rows, DIM)
    if rank == 0:  # GPU memory of a new block holds whatever it held: zeros, on purpose
        model.emb.update(torch.arange(args.rows, device=dev), zeros.to(dev))
    dist.barrier()
    errors = []
    if not torch.equal(lookups(model, args.rows, dev), zeros):
        errors.append("the fresh block does not read as zeros before the load")
    if torch.equal(model.dense.weight.detach(), saved_dense()):
        errors.append("the fresh dense layer already equals the saved one")
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=args.ckpt)
    model.load_state_dict(sd, strict=True)
    dist.barrier()  # every rank's share filled and announced before any rank reads
    if not torch.equal(lookups(model, args.rows, dev), want_rows(args.rows, ROWS_SEED)):
        errors.append("lookups after dcp.load differ from the saved rows")
    if not torch.equal(model.dense.weight.detach().cpu(), saved_dense()):
        errors.append("the dense weight did not round-trip")
    return errors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ckpt", help="the checkpoint directory")
    p.add_argument("mode", choices=["save", "load"])
    p.add_argument("--name", required=True, help="the block's name (a fresh one per launch)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--rows", type=int, default=41)
    p.add_argument("--layer-type", default="LinearUVM", choices=["LinearUVM", "GPULayer"])
    args = p.parse_args(argv)

    from hostcache import segment

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    try:
        dev = device_of(args.device, local_rank)  # NOTE: cuda: GPU LOCAL_RANK % count
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        seed = SAVE_DENSE_SEED if args.mode == "save" else LOAD_DENSE_SEED
        block, model = build(args, dev, seed)
        try:
            errors = (save if args.mode == "save" else load)(args, rank, world, dev, model)
        except BaseException:  # no collective here: the other ranks may be anywhere
            model.emb.close()
            block.release_local()
            raise
        model.emb.close()  # layers, then the block, then the group
        block.close()
        if args.name in segment.list_names():
            errors.append(f"the block's segment {args.name!r} outlived it")
        everyone: list[object] = [None] * world
        dist.all_gather_object(everyone, errors)
    finally:
        dist.destroy_process_group()
    bad = {r: e for r, e in enumerate(everyone) if e}
    if bad:
        print(f"rank {rank}: {args.mode} failed: {bad}", file=sys.stderr)
        return 1
    print(f"rank {rank}/{world}: {args.mode} ok on {dev}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
