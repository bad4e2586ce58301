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
from hypothesis import strategies as st
from safetensors.torch import save_file

import psclient
from bench.ps.file_reads import lookup_per_key
from psclient.codec import be_key_bytes
from tests.psclient import model
from tests.psclient.workers import file_reader, file_writer_forever


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


def _random_rows(n: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows of arbitrary bit patterns (NaN payloads, -0.0, subnormals included)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, dim * torch.empty(0, dtype=dtype).element_size()),
                        dtype=torch.uint8, generator=g)
    return raw.view(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                              b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_lookup_misses_duplicates_and_bits(file_url: str, dtype: torch.dtype) -> None:
    """Every dtype: misses read as zeros with found False, every copy of a repeated key gets
    its row, extreme keys work, a stored row of zeros is found, values are bit-exact."""
    keys = torch.tensor([-(2**63) + 1, 2**63 - 1, 0, 5, -7, 2**40, 11], dtype=torch.int64)
    vals = _random_rows(keys.numel(), 6, dtype, seed=1)  # random bits: NaNs too
    vals[6] = 0  # key 11 stores zeros: still found
    with psclient.connect(file_url, table="bits", dim=6, dtype=dtype) as ps:
        ps.insert(keys, vals, allow_nonfinite=True)
        ask = torch.tensor([5, 99, 2**63 - 1, 5, -(2**63) + 1, -(2**63), -8, 5, 11, 99, 0],
                           dtype=torch.int64)
        got, found = ps.lookup(ask)
        stored = dict(zip(keys.tolist(), vals, strict=True))
        assert found.tolist() == [k in stored for k in ask.tolist()]
        assert got.dtype == dtype and got.shape == (ask.numel(), 6)
        for i, k in enumerate(ask.tolist()):
            want = stored.get(k, torch.zeros(6, dtype=dtype))
            assert _same_bits(got[i], want), (i, k)
        ref = lookup_per_key(ps, ask.numpy())
        assert _same_bits(got, ref[0]) and torch.equal(found, ref[1])
        empty, efound = ps.lookup(torch.empty(0, dtype=torch.int64))
        assert empty.shape == (0, 6) and empty.dtype == dtype and efound.shape == (0,)
        only_misses, none = ps.lookup(torch.tensor([1, 1, 2]))
        assert not none.any() and not only_misses.view(torch.uint8).any()


def test_lookup_large_batch_against_per_key_path(file_url: str) -> None:
    """150k keys (more than one insert batch) with a third missing and many duplicates:
    the same result as the per-key reference path, bit for bit, and as what was inserted."""
    rng = np.random.default_rng(3)
    keys = rng.choice(2**50, size=100_000, replace=False).astype(np.int64)
    vals = _random_rows(keys.size, 32, torch.float32, seed=2)
    with psclient.connect(file_url, table="big", dim=32) as ps:
        ps.load(vals, keys=torch.from_numpy(keys), progress=False, allow_nonfinite=True)
        absent = rng.choice(2**50, size=50_000).astype(np.int64) | (1 << 51)
        ask = np.concatenate([keys[rng.integers(0, keys.size, 100_000)], absent])
        rng.shuffle(ask)
        got, found = ps.lookup(torch.from_numpy(ask))
        ref, ref_found = lookup_per_key(ps, ask)
        assert torch.equal(found, ref_found) and _same_bits(got, ref)
        assert int(found.sum()) == 100_000 and not found[torch.from_numpy(ask >= 1 << 51)].any()
        pos = np.searchsorted(np.sort(keys), ask[found.numpy()])
        want = vals[torch.from_numpy(np.argsort(keys)[pos])]
        assert _same_bits(got[found], want)
        assert not got[~found].view(torch.uint8).any()


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stored=st.lists(st.integers(-40, 40), max_size=30),
       ask=st.lists(st.one_of(st.integers(-45, 45),
                              st.sampled_from([-(2**63), 2**63 - 1])), max_size=60))
def test_lookup_differential_against_per_key_path(file_url: str, stored: list[int],
                                                  ask: list[int]) -> None:
    with psclient.connect(file_url, table="pk", dim=3, dtype=torch.float16) as ps:
        ps.clear()
        k = torch.tensor(stored, dtype=torch.int64)
        ps.insert(k, _random_rows(len(stored), 3, torch.float16, seed=len(stored)),
                  allow_nonfinite=True)
        q = torch.tensor(ask, dtype=torch.int64)
        got, found = ps.lookup(q)
        ref, ref_found = lookup_per_key(ps, q.numpy())
        assert torch.equal(found, ref_found) and _same_bits(got, ref)
        assert found.tolist() == [a in set(stored) for a in ask]


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
        with pytest.raises(psclient.CorruptValueError, match="key 2: .* 1 bad value"):
            ps.lookup(torch.tensor([2, 3, 2, 9, 2]))   # repeated: one distinct bad value
        got, found = ps.lookup(torch.tensor([3, 1, 9]))  # the others still read
        assert found.tolist() == [True, True, False] and torch.equal(got[:2], torch.ones(2, 4))


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
