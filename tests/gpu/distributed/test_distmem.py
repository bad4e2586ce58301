"""DistMemBlock: shards mapped into one range, alone and across a process group.

The CPU twin runs the whole protocol (memfd shards, descriptors over a Unix socket, one
reserved range) here; the same tests run on CUDA (one GPU: every rank's shard on it) and
on several GPUs (marked ``multigpu``: rank r's shard on GPU r, read over NVLink).
"""

from __future__ import annotations

import gc
import pickle

import pytest
import torch
import torch.multiprocessing as tmp
import torch.nn.functional as F  # noqa: N812

from gpu import (
    BadArgumentError,
    DestructionOrderError,
    DistMemBlock,
    GPUError,
    LayerType,
    NVEmbedding,
    NVEmbeddingBag,
)
from hostcache import SharedMemBlock, segment
from tests.conftest import fresh_name
from tests.gpu import distmem_ranks
from tests.servers import free_port

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
MULTI = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two or more CUDA GPUs")

#: (device kind of the ranks, pytest marks)
KINDS = [
    pytest.param("cpu"),
    pytest.param("cuda", marks=[pytest.mark.gpu, CUDA]),
    pytest.param("cuda-each", marks=[pytest.mark.multigpu, MULTI]),
]


def run_ranks(scenario: str, kind: str, world: int = 2) -> None:
    if kind == "cuda-each":
        world = torch.cuda.device_count()
    tmp.spawn(distmem_ranks.entry, args=(world, free_port(), scenario, kind, fresh_name()),
              nprocs=world, join=True)


# -- one process --------------------------------------------------------------------------


