"""Loads into a new table, and drops, racing each other in real processes.

Whatever the timing: a load that reports success has every row in a listed, ready table;
a table being loaded is listed (``psclient ls``, with its loads) and ``psclient drop``
removes it; a write racing a drop is refused with a typed error (never a raw LMDB one) and
never re-creates the dropped table's data; nothing is left under a name that has no table.
The tests wait on what the store shows (a row written) or on what a process prints, never
on sleeps; the creating load is interrupted with a real SIGINT.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest
import redis
import torch

import psclient
from psclient.cli import main
from psclient.schema import TableSchema
from tests.servers import wait_until

ROOT = Path(__file__).resolve().parents[3]
#: the joining load's keys start here (the creating load's are 0, 1, ...)
J0 = 1_000_000
#: partitions of a table on one Redis server (psclient's default)
PARTS = 64


class Peek:
    """Raw looks at a store beside psclient: a row of a key, and what is left of a table
    name that has no schema. (file://: opens LMDB itself, so only while this process holds
    no psclient handle of the store.)"""

    def __init__(self, url: str) -> None:
        self.url = url
        self.path = url.removeprefix("file://") if url.startswith("file://") else None
        if self.path is None:
            self.r = redis.Redis.from_url(url)

    def _env(self) -> Any:
        return lmdb.open(self.path, readonly=True, max_dbs=16, create=False, subdir=True)

    @staticmethod
    def _begin(env: Any) -> Any:
        """A read transaction; a load that grew the map since ``env`` opened it
        (MDB_MAP_RESIZED) is adopted first, as LMDB asks (``set_mapsize(0)``)."""
        try:
            return env.begin()
        except lmdb.MapResizedError:
            env.set_mapsize(0)
            return env.begin()

    def has_row(self, table: str, key: int) -> bool:
        if self.path is None:
            pipe = self.r.pipeline(transaction=False)
            for p in range(PARTS):
                pipe.hexists(f"psc:{{{table}:{p}}}", int(key).to_bytes(8, "little", signed=True))
            return any(pipe.execute())
        if not os.path.exists(os.path.join(self.path, "data.mdb")):
            return False
        env = self._env()
        try:
            with self._begin(env) as txn:
                name = b"rows:" + table.encode()
                if txn.get(name) is None:
                    return False
                db = env.open_db(name, txn=txn, create=False)
                return txn.get((key + (1 << 63)).to_bytes(8, "big"), db=db) is not None
        finally:
            env.close()

    def leftovers(self, table: str) -> list[str]:
        """Keys, records and files of ``table`` when it has no schema (none when it has)."""
        if self.path is None:
            own = re.compile(rf"psc:\{{{re.escape(table)}(:\d+)?\}}.*")
            keys = sorted(k.decode() for k in self.r.scan_iter(match=f"psc:{{{table}*")
                          if own.fullmatch(k.decode()))
            return [] if f"psc:{{{table}}}:schema" in keys else keys
        if not os.path.exists(os.path.join(self.path, "data.mdb")):
            return []
        env = self._env()
        try:
            with self._begin(env) as txn:
                keys = [k.decode() for k, _ in txn.cursor()
                        if k.decode().split(":")[-1] == table]
        finally:
            env.close()
        if f"psc:schema:{table}" in keys:
            return []
        return keys + [f for f in os.listdir(self.path) if f == f"rows.{table}.nvidx"]


@pytest.fixture(params=["file", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path, table_name: str
          ) -> Iterator[tuple[str, Peek]]:
    """A store URL (a fresh file:// one, or the suite's Redis) and a Peek at it; whatever of
    the test's table is left is removed afterwards."""
    url = f"file://{tmp_path}/store" if request.param == "file" else \
        str(request.getfixturevalue("shared_redis"))
    yield url, Peek(url)
    try:
        with psclient.connect(url, table=table_name, partial=True) as ps:
            ps.drop()
    except psclient.PSClientError:
        pass
    try:
        psclient.drop_orphans(url, table_name)
    except psclient.PSClientError:
        pass


def _rows(d: Path, name: str, n: int, first: int) -> tuple[np.ndarray, Path]:
    """Random rows in ``name.npy``, their keys ``first..`` in ``name-keys.npy``."""
    rows = np.random.default_rng(first).standard_normal((n, 4), dtype=np.float32)
    np.save(d / f"{name}.npy", rows)
    np.save(d / f"{name}-keys.npy", np.arange(first, first + n, dtype=np.int64))
    return rows, d / f"{name}.npy"


def _cli_load(url: str, table: str, rows: Path, batch: int) -> subprocess.Popen[str]:
    keys = rows.with_name(rows.stem + "-keys.npy")
    cmd = [sys.executable, "-m", "psclient.cli", "load", url, "--table", table, str(rows),
           "--batch-size", str(batch), "--no-progress"]
    if keys.exists():
        cmd += ["--keys", str(keys)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _worker(kind: str, url: str, table: str, count: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.psclient.load_workers", kind, url, table, str(count)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _end(*procs: subprocess.Popen[str]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(60)


def _ls(url: str, capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    capsys.readouterr()
    assert main(["ls", url, "--json"]) == 0
    rows: list[dict[str, Any]] = json.loads(capsys.readouterr().out)
    return rows


@pytest.mark.parametrize("other_done_first", [False, True],
                         ids=["other-load-still-writing", "other-load-done"])
def test_an_interrupted_creator_leaves_the_table_to_the_other_load(
        store: tuple[str, Peek], table_name: str, tmp_path: Path, other_done_first: bool,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Two `psclient load`s into one new table; the one that created it gets SIGINT while
    the other is writing (or after the other reported success): the other's rows are all in
    the table, which is listed and ready."""
    url, peek = store
    # NOTE: the creating load is long (30,000 small batches): it is interrupted early on
    np.save(tmp_path / "creator.npy", np.ones((1_500_000, 4), dtype=np.float32))
    other, other_rows = _rows(tmp_path, "other", 20_000, J0)
    creator = _cli_load(url, table_name, tmp_path / "creator.npy", 50)
    procs = [creator]
    try:
        wait_until(lambda: peek.has_row(table_name, 0), 120, "the creating load's first rows")
        joiner = _cli_load(url, table_name, other_rows, 200)
        procs.append(joiner)
        if other_done_first:
            j_out, j_err = joiner.communicate(timeout=300)
        else:
            wait_until(lambda: peek.has_row(table_name, J0), 120, "the other load's first rows")
        assert creator.poll() is None, "the creating load ended before the signal"
        creator.send_signal(signal.SIGINT)
        _, c_err = creator.communicate(timeout=120)
        if not other_done_first:
            j_out, j_err = joiner.communicate(timeout=300)
    finally:
        _end(*procs)
    assert creator.returncode == 130 and c_err.endswith("psclient: error: interrupted\n"), c_err
    assert joiner.returncode == 0, j_err
    assert f"loaded {len(other)} rows into {table_name}" in j_out
    [entry] = [r for r in _ls(url, capsys) if r["table"] == table_name]
    assert (entry["state"], entry["loads"]) == ("ready", [])
    with psclient.connect(url, table=table_name) as ps:  # a reader: the table is published
        got, found = ps.lookup(torch.arange(J0, J0 + len(other)))
        assert found.all() and torch.equal(got, torch.from_numpy(other))
        assert ps.size() >= len(other) + 50  # and the creator's rows written before Ctrl-C


def test_the_last_load_to_end_publishes_the_table(
        store: tuple[str, Peek], table_name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A load that joined a loading table and ends first leaves it loading (the other load
    still writes it: readers still wait); the creator's end publishes it."""
    url, _ = store
    creator = _worker("loader", url, table_name, 3)
    joiner = None
    try:
        assert creator.stdout is not None and creator.stdin is not None
        assert creator.stdout.readline() == "wrote 0\n"
        joiner = _worker("loader", url, table_name, 2)
        out, _ = joiner.communicate("\n\n", timeout=120)
        assert joiner.returncode == 0 and out.endswith("loaded 128\n"), out
        [entry] = [r for r in _ls(url, capsys) if r["table"] == table_name]
        assert entry["state"] == "loading"
        assert [x["pid"] for x in entry["loads"]] == [creator.pid]
        with pytest.raises(psclient.TableLoadingError, match=f"pid {creator.pid} on "):
            psclient.connect(url, table=table_name)
        out, _ = creator.communicate("\n\n", timeout=120)
        assert creator.returncode == 0 and out.endswith("loaded 192\n"), out
    finally:
        _end(creator, *([joiner] if joiner is not None else []))
    [entry] = [r for r in _ls(url, capsys) if r["table"] == table_name]
    assert (entry["state"], entry["rows"]) == ("ready", 192)
    with psclient.connect(url, table=table_name) as ps:
        got, found = ps.lookup(torch.tensor([0, 64, 128, 191]))
        assert found.all() and got[:, 0].tolist() == [0.0, 1.0, 2.0, 2.0]


def test_ls_stat_and_drop_of_a_table_being_loaded(
        store: tuple[str, Peek], table_name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """While a load is registered (between its writes): ls and stat show the table
    `loading` by that process, readers and plain writers are refused saying so, drop
    removes it, and the load's next write fails with a typed error."""
    url, peek = store
    loader = _worker("loader", url, table_name, 5)
    try:
        assert loader.stdout is not None and loader.stdin is not None
        assert loader.stdout.readline() == "wrote 0\n"
        [entry] = [r for r in _ls(url, capsys) if r["table"] == table_name]
        assert (entry["state"], entry["rows"]) == ("loading", 64)
        assert [(x["pid"], x["host"], x["running"]) for x in entry["loads"]] == [
            (loader.pid, socket.gethostname(), True)]
        assert main(["ls", url]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if table_name in x)
        assert f"loading (pid {loader.pid} on {socket.gethostname()} since " in line
        assert main(["stat", url, "--table", table_name, "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        assert (info["state"], info["rows"], info["loads"][0]["pid"]) == ("loading", 64,
                                                                          loader.pid)
        for dim in (None, 4):  # a reader, and a writer that is not a load
            with pytest.raises(psclient.TableLoadingError, match="is being loaded") as e:
                psclient.connect(url, table=table_name, dim=dim)
            assert e.value.loads[0]["pid"] == loader.pid
        assert main(["drop", url, "--table", table_name]) == 0
        assert capsys.readouterr().out.startswith(
            f"dropped table {table_name} (64 rows, loading (pid {loader.pid}")
        assert [r for r in _ls(url, capsys) if r["table"] == table_name] == []
        out, _ = loader.communicate("\n", timeout=120)  # its next chunk meets no table
    finally:
        _end(loader)
    assert loader.returncode == 3, out
    assert out.startswith("error TableDroppedError: ") and "was dropped" in out, out
    assert "LMDB" not in out and "MDB_" not in out
    assert peek.leftovers(table_name) == []


def test_an_interrupted_load_alone_drops_the_table_it_created(
        store: tuple[str, Peek], table_name: str) -> None:
    url, peek = store
    loader = _worker("loader", url, table_name, 5)
    try:
        assert loader.stdout is not None
        assert loader.stdout.readline() == "wrote 0\n"
        assert peek.has_row(table_name, 0)
        loader.send_signal(signal.SIGINT)
        loader.communicate(timeout=120)
    finally:
        _end(loader)
    assert loader.returncode != 0
    assert table_name not in psclient.list_tables(url)
    assert peek.leftovers(table_name) == []


def test_a_write_racing_a_drop_is_refused_and_recreates_nothing(
        store: tuple[str, Peek], table_name: str, capsys: pytest.CaptureFixture[str]) -> None:
    url, peek = store
    writer = _worker("writer", url, table_name, 3000)
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline() == "wrote\n"
        assert main(["drop", url, "--table", table_name]) == 0
        out, _ = writer.communicate(timeout=120)
    finally:
        _end(writer)
    assert writer.returncode == 3 and out.startswith("error TableDroppedError: "), out
    assert table_name not in psclient.list_tables(url)
    assert peek.leftovers(table_name) == []


def _cluster_keys(url: str, table: str) -> list[str]:
    host, port = url.removeprefix("redis+cluster://").split(",")[0].split(":")
    client = redis.RedisCluster(host=host, port=int(port))
    try:
        return sorted(k.decode() for k in client.scan_iter(match=f"psc:{{{table}*"))
    finally:
        client.close()


def test_a_stale_handle_cannot_write_a_dropped_or_new_table(store_url: str,
                                                           table_name: str) -> None:
    """After a drop, every write of a handle opened before it is refused (TableDroppedError,
    nothing written, no partition re-created); nor does it write into a new table of the
    same name."""
    old = psclient.connect(store_url, table=table_name, dim=4)
    try:
        old.insert(torch.arange(100), torch.ones(100, 4))
        psclient.connect(store_url, table=table_name).drop()
        for write in (lambda: old.insert(torch.arange(10), torch.ones(10, 4)),
                      lambda: old.update(torch.arange(10), torch.ones(10, 4)),
                      lambda: old.erase(torch.arange(10)), old.clear):
            with pytest.raises(psclient.TableDroppedError, match="was dropped"):
                write()
        assert table_name not in psclient.list_tables(store_url)
        if store_url.startswith("redis+cluster://"):
            assert _cluster_keys(store_url, table_name) == []
        elif not store_url.startswith("file://"):
            assert Peek(store_url).leftovers(table_name) == []
        with psclient.connect(store_url, table=table_name, dim=4) as new:
            new.insert(torch.arange(10), torch.full((10, 4), 2.0))
            with pytest.raises(psclient.TableDroppedError):
                old.insert(torch.arange(100), torch.ones(100, 4))
            got, found = new.lookup(torch.arange(12))
            assert found.tolist() == [True] * 10 + [False] * 2 and (got[:10] == 2.0).all()
            assert new.size() == 10
            new.drop()
    finally:
        old.close()
    if store_url.startswith("file://"):
        assert Peek(store_url).leftovers(table_name) == []


def test_data_left_without_a_table_is_listed_and_dropped(
        store: tuple[str, Peek], table_name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """What an interrupted drop (or an older psclient's write racing a drop) left: rows of a
    table name that has no schema. ls lists it as orphaned, drop removes it."""
    url, peek = store
    with psclient.connect(url, table=table_name, dim=4) as ps:
        ps.insert(torch.arange(500), torch.ones(500, 4))
    if peek.path is None:
        peek.r.delete(f"psc:{{{table_name}}}:schema")
    else:
        env = lmdb.open(peek.path, max_dbs=16, subdir=True)
        with env.begin(write=True) as txn:
            txn.delete(f"psc:schema:{table_name}".encode())
        env.close()
    left = peek.leftovers(table_name)
    assert left
    assert table_name not in psclient.list_tables(url)
    [entry] = [r for r in _ls(url, capsys) if r["table"] == table_name]
    assert (entry["state"], entry["rows"], entry["keys"]) == ("orphaned", 500, len(left))
    assert main(["ls", url]) == 0
    assert "orphaned" in next(x for x in capsys.readouterr().out.splitlines()
                              if table_name in x)
    assert main(["drop", url, "--table", table_name]) == 0
    assert "orphaned data of table" in capsys.readouterr().out
    assert peek.leftovers(table_name) == []
    assert [r for r in _ls(url, capsys) if r["table"] == table_name] == []


def test_a_table_created_before_markers_opens_writes_and_drops(
        shared_redis: str, table_name: str) -> None:
    """A layout-2 table written by an older psclient (no existence markers, no "marked" in
    its schema record) reads and writes as before; once dropped, a handle opened before
    cannot re-create it."""
    url, r = shared_redis, redis.Redis.from_url(shared_redis)
    with psclient.connect(url, table=table_name, dim=4) as ps:
        ps.insert(torch.arange(100), torch.ones(100, 4))
        old = ps.schema
    r.set(f"psc:{{{table_name}}}:schema",  # NOTE: the record as an older psclient wrote it
          TableSchema(dim=4, dtype="float32", partitions=old.partitions,
                      created=old.created).encode())
    r.delete(*[f"psc:{{{table_name}:{p}}}:live" for p in range(old.partitions)])
    writer = psclient.connect(url, table=table_name)
    try:
        assert writer.lookup(torch.arange(100))[1].all()
        writer.insert(torch.arange(100, 200), torch.ones(100, 4))
        assert writer.size() == 200
        psclient.connect(url, table=table_name).drop()
        with pytest.raises(psclient.TableDroppedError):
            writer.insert(torch.arange(10), torch.ones(10, 4))
    finally:
        writer.close()
    assert Peek(url).leftovers(table_name) == []
