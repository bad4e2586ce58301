"""Store-wide questions to a Redis or a Redis Cluster: which tables it holds.

A table ``T`` is known by its schema key ``<prefix>:{T}:schema`` (the layout is in
:mod:`psclient.redis_backend`); listing SCANs for those keys (every master of a cluster),
so it never blocks the server the way ``KEYS`` would.
"""

from __future__ import annotations

import re
from typing import Any

from .names import is_table_name
from .redis_conn import cluster_factory, redact, redis_errors, split_options, standalone_factory


def _names(client: Any, prefix: str) -> list[str]:
    pattern = re.compile(re.escape(prefix) + r":\{(.+)\}:schema")
    found = set()
    for key in client.scan_iter(match=f"{prefix}:{{*}}:schema", count=1000):
        m = pattern.fullmatch(key.decode() if isinstance(key, bytes) else key)
        if m and is_table_name(m.group(1)):
            found.add(m.group(1))
    return sorted(found)


def _list(url: str, options: dict[str, Any], cluster: bool) -> list[str]:
    base, topts, conn = split_options(url, options)
    prefix = topts.get("prefix", "psc")
    with redis_errors(f"listing tables at {redact(base)}"):
        make = cluster_factory(base, conn) if cluster else standalone_factory(base, conn)
        client = make()
        try:
            return _names(client, prefix)
        finally:
            client.close()


def list_standalone(url: str, options: dict[str, Any]) -> list[str]:
    """Table names at a ``redis://``, ``rediss://`` or ``unix://`` URL, sorted."""
    return _list(url, options, cluster=False)


def list_cluster(url: str, options: dict[str, Any]) -> list[str]:
    """Table names on a Redis Cluster (``redis+cluster://``), sorted."""
    return _list(url, options, cluster=True)
