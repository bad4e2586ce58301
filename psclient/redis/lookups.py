"""A Redis table's lookups: its ``HMGET`` commands sent and their rows placed.

Mixed into :class:`psclient.redis.backend.RedisParameterServer`, which holds the table's
schema, options, client, dispatcher and lanes. Two paths:

* one server, few keys a reply (a small lookup spread over many partitions): the commands
  encoded in one pass (:mod:`psclient.redis.hmget`), sent on the calling thread's own
  connection (:mod:`psclient.redis.lane`), every reply checked and its rows copied into
  output order in one step (:class:`psclient.redis.resp.RowFrame`);
* a cluster, few keys a reply: the same, with each node's commands sent on the calling
  thread's lane to that node, every node's before any reply is read (the nodes work at
  once, with no thread handoff); a redirection or a connection error sends the batch
  down the next path instead (a lookup changes nothing, so asking again is safe);
* a cluster, or replies of many keys: the dispatcher's pipelines on the pool, each reply's
  rows placed as soon as it is in, so decoding overlaps the server's work.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from typing import TYPE_CHECKING, Any

import numpy as np
import redis.exceptions as rex

from nvecache.common.lazy import lazy_import
from psclient.errors import CorruptValueError
from psclient.redis import resp
from psclient.redis.conn import redis_errors
from psclient.redis.dispatch import REDIRECTS, Cmd
from psclient.redis.hmget import HmgetBatch, encode_hmget
from psclient.redis.lane import Lanes, Sent
from psclient.redis.wire import fetch_row_replies, reply_error, stream_row_pipeline

if TYPE_CHECKING:
    import torch

    from psclient.schema import TableSchema
else:
    torch = lazy_import("torch", globals())


class RedisLookups:
    """The lookup half of a Redis table (see the module docstring)."""

    _schema: TableSchema
    _opts: dict[str, Any]
    _cluster: bool
    _client: Any
    _where: str
    _table: str
    _lanes: Lanes | None
    _dispatch: Any
    dim: int
    #: the backend's dispatcher: runs commands on the pool (or a cluster's nodes)
    _run: Callable[..., list[Any]]

    def _lookup_setup(self, part_bulks: list[bytes]) -> None:
        """What every lookup reuses: each partition's ``HMGET`` lead, the row framing,
        the numpy view of the stored rows, this client's lanes."""
        self._hmget_leads = [resp.bulk(b"HMGET") + k for k in part_bulks]
        self._frame = resp.RowFrame(self._schema.row_bytes)
        self._stored_types = _numpy_view(self._schema)
        self._lanes = Lanes(self._client)
        #: a cluster's lanes, per node client (by id), and which node serves each
        #: partition as an index into them (with the partition map it was made from)
        self._node_lanes: dict[int, Lanes] = {}
        self._node_map: tuple[list[Any], np.ndarray, list[Lanes]] | None = None

    def _lookup(self, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        batch = encode_hmget(keys, self._schema.partitions, self._opts["chunk_keys"],
                             self._hmget_leads)
        n = keys.size
        got = None
        if n <= self._opts["inline_keys"] and n < self._opts["at_once_keys"] * len(batch):
            got = self._lookup_scattered(batch) if self._cluster else \
                self._lookup_whole(batch)
        values, found = got if got is not None else self._lookup_streamed(batch)
        # NOTE: TableSchema.stored_view's rows, viewed in numpy first: one torch call, not
        # three (bfloat16, which numpy lacks, is viewed by torch from its bits)
        np_type, retype = self._stored_types
        out = torch.from_numpy(values.view(np_type).reshape(n, -1))
        if retype:
            out = out.view(self._schema.torch_dtype)
        return out, (torch.ones(n, dtype=torch.bool) if found is None
                     else torch.from_numpy(found))

    def _lookup_whole(self, batch: HmgetBatch) -> tuple[np.ndarray, np.ndarray | None]:
        """One node, few keys a reply (a small lookup spread over many partitions): one
        pipeline on this thread, its replies read whole, then checked and copied in a few
        numpy operations, or decoded all together where some key is missing. ``found``
        is None when every key was."""
        frame, order, n = self._frame, batch.order, batch.keys.size
        expect = n * frame.rec_len + 16 * len(batch)
        assert self._lanes is not None
        with redis_errors(self._where):
            got = self._lanes.fetch(batch.payload, expect)
            if got is None:
                got = fetch_row_replies(self._client, batch.payload, len(batch), expect,
                                        keep=REDIRECTS)
            if isinstance(got, tuple):
                buf, size = got
                starts = frame.offsets(buf, size, batch.counts, batch.reply_heads)
                if starts is not None:
                    # NOTE: the row of output position i is at src[i]: one copy, in order
                    src = np.empty(n, dtype=np.intp)
                    src[order] = starts
                    return frame.rows(buf, size)[src], None
                got = resp.parse_replies(buf, size, len(batch))
            for reply in got:
                if isinstance(reply, Exception):
                    # NOTE: one server, so a redirection is an error here too
                    raise reply if isinstance(reply, rex.RedisError) else reply_error(reply)
        values = np.empty(n, dtype=frame.row_type)
        found = np.empty(n, dtype=bool)
        self._place(order, list(chain.from_iterable(got)), batch.keys, values, found)
        return values, found

    def _nodes(self) -> tuple[np.ndarray, list[Lanes]]:
        """Which node serves each partition (an index) and this client's lanes to each
        node, remade when the dispatcher's partition map is (after a redirection)."""
        nodes = self._dispatch.nodes()
        known = self._node_map
        if known is None or known[0] is not nodes:
            index: dict[int, int] = {}
            at = np.array([index.setdefault(id(c), len(index)) for c in nodes], dtype=np.intp)
            clients = list({id(c): c for c in nodes}.values())
            lanes = [self._node_lanes.setdefault(id(c), Lanes(c)) for c in clients]
            known = self._node_map = (nodes, at, lanes)
        return known[1], known[2]

    def _lookup_scattered(self, batch: HmgetBatch
                          ) -> tuple[np.ndarray, np.ndarray | None] | None:
        """A cluster, few keys a reply: each node's commands on this thread's lane to it,
        all sent before any reply is read; rows checked and copied per node as
        :meth:`_lookup_whole` does. None (nothing placed, every lane read or dropped) on a
        redirection, a connection error, or a node without a lane for this thread: the
        caller sends the batch down the dispatcher's path."""
        at, lanes = self._nodes()
        frame, order, n = self._frame, batch.order, batch.keys.size
        counts, heads, payload = batch.counts, batch.reply_heads, batch.payload
        first = counts.cumsum() - counts
        cmd_node = at[np.asarray(batch.parts, dtype=np.intp)]
        plan: list[tuple[Sent, list[int], np.ndarray]] = []
        got: list[tuple[bytearray, int]] = []
        try:
            for node in np.unique(cmd_node).tolist():
                js = np.flatnonzero(cmd_node == node)
                sent = lanes[node].open(int(counts[js].sum()) * frame.rec_len + 16 * js.size)
                if sent is None:
                    return None  # NOTE: nothing sent yet
                plan.append((sent, js.tolist(), js))
            for sent, jl, _ in plan:
                sent.send([p for j in jl for p in (payload[2 * j], payload[2 * j + 1])])
            got = [sent.receive() for sent, _, _ in plan]
        except (rex.ConnectionError, rex.TimeoutError, OSError):
            for sent, _, _ in plan[len(got):]:
                sent.drop()  # NOTE: replies left unread would answer the next command
            return None
        values = np.empty(n, dtype=frame.row_type)
        found: np.ndarray | None = None
        for (_, jl, js), (buf, size) in zip(plan, got, strict=True):
            c = counts[js]
            starts = frame.offsets(buf, size, c, [heads[j] for j in jl])
            if starts is not None:
                # NOTE: this node's keys, each command's at its start in the batch
                dest = order[np.arange(int(c.sum())) + (first[js] - (c.cumsum() - c)).repeat(c)]
                values[dest] = frame.rows(buf, size)[starts]
                continue
            replies = resp.parse_replies(buf, size, len(jl))
            if any(isinstance(r, Exception) for r in replies):
                return None  # NOTE: a redirection (or an error the next path raises)
            if found is None:
                found = np.ones(n, dtype=bool)
            for j, reply in zip(jl, replies, strict=True):
                lo, hi = int(first[j]), int(first[j] + counts[j])
                self._place(order[lo:hi], reply, batch.keys[lo:hi], values, found)
        return values, found

    def _lookup_streamed(self, batch: HmgetBatch) -> tuple[np.ndarray, np.ndarray]:
        """Commands routed by the dispatcher (a cluster's nodes, pipelines on the pool):
        each pipeline's replies copied out as they arrive, or read whole when they average
        fewer than ``at_once_keys`` keys."""
        cmds = batch.cmds()
        order, ks, frame = batch.order, batch.keys, self._frame
        n, rb = ks.size, frame.row_bytes
        values = np.empty(n, dtype=frame.row_type)  # NOTE: one element per row (fast scatter)
        found = np.zeros(n, dtype=bool)

        def place(i: int, reply: Any) -> Any:
            c = cmds[i]
            return self._place(order[c.start:c.stop], reply, ks[c.start:c.stop], values, found)

        def job(client: Any, mine: list[Cmd]) -> list[Any]:
            # NOTE: runs on the pool; each job writes only the rows of its own commands, each
            # command's as soon as its reply is in (the server works on the next meanwhile).
            counts = np.fromiter([c.stop - c.start for c in mine], dtype=np.int64,
                                 count=len(mine))
            nkeys = int(counts.sum())
            expect = nkeys * frame.rec_len + 16 * len(mine)
            payload = [part for c in mine for part in c.payload]
            if nkeys < self._opts["at_once_keys"] * len(mine):
                # NOTE: many small replies (few keys spread over many partitions): decoded
                # one by one, each costs more than overlapping it with the server gains
                got = fetch_row_replies(client, payload, len(mine), expect, keep=REDIRECTS)
                if isinstance(got, tuple):
                    starts = frame.offsets(*got, counts, [b"*%d\r\n" % m for m in
                                                          counts.tolist()])
                    if starts is not None:
                        # NOTE: this node's share: each command's keys sit at its start in
                        # the batch, at the sum of the counts before it in this job
                        shift = np.fromiter([c.start for c in mine], dtype=np.int64,
                                            count=len(mine)) - (counts.cumsum() - counts)
                        dest = order[np.arange(nkeys) + shift.repeat(counts)]
                        values[dest] = frame.rows(*got)[starts]
                        found[dest] = True
                        return [None] * len(mine)
                    got = resp.parse_replies(*got, len(mine))
                return [self._place(order[c.start:c.stop], reply, ks[c.start:c.stop], values,
                                    found) for c, reply in zip(mine, got, strict=True)]
            placed: list[Any] = [None] * len(mine)

            def sink(i: int, reply: Any) -> None:
                c = mine[i]
                placed[i] = self._place(order[c.start:c.stop], reply, ks[c.start:c.stop],
                                        values, found)

            stream_row_pipeline(client, payload, len(mine), expect, rb, sink)
            return placed

        self._run(cmds, job, place)
        return values, found

    def _place(self, dest: np.ndarray, reply: Any, keys: np.ndarray, values: np.ndarray,
               found: np.ndarray) -> Exception | None:
        """Write one HMGET reply (fast row view or decoded list) to rows ``dest`` of the output.

        ``values`` is the output as a 1-D ``V<row_bytes>`` array (one element per row).
        Returns a cluster redirection (the command must be resent), else ``None``.
        """
        if isinstance(reply, np.ndarray):
            values[dest] = reply
            found[dest] = True
            return None
        if isinstance(reply, Exception):
            err = reply if isinstance(reply, rex.RedisError) else reply_error(reply)
            if isinstance(err, REDIRECTS):
                return err
            raise err
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
        return None


def _numpy_view(schema: TableSchema) -> tuple[np.dtype, bool]:
    """The numpy dtype a lookup views its stored rows as, and whether torch views that as
    the table's dtype next, giving :meth:`TableSchema.stored_view`'s tensor. (Without
    torch: opening a table must not import it, ``tests/test_cli_startup.py``.)"""
    if schema.quantized:
        return np.dtype(np.uint8), False
    try:
        return np.dtype(schema.dtype), False
    except TypeError:  # NOTE: bfloat16, which numpy lacks: its bits, then torch's view
        return np.dtype(f"u{schema.row_bytes // schema.dim}"), True