def test_rows_land_at_base_plus_index_times_row_bytes_over_several_shards(table_name) -> None:
    rows, dim = 5000, 20
    with DistMemBlock(rows, dim, devices=["cpu"] * 3, name=table_name) as block:
        assert block.num_shards == 3 and block.base % block.granularity == 0
        assert block.shard_bytes * 3 == block.size >= rows * dim * 4
        want = distmem_ranks.expected_rows(rows, dim)
        block.write(torch.arange(rows), want)
        assert torch.equal(block.read(torch.tensor([0, 1234, rows - 1])), want[[0, 1234, -1]])
        # the view IS the range: element (i, j) at base + i * row_bytes + 4 j
        view = block.view()
        assert view.data_ptr() == block.base and view.stride() == (dim, 1)
        straddler = int(block.shard_bytes // block.row_bytes)  # spans shards 0 and 1
        assert int(block.shard_of(torch.tensor([straddler]))) == 0
        assert int(block.shard_of(torch.tensor([straddler + 1]))) == 1
        assert torch.equal(view[straddler], want[straddler])


def test_write_last_duplicate_wins_and_is_announced(table_name) -> None:
    with DistMemBlock(64, 4, devices="cpu", name=table_name) as block:
        cursor = block.change_cursor
        block.write(torch.tensor([5, 9, 5]), torch.tensor([[1.0] * 4, [2.0] * 4, [3.0] * 4]))
        assert torch.equal(block.read(torch.tensor([5, 9]))[:, 0], torch.tensor([3.0, 2.0]))
        keys, cursor2, overflowed = block.changes_since(cursor)
        assert sorted(keys.tolist()) == [5, 9] and cursor2 > cursor and not overflowed


@pytest.mark.parametrize("bad", [
    dict(num_rows=0), dict(num_rows=-3), dict(dim=0), dict(dtype=torch.int64),
    dict(devices=[]), dict(group="mpi"), dict(devices="tpu"), dict(name="bad/name"),
])
def test_bad_arguments_raise_typed_errors(bad, table_name) -> None:
    args = dict(num_rows=10, dim=4, dtype=torch.float32, devices="cpu", name=table_name)
    args.update(bad)
    with pytest.raises(GPUError):
        DistMemBlock(args.pop("num_rows"), args.pop("dim"), args.pop("dtype"), **args)
    assert table_name not in segment.list_names()  # no journal left behind


def shard_mappings() -> int:
    """Mappings of CPU-twin shards (memfds named nvec-distmem) in this process."""
    with open("/proc/self/maps") as f:
        return sum("nvec-distmem" in line for line in f)


def test_a_name_in_use_is_refused_and_nothing_stays_mapped(table_name) -> None:
    before = shard_mappings()
    with SharedMemBlock.create(table_name, num_rows=1, dim=1) as table:
        with pytest.raises(BadArgumentError, match="journal"):
            DistMemBlock(10, 4, devices="cpu", name=table_name)
        assert shard_mappings() == before  # the refused block unmapped its shards
        assert table_name in segment.list_names()  # and left the table of that name alone
        table.unlink(table_name)
    assert table_name not in segment.list_names()


def test_bad_rows_and_values_change_nothing(table_name) -> None:
    with DistMemBlock(10, 4, devices="cpu", name=table_name) as block:
        block.write(torch.arange(10), torch.ones(10, 4))
        for idx, vals in [(torch.tensor([10]), torch.zeros(1, 4)),
                          (torch.tensor([-1]), torch.zeros(1, 4)),
                          (torch.tensor([1.0]), torch.zeros(1, 4)),
                          (torch.tensor([1]), torch.zeros(1, 5)),
                          (torch.tensor([1]), torch.zeros(1, 4, dtype=torch.float16))]:
            with pytest.raises(BadArgumentError):
                block.write(idx, vals)
        assert torch.equal(block.read(torch.arange(10)), torch.ones(10, 4))
        with pytest.raises(BadArgumentError):
            pickle.dumps(block)


def test_view_outlives_close_and_closed_block_refuses(table_name) -> None:
    block = DistMemBlock(100, 4, devices="cpu", name=table_name)
    block.write(torch.arange(100), torch.full((100, 4), 2.5))
    view = block.view()
    block.close()
    block.close()  # idempotent
    assert float(view.sum()) == 1000.0  # still mapped: the view holds the range
    assert table_name not in segment.list_names()
    with pytest.raises(GPUError):
        block.read(torch.tensor([1]))
    mapped = shard_mappings()
    del view
    gc.collect()
    assert shard_mappings() < mapped  # the last view gone: unmapped


@pytest.mark.parametrize("layer_cls", [NVEmbedding, NVEmbeddingBag])
def test_layers_over_a_block_equal_torch_and_guard_the_close_order(layer_cls, table_name):
    rows, dim = 2000, 16
    block = DistMemBlock(rows, dim, devices=["cpu"] * 2, name=table_name)
    gen = torch.Generator().manual_seed(0)
    want = torch.randn(rows, dim, generator=gen)
    block.write(torch.arange(rows), want)
    keys = torch.randint(0, rows, (512,), generator=gen)
    for lt, cache in [(LayerType.LinearUVM, 64 * dim * 4), (LayerType.GPULayer, 0)]:
        layer = layer_cls(rows, dim, torch.float32, lt, gpu_cache_size=cache, storage=block,
                          device="cpu")
        with pytest.raises(DestructionOrderError):
            block.close()
        for _ in range(2):
            if layer_cls is NVEmbedding:
                assert torch.equal(layer(keys), F.embedding(keys, want))
            else:
                got = layer(keys.view(32, 16))
                # NOTE: fp32 sums; the Triton kernels add in another order than the twin
                torch.testing.assert_close(got, F.embedding_bag(keys.view(32, 16), want,
                                                                mode="sum"))
        layer.close()  # a closed layer no longer holds the block
    block.close()
    with pytest.raises(BadArgumentError):
        NVEmbedding(rows, dim + 1, torch.float32, LayerType.LinearUVM, storage=DistMemBlock(
            rows, dim, devices="cpu", name=table_name), device="cpu")


@pytest.mark.gpu
@CUDA
def test_cuda_block_on_every_visible_gpu_reads_like_the_cpu_twin(table_name) -> None:
    n = torch.cuda.device_count()
    rows, dim = 100_000, 32
    want = distmem_ranks.expected_rows(rows, dim)
    with DistMemBlock(rows, dim, devices=list(range(n)), name=table_name) as block:
        assert block.num_shards == n and block.granularity >= 4096
        block.write(torch.arange(rows), want)
        keys = torch.randint(0, rows, (10_000,))
        for d in range(n):  # every GPU reads every shard
            dev = torch.device("cuda", d)
            layer = NVEmbedding(rows, dim, torch.float32, LayerType.LinearUVM,
                                gpu_cache_size=1 << 20, storage=block, device=dev)
            for _ in range(2):
                assert torch.equal(layer(keys.to(dev)).cpu(), F.embedding(keys, want))
            layer.close()


# -- a process group ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_group_maps_every_ranks_shard_and_layers_see_each_others_writes(kind) -> None:
    run_ranks("rows", kind)


@pytest.mark.parametrize("kind", KINDS)
def test_group_close_order_is_enforced(kind) -> None:
    run_ranks("order", kind)


def test_group_geometry_mismatch_raises_on_every_rank() -> None:
    run_ranks("mismatch", "cpu")


@pytest.mark.parametrize("kind", KINDS)
def test_mpimemblock_over_a_communicator(kind) -> None:
    run_ranks("mpi", kind)


class _HalfGroup:
    """One member of a two-rank group whose other member never shows up (the socket and the
    timeout are real; only the group's collectives are this process's alone)."""

    size = 2

    def __init__(self, rank: int, bcast_value: object = None) -> None:
        self.rank = rank
        self._bcast_value = bcast_value

    def bcast(self, obj: object) -> object:
        return obj if self._bcast_value is None else self._bcast_value


def test_exchange_times_out_with_a_typed_error_naming_the_missing_rank() -> None:
    from gpu.dist.groups import GroupError, exchange_fds

    with pytest.raises(GroupError, match=r"ranks \[1\] did not connect"):
        exchange_fds(_HalfGroup(0), {}, [], timeout=0.2)  # type: ignore[arg-type]


def test_exchange_with_an_unreachable_rank_0_raises_a_typed_error(tmp_path) -> None:
    from gpu.dist.groups import GroupError, exchange_fds

    group = _HalfGroup(1, bcast_value=(str(tmp_path / "nobody-listens"), "token"))
    with pytest.raises(GroupError, match="cannot reach rank 0"):
        exchange_fds(group, {}, [], timeout=0.2)  # type: ignore[arg-type]


def test_torch_group_without_torchrun_env_says_how_to_launch(monkeypatch) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(BadArgumentError, match="torchrun"):
        DistMemBlock(10, 4, devices="cpu", group="torch")
