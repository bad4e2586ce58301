"""Vectorized RESP2 encoding of the batch commands (HMGET, HSET, HDEL, EVAL).

Each key (and row) of a command has a fixed-size encoding, so a whole batch is encoded
with one numpy structured array instead of one Python object per argument::

    field   b"$8\\r\\n" + 8 key bytes (int64 little-endian) + b"\\r\\n"          14 bytes
    row     b"$<row_bytes>\\r\\n" + row bytes + b"\\r\\n"

A command is a small header (``*<argc>\\r\\n`` and its leading bulk strings) followed by a
contiguous slice of that array, sent as a memoryview (no copy).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hiredis
import numpy as np


def bulk(arg: bytes) -> bytes:
    """One RESP bulk string."""
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


def header(argc: int, *leading: bytes) -> bytes:
    """The array header of a command with ``argc`` arguments and its leading arguments."""
    return b"*%d\r\n" % argc + b"".join(bulk(a) for a in leading)


def pack(*args: bytes | str | int) -> bytes:
    """Encode one small command (control commands: UNLINK, HLEN, ...)."""
    return hiredis.pack_command(args)  # type: ignore[arg-type]


def field_records(keys: np.ndarray) -> np.ndarray:
    """One 14-byte RESP bulk string per int64 key (the hash field)."""
    rec = np.empty(keys.size, dtype=np.dtype([("h", "S4"), ("k", "<i8"), ("t", "S2")]))
    rec["h"] = b"$8\r\n"
    rec["k"] = keys
    rec["t"] = b"\r\n"
    return rec


def field_value_records(keys: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Interleaved field and row bulk strings; ``rows`` is uint8 ``[N, row_bytes]``."""
    n, rb = rows.shape
    vh = b"$%d\r\n" % rb
    rec = np.empty(n, dtype=np.dtype([("h", "S4"), ("k", "<i8"), ("t", "S2"),
                                      ("vh", f"S{len(vh)}"), ("v", np.uint8, (rb,)),
                                      ("vt", "S2")]))
    rec["h"] = b"$8\r\n"
    rec["k"] = keys
    rec["t"] = b"\r\n"
    rec["vh"] = vh
    rec["v"] = rows
    rec["vt"] = b"\r\n"
    return rec


def field_row_pair_records(keys: np.ndarray, first: np.ndarray, second: np.ndarray
                           ) -> np.ndarray:
    """Each field followed by two row bulk strings (accumulate's row read, then the row
    to write); ``first`` and ``second`` are uint8 ``[N, row_bytes]``."""
    n, rb = first.shape
    vh = b"$%d\r\n" % rb
    row = [("vh", f"S{len(vh)}"), ("v", np.uint8, (rb,)), ("vt", "S2")]
    rec = np.empty(n, dtype=np.dtype([("h", "S4"), ("k", "<i8"), ("t", "S2"),
                                      ("a", row), ("b", row)]))
    rec["h"] = b"$8\r\n"
    rec["k"] = keys
    rec["t"] = b"\r\n"
    for name, rows in (("a", first), ("b", second)):
        rec[name]["vh"] = vh
        rec[name]["v"] = rows
        rec[name]["vt"] = b"\r\n"
    return rec


def as_buffer(rec: np.ndarray) -> memoryview:
    """The raw bytes of a contiguous slice of records, without a copy."""
    return memoryview(np.ascontiguousarray(rec).view(np.uint8))  # type: ignore[arg-type]


def _framed(arr: np.ndarray, start: int, m: int, row_bytes: int, head: bytes) -> bool:
    """Whether ``m`` records ``head + row + CRLF`` start at ``start`` (``m * rec_len`` bytes
    known to be there).

    The bytes between two rows, record i's CRLF and record i+1's head, are one constant
    ``CRLF + head`` (6 to 15 bytes): they are compared as two overlapping fixed-width
    integers per record, read strided straight from the buffer (one pass over the records
    each), plus the first head and the last CRLF.
    """
    hl = len(head)
    rec_len = hl + row_bytes + 2
    end = start + m * rec_len
    if arr[start:start + hl].tobytes() != head or arr[end - 2:end].tobytes() != b"\r\n":
        return False
    if m == 1:
        return True
    joint = b"\r\n" + head
    width, dtype = (8, "<u8") if len(joint) >= 8 else (4, "<u4")
    for off in sorted({0, len(joint) - width}):
        want = np.frombuffer(joint[off:off + width], dtype=dtype)[0]
        got = np.ndarray((m - 1,), dtype=dtype, buffer=arr,
                         offset=start + hl + row_bytes + off, strides=(rec_len,))
        if not bool((got == want).all()):
            return False
    return True


