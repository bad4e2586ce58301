"""ParameterServer.accumulate on file://, Redis and the 3-master cluster: the rows it writes
against torch (every dtype, duplicates summed, float16/bfloat16 added in float32 and
rounded once), missing keys neither written nor created, refused arguments writing nothing,
the change feed, and concurrent accumulates from several processes losing no addition.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import psclient
from psclient.redis.accumulate import compare_and_add, swap_commands

DIM = 5
DTYPES = ["float32", "float16", "bfloat16", "float64"]


@pytest.fixture
def opened(store_url: str, table_name: str) -> Iterator[tuple[str, str]]:
    """The store and a table name; every table of the name dropped afterwards."""
    yield store_url, table_name
    try:
        psclient.connect(store_url, table=table_name).drop()
    except psclient.TableNotFoundError:
        pass


def reference(stored: dict[int, torch.Tensor], keys: torch.Tensor, deltas: torch.Tensor,
              dtype: torch.dtype) -> dict[int, torch.Tensor]:
    """The rows after the accumulate, computed key by key: duplicates summed in batch
    order in the accumulator dtype, added to the row in it, rounded once."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    sums: dict[int, torch.Tensor] = {}
    for k, d in zip(keys.tolist(), deltas, strict=True):
        sums[k] = sums.get(k, torch.zeros(deltas.shape[1], dtype=acc)) + d.to(acc)
    out = dict(stored)
    for k, s in sums.items():
        if k in stored:
            out[k] = (stored[k].to(acc) + s).to(dtype)
    return out


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("delta_in_accumulator", [False, True])
def test_accumulate_matches_torch_for_every_dtype(opened: tuple[str, str], dtype_name: str,
                                                  delta_in_accumulator: bool) -> None:
    url, name = opened
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(7)
    with psclient.connect(url, table=name, dim=DIM, dtype=dtype_name, partitions=3) as ps:
        keys = torch.arange(-20, 40, 3, dtype=torch.int64)
        rows = (torch.randn(keys.numel(), DIM, generator=gen) * 100).to(dtype)
        ps.insert(keys, rows)
        stored = dict(zip(keys.tolist(), rows, strict=True))
        # duplicates, misses (never created), an extreme key
        ask = torch.tensor([-20, 1, -20, 22, 99, 22, -20, 37, 2**63 - 1, 1000], dtype=torch.int64)
        deltas = torch.randn(ask.numel(), DIM, generator=gen) * 3
        deltas = deltas if delta_in_accumulator and dtype != torch.float64 else deltas.to(dtype)
        before = ps.size()
        got = ps.accumulate(ask, deltas)
        assert got.tolist() == [k in stored for k in ask.tolist()]
        want = reference(stored, ask, deltas, dtype)
        everything = torch.tensor(sorted(set(want) | {99, 2**63 - 1, 1000}), dtype=torch.int64)
        values, found = ps.lookup(everything)
        assert found.tolist() == [k in stored for k in everything.tolist()]
        assert ps.size() == before
        for i, k in enumerate(everything.tolist()):
            if k in want:
                assert torch.equal(values[i], want[k]), (k, values[i], want[k])
            else:
                assert not values[i].any()


def test_float16_rounds_once_not_per_duplicate(opened: tuple[str, str]) -> None:
    """Four deltas of a quarter of a float16 ulp: added one by one in float16 each rounds
    away; summed in float32 first they make one ulp."""
    url, name = opened
    with psclient.connect(url, table=name, dim=1, dtype="float16") as ps:
        ps.insert(torch.tensor([3]), torch.tensor([[2048.0]], dtype=torch.float16))
        ulp = 2.0  # float16 spacing at 2048
        ps.accumulate(torch.tensor([3, 3, 3, 3]), torch.full((4, 1), ulp / 4))
        assert ps.lookup(torch.tensor([3]))[0].item() == 2048.0 + ulp


