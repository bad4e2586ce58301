"""Store-wide questions to a Redis or a Redis Cluster: which tables it holds, and what it
holds that belongs to no table.

A table ``T`` is known by its schema key ``<prefix>:{T}:schema`` (the layout is in
:mod:`psclient.redis.backend`); listing SCANs for those keys (every master of a cluster),
so it never blocks the server the way ``KEYS`` would.

Keys of ``T`` (``<prefix>:{T:p}...``, ``<prefix>:{T}:...``) when there is no schema key are
*orphans*: a drop interrupted between its steps leaves them (:mod:`psclient.redis.tables`),
and older psclient versions could leave partitions re-created by a write racing a drop.
:func:`orphans_standalone` lists them (a table created while the SCAN ran is not one: its
schema is looked up again after the scan); :func:`drop_orphans_standalone` removes them, a
partition at a time, only where no table of the name marks the partition as its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from psclient.redis.conn import (
    cluster_factory,
    redact,
    redis_errors,
    split_options,
    standalone_factory,
)
from psclient.redis.keyspace import orphans as _orphans
from psclient.redis.keyspace import table_names as _names
from psclient.redis.keyspace import table_rows as _rows
from psclient.redis.scripts import DROP_PART, partition_keys

#: removes a table's ``{T}`` keys but the schema, when there is no schema
_DROP_TOP = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
return redis.call('UNLINK', KEYS[2], KEYS[3])
"""


@contextmanager
def _client(url: str, options: dict[str, Any], cluster: bool, what: str
            ) -> Iterator[tuple[Any, str]]:
    """``(client, key prefix)``, with redis-py's errors as psclient's."""
    base, topts, conn = split_options(url, options)
    with redis_errors(f"{what} at {redact(base)}"):
        make = cluster_factory(base, conn) if cluster else standalone_factory(base, conn)
        client = make()
        try:
            yield client, topts.get("prefix", "psc")
        finally:
            client.close()


def _list(url: str, options: dict[str, Any], cluster: bool) -> list[str]:
    with _client(url, options, cluster, "listing tables") as (client, prefix):
        return _names(client, prefix)


def _list_orphans(url: str, options: dict[str, Any], cluster: bool
                  ) -> dict[str, dict[str, int]]:
    with _client(url, options, cluster, "listing orphaned keys") as (client, prefix):
        return {name: {"keys": len(ks), "rows": _rows(client, prefix, name, ks)}
                for name, ks in _orphans(client, prefix, f"{prefix}:{{*").items()}


def _drop_orphans(url: str, table: str, options: dict[str, Any], cluster: bool
                  ) -> dict[str, int]:
    with _client(url, options, cluster, f"dropping orphaned keys of {table!r}") as (
            client, prefix):
        keys = _orphans(client, prefix, f"{prefix}:{{{table}*").get(table, [])
        rows = _rows(client, prefix, table, keys)
        parts = sorted({int(k.split("}", 1)[0].rsplit(":", 1)[1]) for k in keys
                        if k.startswith(f"{prefix}:{{{table}:")})
        gone = 0
        for p in parts:
            part = f"{prefix}:{{{table}:{p}}}".encode()
            token = client.get(part + b":live") or b""
            named = partition_keys(part)
            gone += int(client.eval(DROP_PART, len(named), *named, token))
        top = f"{prefix}:{{{table}}}"
        gone += int(client.eval(_DROP_TOP, 3, f"{top}:schema", f"{top}:state",
                                f"{top}:changes"))
        return {"keys": gone, "rows": rows}


def list_standalone(url: str, options: dict[str, Any]) -> list[str]:
    """Table names at a ``redis://``, ``rediss://`` or ``unix://`` URL, sorted."""
    return _list(url, options, cluster=False)


def list_cluster(url: str, options: dict[str, Any]) -> list[str]:
    """Table names on a Redis Cluster (``redis+cluster://``), sorted."""
    return _list(url, options, cluster=True)


def orphans_standalone(url: str, options: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Keys of tables without a schema at a ``redis://``/``rediss://``/``unix://`` URL:
    ``{name: {"keys", "rows"}}``."""
    return _list_orphans(url, options, cluster=False)


def orphans_cluster(url: str, options: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Keys of tables without a schema on a Redis Cluster."""
    return _list_orphans(url, options, cluster=True)


def drop_orphans_standalone(url: str, table: str, options: dict[str, Any]) -> dict[str, int]:
    """Remove ``table``'s keys if it has no schema: ``{"keys", "rows"}`` removed."""
    return _drop_orphans(url, table, options, cluster=False)


def drop_orphans_cluster(url: str, table: str, options: dict[str, Any]) -> dict[str, int]:
    """Remove ``table``'s keys on a Redis Cluster if it has no schema."""
    return _drop_orphans(url, table, options, cluster=True)
