"""The ``hostcache`` command in-process (``main([...])``) and once as the console script."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hostcache import HostCache, SharedMemBlock, SharedMemoryFullError, segment
from hostcache.cli import COMMANDS, main
from tests.project import project_version

CTX = mp.get_context("spawn")


def hold_attached(name: str, ready: mp.synchronize.Event, done: mp.synchronize.Event) -> None:
    """Child body: keep a handle on ``name`` until the parent is done with it."""
    hc = HostCache.attach(name)
    hc.lookup(torch.arange(4))
    ready.set()
    done.wait(30)
    hc.close()


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def ls_json(capsys: pytest.CaptureFixture[str], *patterns: str) -> list[dict]:
    rc, out, _ = run(capsys, "ls", "--json", *patterns)
    assert rc == 0
    return json.loads(out)


@pytest.fixture
def names(table_name: str) -> Iterator[list[str]]:
    """Table names for one test; whatever of them exists at the end is removed."""
    made = [table_name, table_name + "-b"]
    yield made
    for name in made:
        if segment.exists(name):
            segment.unlink(name)


@pytest.fixture
def attached_child(table_name: str) -> Iterator[int]:
    """A spawned process holding a handle on a fresh cache ``table_name``; yields its pid."""
    hc = HostCache.create(table_name, capacity=64, dim=4)
    ready, done = CTX.Event(), CTX.Event()
    child = CTX.Process(target=hold_attached, args=(table_name, ready, done))
    child.start()
    try:
        assert ready.wait(60), "child never attached"
        yield child.pid
    finally:
        done.set()
        child.join(30)
        hc.close()
        if segment.exists(table_name):
            HostCache.unlink(table_name)


def test_create_cache_then_ls_and_stat(
    capsys: pytest.CaptureFixture[str], names: list[str]
) -> None:
    name = names[0]
    rc, out, err = run(capsys, "create", name, "--capacity", "1000", "--dim", "16", "--ways", "16")
    assert (rc, err) == (0, "")
    assert "capacity 1,008" in out  # rounded up to whole buckets of 16 ways
    assert segment.exists(name)  # create leaves the table on the node

    hc = HostCache.attach(name)
    hc.insert(torch.arange(100), torch.ones(100, 16))
    hc.lookup(torch.arange(200))
    hc.close()

    (row,) = ls_json(capsys, name)
    assert row["kind"] == "hostcache"
    assert (row["capacity"], row["dim"], row["dtype"], row["ways"]) == (1008, 16, "float32", 16)
    assert row["size"] == hc_size(name)
    assert row["fill"] == pytest.approx(row["size"] / 1008)
    assert row["hit_rate"] == pytest.approx(row["size"] / 200)
    assert row["processes"] == 0  # the command's own handle is not counted
    assert row["segment_mib"] > 0

    rc, out, _ = run(capsys, "ls", name)
    header, line = out.splitlines()
    assert header.split()[:3] == ["NAME", "KIND", "CAPACITY"]
    assert line.split()[:6] == [name, "hostcache", "1,008", "16", "float32", "16"]
    assert header.index("MiB") + 3 == len(line)  # right-aligned columns line up

    rc, out, _ = run(capsys, "stat", name, "--json")
    info = json.loads(out)
    assert info["geometry"]["num_buckets"] == 63
    assert info["geometry"]["policy"] == "lfu-da"
    node = info["node"]
    assert (node["lookups"], node["inserts"], node["hits"] + node["misses"]) == (1, 100, 200)
    assert node["capacity"] == 1008 and node["processes"] == 0
    assert info["processes"] == []  # no other process is attached

    rc, out, _ = run(capsys, "stat", name)
    assert rc == 0 and "geometry:" in out and "node-wide counters:" in out
    assert "processes attached: none" in out


def hc_size(name: str) -> int:
    with HostCache.attach(name) as hc:
        return len(hc)


def test_create_linear_with_mode(capsys: pytest.CaptureFixture[str], names: list[str]) -> None:
    name = names[0]
    rc, out, _ = run(
        capsys, "create", name, "--linear", "--rows", "300", "--dim", "8",
        "--dtype", "bfloat16", "--mode", "0660", "--ring-capacity", "128",
    )  # fmt: skip
    assert rc == 0 and "linear" in out
    assert stat.S_IMODE(os.stat(segment.shm_path(name)).st_mode) == 0o660
    with SharedMemBlock.attach(name) as mb:
        assert (mb.num_rows, mb.dim, mb.dtype) == (300, 8, torch.bfloat16)
        assert mb.geometry.ring_capacity == 128
    (row,) = ls_json(capsys, name)
    assert (row["kind"], row["capacity"], row["ways"], row["fill"]) == ("linear", 300, None, None)
    info = json.loads(run(capsys, "stat", name, "--json")[1])
    assert info["geometry"]["rows"] == 300 and info["geometry"]["capacity"] is None


def test_ls_shows_a_broken_table_without_failing(
    capsys: pytest.CaptureFixture[str], names: list[str]
) -> None:
    good, broken = names
    assert main(["create", good, "--capacity", "64", "--dim", "4"]) == 0
    Path(segment.shm_path(broken)).write_bytes(b"not a table" * 1000)
    capsys.readouterr()

    rows = {r["name"]: r for r in ls_json(capsys, names[0] + "*")}
    assert rows[good]["kind"] == "hostcache"
    assert rows[broken]["error"].startswith("CorruptedHeaderError")
    rc, out, _ = run(capsys, "ls", names[0] + "*")
    assert rc == 0
    assert any(line.startswith(broken) and "cannot attach" in line for line in out.splitlines())

    rc, _, err = run(capsys, "stat", broken)
    assert rc == 2 and err.startswith("hostcache: error: ") and err.count("\n") == 1
    # a broken table has no attachers to protect: rm removes it without --force
    assert run(capsys, "rm", broken)[0] == 0
    assert not segment.exists(broken)


def test_rm_refuses_while_a_process_is_attached(
    capsys: pytest.CaptureFixture[str], table_name: str, attached_child: int
) -> None:
    (row,) = ls_json(capsys, table_name)
    assert row["processes"] == 1
    info = json.loads(run(capsys, "stat", table_name, "--json")[1])
    (slot,) = info["processes"]
    assert slot["pid"] == attached_child and slot["lookups"] == 1 and slot["misses"] == 4

    rc, out, err = run(capsys, "rm", table_name)
    assert rc == 2 and out == ""
    assert f"pids {attached_child}" in err and "--force" in err
    assert segment.exists(table_name)  # refused: nothing changed

    assert run(capsys, "rm", table_name, "--force")[0] == 0
    assert not segment.exists(table_name)


@pytest.mark.parametrize(
    "argv",
    [
        ["create", "{name}", "--capacity", "64", "--dim", "4"],  # exists already
        ["create", "bad/name", "--capacity", "64", "--dim", "4"],
        ["create", "{name}x", "--capacity", "0", "--dim", "4"],
        ["create", "{name}x", "--capacity", "64", "--dim", "4", "--ways", "3"],
        ["create", "{name}x", "--capacity", "64", "--dim", "4", "--mode", "0007"],
        ["create", "{name}x", "--linear", "--capacity", "64", "--dim", "4"],
        ["create", "{name}x", "--dim", "4"],
        ["stat", "{name}x"],
        ["rm", "{name}x"],
    ],
)
def test_user_errors_print_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], table_name: str, argv: list[str]
) -> None:
    with HostCache.create(table_name, capacity=64, dim=4):
        try:
            # NOTE: only this test's names: the other xdist worker creates tables meanwhile
            def ours() -> list[str]:
                return sorted(n for n in segment.list_names() if n.startswith(table_name))

            before = ours()
            rc, out, err = run(capsys, *(a.format(name=table_name) for a in argv))
            assert rc == 2 and out == ""
            assert err.startswith("hostcache: error: ") and err.count("\n") == 1
            assert "Traceback" not in err
            assert ours() == before  # nothing created or removed
        finally:
            HostCache.unlink(table_name)


def test_argparse_errors_return_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["create", "x", "--capacity", "8", "--dim", "4", "--dtype", "int4"]) == 2
    assert main(["create", "x", "--capacity", "8", "--dim", "4", "--mode", "rw"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(cmd.name in out for cmd in COMMANDS)


def test_console_script_runs(names: list[str]) -> None:
    name = names[0]
    exe = Path(sys.executable).parent / "hostcache"
    script = str(exe) if exe.exists() else shutil.which("hostcache")
    if script is None:
        pytest.skip("the `hostcache` console script is not installed (pip install -e .)")
    assert main(["create", name, "--capacity", "128", "--dim", "8"]) == 0
    listed = subprocess.run(
        [script, "ls", "--json", name], capture_output=True, text=True, timeout=60
    )
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)
    assert (row["name"], row["capacity"], row["dim"]) == (name, 128, 8)
    missing = subprocess.run([script, "stat", names[1]], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.startswith("hostcache: error: no table named")
    assert missing.stderr.count("\n") == 1 and "Traceback" not in missing.stderr


# -- issue 13: sizes, versions, messages ------------------------------------------------------


def shm_entries(name: str) -> list[str]:
    """Files of ``name`` in /dev/shm: its segment and its lock file."""
    return [p for p in (segment.shm_path(name), segment.lock_path(name)) if os.path.exists(p)]


def too_many_rows(row_bytes: int) -> int:
    """A row count whose table is larger than the free space of /dev/shm right now."""
    return 2 * segment.free_bytes() // row_bytes + 1


@pytest.mark.parametrize("kind", ["cache", "linear"])
def test_a_table_larger_than_shared_memory_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], table_name: str, kind: str
) -> None:
    size = ["--linear", "--rows"] if kind == "linear" else ["--capacity"]
    for rows in ("100000000000000", "1000000000", str(too_many_rows(1024 * 4))):
        rc, out, err = run(capsys, "create", table_name, *size, rows, "--dim", "1024")
        assert rc == 2 and out == ""
        assert err.startswith("hostcache: error: ") and err.count("\n") == 1, err
        assert "GiB free" in err and "--force" in err and "overcommit=" not in err
        assert shm_entries(table_name) == []  # nothing created, not even the lock file
    # --force asks the kernel: a segment it cannot even map is still one line, nothing left
    rc, _, err = run(capsys, "create", table_name, *size, "100000000000000", "--dim", "1024",
                     "--force")
    assert rc == 2 and err.startswith("hostcache: error: could not map") and err.count("\n") == 1
    assert shm_entries(table_name) == []


def test_library_create_refuses_what_shared_memory_cannot_hold(table_name: str) -> None:
    with pytest.raises(SharedMemoryFullError, match="overcommit=True") as e:
        HostCache.create(table_name, capacity=too_many_rows(64 * 4), dim=64)
    assert e.value.needed > e.value.free > 0
    with pytest.raises(SharedMemoryFullError):
        SharedMemBlock.create(table_name, num_rows=too_many_rows(64 * 4), dim=64)
    assert shm_entries(table_name) == []


def test_force_overcommits_on_purpose(
    capsys: pytest.CaptureFixture[str], names: list[str]
) -> None:
    name = names[0]
    rows = too_many_rows(16) // 2 + (64 << 20) // 16  # a sparse linear table past the free space
    rc, out, err = run(capsys, "create", name, "--linear", "--rows", str(rows), "--dim", "4",
                       "--force")
    assert rc == 0, err
    with SharedMemBlock.attach(name) as mb:
        assert mb.geometry.total_size > segment.free_bytes()
        mb.write(torch.tensor([rows - 1]), torch.ones(1, 4))  # one page is written, not all
        assert torch.equal(mb.read(torch.tensor([rows - 1])), torch.ones(1, 4))
    assert run(capsys, "rm", name)[0] == 0 and shm_entries(name) == []


def test_version_and_bare_command(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "required" not in err and "give a command: ls, stat, create, rm" in err
    rc, out, _ = run(capsys, "--version")
    assert rc == 0 and out == f"hostcache {project_version()}\n"
    rc, out, err = run(capsys, "create", "x", "--capacity", "8")
    assert rc == 2 and err.startswith("hostcache: error: ") and err.count("\n") == 1
    assert "usage:" not in err


def test_stat_prints_the_same_hit_rate_in_text_and_json(
    capsys: pytest.CaptureFixture[str], names: list[str]
) -> None:
    name = names[0]
    with HostCache.create(name, capacity=64, dim=4) as hc:

        def both() -> tuple[str, float | None]:
            text = run(capsys, "stat", name)[1]
            (line,) = [ln for ln in text.splitlines() if ln.split()[:1] == ["hit_rate"]]
            return line.split()[1], json.loads(run(capsys, "stat", name, "--json")[1])["node"][
                "hit_rate"]

        assert both() == ("-", None)  # nothing looked up yet: no rate, in both
        hc.lookup(torch.zeros(0, dtype=torch.int64))  # a lookup of no keys: still no rate
        assert both() == ("-", None)
        hc.insert(torch.arange(2), torch.ones(2, 4))
        hc.lookup(torch.arange(3))
        text, rate = both()
        assert rate == pytest.approx(2 / 3) and text == f"{100 * rate:.1f}%"
        (row,) = ls_json(capsys, name)
        assert row["hit_rate"] == rate


def test_missing_table_messages_speak_to_command_line_users(
    capsys: pytest.CaptureFixture[str], table_name: str
) -> None:
    for cmd in ("stat", "rm"):
        rc, _, err = run(capsys, cmd, table_name)
        assert rc == 2 and err.count("\n") == 1
        assert f"no table named {table_name!r}" in err and "hostcache ls" in err
        assert "HostCache" not in err and "create it" not in err


def test_stat_shows_how_the_node_service_follows_the_change_feed(
    capsys: pytest.CaptureFixture[str], names: list[str]
) -> None:
    name = names[0]
    with HostCache.create(name, capacity=64, dim=4) as hc:
        assert json.loads(run(capsys, "stat", name, "--json")[1])["feed"] == {
            "last_lag_s": None, "max_lag_s": None, "applied_ns": None, "gaps": 0}
        assert "no change applied yet" in run(capsys, "stat", name)[1]
        hc.record_feed(restart=True)
        for lag in (0.030, 0.0125):  # what the service records as it applies changes
            hc.record_feed(lag_s=lag)
        hc.record_feed(gap=True)
        feed = json.loads(run(capsys, "stat", name, "--json")[1])["feed"]
        assert feed["last_lag_s"] == 0.0125 and feed["max_lag_s"] == 0.03
        assert feed["gaps"] == 1 and feed["applied_ns"] > 0
        text = run(capsys, "stat", name)[1]
        assert "12.5 ms" in text and "30.0 ms" in text
        hc.record_feed(restart=True)  # a service that starts over forgets the old maximum
        hc.record_feed(lag_s=0.001)
        assert hc.feed_status().max_lag_s == 0.001
