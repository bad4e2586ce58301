"""docker-compose.yml: the node service and the demo replicas (no container engine here).

The whole file is validated against the Compose Specification's JSON schema, the one the
Compose implementation itself loads files with (vendored by check-jsonschema, a test
dependency), and by a real ``docker compose config`` where one is installed. The file is
parsed with pyyaml; the service's command line from the file is run for real (``hostcache
serve ... --check`` validates the node config and prints it), and the demo command lines are
parsed by the real ``hostcache`` argument parser and checked against the node's tables. The
Redis services are covered by tests/psclient/test_compose.py.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from nvecache.apps.cli import build_parser
from nvecache.apps.demo import DemoConfig, config_from_args

yaml = pytest.importorskip("yaml", reason="needs pyyaml to parse docker-compose.yml")

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    services: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())["services"]
    return services


def replicas(services: dict[str, Any]) -> dict[str, Any]:
    return {n: s for n, s in services.items() if "--attach" in s.get("command", [])}


def demo_config(cmd: list[str]) -> DemoConfig:
    assert cmd[:2] == ["hostcache", "demo"], cmd
    return config_from_args(build_parser().parse_args(cmd[1:]))


def node_tables(services: dict[str, Any]) -> dict[str, dict[str, str]]:
    cmd = services["node"]["command"]
    specs = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--hostcache"]
    return {t["name"]: t for t in (dict(kv.split("=", 1) for kv in s.split(",")) for s in specs)}


def test_existing_services_are_kept(services: dict[str, Any]) -> None:
    assert "profiles" not in services["redis"]
    assert {"redis-cluster-1", "redis-cluster-2", "redis-cluster-3",
            "redis-cluster-init"} <= set(services)


def test_node_runs_the_service_with_room_in_shared_memory(services: dict[str, Any]) -> None:
    node = services["node"]
    assert node["command"][:2] == ["hostcache", "serve"]
    assert "profiles" not in node  # `docker compose up -d node` starts it
    assert node["ipc"] == "shareable"
    assert node["shm_size"].endswith(("gb", "g", "mb", "m"))
    shm = node["shm_size"].lower().rstrip("b")
    shm_bytes = int(shm[:-1]) << (30 if shm.endswith("g") else 20)
    need = sum(int(t["capacity"]) * (int(t["dim"]) * 4 + 24)
               for t in node_tables(services).values())
    assert shm_bytes >= 2 * need  # the segments fit, with room for rings and headers
    assert node["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "/healthz" in " ".join(node["healthcheck"]["test"])
    assert node["stop_signal"] == "SIGTERM"
    cmd = node["command"]
    port = cmd[cmd.index("--metrics-port") + 1]
    assert f"{port}:{port}" in node["ports"]
    assert cmd[cmd.index("--metrics-host") + 1] == "0.0.0.0"


def test_node_command_line_is_a_valid_service_config(
        services: dict[str, Any], tmp_path: Path) -> None:
    cmd = list(services["node"]["command"])
    cmd[cmd.index("--state-dir") + 1] = str(tmp_path / "state")
    proc = subprocess.run([sys.executable, "-m", "nvecache.apps.cli", *cmd[1:], "--check"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads(proc.stdout)
    assert cfg["metrics_host"] == "0.0.0.0" and cfg["metrics_port"] == 9464
    tables = {t["name"]: t for t in cfg["tables"]}
    assert set(tables) == set(node_tables(services))
    for t in tables.values():
        assert t["kind"] == "hostcache" and t["ps_url"] == "redis://redis:6379/0"
        # the node starts before demo-load fills Redis: it creates the (empty) PS tables
        assert t["ps_create"] is True
    assert not (tmp_path / "state").exists()  # --check creates nothing


def test_two_replicas_attach_to_the_node(services: dict[str, Any]) -> None:
    reps = replicas(services)
    assert len(reps) == 2
    tables = node_tables(services)
    seeds = set()
    for name, svc in reps.items():
        assert svc["ipc"] == "service:node", name  # the node's /dev/shm
        assert svc["pid"] == "service:node", name  # the service sees the replicas' pids
        assert svc["depends_on"]["node"]["condition"] == "service_healthy"
        assert svc["depends_on"]["demo-load"]["condition"] == "service_completed_successfully"
        assert "demo" in svc["profiles"]
        cfg = demo_config(svc["command"])
        assert cfg.mode == "attach" and cfg.device == "cpu"
        assert set(cfg.table_names) == set(tables)
        for t in tables.values():
            assert int(t["dim"]) == cfg.dim
            assert int(t["capacity"]) == cfg.host_capacity
            assert t["ps_url"] == cfg.ps_url
        assert cfg.out_dir.startswith("/out/")
        seeds.add(cfg.stream_seed)
    assert len(seeds) == 2  # each replica draws its own request stream


def test_loader_loads_what_the_replicas_read(services: dict[str, Any]) -> None:
    load = services["demo-load"]
    cfg = demo_config(load["command"])
    assert cfg.mode == "load"
    assert load["restart"] == "no"
    assert load["depends_on"]["redis"]["condition"] == "service_healthy"
    for svc in replicas(services).values():
        rep = demo_config(svc["command"])
        assert (rep.ps_url, rep.table_names, rep.rows, rep.dim, rep.seed) == \
            (cfg.ps_url, cfg.table_names, cfg.rows, cfg.dim, cfg.seed)


def test_image_installs_the_project(services: dict[str, Any]) -> None:
    for name in ("node", "demo-load", *replicas(services)):
        build = services[name]["build"]
        assert build["context"] == "."
        dockerfile = build["dockerfile_inline"]
        for pkg in ("hostcache", "psclient", "gpu", "nvecache"):
            assert f"COPY {pkg} {pkg}" in dockerfile
        assert "apps" in build["args"]["EXTRAS"]  # the service's and the demo's extra
        assert "pip install" in dockerfile and "torch==" in dockerfile
        assert "$${TORCH_INDEX}" in dockerfile  # escaped for compose interpolation
        assert set(build["args"]) == {"TORCH_INDEX", "EXTRAS"}


# -- the Compose Specification's schema and a real Compose implementation ----------------------


def compose_spec_schema() -> dict[str, Any]:
    """The compose-spec JSON schema as check-jsonschema vendors it (a test dependency)."""
    builtin = pytest.importorskip(
        "check_jsonschema.builtin_schemas",
        reason="needs check-jsonschema (pip install -e '.[test]'), which ships the "
        "compose-spec schema")
    schema: dict[str, Any] = builtin.get_builtin_schema("vendor.compose-spec")
    return schema


def compose_errors(doc: dict[str, Any]) -> list[str]:
    schema = compose_spec_schema()
    jsonschema = pytest.importorskip(
        "jsonschema", reason="needs jsonschema (pip install -e '.[test]': check-jsonschema "
        "depends on it) to validate against the compose-spec schema")
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(doc)]


def test_file_is_valid_for_the_compose_specification() -> None:
    doc = yaml.safe_load(COMPOSE.read_text())
    assert compose_errors(doc) == []


@pytest.mark.parametrize("mutate", [
    lambda d: d["services"]["node"].update(imagee="nvecache:latest"),  # a misspelt key
    lambda d: d["services"]["replica-1"]["depends_on"]["node"].update(condition="ready"),
    lambda d: d["services"]["node"].update(ipc=["shareable"]),
    lambda d: d["services"]["node"]["healthcheck"].update(tset=["CMD", "true"]),
    lambda d: d.update(service={}),
])
def test_the_schema_check_catches_a_broken_file(mutate: Any) -> None:
    doc = yaml.safe_load(COMPOSE.read_text())
    broken = copy.deepcopy(doc)
    mutate(broken)
    assert compose_errors(broken) != []


def real_compose() -> list[str] | None:
    """A Compose v2 command line (``docker compose`` or ``docker-compose``), if installed."""
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) is None:
            continue
        proc = subprocess.run([*cmd, "version", "--short"], capture_output=True, text=True,
                              timeout=60)
        if proc.returncode == 0 and proc.stdout.strip().lstrip("v").startswith("2"):
            return cmd
    return None


def test_real_compose_accepts_the_file() -> None:
    cmd = real_compose()
    if cmd is None:
        pytest.skip("needs Docker Compose v2 (`docker compose` or `docker-compose` v2); the "
                    "compose-spec schema test above runs without it")
    proc = subprocess.run([*cmd, "-f", str(COMPOSE), "--profile", "cluster", "--profile",
                           "demo", "config", "--quiet"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
