"""The session-end leak check of tests/conftest.py, run on small pytest sessions of its own.

Each inner session uses this suite's conftest (star-imported), a session token of its own,
and an environment without the outer session's log, like a second pytest run beside this
one. Its tests write the names they create to ``names.txt`` beside them.

Every inner session, and the test that inspects what it left, runs in a node namespace of
its own (``NVEC_NODE``, docs/hostcache.md): what they create and look for is out of reach
of every other process on the machine (other test sessions, their leak checks, a journal
reaper, ``hostcache rm``), and does not depend on the namespace the suite runs in.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from hostcache import segment

ROOT = Path(__file__).resolve().parents[1]

INNER = '''
import os
import subprocess
import sys
from pathlib import Path

from gpu.dist.journal import new_name
from hostcache import SharedMemBlock, segment

NAMES = Path(__file__).with_name("names.txt")


def note(kind, name):
    with NAMES.open("a") as f:
        f.write(f"{kind} {name}\\n")


def test_leaves_an_auto_named_journal():
    name = new_name()  # the name a DistMemBlock generates for its journal
    SharedMemBlock.create(name, num_rows=1, dim=1).close()  # and never unlinked
    note("leak", name)


def test_leaves_a_table_and_a_lock_file_without_the_session_prefix():
    name = "leakcheck-" + os.urandom(5).hex()
    SharedMemBlock.create(name, num_rows=1, dim=1).close()
    note("leak", name)
    lock_only = "leakcheck-lock-" + os.urandom(5).hex()
    segment.open_lock_file(lock_only).close()
    note("lock", lock_only)


def test_another_session_creates_a_table_meanwhile():
    name = "foreign-" + os.urandom(5).hex()
    # another session on this node: none of this session's variables, the same NVEC_NODE
    env = {k: v for k, v in os.environ.items()
           if k not in ("NVEC_SHM_LOG", "NVEC_TEST_SESSION")}
    subprocess.run([sys.executable, "-c", "import sys; from hostcache import SharedMemBlock; "
                    "SharedMemBlock.create(sys.argv[1], num_rows=1, dim=1).close()", name],
                   env=env, check=True)
    note("foreign", name)


def test_clean():
    t = SharedMemBlock.create(new_name(), num_rows=1, dim=1)
    t.close()
    t.unlink(t.name)
'''


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch) -> str:
    """A node namespace of this test's own, for this process and the inner session."""
    name = f"leakcheck-{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv(segment.NODE_ENV, name)
    return name


def run_session(tmp_path: Path, node: str, select: str, *args: str
                ) -> tuple[subprocess.CompletedProcess[str], dict[str, list[str]]]:
    (tmp_path / "conftest.py").write_text("from tests.conftest import *  # noqa: F403\n")
    (tmp_path / "test_inner.py").write_text(INNER)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NVEC_", "PYTEST_XDIST", "PYTEST_CURRENT"))}
    env["NVEC_TEST_SESSION"] = uuid.uuid4().hex[:6]
    env[segment.NODE_ENV] = node
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", select, *args,
         "test_inner.py"], cwd=tmp_path, env=env, text=True, capture_output=True, timeout=300)
    names: dict[str, list[str]] = {}
    notes = tmp_path / "names.txt"
    for line in notes.read_text().splitlines() if notes.exists() else []:
        kind, name = line.split()
        names.setdefault(kind, []).append(name)
    return out, names


def present(name: str) -> list[str]:
    """The entries of ``name`` in /dev/shm, in this process's (the test's) namespace."""
    return [os.path.basename(p) for p in (segment.shm_path(name), segment.lock_path(name))
            if os.path.exists(p)]


def cleanup(names: dict[str, list[str]]) -> None:
    for name in (n for ns in names.values() for n in ns):
        for p in (segment.shm_path(name), segment.lock_path(name)):
            if os.path.exists(p):
                os.unlink(p)


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["alone", "xdist"])
def test_the_check_fails_the_session_on_any_leftover_and_removes_it(
        tmp_path: Path, node: str, workers: list[str]) -> None:
    out, names = run_session(tmp_path, node, "not clean", *workers)
    try:
        report = out.stdout + out.stderr
        assert out.returncode == 1, report[-3000:]
        assert "3 passed" in report  # every test passed: the check alone failed it
        leaked = names["leak"] + names["lock"]
        assert len(leaked) == 3
        shm, lock = segment.prefix(), segment.lock_prefix()  # the test's namespace
        for name in leaked:
            assert lock + name in report and present(name) == []
        for name in names["leak"]:
            assert shm + name in report
        foreign = names["foreign"][0]  # not this session's: neither flagged nor removed
        assert foreign not in report
        assert present(foreign) == [shm + foreign, lock + foreign]
    finally:
        cleanup(names)


def test_a_clean_session_passes_beside_another_sessions_tables(tmp_path: Path,
                                                               node: str) -> None:
    out, names = run_session(tmp_path, node, "clean or another")
    try:
        assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
        assert "shared-memory entries" not in out.stdout + out.stderr
        assert len(present(names["foreign"][0])) == 2
    finally:
        cleanup(names)
