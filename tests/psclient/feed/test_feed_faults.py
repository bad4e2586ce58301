"""The Redis change feed under faults: a layout-1 table, a restart that loses the feed, and a
partition's slot resharded on the real 3-master cluster while a writer and a follower run."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

import psclient
from psclient.cli import main
from psclient.codec import partition_of
from psclient.schema import TableSchema
from tests.psclient.conftest import RedisProc
from tests.servers import needs_redis_server

pytestmark = pytest.mark.redis


def test_layout_1_table_is_refused_then_upgraded(shared_redis: str, table_name: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with psclient.connect(shared_redis, table=table_name, dim=2, partitions=4) as ps:
        ps.insert(torch.arange(10), torch.ones(10, 2))
    r = redis.Redis.from_url(shared_redis)
    key = f"psc:{{{table_name}}}:schema"
    v2 = TableSchema.decode(r.get(key), table_name)
    v1 = TableSchema(dim=2, dtype="float32", partitions=4, layout=1, created=v2.created)
    r.set(key, v1.encode())                                   # as layout 1 wrote it
    r.xadd(f"psc:{{{table_name}}}:changes", {"k": b"\0" * 8})
    try:
        with pytest.raises(psclient.SchemaMismatchError, match="psclient upgrade"):
            psclient.connect(shared_redis, table=table_name)
        assert main(["upgrade", shared_redis, "--table", table_name]) == 0
        assert "layout 2" in capsys.readouterr().out
        assert not r.exists(f"psc:{{{table_name}}}:changes")  # the layout-1 feed is gone
        with psclient.connect(shared_redis, table=table_name) as ps:
            assert ps.schema.layout == 2
            assert ps.lookup(torch.arange(10))[1].all()       # the rows stay
            with pytest.raises(psclient.ChangeFeedGapError):   # a layout-1 cursor: re-sync
                ps.follow("1700000000000-0")
    finally:
        psclient.connect(shared_redis, table=table_name).drop()
        r.close()


@needs_redis_server
def test_restart_without_persistence_is_a_gap(tmp_path: Path, table_name: str) -> None:
    srv = RedisProc(tmp_path / "volatile").start()             # no AOF, no RDB
    try:
        ps = psclient.connect(srv.url, table=table_name, dim=2, partitions=4)
        ps.insert(torch.arange(100), torch.zeros(100, 2))
        start = ps.follow().cursor
        ps.update(torch.arange(100), torch.ones(100, 2))
        read = ps.follow(start)
        assert read.keys.tolist() == list(range(100))          # a cache now holds the ones
        r = redis.Redis(port=srv.port)
        record = r.get(f"psc:{{{table_name}}}:schema")
        srv.kill()
        srv.start()                                            # empty: rows and feed are gone
        r.set(f"psc:{{{table_name}}}:schema", record)          # (say the schema survived)
        r.close()
        # the cursor is ahead of the (new, empty) streams
        with pytest.raises(psclient.ChangeFeedGapError, match="ahead"):
            ps.follow(read.cursor)                             # before any new write
        with pytest.raises(psclient.ChangeFeedGapError, match="ahead"):
            ps.follow(read.cursor, block_ms=100)
        ps.insert(torch.arange(100), torch.full((100, 2), 2.0))
        ps.update(torch.arange(100), torch.full((100, 2), 3.0))
        with pytest.raises(psclient.ChangeFeedGapError) as gap:    # after new writes too
            ps.follow(read.cursor)
        assert ps.follow(gap.value.cursor).keys.numel() == 0
        # a client that connects anew finds another table (the schema was lost too): a gap
        srv.kill()
        srv.start()
        ps2 = psclient.connect(srv.url, table=table_name, dim=2, partitions=4)
        with pytest.raises(psclient.ChangeFeedGapError, match="earlier table"):
            ps2.follow(read.cursor)
        ps.close()
        ps2.close()
    finally:
        srv.kill()


@needs_redis_server
def test_restart_before_any_notice_is_a_gap(tmp_path: Path, table_name: str) -> None:
    """Only new keys were written (no feed entry: every cursor is at 0-0), then a restart
    lost everything and another client wrote the table anew: the feed is empty again, yet a
    follower's cache holds rows of the lost table. The stored schema tells."""
    srv = RedisProc(tmp_path / "volatile").start()
    try:
        follower = psclient.connect(srv.url, table=table_name, dim=2, partitions=4)
        follower.insert(torch.arange(100), torch.zeros(100, 2))
        cur = follower.follow().cursor
        srv.kill()
        srv.start()
        with psclient.connect(srv.url, table=table_name, dim=2, partitions=4) as writer:
            writer.insert(torch.arange(100), torch.ones(100, 2))   # new keys: no notice
        with pytest.raises(psclient.ChangeFeedGapError, match="created anew") as gap:
            follower.follow(cur, block_ms=50)
        with psclient.connect(srv.url, table=table_name) as writer:
            writer.update(torch.arange(3), torch.full((3, 2), 2.0))
        assert follower.follow(gap.value.cursor).keys.tolist() == [0, 1, 2]   # followed on
        follower.close()
    finally:
        srv.kill()


