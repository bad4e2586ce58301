"""The node service (``hostcache serve``): config, lifecycle, change feed, endpoints.

Most tests run ``NodeService`` in this process (a thread runs its loop); the crash test
runs it as a subprocess and SIGKILLs it. Process helpers come from tests/test_failures.py.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import psclient
from gpu import LayerType, NVEmbedding
from hostcache import GeometryMismatchError, HostCache, HostCacheError, segment
from nvecache.apps.cli import main as cli_main
from nvecache.apps.service import (
    NodeService,
    ServiceConfigError,
    ServiceRunningError,
    build_config,
)
from nvecache.apps.service.config import with_overrides
from tests.servers import wait_until
from tests.test_failures import (
    CTX,
    DIM,
    ServiceProc,
    collect,
    http_get,
    new_stop_flag,
    reap_children,
    rows_of,
    spawn_replicas,
    write_config,
)

# -- config ------------------------------------------------------------------------------------


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "node.toml"
    path.write_text(text)
    return path


def test_config_precedence_file_env_flags(tmp_path: Path) -> None:
    path = _toml(tmp_path, """
state_dir = "/from/file"
metrics_port = 1111
poll_interval = 0.5
[[hostcache]]
name = "ctr"
capacity = 1000
dim = 16
dtype = "float16"
ps_url = "redis://127.0.0.1:6379/0"
warmup = 10
[[linear]]
name = "item"
rows = 64
dim = 8
mode = "0660"
""")
    env = {"NVEC_METRICS_PORT": "2222", "NVEC_POLL_INTERVAL": "0.25", "NVEC_KEEP": "yes"}
    cfg = build_config(path, env=env, overrides={"metrics_port": 3333, "state_dir": None},
                       table_specs=["name=ctr,capacity=2000"])
    assert cfg.state_dir == "/from/file"  # file (flag was None: not given)
    assert cfg.metrics_port == 3333  # flag over env over file
    assert cfg.poll_interval == 0.25  # env over file
    assert cfg.keep is True
    ctr, item = cfg.table("ctr"), cfg.table("item")
    assert (ctr.capacity, ctr.dim, ctr.dtype, ctr.warmup) == (2000, 16, "float16", 10)
    assert ctr.ps_name == "ctr" and ctr.torch_dtype == torch.float16
    assert (item.kind, item.capacity, item.mode, item.ways) == ("linear", 64, 0o660, 0)
    # NVEC_CONFIG names the file when no path is given
    assert build_config(env={"NVEC_CONFIG": str(path)}).table("ctr").capacity == 1000


@pytest.mark.parametrize(("text", "field"), [
    ('[[hostcache]]\nname = "a"\ncapacity = -1\ndim = 4\n', "hostcache[0] (a).capacity"),
    ('[[hostcache]]\nname = "a"\ncapacity = 8\ndim = 4\nways = 5\n', "hostcache[0] (a).ways"),
    ('[[hostcache]]\nname = "a"\ncapacity = 8\ndim = 4\ndtype = "int4"\n',
     "hostcache[0] (a).dtype"),
    ('[[linear]]\nname = "a"\nrows = 8\ndim = 4\ndtype = "int8"\n', "linear[0] (a).dtype"),
    ('[[hostcache]]\nname = "a"\ncapacity = 8\ndim = 4\nps_dtype = "int8"\n',
     "hostcache[0] (a).ps_dtype"),
    ('[[hostcache]]\nname = "a"\ncapacity = 8\ndim = 4\nps_url = "file:///x"\n'
     'ps_dtype = "fp8"\n', "hostcache[0] (a).ps_dtype"),
    ('[[linear]]\nname = "a"\nrows = 8\ndim = 4\nps_url = "file:///x"\nps_dtype = "int8"\n',
     "linear[0].ps_dtype"),
    ('[[hostcache]]\nname = "a/b"\ncapacity = 8\ndim = 4\n', "hostcache[0].name"),
    ('[[hostcache]]\nname = "a"\ndim = 4\n', "hostcache[0].capacity"),
    ('[[hostcache]]\nname = "a"\ncapacity = 8\ndim = 4\ncolour = 1\n', "hostcache[0].colour"),
    ('[[hostcache]]\nname = "a"\ncapacity = 8\ndim = 4\nwarmup = "all"\n',
     "hostcache[0] (a).warmup"),
    ('[[hostcache]]\nname = "a"\ncapacity = 8\ndim = 4\nps_url = "nowhere"\n',
     "hostcache[0] (a).ps_url"),
    ('[[hostcache]]\nname = "a"\ncapacity = 8\ndim = 4\nps_create = true\n',
     "hostcache[0] (a).ps_create"),
    ('[[linear]]\nname = "a"\nrows = 8\ndim = 4\nmode = "0400"\n', "linear[0] (a).mode"),
    ('metrics_port = 70000\n[[linear]]\nname = "a"\nrows = 8\ndim = 4\n', "metrics_port"),
    ('log_format = "xml"\n[[linear]]\nname = "a"\nrows = 8\ndim = 4\n', "log_format"),
    ('poll_interval = 0\n[[linear]]\nname = "a"\nrows = 8\ndim = 4\n', "poll_interval"),
    ("state_dir = '/x'\n", "hostcache"),
    ('[[linear]]\nname = "a"\nrows = 8\ndim = 4\n[[hostcache]]\nname = "a"\ncapacity = 8\n'
     'dim = 4\n', "linear[0].name"),
    ("[[hostcache]\n", "--config"),
])
def test_config_errors_name_the_field(tmp_path: Path, text: str, field: str) -> None:
    with pytest.raises(ServiceConfigError) as err:
        build_config(_toml(tmp_path, text), env={})
    assert err.value.field == field
    assert field in str(err.value)
    assert isinstance(err.value, HostCacheError) and isinstance(err.value, ValueError)


def test_config_error_from_env_and_missing_file(tmp_path: Path) -> None:
    path = _toml(tmp_path, '[[linear]]\nname = "a"\nrows = 8\ndim = 4\n')
    with pytest.raises(ServiceConfigError, match="env reap_interval"):
        build_config(path, env={"NVEC_REAP_INTERVAL": "soon"})
    with pytest.raises(ServiceConfigError, match="cannot read"):
        build_config(tmp_path / "absent.toml", env={})


def test_cli_reports_config_errors_in_one_line(tmp_path: Path, capsys: Any) -> None:
    path = _toml(tmp_path, '[[hostcache]]\nname = "a"\ncapacity = 0\ndim = 4\n')
    assert cli_main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hostcache: error: config field hostcache[0] (a).capacity")
    assert "\n" not in err


# -- lifecycle (in-process) --------------------------------------------------------------------


@pytest.fixture
def node_cfg(tmp_path: Path, table_name: str) -> Iterator[Any]:
    """A config with one host cache over a file:// PS (keys 0..199) and one linear table."""
    ps_url = f"file://{tmp_path / 'ps'}"
    ps = psclient.connect(ps_url, table=table_name, dim=DIM, dtype=torch.float32)
    keys = torch.arange(200)
    ps.insert(keys, rows_of(keys, 0))
    ps.close()
    linear = f"{table_name}-lin"
    path = write_config(tmp_path / "node.toml",
                        {"state_dir": str(tmp_path / "state"), "metrics_port": 0,
                         "poll_interval": 0.02, "reap_interval": 0.1, "settle": 0.0},
                        [{"name": table_name, "capacity": 1024, "dim": DIM, "ps_url": ps_url,
                          "warmup": 50},
                         {"kind": "linear", "name": linear, "rows": 64, "dim": DIM}])
    yield build_config(path, env={})
    for name in (table_name, linear):
        if segment.exists(name):
            segment.unlink(name)


