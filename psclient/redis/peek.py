"""What ``psclient ls`` and ``psclient stat`` show of a Redis server's tables, read over a
plain socket without redis-py or numpy.

A table opened through :mod:`psclient.redis.backend` loads redis-py, hiredis's bindings of
the row codec and numpy, which take longer to import than the answer takes to read. The
figures these commands show are a few reads (``SCAN``, ``GET``, ``HLEN``, ``XLEN``,
``HGETALL``), sent here over one connection with the RESP protocol and parsed by hiredis's
reader. Only a plain URL is read so: ``redis://[user:pass@]host[:port][/DB]`` or
``unix:///path``, no query. For anything else (TLS, a cluster, an option, a table of an
older layout) and on any error (refused, timed out, an error reply) these functions answer
``None`` and the caller asks the backend, which says what is wrong in its own words.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import hiredis

from nvecache.common.names import is_table_name
from psclient.errors import PSClientError
from psclient.redis.keyspace import decode_state, orphans, table_names, table_rows
from psclient.registry import redact
from psclient.schema import LAYOUT_VERSION, TableSchema

__all__ = ["list_orphans", "list_tables", "stat"]

#: the backend's key prefix and its default socket timeouts (psclient.redis.conn)
_PREFIX = "psc"
_TIMEOUT_S = 2.0


class _UnsureError(Exception):
    """The socket or the server did not give a plain answer: ask the backend."""


class _Client:
    """One connection; the few commands of redis-py's client that the listings use."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if parts.query or parts.fragment or scheme not in ("redis", "unix"):
            raise _UnsureError(url)
        db = "0"
        if scheme == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            address: Any = unquote(parts.path)
        else:
            db = unquote(parts.path).removeprefix("/") or "0"
            if not (db.isascii() and db.isdigit()):
                raise _UnsureError(url)
            sock = socket.socket(socket.AF_INET6 if ":" in (parts.hostname or "")
                                 else socket.AF_INET, socket.SOCK_STREAM)
            address = (parts.hostname or "localhost", parts.port or 6379)
        self._sock = sock
        self._reader = hiredis.Reader()
        try:
            sock.settimeout(_TIMEOUT_S)
            sock.connect(address)
            if parts.password is not None:
                self.call("AUTH", *([unquote(parts.username)] if parts.username else []),
                          unquote(parts.password))
            if db != "0":
                self.call("SELECT", db)
        except BaseException:
            sock.close()
            raise

    def close(self) -> None:
        self._sock.close()

    def call(self, *args: str | bytes | int) -> Any:
        """One command's reply; an error reply raises :class:`_UnsureError`."""
        return self.pipeline([args])[0]

    def pipeline(self, commands: Sequence[Sequence[str | bytes | int]]) -> list[Any]:
        """The replies of ``commands``, sent at once."""
        out = bytearray()
        for args in commands:
            out += b"*%d\r\n" % len(args)
            for arg in args:
                raw = arg if isinstance(arg, bytes) else str(arg).encode()
                out += b"$%d\r\n%s\r\n" % (len(raw), raw)
        self._sock.sendall(out)
        replies: list[Any] = []
        while len(replies) < len(commands):
            reply = self._reader.gets()
            if reply is False:
                data = self._sock.recv(1 << 16)
                if not data:
                    raise _UnsureError("the server closed the connection")
                self._reader.feed(data)
                continue
            if isinstance(reply, hiredis.ReplyError):
                raise _UnsureError(str(reply))
            replies.append(reply)
        return replies

    def scan_iter(self, match: str, count: int) -> Iterator[bytes]:
        cursor = b"0"
        while True:
            cursor, keys = self.call("SCAN", cursor, "MATCH", match, "COUNT", count)
            yield from keys
            if cursor == b"0":
                return

    def exists(self, key: str) -> int:
        return int(self.call("EXISTS", key))

    def hlen(self, key: str) -> int:
        return int(self.call("HLEN", key))


@contextlib.contextmanager
def _client(url: str) -> Iterator[_Client]:
    client = _Client(url)
    try:
        yield client
    finally:
        client.close()


def _answer(read: Any, url: str, *args: Any) -> Any:
    """``read(client, *args)`` over a connection to ``url``, or ``None``: ask the backend."""
    try:
        with _client(url) as client:
            return read(client, *args)
    except (_UnsureError, OSError, PSClientError, hiredis.ProtocolError):
        return None


def list_tables(url: str) -> list[str] | None:
    """``psclient.list_tables(url)``, or ``None``: ask the backend."""
    names: list[str] | None = _answer(table_names, url, _PREFIX)
    return names


def list_orphans(url: str) -> dict[str, dict[str, int]] | None:
    """``psclient.list_orphans(url)``, or ``None``: ask the backend."""
    def read(client: _Client) -> dict[str, dict[str, int]]:
        found = orphans(client, _PREFIX, f"{_PREFIX}:{{*")
        return dict(sorted((name, {"keys": len(ks), "rows": table_rows(client, _PREFIX, name,
                                                                        ks)})
                           for name, ks in found.items()))
    got: dict[str, dict[str, int]] | None = _answer(read, url)
    return got


def stat(url: str, table: str) -> dict[str, Any] | None:
    """``ParameterServer.stat()`` of ``table`` as opening it would show it, or ``None``:
    open the table to know (no such table, an older layout, an error)."""
    if not is_table_name(table):
        return None
    info: dict[str, Any] | None = _answer(_stat, url, table, url)
    return info


def _stat(client: _Client, table: str, url: str) -> dict[str, Any] | None:
    raw = client.call("GET", f"{_PREFIX}:{{{table}}}:schema")
    if raw is None:
        return None
    schema = TableSchema.decode(raw, table)
    if schema.layout != LAYOUT_VERSION:
        return None
    parts = [f"{_PREFIX}:{{{table}:{p}}}" for p in range(schema.partitions)]
    *counts, rec = client.pipeline(
        [("HLEN", k) for k in parts] + [("XLEN", k + ":changes") for k in parts]
        + [("HGETALL", f"{_PREFIX}:{{{table}}}:state")])
    state = decode_state(dict(zip(rec[::2], rec[1::2], strict=True)))
    return {"table": table, "dim": schema.dim, "dtype": schema.dtype,
            "partitions": schema.partitions, "layout": schema.layout,
            "created": schema.created, "rows": sum(counts[:len(parts)]),
            "state": state.state, "loads": [load.as_dict() for load in state.loads],
            "backend": "redis", "url": redact(url), "masters": 1,
            "feed_entries": sum(counts[len(parts):])}

