"""Key/row encodings, partitioning, RESP encoding and argument checks."""

from __future__ import annotations

import contextlib

import hiredis
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import psclient
from bench.ps.file_reads import assemble_rows
from psclient.codec import (
    assemble_distinct_rows,
    be_bytes_to_keys,
    be_key_bytes,
    check_keys,
    first_of_runs,
    group_by_partition,
    le_key_bytes,
    partition_of,
    row_bytes_list,
)
from psclient.redis import resp
from psclient.schema import TableSchema, dtype_name

INT64 = st.integers(-(2**63), 2**63 - 1)


@given(st.lists(INT64, min_size=1, max_size=50))
def test_big_endian_key_bytes_sort_like_signed_keys(keys: list[int]) -> None:
    arr = np.array(keys, dtype=np.int64)
    kb = be_key_bytes(arr)
    assert all(len(b) == 8 for b in kb)
    assert sorted(kb) == be_key_bytes(np.sort(arr))
    assert be_bytes_to_keys(b"".join(kb)).tolist() == keys


def test_little_endian_fields_keep_trailing_zero_bytes() -> None:
    kb = le_key_bytes(np.array([0, 256, -1], dtype=np.int64))
    assert kb == [bytes(8), b"\x00\x01" + bytes(6), b"\xff" * 8]


def test_partition_is_spread_and_grouped() -> None:
    counts = np.bincount(partition_of(np.arange(64_000, dtype=np.int64), 64), minlength=64)
    assert counts.min() > 800 and counts.max() < 1200
    order, bounds = group_by_partition(np.arange(1000, dtype=np.int64)[::-1].copy(), 8)
    assert bounds[0] == 0 and bounds[-1] == 1000 and (np.diff(bounds) >= 0).all()


@given(st.lists(st.integers(-50, 50), min_size=1, max_size=200),
       st.sampled_from([1, 3, 64, 65_536, 70_000]))
def test_group_by_partition_is_a_stable_sort_by_partition(keys: list[int], parts: int) -> None:
    # NOTE: up to 2**16 partitions take the uint16 radix sort, above it the int64 sort;
    # stability keeps duplicate keys in batch order (the last of duplicates wins)
    arr = np.array(keys, dtype=np.int64)
    part = partition_of(arr, parts)
    order, bounds = group_by_partition(arr, parts)
    model = sorted(range(len(keys)), key=lambda i: int(part[i]))
    assert order.tolist() == model
    assert bounds.tolist() == [0, *np.cumsum(np.bincount(part, minlength=parts)).tolist()]


def test_pinned_partition_values() -> None:
    # NOTE: changing the hash moves every stored key: bump LAYOUT_VERSION with it
    got = partition_of(np.array([0, 1, 12345, -7], dtype=np.int64), 64).tolist()
    assert got == [0, 44, 57, 62]


def test_resp_records_match_hiredis_encoding() -> None:
    keys = np.array([5, -9], dtype=np.int64)
    rows = np.arange(8, dtype=np.uint8).reshape(2, 4)
    head = resp.header(2 + 4, b"HSET", b"k")
    body = bytes(resp.as_buffer(resp.field_value_records(keys, rows)))
    kb = le_key_bytes(keys)
    want = hiredis.pack_command((b"HSET", b"k", kb[0], bytes(rows[0]), kb[1], bytes(rows[1])))
    assert head + body == want
    assert resp.header(2 + 2, b"HMGET", b"k") + bytes(resp.as_buffer(
        resp.field_records(keys))) == hiredis.pack_command((b"HMGET", b"k", *kb))


def test_the_reference_assembly_orders_fills_misses_and_flags_bad_lengths() -> None:
    schema = TableSchema(dim=2, dtype="float32")
    vals = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    rb = row_bytes_list(vals)
    keys = np.array([10, 11, 12], dtype=np.int64)
    order = np.array([2, 0, 1])
    got, found = assemble_rows([rb[1], None, rb[0]], order, keys, schema, "t")
    assert found.tolist() == [False, True, True]
    assert torch.equal(got, torch.tensor([[0.0, 0.0], [1.0, 2.0], [3.0, 4.0]]))
    got[0, 0] = 5.0  # the result is writable and owned
    with pytest.raises(psclient.CorruptValueError, match="'t', key 11: stored value has 3"):
        assemble_rows([None, b"abc", rb[0]], np.array([0, 1, 2]), keys, schema, "t")


