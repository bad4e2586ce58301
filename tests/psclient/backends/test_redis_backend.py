"""The Redis backend on real servers: the shared one, private ones, and a real cluster."""

from __future__ import annotations

import json
import multiprocessing as mp
import threading
import time

import numpy as np
import pytest
import redis
import torch
from hypothesis import HealthCheck, given, settings
from redis.cluster import ClusterNode, RedisCluster

import psclient
from psclient.cli import main
from psclient.codec import partition_of
from tests.psclient import model
from tests.psclient.conftest import RedisProc, opened_tables

pytestmark = pytest.mark.redis


@pytest.fixture
def ps_factory(shared_redis: str, table_name: str):  # noqa: ANN201
    """connect() to the shared server with a unique table; every table is dropped after."""
    with opened_tables(shared_redis, table_name) as make:
        yield make


@pytest.mark.parametrize(("inline_keys", "at_once_keys"), [(0, 64), (8192, 64), (8192, 0)])
@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=model.OPS)
def test_differential_against_dict(ps_factory, inline_keys: int, at_once_keys: int,  # noqa: ANN001
                                   ops: list) -> None:
    # tiny chunks: every batch spans several commands; inline_keys=0: several pipelines on
    # the pool too; 8192: one pipeline on this thread. at_once_keys=64: lookups' replies
    # (3 keys at most) read whole and decoded at once; 0: streamed command by command
    ps = ps_factory(f"-diff{inline_keys}-{at_once_keys}", dim=model.DIM, partitions=4,
                    chunk_keys=3, pipeline_keys=4, inline_keys=inline_keys,
                    at_once_keys=at_once_keys)
    model.check_against_dict(ps, ops)


@pytest.mark.parametrize("at_once_keys", [0, 64])
def test_a_small_lookup_over_many_partitions_reads_what_was_written(
        ps_factory, shared_redis: str, at_once_keys: int) -> None:  # noqa: ANN001
    """A hundred keys over 64 partitions (two a reply): found rows, misses among them and a
    wrong-length value give the same answers whether the replies are decoded at once or one
    by one."""
    ps = ps_factory(f"-small{at_once_keys}", dim=8, partitions=64, at_once_keys=at_once_keys)
    keys = torch.from_numpy(np.random.default_rng(1).choice(2**40, 120, replace=False))
    vals = torch.randn(120, 8)
    ps.insert(keys[:100], vals[:100])
    got, found = ps.lookup(keys[:100])
    assert found.all() and torch.equal(got, vals[:100])
    probe = torch.cat([keys[90:110], keys[:5]])  # 10 misses in the middle, duplicates
    got, found = ps.lookup(probe)
    assert found.tolist() == [True] * 10 + [False] * 10 + [True] * 5
    assert torch.equal(got[:10], vals[90:100]) and not got[10:20].any()
    assert torch.equal(got[20:], vals[:5])
    bad = int(keys[7])
    part = int(partition_of(np.array([bad], dtype=np.int64), 64)[0])
    r = redis.Redis.from_url(shared_redis)
    r.hset(f"psc:{{{ps.table}:{part}}}", np.int64(bad).tobytes(), b"short")
    r.close()
    with pytest.raises(psclient.CorruptValueError, match=rf"key {bad}.*5 bytes"):
        ps.lookup(keys[:100])


@pytest.mark.parametrize("inline_keys", [0, 8192])
def test_large_batch_round_trip_across_partitions_and_pipelines(ps_factory,  # noqa: ANN001
                                                                inline_keys: int) -> None:
    ps = ps_factory(dim=32, dtype=torch.float16, chunk_keys=100, pipeline_keys=700,
                    inline_keys=inline_keys)
    keys = torch.from_numpy(np.random.default_rng(0).choice(2**62, 5000, replace=False))
    keys[:3] = torch.tensor([-(2**63) + 1, 2**63 - 1, 0])
    vals = torch.randn(5000, 32).half()
    ps.insert(keys, vals)
    assert ps.size() == 5000
    probe = torch.cat([keys.flip(0), torch.tensor([12345678901])])
    got, found = ps.lookup(probe)
    assert found[:-1].all() and not found[-1]
    assert torch.equal(got[:-1], vals.flip(0)) and not got[-1].any()
    # duplicates in one batch: the last one wins, as in a dict
    dup = torch.tensor([keys[0].item()] * 3)
    ps.insert(dup, torch.stack([torch.full((32,), float(i)) for i in range(3)]).half())
    assert ps.lookup(dup[:1])[0][0, 0] == 2.0
    many = torch.full((250,), keys[1].item())       # spans three 100-key commands
    ps.insert(many, torch.arange(250, dtype=torch.float16)[:, None].expand(250, 32))
    assert ps.lookup(many[:1])[0][0, 0] == 249.0


