"""The bulk read of HMGET replies against redis-py's parser, on real servers.

The bulk read needs redis-py's private ``conn._sock`` (psclient.redis.wire.bulk_socket):
these tests pin it, so a redis-py release that moves it fails here instead of silently
taking the slower path, and they show that the public path it falls back to gives the
same replies.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import hiredis
import numpy as np
import pytest
import redis
import redis.exceptions as rex

from psclient.redis import resp
from psclient.redis.wire import (
    bulk_socket,
    reply_error,
    run_pipeline,
    run_row_pipeline,
    stream_row_pipeline,
)

pytestmark = pytest.mark.redis

ROW = 16


@pytest.fixture
def client(shared_redis: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(shared_redis, socket_timeout=5)
    yield c
    c.close()


def hmget(key: bytes, keys: list[int]) -> list[bytes | memoryview]:
    """One encoded ``HMGET key field...`` with int64 fields, as the backend encodes it."""
    head = resp.header(2 + len(keys), b"HMGET", key)
    return [head, resp.as_buffer(resp.field_records(np.array(keys, dtype=np.int64)))]


def as_rows(reply: Any) -> Any:
    """A reply of either path as a list of ``bytes | None`` (errors as their message)."""
    if isinstance(reply, np.ndarray):
        return [r.tobytes() for r in reply]
    if isinstance(reply, Exception):
        return str(reply)
    return list(reply)


def test_a_live_connection_exposes_its_socket(shared_redis: str, unix_redis: str,
                                              tls_redis: tuple[str, str]) -> None:
    """The pin: redis-py keeps each kind of connection's socket where bulk_socket reads it."""
    tls_url, ca = tls_redis
    for c in (redis.Redis.from_url(shared_redis), redis.Redis.from_url(unix_redis),
              redis.Redis.from_url(tls_url, ssl_ca_certs=ca)):
        conn = c.connection_pool.get_connection()
        try:
            assert isinstance(bulk_socket(conn), socket.socket), type(conn)
        finally:
            c.connection_pool.release(conn)
            c.close()


@pytest.mark.parametrize("expect", [1, 1 << 20])  # a buffer grown while reading, or not
def test_bulk_read_and_parser_give_the_same_replies(client: redis.Redis, table_name: str,
                                                    expect: int) -> None:
    key = f"wire:{table_name}".encode()
    rows = {k: bytes([k]) * ROW for k in range(100)}
    client.hset(key, mapping={np.int64(k).tobytes(): v for k, v in rows.items()})
    client.hset(key, np.int64(77).tobytes(), b"short")
    cmds = [list(range(50)),                     # every key found: a row view
            list(range(50, 60)) + [1000, 1001],  # misses
            [70, 77, 78],                        # a value of another length
            list(range(80, 100))]                # found again, after the irregular reply
    payload = [part for ks in cmds for part in hmget(key, ks)]
    try:
        bulk = run_row_pipeline(client, payload, len(cmds), expect, ROW)
        parsed = run_row_pipeline(client, payload, len(cmds), expect, ROW, bulk=False)
    finally:
        client.delete(key)
    assert isinstance(bulk[0], np.ndarray), "the bulk read was not taken"
    assert all(isinstance(p, list) for p in parsed)
    assert [as_rows(r) for r in bulk] == [as_rows(r) for r in parsed]
    assert as_rows(bulk[0]) == [rows[k] for k in range(50)]
    assert as_rows(bulk[1])[-2:] == [None, None]
    assert as_rows(bulk[2])[1] == b"short"


@pytest.mark.parametrize("expect", [1, 1 << 20])  # a buffer grown while feeding, or not
def test_streamed_replies_equal_the_collected_ones(client: redis.Redis, table_name: str,
                                                  expect: int) -> None:
    """stream_row_pipeline hands every command's reply to the sink once, in order, the same
    replies as run_row_pipeline: row views as they arrive (the buffer may grow between
    them), then what hiredis decoded."""
    key = f"wire-stream:{table_name}".encode()
    rows = {k: bytes([k % 251]) * ROW for k in range(3000)}
    client.hset(key, mapping={np.int64(k).tobytes(): v for k, v in rows.items()})
    client.hset(key, np.int64(2500).tobytes(), b"short")
    # NOTE: 2,400 found keys first (many receives, fed one by one), then irregular replies
    cmds = [list(range(a, a + 200)) for a in range(0, 2400, 200)]
    cmds += [[1, 5000, 2], [2500, 3], list(range(2600, 2700))]
    payload = [part for ks in cmds for part in hmget(key, ks)]
    got: list[tuple[int, Any]] = []
    kinds: list[bool] = []

    def sink(i: int, reply: Any) -> None:
        kinds.append(isinstance(reply, np.ndarray))
        got.append((i, as_rows(reply)))  # NOTE: copies a view out before returning

    try:
        stream_row_pipeline(client, payload, len(cmds), expect, ROW, sink)
        collected = run_row_pipeline(client, payload, len(cmds), expect, ROW)
        want = [as_rows(r) for r in collected]
    finally:
        client.delete(key)
    assert [i for i, _ in got] == list(range(len(cmds)))
    assert [r for _, r in got] == want
    assert kinds == [True] * 12 + [False] * 3, "the fast replies were not streamed"
    assert want[0] == [rows[k] for k in range(200)]
    assert want[12] == [rows[1], None, rows[2]] and want[13] == [b"short", rows[3]]


