"""Tables to and from files: ``psclient dump`` / :func:`psclient.dump.dump_table` write
safetensors and .npy (keys and rows), ``psclient load`` / ``ps.load`` read them back,
a safetensors file's ``keys`` tensor giving the keys; for every table dtype, odd row lengths,
on file:// and Redis (and a cluster), through the CLI and the API; bad paths fail with one
line and leave no file behind."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import psclient
from psclient.dump import dump_table
from psclient.errors import BadArgumentError, BadKeysError
from tests.psclient.conftest import opened_tables
from tests.psclient.load.test_cli import one_line_error as one_line
from tests.psclient.load.test_cli import run

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def sample(n: int, dim: int, dtype: torch.dtype, seed: int = 0
           ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randperm(10 * n, generator=g)[:n].to(torch.int64) * 7 - 3 * n
    return keys, torch.randn(n, dim, generator=g).to(dtype)


def stored(url: str, table: str, keys: torch.Tensor) -> torch.Tensor:
    with psclient.connect(url, table=table) as ps:
        values, found = ps.lookup(keys)
        assert bool(found.all()) and ps.size() == keys.numel()
        return values


def leftovers(d: Path) -> list[str]:
    return sorted(f for f in os.listdir(d) if f.startswith(".") or f.endswith(".tmp"))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("fmt", ["safetensors", "npy"])
def test_api_round_trip_every_dtype(store: str, table_name: str, tmp_path: Path,
                                    dtype: torch.dtype, fmt: str) -> None:
    keys, rows = sample(777, 7, dtype)
    path = tmp_path / f"rows.{fmt}"
    with opened_tables(store, table_name) as make:
        src = make(dim=7, dtype=str(dtype).removeprefix("torch."))
        src.load(rows, keys=keys, progress=False)
        assert dump_table(src, path, progress=False) == 777
        back = make("b", dim=7, dtype=str(dtype).removeprefix("torch."))
        if fmt == "safetensors":
            loaded = back.load(path, progress=False)  # NOTE: keys from the file's `keys`
        else:
            loaded = back.load(path, keys=tmp_path / "rows.keys.npy", progress=False,
                               convert=dtype == torch.bfloat16)
        assert loaded == 777 and loaded.distinct == 777
        assert torch.equal(stored(store, table_name + "b", keys), rows)
    assert leftovers(tmp_path) == []
    if fmt == "safetensors":
        with safe_open(str(path), "pt") as f:
            assert f.get_tensor("weight").dtype == dtype
            assert f.metadata()["table"] == table_name
            order = f.get_tensor("keys").argsort()
            assert torch.equal(f.get_tensor("keys")[order], keys.sort().values)
    else:
        assert np.load(path).dtype == (np.float32 if dtype == torch.bfloat16
                                       else torch.empty(0, dtype=dtype).numpy().dtype)


@pytest.mark.parametrize("dim", [1, 33])
def test_cli_round_trip_odd_dims(store: str, table_name: str, tmp_path: Path, dim: int,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    keys, rows = sample(300, dim, torch.bfloat16, seed=dim)
    src = tmp_path / "in.safetensors"
    save_file({"weight": rows, "keys": keys}, str(src))
    assert run(capsys, "load", store, "--table", table_name, str(src), "--no-progress")[0] == 0
    assert torch.equal(stored(store, table_name, keys), rows)
    rc, out, _ = run(capsys, "dump", store, "--table", table_name, str(tmp_path / "o.npy"),
                     "--no-progress")
    assert rc == 0 and "dumped 300 rows" in out and "o.keys.npy" in out
    rc, out, _ = run(capsys, "dump", store, "--table", table_name,
                     str(tmp_path / "o.safetensors"), "--no-progress")
    assert rc == 0
    assert run(capsys, "load", store, "--table", table_name + "s",
               str(tmp_path / "o.safetensors"), "--no-progress")[0] == 0
    assert run(capsys, "load", store, "--table", table_name + "n", str(tmp_path / "o.npy"),
               "--keys", str(tmp_path / "o.keys.npy"), "--dtype", "bfloat16",
               "--no-progress")[0] == 0
    for suffix in ("s", "n"):
        assert torch.equal(stored(store, table_name + suffix, keys), rows)
    with psclient.connect(store, table=table_name + "s") as ps:
        assert ps.dtype == torch.bfloat16
    assert leftovers(tmp_path) == []


def test_dump_reads_every_row_once_across_partitions_and_clusters(
        store_url: str, table_name: str, tmp_path: Path) -> None:
    keys, rows = sample(20_000, 3, torch.float32, seed=5)
    with opened_tables(store_url, table_name) as make:
        ps = make(dim=3)
        ps.load(rows, keys=keys, progress=False)
        assert dump_table(ps, tmp_path / "all.safetensors", progress=False) == 20_000
    with safe_open(str(tmp_path / "all.safetensors"), "pt") as f:
        got_keys, got = f.get_tensor("keys"), f.get_tensor("weight")
    order, want = got_keys.argsort(), keys.argsort()
    assert torch.equal(got_keys[order], keys[want]) and torch.equal(got[order], rows[want])


def test_an_empty_table_dumps_and_loads(store: str, table_name: str, tmp_path: Path) -> None:
    with opened_tables(store, table_name) as make:
        ps = make(dim=4)
        assert dump_table(ps, tmp_path / "e.safetensors", progress=False) == 0
        assert dump_table(ps, tmp_path / "e.npy", progress=False) == 0
        assert make("b", dim=4).load(tmp_path / "e.safetensors", progress=False) == 0
    assert np.load(tmp_path / "e.npy").shape == (0, 4)
    assert np.load(tmp_path / "e.keys.npy").shape == (0,)


def test_safetensors_keys_tensor_rules(tmp_path: Path, table_name: str) -> None:
    keys, rows = sample(50, 2, torch.float32)
    url = f"file://{tmp_path}/store"
    three = tmp_path / "three.safetensors"
    save_file({"weight": rows, "keys": keys, "bias": rows[:, 0].contiguous()}, str(three))
    with opened_tables(url, table_name) as make:
        ps = make(dim=2)
        with pytest.raises(BadArgumentError, match="name one with tensor=NAME"):
            ps.load(three, progress=False)
        ps.load(three, tensor="weight", progress=False)  # NOTE: keys still from the file
        assert torch.equal(stored(url, table_name, keys), rows)
        short = tmp_path / "short.safetensors"
        save_file({"weight": rows, "keys": keys[:10].contiguous()}, str(short))
        with pytest.raises(BadKeysError, match="holds 10 keys for 50 rows"):
            make("b", dim=2).load(short, progress=False)
        other = tmp_path / "k.npy"
        np.save(other, np.arange(50) + 10**6)
        make("c", dim=2).load(three, tensor="weight", keys=other, progress=False)
        assert torch.equal(stored(url, table_name + "c", torch.arange(50) + 10**6), rows)


def test_dump_errors_are_one_line_and_leave_nothing(
        tmp_path: Path, table_name: str, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"file://{tmp_path}/store"
    keys, rows = sample(100, 3, torch.float32)
    with psclient.connect(url, table=table_name, dim=3) as ps:
        ps.load(rows, keys=keys, progress=False)
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.safetensors").write_bytes(b"keep me")
    cases = [
        (["--table", "nope", str(out / "a.safetensors")], "no table 'nope'"),
        (["--table", table_name, str(tmp_path / "missing" / "a.safetensors")],
         "cannot write"),
        (["--table", table_name, str(out / "a.txt")], "--format safetensors or npy"),
        (["--table", table_name, str(out / "a.safetensors"), "--keys", str(out / "k.npy")],
         "--keys is for .npy rows"),
        (["--table", table_name, str(out)], "cannot tell the format"),
    ]
    for argv, words in cases:
        rc, _, err = run(capsys, "dump", url, *argv, "--no-progress")
        assert rc == 1 and words in one_line(err), err
    blocker = out / "dir.safetensors"
    blocker.mkdir()
    (blocker / "x").write_text("x")
    rc, _, err = run(capsys, "dump", url, "--table", table_name, str(blocker), "--no-progress")
    assert rc == 1 and "cannot write" in one_line(err)
    assert sorted(os.listdir(out)) == ["dir.safetensors", "old.safetensors"]
    assert (out / "old.safetensors").read_bytes() == b"keep me"
    rc, _, _ = run(capsys, "dump", url, "--table", table_name, str(out / "old.safetensors"),
                   "--no-progress")
    assert rc == 0 and leftovers(out) == []
    with safe_open(str(out / "old.safetensors"), "pt") as f:
        assert f.get_tensor("weight").shape == (100, 3)


def test_a_key_scanned_twice_is_written_once() -> None:
    from psclient.dump import _Seen

    seen, rng, before = _Seen(), np.random.default_rng(0), np.empty(0, dtype=np.int64)
    for _ in range(100):
        keys = np.unique(rng.integers(0, 3000, 64))
        assert np.array_equal(seen.fresh(keys), ~np.isin(keys, before))
        before = np.union1d(before, keys)


def test_handle_dump_and_url_reconnect(store: str, table_name: str, tmp_path: Path) -> None:
    """``ps.dump`` is dump_table; ``ps.url`` (no password, no query) opens the same table."""
    keys, rows = sample(123, 5, torch.bfloat16)
    sep = "&" if "?" in store else "?"
    with opened_tables(store + f"{sep}changes_maxlen=77", table_name) as make:
        src = make(dim=5, dtype="bfloat16")
        src.load(rows, keys=keys, progress=False)
        assert "?" not in src.url and "changes_maxlen" not in src.url
        assert src.url.split("://")[0] == store.split("://")[0]
        with psclient.connect(src.url, table=table_name) as again:
            values, found = again.lookup(keys)
            assert bool(found.all()) and torch.equal(values, rows)
        assert src.dump(tmp_path / "d.safetensors", progress=False) == 123
        assert src.dump(tmp_path / "d.npy", format="npy", progress=False) == 123
        back = make("b", dim=5, dtype="bfloat16")
        assert back.load(tmp_path / "d.safetensors", progress=False) == 123
        assert torch.equal(stored(store, table_name + "b", keys), rows)
        with pytest.raises(BadArgumentError, match="format"):
            src.dump(tmp_path / "d.bin", progress=False)
    assert (tmp_path / "d.keys.npy").exists() and leftovers(tmp_path) == []