def test_assemble_distinct_rows_spreads_duplicates_and_tells_misses_by_identity() -> None:
    schema = TableSchema(dim=2, dtype="float32")
    keys = np.array([12, 10, 12, 11, 10, 12], dtype=np.int64)
    order = np.argsort(keys, kind="stable")
    first = first_of_runs(keys[order])
    distinct = keys[order][first]
    assert distinct.tolist() == [10, 11, 12]
    assert first.tolist() == [True, False, True, True, False, False]
    miss = bytes(schema.row_bytes)
    stored_zero = bytes(bytearray(schema.row_bytes))  # a stored row of zeros: found
    row12 = row_bytes_list(torch.tensor([[1.5, -2.0]]))[0]
    got, found = assemble_distinct_rows([stored_zero, miss, row12], miss, order, first,
                                        distinct, schema, "t")
    assert found.tolist() == [True, True, True, False, True, True]
    assert got.dtype == torch.float32 and got.shape == (6, 2)
    want = torch.tensor([[1.5, -2.0], [0.0, 0.0], [1.5, -2.0], [0.0, 0.0], [0.0, 0.0],
                         [1.5, -2.0]])
    assert torch.equal(got, want)
    got[0, 0] = 9.0  # the result is writable and owned: the other copies of key 12 stay
    assert got[2, 0] == 1.5
    with pytest.raises(psclient.CorruptValueError,
                       match="'t', key 11: stored value has 3 bytes.* 1 bad value"):
        assemble_distinct_rows([stored_zero, b"abc", row12], miss, order, first, distinct,
                               schema, "t")


@given(st.lists(st.integers(-3, 3), min_size=1, max_size=30))
def test_first_of_runs_marks_each_distinct_key_once(keys: list[int]) -> None:
    ks = np.sort(np.array(keys, dtype=np.int64))
    first = first_of_runs(ks)
    assert ks[first].tolist() == sorted(set(keys))
    assert first[0]


def test_check_keys_and_dtype_names() -> None:
    assert check_keys(torch.tensor([1, 2])).dtype == np.int64
    with pytest.raises(psclient.BadKeysError, match="1-D"):
        check_keys(torch.zeros(2, 2, dtype=torch.int64))
    assert psclient.TableSchema(dim=3, dtype="bfloat16").row_bytes == 6
    with pytest.raises(psclient.BadArgumentError):
        psclient.TableSchema(dim=0, dtype="float32")
    assert dtype_name("fp16") == "float16" and dtype_name(torch.float64) == "float64"


def test_schema_round_trip_and_errors() -> None:
    s = TableSchema(dim=8, dtype="float16", partitions=32)
    assert TableSchema.decode(s.encode(), "t") == s
    with pytest.raises(psclient.CorruptValueError, match="unreadable"):
        TableSchema.decode(b"\x93\x01", "t")
    old = TableSchema(dim=8, dtype="float16", partitions=32, layout=0)
    with pytest.raises(psclient.SchemaMismatchError, match="layout version 0"):
        old.check("t", dim=None, dtype=None, partitions=None)


def test_decode_row_replies_fast_path_then_hiredis_fallback() -> None:
    rows = [bytes([i]) * 4 for i in range(3)]
    full = b"*2\r\n$4\r\n" + rows[0] + b"\r\n$4\r\n" + rows[1] + b"\r\n"
    miss = b"*2\r\n$-1\r\n$4\r\n" + rows[2] + b"\r\n"
    err = b"-MOVED 12 127.0.0.1:7001\r\n"
    buf = bytearray(full + full + miss + full + err)
    out = resp.decode_row_replies(buf, len(buf), 5, 4)
    assert isinstance(out[0], np.ndarray) and isinstance(out[1], np.ndarray)
    assert out[0].dtype == np.dtype("V4") and out[0].shape == (2,)  # one element per row
    assert out[0].tobytes() == rows[0] + rows[1]
    assert out[2] == [None, rows[2]]               # from the first irregular reply on: hiredis
    assert out[3] == [rows[0], rows[1]]
    assert isinstance(out[4], hiredis.ReplyError) and "MOVED" in str(out[4])
    wrong_len = bytearray(b"*1\r\n$3\r\nabc\r\n")
    assert resp.decode_row_replies(wrong_len, len(wrong_len), 1, 4) == [[b"abc"]]