class RowReplyReader:
    """Decodes ``ncmds`` HMGET replies from a receive buffer while it fills.

    :meth:`feed` hands each reply that is complete and on the fast path to a callback as
    soon as its bytes are in, so a caller copies rows out while the server still works on
    the next commands; :meth:`finish`, once every reply is in, decodes the rest with hiredis.

    Fast path: a reply whose every element is a bulk string of exactly ``row_bytes`` bytes
    has a fixed layout; it is checked with numpy and given as a 1-D view of the buffer with
    one ``V<row_bytes>`` element per row (strided over the RESP framing: no object per row,
    no copy; a 1-D void array scatters faster than a 2-D uint8 one). From the first reply
    that does not fit (a miss, a wrong-length value, an error) on, hiredis decodes the rest:
    those entries are lists of ``bytes | None`` or ``hiredis.ReplyError``.
    """

    def __init__(self, ncmds: int, row_bytes: int) -> None:
        self.ncmds = ncmds
        self.row_bytes = row_bytes
        self.head = b"$%d\r\n" % row_bytes
        self.rec_len = len(self.head) + row_bytes + 2
        self.row_type = np.dtype(f"V{row_bytes}")
        self.pos = 0         # where the next undecoded reply starts
        self.done = 0        # replies decoded so far
        self.fast = True     # False from the first reply off the fast path on

    def feed(self, buf: bytearray, size: int, sink: Callable[[int, np.ndarray], object]
             ) -> None:
        """Call ``sink(index, rows)`` for each fast-path reply complete in ``buf[:size]``.

        NOTE: ``rows`` views ``buf``: the sink copies them out before it returns (the buffer
        may grow, and so move, once it does).
        """
        arr = np.frombuffer(buf, dtype=np.uint8, count=size)
        rec_len, pos = self.rec_len, self.pos
        while self.fast and self.done < self.ncmds and pos < size:
            if buf[pos] != 0x2A:  # b"*"
                self.fast = False
                break
            eol = buf.find(b"\r\n", pos, min(size, pos + 24))
            if eol < 0:
                self.fast = size - pos < 24  # NOTE: a header still coming in, or garbage
                break
            m = int(buf[pos + 1:eol]) if buf[pos + 1:eol].isdigit() else -1
            start = eol + 2
            end = start + m * rec_len
            if m < 0:
                self.fast = False
                break
            if end > size:
                break  # NOTE: not all in yet (or shorter, with misses: then framing fails)
            if not _framed(arr, start, m, self.row_bytes, self.head):
                self.fast = False
                break
            rows = np.ndarray((m,), dtype=self.row_type, buffer=arr,
                              offset=start + len(self.head), strides=(rec_len,))
            self.pos = pos = end
            self.done += 1
            sink(self.done - 1, rows)
            del rows

    def finish(self, buf: bytearray, size: int) -> list[Any]:
        """The replies not yet fed, decoded by hiredis from ``buf[:size]`` (all complete)."""
        out: list[Any] = []
        if self.done < self.ncmds:
            reader = hiredis.Reader()
            reader.feed(buf, self.pos, size - self.pos)  # type: ignore[arg-type]
            while self.done + len(out) < self.ncmds:
                reply = reader.gets()
                if reply is False:
                    raise ValueError("truncated reply")  # NOTE: callers pass complete replies
                out.append(reply)
        return out


