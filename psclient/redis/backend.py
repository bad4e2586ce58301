"""The Redis / Redis Cluster backend.

Layout 2 of table ``T`` (prefix ``psc``, ``P`` partitions fixed at creation)::

    psc:{T}:schema          string   msgpack TableSchema (layout 2)
    psc:{T}:state           hash     only while the table is not ready (psclient.redis.tables)
    psc:{T:p}               hash     field = key as 8 little-endian bytes, value = raw row bytes
                                     (a quantized table's: payload and parameters)
    psc:{T:p}:changes       stream   partition p's change feed (psclient.redis.scripts)
    psc:{T:p}:last          string   the ID of that stream's newest entry
    psc:{T:p}:live          string   the table's existence marker in p's slot (writes check it)
    psc:{T:p}:acc, :accz    hash, zset  accumulate's receipts (psclient.redis.scripts)
    psc:{T}:bell            channel  (cluster) the writers' doorbell for blocked followers

Key ``k`` lives in partition ``fmix64(k) % P``. The hash tag ``{T:p}`` puts a partition, its
stream and its ``last`` key in one cluster slot, so a partition chunk's rows and its feed
record are written by one Lua script (:mod:`psclient.redis.scripts`): atomic on one server
and on a cluster, while the partitions spread the table over every master. Hashes beat plain
keys by measurement (docs/psclient.md, "Hashes (HMGET/HSET) or plain keys") and give O(P)
size/clear.

A batch is grouped by partition and cut into commands of at most ``chunk_keys`` keys:
``HMGET`` for lookups, one ``EVAL`` of a script for every write (accumulate: a lookup, then
a compare-and-set script, :mod:`psclient.redis.accumulate`).
:class:`psclient.redis.dispatch.Dispatcher` packs them into pipelines per node and follows
cluster redirections; :mod:`psclient.redis.feed` reads and waits on the change feed;
:mod:`psclient.redis.tables` creates, publishes and drops the table. This module keeps the
table: layout, encoding, operations.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import redis.exceptions as rex

from nvecache.common.lazy import lazy_import
from psclient.base import ParameterServer
from psclient.codec import group_by_partition
from psclient.errors import (
    BadArgumentError,
    PSServerError,
    SchemaMismatchError,
    TableDroppedError,
)
from psclient.feed import FeedBatch
from psclient.quantized import add_rows
from psclient.redis import resp, scripts
from psclient.redis.accumulate import compare_and_add, swap_commands
from psclient.redis.conn import (
    cluster_factory,
    redact,
    redis_errors,
    split_options,
    standalone_factory,
)
from psclient.redis.dispatch import Cmd, Dispatcher
from psclient.redis.feed import RedisFeed
from psclient.redis.lane import Lanes
from psclient.redis.lookups import RedisLookups
from psclient.redis.tables import RedisTableLife
from psclient.schema import TableSchema

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_import("torch", globals())

log = logging.getLogger(__name__)


_DEFAULTS = {"chunk_keys": 512, "pipeline_keys": 1024, "inline_keys": 8192, "at_once_keys": 64,
             "changes_maxlen": 1000, "feed_entry_keys": 4096, "prefix": "psc",
             "max_workers": 4, "feed_sweep_ms": 250, "redirect_retries": 60, "upgrade": False}
_SCRIPTS = {b"UPDATE": scripts.UPDATE, b"ERASE": scripts.ERASE}
_MULTI, _EXEC = resp.pack("MULTI"), resp.pack("EXEC")
_FIELD = resp.field_records(np.zeros(1, dtype=np.int64)).dtype.itemsize  # 14 bytes per key


class RedisParameterServer(RedisTableLife, RedisLookups, ParameterServer):
    """A table on one Redis server or a Redis Cluster. Create with :func:`psclient.connect`."""

    _client: Any = None
    _schema_raw = b""
    _dispatch: Dispatcher | None = None
    _feed: RedisFeed | None = None
    _lanes: Lanes | None = None

    def __init__(self, make_client: Any, url: str, table: str, dim: int | None,
                 dtype: str | None, opts: dict[str, Any], cluster: bool,
                 mode: str = "open") -> None:
        self._make_client = make_client
        self._url = redact(url)
        self._cluster = cluster
        self._opts = {**_DEFAULTS, **opts}
        for name in ("chunk_keys", "pipeline_keys", "changes_maxlen", "feed_entry_keys",
                     "max_workers", "feed_sweep_ms", "redirect_retries"):
            if self._opts[name] <= 0:
                raise BadArgumentError(f"option {name} must be positive")
        if self._opts["inline_keys"] < 0:
            raise BadArgumentError("option inline_keys must be >= 0 (0: always split a batch "
                                   "into pipelines of pipeline_keys)")
        if self._opts["at_once_keys"] < 0:
            raise BadArgumentError("option at_once_keys must be >= 0 (0: always hand each "
                                   "lookup reply over as it arrives)")
        self._where = f"table {table!r} at {self._url}"
        pre = self._opts["prefix"]
        self._schema_key = f"{pre}:{{{table}}}:schema"
        self._state_key = f"{pre}:{{{table}}}:state"
        self._client = make_client()
        schema, creator = self._open_schema(table, dim, dtype, opts.get("partitions"))
        super().__init__(table, schema)
        self._part_keys = [f"{pre}:{{{table}:{p}}}".encode() for p in range(schema.partitions)]
        self._tails()
        self._part_bulks = [resp.bulk(k) for k in self._part_keys]
        bell = f"{pre}:{{{table}}}:bell".encode()
        self._dispatch = Dispatcher(self._client, cluster, self._part_keys, self._opts,
                                    self._where, bell if cluster else None)
        self._feed = RedisFeed(self, bell, self._opts["feed_sweep_ms"])
        self._lookup_setup(self._part_bulks)
        try:
            self._settle(creator, mode)
        except BaseException:
            self.close()
            raise

    def _tails(self) -> None:
        """Per partition, what follows a write script's name: its keys, the stream's MAXLEN
        and the table's token (psclient.redis.scripts); and its insert's closing FENCE."""
        maxlen = resp.bulk(str(self._opts["changes_maxlen"]).encode())
        token = resp.bulk(self._schema.token.encode())
        self._marked = self._schema.marked
        self._part_tails = [resp.bulk(k) + resp.bulk(k + b":changes") + resp.bulk(k + b":last")
                            + resp.bulk(k + b":live") + resp.bulk(k + b":held") + maxlen + token
                            for k in self._part_keys]
        self._fences = [resp.pack("EVAL", scripts.FENCE, 2, k, k + b":held")
                        for k in self._part_keys]

    # -- what redis_feed uses ------------------------------------------------------------

    @property
    def part_keys(self) -> list[bytes]:
        """The partition hashes' key names, by partition."""
        return self._part_keys

    @property
    def where(self) -> str:
        """``table 'T' at URL`` (for messages)."""
        return self._where

    @property
    def cluster(self) -> bool:
        """Whether the store is a Redis Cluster."""
        return self._cluster

    @property
    def client(self) -> Any:
        """The redis-py client (``Redis`` or ``RedisCluster``)."""
        return self._client

    @property
    def socket_timeout(self) -> float:
        """The connections' socket timeout in seconds."""
        return float(self._client.get_connection_kwargs().get("socket_timeout") or 2.0)

    def option(self, name: str) -> Any:
        """A table option's value."""
        return self._opts[name]

    @property
    def schema_key(self) -> str:
        """The key of the stored schema record."""
        return self._schema_key

    @property
    def schema_record(self) -> bytes:
        """The schema record this handle opened the table with."""
        return self._schema_raw

    def adopt_schema(self, raw: bytes | None) -> str:
        """After the table was created anew: take its schema if the geometry is the same.

        Returns what happened, for the gap's message.
        """
        if raw is None:
            return "the table is gone (dropped, or a restart lost it)"
        new = TableSchema.decode(raw, self._table)
        old = self._schema
        if (new.layout, new.dim, new.dtype, new.partitions) != (
                old.layout, old.dim, old.dtype, old.partitions):
            raise SchemaMismatchError(
                f"{self._where} was created anew with another schema: dim {new.dim}, dtype "
                f"{new.dtype}, {new.partitions} partitions, layout {new.layout} (this handle "
                f"opened dim {old.dim}, dtype {old.dtype}, {old.partitions}): connect again")
        self._schema, self._schema_raw = new, raw
        self._tails()
        return "the table was created anew (dropped, or lost in a restart, and written again)"

    def run_commands(self, cmds: list[tuple[int, bytes]]) -> list[Any]:
        """Run small encoded commands, each on the node of its partition; replies in order."""
        return self._run([Cmd(p, 0, 1, [c]) for p, c in cmds])

    # -- dispatch ------------------------------------------------------------------------

    def _run(self, cmds: list[Cmd], job: Any = None, finish: Any = None, *,
             bell: bool = False) -> list[Any]:
        """Execute commands on the partitions' nodes; replies in order (see Dispatcher.run)."""
        assert self._dispatch is not None
        with redis_errors(self._where):
            try:
                return self._dispatch.run(cmds, job, finish, bell=bell)
            except rex.ResponseError as e:
                if str(e).startswith(scripts.GONE):
                    raise self._dropped("was dropped (or created anew) while this client "
                                        "wrote it; this write was refused") from e
                raise

    def _write(self, cmds: list[Cmd], transactions: bool = False, *,
               repeat: bool = True) -> list[Any]:
        """Run write commands (a table created before markers gets them first). Refused,
        while the schema is still the one this client opened, the store lost markers (a
        restart without persistence, a flush): the partitions are marked again, and the
        commands run once more (every write step but accumulate's is safe to repeat; with
        ``repeat=False`` the write is refused instead)."""
        if not self._marked:
            self._adopt()
        try:
            return self._checked(self._run(cmds, bell=self._cluster), transactions)
        except TableDroppedError as e:
            if self.stored_schema() != self._schema_raw:
                raise
            log.warning("%s: partition markers were missing (the store lost keys: a restart "
                        "without persistence?); marking them again", self._where)
            self._adopt()
            if not repeat:
                raise PSServerError(
                    f"{self._where}: the store lost the table's partition markers (a restart "
                    "without persistence?) during an accumulate; they are marked again. Rows "
                    "of other partitions may have been added to: read them before adding "
                    "again") from e
            return self._checked(self._run(cmds, bell=self._cluster), transactions)

    def _checked(self, replies: list[Any], transactions: bool) -> list[Any]:
        """Raise the first error inside an ``EXEC`` reply (insert's script, HSET, FENCE)."""
        for reply in replies if transactions else ():
            err = next((r for r in reply if isinstance(r, Exception)), None) \
                if isinstance(reply, list) else None
            if err is not None:
                with redis_errors(self._where):
                    if str(err).startswith(scripts.GONE):
                        raise self._dropped("was dropped (or created anew) while this client "
                                            "wrote it; this write was refused") from err
                    raise err
        return replies

    def _batch(self, script: bytes, keys: np.ndarray, values: torch.Tensor | None
               ) -> tuple[np.ndarray, np.ndarray, list[Cmd]]:
        """Group a write's keys by partition and encode one command per chunk of a
        partition: for ``INSERT``, the insert transaction (module docstring of
        :mod:`psclient.redis.scripts`), else an ``EVAL`` of that script. (A lookup's
        commands: :mod:`psclient.redis.hmget`.)"""
        order, bounds = group_by_partition(keys, self._schema.partitions)
        ks = keys[order]
        if values is None:
            rec = resp.field_records(ks)
            per_key = 1
        else:
            rows = values.view(torch.uint8).numpy().reshape(keys.size, -1)
            rec = resp.field_value_records(ks, rows[order])
            per_key = 2
        ck = self._opts["chunk_keys"]
        size = rec.dtype.itemsize
        raw = resp.as_buffer(rec)  # NOTE: one buffer; commands send slices of it (no copy)
        insert = script == b"INSERT"
        if insert:
            fields = resp.as_buffer(resp.field_records(ks))
            notice = resp.bulk(b"EVAL") + resp.bulk(scripts.INSERT_NOTICE) + resp.bulk(b"5")
        if insert:
            lead, nlead, tails = resp.bulk(b"HSET"), 2, self._part_bulks
        else:
            lead = resp.bulk(b"EVAL") + resp.bulk(_SCRIPTS[script]) + resp.bulk(b"5")
            nlead, tails = 10, self._part_tails
        cmds: list[Cmd] = []
        bl = bounds.tolist()
        for p in np.flatnonzero(bounds[1:] > bounds[:-1]).tolist():
            a, b = bl[p], bl[p + 1]
            tail = tails[p]
            for s in range(a, b, ck):
                e = min(b, s + ck)
                head = b"*%d\r\n%b%b" % (nlead + per_key * (e - s), lead, tail)
                if insert:
                    check = b"*%d\r\n%b%b" % (10 + e - s, notice, self._part_tails[p])
                    cmds.append(Cmd(p, s, e, [_MULTI, check, fields[s * _FIELD:e * _FIELD], head,
                                              raw[s * size:e * size], self._fences[p], _EXEC],
                                    5))
                else:
                    cmds.append(Cmd(p, s, e, [head, raw[s * size:e * size]]))
        return order, ks, cmds

    def _per_partition(self, script: bytes, *args: bytes | str) -> list[Cmd]:
        """One small command per partition: ``script`` on its keys, or ``args`` + its key."""
        if script:
            maxlen, token = self._opts["changes_maxlen"], self._schema.token
            return [Cmd(p, 0, 1, [resp.pack("EVAL", script, 5, k, k + b":changes",
                                             k + b":last", k + b":live", k + b":held", maxlen,
                                             token)])
                    for p, k in enumerate(self._part_keys)]
        return [Cmd(p, 0, 1, [resp.pack(*args, k)]) for p, k in enumerate(self._part_keys)]

    # -- operations ----------------------------------------------------------------------

    def _insert(self, keys: np.ndarray, values: torch.Tensor) -> None:
        # NOTE: one transaction per chunk notices the keys that existed and writes the rows.
        _, _, cmds = self._batch(b"INSERT", keys, values)
        self._write(cmds, transactions=True)

    def _update(self, keys: np.ndarray, values: torch.Tensor) -> torch.Tensor:
        order, _, cmds = self._batch(b"UPDATE", keys, values)
        flags = b"".join(self._write(cmds))
        existed = np.zeros(keys.size, dtype=bool)
        existed[order] = np.frombuffer(flags, dtype=np.uint8) == ord("1")
        return torch.from_numpy(existed)

    def _accumulate(self, keys: np.ndarray, deltas: torch.Tensor) -> torch.Tensor:
        # NOTE: read, add here (a quantized row: decoded, added to, encoded), and write
        # each row only if its stored bytes are still the ones read
        # (psclient.redis.scripts.ACCUMULATE); rows another writer changed meanwhile are
        # read again and retried
        schema = self._schema
        return compare_and_add(keys, deltas, self.dtype, self._lookup, self._swap,
                               self._where, add=lambda r, s, k: add_rows(r, s, schema, k))

    def _swap(self, keys: np.ndarray, old: torch.Tensor, new: torch.Tensor) -> np.ndarray:
        """One compare-and-set per key: uint8 flags ``1`` / ``0`` / ``r`` (the script's)."""
        order, cmds = swap_commands(keys, old, new, self._part_keys, self._opts,
                                    self._schema.token)
        flags = np.empty(keys.size, dtype=np.uint8)
        flags[order] = np.frombuffer(b"".join(self._write(cmds, repeat=False)), dtype=np.uint8)
        return flags

    def _erase(self, keys: np.ndarray) -> None:
        _, _, cmds = self._batch(b"ERASE", keys, None)
        self._write(cmds)

    def _clear(self) -> None:
        self._write(self._per_partition(scripts.CLEAR))

    def _size(self) -> int:
        return sum(int(n) for n in self._run(self._per_partition(b"", "HLEN")))

    # -- change feed ---------------------------------------------------------------------

    def _follow(self, since: str | None, limit: int, block_ms: int) -> FeedBatch:
        assert self._feed is not None
        with redis_errors(self._where):
            return self._feed.follow(since, limit, block_ms)

    # -- lifecycle -----------------------------------------------------------------------

    def _stat(self) -> dict[str, Any]:
        with redis_errors(self._where):
            nodes = len(self._client.get_primaries()) if self._cluster else 1
        feed = sum(int(n) for n in self.run_commands(
            [(p, resp.pack("XLEN", k + b":changes")) for p, k in enumerate(self._part_keys)]))
        return {"backend": "redis-cluster" if self._cluster else "redis", "url": self._url,
                "masters": nodes, "feed_entries": feed}

    def _after_fork(self) -> None:
        # NOTE: the parent's sockets and pool threads are not ours: drop them unclosed
        # (closing would shut the parent's sockets down) and build fresh ones.
        log.debug("%s: fork detected, reconnecting in pid child", self._where)
        self._client = self._make_client()
        if self._dispatch is not None:
            self._dispatch.forget(self._client)
        if self._feed is not None:
            self._feed.forget()
        self._lanes = Lanes(self._client)

    def _close(self) -> None:
        if self._feed is not None:
            self._feed.close()
        if self._dispatch is not None:
            self._dispatch.close()
        if self._client is not None:
            try:
                self._client.close()
            except rex.RedisError:  # closing a dead connection: nothing left to release
                pass
            self._client = None