def test_schema_stored_and_checked(ps_factory, shared_redis: str, table_name: str) -> None:  # noqa: ANN001
    ps = ps_factory(dim=8, dtype="bfloat16", partitions=16)
    with psclient.connect(shared_redis, table=table_name) as again:
        assert (again.dim, again.dtype, again.schema.partitions) == (8, torch.bfloat16, 16)
    with pytest.raises(psclient.SchemaMismatchError, match="dim=9"):
        psclient.connect(shared_redis, table=table_name, dim=9)
    with pytest.raises(psclient.SchemaMismatchError, match="dtype"):
        psclient.connect(shared_redis, table=table_name, dim=8, dtype=torch.float32)
    with pytest.raises(psclient.SchemaMismatchError, match="partitions"):
        psclient.connect(shared_redis, table=table_name, partitions=32)
    with pytest.raises(psclient.TableNotFoundError, match="pass dim"):
        psclient.connect(shared_redis, table=table_name + "-nope")
    with pytest.raises(psclient.BadArgumentError, match="unknown Redis option"):
        psclient.connect(shared_redis, table=table_name, sokcet_timeout=1)
    with pytest.raises(psclient.BadArgumentError, match="inline_keys must be >= 0"):
        psclient.connect(shared_redis, table=table_name, inline_keys=-1)
    with pytest.raises(psclient.BadArgumentError, match="at_once_keys must be >= 0"):
        psclient.connect(shared_redis, table=table_name, at_once_keys=-1)
    with pytest.raises(psclient.BadArgumentError, match="at_once_keys"):
        psclient.connect(f"{shared_redis}?at_once_keys=many", table=table_name)
    r = redis.Redis.from_url(shared_redis)
    r.set(f"psc:{{{ps.table}-bad}}:schema", b"\xc1 not msgpack")
    try:
        with pytest.raises(psclient.CorruptValueError, match="schema"):
            psclient.connect(shared_redis, table=ps.table + "-bad")
    finally:
        r.delete(f"psc:{{{ps.table}-bad}}:schema")


def test_wrong_length_value_names_table_and_key(ps_factory, shared_redis: str) -> None:  # noqa: ANN001
    ps = ps_factory(dim=4, partitions=8)
    keys = torch.tensor([10, 20, 30])
    ps.insert(keys, torch.ones(3, 4))
    part = int(partition_of(np.array([20], dtype=np.int64), 8)[0])
    r = redis.Redis.from_url(shared_redis)
    r.hset(f"psc:{{{ps.table}:{part}}}", np.int64(20).tobytes(), b"short")
    with pytest.raises(psclient.CorruptValueError, match=rf"{ps.table}.*key 20.*5 bytes"):
        ps.lookup(keys)
    ps.insert(torch.tensor([20]), torch.ones(1, 4))   # repaired by a rewrite
    assert ps.lookup(keys)[1].all()


def test_bad_arguments_write_nothing(ps_factory) -> None:  # noqa: ANN001
    ps = ps_factory(dim=4)
    with pytest.raises(psclient.BadKeysError):
        ps.insert(torch.tensor([1, 2], dtype=torch.int32), torch.zeros(2, 4))
    with pytest.raises(psclient.BadValuesError):
        ps.insert(torch.tensor([1, 2]), torch.zeros(2, 4, dtype=torch.float16))
    with pytest.raises(psclient.BadValuesError):
        ps.update(torch.tensor([1, 2]), torch.zeros(1, 4))
    assert ps.size() == 0


