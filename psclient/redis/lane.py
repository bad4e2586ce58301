"""A connection each thread keeps out of a client's pool for its small lookups.

A small lookup is one round trip whose host work is a few dozen numpy calls; checking a
connection out of redis-py's pool and back in (its locks, its observability hooks, a poll
of the socket) and sending through ``send_packed_command`` cost about as much again. So a
thread that looks up keeps one connection checked out (its lane): before each use it is
checked as the pool checks a connection it hands out (not connected, or readable while
idle: closed by the server or holding stale bytes, so made anew), the client's ``Retry``
governs a failed round trip as in :func:`psclient.redis.wire.run_pipeline`, and the
connection goes back to the pool when the thread ends (or is disconnected with the pool
when the client closes).

Lanes hold at most a quarter of the pool's ``max_connections``: the threads beyond that,
and every other command, take the pool's path, so a lane never leaves a command waiting
for a connection.

Only the bulk read (:func:`psclient.redis.wire.idle_socket`) is done here; a connection
without a socket to read directly gives ``None`` and the caller takes the pool's path.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from typing import Any

import redis.exceptions as rex

from psclient.redis import resp
from psclient.redis.wire import ECHO, idle_socket, recv_until

__all__ = ["Lanes", "Sent"]


class _Held:
    """How many lanes of a client hold a connection (shared with their finalizers)."""

    __slots__ = ("count", "lock")

    def __init__(self) -> None:
        self.count = 0
        self.lock = threading.Lock()


class _Lane:
    """One thread's connection and receive buffer."""

    __slots__ = ("__weakref__", "buf", "conn")

    def __init__(self, pool: Any, held: _Held) -> None:
        self.conn = pool.get_connection()
        self.buf = bytearray(1 << 16)
        # NOTE: a thread's locals are dropped when it ends: the connection goes back then
        weakref.finalize(self, _give_back, pool, self.conn, held)


def _give_back(pool: Any, conn: Any, held: _Held) -> None:
    """Return a lane's connection to its pool (a finalizer: it must not raise)."""
    with held.lock:
        held.count -= 1
    with contextlib.suppress(Exception):
        pool.release(conn)


class Lanes:
    """The lanes of one ``redis.Redis`` client, one per thread that uses them."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._local = threading.local()
        self._held = _Held()

    def _lane(self) -> _Lane | None:
        lane: _Lane | None = getattr(self._local, "lane", None)
        if lane is None:
            pool = self._client.connection_pool
            with self._held.lock:
                if self._held.count >= pool.max_connections // 4:
                    return None
                self._held.count += 1
            try:
                lane = self._local.lane = _Lane(pool, self._held)
            except BaseException:
                with self._held.lock:
                    self._held.count -= 1
                raise
        return lane

    def fetch(self, payload: list[bytes | memoryview], expect: int
              ) -> tuple[bytearray, int] | None:
        """Send HMGET commands (followed by an ``ECHO`` of a random token) on this thread's
        connection and read every reply off its socket until the token's reply.

        Returns:
            ``(buf, size)``: the replies' bytes, ``buf[:size]`` of this thread's receive
            buffer (valid until the thread's next call); None when this thread has no lane
            (the lanes' share of the pool is taken) or its connection no socket to read
            directly: read them through the pool's path instead.
        """
        lane = self._lane()
        if lane is None:
            return None
        conn = lane.conn
        tail = resp.bulk(os.urandom(16))
        data = b"".join([*payload, ECHO, tail])
        if len(lane.buf) < expect + len(tail):
            lane.buf = bytearray(expect + len(tail))

        def attempt() -> tuple[bytearray, int] | None:
            sock = idle_socket(conn)
            if sock is None:
                return None
            try:
                try:
                    sock.sendall(data)
                except TimeoutError as e:
                    raise rex.TimeoutError("Timeout writing to the Redis socket") from e
                except OSError as e:
                    raise rex.ConnectionError(f"Error while writing to the Redis socket: {e}"
                                              ) from e
                size = recv_until(sock, lane.buf, tail)
            except BaseException:
                # NOTE: replies left unread would answer the next command sent on it
                conn.disconnect()
                raise
            return lane.buf, size - len(tail)

        return conn.retry.call_with_retry(attempt, lambda _err: conn.disconnect())

    def open(self, expect: int) -> Sent | None:
        """This thread's lane, ready to send on (its receive buffer holds ``expect`` bytes
        and a token's reply): the first half of :meth:`fetch` for a caller that sends on
        several lanes (a cluster's nodes) before reading any. None as :meth:`fetch`."""
        lane = self._lane()
        if lane is None:
            return None
        sock = idle_socket(lane.conn)
        if sock is None:
            return None
        tail = resp.bulk(os.urandom(16))
        if len(lane.buf) < expect + len(tail):
            lane.buf = bytearray(expect + len(tail))
        return Sent(lane, sock, tail)


class Sent:
    """A lane that one batch is sent on (:meth:`Lanes.open`): :meth:`send`, then
    :meth:`receive`. No retry here: on a connection error the connection is dropped (a
    reply left unread would answer its next command) and the error raised, for the caller
    to take a path that retries; :meth:`drop` does the same for a lane whose replies will
    not be read."""

    __slots__ = ("_lane", "_sock", "_tail")

    def __init__(self, lane: _Lane, sock: Any, tail: bytes) -> None:
        self._lane, self._sock, self._tail = lane, sock, tail

    def send(self, payload: list[bytes | memoryview]) -> None:
        """Send the commands, then an ``ECHO`` of this batch's token."""
        try:
            self._sock.sendall(b"".join([*payload, ECHO, self._tail]))
        except OSError as e:
            self.drop()
            raise rex.ConnectionError(f"Error while writing to the Redis socket: {e}") from e

    def receive(self) -> tuple[bytearray, int]:
        """Every reply up to the token's: ``buf[:size]`` of the lane's receive buffer
        (valid until this thread's next batch on the lane)."""
        try:
            size = recv_until(self._sock, self._lane.buf, self._tail)
        except BaseException:
            self.drop()
            raise
        return self._lane.buf, size - len(self._tail)

    def drop(self) -> None:
        self._lane.conn.disconnect()