def open_mode(options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``connect``'s ``loading=``/``partial=`` as an open mode (``load``, ``partial`` or
    ``open``), and the other options."""
    rest = dict(options)
    loading, partial = bool(rest.pop("loading", False)), bool(rest.pop("partial", False))
    return ("load" if loading else "partial" if partial else "open"), rest


def open_standalone(url: str, table: str, dim: int | None, dtype: str | None,
                    options: dict[str, Any]) -> RedisParameterServer:
    """Factory for ``redis://``, ``rediss://`` and ``unix://`` URLs."""
    mode, options = open_mode(options)
    base, topts, conn = split_options(url, options)
    return RedisParameterServer(standalone_factory(base, conn), base, table, dim, dtype, topts,
                                cluster=False, mode=mode)


def open_cluster(url: str, table: str, dim: int | None, dtype: str | None,
                 options: dict[str, Any]) -> RedisParameterServer:
    """Factory for ``redis+cluster://host:port[,host:port]`` URLs."""
    mode, options = open_mode(options)
    base, topts, conn = split_options(url, options)
    with redis_errors(f"table {table!r} at {redact(base)}"):
        make = cluster_factory(base, conn)
        return RedisParameterServer(make, base, table, dim, dtype, topts, cluster=True,
                                    mode=mode)
