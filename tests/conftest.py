"""Suite-wide fixtures and the session-end check that no shared segment leaked."""

from __future__ import annotations

import os
import uuid

import pytest

from hostcache import segment

#: every test table of this pytest session (and its xdist workers, which inherit the
#: environment) starts with ``t-<session token>-``: the leak check then looks at this
#: session's tables only, not at those of another session running beside it.
SESSION = os.environ.setdefault("NVEC_TEST_SESSION", uuid.uuid4().hex[:6])
PREFIX = f"t-{SESSION}-"


def fresh_name(tag: str = "") -> str:
    """A new table name of this test session (``t-<session>-<tag><random>``)."""
    return f"{PREFIX}{tag}{uuid.uuid4().hex[:10]}"


def _ours() -> set[str]:
    return {name for name in segment.list_names() if name.startswith(PREFIX)}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--redis-url",
        default=os.environ.get("NVEC_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"),
        help="the Redis server that tests marked `redis` use (private servers are started "
        "separately by pytest-redis for fault tests)",
    )


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config._nvec_segments_before = _ours()  # type: ignore[attr-defined]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: the controller checks once all workers are done
    before = getattr(session.config, "_nvec_segments_before", set())
    leaked = sorted(_ours() - before)
    for name in leaked:
        segment.unlink(name)
    if leaked:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(f"\nFAILED: tests left shared-memory segments behind: {leaked}")


@pytest.fixture
def table_name() -> str:
    """A fresh table name of this session (checked for leaks at the end of the session)."""
    return fresh_name()


@pytest.fixture
def redis_url(request: pytest.FixtureRequest) -> str:
    return str(request.config.getoption("--redis-url"))
