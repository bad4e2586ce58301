"""The embedded default: a local, persistent LMDB store (``file:///path/to/dir``).

LMDB won over SQLite by measurement (docs/psclient.md): batched reads run in one read
transaction on a memory map, readers never block and never lock, one writer at a time is
serialized across processes by LMDB's robust lock, and copy-on-write B+trees make every
commit crash-safe (``sync=True`` by default).

Layout of one environment directory (any number of tables, two named databases each)::

    main db   b"psc:schema:<T>"    msgpack TableSchema
              b"psc:trimmed:<T>"   8-byte big-endian: highest change-feed seq trimmed
    b"rows:<T>"   key: 8 big-endian bytes of key ^ 2**63 (byte order = signed order)
                  value: raw row bytes
    b"feed:<T>"   key: 8-byte big-endian seq; value: b"K" + 8-byte little-endian commit
                  time (ns since the epoch) + packed int64 keys (layout 1 wrote b"k" + keys,
                  still read), or b"c" (table cleared). Bounded to ``changes_maxlen``
                  entries.

The change feed is written in the same transaction as the rows, so it is exact and atomic:
it lists exactly the keys that existed before an insert/update/erase touched them.

NOTE: LMDB forbids opening one environment twice in a process and using it after fork:
environments are shared per (pid, path) through ``_ENVS`` and reopened in a child.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from itertools import compress, repeat
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, unquote, urlsplit

import lmdb
import numpy as np

from .base import ParameterServer
from .codec import (
    assemble_distinct_rows,
    assemble_rows,
    be_bytes_to_keys,
    be_key_bytes,
    first_of_runs,
    row_bytes_list,
)
from .errors import (
    BadArgumentError,
    ChangeFeedGapError,
    PSClientError,
    PSServerError,
    PSUnavailableError,
    TableNotFoundError,
    UnsupportedURLError,
)
from .feed import FeedBatch, make_batch
from .file_mirror import RowMirror, scan_rows
from .lazy import lazy_import
from .schema import TableSchema

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_import("torch", globals())

log = logging.getLogger(__name__)

_OPTIONS: dict[str, type] = {"map_size": int, "max_dbs": int, "sync": bool,
                             "changes_maxlen": int, "feed_entry_keys": int,
                             "mirror": bool,
                             "upgrade": bool}  # NOTE: accepted; file:// upgrades on open
_DEFAULTS: dict[str, Any] = {"map_size": 1 << 40, "max_dbs": 128, "sync": True,
                             "changes_maxlen": 1000, "feed_entry_keys": 4096,
                             "mirror": True}

_ENVS: dict[tuple[int, str], list[Any]] = {}  # (pid, path) -> [env, refcount]
_ENVS_LOCK = threading.Lock()
#: how often a blocking follow() looks at the (node-local) store again
_POLL_S = 0.002


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


def _acquire_env(path: str, opts: dict[str, Any]) -> lmdb.Environment:
    with _ENVS_LOCK:
        _forget_inherited_envs()
        entry = _ENVS.get((os.getpid(), path))
        if entry is None:
            env = lmdb.open(path, map_size=opts["map_size"], max_dbs=opts["max_dbs"],
                            sync=opts["sync"], readahead=False, subdir=True, create=True)
            entry = _ENVS[(os.getpid(), path)] = [env, 0]
        entry[1] += 1
        return entry[0]


def _release_env(path: str) -> None:
    with _ENVS_LOCK:
        entry = _ENVS.get((os.getpid(), path))
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del _ENVS[(os.getpid(), path)]
            entry[0].close()


def _seq(n: int) -> bytes:
    return n.to_bytes(8, "big")


@contextlib.contextmanager
def _lmdb_errors(where: str) -> Iterator[None]:
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
    except lmdb.Error as e:
        raise PSUnavailableError(f"{where}: LMDB error: {e}") from e
    except OSError as e:  # e.g. a path under /proc, or a directory we may not write
        raise PSUnavailableError(f"{where}: cannot open or create the store there "
                                 f"({e.strerror or e}): use a directory you can write") from e


class FileParameterServer(ParameterServer):
    """A table in a local LMDB environment. Create with :func:`psclient.connect`."""

    _env: Any = None
    _mirror: RowMirror | None = None

    def __init__(self, path: str, table: str, dim: int | None, dtype: str | None,
                 opts: dict[str, Any]) -> None:
        self._path = path
        self._opts = {**_DEFAULTS, **opts}
        for name in ("changes_maxlen", "feed_entry_keys", "max_dbs", "map_size"):
            if self._opts[name] <= 0:
                raise BadArgumentError(f"option {name} must be positive")
        self._where = f"table {table!r} at file://{path}"
        self._schema_key = f"psc:schema:{table}".encode()
        self._trim_key = f"psc:trimmed:{table}".encode()
        if dim is None and not (Path(path) / "data.mdb").exists():
            raise TableNotFoundError(f"{self._where} does not exist: pass dim= to create it")
        with _lmdb_errors(self._where):
            self._env = _acquire_env(path, self._opts)
            try:
                schema = self._open_schema(table, dim, dtype, opts.get("partitions"))
                if self._opts["mirror"]:
                    self._mirror = self._open_mirror(table, schema.row_bytes)
            except BaseException:
                _release_env(path)
                self._env = None
                raise
        super().__init__(table, schema)

    def _open_mirror(self, table: str, row_bytes: int) -> RowMirror | None:
        """The table's row mirror (psclient.file_mirror), built from LMDB if it must be."""
        @contextlib.contextmanager
        def scan() -> Iterator[tuple[int, Iterator[tuple[list[bytes], list[bytes]]]]]:
            with self._env.begin(db=self._rows) as txn:
                yield int(txn.stat(self._rows)["entries"]), scan_rows(txn, self._rows)
        try:
            return RowMirror(self._path, table, row_bytes, scan,
                             lambda: int(self._env.info()["last_txnid"]))
        except OSError as e:
            log.warning("%s: no row mirror (%s); lookups search LMDB", self._where, e)
            return None

    def _writing(self) -> Any:
        """Around a write of rows: the mirror's writer protocol (file_mirror), or nothing."""
        return self._mirror.writing() if self._mirror is not None else \
            contextlib.nullcontext(None)

    def _open_schema(self, table: str, dim: int | None, dtype: str | None,
                     partitions: int | None) -> TableSchema:
        with self._env.begin() as txn:
            raw = txn.get(self._schema_key)
        if raw is None:
            if dim is None:
                raise TableNotFoundError(f"{self._where} does not exist: pass dim= to create it")
            with self._env.begin(write=True) as txn:
                raw = txn.get(self._schema_key)  # NOTE: re-read under the writer lock
                if raw is None:
                    schema = TableSchema(dim=dim, dtype=dtype or "float32",
                                         partitions=partitions or 1)
                    txn.put(self._schema_key, schema.encode())
                    self._open_dbs(txn)
                    log.info("created %s: %s", self._where, schema)
                    return schema
        schema = TableSchema.decode(raw, table)
        if schema.layout == 1:
            # NOTE: layout 1 -> 2 is transparent here: rows are unchanged, and a layout-1
            # client still attached reads the new feed records as a superset (b"K" + time).
            schema = TableSchema(dim=schema.dim, dtype=schema.dtype,
                                 partitions=schema.partitions, created=schema.created)
            with self._env.begin(write=True) as txn:
                txn.put(self._schema_key, schema.encode())
            log.info("upgraded %s to layout %d", self._where, schema.layout)
        schema.check(table, dim=dim, dtype=dtype, partitions=partitions)
        with self._env.begin(write=True) as txn:
            self._open_dbs(txn)
        return schema

    def _open_dbs(self, txn: Any) -> None:
        name = self._schema_key[len(b"psc:schema:"):]
        self._main = self._env.open_db(None, txn=txn)
        self._rows = self._env.open_db(b"rows:" + name, txn=txn, create=True)
        self._feed_db = self._env.open_db(b"feed:" + name, txn=txn, create=True)

    def _sorted(self, keys: np.ndarray, encode: bool = True
                ) -> tuple[np.ndarray, np.ndarray, list[bytes]]:
        """``(order, keys[order], their LMDB key bytes)`` (no bytes when not ``encode``)."""
        order = np.argsort(keys, kind="stable")  # NOTE: B-tree locality; keeps dup order
        ks = keys[order]
        return order, ks, be_key_bytes(ks) if encode else []

    # -- operations ----------------------------------------------------------------------

    def _lookup(self, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """From the row mirror when it can answer (:mod:`psclient.file_mirror`: one
        compiled probe per key, no LMDB search), else :meth:`_lookup_lmdb`."""
        if self._mirror is not None:
            got = self._mirror.read(keys)
            if got is not None:
                rows, found = got
                n = keys.shape[0]
                return (torch.from_numpy(rows).view(self._schema.torch_dtype).view(n, -1),
                        torch.from_numpy(found))
        return self._lookup_lmdb(keys)

    def _lookup_lmdb(self, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """One read transaction; each distinct key read once, in key order.

        NOTE: ``txn.get`` through C-level ``map`` (no Python code per key), with a row of
        zeros as the default: a miss is that very object, and reads as zeros. py-lmdb's
        native batched read (``Cursor.getmulti``) and zero-copy buffers were slower here,
        and LMDB's own search caps any read path through its API far below 5 M rows/s
        (measured: bench/RESULTS.md, "Issue 15").
        """
        order, ks, _ = self._sorted(keys, encode=False)
        first = first_of_runs(ks)
        distinct = ks[first]
        zero = bytes(self._schema.row_bytes)  # NOTE: a new object: identity marks a miss
        with _lmdb_errors(self._where), self._env.begin(db=self._rows) as txn:
            replies = list(map(txn.get, be_key_bytes(distinct), repeat(zero)))
        return assemble_distinct_rows(replies, zero, order, first, distinct, self._schema,
                                      self._table)

    def _lookup_per_key(self, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The earlier read path, kept as the reference that tests and the benchmark compare
        :meth:`_lookup` with: one ``txn.get`` per key, duplicates included, assembled by
        :func:`psclient.codec.assemble_rows`."""
        order, _, kb = self._sorted(keys)
        with _lmdb_errors(self._where), self._env.begin(db=self._rows) as txn:
            replies = list(map(txn.get, kb))
        return assemble_rows(replies, order, keys, self._schema, self._table)

    def _insert(self, keys: np.ndarray, values: torch.Tensor) -> None:
        order, ks, kb = self._sorted(keys)
        vb = row_bytes_list(values, order)
        with _lmdb_errors(self._where), self._writing() as mirror:
            with self._env.begin(write=True, db=self._rows) as txn:
                cur = txn.cursor()
                # NOTE: which keys exist already (exact change feed), then one putmulti.
                existed = np.fromiter(map(cur.set_key, kb), dtype=bool, count=ks.size)
                cur.putmulti(zip(kb, vb, strict=True), overwrite=True)
                if existed.any():
                    self._append_feed(txn, ks[existed])
            if mirror is not None:
                mirror.put(keys, _raw_rows(values))

    def _update(self, keys: np.ndarray, values: torch.Tensor) -> torch.Tensor:
        order, ks, kb = self._sorted(keys)
        vb = row_bytes_list(values, order)
        with _lmdb_errors(self._where), self._writing() as mirror:
            with self._env.begin(write=True, db=self._rows) as txn:
                cur = txn.cursor()
                existed_sorted = np.fromiter(map(cur.set_key, kb), dtype=bool, count=ks.size)
                if existed_sorted.any():
                    cur.putmulti(compress(zip(kb, vb, strict=True), existed_sorted),
                                 overwrite=True)
                    self._append_feed(txn, ks[existed_sorted])
            existed = np.zeros(keys.size, dtype=bool)
            existed[order] = existed_sorted
            if mirror is not None and existed_sorted.any():
                mirror.put(keys[existed], _raw_rows(values)[existed])
        return torch.from_numpy(existed)

    def _erase(self, keys: np.ndarray) -> None:
        _, ks, kb = self._sorted(keys)
        with _lmdb_errors(self._where), self._writing() as mirror:
            with self._env.begin(write=True, db=self._rows) as txn:
                deleted = np.fromiter(map(txn.delete, kb), dtype=bool, count=ks.size)
                if deleted.any():
                    self._append_feed(txn, ks[deleted])
            if mirror is not None and deleted.any():
                mirror.erase(ks[deleted])

    def _clear(self) -> None:
        with _lmdb_errors(self._where), self._writing() as mirror:
            with self._env.begin(write=True) as txn:
                txn.drop(self._rows, delete=False)
                self._append_feed(txn, None)
            if mirror is not None:
                mirror.clear()

    def _reserve(self, rows: int) -> None:
        if self._mirror is not None:
            self._mirror.reserve(rows)

    def _size(self) -> int:
        with _lmdb_errors(self._where), self._env.begin() as txn:
            return int(txn.stat(self._rows)["entries"])

    def _drop(self) -> None:
        with _lmdb_errors(self._where), self._writing() as mirror:
            with self._env.begin(write=True) as txn:
                txn.drop(self._rows, delete=True)
                txn.drop(self._feed_db, delete=True)
                txn.delete(self._schema_key, db=self._main)
                txn.delete(self._trim_key, db=self._main)
            if mirror is not None:
                mirror.retire()
        log.info("dropped %s", self._where)

    # -- change feed ---------------------------------------------------------------------

    def _append_feed(self, txn: Any, keys: np.ndarray | None) -> None:
        cur = txn.cursor(db=self._feed_db)
        seq = int.from_bytes(cur.key(), "big") if cur.last() else 0
        per = self._opts["feed_entry_keys"]
        if keys is None:
            recs = [b"c"]
        else:
            keys = np.unique(keys)
            # NOTE: b"K" + commit time: a layout-1 reader takes the time for one more key
            # (a superset, harmless), so an upgraded table stays safe for it.
            now = time.time_ns().to_bytes(8, "little")
            recs = [b"K" + now + keys[a:a + per].astype("<i8").tobytes()
                    for a in range(0, keys.size, per)]
        for rec in recs:
            seq += 1
            txn.put(_seq(seq), rec, db=self._feed_db)
        excess = int(txn.stat(self._feed_db)["entries"]) - self._opts["changes_maxlen"]
        trimmed = 0
        while excess > 0 and cur.first():  # bounded by the entries just added
            trimmed = int.from_bytes(cur.key(), "big")
            cur.delete()
            excess -= 1
        if trimmed:
            txn.put(self._trim_key, _seq(trimmed), db=self._main)

    def _cursor(self, seq: int) -> str:
        return f"{seq}:{self._schema.incarnation}"

    def _parse_cursor(self, since: str) -> tuple[int, bool]:
        """``(seq, same table)`` of a cursor; a plain number is a layout-1 cursor."""
        seq, sep, inc = since.partition(":")
        try:
            start = int(seq)
        except ValueError as e:
            raise BadArgumentError(
                f"bad change-feed cursor {since!r}: pass one returned by follow()") from e
        if start < 0:
            raise BadArgumentError(
                f"bad change-feed cursor {since!r}: pass one returned by follow()")
        return start, (not sep or inc == self._schema.incarnation)

    def _follow(self, since: str | None, limit: int, block_ms: int) -> FeedBatch:
        # NOTE: file:// is node-local: a blocking follow polls the store every
        # _POLL_S (a read transaction on the memory map, no syscall when nothing changed).
        deadline = time.monotonic() + block_ms / 1000
        while True:
            batch = self._read_feed(since, limit)
            if since is None or batch.cursor != since or time.monotonic() >= deadline:
                return batch
            time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))

    def _read_feed(self, since: str | None, limit: int) -> FeedBatch:
        with _lmdb_errors(self._where), self._env.begin(db=self._feed_db) as txn:
            cur = txn.cursor()
            last = int.from_bytes(cur.key(), "big") if cur.last() else 0
            if since is None:
                return make_batch([], self._cursor(last), [])
            start, same = self._parse_cursor(since)
            if not same:
                raise ChangeFeedGapError(
                    f"{self._where}: cursor {since} belongs to an earlier table of this name "
                    "(dropped and created again): drop every cached row of the table and "
                    "resume from err.cursor", cursor=self._cursor(last))
            if start > last:
                raise ChangeFeedGapError(
                    f"{self._where}: cursor {since} is ahead of the change feed (at {last}): "
                    "the store lost entries the cursor had read (restored from an older copy?); "
                    "drop every cached row of the table and resume from err.cursor",
                    cursor=self._cursor(last))
            trimmed = txn.get(self._trim_key, db=self._main)
            if trimmed is not None and start < int.from_bytes(trimmed, "big"):
                raise ChangeFeedGapError(
                    f"{self._where}: change-feed entries after cursor {since} were trimmed: drop "
                    "every cached row of the table and resume from err.cursor",
                    cursor=self._cursor(last))
            parts: list[np.ndarray] = []
            times: list[int] = []
            seq = start
            if cur.set_range(_seq(start + 1)):
                for key, rec in cur:
                    seq = int.from_bytes(key, "big")
                    kind = rec[:1]
                    if kind == b"c":
                        raise ChangeFeedGapError(
                            f"{self._where} was cleared at {seq}: drop every cached row of "
                            "the table and resume from err.cursor", cursor=self._cursor(seq))
                    if kind == b"K":  # layout 2: commit time, then the keys
                        times.append(int.from_bytes(rec[1:9], "little"))
                        parts.append(np.frombuffer(rec, dtype="<i8", offset=9))
                    else:              # layout 1: the keys alone
                        parts.append(np.frombuffer(rec, dtype="<i8", offset=1))
                    if len(parts) >= limit:
                        break
        return make_batch(parts, self._cursor(seq), times)

    # -- lifecycle -----------------------------------------------------------------------

    def _stat(self) -> dict[str, Any]:
        with self._env.begin() as txn:
            feed = int(txn.stat(self._feed_db)["entries"])
        info = self._env.info()
        return {"backend": "lmdb", "path": self._path, "feed_entries": feed,
                "map_size": info["map_size"], "readers": info["num_readers"],
                "mirror": self._mirror.info() if self._mirror is not None else None}

    def _after_fork(self) -> None:
        # NOTE: LMDB: an environment must not be used after fork; open our own in the child.
        self._env = _acquire_env(self._path, self._opts)
        if self._mirror is not None:
            self._mirror.after_fork()
        with self._env.begin(write=True) as txn:
            self._open_dbs(txn)

    def _close(self) -> None:
        if self._mirror is not None:
            self._mirror.close()
            self._mirror = None
        if self._env is not None:
            if (os.getpid(), self._path) in _ENVS:
                _release_env(self._path)
            self._env = None


def _raw_rows(values: torch.Tensor) -> np.ndarray:
    """A contiguous ``[N, dim]`` tensor's rows as uint8 ``[N, row_bytes]`` (a view)."""
    return values.view(torch.uint8).numpy().reshape(values.shape[0], -1)


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


def _parse_url(url: str, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
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
        typ = _OPTIONS.get(name)
        if typ is None:
            raise BadArgumentError(
                f"unknown file:// option {name!r}: use one of {sorted(_OPTIONS)}")
        try:
            opts[name] = _flag(value) if typ is bool else typ(value)
        except (TypeError, ValueError) as e:
            raise BadArgumentError(f"option {name}={value!r} must be {typ.__name__}"
                                   + (" (true/false, yes/no, on/off or 1/0)"
                                      if typ is bool else "")) from e
    return os.path.realpath(path), opts


def open_file(url: str, table: str, dim: int | None, dtype: str | None,
              options: dict[str, Any]) -> FileParameterServer:
    """Factory for ``file:///path`` URLs (the directory is created with the first table)."""
    path, opts = _parse_url(url, options)
    return FileParameterServer(path, table, dim, dtype, opts)


def list_file_tables(url: str, options: dict[str, Any]) -> list[str]:
    """Table names in the store at a ``file:///path`` URL, sorted; creates nothing.

    Raises:
        PSUnavailableError: there is no store at that path.
    """
    path, opts = _parse_url(url, options)
    where = f"file://{path}"
    if not (Path(path) / "data.mdb").is_file():
        raise PSUnavailableError(f"no store at {where} (no data.mdb there): check the path")
    opts = {**_DEFAULTS, **{k: v for k, v in opts.items() if k != "partitions"}}
    head = b"psc:schema:"
    with _lmdb_errors(where):
        env = _acquire_env(path, opts)
        try:
            with env.begin() as txn:
                cur = txn.cursor()
                names = []
                if cur.set_range(head):
                    for key in cur.iternext(values=False):
                        if not key.startswith(head):
                            break
                        names.append(key[len(head):].decode())
        finally:
            _release_env(path)
    return sorted(names)


__all__ = ["FileParameterServer", "be_bytes_to_keys", "list_file_tables", "open_file"]