def test_refused_arguments_write_nothing(opened: tuple[str, str]) -> None:
    url, name = opened
    with psclient.connect(url, table=name, dim=DIM, dtype="float16") as ps:
        keys = torch.tensor([1, 2, 3])
        rows = torch.ones(3, DIM, dtype=torch.float16)
        ps.insert(keys, rows)
        cursor = ps.follow(None).cursor
        bad_deltas = [
            torch.ones(3, DIM, dtype=torch.float64),  # neither the dtype nor float32
            torch.ones(2, DIM, dtype=torch.float16),  # wrong length
            torch.ones(3, DIM + 1),                   # wrong dim
        ]
        for d in bad_deltas:
            with pytest.raises(psclient.BadValuesError, match="deltas"):
                ps.accumulate(keys, d)
        with pytest.raises(psclient.BadKeysError):
            ps.accumulate(torch.tensor([1.0, 2.0, 3.0]), torch.ones(3, DIM))  # type: ignore[arg-type]
        with pytest.raises(psclient.BadKeysError):
            ps.accumulate(torch.tensor([1, -(2**63), 3]), torch.ones(3, DIM))
        for bad in (float("nan"), float("inf")):
            nonfinite = torch.ones(3, DIM)
            nonfinite[1, 2] = bad
            with pytest.raises(psclient.NonFiniteValuesError, match="key 2"):
                ps.accumulate(keys, nonfinite)
        assert torch.equal(ps.lookup(keys)[0], rows)
        assert ps.follow(cursor).keys.numel() == 0
        nonfinite = torch.zeros(3, DIM)
        nonfinite[1, 2] = float("inf")
        assert ps.accumulate(keys, nonfinite, allow_nonfinite=True).all()
        assert ps.lookup(torch.tensor([2]))[0][0, 2].item() == float("inf")
        assert ps.accumulate(torch.empty(0, dtype=torch.int64), torch.empty(0, DIM)).numel() == 0


def test_announced_on_the_change_feed_as_update(opened: tuple[str, str]) -> None:
    url, name = opened
    with psclient.connect(url, table=name, dim=DIM, partitions=4) as ps:
        ps.insert(torch.arange(10), torch.zeros(10, DIM))
        cursor = ps.follow(None).cursor
        ps.accumulate(torch.tensor([4, 7, 4, 55]), torch.ones(4, DIM))
        assert sorted(ps.follow(cursor).keys.tolist()) == [4, 7]


def test_accumulate_refused_after_a_drop(opened: tuple[str, str]) -> None:
    url, name = opened
    with psclient.connect(url, table=name, dim=DIM) as ps:
        ps.insert(torch.arange(4), torch.zeros(4, DIM))
        psclient.connect(url, table=name).drop()
        with pytest.raises(psclient.TableDroppedError):
            ps.accumulate(torch.arange(4), torch.ones(4, DIM))
    with pytest.raises(psclient.TableNotFoundError):
        psclient.connect(url, table=name)