def test_cli_round_trip(shared_redis: str, table_name: str, tmp_path, capsys) -> None:  # noqa: ANN001
    np.save(tmp_path / "rows.npy", np.random.rand(300, 16).astype(np.float32))
    assert main(["load", shared_redis, "--table", table_name, str(tmp_path / "rows.npy"),
                 "--no-progress"]) == 0
    assert "loaded 300 rows" in capsys.readouterr().out
    assert main(["stat", shared_redis, "--table", table_name, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["rows"], info["dim"], info["dtype"], info["backend"]) == (300, 16, "float32",
                                                                           "redis")
    assert main(["drop", shared_redis, "--table", table_name]) == 0
    assert main(["stat", shared_redis, "--table", table_name]) == 1
    assert f"psclient: error: no table {table_name!r}" in capsys.readouterr().err


def test_fork_child_reads_through_parents_client(ps_factory) -> None:  # noqa: ANN001
    ps = ps_factory(dim=4)
    keys = torch.arange(2000)
    vals = torch.randn(2000, 4)
    ps.insert(keys, vals)
    assert ps.lookup(keys)[1].all()          # connections and pool threads exist now
    ctx = mp.get_context("fork")             # NOTE: this test is about fork on purpose
    q = ctx.Queue()

    def child() -> None:
        got, found = ps.lookup(keys)
        q.put(bool(found.all()) and bool(torch.equal(got, vals)))

    p = ctx.Process(target=child)
    p.start()
    assert q.get(timeout=20) is True
    p.join(20)
    assert p.exitcode == 0
    got, found = ps.lookup(keys)             # the parent's connections were not disturbed
    assert found.all() and torch.equal(got, vals)


def test_fork_child_and_parent_look_up_at_once(ps_factory) -> None:  # noqa: ANN001
    """A thread's lookup connection (psclient/redis/lane.py) is not the forked child's:
    both processes' lookups at the same time each get their own rows."""
    ps = ps_factory(dim=4)
    keys = torch.arange(512)
    vals = torch.randn(512, 4)
    ps.insert(keys, vals)
    assert ps.lookup(keys[:7])[1].all()      # NOTE: this thread holds its connection now
    ctx = mp.get_context("fork")             # NOTE: this test is about fork on purpose
    q = ctx.Queue()
    go = ctx.Event()

    def child() -> None:
        go.wait(20)
        ok = True
        for i in range(200):
            sub = keys[(i * 37) % 500:][:1 + i % 12]
            got, found = ps.lookup(sub)
            ok = ok and bool(found.all()) and bool(torch.equal(got, vals[sub]))
        q.put(ok)

    p = ctx.Process(target=child)
    p.start()
    go.set()
    for i in range(200):
        sub = keys[(i * 53) % 500:][:1 + i % 9]
        got, found = ps.lookup(sub)
        assert found.all() and torch.equal(got, vals[sub])
    assert q.get(timeout=60) is True
    p.join(20)
    assert p.exitcode == 0


# -- private servers ----------------------------------------------------------------------


def test_auth_password_protected_server(auth_redis: RedisProc, table_name: str) -> None:
    bare = f"redis://127.0.0.1:{auth_redis.port}/0"
    with pytest.raises(psclient.PSAuthError, match="password"):
        psclient.connect(bare, table=table_name, dim=4)
    with pytest.raises(psclient.PSAuthError):
        psclient.connect(bare, table=table_name, dim=4, password="wrong")
    with psclient.connect(bare, table=table_name, dim=4, password="s3cret-pw") as ps:
        ps.insert(torch.tensor([1]), torch.ones(1, 4))
    with psclient.connect(auth_redis.url, table=table_name) as ps:   # password in the URL
        assert ps.lookup(torch.tensor([1]))[1].all()


def test_tls_and_unix_socket_urls(tls_redis: tuple[str, str], unix_redis: str,
                                  table_name: str) -> None:
    url, ca = tls_redis
    keys = torch.arange(3000)
    vals = torch.randn(3000, 8)
    with psclient.connect(url, table=table_name, dim=8, ssl_ca_certs=ca) as ps:
        ps.insert(keys, vals)
        got, found = ps.lookup(keys)
        assert found.all() and torch.equal(got, vals)
    with pytest.raises(psclient.PSUnavailableError):   # plain TCP to a TLS-only port
        psclient.connect(url.replace("rediss://", "redis://"), table=table_name,
                         socket_timeout=0.5, retries=0)
    with psclient.connect(unix_redis, table=table_name, dim=8) as ps:
        ps.insert(keys, vals)
        got, found = ps.lookup(keys)
        assert found.all() and torch.equal(got, vals)


def test_outage_mid_batch_raises_typed_error_then_recovers(private_redis: RedisProc,
                                                           table_name: str) -> None:
    ps = psclient.connect(private_redis.url, table=table_name, dim=64, socket_timeout=1.0,
                          socket_connect_timeout=0.5, retries=1, pipeline_keys=1024)
    keys = torch.arange(20000)
    vals = torch.randn(20000, 64)
    ps.insert(keys, vals)
    started = threading.Event()
    errors: list[BaseException] = []

    def hammer() -> None:
        try:
            while True:
                ps.insert(keys, vals)
                started.set()
        except BaseException as e:  # noqa: BLE001 -- the test inspects it
            errors.append(e)
            started.set()

    t = threading.Thread(target=hammer, daemon=True)
    t.start()
    assert started.wait(20)
    private_redis.kill()
    t.join(15)
    assert not t.is_alive(), "a write hung after the server died"
    assert len(errors) == 1 and isinstance(errors[0], psclient.PSUnavailableError), errors
    t0 = time.monotonic()
    with pytest.raises(psclient.PSUnavailableError):
        ps.lookup(keys[:10])
    assert time.monotonic() - t0 < 5, "the typed error must come within the timeouts"
    private_redis.start()                    # same port, data from the append-only file
    got, found = ps.lookup(keys)             # the same client object works again
    assert found.all() and torch.equal(got, vals)
    ps.insert(torch.tensor([-1]), torch.ones(1, 64))
    assert ps.lookup(torch.tensor([-1]))[1].all()
    ps.drop()


# -- cluster --------------------------------------------------------------------------------


def test_cluster_round_trip_spreads_over_every_master(redis_cluster: str,
                                                      table_name: str) -> None:
    with psclient.connect(redis_cluster, table=table_name, dim=16) as ps:
        assert ps.schema.partitions >= 3 * 8
        keys = torch.from_numpy(np.random.default_rng(1).choice(2**62, 3000, replace=False))
        vals = torch.randn(3000, 16)
        ps.insert(keys, vals)
        got, found = ps.lookup(torch.cat([keys, torch.tensor([-5])]))
        assert found[:-1].all() and not found[-1] and torch.equal(got[:-1], vals)
        assert ps.update(keys[:2], torch.zeros(2, 16)).all()
        _, cur = ps.changes()
        ps.erase(keys[:10])
        assert set(ps.changes(cur)[0].tolist()) == set(keys[:10].tolist())
        assert ps.size() == 2990
        assert ps.stat()["masters"] == 3
        # every master holds some of the table (partition p is the hash psc:{T:p})
        addrs = [hp.rpartition(":") for hp in
                 redis_cluster.removeprefix("redis+cluster://").split(",")]
        rc = RedisCluster(startup_nodes=[ClusterNode(h, int(p)) for h, _, p in addrs])
        try:
            part_keys = [f"psc:{{{table_name}:{p}}}" for p in range(ps.schema.partitions)]
            holders = {rc.get_node_from_key(k).name for k in part_keys if rc.exists(k)}
        finally:
            rc.close()
        assert len(holders) == 3
        ps.drop()


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=model.OPS)
def test_cluster_differential_against_dict(redis_cluster: str, table_name: str,
                                           ops: list) -> None:
    with psclient.connect(redis_cluster, table=table_name + "-d", dim=model.DIM) as ps:
        model.check_against_dict(ps, ops)


