"""The embedded default: a local, persistent LMDB store (``file:///path/to/dir``).

LMDB won over SQLite by measurement (docs/psclient.md): batched reads run in one read
transaction on a memory map, readers never block and never lock, one writer at a time is
serialized across processes by LMDB's robust lock, and copy-on-write B+trees make every
commit crash-safe (``sync=True`` by default).

Layout of one environment directory (any number of tables, two named databases each)::

    main db   b"psc:schema:<T>"    msgpack TableSchema
              b"psc:trimmed:<T>"   8-byte big-endian: highest change-feed seq trimmed
              b"psc:state:<T>"     only while the table is loading (psclient.file.store)
    b"rows:<T>"   key: 8 big-endian bytes of key ^ 2**63 (byte order = signed order)
                  value: raw row bytes (a quantized table's: payload and parameters)
    b"feed:<T>"   key: 8-byte big-endian seq; value: b"K" + 8-byte little-endian commit
                  time (ns since the epoch) + packed int64 keys (layout 1 wrote b"k" + keys,
                  still read), or b"c" (table cleared). Bounded to ``changes_maxlen``
                  entries.

The change feed is written in the same transaction as the rows, so it is exact and atomic:
it lists exactly the keys that existed before an insert/update/erase touched them. Every
write transaction first compares the schema record with the one this client opened, so a
write racing a drop (or a drop and a new table of the name) is refused with
:class:`TableDroppedError` and writes nothing; creating, joining, withdrawing from and
dropping a table are one transaction each (:mod:`psclient.file.store`, :mod:`psclient.loads`).

NOTE: LMDB forbids opening one environment twice in a process and using it after fork:
environments are shared per (pid, path) (:func:`psclient.file.store.acquire_env`) and
reopened in a child.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from itertools import compress, repeat
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import lmdb
import numpy as np

from nvecache.common import rows as row_formats
from nvecache.common.accumulate import sum_duplicates
from nvecache.common.lazy import lazy_import
from psclient.base import ParameterServer
from psclient.codec import (
    assemble_distinct_rows,
    be_bytes_to_keys,
    be_key_bytes,
    first_of_runs,
    row_bytes_list,
)
from psclient.errors import (
    BadArgumentError,
    PSUnavailableError,
    TableDroppedError,
    TableNotFoundError,
)
from psclient.file.feed import FileFeed
from psclient.file.mirror import RowMirror, scan_rows
from psclient.file.mirror_files import remove_mirror, store_lock
from psclient.file.store import DEFAULTS as _DEFAULTS
from psclient.file.store import FEED, ROWS, STATE, decode_state, encode_state, holds_env, parse_url
from psclient.file.store import acquire_env as _acquire_env
from psclient.file.store import list_file_tables as list_file_tables
from psclient.file.store import lmdb_errors as _lmdb_errors
from psclient.file.store import release_env as _release_env
from psclient.loads import LOADING, READY, Load, TableState, loading_error
from psclient.quantized import add_rows
from psclient.schema import TableSchema

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_import("torch", globals())

log = logging.getLogger(__name__)


class FileParameterServer(FileFeed, ParameterServer):
    """A table in a local LMDB environment. Create with :func:`psclient.connect`."""

    _env: Any = None
    _mirror: RowMirror | None = None

    def __init__(self, path: str, table: str, dim: int | None, dtype: str | None,
                 opts: dict[str, Any], mode: str = "open") -> None:
        self._path = path
        self._url = "file://" + quote(path)
        self._opts = {**_DEFAULTS, **opts}
        for name in ("changes_maxlen", "feed_entry_keys", "max_dbs", "map_size"):
            if self._opts[name] <= 0:
                raise BadArgumentError(f"option {name} must be positive")
        self._where = f"table {table!r} at file://{path}"
        self._schema_key = f"psc:schema:{table}".encode()
        self._trim_key = f"psc:trimmed:{table}".encode()
        self._state_key = STATE + table.encode()
        if dim is None and not (Path(path) / "data.mdb").exists():
            raise TableNotFoundError(f"{self._where} does not exist: pass dim= to create it")
        with _lmdb_errors(self._where):
            self._env = _acquire_env(path, self._opts)
            try:
                schema = self._open_schema(table, dim, dtype, opts.get("partitions"), mode)
                if self._opts["mirror"]:
                    self._mirror = self._open_mirror(table, schema.row_bytes)
            except BaseException:
                _release_env(path)
                self._env = None
                raise
        super().__init__(table, schema)

    def _open_mirror(self, table: str, row_bytes: int) -> RowMirror | None:
        """The table's row mirror (psclient.file.mirror), built from LMDB if it must be."""
        @contextlib.contextmanager
        def scan() -> Iterator[tuple[int, Iterator[tuple[list[bytes], list[bytes]]]]]:
            with self._env.begin(db=self._rows) as txn:
                yield int(txn.stat(self._rows)["entries"]), scan_rows(txn, self._rows)
        try:
            return RowMirror(self._path, table, row_bytes, scan,
                             lambda: int(self._env.info()["last_txnid"]), self._check_same)
        except OSError as e:
            log.warning("%s: no row mirror (%s); lookups search LMDB", self._where, e)
            return None

    def _writing(self) -> Any:
        """Around a write of rows: the mirror's writer protocol (file_mirror), or nothing."""
        return self._mirror.writing(self._check_same) if self._mirror is not None else \
            contextlib.nullcontext(None)

    def _dropping(self) -> Any:
        """Around a drop: the mirror's writer lock (whether this client keeps a mirror or
        not: another one may); a table gone meanwhile raises first (no mirror is rebuilt)."""
        return self._mirror.writing(self._check_same) if self._mirror is not None else \
            store_lock(self._path)

    def _dropped(self, what: str) -> TableDroppedError:
        return TableDroppedError(f"{self._where} {what}: connect again (`psclient ls URL` "
                                 "lists the tables there)")

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """LMDB's errors as psclient's; one that comes of the table's databases dropped
        under this client (another handle or process dropped the table) as
        :class:`TableDroppedError`."""
        try:
            with _lmdb_errors(self._where):
                yield
        except PSUnavailableError as e:
            if isinstance(e.__cause__, lmdb.Error) and not self._same_table():
                raise self._dropped("was dropped (or created anew) while this client used "
                                    "it") from e.__cause__
            raise

    def _live(self, txn: Any) -> None:
        """In a write transaction: refuse when the table is not the one this client opened."""
        if txn.get(self._schema_key, db=self._main) != self._schema_raw:
            raise self._dropped("was dropped (or created anew) while this client wrote it; "
                                "this write was refused")

    def _check_same(self) -> None:
        with _lmdb_errors(self._where):
            if not self._same_table():
                raise self._dropped("was dropped (or created anew) while this client wrote "
                                    "it; this write was refused")

    def _open_schema(self, table: str, dim: int | None, dtype: str | None,
                     partitions: int | None, mode: str) -> TableSchema:
        """Read, create or join the table: one write transaction (``mode``: ``open``, a
        ready table only; ``load``, create it ``loading`` or join it; ``partial``, any)."""
        with self._env.begin(write=True) as txn:
            raw = txn.get(self._schema_key)
            if raw is None:
                if dim is None:
                    raise TableNotFoundError(
                        f"{self._where} does not exist: pass dim= to create it")
                schema = TableSchema(dim=dim, dtype=dtype or "float32",
                                     partitions=partitions or 1, formats=row_formats.FORMATS)
                raw = schema.encode()
                txn.put(self._schema_key, raw)
                self._open_dbs(txn, fresh=True)
                if mode == "load":
                    self._load = Load.here()
                    txn.put(self._state_key, encode_state([self._load], 0))
                log.info("created %s: %s", self._where, schema)
                self._schema_raw = raw
                return schema
            schema = TableSchema.decode(raw, table)
            if schema.layout == 1:
                # NOTE: layout 1 -> 2 is transparent here: rows are unchanged, and a layout-1
                # client still attached reads the new feed records as a superset (b"K" + time).
                schema = TableSchema(dim=schema.dim, dtype=schema.dtype,
                                     partitions=schema.partitions, created=schema.created,
                                     formats=row_formats.FORMATS)
                raw = schema.encode()
                txn.put(self._schema_key, raw)
                log.info("upgraded %s to layout %d", self._where, schema.layout)
            schema.check(table, dim=dim, dtype=dtype, partitions=partitions)
            state = decode_state(txn.get(self._state_key))
            if state.state != READY and mode != "partial":
                if mode != "load":
                    raise loading_error(self._where, table, state)
                self._load = Load.here()
                loads = [x for x in state.loads if x.running() is not False]
                txn.put(self._state_key, encode_state([*loads, self._load], state.committed))
            self._open_dbs(txn, fresh=False)
            self._schema_raw = raw
            return schema

    def _open_dbs(self, txn: Any, *, fresh: bool) -> None:
        name = self._schema_key[len(b"psc:schema:"):]
        self._main = self._env.open_db(None, txn=txn)
        self._rows = self._env.open_db(ROWS + name, txn=txn, create=True)
        self._feed_db = self._env.open_db(FEED + name, txn=txn, create=True)
        if fresh:  # NOTE: what an older psclient may have left under the name is not ours
            txn.drop(self._rows, delete=False)
            txn.drop(self._feed_db, delete=False)
            txn.delete(self._trim_key, db=self._main)

    def _sorted(self, keys: np.ndarray, encode: bool = True
                ) -> tuple[np.ndarray, np.ndarray, list[bytes]]:
        """``(order, keys[order], their LMDB key bytes)`` (no bytes when not ``encode``)."""
        order = np.argsort(keys, kind="stable")  # NOTE: B-tree locality; keeps dup order
        ks = keys[order]
        return order, ks, be_key_bytes(ks) if encode else []

    # -- operations ----------------------------------------------------------------------

    def _lookup(self, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """From the row mirror when it can answer (:mod:`psclient.file.mirror`: one
        compiled probe per key, no LMDB search), else :meth:`_lookup_lmdb`."""
        if self._mirror is not None:
            got = self._mirror.read(keys)
            if got is not None:
                rows, found = got
                return (self._schema.stored_view(torch.from_numpy(rows), keys.shape[0]),
                        torch.from_numpy(found))
        return self._lookup_lmdb(keys)

    def _lookup_lmdb(self, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """One read transaction; each distinct key read once, in key order.

        NOTE: ``txn.get`` through C-level ``map`` (no Python code per key), with a row of
        zeros as the default: a miss is that very object, and reads as zeros. py-lmdb's
        native batched read (``Cursor.getmulti``) and zero-copy buffers were slower here,
        and LMDB's own search caps any read path through its API (measured:
        bench/RESULTS.md, "Parameter-server clients").
        """
        order, ks, _ = self._sorted(keys, encode=False)
        first = first_of_runs(ks)
        distinct = ks[first]
        zero = bytes(self._schema.row_bytes)  # NOTE: a new object: identity marks a miss
        with self._guard(), self._env.begin(db=self._rows) as txn:
            replies = list(map(txn.get, be_key_bytes(distinct), repeat(zero)))
        return assemble_distinct_rows(replies, zero, order, first, distinct, self._schema,
                                      self._table)

    def _insert(self, keys: np.ndarray, values: torch.Tensor) -> None:
        order, ks, kb = self._sorted(keys)
        vb = row_bytes_list(values, order)
        with self._guard(), self._writing() as mirror:
            with self._env.begin(write=True, db=self._rows) as txn:
                self._live(txn)
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
        with self._guard(), self._writing() as mirror:
            with self._env.begin(write=True, db=self._rows) as txn:
                self._live(txn)
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

    def _accumulate(self, keys: np.ndarray, deltas: torch.Tensor) -> torch.Tensor:
        """One write transaction (LMDB's one writer at a time, across processes): the
        distinct keys' rows read, their summed deltas added (a quantized row decoded,
        added to in float32, encoded: :func:`psclient.quantized.add_rows`), the rows
        written back. So two processes adding to a row never lose an addition; a sum that
        cannot be stored (a quantized row's overflow) aborts the transaction: nothing is
        written."""
        distinct, sums, inverse = sum_duplicates(torch.from_numpy(keys), deltas, self.dtype)
        ukeys = distinct.numpy()
        n = ukeys.size
        kb = be_key_bytes(ukeys)  # NOTE: ascending keys: B-tree order
        zero = bytes(self._schema.row_bytes)  # NOTE: a new object: identity marks a miss
        with self._guard(), self._writing() as mirror:
            with self._env.begin(write=True, db=self._rows) as txn:
                self._live(txn)
                replies = list(map(txn.get, kb, repeat(zero)))
                old, found = assemble_distinct_rows(replies, zero, np.arange(n),
                                                    np.ones(n, dtype=bool), ukeys, self._schema,
                                                    self._table)
                hit = found.numpy()
                new = add_rows(old[found], sums[found], self._schema, ukeys[hit])
                if hit.any():
                    txn.cursor().putmulti(zip(compress(kb, hit), row_bytes_list(new),
                                              strict=True), overwrite=True)
                    self._append_feed(txn, ukeys[hit])
            if mirror is not None and hit.any():
                mirror.put(ukeys[hit], _raw_rows(new))
        return found[inverse]

    def _erase(self, keys: np.ndarray) -> None:
        _, ks, kb = self._sorted(keys)
        with self._guard(), self._writing() as mirror:
            with self._env.begin(write=True, db=self._rows) as txn:
                self._live(txn)
                deleted = np.fromiter(map(txn.delete, kb), dtype=bool, count=ks.size)
                if deleted.any():
                    self._append_feed(txn, ks[deleted])
            if mirror is not None and deleted.any():
                mirror.erase(ks[deleted])

    def _clear(self) -> None:
        with self._guard(), self._writing() as mirror:
            with self._env.begin(write=True) as txn:
                self._live(txn)
                txn.drop(self._rows, delete=False)
                self._append_feed(txn, None)
            if mirror is not None:
                mirror.clear()

    def _reserve(self, rows: int) -> None:
        if self._mirror is not None:
            self._mirror.reserve(rows)

    def _size(self) -> int:
        with self._guard(), self._env.begin() as txn:
            return int(txn.stat(self._rows)["entries"])

    def _drop(self) -> None:
        with self._guard(), self._dropping() as mirror:
            with self._env.begin(write=True) as txn:
                if txn.get(self._schema_key, db=self._main) != self._schema_raw:
                    raise self._dropped("was dropped (or created anew) since this client "
                                        "opened it; nothing was deleted")
                self._drop_in(txn)
            self._retire(mirror)
        log.info("dropped %s", self._where)

    def _drop_in(self, txn: Any) -> None:
        txn.drop(self._rows, delete=True)
        txn.drop(self._feed_db, delete=True)
        for key in (self._schema_key, self._trim_key, self._state_key):
            txn.delete(key, db=self._main)

    def _retire(self, mirror: RowMirror | None) -> None:
        """After a drop, under :meth:`_dropping`: the table's mirror goes."""
        if mirror is not None:
            mirror.retire()
        else:
            remove_mirror(self._path, self._table)

    def _state(self) -> TableState:
        with _lmdb_errors(self._where), self._env.begin() as txn:
            return decode_state(txn.get(self._state_key, db=self._main))

    def _same_table(self) -> bool:
        with _lmdb_errors(self._where), self._env.begin() as txn:
            return bool(txn.get(self._schema_key, db=self._main) == self._schema_raw)

    def _withdraw(self, load: Load, *, ok: bool) -> str:
        """One transaction: the last load out drops the table if no load committed."""
        try:
            return self._withdraw_in(load, ok)
        except TableDroppedError:
            return "gone"

    def _withdraw_in(self, load: Load, ok: bool) -> str:
        with self._guard(), self._dropping() as mirror:
            with self._env.begin(write=True) as txn:
                if txn.get(self._schema_key, db=self._main) != self._schema_raw:
                    return "gone"
                state = decode_state(txn.get(self._state_key, db=self._main))
                if state.state == READY:
                    return READY
                left = [x for x in state.loads
                        if x.token != load.token and x.running() is not False]
                committed = state.committed + int(ok)
                if left:
                    txn.put(self._state_key, encode_state(left, committed), db=self._main)
                    return LOADING
                if committed:
                    txn.delete(self._state_key, db=self._main)
                    return READY
                self._drop_in(txn)
            self._retire(mirror)
        log.info("dropped %s: the loads that created it failed", self._where)
        return "dropped"

    # -- lifecycle -----------------------------------------------------------------------

    def _stat(self) -> dict[str, Any]:
        with self._guard(), self._env.begin() as txn:
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
        with _lmdb_errors(self._where), self._env.begin(write=True) as txn:
            if txn.get(self._schema_key) != self._schema_raw:
                txn.abort()
                _release_env(self._path)  # NOTE: the next call tries again, and fails again
                self._env = None
                raise self._dropped("was dropped (or created anew) since this client opened "
                                    "it")
            self._open_dbs(txn, fresh=False)

    def _close(self) -> None:
        if self._mirror is not None:
            self._mirror.close()
            self._mirror = None
        if self._env is not None:
            if holds_env(self._path):
                _release_env(self._path)
            self._env = None


def _raw_rows(values: torch.Tensor) -> np.ndarray:
    """A contiguous ``[N, dim]`` tensor's rows as uint8 ``[N, row_bytes]`` (a view)."""
    return values.view(torch.uint8).numpy().reshape(values.shape[0], -1)


def open_file(url: str, table: str, dim: int | None, dtype: str | None,
              options: dict[str, Any]) -> FileParameterServer:
    """Factory for ``file:///path`` URLs (the directory is created with the first table)."""
    rest = dict(options)
    loading, partial = bool(rest.pop("loading", False)), bool(rest.pop("partial", False))
    path, opts = parse_url(url, rest)
    return FileParameterServer(path, table, dim, dtype, opts,
                               "load" if loading else "partial" if partial else "open")


__all__ = ["FileParameterServer", "be_bytes_to_keys", "list_file_tables", "open_file"]
