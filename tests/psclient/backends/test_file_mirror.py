"""The file:// store's row mirror (psclient.file.mirror): what lookups read instead of
LMDB's B-tree, always equal to LMDB, across growth, other processes' writes, writers
killed mid-write, writes that bypass it, and machine restarts."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch

import psclient
from psclient.codec import be_key_bytes
from psclient.file import mirror_loops as loops
from tests.psclient.workers import HELD_KEY, mirror_writer_held


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


def _url(store: Path, **opts: object) -> str:
    query = "&".join(f"{k}={v}" for k, v in opts.items())
    return f"file://{store}" + (f"?{query}" if query else "")


def _header(store: Path, table: str) -> np.ndarray:
    return np.fromfile(store / f"rows.{table}.nvidx", dtype=np.int64, count=loops.HEADER_WORDS)


def _same(ps: psclient.ParameterServer, keys: torch.Tensor) -> tuple[torch.Tensor,
                                                                      torch.Tensor]:
    """The lookup, checked against LMDB's own read of the same keys (a client of the store
    that keeps no mirror)."""
    got, found = ps.lookup(keys)
    with psclient.connect(f"file://{ps.stat()['path']}?mirror=false", table=ps.table) as lmdb:
        ref, ref_found = lmdb.lookup(keys)
    assert torch.equal(found, ref_found)
    assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    return got, found


@pytest.mark.parametrize("seed", range(4))
def test_the_mirror_equals_lmdb_through_growth(store: Path, seed: int) -> None:
    """Random writes in batches of 1 to 3,000 keys over 4,000 (duplicates, overwrites,
    erases leaving tombstones, clears), growing the mirror several times from its 1,024
    slots: every lookup equals LMDB's read, and a second handle opened before the growth
    follows the new files."""
    rng = np.random.default_rng(seed)
    with psclient.connect(_url(store), table="grow", dim=3, dtype=torch.float64) as ps, \
            psclient.connect(_url(store), table="grow") as other:
        ps.clear()
        sizes = {1024}
        for step in range(40):
            n = int(rng.choice([1, 5, 100, 700, 3000]))
            k = torch.from_numpy(rng.integers(0, 4000, n))
            v = torch.from_numpy(rng.standard_normal((n, 3)))
            op = rng.choice(["insert", "insert", "update", "erase", "clear"],
                            p=[0.35, 0.2, 0.25, 0.17, 0.03])
            if op == "insert":
                ps.insert(k, v)
            elif op == "update":
                ps.update(k, v)
            elif op == "erase":
                ps.erase(k)
            else:
                ps.clear()
            probe = torch.arange(-5, 4005) if step % 4 == 0 else k
            _same(ps, probe)
            _same(other, probe)
            assert _header(store, "grow")[loops.COUNT] == ps.size()
            sizes.add(int(_header(store, "grow")[loops.SLOTS]))
        assert len(sizes) >= 2  # it grew


def test_lookups_read_the_mirror_and_writes_keep_it_even(store: Path) -> None:
    with psclient.connect(_url(store), table="t", dim=4) as ps:
        ps.insert(torch.arange(100), torch.ones(100, 4))
        hdr = _header(store, "t")
        assert hdr[loops.GEN] % 2 == 0 and hdr[loops.STATE] == 0 and hdr[loops.COUNT] == 100
        assert ps.stat()["mirror"]["state"] == "ok"  # lookups read it
        ps.update(torch.tensor([5, 500]), torch.zeros(2, 4))
        got, found = _same(ps, torch.tensor([5, 500, 6]))
        assert found.tolist() == [True, False, True] and got[0].sum() == 0
        assert _header(store, "t")[loops.GEN] == hdr[loops.GEN] + 2


def test_a_writer_killed_inside_its_write_leaves_lookups_right_and_is_repaired(
        store: Path) -> None:
    """A process inside the mirror's update after its LMDB commit (GEN odd) is SIGKILLed:
    lookups here read LMDB meanwhile (and see the row it committed, which the mirror never
    got); the next write finds GEN odd under the lock and rebuilds the mirror first;
    lookups then read the mirror again."""
    with psclient.connect(_url(store), table="k", dim=4) as ps:
        ps.insert(torch.arange(50), torch.ones(50, 4))
        ctx = mp.get_context("spawn")
        held = ctx.Event()
        child = ctx.Process(target=mirror_writer_held, args=(_url(store), "k", held))
        child.start()
        try:
            assert held.wait(60), "the writer did not reach its write"
            assert _header(store, "k")[loops.GEN] % 2 == 1
            got, found = ps.lookup(torch.tensor([1, 77, HELD_KEY]))  # LMDB's rows
            assert found.tolist() == [True, False, True] and torch.equal(got[0], torch.ones(4))
            assert torch.equal(got[2], torch.full((4,), 3.0))
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.join(10)
        ps.insert(torch.tensor([77]), torch.full((1, 4), 2.0))  # the lock is free
        hdr = _header(store, "k")
        # rebuilt from LMDB (the killed writer's row too), then the write
        assert hdr[loops.GEN] % 2 == 0 and hdr[loops.STATE] == 0 and hdr[loops.COUNT] == 52
        assert ps.stat()["mirror"]["state"] == "ok"
        got, found = _same(ps, torch.tensor([1, 77, 78, HELD_KEY]))
        assert found.tolist() == [True, True, False, True] and got[1, 0] == 2.0


def test_a_write_that_bypassed_psclient_is_seen_after_reopening(store: Path) -> None:
    with psclient.connect(_url(store), table="raw", dim=2) as ps:
        ps.insert(torch.tensor([1, 2]), torch.ones(2, 2))
    inode = os.stat(store / "rows.raw.nvidx").st_ino
    env = lmdb.open(str(store), max_dbs=8, subdir=True, create=False)
    try:
        db = env.open_db(b"rows:raw", create=False)
        with env.begin(write=True, db=db) as txn:
            txn.put(be_key_bytes(np.array([3], dtype=np.int64))[0],
                    torch.full((2,), 5.0).numpy().tobytes())
            txn.delete(be_key_bytes(np.array([1], dtype=np.int64))[0])
    finally:
        env.close()
    with psclient.connect(_url(store), table="raw") as ps:
        got, found = _same(ps, torch.tensor([1, 2, 3]))
        assert found.tolist() == [False, True, True] and got[2, 0] == 5.0
    assert os.stat(store / "rows.raw.nvidx").st_ino != inode  # rebuilt


def test_a_mirror_from_another_boot_is_rebuilt(store: Path) -> None:
    """Page-cache writes lost in a machine crash leave no trace in the file: a mirror
    written before the machine restarted is never trusted."""
    with psclient.connect(_url(store), table="boot", dim=2) as ps:
        ps.insert(torch.tensor([1, 2]), torch.ones(2, 2))
    path = store / "rows.boot.nvidx"
    words = np.memmap(path, dtype=np.int64, mode="r+", shape=(loops.HEADER_WORDS,))
    words[loops.BOOT0] ^= 1
    words[loops.COUNT] = 7  # what a lost write could leave
    words.flush()
    del words
    inode = os.stat(path).st_ino
    with psclient.connect(_url(store), table="boot") as ps:
        _same(ps, torch.tensor([1, 2, 3]))
    assert os.stat(path).st_ino != inode and _header(store, "boot")[loops.COUNT] == 2


@pytest.mark.parametrize("n", [256, 4 * 2048])
def test_threads_writing_and_reading_through_one_handle_see_whole_batches(
        store: Path, n: int) -> None:
    """Writers on several threads (the per-process lock orders them before the flock);
    every lookup sees each row whole and every batch from one commit (also a batch large
    enough to be read by several threads at once, nvecache.common.fanout)."""
    with psclient.connect(_url(store), table="thr", dim=8) as ps:
        ps.insert(torch.arange(n), torch.zeros(n, 8))
        stop = threading.Event()
        errors: list[str] = []

        def write(first: int) -> None:
            i = first
            while not stop.is_set():
                ps.insert(torch.arange(n), torch.full((n, 8), float(i)))
                i += 2

        def read() -> None:
            for _ in range(300 if n <= 256 else 60):
                got, found = ps.lookup(torch.arange(n))
                if not bool(found.all()) or got.unique().numel() != 1:
                    errors.append("a lookup mixed two writes")
                    return

        writers = [threading.Thread(target=write, args=(s,)) for s in (0, 1)]
        readers = [threading.Thread(target=read) for _ in range(2)]
        for t in writers + readers:
            t.start()
        for t in readers:
            t.join(120)
        stop.set()
        for t in writers:
            t.join(60)
        assert errors == []
        assert _header(store, "thr")[loops.GEN] % 2 == 0


def test_mirror_false_keeps_lmdb_alone(store: Path) -> None:
    with psclient.connect(_url(store, mirror="false"), table="plain", dim=2) as ps:
        ps.insert(torch.tensor([4]), torch.ones(1, 2))
        assert ps.lookup(torch.tensor([4, 5]))[1].tolist() == [True, False]
    assert not (store / "rows.plain.nvidx").exists()
    with pytest.raises(psclient.BadArgumentError, match="mirror"):
        psclient.connect(_url(store, mirror="maybe"), table="plain")


def test_drop_removes_the_mirror_and_other_handles_stop_reading_it(store: Path) -> None:
    other = psclient.connect(_url(store), table="gone", dim=2)
    ps = psclient.connect(_url(store), table="gone")
    ps.insert(torch.tensor([1]), torch.ones(1, 2))
    assert other.lookup(torch.tensor([1]))[1].tolist() == [True]
    ps.drop()
    assert not (store / "rows.gone.nvidx").exists()
    with pytest.raises(psclient.TableDroppedError):  # LMDB's answer: the mirror is not read
        other.lookup(torch.tensor([1]))
    other.close()


def test_a_bulk_load_sizes_the_mirror_once_and_stat_shows_it(
        store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from psclient.file.mirror import RowMirror

    published = []
    publish = RowMirror._publish
    monkeypatch.setattr(RowMirror, "_publish",
                        lambda self, new: (published.append(1), publish(self, new)))
    rows = torch.randn(5000, 4)
    with psclient.connect(_url(store), table="bulk", dim=4) as ps:
        published.clear()  # NOTE: the empty mirror built at creation
        assert ps.load(rows, batch_size=512, progress=False) == 5000
        assert len(published) == 1  # one growth for the whole load, not one per doubling
        info = ps.stat()["mirror"]
        assert info["state"] == "ok" and info["keys"] == 5000
        assert info["row_capacity"] >= 5000 and info["file_bytes"] > 5000 * 16
        got, found = _same(ps, torch.arange(-1, 5001))
        assert found.sum() == 5000 and torch.equal(got[1:5001], rows)
    with psclient.connect(_url(store, mirror="false"), table="bulk") as ps:
        assert ps.stat()["mirror"] is None


def test_a_write_that_fails_after_its_commit_leaves_lookups_right(
        store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An insert that raises between LMDB's commit and the mirror's update (here: the
    rows' conversion, made to fail): the mirror is marked stale, lookups read LMDB (which
    has the rows), and the next write rebuilds it."""
    import psclient.file.backend as fb

    with psclient.connect(_url(store), table="late", dim=2) as ps:
        ps.insert(torch.tensor([1]), torch.ones(1, 2))

        def broken(values: torch.Tensor) -> np.ndarray:
            raise RuntimeError("after the commit")

        # NOTE: fault injection: no public seam fails a write between its commit and the
        # mirror's update
        with monkeypatch.context() as patch:
            patch.setattr(fb, "_raw_rows", broken)
            with pytest.raises(RuntimeError, match="after the commit"):
                ps.insert(torch.tensor([2]), torch.full((1, 2), 2.0))
        assert _header(store, "late")[loops.STATE] == 1  # STALE
        got, found = ps.lookup(torch.tensor([1, 2]))
        assert found.tolist() == [True, True] and got[1, 0] == 2.0
        ps.update(torch.tensor([1]), torch.zeros(1, 2))  # rebuilds, then writes
        hdr = _header(store, "late")
        assert hdr[loops.STATE] == 0 and hdr[loops.GEN] % 2 == 0 and hdr[loops.COUNT] == 2
        _same(ps, torch.tensor([1, 2, 3]))
