"""Table loads streamed into a SharedMemBlock (``hostcache.files.load_rows``, ``restore``,
``SharedMemBlock.fill_range``, ``psclient.read_into``): every source format, row counts that
are no multiple of the chunk, padded rows, every read bounded by the chunk (straight into
the block's rows where they are packed), announcements, and typed errors that leave the
table as it was (another dtype, a truncated file)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from hostcache import SharedMemBlock, files
from hostcache.errors import (
    BadArgumentError,
    GeometryMismatchError,
    NonFiniteValuesError,
    SegmentNotFoundError,
)
from psclient.errors import BadArgumentError as PSBadArgumentError
from psclient.read_into import open_reader
from tests.conftest import fresh_name

N = 1001  # NOTE: no multiple of any chunk used below
SENTINEL = 7.0


@pytest.fixture
def blocks() -> Iterator[list[SharedMemBlock]]:
    """Blocks made by a test (``make``); every one is closed and removed at the end."""
    made: list[SharedMemBlock] = []
    yield made
    for b in made:
        b.close()
        with contextlib.suppress(SegmentNotFoundError):
            SharedMemBlock.unlink(b.name)


def make(made: list[SharedMemBlock], rows: int, dim: int,
         dtype: torch.dtype = torch.float32) -> SharedMemBlock:
    block = SharedMemBlock.create(fresh_name("ls"), num_rows=rows, dim=dim, dtype=dtype)
    made.append(block)
    block.tensor.fill_(SENTINEL)
    return block


def write_sources(d: Path, emb: torch.Tensor) -> dict[str, Path]:
    """``emb`` as each format a load reads (``.npy`` and raw rows where numpy has the dtype)."""
    out = {"safetensors": d / "t.safetensors", "dcp": d / "ck"}
    save_file({"emb.weight": emb}, str(out["safetensors"]))
    with warnings.catch_warnings():  # NOTE: DCP warns that no process group is running
        warnings.simplefilter("ignore")
        dcp.save({"emb.weight": emb}, checkpoint_id=str(out["dcp"]))
    if emb.dtype != torch.bfloat16:
        out["npy"] = d / "t.npy"
        np.save(out["npy"], emb.numpy())
        out["fortran"] = d / "f.npy"
        np.save(out["fortran"], np.asfortranarray(emb.numpy()))
        out["raw"] = d / "t.bin"
        emb.numpy().tofile(out["raw"])
    return out


@pytest.mark.parametrize(("dim", "dtype"), [(4, torch.float32), (3, torch.float32),
                                            (5, torch.bfloat16), (7, torch.float16)],
                         ids=["packed", "padded-f32", "padded-bf16", "padded-f16"])
def test_every_source_loads_whole_in_odd_chunks(blocks: list[SharedMemBlock], tmp_path: Path,
                                               dim: int, dtype: torch.dtype) -> None:
    emb = torch.randn(N, dim).to(dtype)
    block = make(blocks, N + 50, dim, dtype)
    assert (block.geometry.row_stride == block.geometry.row_bytes) == (dim == 4)
    for fmt, path in write_sources(tmp_path, emb).items():
        for chunk in (7, 64, 5000):
            block.tensor.fill_(SENTINEL)
            cursor = block.change_cursor
            assert files.load_rows(block, path, chunk=chunk, progress=False) == N, (fmt, chunk)
            assert torch.equal(block.tensor[:N], emb), (fmt, chunk)
            assert bool((block.tensor[N:] == SENTINEL).all())  # NOTE: rows past the file
            keys, _, overflowed = block.changes_since(cursor)
            assert overflowed or sorted(set(keys.tolist())) == list(range(N))


def test_reads_go_into_the_rows_or_one_buffer_or_mapping_of_at_most_chunk_rows(
        blocks: list[SharedMemBlock], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, int]] = []  # (rows, data_ptr) of every read
    maps: list[int] = []  # rows of every mapping the check reads
    opened = files._open_source

    def spy(*args: object, **kwargs: object) -> object:
        reader = opened(*args, **kwargs)  # type: ignore[arg-type]
        inner, inner_map = reader.read_into, reader.mapped

        def read_into(a: int, out: torch.Tensor) -> None:
            seen.append((out.shape[0], out.data_ptr()))
            inner(a, out)

        def mapped(a: int, b: int) -> torch.Tensor | None:
            view = inner_map(a, b)
            if view is not None:
                maps.append(view.shape[0])
            return view

        reader.read_into, reader.mapped = read_into, mapped
        return reader

    monkeypatch.setattr(files, "_open_source", spy)
    for dim in (32, 3):  # packed, then padded rows
        emb = torch.randn(N, dim)
        block = make(blocks, N, dim)
        (tmp_path / str(dim)).mkdir()
        src = write_sources(tmp_path / str(dim), emb)
        rows = block.tensor
        lo, hi = rows.data_ptr(), rows[-1].data_ptr() + rows.stride(0) * rows.element_size()
        for path in (src["safetensors"], src["dcp"]):
            for check in (True, False):
                seen.clear()
                maps.clear()
                files.load_rows(block, path, chunk=100, allow_nonfinite=not check)
                # NOTE: the check reads the file over mappings of at most a chunk
                assert max(maps, default=0) <= 100
                assert sum(maps) == (N + 1 if check else 0)  # NOTE: and one probe row
                assert torch.equal(block.tensor, emb)
                assert seen and all(m <= 100 for m, _ in seen)
                in_block = [(m, p) for m, p in seen if lo <= p < hi]
                if dim == 32:  # NOTE: every write pass read is the block's own rows
                    assert sum(m for m, _ in in_block) == N
                    assert [p for _, p in in_block] == \
                        [rows[a].data_ptr() for a in range(0, N, 100)]
                else:
                    assert not in_block
                buffers = {p for _, p in seen if not lo <= p < hi}
                assert len(buffers) <= 1  # NOTE: one buffer, reused
                chunks = -(-N // 100)
                assert len(seen) - len(in_block) == (dim == 3) * chunks  # NOTE: padded
    assert files.STAGE_BYTES // (3 * 4) > 100  # NOTE: the buffer was bounded by the chunk


def test_reader_reads_in_place_and_refuses_a_file_cut_after_open(tmp_path: Path) -> None:
    emb = torch.randn(N, 16)
    src = write_sources(tmp_path, emb)
    for fmt in ("safetensors", "dcp", "npy", "raw"):
        r = open_reader(src[fmt], dim=16, dtype=torch.float32)
        assert r.direct and (r.n, r.dim, r.dtype) == (N, 16, torch.float32)
        out = torch.zeros(10, 16)
        r.read_into(995, out[:6])
        assert torch.equal(out[:6], emb[995:]) and not out[6:].any()
        assert torch.equal(r.get(3, 40), emb[3:40])
    assert not open_reader(src["fortran"]).direct
    r = open_reader(src["safetensors"])
    with open(src["safetensors"], "r+b") as f:
        f.truncate(f.seek(0, 2) - 100)
    with pytest.raises(PSBadArgumentError, match="truncated"):
        r.read_into(N - 10, torch.empty(10, 16))
    with pytest.raises(PSBadArgumentError, match="contiguous CPU tensor"):
        r.read_into(0, torch.empty(16, 10).t())


def test_dtype_mismatch_is_typed_and_writes_nothing(blocks: list[SharedMemBlock],
                                                    tmp_path: Path) -> None:
    src = write_sources(tmp_path, torch.randn(N, 4, dtype=torch.float64))
    block = make(blocks, N, 4)
    for fmt, path in src.items():
        if fmt == "raw":  # NOTE: raw rows carry no dtype: they are read as the block's
            continue
        with pytest.raises(GeometryMismatchError, match="float64.*float32"):
            files.load_rows(block, path)
    wide = make(blocks, N, 5)
    with pytest.raises(GeometryMismatchError, match="dim 4"):
        files.load_rows(wide, src["safetensors"])
    assert bool((block.tensor == SENTINEL).all()) and bool((wide.tensor == SENTINEL).all())


def test_truncated_files_are_typed_and_leave_the_table_unchanged(
        blocks: list[SharedMemBlock], tmp_path: Path) -> None:
    src = write_sources(tmp_path, torch.randn(N, 8))
    block = make(blocks, N, 8)
    cut = [src["safetensors"], src["npy"], *sorted(src["dcp"].glob("*.distcp"))]
    for path in cut:
        with open(path, "r+b") as f:
            f.truncate(f.seek(0, 2) - 64)
    for path in (src["safetensors"], src["npy"], src["dcp"]):
        for check in (True, False):
            with pytest.raises(BadArgumentError, match="truncated|damaged|not a .safetensors"):
                files.load_rows(block, path, allow_nonfinite=not check)
            assert bool((block.tensor == SENTINEL).all()), path
    with pytest.raises(BadArgumentError, match="truncated"):  # NOTE: a restore creates nothing
        files.restore(fresh_name("ls"), src["dcp"])


def test_nonfinite_refused_before_the_first_write_then_allowed(
        blocks: list[SharedMemBlock], tmp_path: Path) -> None:
    emb = torch.randn(N, 4)
    emb[N - 1, 2] = float("inf")
    src = write_sources(tmp_path, emb)
    block = make(blocks, N, 4)
    with pytest.raises(NonFiniteValuesError, match=f"1 of {N} rows .* row {N - 1}"):
        files.load_rows(block, src["dcp"], chunk=64)
    assert bool((block.tensor == SENTINEL).all())
    assert files.load_rows(block, src["dcp"], chunk=64, allow_nonfinite=True) == N
    assert torch.equal(block.tensor, emb)


def test_restore_of_a_saved_block_streams_and_checks_keys(blocks: list[SharedMemBlock],
                                                          tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    src = make(blocks, N, 3)
    src.tensor.copy_(torch.randn(N, 3))
    src.tensor[500, 1] = float("nan")
    src.save(tmp_path / "b.safetensors")
    name = fresh_name("ls")
    with pytest.raises(NonFiniteValuesError, match="key 500"):
        files.restore(name, tmp_path / "b.safetensors", chunk=100)
    with pytest.raises(SegmentNotFoundError):  # NOTE: the table it created is gone again
        SharedMemBlock.attach(name)
    restored = files.restore(name, tmp_path / "b.safetensors", chunk=100,
                             allow_nonfinite=True, progress=True)
    blocks.append(restored)  # type: ignore[arg-type]
    assert isinstance(restored, SharedMemBlock)
    assert torch.equal(restored.tensor.nan_to_num(), src.tensor.nan_to_num())
    assert f"load {name}" in capsys.readouterr().err  # NOTE: the progress bar


def test_fill_range_checks_and_announces_when_fill_fails(blocks: list[SharedMemBlock]) -> None:
    block = make(blocks, 20, 3)
    with pytest.raises(BadArgumentError, match="do not fit"):
        block.fill_range(15, 10, lambda i, out: None)
    with pytest.raises(BadArgumentError, match="stage must be"):
        block.fill_range(0, 4, lambda i, out: None, stage=torch.empty(4, 2))

    def boom(i: int, out: torch.Tensor) -> None:
        out.fill_(1.0)
        raise OSError("disk gone")

    cursor = block.change_cursor
    with pytest.raises(OSError, match="disk gone"):
        block.fill_range(2, 5, boom, stage=torch.empty(2, 3))
    assert sorted(block.changes_since(cursor)[0].tolist()) == [2, 3, 4, 5, 6]
    assert bool((block.tensor == SENTINEL).all())  # NOTE: a stage is copied once it is read
    done: list[int] = []

    def second_fails(i: int, out: torch.Tensor) -> None:
        if done:
            raise OSError("disk gone")
        done.append(i)
        out.fill_(1.0)

    with pytest.raises(OSError, match="disk gone"):
        block.fill_range(2, 5, second_fails, stage=torch.empty(2, 3))
    assert torch.equal(block.tensor[2:4], torch.ones(2, 3))
    assert bool((block.tensor[4:] == SENTINEL).all())


def test_check_reads_chunks_no_mapping_holds_through_the_buffer(
        blocks: list[SharedMemBlock], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    emb = torch.randn(N, 4)
    emb[333, 0] = float("nan")
    emb[334, 3] = float("-inf")
    src = write_sources(tmp_path, emb)
    opened = files._open_source

    def spy(*args: object, **kwargs: object) -> object:
        reader = opened(*args, **kwargs)  # type: ignore[arg-type]
        inner = reader.mapped
        # NOTE: as a chunk across two pieces of a sharded checkpoint: no one mapping
        reader.mapped = lambda a, b: None if a in (300, 0) and b - a > 1 else inner(a, b)
        return reader

    monkeypatch.setattr(files, "_open_source", spy)
    block = make(blocks, N, 4)
    for path in (src["dcp"], src["safetensors"]):
        with pytest.raises(NonFiniteValuesError, match=f"2 of {N} rows .* row 333"):
            files.load_rows(block, path, chunk=100)
        assert bool((block.tensor == SENTINEL).all())
