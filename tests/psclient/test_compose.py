"""docker-compose.yml: the standalone Redis service and the `cluster` profile are coherent."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="needs pyyaml to parse docker-compose.yml")

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yml"


def _services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_standalone_redis_service_kept() -> None:
    redis = _services()["redis"]
    assert "profiles" not in redis  # starts with a plain `docker compose up`
    assert "6379:6379" in redis["ports"]
    assert redis["command"][0] == "redis-server"


def test_cluster_profile_nodes_and_init() -> None:
    services = _services()
    nodes = {name: s for name, s in services.items()
             if "cluster" in s.get("profiles", []) and s.get("command", [""])[0] == "redis-server"}
    assert len(nodes) >= 3
    ports = set()
    for s in nodes.values():
        cmd = s["command"]
        assert cmd[cmd.index("--cluster-enabled") + 1] == "yes"
        port = cmd[cmd.index("--port") + 1]
        assert s["environment"]["REDIS_PORT"] == port  # the healthcheck pings this port
        assert "healthcheck" in s
        ports.add(port)
    assert len(ports) == len(nodes)
    inits = [s for s in services.values() if "cluster" in s.get("profiles", [])
             and "--cluster create" in " ".join(s.get("command", []))]
    assert len(inits) == 1
    init = inits[0]
    script = " ".join(init["command"])
    assert "--cluster-yes" in script and "--cluster-replicas 0" in script
    assert set(re.findall(r"127\.0\.0\.1:(\d+)", script)) == ports
    assert set(init["depends_on"]) == set(nodes)
    assert all(d["condition"] == "service_healthy" for d in init["depends_on"].values())
    assert init.get("restart") == "no"
