"""The embedded LMDB backend (file://): round trips, schema, change feed, processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from safetensors.torch import save_file

import psclient
from psclient.codec import be_key_bytes

from . import model
from .workers import file_reader, file_writer_forever


@pytest.fixture
def file_url(tmp_path: Path) -> str:
    return f"file://{tmp_path}/store"


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=model.OPS)
def test_differential_against_dict(file_url: str, ops: list) -> None:
    with psclient.connect(file_url, table="diff", dim=model.DIM) as ps:
        model.check_against_dict(ps, ops)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_dtypes_round_trip_bit_exact(file_url: str, dtype: torch.dtype) -> None:
    keys = torch.tensor([5, -7, 2**62], dtype=torch.int64)
    vals = torch.randn(3, 16).to(dtype)
    with psclient.connect(file_url, table="dt", dim=16, dtype=dtype) as ps:
        ps.insert(keys, vals)
        got, found = ps.lookup(keys.flip(0))
        assert found.all() and got.dtype == dtype
        assert torch.equal(got.view(torch.uint8), vals.flip(0).contiguous().view(torch.uint8))


def test_persists_and_reopens_with_stored_schema(file_url: str) -> None:
    keys = torch.arange(100, dtype=torch.int64) * 3 - 50
    vals = torch.randn(100, 8)
    with psclient.connect(file_url, table="persist", dim=8, dtype="float16") as ps:
        ps.insert(keys, vals.half())
    with psclient.connect(file_url, table="persist") as ps:
        assert (ps.dim, ps.dtype, ps.size()) == (8, torch.float16, 100)
        got, found = ps.lookup(keys)
        assert found.all() and torch.equal(got, vals.half())


def test_schema_mismatch_and_missing_table(file_url: str) -> None:
    psclient.connect(file_url, table="s", dim=8).close()
    with pytest.raises(psclient.SchemaMismatchError, match="dim=16"):
        psclient.connect(file_url, table="s", dim=16)
    with pytest.raises(psclient.SchemaMismatchError, match="dtype"):
        psclient.connect(file_url, table="s", dim=8, dtype=torch.float16)
    with pytest.raises(psclient.TableNotFoundError, match="pass dim"):
        psclient.connect(file_url, table="other")
    with pytest.raises(psclient.BadArgumentError, match="unsupported dtype"):
        psclient.connect(file_url, table="s3", dim=8, dtype=torch.int32)
    with pytest.raises(psclient.BadArgumentError, match="bad table name"):
        psclient.connect(file_url, table="a b", dim=8)
    with pytest.raises(psclient.UnsupportedURLError, match="three slashes"):
        psclient.connect("file://relative/path", table="s", dim=8)
    with pytest.raises(psclient.UnsupportedURLError, match="no backend"):
        psclient.connect("ftp://x/y", table="s", dim=8)
    with pytest.raises(psclient.BadArgumentError, match="unknown file:// option"):
        psclient.connect(file_url, table="s", bogus=1)


def test_bad_keys_and_values_write_nothing(file_url: str) -> None:
    with psclient.connect(file_url, table="bad", dim=4) as ps:
        good = torch.tensor([1, 2])
        for keys in ([1, 2], torch.tensor([1.0, 2.0]), torch.tensor([[1, 2]]),
                     torch.tensor([1, 2], dtype=torch.int32)):
            with pytest.raises(psclient.BadKeysError):
                ps.insert(keys, torch.zeros(2, 4))  # type: ignore[arg-type]
        for vals in (torch.zeros(2, 5), torch.zeros(3, 4), torch.zeros(2, 4, dtype=torch.float64),
                     [[0.0] * 4] * 2):
            with pytest.raises(psclient.BadValuesError):
                ps.insert(good, vals)  # type: ignore[arg-type]
        assert isinstance(psclient.BadKeysError("x"), ValueError)
        assert ps.size() == 0
        ps.close()
        with pytest.raises(psclient.HandleClosedError):
            ps.lookup(good)


def test_change_feed_lists_changed_keys_and_reports_gaps(file_url: str) -> None:
    with psclient.connect(file_url, table="feed", dim=2, changes_maxlen=3) as ps:
        keys0, cur = ps.changes()
        assert keys0.numel() == 0
        ps.insert(torch.tensor([1, 2, 3]), torch.zeros(3, 2))   # new keys: no feed entry
        keys, cur2 = ps.changes(cur)
        assert keys.numel() == 0 and cur2 == cur
        ps.insert(torch.tensor([3, 4]), torch.ones(2, 2))        # 3 existed
        assert ps.update(torch.tensor([1, 9]), torch.ones(2, 2)).tolist() == [True, False]
        ps.erase(torch.tensor([2, 8]))
        keys, cur3 = ps.changes(cur)
        assert {1, 2, 3} <= set(keys.tolist()) and 9 not in keys.tolist()
        assert ps.changes(cur3)[0].numel() == 0
        for i in range(5):                                        # overflow the bounded feed
            ps.update(torch.tensor([1]), torch.full((1, 2), float(i)))
        with pytest.raises(psclient.ChangeFeedGapError) as gap:
            ps.changes(cur3)
        resume = gap.value.cursor
        assert ps.changes(resume)[0].numel() == 0
        ps.clear()
        with pytest.raises(psclient.ChangeFeedGapError, match="cleared"):
            ps.changes(resume)


def test_load_sources(file_url: str, tmp_path: Path) -> None:
    data = torch.randn(1000, 8)
    np.save(tmp_path / "rows.npy", data.numpy())
    save_file({"emb": data, "other": torch.zeros(2, 2)}, str(tmp_path / "rows.safetensors"))
    with psclient.connect(file_url, table="load", dim=8) as ps:
        assert ps.load(data, batch_size=300, progress=False) == 1000
        assert ps.load(tmp_path / "rows.npy", keys=torch.arange(1000) + 5000,
                       progress=False) == 1000
        assert ps.load(str(tmp_path / "rows.safetensors"), tensor="emb",
                       keys=torch.arange(1000) - 3000, progress=False) == 1000
        chunks = ((torch.arange(10) + 10 * i + 10_000, data[:10]) for i in range(5))
        assert ps.load(chunks, progress=False) == 50
        assert ps.size() == 3050
        for off in (0, 5000, -3000):
            got, found = ps.lookup(torch.arange(1000) + off)
            assert found.all() and torch.equal(got, data)
        with pytest.raises(psclient.BadArgumentError, match="tensor=NAME"):
            ps.load(tmp_path / "rows.safetensors", progress=False)
        with pytest.raises(psclient.BadValuesError, match="dim 8"):
            ps.load(torch.zeros(4, 3), progress=False)
        assert ps.size() == 3050


def test_wrong_length_value_names_table_and_key(file_url: str, tmp_path: Path) -> None:
    with psclient.connect(file_url, table="corrupt", dim=4) as ps:
        ps.insert(torch.tensor([1, 2, 3]), torch.ones(3, 4))
    # NOTE: the store's files, once no client holds them open (LMDB allows one open
    # environment per process): key 2's row, where docs/psclient.md puts it, gets 3 bytes.
    env = lmdb.open(str(tmp_path / "store"), max_dbs=4, subdir=True, create=False)
    try:
        rows = env.open_db(b"rows:corrupt", create=False)
        with env.begin(write=True, db=rows) as txn:
            txn.put(be_key_bytes(np.array([2], dtype=np.int64))[0], b"xyz")
    finally:
        env.close()
    with psclient.connect(file_url, table="corrupt") as ps:
        with pytest.raises(psclient.CorruptValueError, match="'corrupt', key 2: .* 3 bytes"):
            ps.lookup(torch.tensor([1, 2, 3]))


def test_drop_removes_table(file_url: str) -> None:
    ps = psclient.connect(file_url, table="gone", dim=4)
    ps.insert(torch.tensor([1]), torch.zeros(1, 4))
    ps.drop()
    with pytest.raises(psclient.TableNotFoundError):
        psclient.connect(file_url, table="gone")


def test_fork_child_reads_through_parents_client(file_url: str) -> None:
    keys = torch.arange(64, dtype=torch.int64)
    vals = torch.randn(64, 4)
    with psclient.connect(file_url, table="fork", dim=4) as ps:
        ps.insert(keys, vals)
        ps.lookup(keys)  # the environment is in use before the fork
        ctx = mp.get_context("fork")  # NOTE: this test is about fork on purpose
        q = ctx.Queue()

        def child() -> None:
            got, found = ps.lookup(keys)
            ps.insert(torch.tensor([1000]), torch.ones(1, 4))
            q.put((bool(found.all()), bool(torch.equal(got, vals))))

        p = ctx.Process(target=child)
        p.start()
        assert q.get(timeout=20) == (True, True)
        p.join(20)
        assert p.exitcode == 0
        got, found = ps.lookup(torch.tensor([1000, 3]))   # the parent still works
        assert found.all() and torch.equal(got[1], vals[3])


def test_reader_during_writer_process_and_killed_writer(file_url: str) -> None:
    """This process reads whole rows while a spawned writer commits; a writer killed by
    SIGKILL mid-stream leaves the store readable and writable (no stuck lock)."""
    with psclient.connect(file_url, table="mp", dim=8) as ps:
        ps.insert(torch.arange(512), torch.zeros(512, 8))
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    writer = ctx.Process(target=file_writer_forever, args=(file_url, "mp", ready))
    writer.start()
    try:
        assert ready.wait(60), "writer did not start"
        assert file_reader(file_url, "mp", 50) == "ok"
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(10)
    with psclient.connect(file_url, table="mp") as ps:
        got, found = ps.lookup(torch.arange(512))
        assert found.all()
        # every row is one whole write (all 8 elements equal), never torn
        assert torch.equal(got, got[:, :1].expand(-1, 8))
        ps.insert(torch.tensor([7]), torch.full((1, 8), -1.0))   # writer lock is free
        assert ps.lookup(torch.tensor([7]))[0][0, 0] == -1.0
