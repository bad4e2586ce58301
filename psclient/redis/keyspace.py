"""A Redis store's keys read back: which tables have a schema key, which keys belong to a
table name that has none (orphans; :mod:`psclient.redis.admin` says how they come about),
and a table's state record (:mod:`psclient.redis.tables` writes it).

The functions take any client with redis-py's ``scan_iter``, ``exists`` and ``hlen``:
:mod:`psclient.redis.admin` passes redis-py's, :mod:`psclient.redis.peek` its own, so the
command lines list a store without importing redis-py.
"""

from __future__ import annotations

import re
from typing import Any

from nvecache.common.names import is_table_name
from psclient.loads import Load, TableState

__all__ = ["decode_state", "orphans", "table_names", "table_rows"]


def table_names(client: Any, prefix: str) -> list[str]:
    """The names of the tables with a schema key, sorted (one SCAN of the keyspace)."""
    pattern = re.compile(re.escape(prefix) + r":\{(.+)\}:schema")
    found = set()
    for key in client.scan_iter(match=f"{prefix}:{{*}}:schema", count=1000):
        m = pattern.fullmatch(key.decode() if isinstance(key, bytes) else key)
        if m and is_table_name(m.group(1)):
            found.add(m.group(1))
    return sorted(found)


def _table_keys(client: Any, prefix: str, match: str) -> tuple[set[str], dict[str, list[str]]]:
    """SCAN ``match``: the tables with a schema, and every other key of a table, by name."""
    pattern = re.compile(re.escape(prefix) + r":\{([^{}:]+)(:\d+)?\}(.*)")
    tables: set[str] = set()
    keys: dict[str, list[str]] = {}
    for raw in client.scan_iter(match=match, count=1000):
        key = raw.decode() if isinstance(raw, bytes) else raw
        m = pattern.fullmatch(key)
        if m is None or not is_table_name(m.group(1)):
            continue
        if m.group(2) is None and m.group(3) == ":schema":
            tables.add(m.group(1))
        else:
            keys.setdefault(m.group(1), []).append(key)
    return tables, keys


def orphans(client: Any, prefix: str, match: str) -> dict[str, list[str]]:
    """The keys matching ``match`` of each table name without a schema key (looked up again
    after the scan: a table created meanwhile is not one), by name."""
    tables, keys = _table_keys(client, prefix, match)
    return {name: ks for name, ks in keys.items()
            if name not in tables and not client.exists(f"{prefix}:{{{name}}}:schema")}


def table_rows(client: Any, prefix: str, name: str, keys: list[str]) -> int:
    """The rows in those of ``keys`` that are partition hashes of table ``name``."""
    hashes = re.compile(re.escape(f"{prefix}:{{{name}:") + r"\d+\}")
    return sum(int(client.hlen(k)) for k in keys if hashes.fullmatch(k))


def decode_state(rec: dict[Any, Any]) -> TableState:
    """A table's state from its ``<prefix>:{T}:state`` hash (empty: the table is ready)."""
    if not rec:
        return TableState()
    rec = {(k.decode() if isinstance(k, bytes) else k): v for k, v in rec.items()}
    state = rec.get("state", b"loading")
    loads = tuple(sorted((Load.decode(k[2:], v) for k, v in rec.items()
                          if k.startswith("l:")), key=lambda load: load.since))
    return TableState(state.decode() if isinstance(state, bytes) else str(state), loads,
                      int(rec.get("committed", 0)))
