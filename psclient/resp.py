"""Vectorized RESP2 encoding of the batch commands (HMGET, HSET, HDEL, EVAL).

Each key (and row) of a command has a fixed-size encoding, so a whole batch is encoded
with one numpy structured array instead of one Python object per argument::

    field   b"$8\\r\\n" + 8 key bytes (int64 little-endian) + b"\\r\\n"          14 bytes
    row     b"$<row_bytes>\\r\\n" + row bytes + b"\\r\\n"

A command is a small header (``*<argc>\\r\\n`` and its leading bulk strings) followed by a
contiguous slice of that array, sent as a memoryview (no copy).
"""

from __future__ import annotations

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


def decode_row_replies(buf: bytearray, size: int, ncmds: int, row_bytes: int
                       ) -> list[np.ndarray | Any]:
    """Decode ``ncmds`` HMGET replies from ``buf[:size]`` (complete replies).

    Fast path: a reply whose every element is a bulk string of exactly ``row_bytes`` bytes
    has a fixed layout; it is checked with numpy and returned as a 1-D view of ``buf`` with
    one ``V<row_bytes>`` element per row (strided over the RESP framing: no object per row,
    no copy; a 1-D void array scatters faster than a 2-D uint8 one). From the first reply that does
    not fit (a miss, a wrong-length value, an error) on, hiredis decodes the rest: those
    entries are lists of ``bytes | None`` or ``hiredis.ReplyError``.
    """
    head = b"$%d\r\n" % row_bytes
    rec_len = len(head) + row_bytes + 2
    arr = np.frombuffer(buf, dtype=np.uint8, count=size)
    row_type = np.dtype(f"V{row_bytes}")
    out: list[np.ndarray | Any] = []
    pos = 0
    while len(out) < ncmds and pos < size and buf[pos] == 0x2A:  # b"*"
        eol = buf.find(b"\r\n", pos, pos + 24)
        if eol < 0:
            break
        m = int(buf[pos + 1:eol])
        start = eol + 2
        end = start + m * rec_len
        if m < 0 or end > size:
            break
        if not _framed(arr, start, m, row_bytes, head):
            break
        out.append(np.ndarray((m,), dtype=row_type, buffer=arr, offset=start + len(head),
                              strides=(rec_len,)))
        pos = end
    if len(out) < ncmds:
        reader = hiredis.Reader()
        reader.feed(buf, pos, size - pos)  # type: ignore[arg-type]
        while len(out) < ncmds:
            reply = reader.gets()
            if reply is False:
                raise ValueError("truncated reply")  # NOTE: callers pass complete replies
            out.append(reply)
    return out
