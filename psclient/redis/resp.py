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


def all_rows(buf: bytearray, size: int, counts: list[int], row_bytes: int
             ) -> np.ndarray | None:
    """The rows of consecutive HMGET replies in ``buf[:size]`` (reply ``i`` for
    ``counts[i]`` keys), when every key was found with a value of ``row_bytes`` bytes:
    one ``V<row_bytes>`` array in reply order (a copy). None when any reply is otherwise (a
    miss, another length, an error): decode those one by one.

    Every reply's layout is then known in advance, so the whole buffer is checked and
    gathered in a few numpy operations, however many replies: a lookup of a hundred keys
    spread over 64 partitions costs no more than one of a single partition.
    """
    n = len(counts)
    if n == 0:
        return None
    head = b"$%d\r\n" % row_bytes
    hl = len(head)
    rec = hl + row_bytes + 2
    heads = [b"*%d\r\n" % m for m in counts]
    cnt = np.asarray(counts, dtype=np.int64)
    sizes = np.fromiter(map(len, heads), dtype=np.int64, count=n) + cnt * rec
    ends = np.cumsum(sizes)
    if int(ends[-1]) != size:
        return None
    view = memoryview(buf)
    for s, h in zip((ends - sizes).tolist(), heads, strict=True):
        if view[s:s + len(h)] != h:
            return None
    total = int(cnt.sum())
    first = np.repeat(ends - cnt * rec, cnt)  # each reply's first record, per record
    within = np.arange(total) - np.repeat(np.cumsum(cnt) - cnt, cnt)
    starts = first + within * rec  # where each record (head, row, CRLF) starts
    arr = np.frombuffer(buf, dtype=np.uint8, count=size)
    if not bool((arr[starts[:, None] + np.arange(hl)] ==
                 np.frombuffer(head, dtype=np.uint8)).all()):
        return None
    crlf = starts + (hl + row_bytes)
    if not bool(((arr[crlf] == 13) & (arr[crlf + 1] == 10)).all()):
        return None
    # NOTE: every row_bytes-long window of the buffer as one element (overlapping views):
    # one fancy index copies the rows out
    windows = np.ndarray((size - row_bytes + 1,), dtype=f"V{row_bytes}", buffer=arr,
                         strides=(1,))
    return windows[starts + hl]


def decode_row_replies(buf: bytearray, size: int, ncmds: int, row_bytes: int
                       ) -> list[np.ndarray | Any]:
    """Decode ``ncmds`` HMGET replies from ``buf[:size]`` (complete replies), as
    :class:`RowReplyReader` does: row views (views of ``buf``) first, then what hiredis
    decoded from the first reply off the fast path on."""
    reader = RowReplyReader(ncmds, row_bytes)
    out: list[np.ndarray | Any] = []
    reader.feed(buf, size, lambda _i, rows: out.append(rows))
    return out + reader.finish(buf, size)
