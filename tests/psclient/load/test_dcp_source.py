"""A ``torch.distributed.checkpoint`` directory as a load source: ``ps.load(DIR)``,
``psclient load DIR``, ``hostcache.files.load_rows`` / ``restore``; the tensor picked by its
FQN or as the only 2-D one, every table dtype, a transposed tensor, a checkpoint written
by two ranks (row and column shards), memory bounded by the rows read, and one-line errors
(not a DCP directory, no such tensor, several candidates, not 2-D)."""

from __future__ import annotations

import tracemalloc
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from safetensors.torch import save_file

import psclient
from hostcache import SharedMemBlock, files
from hostcache.errors import BadArgumentError as HostBadArgumentError
from hostcache.errors import GeometryMismatchError, NonFiniteValuesError
from psclient.cli import main
from psclient.dcp_source import open_dcp
from psclient.errors import BadArgumentError, BadValuesError
from psclient.loader import open_rows
from tests.conftest import fresh_name

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def save(path: Path, state: dict[str, object]) -> Path:
    with warnings.catch_warnings():  # NOTE: DCP warns that no process group is running
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path))
    return path


def rows_of(url: str, table: str, n: int) -> torch.Tensor:
    with psclient.connect(url, table=table) as ps:
        values, found = ps.lookup(torch.arange(n, dtype=torch.int64))
    assert bool(found.all())
    return values


@pytest.fixture
def shm_name() -> Iterator[str]:
    name = fresh_name("dcp")
    yield name
    try:
        SharedMemBlock.unlink(name)
    except FileNotFoundError:
        pass


@pytest.mark.parametrize("dtype", DTYPES)
def test_api_load_by_fqn(tmp_path: Path, table_name: str, dtype: torch.dtype) -> None:
    emb = torch.randn(301, 7).to(dtype)
    ck = save(tmp_path / "ck", {"emb.weight": emb, "dense.weight": torch.randn(3, 4),
                                "dense.bias": torch.randn(4), "step": 12})
    url = f"file://{tmp_path}/store"
    with psclient.connect(url, table=table_name, dim=7, dtype=emb.dtype) as ps:
        n = ps.load(ck, tensor="emb.weight", batch_size=50)
    assert n == 301 and n.distinct == 301
    assert torch.equal(rows_of(url, table_name, 301), emb)


def test_transposed_tensor_and_only_2d(tmp_path: Path) -> None:
    base = torch.randn(9, 5)
    ck = save(tmp_path / "ck", {"w": base.t(), "b": torch.randn(3)})  # NOTE: strides (1, 5)
    rows = open_rows(ck)  # the only 2-D tensor
    assert (rows.n, rows.dim, rows.dtype) == (5, 9, torch.float32)
    assert torch.equal(rows.get(0, 5), base.t())
    assert torch.equal(rows.get(2, 4), base.t()[2:4])
    assert rows.get(3, 3).shape == (0, 9)


def test_redis_store(tmp_path: Path, shared_redis: str, table_name: str) -> None:
    emb = torch.randn(200, 16)
    ck = save(tmp_path / "ck", {"emb.weight": emb})
    try:
        with psclient.connect(shared_redis, table=table_name, dim=16) as ps:
            assert ps.load(ck) == 200
        assert torch.equal(rows_of(shared_redis, table_name, 200), emb)
    finally:
        psclient.connect(shared_redis, table=table_name, partial=True).drop()


def test_cli_load(tmp_path: Path, table_name: str, capsys: pytest.CaptureFixture[str]) -> None:
    emb = torch.randn(120, 8, dtype=torch.float64)
    ck = save(tmp_path / "ck", {"emb.weight": emb, "other.weight": torch.randn(4, 4)})
    url = f"file://{tmp_path}/store"
    assert main(["load", url, "--table", table_name, "--tensor", "emb.weight",
                 "--no-progress", str(ck)]) == 0
    assert "loaded 120 rows" in capsys.readouterr().out
    assert torch.equal(rows_of(url, table_name, 120), emb)
    # converted on load, as any source
    assert main(["load", url, "--table", table_name + "_h", "--tensor", "emb.weight",
                 "--dtype", "float16", "--no-progress", "--format", "dcp", str(ck)]) == 0
    assert torch.equal(rows_of(url, table_name + "_h", 120), emb.to(torch.float16))


def one_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) != 0
    err = capsys.readouterr().err
    assert err.startswith("psclient: error: ") and err.count("\n") == 1, err
    return err


def test_cli_errors(tmp_path: Path, table_name: str, capsys: pytest.CaptureFixture[str]) -> None:
    ck = save(tmp_path / "ck", {"a.weight": torch.randn(4, 3), "b.weight": torch.randn(5, 3),
                                "bias": torch.randn(3)})
    url = f"file://{tmp_path}/store"
    (tmp_path / "empty").mkdir()
    err = one_error(capsys, "load", url, "--table", table_name, str(tmp_path / "empty"))
    assert "not a DCP checkpoint directory" in err and ".metadata" in err
    err = one_error(capsys, "load", url, "--table", table_name, str(ck))
    assert "2 2-D tensors (a.weight, b.weight)" in err and "--tensor NAME" in err
    err = one_error(capsys, "load", url, "--table", table_name, "--tensor", "c.weight", str(ck))
    assert "no tensor 'c.weight'" in err and "a.weight, b.weight" in err
    err = one_error(capsys, "load", url, "--table", table_name, "--tensor", "bias", str(ck))
    assert "is [3], need [N, dim]" in err
    err = one_error(capsys, "load", url, "--table", table_name, "--format", "dcp",
                    str(ck / "__0_0.distcp"))
    assert "is a file, not a DCP checkpoint directory" in err
    assert not (tmp_path / "store").exists()  # nothing was created


