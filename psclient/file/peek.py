"""What ``psclient stat`` and ``psclient ls`` show of a ``file://`` table, read without
opening the table.

Opening a table (:mod:`psclient.file.backend`) loads the row machinery (numpy) and may change
the store: it upgrades a table of an older layout and rebuilds a row mirror it cannot trust.
A table that needs neither (the usual case) shows the same figures read here, in one LMDB
read transaction and the mirror file's header, without numpy. For anything else, an option
in the URL included, :func:`stat` answers ``None`` and the caller opens the table, which
says what is wrong or repairs what it must.
"""

from __future__ import annotations

import os
import struct
from typing import Any
from urllib.parse import urlsplit

import lmdb

from nvecache.common.names import is_table_name
from psclient.errors import PSClientError
from psclient.file import mirror_layout as words
from psclient.file.mirror_files import HEADER_BYTES, OK, mirror_path
from psclient.file.store import (
    DEFAULTS,
    FEED,
    ROWS,
    SCHEMA,
    STATE,
    acquire_env,
    decode_state,
    parse_url,
    release_env,
)
from psclient.schema import LAYOUT_VERSION, TableSchema

__all__ = ["stat"]


def stat(url: str, table: str) -> dict[str, Any] | None:
    """``ParameterServer.stat()`` of ``table`` as opening it would show it, or ``None``:
    open the table to know (no table or store there, a URL option, an older layout, a row
    mirror the open would rebuild, an error)."""
    if urlsplit(url).query or not is_table_name(table):
        return None
    try:
        path, _ = parse_url(url, {})
        if not os.path.isfile(os.path.join(path, "data.mdb")):
            return None
        return _stat(path, table)
    except (PSClientError, lmdb.Error, OSError):
        return None


def _stat(path: str, table: str) -> dict[str, Any] | None:
    name = table.encode()
    env = acquire_env(path, DEFAULTS)
    try:
        with env.begin() as txn:
            raw = txn.get(SCHEMA + name)
            if raw is None:
                return None
            schema = TableSchema.decode(raw, table)
            if schema.layout != LAYOUT_VERSION:
                return None
            rows = txn.stat(env.open_db(ROWS + name, txn=txn, create=False))["entries"]
            feed = txn.stat(env.open_db(FEED + name, txn=txn, create=False))["entries"]
            state = decode_state(txn.get(STATE + name))
        info = env.info()
    finally:
        release_env(path)
    mirror = _mirror(path, table, schema.row_bytes, info["last_txnid"])
    if mirror is None:
        return None
    return {"table": table, "dim": schema.dim, "dtype": schema.dtype,
            "partitions": schema.partitions, "layout": schema.layout,
            "created": schema.created, "rows": int(rows), "state": state.state,
            "loads": [load.as_dict() for load in state.loads],
            "backend": "lmdb", "path": path, "feed_entries": int(feed),
            "map_size": info["map_size"], "readers": info["num_readers"], "mirror": mirror}


def _mirror(path: str, table: str, row_bytes: int, last_txnid: int) -> dict[str, Any] | None:
    """The mirror's part of ``stat()`` when opening the table would trust the mirror as it
    is (psclient.file.mirror: the file's format and size, even ``GEN``, ``OK``, written in
    this boot, at LMDB's last transaction), else ``None``."""
    file = mirror_path(path, table)
    lock = os.path.join(path, "mirror.lock")
    if not (os.access(file, os.R_OK | os.W_OK) and os.access(lock, os.R_OK | os.W_OK)):
        return None
    fd = os.open(file, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8 * words.HEADER_WORDS, 0)
    finally:
        os.close(fd)
    if size < HEADER_BYTES or len(head) != 8 * words.HEADER_WORDS:
        return None
    hdr = struct.unpack(f"{words.HEADER_WORDS}q", head)
    slots, cap = hdr[words.SLOTS], hdr[words.ROW_CAP]
    trusted = (hdr[words.MAGIC] == words.FILE_MAGIC and hdr[words.VERSION] == words.FILE_FORMAT
               and hdr[words.ROW_BYTES] == row_bytes
               and size == HEADER_BYTES + 16 * slots + cap * (8 + row_bytes)
               and not hdr[words.GEN] & 1 and hdr[words.STATE] == OK
               and (hdr[words.BOOT0], hdr[words.BOOT1]) == words.boot_id()
               and hdr[words.TXNID] == last_txnid)
    if not trusted:
        return None
    return {"path": file, "state": "ok", "keys": hdr[words.COUNT], "slots": slots,
            "row_capacity": cap, "file_bytes": size}