class Running:
    """A NodeService started in this process with its loop in a thread."""

    def __init__(self, cfg: Any) -> None:
        self.service = NodeService(cfg)
        self.service.start()
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.service.serve, args=(self.stop_event,))
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.service.address  # type: ignore[misc]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(30)
        assert not self.thread.is_alive()


def test_start_warmup_health_and_clean_stop_removes_segments(node_cfg: Any) -> None:
    names = [t.name for t in node_cfg.tables]
    run = Running(node_cfg)
    try:
        assert all(segment.exists(n) for n in names)
        hc = HostCache.attach(names[0])
        assert len(hc) == 50 and bool(hc.contains(torch.arange(50)).all())  # warm-up
        hc.close()
        code, body = http_get(run.url + "/healthz")
        health = json.loads(body)
        assert code == 200 and health["status"] == "ok"
        assert health["tables"][names[0]]["feed_alive"] is True
        assert health["tables"][names[1]]["attached"] is True
        info = json.loads((Path(node_cfg.state_dir) / "endpoint.json").read_text())
        assert info["url"] == run.url and info["pid"] == os.getpid()
    finally:
        run.stop()
    assert not any(segment.exists(n) for n in names)
    assert not (Path(node_cfg.state_dir) / "endpoint.json").exists()


def test_keep_keeps_segments_and_readopts(node_cfg: Any) -> None:
    cfg = with_overrides(node_cfg, keep=True)
    name = cfg.tables[0].name
    run = Running(cfg)
    run.stop()
    assert segment.exists(name)  # kept
    hc = HostCache.attach(name)
    assert len(hc) == 50
    hc.close()
    run = Running(cfg)
    try:
        assert run.service.adopted[name] is True
    finally:
        run.stop()
    for t in cfg.tables:
        segment.unlink(t.name)


