"""The Redis / Redis Cluster backend.

Layout of table ``T`` (prefix ``psc``, ``P`` partitions fixed at creation)::

    psc:{T}:schema      string   msgpack TableSchema
    psc:{T:p}           hash     field = key as 8 little-endian bytes, value = raw row bytes
    psc:{T}:changes     stream   entries {"k": packed int64 keys} or {"clear": ""}

Key ``k`` lives in partition ``fmix64(k) % P``. The hash tag ``{T:p}`` puts a partition
in one cluster slot, so one HMGET/HSET per partition chunk is legal on a cluster while
the partitions spread the table over every master. Hashes beat plain keys by
measurement (docs/psclient.md, "Hashes (HMGET/HSET) or plain keys") and give O(P)
size/clear.

A batch is grouped by partition, cut into commands of at most ``chunk_keys`` keys, and
the commands of whole partitions are packed into pipelines (no MULTI) of about
``pipeline_keys`` keys, one node per pipeline, run concurrently on a thread pool. The
commands' bytes come from :mod:`psclient.resp`; :mod:`psclient.redis_wire` sends them and
reads the replies. This module keeps the table: layout, dispatch, change feed.

NOTE: all chunks of one partition go into the same pipeline, in key order, so the last
of duplicate keys in a batch wins, as in a dict.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import redis.exceptions as rex
import torch

from . import resp
from .base import ParameterServer
from .codec import group_by_partition
from .errors import (
    BadArgumentError,
    ChangeFeedGapError,
    CorruptValueError,
    PSServerError,
    SchemaMismatchError,
    TableNotFoundError,
)
from .feed import FeedBatch, make_batch
from .redis_conn import cluster_factory, redact, redis_errors, split_options, standalone_factory
from .redis_wire import reply_error, run_pipeline, run_row_pipeline
from .schema import TableSchema

log = logging.getLogger(__name__)


class Cmd(NamedTuple):
    """One encoded command: partition, the range of sorted keys it covers, its bytes."""

    part: int
    start: int
    stop: int
    payload: list[bytes | memoryview]


# Writes only fields that exist; returns one '0'/'1' per field (atomic per partition).
_UPDATE_LUA = b"""
local out = {}
for i = 1, #ARGV, 2 do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 1 then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    out[#out + 1] = '1'
  else
    out[#out + 1] = '0'
  end
end
return table.concat(out)
"""

_DEFAULTS = {"chunk_keys": 512, "pipeline_keys": 1024, "changes_maxlen": 1000,
             "feed_entry_keys": 4096, "prefix": "psc", "max_workers": 4}


def _stream_id(s: str | bytes) -> tuple[int, int]:
    if isinstance(s, bytes):
        s = s.decode()
    ms, _, seq = s.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError as e:
        raise BadArgumentError(
            f"bad change-feed cursor {s!r}: pass one returned by changes()"
        ) from e


class RedisParameterServer(ParameterServer):
    """A table on one Redis server or a Redis Cluster. Create with :func:`psclient.connect`."""

    _client: Any = None
    _executor: ThreadPoolExecutor | None = None

    def __init__(self, make_client: Any, url: str, table: str, dim: int | None,
                 dtype: str | None, opts: dict[str, Any], cluster: bool) -> None:
        self._make_client = make_client
        self._url = redact(url)
        self._cluster = cluster
        self._opts = {**_DEFAULTS, **opts}
        for name in ("chunk_keys", "pipeline_keys", "changes_maxlen", "feed_entry_keys",
                     "max_workers"):
            if self._opts[name] <= 0:
                raise BadArgumentError(f"option {name} must be positive")
        self._where = f"table {table!r} at {self._url}"
        pre = self._opts["prefix"]
        self._schema_key = f"{pre}:{{{table}}}:schema"
        self._stream_key = f"{pre}:{{{table}}}:changes"
        self._client = make_client()
        schema = self._open_schema(table, dim, dtype, opts.get("partitions"))
        super().__init__(table, schema)
        self._part_keys = [f"{pre}:{{{table}:{p}}}".encode() for p in range(schema.partitions)]
        self._part_bulks = [resp.bulk(k) for k in self._part_keys]
        self._node_of: list[Any] | None = None

    # -- schema --------------------------------------------------------------------------

    def _open_schema(self, table: str, dim: int | None, dtype: str | None,
                     partitions: int | None) -> TableSchema:
        with redis_errors(self._where):
            raw = self._client.get(self._schema_key)
            if raw is None:
                if dim is None:
                    raise TableNotFoundError(
                        f"{self._where} does not exist: pass dim= (and dtype=) to create it"
                    )
                if partitions is None:
                    masters = len(self._client.get_primaries()) if self._cluster else 1
                    partitions = max(64, 8 * masters)
                schema = TableSchema(dim=dim, dtype=dtype or "float32", partitions=partitions)
                if self._client.set(self._schema_key, schema.encode(), nx=True):
                    log.info("created %s: %s", self._where, schema)
                    return schema
                raw = self._client.get(self._schema_key)  # lost a creation race: use theirs
                if raw is None:
                    raise SchemaMismatchError(f"{self._where} was dropped while being created")
            schema = TableSchema.decode(raw, table)
            schema.check(table, dim=dim, dtype=dtype, partitions=partitions)
            return schema

    # -- dispatch ------------------------------------------------------------------------

    def _nodes(self) -> list[Any]:
        """The client that serves each partition (one client when standalone)."""
        if self._node_of is None:
            if not self._cluster:
                self._node_of = [self._client] * self._schema.partitions
            else:
                nm = self._client.nodes_manager
                self._node_of = [
                    self._client.get_redis_connection(
                        nm.get_node_from_slot(self._client.keyslot(k)))
                    for k in self._part_keys
                ]
        return self._node_of

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._opts["max_workers"],
                                                thread_name_prefix="psclient")
        return self._executor

    def _run(self, cmds: list[Cmd], job: Any = None) -> list[Any]:
        """Execute commands; return their replies in order.

        ``job(client, commands)`` runs one pipeline (default:
        :func:`psclient.redis_wire.run_pipeline`).
        """
        try:
            with redis_errors(self._where):
                return self._dispatch(cmds, job)
        except PSServerError as e:
            if not self._cluster or not isinstance(e.__cause__, (rex.MovedError, rex.AskError)):
                raise
        # NOTE: the slot map changed under us (resharding/failover): refresh it and send the
        # batch once more; every command here is idempotent per key.
        log.info("%s: cluster topology changed, refreshing the slot map", self._where)
        with redis_errors(self._where):
            self._client.nodes_manager.initialize()
            self._node_of = None
            return self._dispatch(cmds, job)

    def _dispatch(self, cmds: list[Cmd], job: Any) -> list[Any]:
        nodes = self._nodes()
        jobs: dict[int, list[list[int]]] = {}  # id(node) -> pipelines (command indices)
        clients: dict[int, Any] = {}
        rows_in_last: dict[int, int] = {}
        last_part: dict[int, int] = {}
        limit = self._opts["pipeline_keys"]
        for i, cmd in enumerate(cmds):
            node = nodes[cmd.part]
            nid = id(node)
            clients[nid] = node
            pipes = jobs.setdefault(nid, [])
            # NOTE: a new pipeline starts only at a partition boundary (keeps duplicate order)
            if not pipes or (rows_in_last[nid] >= limit and last_part[nid] != cmd.part):
                pipes.append([])
                rows_in_last[nid] = 0
            pipes[-1].append(i)
            rows_in_last[nid] += cmd.stop - cmd.start
            last_part[nid] = cmd.part
        work = [(clients[nid], idx) for nid, pipes in jobs.items() for idx in pipes]

        def execute(work_item: tuple[Any, list[int]]) -> list[Any]:
            client, idx = work_item
            if job is not None:
                return job(client, [cmds[i] for i in idx])
            return run_pipeline(client, [part for i in idx for part in cmds[i].payload], len(idx))

        out: list[Any] = [None] * len(cmds)
        if len(work) == 1:
            results = [execute(work[0])]
        else:
            results = list(self._pool().map(execute, work))
        for (_, idx), res in zip(work, results, strict=True):
            for i, r in zip(idx, res, strict=True):
                out[i] = r
        return out

    def _batch(self, name: bytes, keys: np.ndarray, values: torch.Tensor | None
               ) -> tuple[np.ndarray, np.ndarray, list[Cmd]]:
        """Group keys by partition and encode one command per chunk of a partition."""
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
        if name == b"EVAL":
            lead, nlead = resp.bulk(b"EVAL") + resp.bulk(_UPDATE_LUA) + resp.bulk(b"1"), 4
        else:
            lead, nlead = resp.bulk(name), 2
        cmds: list[Cmd] = []
        bl = bounds.tolist()
        for p in np.flatnonzero(bounds[1:] > bounds[:-1]).tolist():
            a, b = bl[p], bl[p + 1]
            tail = self._part_bulks[p]
            for s in range(a, b, ck):
                e = min(b, s + ck)
                head = b"*%d\r\n%b%b" % (nlead + per_key * (e - s), lead, tail)
                cmds.append(Cmd(p, s, e, [head, raw[s * size:e * size]]))
        return order, ks, cmds

    def _control(self, *args: bytes | str) -> list[Cmd]:
        """One small command per partition (``args`` then the partition key)."""
        return [Cmd(p, 0, 1, [resp.pack(*args, k)]) for p, k in enumerate(self._part_keys)]

    # -- operations ----------------------------------------------------------------------

    def _lookup(self, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        order, ks, cmds = self._batch(b"HMGET", keys, None)
        n, rb = keys.size, self._schema.row_bytes
        values = np.empty(n, dtype=f"V{rb}")  # NOTE: one element per row (fast scatter)
        found = np.zeros(n, dtype=bool)
        rec_len = len(b"$%d\r\n" % rb) + rb + 2

        def job(client: Any, mine: list[Cmd]) -> list[None]:
            # NOTE: runs on the pool; each job writes only the rows of its own commands.
            expect = sum(c.stop - c.start for c in mine) * rec_len + 16 * len(mine)
            payload = [part for c in mine for part in c.payload]
            replies = run_row_pipeline(client, payload, len(mine), expect, rb)
            for c, reply in zip(mine, replies, strict=True):
                self._place(order[c.start:c.stop], reply, ks[c.start:c.stop], values, found)
            return [None] * len(mine)

        self._run(cmds, job)
        flat = values.view(np.uint8)
        out = torch.from_numpy(flat).view(self._schema.torch_dtype).reshape(n, self.dim)
        return out, torch.from_numpy(found)

    def _place(self, dest: np.ndarray, reply: Any, keys: np.ndarray, values: np.ndarray,
               found: np.ndarray) -> None:
        """Write one HMGET reply (fast row view or decoded list) to rows ``dest`` of the output.

        ``values`` is the output as a 1-D ``V<row_bytes>`` array (one element per row).
        """
        if isinstance(reply, np.ndarray):
            values[dest] = reply
            found[dest] = True
            return
        if isinstance(reply, Exception):
            raise reply_error(reply)
        obj = np.empty(len(reply), dtype=object)
        obj[:] = reply
        hit = obj != None  # noqa: E711 -- elementwise on an object array
        rows = obj[hit].tolist()
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        bad = np.flatnonzero(lengths != self._schema.row_bytes)
        if bad.size:
            key = int(keys[np.flatnonzero(hit)[bad[0]]])
            raise CorruptValueError(
                f"table {self._table!r}, key {key}: stored value has {int(lengths[bad[0]])} "
                f"bytes, expected {self._schema.row_bytes} (dim {self.dim} x "
                f"{self._schema.dtype}); rewrite it with insert() or drop the table")
        values.view(np.uint8).reshape(values.size, -1)[dest[~hit]] = 0
        if rows:
            values[dest[hit]] = np.fromiter(rows, dtype=values.dtype, count=len(rows))
        found[dest] = hit

    def _insert(self, keys: np.ndarray, values: torch.Tensor) -> None:
        _, ks, cmds = self._batch(b"HSET", keys, values)
        added = self._run(cmds)
        # NOTE: HSET answers how many fields were new; a chunk where fewer were new than
        # sent overwrote something, so its keys go to the change feed (a superset).
        changed = [ks[c.start:c.stop] for c, n in zip(cmds, added, strict=True)
                   if int(n) < c.stop - c.start]
        if changed:
            self._feed(np.concatenate(changed))

    def _update(self, keys: np.ndarray, values: torch.Tensor) -> torch.Tensor:
        order, ks, cmds = self._batch(b"EVAL", keys, values)
        flags = b"".join(self._run(cmds))
        existed_sorted = np.frombuffer(flags, dtype=np.uint8) == ord("1")
        existed = np.zeros(keys.size, dtype=bool)
        existed[order] = existed_sorted
        if existed_sorted.any():
            self._feed(ks[existed_sorted])
        return torch.from_numpy(existed)

    def _erase(self, keys: np.ndarray) -> None:
        _, ks, cmds = self._batch(b"HDEL", keys, None)
        self._run(cmds)
        self._feed(ks)

    def _clear(self) -> None:
        self._run(self._control("UNLINK"))
        self._feed(None)

    def _size(self) -> int:
        return sum(int(n) for n in self._run(self._control("HLEN")))

    def _drop(self) -> None:
        self._run(self._control("UNLINK"))
        with redis_errors(self._where):
            self._client.delete(self._stream_key)
            self._client.delete(self._schema_key)
        log.info("dropped %s", self._where)

    # -- change feed ---------------------------------------------------------------------

    def _feed(self, keys: np.ndarray | None) -> None:
        """Append changed keys (or a clear marker) to the bounded stream, after the write."""
        maxlen = self._opts["changes_maxlen"]
        per = self._opts["feed_entry_keys"]
        if keys is None:
            fields_list: list[dict[str, bytes]] = [{"clear": b""}]
        else:
            keys = np.unique(keys)
            fields_list = [{"k": keys[a:a + per].astype("<i8").tobytes()}
                           for a in range(0, keys.size, per)]
        with redis_errors(self._where):
            pipe = self._client.pipeline(transaction=False)
            for fields in fields_list:
                pipe.xadd(self._stream_key, fields, maxlen=maxlen, approximate=True)
            pipe.execute()

    def _follow(self, since: str | None, limit: int, block_ms: int) -> FeedBatch:
        batch = self._read_feed(since, limit)
        if since is None or batch.cursor != since or block_ms == 0:
            return batch
        deadline = time.monotonic() + block_ms / 1000
        tmo = self._client.get_connection_kwargs().get("socket_timeout") or 2.0
        while (left := int((deadline - time.monotonic()) * 1000)) > 0:
            # NOTE: XREAD BLOCK wakes on the XADD itself; slices stay under the socket
            # timeout so a dead server still raises within the configured time.
            with redis_errors(self._where):
                got = self._client.xread({self._stream_key: since}, count=1,
                                         block=max(1, min(left, int(tmo * 500))))
            if got:
                return self._read_feed(since, limit)
        return batch

    def _read_feed(self, since: str | None, limit: int) -> FeedBatch:
        empty: list[np.ndarray] = []
        with redis_errors(self._where):
            try:
                info = self._client.xinfo_stream(self._stream_key)
            except rex.ResponseError as e:
                if "no such key" not in str(e).lower():
                    raise
                return make_batch(empty, since or "0-0", [])
            last = info["last-generated-id"]
            last = last.decode() if isinstance(last, bytes) else str(last)
            if since is None:
                return make_batch(empty, last, [])
            start = _stream_id(since)
            entries = self._client.xrange(self._stream_key, min=f"({since}", count=limit)
        # NOTE: MAXLEN trimming removes entries from the head only (no XDEL here), so
        # entries after ``since`` were lost iff some entry was trimmed and ``since`` is older
        # than the first entry kept. Conservative: a cursor equal to the last trimmed entry
        # also reports a gap (one needless cache clear, never a missed invalidation).
        trimmed = int(info.get("entries-added", 0)) > int(info.get("length", 0))
        first = info.get("first-entry")
        first_id = _stream_id(first[0]) if first else _stream_id(last)
        if trimmed and (start < first_id if first else start < first_id):
            raise ChangeFeedGapError(
                f"{self._where}: change-feed entries after cursor {since} were trimmed (the feed "
                f"keeps about {self._opts['changes_maxlen']} entries): drop every cached row of "
                "the table and resume from err.cursor", cursor=last)
        parts = []
        times: list[int] = []
        cursor = since
        for eid, fields in entries:
            cursor = eid.decode() if isinstance(eid, bytes) else str(eid)
            if b"clear" in fields or "clear" in fields:
                raise ChangeFeedGapError(
                    f"{self._where} was cleared at {cursor}: drop every cached row of the table "
                    "and resume from err.cursor", cursor=cursor)
            parts.append(np.frombuffer(fields[b"k"], dtype="<i8"))
            times.append(_stream_id(cursor)[0] * 1_000_000)
        return make_batch(parts, cursor, times)

    # -- lifecycle -----------------------------------------------------------------------

    def _stat(self) -> dict[str, Any]:
        with redis_errors(self._where):
            nodes = len(self._client.get_primaries()) if self._cluster else 1
            try:
                feed = self._client.xlen(self._stream_key)
            except rex.ResponseError:
                feed = 0
        return {"backend": "redis-cluster" if self._cluster else "redis", "url": self._url,
                "masters": nodes, "feed_entries": feed}

    def _after_fork(self) -> None:
        # NOTE: the parent's sockets and pool threads are not ours: drop them unclosed
        # (closing would shut the parent's sockets down) and build fresh ones.
        log.debug("%s: fork detected, reconnecting in pid child", self._where)
        self._executor = None
        self._node_of = None
        self._client = self._make_client()

    def _close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._client is not None:
            try:
                self._client.close()
            except rex.RedisError:  # closing a dead connection: nothing left to release
                pass
            self._client = None


def open_standalone(url: str, table: str, dim: int | None, dtype: str | None,
                    options: dict[str, Any]) -> RedisParameterServer:
    """Factory for ``redis://``, ``rediss://`` and ``unix://`` URLs."""
    base, topts, conn = split_options(url, options)
    return RedisParameterServer(standalone_factory(base, conn), base, table, dim, dtype, topts,
                                cluster=False)


def open_cluster(url: str, table: str, dim: int | None, dtype: str | None,
                 options: dict[str, Any]) -> RedisParameterServer:
    """Factory for ``redis+cluster://host:port[,host:port]`` URLs."""
    base, topts, conn = split_options(url, options)
    with redis_errors(f"table {table!r} at {redact(base)}"):
        make = cluster_factory(base, conn)
        return RedisParameterServer(make, base, table, dim, dtype, topts, cluster=True)
