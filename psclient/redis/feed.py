"""The follower side of the Redis change feed: cursors, reading the partition streams, waiting.

Each partition ``p`` of table ``T`` has its stream ``psc:{T:p}:changes`` and the ID of its
newest entry in ``psc:{T:p}:last`` (written by the Lua steps of
:mod:`psclient.redis.scripts`, which also state the entry format and the ``p`` chain).

A cursor holds every partition's last stream ID, compactly::

    "r2." + 8 hex digits (the table's incarnation, from its creation time) + "." +
    base64url(varint P, varint B, then per partition varint(B - ms), varint(seq))

where ``B`` is the largest ``ms`` (partitions written at about the same time cost 2-3 bytes).

One read (:meth:`RedisFeed.read`) is one pipeline per node: the ``last`` IDs (``MGET`` on one
server, ``GET`` per partition on a cluster) then ``XREAD COUNT c`` of every stream after its
cursor (one ``XREAD`` over all streams on one server; one per partition on a cluster, where a
multi-key ``XREAD`` across slots is refused with CROSSSLOT). A gap is raised when a cursor is
ahead of its partition's ``last`` (the store lost entries the follower had read) or when the
first entry after a cursor does not name it as ``p`` (entries trimmed or lost), or at a clear.

Waiting (``block_ms > 0``, nothing new): on one server, ``XREAD BLOCK`` over every stream
after the cursor, which returns as soon as any script's ``XADD`` commits. On a cluster, the
writer ends each write pipeline with ``PUBLISH psc:{T}:bell`` (after its ``EVAL``\\ s, on the
same connection, so after they committed); the follower, subscribed before it read, sleeps on
that channel and reads again when it rings, and sweeps (reads again) every ``feed_sweep_ms``
anyway, since a doorbell is only a hint: a writer killed between its ``EVAL`` and its
``PUBLISH``, or a subscription lost in a failover, delays a follower by one sweep at most.
"""

from __future__ import annotations

import base64
import binascii
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import redis.exceptions as rex

from psclient.errors import BadArgumentError, ChangeFeedGapError
from psclient.feed import FeedBatch, make_batch
from psclient.redis import resp

if TYPE_CHECKING:  # NOTE: type-only: redis_backend imports this module
    from psclient.redis.backend import RedisParameterServer

log = logging.getLogger(__name__)

StreamId = tuple[int, int]
_ZERO: StreamId = (0, 0)
_TAG = "r2"


def _varint(out: bytearray, n: int) -> None:
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def encode_cursor(incarnation: str, ids: list[StreamId]) -> str:
    """The opaque cursor string for every partition's last stream ID."""
    base = max(ms for ms, _ in ids)
    out = bytearray()
    _varint(out, len(ids))
    _varint(out, base)
    for ms, seq in ids:
        _varint(out, base - ms)
        _varint(out, seq)
    return f"{_TAG}.{incarnation}.{base64.urlsafe_b64encode(bytes(out)).rstrip(b'=').decode()}"


def decode_cursor(cursor: str, incarnation: str, partitions: int) -> list[StreamId] | None:
    """Every partition's stream ID, or ``None`` for a cursor of an earlier table of this name
    or of an older layout (the caller reports a gap).

    Raises:
        BadArgumentError: not a change-feed cursor.
    """
    tag, _, rest = cursor.partition(".")
    inc, _, body = rest.partition(".")
    if tag != _TAG:
        ms, sep, seq = cursor.partition("-")
        if sep and ms.isdigit() and seq.isdigit():
            return None  # NOTE: a layout-1 cursor (one stream ID): a gap, not an error
        raise BadArgumentError(f"bad change-feed cursor {cursor!r}: pass one returned by follow()")
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        vals: list[int] = []
        n = shift = 0
        for b in raw:
            n |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                vals.append(n)
                n = shift = 0
        count, base = vals[0], vals[1]
        if len(vals) != 2 + 2 * count or shift:
            raise ValueError("length")
    except (ValueError, IndexError, binascii.Error) as e:
        raise BadArgumentError(
            f"bad change-feed cursor {cursor!r}: pass one returned by follow()") from e
    if inc != incarnation or count != partitions:
        return None
    return [(base - vals[2 + 2 * i], vals[3 + 2 * i]) for i in range(count)]


