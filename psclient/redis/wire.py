"""Pipelines of pre-encoded commands on one redis-py connection, and the bulk read of rows.

:mod:`psclient.redis.resp` encodes a batch's commands and decodes a run of HMGET replies from a
buffer; this module puts those bytes on the wire and gets the replies back:

- :func:`run_pipeline` sends pre-encoded commands (no MULTI) and reads one reply per
  command through redis-py's parser, with the client's ``redis.retry.Retry``.
- :func:`run_row_pipeline` does the same for HMGET commands, sent as one buffer, but follows
  them with ``ECHO <random token>`` and reads every reply off the socket in one go into a reused
  per-thread buffer, until the token's reply: :func:`psclient.redis.resp.decode_row_replies`
  then checks and views the rows with numpy, without one Python object per row. Why this
  read pays: see bench/RESULTS.md, "Parameter server clients".
  :func:`stream_row_pipeline` hands each reply over as soon as it is in;
  :func:`fetch_row_replies` hands over the undecoded bytes of all of them, for the caller
  to check and copy at once.

The bulk read needs the connection's socket, and redis-py (5.x to 8.x) has no public
accessor for it: :func:`bulk_socket` is the one place that reads the private attribute.
Where it is missing (another connection class, a future redis-py), the replies are read
through redis-py's public ``read_response`` instead: the same results, slower.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import redis.exceptions as rex

from psclient.redis import resp

_RECV = threading.local()  # per-thread receive buffer, reused between batches


def bulk_socket(conn: Any) -> socket.socket | None:
    """The socket to read a batch's replies from directly, or ``None`` to use redis-py's parser.

    Call it before sending: it connects ``conn`` if needed and returns ``None`` when the
    parser or the socket already holds bytes (reading the socket directly would skip them).

    NOTE: redis-py keeps a connection's socket in ``conn._sock`` (``Connection``,
    ``SSLConnection``, ``UnixDomainSocketConnection`` in 5.x-8.x; its own parsers read it
    there) and offers no public accessor. This is psclient's one use of a private redis-py
    attribute; tests/psclient/backends/test_redis_wire.py pins it (a live connection must expose a
    socket here, and both read paths must give the same replies), so a redis-py release that
    moves it fails that test instead of silently losing the bulk read.
    """
    if conn.can_read(timeout=0):  # public; connects first. Stale bytes: use the parser.
        return None
    return _socket_of(conn)


def idle_socket(conn: Any) -> socket.socket | None:
    """:func:`bulk_socket` of a connection kept out of the pool between batches
    (:mod:`psclient.redis.lane`): one readable while idle (closed by the server, or holding
    stale bytes) is made anew first, as the pool does with a connection it hands out."""
    if conn.can_read(timeout=0):  # public; connects first
        conn.disconnect()
        conn.connect()
    return _socket_of(conn)


def _socket_of(conn: Any) -> socket.socket | None:
    sock = getattr(conn, "_sock", None)  # NOTE: the private attribute (bulk_socket's note)
    return sock if isinstance(sock, socket.socket) else None


def read_replies(conn: Any, ncmds: int, keep: tuple[type[Exception], ...] = ()) -> list[Any]:
    """Read ``ncmds`` replies through redis-py's parser; raise the first error reply, except
    those of the ``keep`` types, which are returned in place.

    NOTE: every reply is read, errors included, so the connection stays in sync.
    """
    replies: list[Any] = []
    first_error: Exception | None = None
    for _ in range(ncmds):
        try:
            replies.append(conn.read_response())
        except rex.ResponseError as e:
            if not isinstance(e, keep):
                first_error = first_error or e
            replies.append(e)
    if first_error is not None:
        raise first_error
    return replies


@contextlib.contextmanager
def _released(pool: Any, conn: Any) -> Iterator[None]:
    """Hand ``conn`` back to ``pool`` after a pipeline; one whose replies were not all read
    (an error, or a KeyboardInterrupt between send and read) is disconnected first.

    NOTE: its unread replies would otherwise answer the next command sent on it.
    """
    try:
        yield
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def run_pipeline(client: Any, payload: list[bytes | memoryview], ncmds: int,
                 keep: tuple[type[Exception], ...] = ()) -> list[Any]:
    """Send pre-encoded commands on one connection and read ``ncmds`` replies (no MULTI).

    Error replies raise (the first one, after every reply was read), except those of the
    ``keep`` types (cluster redirections), which are returned in place.

    Retries follow the client's ``redis.retry.Retry`` (reconnecting between attempts); the
    commands are idempotent per key, so resending a batch is safe.
    """
    pool = client.connection_pool
    conn = pool.get_connection()

    def attempt() -> list[Any]:
        conn.send_packed_command(payload, check_health=True)
        return read_replies(conn, ncmds, keep)

    with _released(pool, conn):
        return conn.retry.call_with_retry(attempt, lambda _err: conn.disconnect())


def run_row_pipeline(client: Any, payload: list[bytes | memoryview], ncmds: int,
                     expect: int, row_bytes: int, *, bulk: bool = True) -> list[Any]:
    """Like :func:`run_pipeline` for HMGET commands, decoding rows without one object per row.

    Args:
        client: a ``redis.Redis`` (one node of a cluster included).
        payload: the encoded HMGET commands.
        ncmds: how many commands ``payload`` holds.
        expect: the bytes of all replies when every key is found (sizes the buffer).
        row_bytes: the length of a stored row.
        bulk: read the replies off the socket in one go (``False``: through redis-py's
            parser, the path taken anyway when :func:`bulk_socket` finds no socket).

    Returns:
        One entry per command, as :func:`psclient.redis.resp.decode_row_replies` returns them
        (a row view when every key was found with a value of ``row_bytes`` bytes), or a
        list of ``bytes | None`` from the parser.

    NOTE: row views point into this thread's receive buffer: copy them out before the
    thread's next call.
    """
    out: list[Any] = []
    _row_pipeline(client, payload, ncmds, expect, row_bytes, bulk, None, out)
    return out


def stream_row_pipeline(client: Any, payload: list[bytes | memoryview], ncmds: int,
                        expect: int, row_bytes: int, sink: Callable[[int, Any], object], *,
                        bulk: bool = True) -> None:
    """:func:`run_row_pipeline` that hands over each reply as soon as it can.

    ``sink(index, reply)`` gets every command's reply, in order: each reply on the fast
    path (a row view) as soon as its bytes are in, while the server still works on the
    next commands, so the caller copies rows out in parallel with it; the rest once every
    reply is in. A row view points into this thread's receive buffer: the sink copies it
    out before it returns (the buffer may then grow and move).

    After a connection error the pipeline is sent again (the client's ``Retry``) and the
    sink gets every reply again: it must accept a command's reply twice (a lookup does:
    the second overwrites the first).
    """
    _row_pipeline(client, payload, ncmds, expect, row_bytes, bulk, sink, [])


def fetch_row_replies(client: Any, payload: list[bytes | memoryview], ncmds: int,
                      expect: int, keep: tuple[type[Exception], ...] = ()
                      ) -> tuple[bytearray, int] | list[Any]:
    """Send HMGET commands and wait for all their replies, undecoded where it can.

    For many small replies (a few keys spread over many partitions), whose one-by-one
    decoding costs more than overlapping it with the server's work gains: the caller
    checks and copies every row at once (:meth:`psclient.redis.resp.RowFrame.offsets`).

    Returns:
        ``(buf, size)``: the replies' bytes, ``buf[:size]`` of this thread's receive
        buffer (valid until the thread's next call); or, where :func:`bulk_socket` finds
        no socket to read, the replies parsed by redis-py (lists of ``bytes | None``;
        error replies of the ``keep`` types in place, others raised).
    """
    parsed: list[Any] = []
    whole = _row_pipeline(client, payload, ncmds, expect, 0, True, None, parsed, whole=True,
                          keep=keep)
    return parsed if whole is None else whole


#: what precedes a token's bulk string in the ``ECHO`` that ends a pipeline read in bulk
ECHO = b"*2\r\n$4\r\nECHO\r\n"


def _row_pipeline(client: Any, payload: list[bytes | memoryview], ncmds: int, expect: int,
                  row_bytes: int, bulk: bool, sink: Callable[[int, Any], object] | None,
                  out: list[Any], *, whole: bool = False,
                  keep: tuple[type[Exception], ...] = ()) -> tuple[bytearray, int] | None:
    """The pipelines above: ``sink`` None collects the decoded replies into ``out``; a
    sink gets them one by one; ``whole`` returns ``(buffer, size)`` of the undecoded
    replies instead (without a socket to read: None, the parsed replies in ``out``)."""
    pool = client.connection_pool
    conn = pool.get_connection()
    tail = resp.bulk(os.urandom(16))
    # NOTE: one buffer, one send: redis-py sends each part with its own sendall (a syscall
    # and, with TCP_NODELAY, a segment the server reads on its own), and a pipeline holds
    # two parts per command (one per partition chunk). Joining copies each key's field
    # once; what it saves: bench/RESULTS.md, "Parameter-server clients".
    data = [b"".join([*payload, ECHO, tail])]

    def attempt() -> tuple[bytearray, int] | None:
        out.clear()
        sock = bulk_socket(conn) if bulk else None
        conn.send_packed_command(data, check_health=True)
        if sock is None:
            replies = read_replies(conn, ncmds + 1, keep)[:-1]
        else:
            buf = getattr(_RECV, "buf", None)
            if buf is None or len(buf) < expect + len(tail):
                buf = _RECV.buf = bytearray(expect + len(tail))
            reader = None if whole else resp.RowReplyReader(ncmds, row_bytes)
            try:
                if reader is None or sink is None:
                    size = recv_until(sock, buf, tail)
                else:
                    size = recv_until(sock, buf, tail, lambda b, n: reader.feed(b, n, sink))
            except BaseException:
                conn.disconnect()
                raise
            if reader is None:
                return buf, size - len(tail)
            if sink is None:
                out.extend(resp.decode_row_replies(buf, size - len(tail), ncmds, row_bytes))
                return None
            replies = reader.finish(buf, size - len(tail))
        done = ncmds - len(replies)
        for i, reply in enumerate(replies):
            if sink is None:
                out.append(reply)
            else:
                sink(done + i, reply)
        return None

    with _released(pool, conn):
        return conn.retry.call_with_retry(attempt, lambda _err: conn.disconnect())


def reply_error(err: Exception) -> rex.RedisError:
    """A hiredis error reply (from the bulk read) as the exception redis-py would raise."""
    msg = str(err)
    if msg.startswith("MOVED "):
        return rex.MovedError(msg[6:])
    if msg.startswith("ASK "):
        return rex.AskError(msg[4:])
    if msg.startswith("TRYAGAIN"):
        return rex.TryAgainError(msg)
    if msg.startswith("CLUSTERDOWN"):
        return rex.ClusterDownError(msg)
    if msg.startswith(("NOAUTH", "WRONGPASS")):
        return rex.AuthenticationError(msg)
    return rex.ResponseError(msg)


def recv_until(sock: socket.socket, buf: bytearray, tail: bytes,
                progress: Callable[[bytearray, int], object] | None = None) -> int:
    """Receive into ``buf`` (grown as needed) until the data ends with ``tail``; after each
    receive, ``progress(buf, bytes so far)`` (it must hold no view of ``buf`` when it
    returns: the buffer may grow)."""
    size = 0
    view = memoryview(buf)
    while size < len(tail) or buf[size - len(tail):size] != tail:
        if size == len(buf):
            view.release()
            buf.extend(bytes(max(len(buf), 1 << 16)))
            view = memoryview(buf)
        try:
            got = sock.recv_into(view[size:])
        except TimeoutError as e:
            raise rex.TimeoutError("Timeout reading from the Redis socket") from e
        except OSError as e:
            raise rex.ConnectionError(f"Error while reading from the Redis socket: {e}") from e
        if got == 0:
            raise rex.ConnectionError("Connection closed by server.")
        size += got
        if progress is not None:
            progress(buf, size)
    view.release()
    return size