def test_api_errors(tmp_path: Path) -> None:
    ck = save(tmp_path / "ck", {"v": torch.randn(4), "step": 3})
    with pytest.raises(BadArgumentError, match=r"holds 0 2-D tensors: there are no rows"):
        open_dcp(ck, None)
    with pytest.raises(BadValuesError, match=r"tensor 'v' .* is \[4\]"):
        open_dcp(ck, "v")
    with pytest.raises(BadArgumentError, match="no tensor 'step'"):
        open_dcp(ck, "step")
    ck2 = save(tmp_path / "ck2", {"a": torch.randn(2, 2), "b": torch.randn(2, 2)})
    with pytest.raises(BadArgumentError, match="name one with tensor=NAME"):
        open_rows(ck2)
    (ck2 / "__0_0.distcp").write_bytes(b"PK\x03\x04 not an archive")
    with pytest.raises(BadArgumentError, match="cannot be read"):
        open_rows(ck2, "a")


def test_memory_bounded_by_chunk(tmp_path: Path) -> None:
    emb = torch.randn(40000, 64)  # 10 MiB
    ck = save(tmp_path / "ck", {"emb.weight": emb})
    rows = open_rows(ck, "emb.weight")
    tracemalloc.start()
    try:
        total = torch.zeros(64, dtype=torch.float64)
        for a in range(0, rows.n, 1000):  # 250 KiB a chunk
            total += rows.get(a, a + 1000).sum(0, dtype=torch.float64)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert torch.allclose(total, emb.sum(0, dtype=torch.float64))
    assert peak < 2 << 20, peak  # a few chunks, never the 10 MiB tensor


def _save_sharded(rank: int, world: int, init: str, path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        g = torch.Generator().manual_seed(0)
        rows, cols = torch.randn(11, 6, generator=g), torch.randn(7, 10, generator=g)
        state = {"rows.weight": distribute_tensor(rows, mesh, [Shard(0)]),
                 "cols.weight": distribute_tensor(cols, mesh, [Shard(1)])}
        dcp.save(state, checkpoint_id=path)
    finally:
        dist.destroy_process_group()


def test_two_rank_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    mp.spawn(_save_sharded, args=(2, f"file://{tmp_path}/pg", str(path)), nprocs=2)
    g = torch.Generator().manual_seed(0)
    want_rows, want_cols = torch.randn(11, 6, generator=g), torch.randn(7, 10, generator=g)
    rows = open_rows(path, "rows.weight")
    assert len(list(path.glob("*.distcp"))) == 2
    assert torch.equal(torch.cat([rows.get(a, min(11, a + 4)) for a in range(0, 11, 4)]),
                       want_rows)
    cols = open_rows(path, "cols.weight")
    assert torch.equal(cols.get(0, 7), want_cols) and torch.equal(cols.get(3, 5), want_cols[3:5])


def test_load_rows_into_block(tmp_path: Path, shm_name: str) -> None:
    emb = torch.randn(500, 12)
    ck = save(tmp_path / "ck", {"emb.weight": emb})
    save_file({"emb": emb}, str(tmp_path / "t.safetensors"))
    with SharedMemBlock.create(shm_name, num_rows=600, dim=12) as block:
        for src in (ck, tmp_path / "t.safetensors"):
            block.tensor.zero_()
            assert files.load_rows(block, src, chunk=128) == 500
            assert torch.equal(block.tensor[:500], emb)
            assert not block.tensor[500:].any()
        with pytest.raises(HostBadArgumentError, match="no tensor 'x'"):
            files.load_rows(block, ck, tensor="x")
    with SharedMemBlock.create(shm_name + "s", num_rows=100, dim=12) as small:
        try:
            with pytest.raises(GeometryMismatchError, match="500 rows of dim 12"):
                files.load_rows(small, ck)
        finally:
            SharedMemBlock.unlink(shm_name + "s")


def test_load_rows_refuses_nonfinite_before_writing(tmp_path: Path, shm_name: str) -> None:
    emb = torch.randn(300, 4)
    emb[250, 1] = float("nan")
    ck = save(tmp_path / "ck", {"emb.weight": emb})
    with SharedMemBlock.create(shm_name, num_rows=300, dim=4) as block:
        with pytest.raises(NonFiniteValuesError, match="1 of 300 rows .* row 250"):
            files.load_rows(block, ck, chunk=100)
        assert not block.tensor.any()  # nothing was written
        assert files.load_rows(block, ck, chunk=100, allow_nonfinite=True) == 300
        assert bool(block.tensor[250, 1].isnan())
        assert torch.equal(block.tensor.nan_to_num(), emb.nan_to_num())


def test_restore_dcp_dir(tmp_path: Path, shm_name: str) -> None:
    emb = torch.randn(77, 5).to(torch.bfloat16)
    ck = save(tmp_path / "ck", {"emb.weight": emb, "x.weight": torch.randn(2, 2)})
    with pytest.raises(HostBadArgumentError, match="2 2-D tensors"):
        files.restore(shm_name, ck)
    with pytest.raises(FileNotFoundError):  # nothing was left by the failed restore
        SharedMemBlock.attach(shm_name)
    with files.restore(shm_name, ck, tensor="emb.weight") as table:
        assert isinstance(table, SharedMemBlock)
        assert (table.num_rows, table.dtype) == (77, torch.bfloat16)
        assert torch.equal(table.tensor, emb)