def test_second_service_for_the_same_node_is_refused(node_cfg: Any) -> None:
    run = Running(node_cfg)
    try:
        with pytest.raises(ServiceRunningError, match=f"pid {os.getpid()}"):
            NodeService(node_cfg).start()
        assert all(segment.exists(t.name) for t in node_cfg.tables)  # nothing touched
    finally:
        run.stop()
    again = NodeService(node_cfg)
    again.start()  # the lock is free again once the first one stopped
    again.stop()
    assert not any(segment.exists(t.name) for t in node_cfg.tables)


def test_geometry_mismatch_is_an_error_and_changes_nothing(node_cfg: Any) -> None:
    name = node_cfg.tables[0].name
    other = HostCache.create(name, capacity=1024, dim=DIM * 2)
    other.insert(torch.tensor([1]), torch.ones(1, DIM * 2))
    try:
        with pytest.raises(GeometryMismatchError, match="dim=8 \\(config wants 4\\)"):
            NodeService(node_cfg).start()
        assert len(other) == 1 and other.geometry.dim == DIM * 2
        assert not segment.exists(node_cfg.tables[1].name)  # the created one rolled back
    finally:
        other.close()
        HostCache.unlink(name)


def test_change_feed_invalidates_host_cache_and_replica_layer(node_cfg: Any) -> None:
    t = node_cfg.tables[0]
    run = Running(node_cfg)
    try:
        layer = NVEmbedding(1000, DIM, torch.float32, LayerType.Hierarchical,
                            gpu_cache_size=4096, host_cache=t.name, storage=t.ps_url,
                            table=t.name, device="cpu")
        keys = torch.tensor([3, 4])
        assert layer(keys)[:, 1].tolist() == [0.0, 0.0]  # now in the layer's GPU cache
        trainer = psclient.connect(t.ps_url, table=t.name)  # another node's writer
        trainer.update(torch.tensor([3]), rows_of(torch.tensor([3]), 5))
        trainer.close()
        hc = HostCache.attach(t.name)  # the same shared table the layer reads
        wait_until(lambda: not hc.contains(torch.tensor([3])).item(), 10,
                   "the service to drop key 3 from the host cache")
        assert hc.contains(torch.tensor([4])).item()  # untouched keys stay
        assert layer(keys)[:, 1].tolist() == [5.0, 0.0]  # the new row, on the next lookup
        layer.close()
        hc.close()
        _, body = http_get(run.url + "/metrics")
        assert f'nvec_feed_keys_applied_total{{kind="hostcache",table="{t.name}"}} 1.0' in body
    finally:
        run.stop()


