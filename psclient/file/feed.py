"""The ``file://`` store's change feed: written in the transaction of the rows it names,
read after a cursor (:mod:`psclient.file.backend` has the layout of ``feed:<T>``).

A cursor is ``<seq>:<incarnation>``: the last entry read, and the table it belongs to, so a
cursor of a dropped table is never read against its successor (a gap instead).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import numpy as np

from psclient.errors import BadArgumentError, ChangeFeedGapError
from psclient.feed import FeedBatch, make_batch
from psclient.schema import TableSchema

#: how often a blocking follow() looks at the (node-local) store again
_POLL_S = 0.002


def _seq(n: int) -> bytes:
    return n.to_bytes(8, "big")


class FileFeed:
    """The change feed of a table, mixed into
    :class:`psclient.file.backend.FileParameterServer` (which sets these attributes)."""

    _env: Any
    _feed_db: Any
    _main: Any
    _trim_key: bytes
    _where: str
    _opts: dict[str, Any]
    _schema: TableSchema

    def _guard(self) -> contextlib.AbstractContextManager[None]:
        raise NotImplementedError

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
        with self._guard(), self._env.begin(db=self._feed_db) as txn:
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
