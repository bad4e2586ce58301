"""Quantized parameter-server tables (int8, float8_e4m3fn) on file://, Redis and the
3-master cluster: what they store is nvecache.common.quant's encoding (differential,
odd dims), lookups its decoding; another format's attach is refused; non-finite rows are
refused whatever allow_nonfinite says, with nothing written; accumulate is decode, sum,
encode with stochastic rounding, atomically per row (two processes lose no update; a
thousand deltas under half a step add up); loads quantize float rows
(``psclient load --dtype int8``) and a dump loads back bit for bit; the feed and the
listings name the format.

What a table stores is read with the backend's own ``_lookup`` (the stored rows, before
``lookup`` decodes them): the bytes are what these tests compare.
"""

from __future__ import annotations

import json
import multiprocessing as mp
from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest
import redis
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import psclient
from nvecache.common import quant
from nvecache.common.rows import QUANTIZED, RowFormat
from psclient.cli import main
from psclient.schema import TableSchema, dtype_name
from tests import quant_drift
from tests.psclient.conftest import opened_tables

FORMATS = list(QUANTIZED)


@pytest.fixture
def make(store_url: str, table_name: str) -> Iterator[psclient.ParameterServer]:
    """``make(suffix, **connect kwargs)`` on each store; every table dropped afterwards."""
    with opened_tables(store_url, table_name) as opener:
        yield opener  # type: ignore[misc]


def stored(ps: psclient.ParameterServer, keys: torch.Tensor) -> torch.Tensor:
    """The bytes ``ps`` stores for ``keys`` (uint8 ``[N, row_bytes]``)."""
    raw, _ = ps._lookup(keys.numpy())
    assert raw.dtype == torch.uint8 and raw.shape == (keys.numel(), ps.schema.row_bytes)
    return raw