@pytest.mark.parametrize("row_bytes", [1, 4, 64, 512, 1024, 10**6])
def test_decode_row_replies_checks_every_records_framing(row_bytes: int) -> None:
    """Heads ``$N\\r\\n`` of 4 to 10 bytes: a reply whose records are all well framed is a
    row view; one record of another length, or a broken CRLF anywhere, sends the reply to
    hiredis (which then reads it as it is)."""
    rng = np.random.default_rng(row_bytes)
    rows = [rng.integers(0, 256, row_bytes, dtype=np.uint8).tobytes() for _ in range(5)]

    def reply(values: list[bytes]) -> bytes:
        return b"*%d\r\n" % len(values) + b"".join(b"$%d\r\n%b\r\n" % (len(v), v)
                                                  for v in values)

    good = bytearray(reply(rows))
    out = resp.decode_row_replies(good, len(good), 1, row_bytes)
    assert isinstance(out[0], np.ndarray) and out[0].tobytes() == b"".join(rows)
    for i in (0, 2, 4):  # a short value first, in the middle, last
        bad = list(rows)
        bad[i] = bad[i][:-1] + b""
        if not bad[i]:
            bad[i] = b"xy"
        buf = bytearray(reply(bad))
        assert resp.decode_row_replies(buf, len(buf), 1, row_bytes) == [bad]
    # same lengths, but one record's CRLF is broken: not a row view
    broken = bytearray(reply(rows))
    pos = len(b"*5\r\n") + 3 * (len(b"$%d\r\n" % row_bytes) + row_bytes + 2) - 1
    assert broken[pos] == 10
    broken[pos] = 11
    got = resp.decode_row_replies(broken, len(broken), 1, row_bytes)
    assert not isinstance(got[0], np.ndarray)
    # same lengths, but a middle record's head ends in another byte than LF
    hl = len(b"$%d\r\n" % row_bytes)
    pos = len(b"*5\r\n") + 2 * (hl + row_bytes + 2) + hl - 1
    broken = bytearray(reply(rows))
    assert broken[pos] == 10
    broken[pos] = 11
    with contextlib.suppress(hiredis.ProtocolError):
        got = resp.decode_row_replies(broken, len(broken), 1, row_bytes)
        assert not isinstance(got[0], np.ndarray)


def _hmget_replies(replies: list[list[bytes | None]]) -> bytearray:
    """RESP2 array replies of bulk strings (None: a nil), as HMGET answers."""
    buf = bytearray()
    for items in replies:
        buf += b"*%d\r\n" % len(items)
        for x in items:
            buf += b"$-1\r\n" if x is None else b"$%d\r\n%b\r\n" % (len(x), x)
    return buf


@given(st.lists(st.integers(1, 12), min_size=1, max_size=20), st.integers(1, 40),
       st.integers(0, 2**32))
def test_all_rows_equals_hiredis_and_refuses_any_irregular_reply(
        counts: list[int], row_bytes: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows = [[rng.integers(0, 256, row_bytes, dtype=np.uint8).tobytes() for _ in range(m)]
            for m in counts]
    buf = _hmget_replies(rows)
    got = resp.all_rows(buf, len(buf), counts, row_bytes)
    reader = hiredis.Reader()
    reader.feed(bytes(buf))
    want = [x for _ in counts for x in reader.gets()]
    assert got is not None and [bytes(r) for r in got] == want
    # every kind of irregular reply: the caller must decode one by one
    i = int(rng.integers(0, len(counts)))
    j = int(rng.integers(0, counts[i]))
    miss = [list(r) for r in rows]
    miss[i][j] = None
    other = [list(r) for r in rows]
    other[i][j] = other[i][j] + b"x"
    for bad in (_hmget_replies(miss), _hmget_replies(other)):
        assert resp.all_rows(bad, len(bad), counts, row_bytes) is None
    error = bytearray(buf)
    error[: len(b"*%d" % counts[0])] = b"-" * len(b"*%d" % counts[0])
    assert resp.all_rows(error, len(error), counts, row_bytes) is None
    assert resp.all_rows(buf, len(buf) - 1, counts, row_bytes) is None
    assert resp.all_rows(buf, len(buf), [*counts[:-1], counts[-1] + 1], row_bytes) is None
    assert resp.all_rows(bytearray(), 0, [], row_bytes) is None