def parse_id(raw: bytes | str) -> StreamId:
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


class RedisFeed:
    """Reads and waits on one table's partition streams (the backend's ``follow``)."""

    _pubsub: Any = None

    def __init__(self, ps: RedisParameterServer, bell: bytes, sweep_ms: int) -> None:
        self._ps = ps
        self._bell = bell
        self._sweep_s = sweep_ms / 1000
        self._streams = [k + b":changes" for k in ps.part_keys]
        self._lasts = [k + b":last" for k in ps.part_keys]
        self._part_of = {s: p for p, s in enumerate(self._streams)}

    # -- the call ------------------------------------------------------------------------

    def follow(self, since: str | None, limit: int, block_ms: int) -> FeedBatch:
        ps = self._ps
        inc, parts = ps.schema.incarnation, ps.schema.partitions
        if since is None:
            return make_batch([], encode_cursor(inc, self._ends()), [])
        ids = decode_cursor(since, inc, parts)
        if ids is None:
            raise ChangeFeedGapError(
                f"{ps.where}: cursor {since[:40]!r} belongs to an older layout or to an earlier "
                "table of this name (dropped and created again): drop every cached row of the "
                "table and resume from err.cursor", cursor=encode_cursor(inc, self._ends()))
        count = max(1, -(-limit // parts))  # NOTE: about ``limit`` entries over all streams
        deadline = time.monotonic() + block_ms / 1000
        if block_ms and ps.cluster:
            self._subscribe()  # NOTE: before the read, so no doorbell falls in between
        batch, n = self.read(ids, count)
        if n or not block_ms:
            return batch
        return self._wait(ids, count, deadline, batch)

    def _wait(self, ids: list[StreamId], count: int, deadline: float,
              idle: FeedBatch) -> FeedBatch:
        ps = self._ps
        if not ps.cluster:
            tmo = ps.socket_timeout
            while (left := int((deadline - time.monotonic()) * 1000)) > 0:
                # NOTE: slices under the socket timeout: a dead server still raises in time.
                block = max(1, min(left, int(tmo * 500)))
                args: list[bytes | str | int] = ["XREAD", "BLOCK", block, "COUNT", count,
                                                 "STREAMS", *self._streams,
                                                 *(f"{ms}-{seq}" for ms, seq in ids)]
                reply = ps.run_commands([(0, resp.pack(*args))])[0]
                if reply:
                    return self._consume(ids, None, self._entries([reply]))
            return idle
        while (wait_s := deadline - time.monotonic()) > 0:
            self._ring(min(wait_s, self._sweep_s))
            batch, n = self.read(ids, count)
            if n:
                return batch
        return idle

    # -- reading -------------------------------------------------------------------------

    def _ends(self) -> list[StreamId]:
        ps = self._ps
        if ps.cluster:
            replies = ps.run_commands([(p, resp.pack("GET", k))
                                       for p, k in enumerate(self._lasts)])
        else:
            replies = ps.run_commands([(0, resp.pack("MGET", *self._lasts))])[0]
        return [parse_id(r) if r else _ZERO for r in replies]

    def read(self, ids: list[StreamId], count: int) -> tuple[FeedBatch, int]:
        """One non-blocking read after ``ids``: the batch and how many entries it read."""
        ps = self._ps
        cursors = [f"{ms}-{seq}" for ms, seq in ids]
        if ps.cluster:
            cmds: list[tuple[int, bytes]] = []
            for p in range(len(ids)):
                cmds.append((p, resp.pack("GET", self._lasts[p])))
                cmds.append((p, resp.pack("XREAD", "COUNT", count, "STREAMS", self._streams[p],
                                          cursors[p])))
            schema = ps.stored_schema()  # NOTE: another slot: its own round trip
            replies = ps.run_commands(cmds)
            lasts = replies[0::2]
            xreads = replies[1::2]
        else:
            schema, lasts, xread = ps.run_commands([
                (0, resp.pack("GET", ps.schema_key)),
                (0, resp.pack("MGET", *self._lasts)),
                (0, resp.pack("XREAD", "COUNT", count, "STREAMS", *self._streams, *cursors))])
            xreads = [xread]
        if schema != ps.schema_record:
            # NOTE: the table was created anew (a restart that lost it, a drop): its feed may
            # be empty again, so no cursor check would see it. Adopt the new table if it has
            # this geometry, and make the follower re-sync.
            what = ps.adopt_schema(schema)
            raise ChangeFeedGapError(
                f"{ps.where}: {what}: drop every cached row of the table and resume from "
                "err.cursor", cursor=encode_cursor(ps.schema.incarnation, self._ends()))
        ends = [parse_id(r) if r else _ZERO for r in lasts]
        entries = self._entries(xreads)
        return self._consume(ids, ends, entries), sum(len(e) for e in entries.values())

    def _entries(self, xreads: list[Any]) -> dict[int, list[Any]]:
        out: dict[int, list[Any]] = {}
        for reply in xreads:
            # NOTE: a map under RESP3 (redis-py's default from 8.0), a list of pairs under RESP2
            for name, ents in (reply.items() if isinstance(reply, dict) else reply or ()):
                if ents:
                    out[self._part_of[name]] = ents
        return out

    def _consume(self, ids: list[StreamId], ends: list[StreamId] | None,
                 entries: dict[int, list[Any]]) -> FeedBatch:
        ps = self._ps
        new = list(ids)
        parts: list[np.ndarray] = []
        times: list[int] = []
        problem = None
        if ends is not None:
            ahead = [p for p in range(len(ids)) if ids[p] > ends[p]]
            if ahead:
                problem = (f"the cursor is ahead of partition {ahead[0]}'s stream "
                           f"({len(ahead)} partition(s)): the store lost entries the cursor had "
                           "read (a restart without persistence, a failover)")
        for p, ents in sorted(entries.items()):
            for eid, fields in ents:
                rec = dict(zip(fields[0::2], fields[1::2], strict=True))
                if problem is None and parse_id(rec.get(b"p", b"0-0")) != new[p]:
                    problem = (f"entries of partition {p} after the cursor were trimmed from the "
                               f"bounded feed (changes_maxlen={ps.option('changes_maxlen')} "
                               "entries per partition) or lost (a restart, a failover)")
                if problem is None and b"c" in rec:
                    problem = f"the table was cleared (partition {p} at {eid.decode()})"
                new[p] = parse_id(eid)
                if problem is None:
                    parts.append(np.frombuffer(rec[b"k"], dtype="<i8"))
                    if b"t" in rec:
                        times.append(int(rec[b"t"]) * 1000)
        inc = ps.schema.incarnation
        if problem is not None:
            latest = self._ends() if ends is None else ends
            resume = [max(a, b) if b > ids[p] else a
                      for p, (a, b) in enumerate(zip(latest, new, strict=True))]
            raise ChangeFeedGapError(
                f"{ps.where}: {problem}: drop every cached row of the table and resume from "
                "err.cursor", cursor=encode_cursor(inc, resume))
        return make_batch(parts, encode_cursor(inc, new), times)

    # -- the cluster's doorbell ------------------------------------------------------------

    def _subscribe(self) -> None:
        if self._pubsub is not None:
            return
        try:
            self._pubsub = self._ps.client.pubsub()
            self._pubsub.subscribe(self._bell)
        except (rex.RedisError, OSError) as e:
            log.info("%s: doorbell subscription failed (%s); sweeping every %.0f ms",
                     self._ps.where, e, self._sweep_s * 1000)
            self.close()

    def _ring(self, timeout: float) -> None:
        """Wait until the doorbell rings (then drain it) or ``timeout`` seconds pass."""
        self._subscribe()
        if self._pubsub is None:
            time.sleep(timeout)
            return
        try:
            msg = self._pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout)
            while msg is not None:  # NOTE: one read serves every ring so far
                msg = self._pubsub.get_message(ignore_subscribe_messages=True, timeout=0)
        except (rex.RedisError, OSError) as e:
            log.info("%s: doorbell lost (%s); resubscribing", self._ps.where, e)
            self.close()

    def forget(self) -> None:
        """After fork: drop the parent's subscription without touching its socket."""
        self._pubsub = None

    def close(self) -> None:
        if self._pubsub is not None:
            try:
                self._pubsub.close()
            except (rex.RedisError, OSError):  # closing a dead connection
                pass
            self._pubsub = None