def test_a_reply_is_handed_over_before_the_rest_arrives(client: redis.Redis,
                                                       table_name: str) -> None:
    """The point of streaming: a command's rows reach the sink while the server still
    works on later commands (here a BLPOP that times out after 0.4 s on the server)."""
    key = f"wire-early:{table_name}".encode()
    client.hset(key, mapping={np.int64(k).tobytes(): bytes([k]) * ROW for k in range(50)})
    payload = [*hmget(key, list(range(50))),
               resp.pack("BLPOP", f"wire-early-list:{table_name}", "0.4"),
               *hmget(key, [1, 2])]
    seen: dict[int, float] = {}

    def sink(i: int, reply: Any) -> None:
        seen[i] = time.monotonic()

    try:
        stream_row_pipeline(client, payload, 3, 1, ROW, sink)
        end = time.monotonic()
    finally:
        client.delete(key)
    assert sorted(seen) == [0, 1, 2]
    assert end - seen[0] > 0.3, "the first reply waited for the whole pipeline"


def test_a_sink_that_raises_leaves_the_connection_in_sync(client: redis.Redis,
                                                          table_name: str) -> None:
    """A sink failing mid-read (replies still unread) drops that connection: the next
    pipeline on the client reads its own replies, not the rest of these. (redis-py's pool
    would also refuse to hand out a connection with unread bytes: two guards.)"""
    key = f"wire-raise:{table_name}".encode()
    client.hset(key, mapping={np.int64(k).tobytes(): bytes(ROW) for k in range(500)})
    cmds = [list(range(a, a + 50)) for a in range(0, 500, 50)]
    payload = [part for ks in cmds for part in hmget(key, ks)]

    def sink(i: int, reply: Any) -> None:
        raise RuntimeError(f"sink refused reply {i}")

    try:
        with pytest.raises(RuntimeError, match="refused reply 0"):
            stream_row_pipeline(client, payload, len(cmds), 1, ROW, sink)
        assert run_pipeline(client, [resp.pack("ECHO", b"in-sync")], 1) == [b"in-sync"]
        assert len(run_row_pipeline(client, payload, len(cmds), 1, ROW)) == len(cmds)
    finally:
        client.delete(key)


def test_an_interrupt_mid_read_drops_the_connection(client: redis.Redis,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A KeyboardInterrupt (Ctrl-C) while a pipeline's replies are read leaves replies
    unread: that connection is dropped, so the next command reads its own reply, not one
    of these (as a load interrupted mid-write withdraws from its table next)."""
    real = redis.connection.AbstractConnection.read_response
    calls = 0

    def interrupted(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:  # NOTE: the fault: Ctrl-C arrives after the first reply was read
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    payload = [resp.pack("ECHO", b"reply-%d" % i) for i in range(20)]
    assert client.ping()  # NOTE: the pool's connection is made (its handshake read) first
    monkeypatch.setattr(redis.connection.AbstractConnection, "read_response", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_pipeline(client, payload, len(payload))
    monkeypatch.undo()
    assert run_pipeline(client, [resp.pack("ECHO", b"in-sync")], 1) == [b"in-sync"]
    assert client.echo(b"mine") == b"mine"


def test_error_reply_on_both_paths(client: redis.Redis, table_name: str) -> None:
    """A command that fails: the bulk read returns the error reply, the parser raises it;
    the connection stays in sync either way (the next pipeline reads its own replies)."""
    key = f"wire:{table_name}".encode()
    client.set(key, b"not a hash")
    payload = hmget(key, [1, 2])
    try:
        bulk = run_row_pipeline(client, payload, 1, 64, ROW)
        assert isinstance(bulk[0], hiredis.ReplyError)
        err = reply_error(bulk[0])
        assert type(err) is rex.ResponseError and "WRONGTYPE" in str(err)
        with pytest.raises(rex.ResponseError, match="WRONGTYPE"):
            run_row_pipeline(client, payload, 1, 64, ROW, bulk=False)
        assert run_pipeline(client, [resp.pack("ECHO", b"in-sync")], 1) == [b"in-sync"]
    finally:
        client.delete(key)


def test_reply_error_maps_cluster_redirections() -> None:
    assert isinstance(reply_error(hiredis.ReplyError("MOVED 12 127.0.0.1:7001")),
                      rex.MovedError)
    assert isinstance(reply_error(hiredis.ReplyError("ASK 12 127.0.0.1:7001")), rex.AskError)
    assert isinstance(reply_error(hiredis.ReplyError("NOAUTH Authentication required.")),
                      rex.AuthenticationError)