def test_a_row_changed_between_read_and_swap_is_read_again(shared_redis: str,
                                                           table_name: str) -> None:
    """Another handle adds to the rows right after this accumulate read them: the swap
    finds them changed, reads them again and adds on top (no addition lost)."""
    with psclient.connect(shared_redis, table=table_name, dim=2, partitions=2) as ps, \
            psclient.connect(shared_redis, table=table_name) as other:
        keys = torch.arange(6)
        ps.insert(keys, torch.zeros(6, 2))
        reads: list[int] = []

        def read(ks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
            got = ps.lookup(torch.from_numpy(ks))
            reads.append(ks.size)
            if len(reads) == 1:
                other.accumulate(torch.tensor([1, 4]), torch.full((2, 2), 10.0))
            return got

        kn = torch.tensor([0, 1, 4, 9]).numpy()
        existed = compare_and_add(kn, torch.ones(4, 2), torch.float32, read, ps._swap,
                                  ps.table)
        assert existed.tolist() == [True, True, True, False]
        assert reads == [4, 2]  # the second round read only the two rows changed meanwhile
        assert ps.lookup(keys)[0][:, 0].tolist() == [1.0, 11.0, 0.0, 0.0, 11.0, 0.0]
        ps.drop()


def test_a_resent_swap_answers_its_receipt_and_adds_once(shared_redis: str,
                                                         table_name: str) -> None:
    """The same compare-and-set commands sent twice (a pipeline resent after a lost
    connection): the second answers the first's flags and writes nothing again."""
    import redis

    with psclient.connect(shared_redis, table=table_name, dim=2, partitions=2) as ps:
        keys = torch.arange(4)
        ps.insert(keys, torch.zeros(4, 2))
        kn = torch.tensor([0, 2, 3, 7]).numpy()
        old, _ = ps.lookup(torch.from_numpy(kn))
        order, cmds = swap_commands(kn, old, old + 1, ps.part_keys, {
            "changes_maxlen": 100, "chunk_keys": 2}, ps.schema.token)
        encoded = [(c.part, b"".join(bytes(x) for x in c.payload)) for c in cmds]
        first = ps.run_commands(encoded)
        again = ps.run_commands(encoded)
        assert first == again and sorted(b"".join(first)) == sorted(b"1110")
        assert ps.lookup(keys)[0][:, 0].tolist() == [1.0, 0.0, 1.0, 1.0]
        client = redis.Redis.from_url(shared_redis)
        kept = sum(client.hlen(k + b":acc") for k in ps.part_keys)
        assert kept == len(cmds) == sum(client.zcard(k + b":accz") for k in ps.part_keys)
        # a receipt from long ago goes with the partition's next accumulate
        part = ps.part_keys[0]
        client.hset(part + b":acc", "stale", "1")
        client.zadd(part + b":accz", {"stale": 0})
        ps.accumulate(keys, torch.ones(4, 2))
        assert client.hget(part + b":acc", "stale") is None
        assert client.zscore(part + b":accz", "stale") is None
        ps.drop()
        assert not list(client.scan_iter(match=f"psc:{{{table_name}*"))  # receipts too
        client.close()


def adder(url: str, table: str, rounds: int, keys: list[int], start: mp.Barrier) -> int:
    """Add 1 to every key (twice to the first, a duplicate) ``rounds`` times."""
    with psclient.connect(url, table=table) as ps:
        k = torch.tensor([keys[0], *keys], dtype=torch.int64)
        start.wait()
        for _ in range(rounds):
            assert bool(ps.accumulate(k, torch.ones(k.numel(), DIM)).all())
    return rounds


@pytest.mark.parametrize("kind", ["file", "redis"])
def test_concurrent_accumulates_lose_no_addition(kind: str, tmp_path: Path,
                                                 table_name: str,
                                                 request: pytest.FixtureRequest) -> None:
    url = f"file://{tmp_path}/store" if kind == "file" else str(
        request.getfixturevalue("shared_redis"))
    procs, rounds = 3, 40
    keys = list(range(0, 48, 3))
    with psclient.connect(url, table=table_name, dim=DIM, partitions=2) as ps:
        ps.insert(torch.tensor(keys), torch.zeros(len(keys), DIM))
        try:
            ctx = mp.get_context("spawn")
            start = ctx.Manager().Barrier(procs + 1)
            with ctx.Pool(procs) as pool:
                jobs = [pool.apply_async(adder, (url, table_name, rounds, keys, start))
                        for _ in range(procs)]
                start.wait()
                assert [j.get(timeout=300) for j in jobs] == [rounds] * procs
            got, found = ps.lookup(torch.tensor(keys))
            assert bool(found.all())
            want = torch.full((len(keys), DIM), float(procs * rounds))
            want[0] *= 2
            assert torch.equal(got, want)
        finally:
            ps.drop()
