"""``hostcache save`` / ``restore`` and :mod:`hostcache.files`: a table's keys and rows to a
safetensors file and back, into a new table (created from the file's geometry) or an
existing one of the same geometry, for both kinds, every dtype and odd row lengths; bad
input is one typed line and writes nothing."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import psclient
from hostcache import HostCache, SharedMemBlock, files
from hostcache.cli import main
from hostcache.errors import (
    BadArgumentError,
    GeometryMismatchError,
    NonFiniteValuesError,
    SegmentNotFoundError,
)
from tests.conftest import fresh_name

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@pytest.fixture
def names() -> Iterator[list[str]]:
    """Table names to use; every one that exists at the end is removed."""
    made: list[str] = []
    yield made
    for name in made:
        with contextlib.suppress(SegmentNotFoundError):
            SharedMemBlock.unlink(name)


def name(made: list[str]) -> str:
    made.append(fresh_name("sr"))
    return made[-1]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def leftovers(d: Path) -> list[str]:
    return sorted(f for f in os.listdir(d) if f.startswith("."))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("dim", [1, 13])
def test_linear_round_trip(names: list[str], tmp_path: Path, dtype: torch.dtype,
                           dim: int) -> None:
    rows = torch.randn(300, dim).to(dtype)
    path = tmp_path / "lin.safetensors"
    with SharedMemBlock.create(name(names), num_rows=300, dim=dim, dtype=dtype) as block:
        block.write(torch.arange(300), rows)
        assert files.save(block, path) == 300
    with files.restore(name(names), path) as back:
        assert isinstance(back, SharedMemBlock) and back.num_rows == 300
        assert torch.equal(back.tensor, rows)
    with SharedMemBlock.create(name(names), num_rows=300, dim=dim, dtype=dtype) as there:
        cursor = there.change_cursor
        with files.restore(there.name, path, create=False) as same:
            assert torch.equal(same.tensor, rows)
        assert there.change_cursor > cursor  # NOTE: GPU caches are told to drop the rows
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_cache_round_trip(names: list[str], tmp_path: Path, dtype: torch.dtype) -> None:
    keys = torch.randperm(100_000)[:400].to(torch.int64) - 50_000
    rows = torch.randn(400, 7).to(dtype)
    path = tmp_path / "hc.safetensors"
    with HostCache.create(name(names), capacity=1024, dim=7, dtype=dtype, ways=16) as hc:
        hc.insert(keys, rows)
        held = hc.contains(keys)
        assert files.save(hc.name, path) == int(held.sum())
    with files.restore(name(names), path) as back:
        assert isinstance(back, HostCache)
        assert back.geometry.capacity == 1024 and back.geometry.ways == 16
        values, hit = back.lookup(keys[held], count=False)
        assert bool(hit.all()) and torch.equal(values, rows[held])
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        assert meta["kind"] == "hostcache" and meta["dtype"] == str(dtype)[6:]


def test_cli_save_restore_and_psclient_reads_the_file(
        names: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = torch.randn(50, 5).to(torch.bfloat16)
    src = name(names)
    with SharedMemBlock.create(src, num_rows=50, dim=5, dtype=torch.bfloat16) as block:
        block.write(torch.arange(50), rows)
    path = tmp_path / "t.safetensors"
    rc, out, _ = run(capsys, "save", src, str(path))
    assert rc == 0 and "saved 50 rows" in out
    dst = name(names)
    rc, out, _ = run(capsys, "restore", dst, str(path))
    assert rc == 0 and f"into linear table {dst}" in out
    with SharedMemBlock.attach(dst) as back:
        assert torch.equal(back.tensor, rows)
    url = f"file://{tmp_path}/store"
    with psclient.connect(url, table="t", dim=5, dtype="bfloat16") as ps:
        assert ps.load(path, progress=False) == 50
        values, found = ps.lookup(torch.arange(50))
        assert bool(found.all()) and torch.equal(values, rows)
    assert leftovers(tmp_path) == []


def test_errors_are_typed_one_line_and_write_nothing(
        names: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = torch.randn(20, 4)
    path = tmp_path / "t.safetensors"
    with SharedMemBlock.create(name(names), num_rows=20, dim=4) as block:
        block.write(torch.arange(20), rows)
        files.save(block, path)
    other = torch.ones(20, 4)
    cases = [
        (SharedMemBlock.create(name(names), num_rows=20, dim=3), GeometryMismatchError,
         "dim 3"),
        (SharedMemBlock.create(name(names), num_rows=20, dim=4, dtype=torch.float16),
         GeometryMismatchError, "float16"),
        (SharedMemBlock.create(name(names), num_rows=10, dim=4), GeometryMismatchError,
         "at least 20 rows"),
        (HostCache.create(name(names), capacity=64, dim=4), GeometryMismatchError,
         "linear table"),
    ]
    for table, kind, words in cases:
        with table:
            if isinstance(table, SharedMemBlock):
                table.tensor.copy_(other[:table.num_rows, :table.dim].to(table.dtype))
            with pytest.raises(kind, match=words):
                files.restore(table.name, path)
            if isinstance(table, SharedMemBlock):  # NOTE: nothing was written
                assert bool((table.tensor == 1).all())
            rc, _, err = run(capsys, "restore", table.name, str(path))
            assert rc == 2 and err.startswith("hostcache: error: ") and err.count("\n") == 1
    missing = name(names)
    with pytest.raises(SegmentNotFoundError):
        files.restore(missing, path, create=False)
    with pytest.raises(SegmentNotFoundError):
        files.save(missing, tmp_path / "x.safetensors")
    with pytest.raises(BadArgumentError, match="cannot write"):
        files.save(names[0], tmp_path / "no" / "x.safetensors")
    with pytest.raises(BadArgumentError, match="no such file"):
        files.restore(missing, tmp_path / "none.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a table")
    with pytest.raises(BadArgumentError, match="not a saved table"):
        files.restore(missing, tmp_path / "junk.safetensors")
    save_file({"w": rows}, str(tmp_path / "other.safetensors"))
    with pytest.raises(BadArgumentError, match="'weight' and 'keys'"):
        files.restore(missing, tmp_path / "other.safetensors")
    bad = rows.clone()
    bad[17, 2] = float("nan")
    save_file({"weight": bad, "keys": torch.arange(20)}, str(tmp_path / "nan.safetensors"))
    with pytest.raises(NonFiniteValuesError, match="key 17"):
        files.restore(missing, tmp_path / "nan.safetensors")  # NOTE: the new table goes again
    with pytest.raises(SegmentNotFoundError):
        SharedMemBlock.attach(missing)
    blocker = tmp_path / "dir.safetensors"
    blocker.mkdir()
    (blocker / "x").write_text("x")
    rc, _, err = run(capsys, "save", names[0], str(blocker))
    assert rc == 2 and "cannot write" in err and err.count("\n") == 1
    assert leftovers(tmp_path) == []


def test_table_methods_save_and_restore(names: list[str], tmp_path: Path) -> None:
    """``table.save(path)`` and ``Class.restore(name, path)`` are hostcache.files' save and
    restore; a file of the other kind is refused before any table is created."""
    rows = torch.randn(40, 6).to(torch.float16)
    lin, hcf = tmp_path / "lin.safetensors", tmp_path / "hc.safetensors"
    with SharedMemBlock.create(name(names), num_rows=40, dim=6, dtype=torch.float16) as block:
        block.write(torch.arange(40), rows)
        assert block.save(lin) == 40
    keys = torch.arange(100, 130)
    with HostCache.create(name(names), capacity=256, dim=6, dtype=torch.float16) as hc:
        hc.insert(keys, rows[:30])
        assert hc.save(hcf, chunk=7) == int(hc.contains(keys).sum()) > 0
    with SharedMemBlock.restore(name(names), lin) as back:
        assert type(back) is SharedMemBlock and torch.equal(back.tensor, rows)
        cursor = back.change_cursor
        with SharedMemBlock.restore(back.name, lin, create=False, chunk=16) as same:
            assert same.name == back.name
        assert back.change_cursor > cursor  # NOTE: written again, announced
    with HostCache.restore(name(names), hcf) as cache:
        assert type(cache) is HostCache
        values, hit = cache.lookup(keys, count=False)
        assert bool(hit.any()) and torch.equal(values[hit], rows[:30][hit])
    for cls, wrong in ((HostCache, lin), (SharedMemBlock, hcf)):
        new = name(names)
        with pytest.raises(GeometryMismatchError, match="not a " + cls.__name__):
            cls.restore(new, wrong)
        with pytest.raises(SegmentNotFoundError):
            SharedMemBlock.attach(new)  # NOTE: nothing was created
    assert leftovers(tmp_path) == []