@pytest.mark.redis
def test_change_feed_from_redis(node_cfg: Any, redis_url: str) -> None:
    import redis

    try:
        redis.Redis.from_url(redis_url, socket_connect_timeout=1).ping()
    except redis.RedisError as e:
        pytest.skip(f"needs a Redis server at {redis_url}: {e}")
    t = node_cfg.tables[0]
    ps = psclient.connect(redis_url, table=t.name, dim=DIM, dtype=torch.float32)
    try:
        keys = torch.arange(200)
        ps.insert(keys, rows_of(keys, 0))
        cfg = build_config(None, env={}, overrides={"state_dir": node_cfg.state_dir,
                                                    "metrics_port": -1, "poll_interval": 0.02},
                           table_specs=[f"name={t.name},capacity=1024,dim={DIM},"
                                        f"ps_url={redis_url},warmup=all"])
        run = Running(cfg)
        try:
            layer = NVEmbedding(1000, DIM, torch.float32, LayerType.Hierarchical,
                                gpu_cache_size=4096, host_cache=t.name, storage=redis_url,
                                table=t.name, device="cpu")
            assert layer(torch.tensor([9]))[0, 1] == 0.0
            ps.update(torch.tensor([9]), rows_of(torch.tensor([9]), 3))
            wait_until(lambda: float(layer(torch.tensor([9]))[0, 1]) == 3.0, 10,
                       "the replica layer to return the updated row")
            layer.close()
        finally:
            run.stop()
    finally:
        ps.drop()


def test_resume_from_saved_cursor_after_restart(node_cfg: Any) -> None:
    cfg = with_overrides(node_cfg, keep=True)
    t = cfg.tables[0]
    run = Running(cfg)
    run.stop()
    cursor_file = Path(cfg.state_dir) / "cursors" / f"{t.name}.json"
    saved = json.loads(cursor_file.read_text())["cursor"]
    trainer = psclient.connect(t.ps_url, table=t.name)
    trainer.update(torch.tensor([7, 8]), rows_of(torch.tensor([7, 8]), 1))  # while stopped
    trainer.close()
    run = Running(cfg)
    hc = HostCache.attach(t.name)
    try:
        wait_until(lambda: not bool(hc.contains(torch.tensor([7, 8])).any()), 10,
                   "the restarted service to apply the change made while it was down")
        assert bool(hc.contains(torch.tensor([5, 6])).all())  # resumed, not cleared
        wait_until(lambda: json.loads(cursor_file.read_text())["cursor"] != saved, 10,
                   "the cursor to advance")
    finally:
        hc.close()
        run.stop()
    for x in cfg.tables:
        segment.unlink(x.name)


def test_metrics_and_healthz_content(node_cfg: Any) -> None:
    t = node_cfg.tables[0]
    run = Running(node_cfg)
    try:
        hc = HostCache.attach(t.name)
        hc.lookup(torch.arange(100))  # 50 warm hits, 50 misses
        wait_until(lambda: run.service.followers[t.name].state.up, 10, "the first feed poll")
        _, body = http_get(run.url + "/metrics")
        lab = f'{{kind="hostcache",table="{t.name}"}}'
        for line in (f"nvec_table_capacity_rows{lab} 1024.0", f"nvec_table_size_rows{lab} 50.0",
                     f"nvec_table_hits_total{lab} 50.0", f"nvec_table_misses_total{lab} 50.0",
                     f"nvec_table_lookup_keys_total{lab} 100.0",
                     f"nvec_table_replicas{lab} 0.0", f"nvec_feed_up{lab} 1.0",  # same pid
                     f'nvec_hit_rate{{table="{t.name}",tier="host"}} 0.5'):
            assert line in body, line
        assert f'nvec_feed_poll_seconds_count{{table="{t.name}"}}' in body
        assert "nvec_feed_lag_seconds" in body and "nvec_feed_gaps_total" in body
        hc.close()
        code, _ = http_get(run.url + "/nope")
        assert code == 404
        # a table removed under the service makes it unhealthy
        segment.unlink(node_cfg.tables[1].name)
        code, body = http_get(run.url + "/healthz")
        assert code == 503 and json.loads(body)["status"] == "unhealthy"
    finally:
        run.stop()