def test_cluster_small_lookups_from_threads_while_connections_are_killed(
        redis_cluster: str, table_name: str) -> None:
    """Small cluster lookups go out on each thread's own connection to every node, all
    nodes asked before any reply is read (psclient/redis/lookups.py): from four threads
    at once, with missing and repeated keys, while every node's client connections are
    killed again and again (an in-flight batch then takes the dispatcher's path, a killed
    idle one is made anew), every result is exact."""
    addrs = [hp.rpartition(":") for hp in
             redis_cluster.removeprefix("redis+cluster://").split(",")]
    nodes = [redis.Redis(host=h, port=int(p)) for h, _, p in addrs]
    with psclient.connect(redis_cluster, table=table_name, dim=8) as ps:
        keys = torch.arange(0, 4000, 2)  # NOTE: odd keys are missing
        vals = torch.randn(keys.numel(), 8)
        ps.insert(keys, vals)
        table = dict(zip(keys.tolist(), vals, strict=True))
        errors: list[str] = []
        start = threading.Barrier(5)

        def reader(seed: int) -> None:
            rng = np.random.default_rng(seed)
            start.wait(30)
            for _ in range(150):
                ask = torch.from_numpy(rng.integers(0, 4000, int(rng.integers(1, 200))))
                got, found = ps.lookup(ask)
                want = [k % 2 == 0 for k in ask.tolist()]
                if found.tolist() != want:
                    errors.append(f"found flags differ for {ask.tolist()}")
                    return
                for k, row, hit in zip(ask.tolist(), got, want, strict=True):
                    if not torch.equal(row, table[k] if hit else torch.zeros(8)):
                        errors.append(f"row of key {k} differs")
                        return

        threads = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        start.wait(30)
        killed = 0
        while any(t.is_alive() for t in threads):
            for node in nodes:
                killed += node.client_kill_filter(_type="normal", skipme=True)
            time.sleep(0.01)  # NOTE: pacing the kills, not waiting for a result
        for t in threads:
            t.join()
        assert not errors, errors[:3]
        assert killed > 0, "no connection was killed while the readers ran"
        got, found = ps.lookup(keys[:50])  # NOTE: after the kills, this thread too
        assert found.all() and torch.equal(got, vals[:50])
        ps.drop()
    for node in nodes:
        node.close()
