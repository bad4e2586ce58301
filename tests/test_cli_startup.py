"""The command lines answer without loading the row machinery (torch, numba, triton,
matplotlib): ``--help``, ``--version`` and the table commands of ``hostcache`` and
``psclient``, each run in a fresh interpreter that then lists what it imported.
``psclient ls`` and ``stat`` of a ``file://`` store or a plain ``redis://`` server load
neither numpy nor redis-py either: they read what they show through the peek modules
(``psclient.file.peek``, ``psclient.redis.peek``), whose answers are checked here against
the library's.

Each command also has to do its job there (its output is checked), so a command that
imported nothing because it failed early does not pass.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

import psclient
from hostcache import HostCache, segment
from psclient.file import peek as file_peek
from psclient.file.mirror_files import mirror_path
from psclient.redis import peek as redis_peek
from tests.project import project_version

REPO = Path(__file__).resolve().parents[1]
#: what a command that only reads a header or a schema must not load
HEAVY = ("torch", "numba", "triton", "matplotlib")
#: what ``psclient ls``/``stat`` of a file:// or plain redis:// store must not load either
BARE = ("numpy", "redis")
CTX = mp.get_context("spawn")

# NOTE: runs ``main(argv)`` of MODULE in a fresh interpreter; prints its exit status, its
# output and which of HEAVY it loaded, as one JSON line.
_SCRIPT = """
import contextlib, io, json, sys
from {module} import main
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    rc = main(sys.argv[1:])
loaded = [m for m in {heavy!r} if m in sys.modules]
print(json.dumps({{"rc": rc, "out": out.getvalue(), "err": err.getvalue(), "loaded": loaded}}))
"""


def run_fresh(module: str, *argv: str, setup: str = "") -> dict[str, Any]:
    """``main(argv)`` of ``module`` (``nvecache.apps.cli``: the ``hostcache`` console script) in a
    new interpreter, after ``setup`` (Python source run first)."""
    script = setup + _SCRIPT.format(module=module, heavy=HEAVY + BARE)
    proc = subprocess.run([sys.executable, "-c", script, *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return result


def hostcache_cmd(*argv: str) -> dict[str, Any]:
    return run_fresh("nvecache.apps.cli", *argv)


def psclient_cmd(*argv: str) -> dict[str, Any]:
    return run_fresh("psclient.cli", *argv)


def light(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` after checking that the command succeeded and loaded none of HEAVY."""
    assert result["rc"] == 0, result["err"]
    heavy = [m for m in result["loaded"] if m in HEAVY]
    assert heavy == [], f"the command imported {heavy}"
    return result