def test_gap_clears_the_host_cache(node_cfg: Any, tmp_path: Path) -> None:
    t = node_cfg.tables[0]
    run = Running(node_cfg)
    try:
        hc = HostCache.attach(t.name)
        assert len(hc) == 50
        trainer = psclient.connect(t.ps_url, table=t.name)
        trainer.clear()  # a clear marker in the feed: a gap for its readers
        trainer.close()
        wait_until(lambda: len(hc) == 0, 10, "the gap to clear the host cache")
        wait_until(lambda: run.service.followers[t.name].state.gaps == 1, 10, "a gap counted")
        assert hc.feed_status().gaps == 1  # what `hostcache stat` shows
        hc.close()
    finally:
        run.stop()


def test_a_change_is_applied_as_soon_as_it_commits_and_its_lag_is_recorded(
        node_cfg: Any) -> None:
    """The follower blocks on the feed: with a poll interval of 6 s a change still reaches
    the host cache at once (a timer would take 3 s on average); its propagation lag goes to
    the histogram and the table's header (hostcache stat)."""
    cfg = with_overrides(node_cfg, poll_interval=6.0)
    t = cfg.tables[0]
    run = Running(cfg)
    try:
        hc = HostCache.attach(t.name)
        follower = run.service.followers[t.name]
        wait_until(lambda: follower.state.up, 10, "the follower to reach the feed")
        assert hc.contains(torch.tensor([7])).item()  # warmed up
        trainer = psclient.connect(t.ps_url, table=t.name)
        trainer.update(torch.tensor([7]), rows_of(torch.tensor([7]), 9))
        trainer.close()
        started = time.monotonic()
        wait_until(lambda: not hc.contains(torch.tensor([7])).item(), 6, "key 7 dropped")
        assert time.monotonic() - started < 2.0
        wait_until(lambda: hc.feed_status().last_lag_s is not None, 5, "the lag recorded")
        status = hc.feed_status()
        assert 0 <= status.last_lag_s <= status.max_lag_s < 5  # type: ignore[operator]
        _, body = http_get(run.url + "/metrics")
        assert f'nvec_feed_propagation_seconds_count{{table="{t.name}"}} 1.0' in body
        assert f'nvec_feed_propagation_seconds_bucket{{le="+Inf",table="{t.name}"}} 1.0' \
            in body
        hc.close()
    finally:
        run.stop()


# -- crash and re-adoption (subprocess) --------------------------------------------------------


def test_readopt_after_sigkill_while_a_replica_serves(tmp_path: Path, table_name: str) -> None:
    ps_url = f"file://{tmp_path / 'ps'}"
    ps = psclient.connect(ps_url, table=table_name, dim=DIM, dtype=torch.float32)
    ps.insert(torch.arange(1000), rows_of(torch.arange(1000), 0))
    ps.close()
    state = tmp_path / "state"
    config = write_config(tmp_path / "node.toml",
                          {"state_dir": str(state), "metrics_port": 0, "poll_interval": 0.05},
                          [{"name": table_name, "capacity": 2048, "dim": DIM,
                            "ps_url": ps_url, "warmup": "all"}])
    svc = ServiceProc(config, state, tmp_path / "service.log").start()
    stop, out = new_stop_flag(), CTX.Queue()
    info = {"name": table_name, "ps_url": ps_url}
    procs: list[Any] = []
    try:
        procs = spawn_replicas(info, 1, stop, out)
        hc = HostCache.attach(table_name)
        os.kill(svc.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
        svc.proc.wait(30)  # type: ignore[union-attr]
        assert segment.exists(table_name) and len(hc) > 900  # warmed (a few buckets overflow)
        hits = hc.stats("node").hits
        wait_until(lambda: hc.stats("node").hits > hits + 500, 30, "hits while it is down")
        svc.start()
        health = svc.healthy()
        assert health is not None and health["tables"][table_name]["adopted"] is True
        assert health["tables"][table_name]["replicas"] == 2  # the replica and this test
        hits = hc.stats("node").hits
        wait_until(lambda: hc.stats("node").hits > hits + 500, 30, "hits after the restart")
        stop.value = 1
        (_, lookups, _, bad, _, errors, _), = collect(out, 1)
        assert lookups > 0 and bad == 0 and errors == 0
        hc.close()
        assert svc.terminate() == 0
        assert not segment.exists(table_name)
    finally:
        stop.value = 1
        reap_children(procs)
        svc.kill()
        if segment.exists(table_name):
            segment.unlink(table_name)