def rows_of(n: int, dim: int, seed: int) -> torch.Tensor:
    """Rows of every scale: each row ``randn * 10**e``, ``e`` in -3..3, and an offset."""
    gen = torch.Generator().manual_seed(seed)
    scale = 10.0 ** torch.randint(-3, 4, (n, 1), generator=gen).float()
    return torch.randn(n, dim, generator=gen) * scale + torch.randn(n, 1, generator=gen)


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main([*argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dim", [1, 5, 13, 128])
def test_stored_rows_are_the_codec_s_and_lookups_decode_them(make, name: str,
                                                             dim: int) -> None:
    fmt = RowFormat(name, dim)
    ps = make(dim=dim, dtype=name, partitions=3)
    assert ps.quantized and ps.dtype == getattr(torch, name)
    assert ps.schema.row_bytes == fmt.stored_bytes and ps.schema.dtype == name
    keys = torch.tensor([7, -3, 2**62, 7, 40, -(2**63) + 1])   # 7 twice: the last wins
    vals = rows_of(keys.numel(), dim, seed=dim)
    vals[4] = 2.5  # a constant row: scale 0, read back exactly
    ps.insert(keys, vals)
    distinct = torch.tensor([7, -3, 2**62, 40, -(2**63) + 1])
    want = quant.encode(vals[[3, 1, 2, 4, 5]], fmt)
    assert torch.equal(stored(ps, distinct), want)
    asked = torch.tensor([40, 7, 999, -3, 7])
    got, found = ps.lookup(asked)
    assert got.dtype == torch.float32 and got.shape == (5, dim)
    assert found.tolist() == [True, True, False, True, True]
    assert torch.equal(got[[0, 1, 3, 4]], quant.decode(want[[3, 0, 1, 0]], fmt))
    assert not got[2].any()
    assert torch.equal(got[0], torch.full((dim,), 2.5))
    err = (got[[1, 3]] - vals[[3, 1]]).abs()
    assert bool((err <= quant.error_bound(want[[0, 1]], fmt)).all())
    # update: only the keys that exist, quantized the same way
    new = rows_of(2, dim, seed=99)
    assert ps.update(torch.tensor([-3, 12345]), new).tolist() == [True, False]
    assert torch.equal(stored(ps, torch.tensor([-3])), quant.encode(new[:1], fmt))
    assert not ps.lookup(torch.tensor([12345]))[1].any() and ps.size() == 5
    empty, none = ps.lookup(torch.empty(0, dtype=torch.int64))
    assert empty.shape == (0, dim) and empty.dtype == torch.float32 and none.numel() == 0
    # the stored bytes themselves, as a host cache of the format is filled with them
    raw, found = ps.lookup_stored(asked)
    assert raw.dtype == torch.uint8 and raw.shape == (5, fmt.stored_bytes)
    assert found.tolist() == [True, True, False, True, True]
    assert torch.equal(raw[[0, 1, 3, 4]], stored(ps, asked[[0, 1, 3, 4]]))
    assert torch.equal(raw[[0, 1, 4]], want[[3, 0, 0]]) and not raw[2].any()
    assert torch.equal(quant.decode(raw, fmt), ps.lookup(asked)[0])
    none_raw, none = ps.lookup_stored(torch.empty(0, dtype=torch.int64))
    assert none_raw.shape == (0, fmt.stored_bytes) and none_raw.dtype == torch.uint8
    assert none.numel() == 0


def test_a_plain_table_s_stored_rows_are_its_lookup_s(make) -> None:
    ps = make(dim=3, dtype="float16")
    keys = torch.tensor([1, 2])
    ps.insert(keys, torch.randn(2, 3).half())
    for asked in (torch.tensor([2, 9, 1]), torch.empty(0, dtype=torch.int64)):
        raw, found = ps.lookup_stored(asked)
        values, found2 = ps.lookup(asked)
        assert raw.dtype == torch.float16 and torch.equal(raw, values)
        assert torch.equal(found, found2)
    with pytest.raises(psclient.BadKeysError):  # NOTE: the keys rule of every lookup
        ps.lookup_stored(torch.tensor([1, 2], dtype=torch.int32))


@pytest.mark.parametrize("name", FORMATS)
def test_writes_take_float_rows_of_any_plain_dtype_and_nothing_else(
        store: str, table_name: str, name: str) -> None:
    fmt = RowFormat(name, 6)
    with opened_tables(store, table_name) as open_:
        ps = open_(dim=6, dtype=name)
        base = rows_of(4, 6, seed=3)
        for given in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            v = base.to(given)
            ps.insert(torch.arange(4), v)
            assert torch.equal(stored(ps, torch.arange(4)), quant.encode(v, fmt)), given
        before = stored(ps, torch.arange(4))
        for bad in (base.to(torch.int8), base.to(torch.uint8), base.to(torch.complex64),
                    base[:, :5], base[:3]):
            with pytest.raises(psclient.BadValuesError):
                ps.insert(torch.arange(4), bad)
        with pytest.raises(psclient.BadKeysError):
            ps.insert(torch.tensor([1, -(2**63)]), base[:2])
        assert torch.equal(stored(ps, torch.arange(4)), before)


def test_another_format_is_refused_on_attach(store_url: str, table_name: str) -> None:
    with opened_tables(store_url, table_name) as open_:
        q = open_("_q", dim=8, dtype=torch.int8)
        for same in ("int8", torch.int8, None):
            again = open_("_q", dtype=same)
            assert again.dtype == torch.int8 and again.schema == q.schema
        for other in ("float32", torch.float8_e4m3fn, "fp8", "float8_e4m3fn", torch.float16):
            with pytest.raises(psclient.SchemaMismatchError, match="dtype=int8"):
                psclient.connect(store_url, table=table_name + "_q", dtype=other)
        open_("_f", dim=8, dtype="float32")
        for other in ("int8", torch.float8_e4m3fn):
            with pytest.raises(psclient.SchemaMismatchError, match="dtype=float32"):
                psclient.connect(store_url, table=table_name + "_f", dtype=other)
        assert open_("_8", dim=3, dtype=torch.float8_e4m3fn).schema.dtype == "float8_e4m3fn"
        with pytest.raises(psclient.BadArgumentError, match="unsupported dtype"):
            psclient.connect(store_url, table=table_name + "_x", dim=8, dtype="int4")
    # the plain whitelist stays the default: only the places that store a table take these
    with pytest.raises(psclient.BadArgumentError):
        dtype_name(torch.int8)
    with pytest.raises(psclient.BadArgumentError):
        TableSchema(dim=4, dtype="float8_e4m3fn")


def test_the_schema_record_names_the_format(shared_redis: str, table_name: str) -> None:
    """An older psclient reads an unknown dtype and refuses the table, never its bytes."""
    with opened_tables(shared_redis, table_name) as open_:
        open_(dim=4, dtype="fp8")
        client = redis.Redis.from_url(shared_redis)
        rec = msgpack.unpackb(client.get(f"psc:{{{table_name}}}:schema"))
        client.close()
        assert rec["dtype"] == "float8_e4m3fn" and rec["dim"] == 4
        decoded = TableSchema.decode(msgpack.packb(rec), table_name)
        assert decoded.quantized and decoded.value_dtype == torch.float32


@pytest.mark.parametrize("name", FORMATS)
def test_nonfinite_rows_are_refused_whatever_allow_nonfinite_says(
        store: str, table_name: str, name: str) -> None:
    with opened_tables(store, table_name) as open_:
        ps = open_(dim=5, dtype=name)
        keys = torch.tensor([1, 2, 3])
        ps.insert(keys, torch.ones(3, 5))
        before = stored(ps, keys)
        cursor = ps.follow(None).cursor
        for bad in (float("nan"), float("inf"), float("-inf")):
            rows = torch.ones(3, 5)
            rows[1, 3] = bad
            for allow in (False, True):
                with pytest.raises(psclient.NonFiniteValuesError, match="key 2.*quantized"):
                    ps.insert(torch.tensor([1, 2, 9]), rows, allow_nonfinite=allow)
                with pytest.raises(psclient.NonFiniteValuesError, match="key 2"):
                    ps.update(keys, rows, allow_nonfinite=allow)
                with pytest.raises(psclient.NonFiniteValuesError, match="deltas.*key 2"):
                    ps.accumulate(keys, rows, allow_nonfinite=allow)
        assert ps.follow(cursor).keys.numel() == 0
        if name == "int8":  # NOTE: a finite row whose range (int8's scale) overflows float32
            with pytest.raises(psclient.NonFiniteValuesError, match="range.*key 9"):
                ps.insert(torch.tensor([9]), torch.tensor([[-3e38, 3e38, 0.0, 1.0, 2.0]]))
        # a finite row whose sum overflows float32
        ps.insert(torch.tensor([4]), torch.full((1, 5), 3e38))
        cursor = ps.follow(None).cursor
        with pytest.raises(psclient.NonFiniteValuesError, match="rows plus deltas.*key 4"):
            ps.accumulate(torch.tensor([1, 4]), torch.full((2, 5), 3e38))
        assert torch.equal(stored(ps, keys), before)
        assert ps.size() == 4 and not ps.lookup(torch.tensor([9]))[1].any()
        assert ps.follow(cursor).keys.numel() == 0


def check_added(table: dict[int, torch.Tensor], got: dict[int, torch.Tensor],
                keys: torch.Tensor, deltas: torch.Tensor, fmt: RowFormat) -> None:
    """Stored rows after an accumulate (``got``) against those before (``table``), key by
    key: each key's deltas summed in batch order in float32 and added to its decoded row
    give the exact sum; the row stored has the parameters rounding it to nearest gives,
    each element one of the two steps around the sum (stochastic rounding:
    ``quant.steps_around``), within one step of it. Keys not added to are unchanged."""
    sums: dict[int, torch.Tensor] = {}
    for k, d in zip(keys.tolist(), deltas, strict=True):
        sums[k] = sums.get(k, torch.zeros(fmt.dim)) + d
    assert sorted(got) == sorted(table)
    added = sorted(k for k in sums if k in table)
    for k in table:
        if k not in sums:
            assert torch.equal(got[k], table[k]), k
    if not added:
        return
    exact = torch.cat([quant.decode(table[k][None], fmt) + sums[k] for k in added])
    new = torch.stack([got[k] for k in added])
    assert torch.equal(quant.parameters(new, fmt),
                       quant.parameters(quant.encode(exact, fmt), fmt))
    back = quant.decode(new, fmt)
    below, above = (quant.decode(r, fmt) for r in quant.steps_around(exact, fmt))
    assert bool(((back == below) | (back == above)).all())
    assert bool(((back - exact).abs() <= quant.error_bound(new, fmt, stochastic=True)).all())


@pytest.mark.parametrize("name", FORMATS)
def test_accumulate_is_decode_sum_encode(make, name: str) -> None:
    fmt = RowFormat(name, 13)
    ps = make(dim=13, dtype=name, partitions=4)
    keys = torch.arange(-10, 30, 2)
    ps.insert(keys, rows_of(keys.numel(), 13, seed=5))
    table = dict(zip(keys.tolist(), stored(ps, keys), strict=True))
    cursor = ps.follow(None).cursor
    ask = torch.tensor([-10, 4, -10, 28, 99, 4, -10, 3])   # duplicates, misses
    gen = torch.Generator().manual_seed(11)
    every = torch.tensor(sorted(table))
    for round_ in range(3):
        deltas = torch.randn(ask.numel(), 13, generator=gen) * 10.0 ** (round_ - 1)
        got = ps.accumulate(ask, deltas)
        assert got.tolist() == [k in table for k in ask.tolist()]
        after = dict(zip(every.tolist(), stored(ps, every), strict=True))
        check_added(table, after, ask, deltas, fmt)
        table = after
    assert ps.size() == keys.numel() and not ps.lookup(torch.tensor([99, 3]))[1].any()
    assert sorted(ps.follow(cursor).keys.tolist()) == [-10, 4, 28]
    for bad in (torch.ones(8, 13, dtype=torch.float16), torch.ones(8, 13, dtype=torch.float64),
                torch.ones(8, 12)):
        with pytest.raises(psclient.BadValuesError, match="deltas"):
            ps.accumulate(ask, bad)


@pytest.mark.parametrize("name", FORMATS)
def test_many_small_deltas_add_up(store: str, table_name: str, name: str) -> None:
    """A thousand accumulates of a delta well under half a step (file://, Redis) end near
    the exact sum (tests/quant_drift.py: within 6 standard deviations of the rounding, on
    average), where rounding to nearest would lose every one."""
    case = quant_drift.scenario(name)
    keys = torch.arange(quant_drift.ROWS) * 5 - 7
    with opened_tables(store, table_name) as open_:
        ps = open_(dim=quant_drift.DIM, dtype=name, partitions=2)
        ps.insert(keys, case.start)
        start = ps.lookup(keys)[0]
        quant.seed_rounding(0)
        with quant_drift.one_thread():
            for _ in range(quant_drift.ADDS):
                assert bool(ps.accumulate(keys, case.delta).all())
        quant_drift.check_drift(case, start, ps.lookup(keys)[0])


def test_many_additions_stay_within_the_summed_bounds(tmp_path: Path, table_name: str) -> None:
    """Each addition re-quantizes the row (stochastically: within one step): after K of
    them an element is within the first row's bound plus the sum of the K stored rows'
    one-step bounds of the exact sum, a bound below one delta (so a lost addition would
    not pass)."""
    fmt = RowFormat("int8", 32)
    with opened_tables(f"file://{tmp_path}/store", table_name) as open_:
        ps = open_(dim=32, dtype="int8")
        start = torch.linspace(-1, 1, 32)[None]
        ps.insert(torch.tensor([5]), start)
        exact = start.double()
        bound = quant.error_bound(stored(ps, torch.tensor([5])), fmt).double()
        gen = torch.Generator().manual_seed(2)
        for _ in range(50):
            delta = torch.rand(1, 32, generator=gen) * 0.02 + 1.0
            ps.accumulate(torch.tensor([5]), delta)
            exact += delta.double()
            bound += quant.error_bound(stored(ps, torch.tensor([5])), fmt,
                                       stochastic=True).double()
        got = ps.lookup(torch.tensor([5]))[0].double()
        assert bool(((got - exact).abs() <= bound).all())
        assert float(bound.max()) < 1.0  # below one delta (each is at least 1)


def exact_rows(name: str, k: int, dim: int) -> torch.Tensor:
    """Rows ``448 * m * pattern`` for the integers ``m`` of ``k``: every format stores them
    exactly (int8: a constant row, scale 0; fp8: +-448 m, scale m), so do their sums."""
    pattern = torch.ones(dim) if name == "int8" else torch.tensor([1.0, -1.0]).repeat(dim)[:dim]
    return 448.0 * k.double()[:, None].float() * pattern


def adder(url: str, table: str, name: str, rounds: int, keys: list[int], start: mp.Barrier
          ) -> int:
    """Add ``exact_rows(1)`` to every key (twice to the first: a duplicate) ``rounds``
    times."""
    with psclient.connect(url, table=table) as ps:
        k = torch.tensor([keys[0], *keys])
        deltas = exact_rows(name, torch.ones(k.numel()), ps.dim)
        start.wait()
        for _ in range(rounds):
            assert bool(ps.accumulate(k, deltas).all())
    return rounds


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("kind", ["file", "redis", "cluster"])
def test_two_processes_accumulating_the_same_keys_lose_no_update(
        kind: str, name: str, tmp_path: Path, table_name: str,
        request: pytest.FixtureRequest) -> None:
    url = {"file": f"file://{tmp_path}/store"}.get(kind) or str(
        request.getfixturevalue("shared_redis" if kind == "redis" else "redis_cluster"))
    procs, rounds, dim = 2, 40, 7
    keys = list(range(0, 30, 3))
    fmt = RowFormat(name, dim)
    with opened_tables(url, table_name) as open_:
        ps = open_(dim=dim, dtype=name, partitions=2)
        first = exact_rows(name, torch.arange(len(keys)), dim)
        ps.insert(torch.tensor(keys), first)
        ctx = mp.get_context("spawn")
        start = ctx.Manager().Barrier(procs + 1)
        with ctx.Pool(procs) as pool:
            jobs = [pool.apply_async(adder, (url, table_name, name, rounds, keys, start))
                    for _ in range(procs)]
            start.wait()
            assert [j.get(timeout=300) for j in jobs] == [rounds] * procs
        added = torch.full((len(keys),), float(procs * rounds))
        added[0] *= 2
        want = exact_rows(name, torch.arange(len(keys)) + added, dim)
        got, found = ps.lookup(torch.tensor(keys))
        assert bool(found.all())
        # exact: every intermediate row is representable; within the bound all the more
        assert torch.equal(got, want)
        bound = quant.error_bound(stored(ps, torch.tensor(keys)), fmt)
        assert bool(((got - want).abs() <= bound).all())


@pytest.mark.parametrize("name", FORMATS)
def test_load_quantizes_float_rows(store: str, table_name: str, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str], name: str) -> None:
    fmt = RowFormat(name, 13)
    rows = rows_of(300, 13, seed=8)
    save_file({"weight": rows.half()}, str(tmp_path / "h.safetensors"))
    np.save(tmp_path / "f.npy", rows.double().numpy())
    alias = "fp8" if name != "int8" else "int8"
    with opened_tables(store, table_name) as open_:
        rc, out, err = cli(capsys, "load", store, "--table", table_name + "_a",
                           str(tmp_path / "h.safetensors"), "--dtype", alias, "--no-progress")
        assert rc == 0 and "loaded 300 rows" in out, err
        a = open_("_a")
        assert a.schema.dtype == name
        assert torch.equal(stored(a, torch.arange(300)), quant.encode(rows.half(), fmt))
        # into the existing table, without --dtype: float rows are what it takes
        assert cli(capsys, "load", store, "--table", table_name + "_a",
                   str(tmp_path / "f.npy"), "--no-progress")[0] == 0
        assert torch.equal(stored(a, torch.arange(300)), quant.encode(rows.double(), fmt))
        # the Python API: a tensor of any plain float dtype, and integers with convert
        b = open_("_b", dim=13, dtype=name)
        assert b.load(rows.bfloat16(), progress=False) == 300
        assert torch.equal(stored(b, torch.arange(300)), quant.encode(rows.bfloat16(), fmt))
        ints = torch.arange(26, dtype=torch.int32).view(2, 13)
        with pytest.raises(psclient.BadValuesError, match="convert=True"):
            b.load(ints)
        b.load(ints, keys=torch.tensor([1000, 1001]), convert=True)
        assert torch.equal(stored(b, torch.tensor([1000, 1001])),
                           quant.encode(ints.float(), fmt))
        b.load(iter([(torch.tensor([7, 2000]), rows[:2].half())]))   # chunks, as insert
        assert torch.equal(stored(b, torch.tensor([7, 2000])), quant.encode(rows[:2].half(), fmt))
        # NaN in the file: refused, --allow-nonfinite or not; no table created
        bad = rows.clone()
        bad[17, 4] = float("nan")
        save_file({"weight": bad}, str(tmp_path / "bad.safetensors"))
        for extra in ([], ["--allow-nonfinite"]):
            rc, _, err = cli(capsys, "load", store, "--table", table_name + "_c",
                             str(tmp_path / "bad.safetensors"), "--dtype", name, *extra)
            assert rc == 1 and "row 17" in err and "quantized" in err, err
        with pytest.raises(psclient.NonFiniteValuesError):
            b.load(bad, allow_nonfinite=True)
        assert b.size() == 303
        assert table_name + "_c" not in psclient.list_tables(store)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dim", [5, 128])
def test_dump_then_load_gives_the_same_stored_bytes(
        store: str, table_name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        name: str, dim: int) -> None:
    keys = torch.arange(-200, 800, 5)
    with opened_tables(store, table_name) as open_:
        src = open_("_src", dim=dim, dtype=name, partitions=4)
        src.insert(keys, rows_of(keys.numel(), dim, seed=dim))
        src.accumulate(keys[::3], torch.randn(keys[::3].numel(), dim))
        want = stored(src, keys)
        dump = tmp_path / "dump.safetensors"
        assert cli(capsys, "dump", store, "--table", table_name + "_src", str(dump),
                   "--no-progress")[0] == 0
        with safe_open(str(dump), framework="pt") as f:
            meta = f.metadata()
            assert (meta["dtype"], meta["dim"]) == (name, str(dim))
            weight, ks = f.get_tensor("weight"), f.get_tensor("keys")
        assert weight.dtype == torch.uint8 and weight.shape == (keys.numel(), want.shape[1])
        order = torch.argsort(ks)
        assert torch.equal(weight[order], want) and torch.equal(ks[order], keys)
        # the CLI creates the table from the dump: its format and dim, no --dtype
        rc, out, err = cli(capsys, "load", store, "--table", table_name + "_cli", str(dump),
                           "--no-progress")
        assert rc == 0, err
        back = open_("_cli")
        assert (back.schema.dtype, back.dim) == (name, dim)
        assert torch.equal(stored(back, keys), want)
        # the Python API, from .npy rows and keys
        src.dump(tmp_path / "dump.npy")
        npy = open_("_npy", dim=dim, dtype=name)
        assert npy.load(tmp_path / "dump.npy", keys=tmp_path / "dump.keys.npy") == keys.numel()
        assert torch.equal(stored(npy, keys), want)
        assert torch.equal(npy.lookup(keys)[0], src.lookup(keys)[0])
        # into a table of another format or dim: refused, nothing written or created
        other = "int8" if name != "int8" else "float8_e4m3fn"
        for kw in ({"dim": dim, "dtype": other}, {"dim": dim + 1, "dtype": name},
                   {"dim": dim, "dtype": "float32"}):
            t = open_(f"_{kw['dtype']}{kw['dim']}", **kw)
            with pytest.raises(psclient.BadValuesError, match="stored bytes"):
                t.load(dump)
            assert t.size() == 0
        rc, _, err = cli(capsys, "load", store, "--table", table_name + "_no", str(dump),
                         "--dtype", other)
        assert rc == 1 and "stored bytes" in err
        assert table_name + "_no" not in psclient.list_tables(store)


def test_listings_and_the_feed_name_the_format(shared_redis: str, table_name: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    url = shared_redis
    with opened_tables(url, table_name) as open_:
        q = open_("_q", dim=4, dtype="fp8")
        cursor = q.follow(None).cursor
        q.insert(torch.arange(3), torch.ones(3, 4))
        q.update(torch.tensor([1]), torch.zeros(1, 4))
        q.accumulate(torch.tensor([2, 7]), torch.ones(2, 4))
        assert q.follow(cursor).keys.tolist() == [1, 2]
        rc, out, _ = cli(capsys, "ls", url, "--json")
        listed = {r["table"]: r for r in json.loads(out)}
        assert rc == 0 and listed[table_name + "_q"]["dtype"] == "float8_e4m3fn"
        rc, out, _ = cli(capsys, "stat", url, "--table", table_name + "_q")
        assert rc == 0 and "float8_e4m3fn" in out
        assert q.stat()["dtype"] == "float8_e4m3fn"
        # a handle's table dropped and created anew as int8: the follow names both formats
        f = open_("_f", dim=4)
        cursor = f.follow(None).cursor
        psclient.connect(url, table=table_name + "_f").drop()
        open_("_f", dim=4, dtype="int8").insert(torch.arange(2), torch.ones(2, 4))
        with pytest.raises(psclient.SchemaMismatchError, match="dtype int8.*dtype float32"):
            f.follow(cursor)
