"""A ``file://`` store as a whole: its URL and options, the LMDB environment each process
shares, LMDB's errors as psclient's, and what the store holds (tables, their states, and
data left without a table).

Records of table ``T`` in the environment's main database (the rows and feed databases are
:mod:`psclient.file.backend`'s)::

    b"psc:schema:<T>"    msgpack TableSchema (the table exists: created with its dbs)
    b"psc:trimmed:<T>"   8-byte big-endian: highest change-feed seq trimmed
    b"psc:state:<T>"     msgpack {"loads": {token: {pid, host, since}}, "committed": n}:
                         only while the table is ``loading`` (psclient.loads)
    b"rows:<T>", b"feed:<T>"   LMDB's records of the named databases

Every change to these is one LMDB write transaction, so a table is there whole or not at
all; data without a schema (an *orphan*: rows, feed, records or a row mirror) could only be
left by an older psclient or by hand, and :func:`file_orphans` / :func:`drop_file_orphans`
list and remove it.

Nothing here needs torch: ``psclient ls`` lists a store without loading it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import lmdb
import msgpack

from nvecache.common.names import is_table_name
from psclient.errors import (
    BadArgumentError,
    PSClientError,
    PSServerError,
    PSUnavailableError,
    TableDroppedError,
    UnsupportedURLError,
)
from psclient.file.mirror_files import mirror_path, remove_mirror, store_lock
from psclient.loads import LOADING, Load, TableState

OPTIONS: dict[str, type] = {"map_size": int, "max_dbs": int, "sync": bool,
                            "changes_maxlen": int, "feed_entry_keys": int,
                            "mirror": bool,
                            "upgrade": bool}  # NOTE: accepted; file:// upgrades on open
DEFAULTS: dict[str, Any] = {"map_size": 1 << 40, "max_dbs": 128, "sync": True,
                            "changes_maxlen": 1000, "feed_entry_keys": 4096,
                            "mirror": True}

SCHEMA, TRIMMED, STATE = b"psc:schema:", b"psc:trimmed:", b"psc:state:"
ROWS, FEED = b"rows:", b"feed:"

_ENVS: dict[tuple[int, str], list[Any]] = {}  # (pid, path) -> [env, refcount]
_ENVS_LOCK = threading.Lock()


def _forget_inherited_envs() -> None:
    """In a forked child: close the environments inherited from the parent.

    NOTE: safe for the parent: LMDB's close clears only reader slots of the *calling* pid and
    fcntl locks are not inherited; py-lmdb refuses a second open of the same files until the
    inherited handle is closed.
    """
    pid = os.getpid()
    for key in [k for k in _ENVS if k[0] != pid]:
        env = _ENVS.pop(key)[0]
        with contextlib.suppress(lmdb.Error):
            env.close()


def acquire_env(path: str, opts: dict[str, Any]) -> lmdb.Environment:
    """This process's environment of the store at ``path`` (opened on first use)."""
    with _ENVS_LOCK:
        _forget_inherited_envs()
        entry = _ENVS.get((os.getpid(), path))
        if entry is None:
            env = lmdb.open(path, map_size=opts["map_size"], max_dbs=opts["max_dbs"],
                            sync=opts["sync"], readahead=False, subdir=True, create=True)
            entry = _ENVS[(os.getpid(), path)] = [env, 0]
        entry[1] += 1
        return entry[0]


def release_env(path: str) -> None:
    """One user of :func:`acquire_env`'s environment is done (the last one closes it)."""
    with _ENVS_LOCK:
        entry = _ENVS.get((os.getpid(), path))
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del _ENVS[(os.getpid(), path)]
            entry[0].close()


def holds_env(path: str) -> bool:
    """Whether this process holds an environment of ``path``."""
    return (os.getpid(), path) in _ENVS


@contextlib.contextmanager
def lmdb_errors(where: str) -> Iterator[None]:
    """LMDB's exceptions as psclient's typed errors (a table's named database gone under a
    handle: the table was dropped)."""
    try:
        yield
    except PSClientError:
        raise
    except lmdb.MapFullError as e:
        raise PSServerError(f"{where}: the store is full: open it with a larger map_size "
                            "(the URL option ?map_size=BYTES; the file grows only as data is "
                            "written)") from e
    except (lmdb.ReadersFullError, lmdb.TlsFullError) as e:
        raise PSUnavailableError(f"{where}: too many concurrent readers ({e})") from e
    except (lmdb.NotFoundError, lmdb.BadDbiError) as e:
        raise TableDroppedError(f"{where} was dropped (or created anew) by another client "
                                "while this one used it: connect again (`psclient ls URL` "
                                "lists the tables there)") from e
    except lmdb.Error as e:
        raise PSUnavailableError(f"{where}: LMDB error: {e}") from e
    except OSError as e:  # e.g. a path under /proc, or a directory we may not write
        raise PSUnavailableError(f"{where}: cannot open or create the store there "
                                 f"({e.strerror or e}): use a directory you can write") from e


def _flag(value: object) -> bool:
    """A boolean URL option; ValueError for anything but the usual spellings."""
    if isinstance(value, bool):
        return value
    word = str(value).lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ValueError(word)