def _move_slot(ports: list[int], slot: int, pause: float) -> tuple[int, int]:
    """Move ``slot`` to another master key by key (pausing between keys, so scripts meet a
    half-moved partition), as ``redis-cli --cluster reshard`` does. Returns (from, to) ports."""
    nodes = {p: redis.Redis(port=p, socket_timeout=5) for p in ports}
    try:
        ids = {p: c.execute_command("CLUSTER MYID").decode() for p, c in nodes.items()}
        # NOTE: the owner is the one node holding keys of the slot (the partition's 3 keys)
        src = next(p for p, c in nodes.items()
                   if c.execute_command("CLUSTER COUNTKEYSINSLOT", slot))
        dst = next(p for p in ports if p != src)
        nodes[dst].execute_command("CLUSTER SETSLOT", slot, "IMPORTING", ids[src])
        nodes[src].execute_command("CLUSTER SETSLOT", slot, "MIGRATING", ids[dst])
        while keys := nodes[src].execute_command("CLUSTER GETKEYSINSLOT", slot, 1):
            nodes[src].execute_command("MIGRATE", "127.0.0.1", dst, "", 0, 5000, "KEYS", *keys)
            time.sleep(pause)
        for c in (nodes[dst], nodes[src], *(c for p, c in nodes.items() if p not in (src, dst))):
            c.execute_command("CLUSTER SETSLOT", slot, "NODE", ids[dst])
        return src, dst
    finally:
        for c in nodes.values():
            c.close()


@pytest.mark.slow
def test_resharding_a_partition_loses_no_write_and_no_notice(redis_cluster: str,
                                                             table_name: str) -> None:
    ports = [int(hp.rpartition(":")[2])
             for hp in redis_cluster.removeprefix("redis+cluster://").split(",")]
    ps = psclient.connect(redis_cluster, table=table_name, dim=2, dtype=torch.float64,
                          partitions=8)
    follower = psclient.connect(redis_cluster, table=table_name)
    n = 4000
    keys = torch.arange(n)
    ps.insert(keys, torch.zeros(n, 2, dtype=torch.float64))
    part = 3
    mine = keys[torch.from_numpy(partition_of(keys.numpy(), 8) == part)]
    slot = int(redis.Redis(port=ports[0]).execute_command(
        "CLUSTER KEYSLOT", f"psc:{{{table_name}:{part}}}"))
    model = np.zeros(n)                    # version per key; -1: erased
    told: set[int] = set()
    errors: list[BaseException] = []
    stop = threading.Event()
    cursor = follower.follow().cursor

    def write() -> None:
        rng = np.random.default_rng(7)
        version = 0
        try:
            while not stop.is_set():
                version += 1
                pick = mine if rng.random() < 0.7 else keys
                k = pick[torch.from_numpy(rng.integers(0, pick.numel(), 50))].unique()
                if rng.random() < 0.15:
                    ps.erase(k)
                    model[k.numpy()] = -1
                else:
                    rows = torch.stack([k.double(), torch.full((k.numel(),), float(version),
                                                               dtype=torch.float64)], 1)
                    ps.insert(k, rows)
                    model[k.numpy()] = version
        except BaseException as e:  # noqa: BLE001 -- the test inspects it
            errors.append(e)

    def follow() -> None:
        nonlocal cursor
        try:
            while not stop.is_set():
                b = follower.follow(cursor, block_ms=200)
                told.update(b.keys.tolist())
                cursor = b.cursor
        except BaseException as e:  # noqa: BLE001 -- the test inspects it
            errors.append(e)

    threads = [threading.Thread(target=write), threading.Thread(target=follow)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        src, dst = _move_slot(ports, slot, pause=0.3)
        time.sleep(0.5)
        src2, dst2 = _move_slot(ports, slot, pause=0.0)        # and on again, at once
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors
    assert dst != src and dst2 != src2
    while True:                                                 # drain what is left
        b = follower.follow(cursor)
        told.update(b.keys.tolist())
        if b.keys.numel() == 0:
            break
        cursor = b.cursor
    rows, found = ps.lookup(keys)
    assert torch.equal(found, torch.from_numpy(model >= 0))
    assert torch.equal(rows[found, 1], torch.from_numpy(model[model >= 0]))
    changed = set(keys[torch.from_numpy(model != 0)].tolist())
    assert len(changed & set(mine.tolist())) > 50
    assert changed <= told, f"{len(changed - told)} changed keys never announced"
    ps.drop()
    ps.close()
    follower.close()
