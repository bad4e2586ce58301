"""Suite-wide fixtures and the session-end check that nothing was left in /dev/shm.

The leak check covers every segment (``nvec.*``) and lock file (``nvec-lock.*``) that a
process of this session created, whatever its name, and nothing of another pytest session
running beside it on the same machine:

* the session (the controller under pytest-xdist) points ``NVEC_SHM_LOG`` at a fresh
  file; every process that inherits it (xdist workers, spawned ranks, CLI subprocesses)
  records there the inode of each segment and lock file it creates
  (:mod:`hostcache.shmlog`). At the end, a recorded name whose file is still that inode
  is a leftover. Auto-named ones (a ``DistMemBlock`` journal's) are covered like any other.
* test tables are named ``t-<session token>-...`` (:func:`fresh_name`): any entry with
  this prefix, recorded or not (a process started with a scrubbed environment), is one too.

Leftovers are removed, listed, and fail the session (exit status 1).
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import uuid

import pytest

from hostcache import segment, shmlog

#: every test table of this pytest session (and its xdist workers, which inherit the
#: environment) starts with ``t-<session token>-``.
SESSION = os.environ.setdefault("NVEC_TEST_SESSION", uuid.uuid4().hex[:6])
PREFIX = f"t-{SESSION}-"
_LOG = os.path.join(tempfile.gettempdir(), f"nvec-shm-{SESSION}-{os.getpid()}.log")
if "PYTEST_XDIST_WORKER" not in os.environ:  # the controller: a log of its own, always
    os.environ[shmlog.ENV] = _LOG
SHM_LOG = os.environ.setdefault(shmlog.ENV, _LOG)  # a worker: its controller's


def fresh_name(tag: str = "") -> str:
    """A new table name of this test session (``t-<session>-<tag><random>``)."""
    return f"{PREFIX}{tag}{uuid.uuid4().hex[:10]}"


def session_entries() -> set[str]:
    """File names in /dev/shm that this session created and that are still there."""
    found = set(shmlog.leftovers(SHM_LOG, segment.SHM_DIR))
    try:
        entries = os.listdir(segment.SHM_DIR)
    except FileNotFoundError:
        entries = []
    ours = (segment.prefix() + PREFIX, segment.lock_prefix() + PREFIX)
    found.update(e for e in entries if e.startswith(ours))
    return found


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--redis-url",
        default=os.environ.get("NVEC_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"),
        help="the Redis server that tests marked `redis` use (private servers are started "
        "separately by pytest-redis for fault tests)",
    )


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config._nvec_shm_before = session_entries()  # type: ignore[attr-defined]
    # NOTE: a suite started in the background of a shell (`cmd &`, nohup) inherits SIGINT
    # ignored, and so would every process a test starts: the Ctrl-C tests' signals would be
    # lost. A Python handler is reset to the default at exec, so the children get SIGINT back
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: the controller checks once all workers are done
    before = getattr(session.config, "_nvec_shm_before", set())
    leaked = sorted(session_entries() - before)
    for entry in leaked:
        try:
            os.unlink(os.path.join(segment.SHM_DIR, entry))
        except FileNotFoundError:
            pass
    try:
        os.unlink(SHM_LOG)
    except FileNotFoundError:
        pass
    if leaked:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        msg = f"FAILED: tests left shared-memory entries in /dev/shm (removed now): {leaked}"
        if tr is not None:
            tr.write_line(msg, red=True, bold=True)
        else:
            print(msg, file=sys.stderr)


@pytest.fixture
def table_name() -> str:
    """A fresh table name of this session (checked for leaks at the end of the session)."""
    return fresh_name()


@pytest.fixture
def redis_url(request: pytest.FixtureRequest) -> str:
    return str(request.config.getoption("--redis-url"))


@pytest.fixture(scope="session")
def aoti_loads(tmp_path_factory: pytest.TempPathFactory) -> bool:
    """Whether this torch loads an AOTInductor package at all (:mod:`tests.aot_probe`),
    asked once per session: xdist's workers share their controller's temporary root."""
    from tests import aot_probe

    root = tmp_path_factory.getbasetemp()
    return aot_probe.aoti_loads(root.parent if "PYTEST_XDIST_WORKER" in os.environ else root)
