"""How the demo waits for its node service (``nvecache.apps.demo.node._wait_service``).

Real child processes stand in for the service: one that exits, one that never becomes
ready, one that writes its endpoint file the way ``hostcache serve`` does. No segment is
created: the configs name tables that do not exist, or none.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from nvecache.apps.demo import DemoConfig, DemoError
from nvecache.apps.demo import node as demo_node


def _child(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL)


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def _cfg(tmp_path: Path, prefix: str) -> DemoConfig:
    return DemoConfig(prefix=prefix, out_dir=str(tmp_path / "out"), rows=1000)


def test_a_service_that_exits_is_reported_at_once_not_after_the_limit(
        tmp_path: Path, children: list[subprocess.Popen[bytes]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE: a limit no test run reaches: only the exit can end the wait
    monkeypatch.setattr(demo_node, "SERVICE_START_TIMEOUT_S", 3600.0)
    proc = _child("import sys; sys.exit(3)")
    children.append(proc)
    with pytest.raises(DemoError, match="exited with status 3 before it was ready"):
        demo_node._wait_service(proc, _cfg(tmp_path, "t-wait-exit-"), str(tmp_path))


def test_a_service_that_never_becomes_ready_is_given_up_after_the_limit(
        tmp_path: Path, children: list[subprocess.Popen[bytes]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo_node, "SERVICE_START_TIMEOUT_S", 0.3)
    # NOTE: no tables to wait for, and an endpoint file naming another pid (a crashed
    # service's leftover), which must not count as ready
    monkeypatch.setattr(DemoConfig, "table_names", property(lambda self: []))
    (tmp_path / "endpoint.json").write_text(json.dumps({"pid": os.getpid(), "url": None}))
    proc = _child("import time; time.sleep(600)")
    children.append(proc)
    with pytest.raises(DemoError, match=r"did not become ready within 0 s; run the demo "
                                        r"with --no-service"):
        demo_node._wait_service(proc, _cfg(tmp_path, "t-wait-hang-"), str(tmp_path))
    assert proc.poll() is None  # NOTE: the caller (Node.stop) stops it, not the wait


def test_the_wait_ends_when_the_child_writes_its_endpoint_file(
        tmp_path: Path, children: list[subprocess.Popen[bytes]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo_node, "SERVICE_START_TIMEOUT_S", 3600.0)
    cfg = _cfg(tmp_path, "t-wait-ready-")
    monkeypatch.setattr(DemoConfig, "table_names", property(lambda self: []))
    endpoint = tmp_path / "endpoint.json"
    # NOTE: written atomically, last, with the child's own pid (as hostcache serve does);
    # then the child waits to be stopped
    code = ("import json, os, sys, time\n"
            f"tmp = {str(endpoint)!r} + '.tmp'\n"
            "open(tmp, 'w').write(json.dumps({'pid': os.getpid(), 'url': None}))\n"
            f"os.replace(tmp, {str(endpoint)!r})\n"
            "time.sleep(600)\n")
    proc = _child(code)
    children.append(proc)
    assert demo_node._wait_service(proc, cfg, str(tmp_path)) is None
    assert proc.poll() is None
    assert json.loads(endpoint.read_text())["pid"] == proc.pid
