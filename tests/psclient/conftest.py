"""Fixtures for psclient tests: private redis-server processes and a real loopback cluster.

Private servers run from ``redis-server`` on free loopback ports in a tmp dir; tests that
need one skip (with the reason) where ``redis-server`` is not installed.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

import psclient
from tests.servers import (  # noqa: F401 - re-exported to the psclient tests
    REDIS_SERVER,
    RedisProc,
    free_port,
    needs_redis_server,
    start_cluster,
    wait_until,
)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisProc]:
    """A private persistent (AOF, fsync always) redis-server; killed at teardown."""
    if REDIS_SERVER is None:
        pytest.skip("needs the redis-server binary (apt-get install redis-server)")
    srv = RedisProc(tmp_path / "redis", free_port(), "--appendonly", "yes",
                    "--appendfsync", "always").start()
    yield srv
    srv.kill()


@pytest.fixture
def auth_redis(tmp_path: Path) -> Iterator[RedisProc]:
    """A private password-protected redis-server."""
    if REDIS_SERVER is None:
        pytest.skip("needs the redis-server binary (apt-get install redis-server)")
    srv = RedisProc(tmp_path / "redis-auth", free_port(), password="s3cret-pw").start()
    yield srv
    srv.kill()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real 3-master Redis Cluster on loopback ports; yields its redis+cluster:// URL."""
    if REDIS_SERVER is None:
        pytest.skip("needs the redis-server binary (apt-get install redis-server)")
    root = tmp_path_factory.mktemp("cluster")
    url, nodes = start_cluster(root)
    try:
        yield url
    finally:
        for n in nodes:
            n.kill()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def shared_redis(redis_url: str) -> str:
    """The suite's shared Redis URL (``--redis-url``), or skip if it does not answer."""
    try:
        redis.Redis.from_url(redis_url, socket_connect_timeout=1).ping()
    except redis.RedisError as e:
        pytest.skip(f"needs a Redis server at {redis_url} (--redis-url): {e}")
    return redis_url


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A private TLS-only redis-server with a throwaway CA; yields (rediss URL, CA file)."""
    openssl = shutil.which("openssl")
    if REDIS_SERVER is None or openssl is None:
        pytest.skip("needs redis-server (built with TLS) and openssl")
    d = tmp_path / "tls"
    d.mkdir()
    ca_key, ca, key, csr, crt = (str(d / n) for n in ("ca.key", "ca.crt", "s.key", "s.csr",
                                                      "s.crt"))

    def ossl(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, timeout=30)

    ossl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca,
         "-days", "1", "-subj", "/CN=psclient-test-ca")
    ossl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
         "-subj", "/CN=127.0.0.1")
    ext = d / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    ossl("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
         "-out", crt, "-days", "1", "-extfile", str(ext))
    port = free_port()
    proc = subprocess.Popen(
        [REDIS_SERVER, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--save", "", "--dir", str(d), "--tls-cert-file", crt, "--tls-key-file", key,
         "--tls-ca-cert-file", ca, "--tls-auth-clients", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=ca,
                              socket_timeout=1)
        wait_until(client.ping, 10, f"TLS redis-server on port {port}")
        client.close()
        yield f"rediss://127.0.0.1:{port}/0", ca
    finally:
        proc.kill()
        proc.wait(10)


@pytest.fixture
def unix_redis(tmp_path: Path) -> Iterator[str]:
    """A private redis-server on a unix socket only; yields its unix:// URL."""
    if REDIS_SERVER is None:
        pytest.skip("needs the redis-server binary (apt-get install redis-server)")
    sock = tmp_path / "r.sock"
    srv = RedisProc(tmp_path / "redis-unix", 0, "--unixsocket", str(sock),
                    "--unixsocketperm", "700")
    assert REDIS_SERVER is not None
    srv.workdir.mkdir(parents=True, exist_ok=True)
    srv.proc = subprocess.Popen(
        [REDIS_SERVER, "--port", "0", "--save", "", "--dir", str(srv.workdir), *srv.args],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(unix_socket_path=str(sock), socket_timeout=1)
    wait_until(client.ping, 10, "redis-server on a unix socket")
    client.close()
    yield f"unix://{sock}"
    srv.kill()


@pytest.fixture(params=["file", "redis", "cluster"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each kind of store in turn: a file:// store, the shared Redis, the 3-master cluster."""
    if request.param == "file":
        return f"file://{tmp_path}/store"
    if request.param == "redis":
        return str(request.getfixturevalue("shared_redis"))
    return str(request.getfixturevalue("redis_cluster"))


@contextlib.contextmanager
def opened_tables(url: str, base: str) -> Iterator[Callable[..., psclient.ParameterServer]]:
    """``make(suffix="", **kw)`` connects to table ``base + suffix`` at ``url``; every handle
    is closed and every table dropped afterwards."""
    opened: list[psclient.ParameterServer] = []

    def make(suffix: str = "", **kw: object) -> psclient.ParameterServer:
        ps = psclient.connect(url, table=base + suffix, **kw)
        opened.append(ps)
        return ps

    try:
        yield make
    finally:
        for ps in opened:
            ps.close()
        for name in {ps.table for ps in opened}:
            try:
                psclient.connect(url, table=name).drop()
            except psclient.TableNotFoundError:
                pass


@pytest.fixture(params=["file", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path, table_name: str) -> Iterator[str]:
    """An empty-for-this-test store URL: a fresh file:// path, or the suite's Redis."""
    if request.param == "file":
        yield f"file://{tmp_path}/store"
        return
    url: str = request.getfixturevalue("shared_redis")
    yield url
    for name in psclient.list_tables(url):
        if name.startswith(table_name):
            psclient.connect(url, table=name, partial=True).drop()
