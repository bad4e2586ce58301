"""Suite-wide fixtures and the session-end check that no shared segment leaked."""

from __future__ import annotations

import os
import uuid

import pytest

from hostcache import segment


def _ours() -> set[str]:
    return set(segment.list_names())


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
    leaked = sorted(name for name in _ours() - before if name.startswith("t-"))
    for name in leaked:
        segment.unlink(name)
    if leaked:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(f"\nFAILED: tests left shared-memory segments behind: {leaked}")


@pytest.fixture
def table_name() -> str:
    """A fresh table name; every test table starts with ``t-`` for the leak check."""
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def redis_url(request: pytest.FixtureRequest) -> str:
    return str(request.config.getoption("--redis-url"))
