"""A lookup's ``HMGET`` commands, encoded from its keys in one pass.

A lookup groups its keys by partition (:func:`psclient.codec.group_by_partition`) and asks
each partition's hash for its share, at most ``chunk_keys`` fields a command. The commands
cover the sorted keys consecutively, partition by partition, so a batch is described by
three per-command lists (partition, first sorted key, key count) and its wire bytes: one
header per command, each followed by a slice of one buffer of fixed-size field records
(:func:`psclient.redis.resp.field_records`). Nothing is built per key in Python, and the
per-command :class:`~psclient.redis.dispatch.Cmd` objects are made only for the paths
that route commands one by one (a cluster, a batch split over several pipelines): a
lookup of a few keys spread over many partitions spends more of its host time on
per-command objects than on its keys.
"""

from __future__ import annotations

import numpy as np

from nvecache.common.fmix import fmix64
from psclient.redis.dispatch import Cmd

__all__ = ["HmgetBatch", "encode_hmget"]

_FIELD = 14  # bytes of one field record: b"$8\r\n" + 8 key bytes + b"\r\n"
#: field records with their framing in place: a batch copies the first N and writes keys in
_TEMPLATE = np.frombuffer((b"$8\r\n" + bytes(8) + b"\r\n") * 8192,
                          dtype=np.uint8).reshape(-1, _FIELD)


class HmgetBatch:
    """The ``HMGET`` commands of one lookup.

    Attributes:
        order: ``keys[order]`` are the keys grouped by partition (the commands' order).
        keys: the keys in that order.
        parts: each command's partition.
        counts: each command's key count (int64 array; its keys follow the previous
            command's in ``keys``).
        payload: the encoded commands, two parts each (header, field records).
        reply_heads: the array header each command's reply has when it is an array
            (``*<count>\r\n``: :meth:`psclient.redis.resp.RowFrame.offsets` checks them).
    """

    __slots__ = ("counts", "keys", "order", "parts", "payload", "reply_heads")

    def __init__(self, order: np.ndarray, keys: np.ndarray, parts: list[int],
                 counts: np.ndarray, payload: list[bytes | memoryview],
                 reply_heads: list[bytes]) -> None:
        self.order = order
        self.keys = keys
        self.parts = parts
        self.counts = counts
        self.payload = payload
        self.reply_heads = reply_heads

    def __len__(self) -> int:
        return len(self.parts)

    def cmds(self) -> list[Cmd]:
        """One :class:`Cmd` per command, for :class:`psclient.redis.dispatch.Dispatcher`."""
        out: list[Cmd] = []
        start = 0
        pl = self.payload
        for j, (p, c) in enumerate(zip(self.parts, self.counts.tolist(), strict=True)):
            out.append(Cmd(p, start, start + c, pl[2 * j:2 * j + 2]))
            start += c
        return out


def encode_hmget(keys: np.ndarray, partitions: int, chunk_keys: int, leads: list[bytes]
                 ) -> HmgetBatch:
    """Group ``keys`` by partition and encode one ``HMGET`` per chunk of a partition.

    The grouping is :func:`psclient.codec.group_by_partition`'s (the same partitions, the
    same stable order), written out here with fewer numpy calls: a small lookup's host
    time is mostly the count of its numpy calls.

    Args:
        keys: int64 keys (duplicates allowed: each is asked for, in place).
        partitions: the table's partition count.
        chunk_keys: at most this many fields a command.
        leads: per partition, the command's leading bulk strings (``HMGET`` and the
            partition hash's key), encoded.
    """
    n = keys.size
    part = fmix64(keys)
    part %= np.uint64(partitions)
    # NOTE: numpy sorts 16-bit integers stably by radix (psclient.codec.group_by_partition)
    part = part.astype(np.uint16 if partitions <= 1 << 16 else np.int64)
    order = part.argsort(kind="stable")
    sizes = np.bincount(part, minlength=partitions)
    ks = keys[order]
    rec = _TEMPLATE[:n].copy() if n <= len(_TEMPLATE) else np.tile(_TEMPLATE[0], (n, 1))
    rec[:, 4:12] = ks.view(np.uint8).reshape(n, 8)
    raw = memoryview(rec).cast("B")
    nonempty = sizes.nonzero()[0]
    counts = sizes[nonempty]
    if int(counts.max()) <= chunk_keys:
        parts = nonempty.tolist()
    else:  # NOTE: some partition needs several commands: cut each into chunk_keys pieces
        pieces = -(-counts // chunk_keys)
        piece_part = np.repeat(nonempty, pieces)
        within = np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        counts = np.minimum(sizes[piece_part] - within * chunk_keys, chunk_keys)
        parts = piece_part.tolist()
    payload: list[bytes | memoryview] = []
    heads: list[bytes] = []
    at = 0
    for p, c in zip(parts, counts.tolist(), strict=True):
        payload.append(b"*%d\r\n%b" % (c + 2, leads[p]))
        payload.append(raw[at:at + c * _FIELD])
        heads.append(b"*%d\r\n" % c)
        at += c * _FIELD
    return HmgetBatch(order, ks, parts, counts, payload, heads)