def bare(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` after checking that the command succeeded and loaded none of HEAVY and
    BARE."""
    assert result["rc"] == 0, result["err"]
    assert result["loaded"] == [], f"the command imported {result['loaded']}"
    return result


@pytest.fixture
def cache(table_name: str) -> Iterator[str]:
    """A host cache holding 10 rows; its name."""
    with HostCache.create(table_name, capacity=64, dim=4) as hc:
        hc.insert(torch.arange(10), torch.ones(10, 4))
    yield table_name
    if segment.exists(table_name):
        HostCache.unlink(table_name)


@pytest.fixture
def file_store(tmp_path: Path) -> tuple[str, str]:
    """A file:// store with a table of 10 rows: (URL, table)."""
    url = f"file://{tmp_path}/store"
    with psclient.connect(url, table="emb", dim=8) as ps:
        ps.insert(torch.arange(10), torch.ones(10, 8))
    return url, "emb"


@pytest.fixture
def redis_store(redis_url: str, table_name: str) -> Iterator[tuple[str, str]]:
    """The suite's Redis with a table of 10 rows: (URL, table); dropped afterwards."""
    try:
        redis.Redis.from_url(redis_url, socket_connect_timeout=1).ping()
    except redis.RedisError as e:
        pytest.skip(f"needs a Redis server at {redis_url} (--redis-url): {e}")
    with psclient.connect(redis_url, table=table_name, dim=8) as ps:
        ps.insert(torch.arange(10), torch.ones(10, 8))
    yield redis_url, table_name
    if table_name in psclient.list_tables(redis_url):
        psclient.connect(redis_url, table=table_name).drop()


# -- hostcache -----------------------------------------------------------------------------


def test_hostcache_help_and_version_load_nothing_heavy() -> None:
    out = light(hostcache_cmd("--help"))["out"]
    assert all(cmd in out for cmd in ("ls", "stat", "create", "rm", "serve", "demo"))
    assert light(hostcache_cmd("--version"))["out"] == f"hostcache {project_version()}\n"
    assert "--ring-capacity" in light(hostcache_cmd("create", "--help"))["out"]


def test_hostcache_ls_and_stat_load_nothing_heavy(cache: str) -> None:
    assert any(line.split()[:2] == [cache, "hostcache"]
               for line in light(hostcache_cmd("ls"))["out"].splitlines())
    (row,) = json.loads(light(hostcache_cmd("ls", "--json", cache))["out"])
    assert (row["name"], row["size"], row["dtype"]) == (cache, 10, "float32")
    assert f"table {cache}\n" in light(hostcache_cmd("stat", cache))["out"]
    info = json.loads(light(hostcache_cmd("stat", cache, "--json"))["out"])
    assert info["node"]["inserts"] == 10 and info["geometry"]["capacity"] == 64


def test_hostcache_create_and_rm_load_nothing_heavy(table_name: str) -> None:
    linear = table_name + "-lin"
    try:
        out = light(hostcache_cmd("create", table_name, "--capacity", "100", "--dim", "4",
                                  "--dtype", "bfloat16"))["out"]
        assert "capacity 104 (13 buckets x 8 ways)" in out
        light(hostcache_cmd("create", linear, "--linear", "--rows", "30", "--dim", "3"))
        # what the command made is what the library makes: attach, write, read
        with HostCache.attach(table_name) as hc:
            assert hc.geometry.dtype == torch.bfloat16 and len(hc) == 0
            hc.insert(torch.arange(3), torch.ones(3, 4, dtype=torch.bfloat16))
            assert hc.lookup(torch.arange(4))[1].tolist() == [True, True, True, False]
        assert light(hostcache_cmd("rm", table_name))["out"] == f"removed {table_name}\n"
        assert light(hostcache_cmd("rm", linear))["out"] == f"removed {linear}\n"
        assert not segment.exists(table_name) and not segment.exists(linear)
    finally:
        for name in (table_name, linear):
            if segment.exists(name):
                segment.unlink(name)


def die_inside_a_write(name: str) -> None:
    """Child body: attach ``name`` and die inside a write section (the lock's holder)."""
    hc = HostCache.attach(name)
    with hc._writing():
        os._exit(0)


def test_stat_repairs_a_write_section_left_by_a_dead_writer(cache: str) -> None:
    """The command reads tables without their class, but repairs as any attacher does."""
    child = CTX.Process(target=die_inside_a_write, args=(cache,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    result = hostcache_cmd("stat", cache, "--json")  # the first to take the lock since
    assert result["rc"] == 0, result["err"]
    assert json.loads(result["out"])["repairs"] == 1
    with HostCache.attach(cache) as hc:
        assert hc.writer_pid == 0 and hc.repairs == 1 and len(hc) == 10


# -- psclient ------------------------------------------------------------------------------


def test_psclient_help_and_version_load_nothing_heavy() -> None:
    out = light(psclient_cmd("--help"))["out"]
    assert all(cmd in out for cmd in ("ls", "load", "stat", "drop", "upgrade"))
    assert light(psclient_cmd("--version"))["out"] == f"psclient {project_version()}\n"


@pytest.mark.parametrize("backend", ["file", pytest.param("redis", marks=pytest.mark.redis)])
def test_psclient_ls_stat_drop_load_nothing_heavy(
    backend: str, request: pytest.FixtureRequest
) -> None:
    url, table = request.getfixturevalue(f"{backend}_store")
    listed = bare(psclient_cmd("ls", url))["out"].splitlines()
    assert any(line.split()[:4] == [table, "8", "float32", "10"] for line in listed)
    (row,) = [r for r in json.loads(bare(psclient_cmd("ls", url, "--json"))["out"])
              if r["table"] == table]
    assert row["rows"] == 10
    info = json.loads(bare(psclient_cmd("stat", url, "--table", table, "--json"))["out"])
    assert (info["table"], info["dim"], info["dtype"], info["rows"]) == (table, 8, "float32", 10)
    out = light(psclient_cmd("drop", url, "--table", table))["out"]
    assert out == f"dropped table {table} (10 rows)\n"
    assert table not in psclient.list_tables(url)


def library_stat(url: str, table: str) -> list[tuple[str, Any]]:
    """``stat()`` of the table opened by the library, as (name, value) pairs in order."""
    with psclient.connect(url, table=table, partial=True) as ps:
        return list(ps.stat().items())


@pytest.mark.parametrize("backend", ["file", pytest.param("redis", marks=pytest.mark.redis)])
def test_peek_shows_what_opening_the_table_shows(
    backend: str, request: pytest.FixtureRequest
) -> None:
    url, table = request.getfixturevalue(f"{backend}_store")
    peek = file_peek if backend == "file" else redis_peek
    got = peek.stat(url, table)
    assert got is not None and got["rows"] == 10
    assert list(got.items()) == library_stat(url, table)
    # a table a load is creating: its state and its load are shown alike
    loading = table + "-ld"
    with psclient.connect(url, table=loading, dim=4, loading=True):
        got = peek.stat(url, loading)
        assert got is not None and got["state"] == "loading"
        assert [load["pid"] for load in got["loads"]] == [os.getpid()]
        assert list(got.items()) == library_stat(url, loading)
    assert loading not in psclient.list_tables(url)  # the load ended without rows: dropped
    assert peek.stat(url, loading) is None  # no table: the library says so


def test_file_peek_leaves_a_mirror_to_rebuild_to_the_open(file_store: tuple[str, str]) -> None:
    url, table = file_store
    os.unlink(mirror_path(os.path.realpath(url.removeprefix("file://")), table))
    assert file_peek.stat(url, table) is None
    result = psclient_cmd("stat", url, "--table", table, "--json")
    assert result["rc"] == 0, result["err"]
    assert "numpy" in result["loaded"]  # NOTE: the table was opened, and its mirror rebuilt
    mirror = json.loads(result["out"])["mirror"]
    assert (mirror["state"], mirror["keys"]) == ("ok", 10)
    got = file_peek.stat(url, table)
    assert got is not None and got["mirror"] == mirror
    assert file_peek.stat(url + "?mirror=false", table) is None  # an option: the library's


@pytest.mark.redis
def test_redis_peek_lists_tables_and_orphans_as_the_library(
    redis_store: tuple[str, str], table_name: str
) -> None:
    url, table = redis_store
    names = redis_peek.list_tables(url)
    assert names is not None and table in names and names == sorted(names)
    orphan = table_name + "-orphan"
    client = redis.Redis.from_url(url)
    try:
        client.hset(f"psc:{{{orphan}:3}}", mapping={b"a": b"1", b"b": b"2"})
        client.set(f"psc:{{{orphan}}}:state", b"x")
        got, want = redis_peek.list_orphans(url), psclient.list_orphans(url)
        assert got is not None and got[orphan] == want[orphan] == {"keys": 2, "rows": 2}
        listed = bare(psclient_cmd("ls", url))["out"]
        assert f"orphaned: 2 keys with no schema (psclient drop URL --table {orphan}" in listed
    finally:
        client.delete(f"psc:{{{orphan}:3}}", f"psc:{{{orphan}}}:state")
        client.close()


@pytest.mark.redis
def test_redis_peek_leaves_other_urls_and_errors_to_the_backend(
    redis_store: tuple[str, str]
) -> None:
    url, table = redis_store
    assert redis_peek.stat(url, table) is not None
    for other in (url + "?socket_timeout=5", url.replace("redis://", "rediss://", 1),
                  "redis://127.0.0.1:1/0"):
        assert redis_peek.stat(other, table) is None
        assert redis_peek.list_tables(other) is None
    result = psclient_cmd("ls", "redis://127.0.0.1:1/0")
    assert result["rc"] == 1 and "cannot reach Redis" in result["err"]


# -- the version ---------------------------------------------------------------------------


def test_version_of_a_source_tree_never_installed_is_its_pyprojects() -> None:
    from nvecache.common.cli import source_version

    version = project_version()
    assert source_version(str(REPO / "pyproject.toml")) == version == metadata.version("nvecache")
    # NOTE: the distribution looked up under a name nothing is installed as: what a checkout
    # that was never pip-installed meets
    result = run_fresh("psclient.cli", "--version", setup=(
        "import nvecache.common.cli as c; c.DISTRIBUTION = 'nvecache-never-installed'\n"))
    assert light(result)["out"] == f"psclient {version}\n"


def test_packages_resolve_their_names_on_first_use() -> None:
    """``import hostcache`` / ``psclient`` load no torch; their names still resolve, once."""
    script = (
        "import sys, hostcache, psclient, nvecache.apps.demo, nvecache.apps.service\n"
        "assert 'torch' not in sys.modules, 'imported torch'\n"
        "for pkg in (hostcache, psclient, nvecache.apps.demo, nvecache.apps.service):\n"
        "    assert set(pkg.__all__) <= set(dir(pkg)), pkg\n"
        "from hostcache import HostCache\n"
        "assert hostcache.HostCache is HostCache and 'HostCache' in vars(hostcache)\n"
        "assert psclient.connect is psclient.registry.connect\n"
        "assert 'torch' in sys.modules\n"
        "try:\n"
        "    hostcache.NoSuchName\n"
        "except AttributeError as e:\n"
        "    assert 'NoSuchName' in str(e)\n"
        "else:\n"
        "    raise AssertionError('no AttributeError')\n"
        "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr
