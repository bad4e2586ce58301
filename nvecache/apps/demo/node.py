"""The demo's node: the tables in the parameter server, and the shared host caches.

:func:`load_tables` builds the synthetic tables and loads them into the parameter server
(the embedded ``file://`` store by default). :func:`start_node` brings up the host caches:
through the node service (``hostcache serve --config FILE``), or (``--no-service``) by
creating them in this process; replicas attach them by name either way. Every ``Node``
removes what it created in :meth:`Node.stop`, also after a failure or Ctrl-C.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import torch

from hostcache import HostCache, HostCacheError, segment
from nvecache.apps.demo.config import TABLES, DemoConfig
from nvecache.apps.errors import DemoError
from psclient import PSClientError, connect

logger = logging.getLogger(__name__)

#: how long the node service may take to create its tables and answer /healthz. A loaded
#: machine (a GPU host running the test suite on many workers) can take many times its
#: idle start; a service that exits is reported at once, so the limit only bounds a
#: service that hangs.
SERVICE_START_TIMEOUT_S = 120.0


def build_rows(rows: int, dim: int, *, seed: int) -> torch.Tensor:
    """A synthetic embedding table, float32 ``[rows, dim]``.

    Rows are Gaussian with a per-row scale spread like trained embeddings' norms (a
    log-normal around 1/sqrt(dim)); deterministic for a given seed.
    """
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(rows, dim, generator=gen)
    scale = torch.randn(rows, 1, generator=gen).mul_(0.3).exp_().div_(dim**0.5)
    return table.mul_(scale)


def ps_url_for(cfg: DemoConfig, state_dir: str) -> str:
    """The parameter-server URL the demo uses: ``--ps``, else ``file://<state>/ps``."""
    return cfg.ps_url or "file://" + os.path.join(os.path.abspath(state_dir), "ps")


def load_tables(cfg: DemoConfig, ps_url: str, created: list[str], *,
                keep_loaded: bool = False) -> int:
    """Build the demo's tables and load them into the parameter server at ``ps_url``.

    Appends each table's name to ``created`` before writing it (to drop at the end, also
    after an interruption). Returns the number of tables loaded.

    Args:
        cfg: the demo settings.
        ps_url: the parameter server.
        created: receives the names of the tables this call creates.
        keep_loaded: a table that already holds exactly ``cfg.rows`` rows is left as it
            is (``--load-only`` run twice); otherwise an existing table is an error.

    Raises:
        DemoError: a table of that name already exists there, or the store fails.
    """
    loaded = 0
    try:
        for i, (suffix, _) in enumerate(TABLES):
            name = cfg.table_name(suffix)
            ps = connect(ps_url, table=name, dim=cfg.dim, dtype=torch.float32)
            try:
                size = ps.size()
                if keep_loaded and size == cfg.rows:
                    logger.info("table %s already holds %d rows: kept", name, size)
                    continue
                if size:
                    raise DemoError(
                        f"parameter-server table {name!r} at {ps_url} already holds {size:,} "
                        "rows; pass another --prefix or drop that table"
                    )
                created.append(name)
                loaded += 1
                rows = build_rows(cfg.rows, cfg.dim, seed=cfg.seed * 1000 + i)
                ps.load(rows, progress=None if cfg.progress else False, batch_size=1 << 16)
            finally:
                ps.close()
    except PSClientError as e:
        raise DemoError(f"loading the tables into {ps_url} failed: {e}") from e
    return loaded


def drop_tables(ps_url: str, names: list[str]) -> None:
    """Drop the demo's tables from the parameter server (errors are logged, not raised)."""
    for name in names:
        try:
            connect(ps_url, table=name).drop()
        except PSClientError as e:
            logger.warning("could not drop parameter-server table %s: %s", name, e)


@dataclass
class Node:
    """The node side of the demo: who created the host caches and how to remove them."""

    #: ``"service"`` (``hostcache serve``), ``"local"`` (created by the demo process) or
    #: ``"attached"`` (``--attach``: someone else's node; nothing is removed).
    kind: str
    names: list[str]
    #: this process's handles (kept open so the node counts as a user of each segment).
    handles: list[HostCache] = field(default_factory=list)
    process: subprocess.Popen[bytes] | None = None
    metrics_url: str | None = None

    def metrics(self) -> str | None:
        """The service's Prometheus text, when it runs one."""
        if self.metrics_url is None:
            return None
        try:
            with urllib.request.urlopen(self.metrics_url + "/metrics", timeout=2) as r:
                return r.read().decode()
        except OSError:
            return None

    def stop(self) -> None:
        """Stop the service (SIGTERM: it removes its segments) or remove our own segments."""
        for h in self.handles:
            h.close()
        self.handles.clear()
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                logger.warning("node service pid %d ignored SIGTERM; killing it",
                               self.process.pid)
                self.process.kill()
                self.process.wait()
        for name in self.names:  # whatever is left (local tables, or a service that died)
            if segment.exists(name):
                try:
                    segment.unlink(name)
                except HostCacheError as e:
                    logger.warning("could not remove segment %s: %s", name, e)


def check_names_free(cfg: DemoConfig) -> None:
    """Raise :class:`DemoError` if a segment of one of the demo's names exists."""
    for name in cfg.table_names:
        if segment.exists(name):
            raise DemoError(f"a table named {name!r} already exists on this node; pass "
                            f"another --prefix or remove it with `hostcache rm {name}`")


def start_node(cfg: DemoConfig, ps_url: str, state_dir: str) -> Node:
    """Create the shared host caches: through the node service, or here (``--no-service``).

    Raises:
        DemoError: a table of that name exists on this node, or the service failed.
    """
    check_names_free(cfg)
    if cfg.use_service:
        return _start_service(cfg, ps_url, state_dir)
    return _start_local(cfg)


def attach_node(cfg: DemoConfig, ps_url: str) -> Node:
    """``--attach``: check that the node's host caches and the PS tables exist.

    Raises:
        DemoError: a table is missing or has another geometry than the flags say.
    """
    node = Node("attached", [])
    try:
        for name in cfg.table_names:
            node.handles.append(HostCache.attach(name, dim=cfg.dim, dtype=torch.float32))
            connect(ps_url, table=name).close()
    except (HostCacheError, PSClientError) as e:
        node.stop()
        raise DemoError(f"--attach needs the node's tables {cfg.table_names} (started by "
                        f"`hostcache serve`) and the same tables at {ps_url} (loaded by "
                        f"`hostcache demo --load-only`): {e}") from e
    return node


def _start_local(cfg: DemoConfig) -> Node:
    node = Node("local", cfg.table_names)
    try:
        for name in cfg.table_names:
            node.handles.append(HostCache.create(name, capacity=cfg.host_capacity, dim=cfg.dim,
                                                 dtype=torch.float32))
    except BaseException:
        node.stop()
        raise
    return node


def service_toml(cfg: DemoConfig, ps_url: str, state_dir: str) -> str:
    """The node config the demo gives ``hostcache serve`` (see docs/service.md)."""
    lines = [
        f"state_dir = {json.dumps(os.path.join(os.path.abspath(state_dir), 'service'))}",
        "metrics_host = \"127.0.0.1\"",
        "metrics_port = 0",
        "keep = false",
        "log_level = \"WARNING\"",
        "",
    ]
    for name in cfg.table_names:
        lines += [
            "[[hostcache]]",
            f"name = {json.dumps(name)}",
            f"capacity = {cfg.host_capacity}",
            f"dim = {cfg.dim}",
            "dtype = \"float32\"",
            f"ps_url = {json.dumps(ps_url)}",
            "",
        ]
    return "\n".join(lines)


def _start_service(cfg: DemoConfig, ps_url: str, state_dir: str) -> Node:
    path = os.path.join(state_dir, "node.toml")
    with open(path, "w") as f:
        f.write(service_toml(cfg, ps_url, state_dir))
    cmd = [sys.executable, "-m", "nvecache.apps.cli", "serve", "--config", path]
    logger.info("starting the node service: %s", " ".join(cmd))
    # NOTE: its own process group, so a Ctrl-C reaches only the demo, which stops the
    # replicas first and then the service (SIGTERM), in that order.
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, process_group=0)
    node = Node("service", cfg.table_names, process=proc)
    try:
        node.metrics_url = _wait_service(proc, cfg, os.path.join(state_dir, "service"))
    except BaseException:
        node.stop()
        raise
    return node


def _wait_service(proc: subprocess.Popen[bytes], cfg: DemoConfig, service_dir: str) -> str | None:
    """Wait until the service has written its endpoint file and /healthz says ok.

    As docs/service.md says a launcher does: the service writes ``endpoint.json`` last in
    its start (after the tables exist); returns its metrics URL.
    """
    deadline = time.monotonic() + SERVICE_START_TIMEOUT_S
    endpoint = os.path.join(service_dir, "endpoint.json")
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DemoError(f"the node service exited with status {proc.returncode} before it "
                            "was ready (its log is above); run the demo with --no-service")
        info = _read_endpoint(endpoint)
        # NOTE: a crashed service may have left an endpoint file: only our child's counts
        if info is not None and info.get("pid") == proc.pid and all(
                segment.exists(n) for n in cfg.table_names):
            url = info.get("url")
            if url is None or _healthy(str(url)):
                return None if url is None else str(url).rstrip("/")
        time.sleep(0.05)  # polling a child process's readiness, not synchronizing data
    raise DemoError(f"the node service did not become ready within {SERVICE_START_TIMEOUT_S:.0f}"
                    " s; run the demo with --no-service")


def _read_endpoint(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None  # not there yet (the service writes it atomically, last)
    return info if isinstance(info, dict) else None


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/healthz", timeout=1) as r:
            return bool(r.status == 200)
    except OSError:
        return False
