"""Test helpers shared by the suites: free ports, bounded polling, private redis-servers.

Private servers run from ``redis-server`` on free loopback ports in a tmp dir (never the
shared 127.0.0.1:6379), and can be killed and restarted in place for outage tests.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

REDIS_SERVER = shutil.which("redis-server")
needs_redis_server = pytest.mark.skipif(
    REDIS_SERVER is None, reason="needs the redis-server binary (apt-get install redis-server)"
)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(bus: bool = False) -> int:
    """A free loopback port (and ``port + 10000`` free too when ``bus``: cluster bus)."""
    for _ in range(200):
        port = random.randint(20000, 50000)
        if _port_free(port) and (not bus or _port_free(port + 10000)):
            return port
    raise RuntimeError("no free port found")


def wait_until(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``pred`` until it returns something truthy (returned); a Redis or OS error while
    polling counts as not yet. Fails after ``timeout`` seconds: a bounded readiness wait."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = pred()
            if value:
                return value
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


class RedisProc:
    """A private redis-server on a loopback port; can be killed and restarted in place."""

    def __init__(self, workdir: Path, port: int | None = None, *args: str,
                 password: str | None = None):
        self.workdir, self.args, self.password = workdir, args, password
        self.port = free_port() if port is None else port
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisProc:
        assert REDIS_SERVER is not None
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
               "--dir", str(self.workdir), "--daemonize", "no", *self.args]
        if self.password:
            cmd += ["--requirepass", self.password]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if self.port:
            client = redis.Redis(port=self.port, password=self.password, socket_timeout=1)
            wait_until(client.ping, 20, f"redis-server on port {self.port}")
            client.close()
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None


def start_cluster(root: Path, masters: int = 3) -> tuple[str, list[RedisProc]]:
    """A real Redis Cluster of ``masters`` masters (no replicas) on loopback ports, in
    ``root``: ``(its redis+cluster:// URL, the servers)``; the caller kills them. Made with
    the cluster's own commands (each master's share of the 16,384 slots, then ``CLUSTER
    MEET``), so only ``redis-server`` is needed."""
    nodes: list[RedisProc] = []
    clients: list[redis.Redis] = []
    try:
        for i in range(masters):
            port = free_port(bus=True)
            nodes.append(RedisProc(root / f"n{i}", port, "--cluster-enabled", "yes",
                                   "--cluster-config-file", f"nodes-{port}.conf",
                                   "--cluster-node-timeout", "2000",
                                   "--appendonly", "no").start())
        clients = [redis.Redis(port=n.port, socket_timeout=5) for n in nodes]
        for i, c in enumerate(clients):
            c.execute_command("CLUSTER", "ADDSLOTS", *range(16384 * i // masters,
                                                             16384 * (i + 1) // masters))
        for c in clients[1:]:
            c.execute_command("CLUSTER", "MEET", "127.0.0.1", nodes[0].port)
        wait_until(lambda: all(c.cluster("info")["cluster_state"] == "ok" and
                               int(c.cluster("info")["cluster_known_nodes"]) == masters
                               for c in clients),
                   30, "cluster_state:ok on every node")
    except BaseException:
        for n in nodes:
            n.kill()
        raise
    finally:
        for c in clients:
            c.close()
    addrs = [f"127.0.0.1:{n.port}" for n in nodes]
    return "redis+cluster://" + ",".join(addrs), nodes