def parse_url(url: str, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The store directory (real path) and the options of a ``file://`` URL."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise UnsupportedURLError(
            f"bad file URL {url!r}: use file:///absolute/path (three slashes)")
    path = unquote(parts.path)
    if not path:
        raise UnsupportedURLError(f"bad file URL {url!r}: no path")
    merged: dict[str, Any] = dict(parse_qsl(parts.query))
    merged.update(options)
    opts: dict[str, Any] = {}
    for name, value in merged.items():
        if name == "partitions":
            opts[name] = int(value)
            continue
        typ = OPTIONS.get(name)
        if typ is None:
            raise BadArgumentError(
                f"unknown file:// option {name!r}: use one of {sorted(OPTIONS)}")
        try:
            opts[name] = _flag(value) if typ is bool else typ(value)
        except (TypeError, ValueError) as e:
            raise BadArgumentError(f"option {name}={value!r} must be {typ.__name__}"
                                   + (" (true/false, yes/no, on/off or 1/0)"
                                      if typ is bool else "")) from e
    return os.path.realpath(path), opts


# -- a table's state record ---------------------------------------------------------------

def decode_state(raw: bytes | None) -> TableState:
    """A ``psc:state:<T>`` record (``None``: the table is ready)."""
    if raw is None:
        return TableState()
    try:
        rec = msgpack.unpackb(raw)
        loads = tuple(sorted((Load(str(t), int(v["pid"]), str(v["host"]), float(v["since"]))
                              for t, v in rec["loads"].items()), key=lambda x: x.since))
        return TableState(LOADING, loads, int(rec.get("committed", 0)))
    except (ValueError, KeyError, TypeError, AttributeError, msgpack.UnpackException):
        return TableState(LOADING)  # NOTE: unreadable: loading, by nobody known


def encode_state(loads: list[Load], committed: int) -> bytes:
    """The ``psc:state:<T>`` record of a loading table."""
    return msgpack.packb({"loads": {x.token: {"pid": x.pid, "host": x.host, "since": x.since}
                                    for x in loads}, "committed": committed})


# -- the store's tables and orphans -------------------------------------------------------

@contextlib.contextmanager
def _store(url: str, options: dict[str, Any]) -> Iterator[tuple[str, str, Any]]:
    """``(path, where, env)`` of an existing store (creates nothing)."""
    path, opts = parse_url(url, options)
    where = f"file://{path}"
    if not (Path(path) / "data.mdb").is_file():
        raise PSUnavailableError(f"no store at {where} (no data.mdb there): check the path")
    opts = {**DEFAULTS, **{k: v for k, v in opts.items() if k != "partitions"}}
    with lmdb_errors(where):
        env = acquire_env(path, opts)
        try:
            yield path, where, env
        finally:
            release_env(path)


def _names(txn: Any, head: bytes) -> list[str]:
    """Table names of the main-database keys that start with ``head``."""
    cur = txn.cursor()
    names = []
    if cur.set_range(head):
        for key in cur.iternext(values=False):
            if not key.startswith(head):
                break
            name = key[len(head):].decode(errors="replace")
            if is_table_name(name):
                names.append(name)
    return names


def list_file_tables(url: str, options: dict[str, Any]) -> list[str]:
    """Table names in the store at a ``file:///path`` URL, sorted; creates nothing.

    Raises:
        PSUnavailableError: there is no store at that path.
    """
    with _store(url, options) as (_, _, env), env.begin() as txn:
        return sorted(_names(txn, SCHEMA))


def _orphans(path: str, env: Any, txn: Any) -> dict[str, dict[str, int]]:
    tables = set(_names(txn, SCHEMA))
    found: dict[str, dict[str, int]] = {}
    for head in (TRIMMED, STATE, ROWS, FEED):
        for name in _names(txn, head):
            if name in tables:
                continue
            got = found.setdefault(name, {"keys": 0, "rows": 0})
            got["keys"] += 1
            if head == ROWS:
                db = env.open_db(ROWS + name.encode(), txn=txn, create=False)
                got["rows"] += int(txn.stat(db)["entries"])
    for entry in os.listdir(path):
        name = entry.removeprefix("rows.").removesuffix(".nvidx")
        if os.path.basename(mirror_path(path, name)) == entry and is_table_name(name) \
                and name not in tables:
            found.setdefault(name, {"keys": 0, "rows": 0})["keys"] += 1
    return found


def file_orphans(url: str, options: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Data in the store that belongs to no table, by the table name it was written under:
    ``{name: {"keys": records, databases and files, "rows": rows}}``."""
    with _store(url, options) as (path, _, env), env.begin() as txn:
        return _orphans(path, env, txn)


def drop_file_orphans(url: str, table: str, options: dict[str, Any]) -> dict[str, int]:
    """Remove the data of ``table`` that belongs to no table (one transaction, and its row
    mirror file); ``{"keys", "rows"}`` removed, zeros when there was none."""
    with _store(url, options) as (path, _, env):
        name = table.encode()
        with env.begin(write=True) as txn:
            if txn.get(SCHEMA + name) is not None:
                return {"keys": 0, "rows": 0}  # NOTE: a table now: psclient drop drops it
            gone = _orphans(path, env, txn).get(table, {"keys": 0, "rows": 0})
            for head in (ROWS, FEED):
                if txn.get(head + name) is not None:
                    txn.drop(env.open_db(head + name, txn=txn, create=False), delete=True)
            for head in (TRIMMED, STATE):
                txn.delete(head + name)
        with store_lock(path):
            remove_mirror(path, table)
        return gone
