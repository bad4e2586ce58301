"""The psclient CLI through its real entry point (``main(argv)``), on file:// and Redis.

Every error must be one line ``psclient: error: ...`` on stderr, a non-zero exit, and no
change to the store (no table created, nothing written).
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from safetensors.torch import save_file

import psclient
from psclient.cli import main
from tests.project import project_version


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def one_line_error(err: str) -> str:
    assert err.startswith("psclient: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


def tables(url: str, prefix: str) -> list[str]:
    """This test's tables in ``url`` (the store may not exist: then none)."""
    try:
        return [n for n in psclient.list_tables(url) if n.startswith(prefix)]
    except psclient.PSUnavailableError:
        return []


def test_load_stat_ls_drop(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"file://{tmp_path}/store"
    data = torch.randn(500, 8).half()
    save_file({"a": data, "b": torch.zeros(1)}, str(tmp_path / "emb.safetensors"))
    before = dt.datetime.now(dt.UTC).replace(microsecond=0)
    assert main(["load", url, "--table", "emb", str(tmp_path / "emb.safetensors"),
                 "--tensor", "a", "--batch-size", "128", "--progress"]) == 0
    out = capsys.readouterr()
    assert "loaded 500 rows into emb" in out.out and "rows/s" in out.out
    assert "500" in out.err  # the tqdm bar, asked for (stderr is not a terminal here)
    assert main(["stat", url, "--table", "emb", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["rows"], info["dim"], info["dtype"], info["backend"]) == (500, 8, "float16",
                                                                           "lmdb")
    created = dt.datetime.fromisoformat(info["created"])  # an ISO date, not an epoch
    assert created.tzinfo is not None and before <= created <= dt.datetime.now(dt.UTC)
    with psclient.connect(url, table="emb") as ps:
        got, found = ps.lookup(torch.arange(500))
        assert found.all() and torch.equal(got, data)
    rc, out, _ = run(capsys, "stat", url, "--table", "emb")
    assert rc == 0 and f"created        {info['created']}" in out.splitlines()
    rc, out, _ = run(capsys, "ls", url)
    assert rc == 0
    head, line = out.splitlines()
    assert head.split() == ["TABLE", "DIM", "DTYPE", "ROWS", "CREATED", "STATE"]
    assert line.split() == ["emb", "8", "float16", "500", info["created"], "ready"]
    assert json.loads(run(capsys, "ls", url, "--json")[1]) == [
        {k: info[k] for k in ("dim", "dtype", "rows", "created")}
        | {"table": "emb", "state": "ready", "loads": []}]
    assert main(["drop", url, "--table", "emb"]) == 0
    assert "dropped table emb (500 rows)" in capsys.readouterr().out
    rc, out, err = run(capsys, "stat", url, "--table", "emb")
    assert rc == 1 and out == ""
    assert "no table 'emb'" in one_line_error(err) and "psclient ls" in err
    assert run(capsys, "ls", url)[1] == f"no tables at {url}\n"


def bad_loads(d: Path) -> list[list[str]]:
    """Loads that must fail before anything is written, with the files they read."""
    np.save(d / "rows.npy", np.ones((10, 4), dtype=np.float32))
    np.save(d / "ints.npy", np.ones((10, 4), dtype=np.int32))
    np.ones((10, 4), dtype=np.float32).tofile(d / "rows.bin")
    (d / "ragged.bin").write_bytes(b"\0" * 17)
    np.arange(9, dtype=np.int64).tofile(d / "nine.keys")
    (d / "odd.keys").write_bytes(b"\0" * 12)
    (d / "rows.csv").write_text("1,2,3,4\n")
    f = str(d / "rows.npy")
    return [
        [f, "--batch-size", "0"],
        [f, "--batch-size", "-5"],
        [f, "--dim", "5"],  # the file's rows have 4 elements
        [str(d / "ints.npy")],  # int rows: a table holds floats; --dtype converts
        [str(d / "rows.bin")],  # raw rows of a new table: --dim is needed
        [str(d / "rows.bin"), "--dim", "3"],  # 160 bytes are not whole rows of 3 floats
        [str(d / "ragged.bin"), "--dim", "4"],
        [f, "--keys", str(d / "nine.keys")],  # 9 keys for 10 rows
        [f, "--keys", str(d / "odd.keys")],
        [f, "--keys", str(d / "missing.keys")],
        [str(d / "missing.npy")],
        [str(d / "rows.csv")],
        [f, "--format", "safetensors"],
        [f, "--dtype", "int16"],  # no table stores it (int8 is a quantized format)
        [f, "--dtype", "int8", "--dim", "5"],  # a quantized table: rows still of its dim
    ]


def test_failed_loads_leave_the_store_as_it_was(
        store: str, table_name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for i, argv in enumerate(bad_loads(tmp_path)):
        name = f"{table_name}-{i}"
        rc, out, err = run(capsys, "load", store, "--table", name, *argv, "--no-progress")
        assert rc in (1, 2) and out == "", argv
        one_line_error(err)
        assert tables(store, table_name) == [], (argv, err)
    if store.startswith("file://"):
        assert not (tmp_path / "store").exists()  # not even the store's directory


def test_mismatch_with_an_existing_table_changes_nothing(
        store: str, table_name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.save(tmp_path / "rows.npy", np.ones((10, 4), dtype=np.float32))
    with psclient.connect(store, table=table_name, dim=4, dtype=torch.float16) as ps:
        ps.insert(torch.tensor([1]), torch.full((1, 4), 7.0, dtype=torch.float16))
    f = str(tmp_path / "rows.npy")
    for argv, says in [([f, "--dim", "8"], "--dim 8"), ([f, "--dtype", "float32"], "--dtype"),
                       ([f], "--dtype float16")]:  # float32 rows, float16 table: say --dtype
        rc, _, err = run(capsys, "load", store, "--table", table_name, *argv, "--no-progress")
        assert rc == 1 and says in one_line_error(err), err
    with psclient.connect(store, table=table_name) as ps:
        assert (ps.dim, ps.dtype, ps.size()) == (4, torch.float16, 1)
        assert torch.equal(ps.lookup(torch.tensor([1]))[0], torch.full((1, 4), 7.0).half())


def test_a_load_that_fails_midway_drops_the_table_it_created(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a store too small for the rows: LMDB reports the map full after some batches
    np.save(tmp_path / "big.npy", np.ones((20000, 64), dtype=np.float32))
    url = f"file://{tmp_path}/small?map_size=1000000"
    rc, _, err = run(capsys, "load", url, "--table", "t", str(tmp_path / "big.npy"),
                     "--batch-size", "1000", "--no-progress")
    assert rc == 1 and "store is full" in one_line_error(err)
    assert psclient.list_tables(url) == []


def test_dtype_converts_on_load(store: str, table_name: str, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    data = torch.randn(50, 4, dtype=torch.float64)
    np.save(tmp_path / "rows.npy", data.numpy())
    f = str(tmp_path / "rows.npy")
    assert run(capsys, "load", store, "--table", table_name, f, "--dtype", "float16",
               "--no-progress")[0] == 0
    # an existing float16 table: --dtype float16 converts the float64 rows again
    assert run(capsys, "load", store, "--table", table_name, f, "--dtype", "float16",
               "--no-progress")[0] == 0
    with psclient.connect(store, table=table_name) as ps:
        assert (ps.dim, ps.dtype) == (4, torch.float16)
        got, found = ps.lookup(torch.arange(50))
        assert found.all() and torch.equal(got, data.half())
    ints = np.arange(12, dtype=np.int32).reshape(3, 4)
    np.save(tmp_path / "ints.npy", ints)
    name = table_name + "-i"
    assert run(capsys, "load", store, "--table", name, str(tmp_path / "ints.npy"), "--dtype",
               "float32", "--no-progress")[0] == 0
    with psclient.connect(store, table=name) as ps:
        assert torch.equal(ps.lookup(torch.arange(3))[0], torch.from_numpy(ints).float())


def test_raw_rows_and_keys_file(store: str, table_name: str, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    data = torch.randn(30, 3).to(torch.bfloat16)
    (tmp_path / "rows.raw").write_bytes(data.view(torch.int16).numpy().tobytes())
    keys = np.arange(30, dtype="<i8") * 1000 - 7
    keys.tofile(tmp_path / "keys.bin")
    rc, out, err = run(capsys, "load", store, "--table", table_name, str(tmp_path / "rows.raw"),
                       "--dim", "3", "--dtype", "bfloat16", "--keys",
                       str(tmp_path / "keys.bin"), "--no-progress")
    assert rc == 0, err
    with psclient.connect(store, table=table_name) as ps:
        got, found = ps.lookup(torch.from_numpy(keys.astype(np.int64)))
        assert found.all() and torch.equal(got, data) and ps.size() == 30
    # into the existing table, geometry from the table; any name with --format raw
    (tmp_path / "more.dat").write_bytes(data[:5].view(torch.int16).numpy().tobytes())
    assert run(capsys, "load", store, "--table", table_name, str(tmp_path / "more.dat"),
               "--format", "raw", "--no-progress")[0] == 0
    with psclient.connect(store, table=table_name) as ps:
        assert torch.equal(ps.lookup(torch.arange(5))[0], data[:5]) and ps.size() == 35


def test_redis_url_with_a_bad_database_is_refused(
        shared_redis: str, table_name: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    np.save(tmp_path / "rows.npy", np.ones((10, 4), dtype=np.float32))
    base = shared_redis.rsplit("/", 1)[0]
    for path in ("abc", "0x1", "-1", "1/2"):
        url = f"{base}/{path}"
        with pytest.raises(psclient.UnsupportedURLError, match="database number"):
            psclient.connect(url, table=table_name, dim=4)
        rc, _, err = run(capsys, "load", url, "--table", table_name, str(tmp_path / "rows.npy"),
                         "--no-progress")
        assert rc == 1 and url in one_line_error(err) and "database number" in err
    db0 = redis.Redis.from_url(f"{base}/0")
    assert not db0.exists(f"psc:{{{table_name}}}:schema")  # nothing went to db 0
    db0.close()
    with pytest.raises(psclient.UnsupportedURLError, match="only db 0"):
        psclient.connect(base.replace("redis://", "redis+cluster://") + "/2", table="t")


def test_unreachable_or_wrong_stores_are_one_line(
        shared_redis: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "stat", "file:///proc/foo", "--table", "t")
    assert rc == 1 and out == "" and "no table 't'" in one_line_error(err)
    rc, _, err = run(capsys, "ls", "file:///proc/foo")
    assert rc == 1 and "no store" in one_line_error(err)
    np.save(tmp_path / "rows.npy", np.ones((2, 2), dtype=np.float32))
    rc, _, err = run(capsys, "load", "file:///proc/foo", "--table", "t",
                     str(tmp_path / "rows.npy"), "--no-progress")
    assert rc == 1 and "/proc/foo" in one_line_error(err)
    not_a_cluster = shared_redis.rsplit("/", 1)[0].replace("redis://", "redis+cluster://")
    for cmd in (["stat", not_a_cluster, "--table", "t"], ["ls", not_a_cluster]):
        rc, _, err = run(capsys, *cmd)
        assert rc == 1 and "not a Redis Cluster" in one_line_error(err)


def test_messages_speak_to_command_line_users(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"file://{tmp_path}/store"
    save_file({"a": torch.zeros(2, 2), "b": torch.zeros(2, 2)}, str(tmp_path / "two.safetensors"))
    np.save(tmp_path / "rows.npy", np.ones((3, 2), dtype=np.float32))
    errors = [run(capsys, *argv)[2] for argv in (
        ["stat", url, "--table", "t"],
        ["drop", url, "--table", "t"],
        ["load", url, "--table", "t", str(tmp_path / "two.safetensors")],
        ["load", url, "--table", "t", str(tmp_path / "rows.csv")],
        ["load", url, "--table", "t", str(tmp_path / "rows.npy"), "--dim", "3"],
    )]
    for err in errors:
        one_line_error(err)
        for api_words in ("dim=", "dtype=", "tensor=", "pass a tensor", "keys=", "convert="):
            assert api_words not in err, err
    assert "--tensor" in errors[2]


def test_help_version_and_bare_command(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys)
    assert rc == 2 and "required" not in one_line_error(err) and "ls, load, stat" in err
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"psclient {project_version()}\n"
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for scheme in ("file://", "redis://", "rediss://", "unix://", "redis+cluster://"):
        assert scheme in out
    for cmd in ("ls", "load", "stat", "drop"):
        assert cmd in out
    assert main(["load", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--table", "--tensor", "--format", "--keys", "--dim", "--dtype", "--batch-size"):
        assert flag in out
    rc, _, err = run(capsys, "load", "file:///x")
    assert rc == 2 and "--table" in one_line_error(err)


def test_console_script(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "psclient"
    if not exe.exists():
        pytest.skip("the `psclient` console script is not installed (pip install -e .)")
    proc = subprocess.run([str(exe), "stat", f"file://{tmp_path}/none", "--table", "t"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    one_line_error(proc.stderr)
    proc = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("psclient ")


def test_ls_redis_and_cluster(shared_redis: str, redis_cluster: str, table_name: str,
                              capsys: pytest.CaptureFixture[str]) -> None:
    for url in (shared_redis, redis_cluster):
        names = [f"{table_name}-{i}" for i in range(3)]
        for i, name in enumerate(names):
            with psclient.connect(url, table=name, dim=i + 1) as ps:
                ps.insert(torch.arange(i), torch.ones(i, i + 1))
        try:
            assert [n for n in psclient.list_tables(url) if n.startswith(table_name)] == names
            rows = json.loads(run(capsys, "ls", url, "--json")[1])
            ours = [r for r in rows if r["table"].startswith(table_name)]
            assert [(r["table"], r["dim"], r["rows"]) for r in ours] == [
                (n, i + 1, i) for i, n in enumerate(names)]
        finally:
            for name in names:
                psclient.connect(url, table=name).drop()