class RowFrame:
    """The framing of a ``row_bytes`` row in an ``HMGET`` reply (``$<row_bytes>\r\n``, the
    row, ``\r\n``), and the check that a run of replies holds nothing else.

    Made once per table: a lookup of a few keys spread over many partitions gets many
    replies of a row or two, and every numpy call saved per lookup counts there.
    """

    def __init__(self, row_bytes: int) -> None:
        self.row_bytes = row_bytes
        self.head = b"$%d\r\n" % row_bytes
        self.rec_len = len(self.head) + row_bytes + 2
        self.row_type = np.dtype(f"V{row_bytes}")
        hl = len(self.head)
        # NOTE: where a record's framing bytes are, from its start, and what they must be
        self._at = np.array([*range(hl), hl + row_bytes, hl + row_bytes + 1], dtype=np.intp)
        self._want = np.frombuffer(self.head + b"\r\n", dtype=np.uint8)

    def offsets(self, buf: bytearray, size: int, counts: np.ndarray, heads: list[bytes]
                ) -> np.ndarray | None:
        """Where each row starts in ``buf[:size]``, which holds the replies of consecutive
        ``HMGET`` commands of ``counts[i]`` keys (int64), when every key was found with a
        value of ``row_bytes`` bytes; None when any reply is otherwise (a miss, another
        length, an error): parse those (:func:`parse_replies`).

        ``heads[i]`` is ``b"*%d\\r\\n" % counts[i]``, the header reply ``i`` has as an
        array (the encoder writes them beside the commands).

        Every reply's layout is then known in advance, so the whole buffer is checked in a
        few numpy operations however many replies there are. The check is a parse: every
        array header and every record's framing is compared where it must be, and the sizes
        add up, so reading the buffer from its start can only find these records.
        """
        joined = b"".join(heads)
        rec, hl = self.rec_len, len(joined)
        nrec = (size - hl) // rec
        if not heads or hl + nrec * rec != size or nrec != int(counts.sum()):
            return None
        arr = np.frombuffer(buf, dtype=np.uint8, count=size)
        if len(heads) == 1:
            if buf[:hl] != joined:
                return None
            starts = np.arange(hl, size, rec)
        else:
            lens = np.fromiter(map(len, heads), dtype=np.int64, count=len(heads))
            # NOTE: reply j starts after the headers and records of the replies before it
            first = counts.cumsum()
            first -= counts
            first *= rec
            at = first.repeat(lens)
            at += np.arange(hl)
            if not (arr[at] == np.frombuffer(joined, dtype=np.uint8)).all():
                return None
            starts = lens.cumsum().repeat(counts)
            starts += np.arange(0, nrec * rec, rec)
        if not (arr[starts[:, None] + self._at] == self._want).all():
            return None
        starts += len(self.head)
        return starts

    def rows(self, buf: bytearray, size: int) -> np.ndarray:
        """Every ``row_bytes``-long window of ``buf[:size]`` as one ``V<row_bytes>`` element
        (overlapping views, no copy): indexed with :meth:`offsets`, one fancy index copies
        the rows out, in any order."""
        arr = np.frombuffer(buf, dtype=np.uint8, count=size)
        return np.ndarray((size - self.row_bytes + 1,), dtype=self.row_type, buffer=arr,
                          strides=(1,))


def all_rows(buf: bytearray, size: int, counts: list[int], row_bytes: int
             ) -> np.ndarray | None:
    """The rows of consecutive HMGET replies in ``buf[:size]`` (reply ``i`` for
    ``counts[i]`` keys), when every key was found with a value of ``row_bytes`` bytes:
    one ``V<row_bytes>`` array in reply order (a copy). None when any reply is otherwise
    (:meth:`RowFrame.offsets`)."""
    frame = RowFrame(row_bytes)
    starts = frame.offsets(buf, size, np.asarray(counts, dtype=np.int64),
                           [b"*%d\r\n" % m for m in counts])
    return None if starts is None else frame.rows(buf, size)[starts]


def parse_replies(buf: bytearray, size: int, ncmds: int) -> list[Any]:
    """``ncmds`` complete replies in ``buf[:size]``, decoded by hiredis: lists of
    ``bytes | None`` for ``HMGET``, error replies as ``hiredis.ReplyError`` in place."""
    reader = hiredis.Reader()
    reader.feed(buf, 0, size)  # type: ignore[arg-type]
    out = [reader.gets() for _ in range(ncmds)]
    if out and out[-1] is False:
        raise ValueError("truncated reply")  # NOTE: callers pass complete replies
    return out


def decode_row_replies(buf: bytearray, size: int, ncmds: int, row_bytes: int
                       ) -> list[np.ndarray | Any]:
    """Decode ``ncmds`` HMGET replies from ``buf[:size]`` (complete replies), as
    :class:`RowReplyReader` does: row views (views of ``buf``) first, then what hiredis
    decoded from the first reply off the fast path on."""
    reader = RowReplyReader(ncmds, row_bytes)
    out: list[np.ndarray | Any] = []
    reader.feed(buf, size, lambda _i, rows: out.append(rows))
    return out + reader.finish(buf, size)
