"""System tests with real processes: replicas, the node service and Redis failing.

The node service runs as a subprocess (``python -m nvecache.apps.cli serve --config FILE``);
replicas, the updater and the inserter are spawned processes (bodies below, importable by
spawned children). Rows encode key and version as ``[key, version, key, version]`` (exact
in float32), so a torn or foreign row is detectable. Every wait is a poll with a deadline.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hostcache import HostCache, segment
from tests.servers import REDIS_SERVER, RedisProc, wait_until

CTX = mp.get_context("spawn")
DIM = 4


# -- helpers shared with tests/hostcache/test_service.py --------------------------------------


def rows_of(keys: torch.Tensor, version: int | torch.Tensor) -> torch.Tensor:
    """Rows ``[key, version, key, version]`` (float32, exact below 2**24)."""
    v = torch.as_tensor(version, dtype=torch.float32).expand(keys.numel())
    k = keys.to(torch.float32)
    return torch.stack([k, v, k, v], dim=1).contiguous()


def bad_rows(keys: torch.Tensor, rows: torch.Tensor) -> int:
    """Rows that are torn (halves disagree) or foreign (another key's)."""
    torn = (rows[:, 0] != rows[:, 2]) | (rows[:, 1] != rows[:, 3])
    return int((torn | (rows[:, 0] != keys.to(torch.float32))).sum())


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return json.dumps(str(v))


def write_config(path: Path, node: dict[str, Any], tables: list[dict[str, Any]]) -> Path:
    """A node config TOML: node fields, then ``[[hostcache]]``/``[[linear]]`` entries."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in node.items()]
    for t in tables:
        t = dict(t)
        lines.append(f"\n[[{t.pop('kind', 'hostcache')}]]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in t.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


class ServiceProc:
    """``hostcache serve --config FILE`` as a subprocess; its endpoint from endpoint.json."""

    def __init__(self, config: Path, state_dir: Path, log: Path) -> None:
        self.config, self.state_dir, self.log = config, state_dir, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60) -> ServiceProc:
        (self.state_dir / "endpoint.json").unlink(missing_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "nvecache.apps.cli", "serve", "--config", str(self.config)],
                stdout=log, stderr=subprocess.STDOUT)
        wait_until(lambda: self.healthy() or self._exited(), timeout, "service health")
        assert self.proc.poll() is None, self.log.read_text()
        return self

    def _exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    @property
    def url(self) -> str:
        info = json.loads((self.state_dir / "endpoint.json").read_text())
        assert info["pid"] == self.proc.pid  # type: ignore[union-attr]
        return str(info["url"])

    def healthy(self) -> dict[str, Any] | None:
        try:
            code, body = http_get(self.url + "/healthz")
        except (OSError, ValueError, AssertionError, KeyError):
            return None
        return json.loads(body) if code == 200 else None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def terminate(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


def new_stop_flag() -> Any:
    """A shared stop flag read without a lock: a SIGKILLed reader cannot leave it held
    (an ``mp.Event`` takes a lock in ``is_set`` and would deadlock the survivors)."""
    return CTX.RawValue("i", 0)


def cleanup_segments(*names: str) -> None:
    for name in names:
        if segment.exists(name):
            segment.unlink(name)


def reap_children(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(10)


# -- process bodies (spawned) -----------------------------------------------------------------


def replica(host: str, ps_url: str, key_space: int, stop: Any, out: Any,
            acked: Any = None, name: str = "replica", insert_every: int = 0) -> None:
    """Serve lookups through a Hierarchical layer until ``stop``; report counts.

    Reports ``(name, lookups, keys, bad, stale, errors, hits_host)`` on ``out`` at the end,
    plus a ``("ready", name, pid)`` message once serving. With ``acked`` (an int64 shared
    array of acknowledged versions per key) every row read must have version >= the
    acknowledged version at the time its lookup started.
    """
    from gpu import LayerType, NVEmbedding

    torch.set_num_threads(1)
    layer = NVEmbedding(key_space, DIM, torch.float32, LayerType.Hierarchical,
                        gpu_cache_size=64 * DIM * 4, host_cache=host, storage=ps_url,
                        table=host, default_row=-1.0, device="cpu")
    hc = HostCache.attach(host)  # for the inserts beside the layer's own handle
    gen = torch.Generator().manual_seed(os.getpid())
    versions = None if acked is None else np.frombuffer(acked, dtype=np.int64)
    lookups = nkeys = bad = stale = errors = 0
    out.put(("ready", name, os.getpid()))
    while not stop.value:
        keys = torch.randint(0, key_space, (64,), generator=gen)
        before = None if versions is None else torch.from_numpy(versions[keys.numpy()].copy())
        try:
            rows = layer(keys)
        except Exception:  # noqa: BLE001 - counted; the test asserts there were none
            errors += 1
            continue
        lookups += 1
        nkeys += keys.numel()
        time.sleep(0.001)  # pacing, so a 2-core machine keeps room for the others
        real = rows[:, 0] != -1.0  # default rows (key not in the PS) are not checked
        bad += bad_rows(keys[real], rows[real])
        if before is not None:
            stale += int((rows[real, 1] < before[real].to(torch.float32)).sum())
        if insert_every and lookups % insert_every == 0:
            hc.insert(keys, rows_of(keys, 0), overwrite=False)
    host_stats = layer.stats().host
    assert host_stats is not None
    out.put((name, lookups, nkeys, bad, stale, errors, host_stats.hits))
    layer.close()
    hc.close()


def updater(host: str, ps_url: str, key_space: int, stop: Any, out: Any, acked: Any) -> None:
    """Update random keys through a layer; publish each acknowledged (key, version)."""
    from gpu import LayerType, NVEmbedding

    torch.set_num_threads(1)
    layer = NVEmbedding(key_space, DIM, torch.float32, LayerType.Hierarchical,
                        gpu_cache_size=0, host_cache=host, storage=ps_url, table=host,
                        device="cpu")
    versions = np.frombuffer(acked, dtype=np.int64)
    gen = torch.Generator().manual_seed(7)
    version = int(versions.max())
    out.put(("ready", "updater", os.getpid()))
    while not stop.value:
        version += 1
        keys = torch.unique(torch.randint(0, key_space, (16,), generator=gen))
        layer.update(keys, rows_of(keys, version))
        versions[keys.numpy()] = version  # NOTE: published only after update() returned
    out.put(("updater", version))
    layer.close()


def inserter(host: str, key_space: int) -> None:
    """Big inserts forever (until SIGKILLed): mostly inside the writer lock."""
    torch.set_num_threads(1)
    hc = HostCache.attach(host)
    gen = torch.Generator().manual_seed(1)
    while True:
        keys = torch.randint(0, key_space, (20_000,), generator=gen)
        hc.insert(keys, rows_of(keys, 0), overwrite=False)


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture
def node(tmp_path: Path, table_name: str) -> Iterator[dict[str, Any]]:
    """A node layout in tmp: state dir, config path, a file:// PS with keys 0..999."""
    import psclient

    ps_url = f"file://{tmp_path / 'ps'}"
    ps = psclient.connect(ps_url, table=table_name, dim=DIM, dtype=torch.float32)
    keys = torch.arange(1000)
    ps.insert(keys, rows_of(keys, 0))
    ps.close()
    info = {"tmp": tmp_path, "name": table_name, "ps_url": ps_url,
            "state": tmp_path / "state", "config": tmp_path / "node.toml"}
    yield info
    cleanup_segments(table_name)


def start_service(info: dict[str, Any], **table: Any) -> ServiceProc:
    write_config(info["config"], {"state_dir": str(info["state"]), "metrics_port": 0,
                                  "poll_interval": 0.05, "reap_interval": 0.2},
                 [{"name": info["name"], "capacity": 4096, "dim": DIM,
                   "ps_url": info["ps_url"], **table}])
    return ServiceProc(info["config"], info["state"], info["tmp"] / "service.log").start()


def spawn_replicas(info: dict[str, Any], n: int, stop: Any, out: Any, key_space: int = 1000,
                   **kw: Any) -> list[Any]:
    procs = [CTX.Process(target=replica, args=(info["name"], info["ps_url"], key_space, stop,
                                                out), kwargs={"name": f"r{i}", **kw})
             for i in range(n)]
    for p in procs:
        p.start()
    for _ in procs:
        assert out.get(timeout=60)[0] == "ready"
    return procs


def collect(out: Any, n: int) -> list[tuple[Any, ...]]:
    return [out.get(timeout=60) for _ in range(n)]


# -- the tests --------------------------------------------------------------------------------


def test_replica_killed_mid_lookup_or_insert(node: dict[str, Any]) -> None:
    svc = start_service(node)
    stop, out = new_stop_flag(), CTX.Queue()
    procs: list[Any] = []
    try:
        procs = spawn_replicas(node, 3, stop, out)
        victim = procs.pop(0)
        time.sleep(0.3)  # let it serve a little; then it is killed mid-lookup, wherever it is
        victim.kill()
        victim.join(10)
        ins = CTX.Process(target=inserter, args=(node["name"], 1000))
        ins.start()
        hc = HostCache.attach(node["name"])
        # NOTE: attaching is a write section too (it claims a counter slot): wait until the
        # slot is claimed, so the death leaves a slot for the service to reap
        wait_until(lambda: hc.writer_pid == ins.pid and ins.pid in hc.slot_pids(), 30,
                   "the inserter inside a write section, its counter slot claimed")
        os.kill(ins.pid, signal.SIGKILL)  # mid-insert: inside the writer lock
        ins.join(10)
        dead = {victim.pid, ins.pid}
        wait_until(lambda: not dead & set(hc.slot_pids()), 10,
                   "the service to reap the dead processes' slots")
        # the reaper's lock repaired the dead writer's section (a live replica may be inside
        # a write section of its own at this instant: its fills keep going)
        assert hc.writer_pid not in dead
        time.sleep(0.3)  # the survivors keep serving after both deaths
        stop.value = 1
        results = collect(out, 2)
        for _name, lookups, _keys, bad, _stale, errors, _ in results:
            assert lookups > 0 and bad == 0 and errors == 0
        _, body = http_get(svc.url + "/metrics")
        reaped = [line for line in body.splitlines()
                  if line.startswith("nvec_table_reaped_processes_total")]
        # the inserter's slot at least (the victim's may be reaped by our own attach above)
        assert reaped and float(reaped[0].split()[-1]) >= 1
        hc.close()
        assert svc.terminate() == 0
        assert not segment.exists(node["name"])
    finally:
        stop.value = 1
        reap_children(procs)
        svc.kill()


def run_kill_restart(node: dict[str, Any], replicas: int, *, feed: bool) -> None:
    """Replicas serve while the service is SIGKILLed and restarted; shared by two tests."""
    import psclient

    svc = start_service(node, warmup="all")
    stop, out = new_stop_flag(), CTX.Queue()
    procs: list[Any] = []
    try:
        procs = spawn_replicas(node, replicas, stop, out)
        hc = HostCache.attach(node["name"])
        assert hc.contains(torch.tensor([5])).item()  # warmed up
        svc.kill()
        assert segment.exists(node["name"])  # the segments outlive the service
        if feed:  # a trainer on another node writes while the service is down
            ps = psclient.connect(node["ps_url"], table=node["name"])
            ps.update(torch.tensor([5]), rows_of(torch.tensor([5]), 42))
            ps.close()
        hits_before = hc.stats("node").hits
        wait_until(lambda: hc.stats("node").hits > hits_before + 1000, 30,
                   "replicas serving hits while the service is down")
        svc.start()
        body = svc.healthy()
        assert body is not None and body["tables"][node["name"]]["adopted"] is True
        assert body["tables"][node["name"]]["replicas"] >= replicas
        if feed:  # resumed from the saved cursor: the change made while down is applied
            wait_until(lambda: hc.stats("node").erases > 0, 30, "the feed to resume")
            check = CTX.Queue()
            p = CTX.Process(target=_lookup_once, args=(node["name"], node["ps_url"], 5, check))
            p.start()
            assert check.get(timeout=60) == 42.0
            p.join(30)
        stop.value = 1
        for _name, lookups, _keys, bad, _stale, errors, host_hits in collect(out, replicas):
            assert lookups > 0 and bad == 0 and errors == 0 and host_hits >= 0
        hc.close()
        assert svc.terminate() == 0
    finally:
        stop.value = 1
        reap_children(procs)
        svc.kill()


def _lookup_once(host: str, ps_url: str, key: int, out: Any) -> None:
    from gpu import LayerType, NVEmbedding

    layer = NVEmbedding(1000, DIM, torch.float32, LayerType.Hierarchical, gpu_cache_size=1024,
                        host_cache=host, storage=ps_url, table=host, device="cpu")
    out.put(float(layer(torch.tensor([key]))[0, 1]))
    layer.close()


def test_service_killed_and_restarted_while_replicas_serve(node: dict[str, Any]) -> None:
    run_kill_restart(node, 2, feed=True)


@pytest.mark.redis
@pytest.mark.skipif(REDIS_SERVER is None, reason="needs the redis-server binary")
def test_redis_down_hits_served_misses_by_policy_no_update_lost(
        node: dict[str, Any], tmp_path: Path) -> None:
    import psclient
    from gpu import LayerType, NVEmbedding, StorageUnavailableError, StorageWriteError

    redis = RedisProc(tmp_path / "redis", None, "--appendonly", "yes", "--appendfsync",
                      "always").start()
    name = node["name"]
    fast = {"socket_timeout": 0.5, "socket_connect_timeout": 0.5, "retries": 0}
    node["ps_url"] = redis.url
    ps = psclient.connect(redis.url, table=name, dim=DIM, dtype=torch.float32, **fast)
    keys = torch.arange(100)
    ps.insert(keys, rows_of(keys, 0))
    svc = start_service(node, ps_options=fast)
    layers: list[Any] = []
    try:
        def layer(**kw: Any) -> Any:
            store = psclient.connect(redis.url, table=name, **fast)
            emb = NVEmbedding(1000, DIM, torch.float32, LayerType.Hierarchical,
                              gpu_cache_size=1024, host_cache=name, storage=store,
                              device="cpu", **kw)
            layers.append(emb)
            return emb

        lenient, strict = layer(default_row=-1.0), layer()
        warm = torch.arange(50)
        assert bad_rows(warm, lenient(warm)) == 0
        lenient.flush()  # its fills reach the host cache (the worker batches them)
        redis.kill()
        wait_until(lambda: (svc.healthy() or {}).get("tables", {}).get(name, {}).get(
            "feed_up") is False, 30, "the service to notice Redis is down")
        assert bad_rows(warm, strict(warm)) == 0  # host-tier hits for a fresh layer
        assert bad_rows(warm, lenient(warm)) == 0
        cold = torch.arange(50, 60)
        assert bool((lenient(cold) == -1.0).all())  # default rows while the PS is down
        with pytest.raises(StorageUnavailableError):
            strict(cold)
        with pytest.raises(StorageWriteError):
            lenient.update(torch.tensor([7]), rows_of(torch.tensor([7]), 9))
        assert float(strict(torch.tensor([7]))[0, 1]) == 0.0  # nothing changed
        redis.start()  # same port, same AOF: the data is back; nothing else restarts
        lenient.update(torch.tensor([7]), rows_of(torch.tensor([7]), 9))  # the retry
        assert float(strict(torch.tensor([7]))[0, 1]) == 9.0
        assert bad_rows(cold, strict(cold)) == 0  # misses are served from Redis again
        wait_until(lambda: (svc.healthy() or {}).get("tables", {}).get(name, {}).get(
            "feed_up") is True, 30, "the feed to resume")
        check = psclient.connect(redis.url, table=name)
        assert float(check.lookup(torch.tensor([7]))[0][0, 1]) == 9.0  # no update lost
        check.drop()
        assert svc.terminate() == 0
    finally:
        for emb in layers:
            emb.close()
        svc.kill()
        redis.kill()


@pytest.mark.slow
def test_soak_service_replicas_updater_and_crashes(node: dict[str, Any]) -> None:
    seconds = float(os.environ.get("NVEC_SOAK_SECONDS", "40"))
    svc = start_service(node, capacity=512)  # smaller than the key space: evictions too
    stop, out = new_stop_flag(), CTX.Queue()
    acked = CTX.RawArray("q", 1000)  # acknowledged version per key
    procs: list[Any] = []
    kills = 0
    try:
        procs = spawn_replicas(node, 2, stop, out, acked=acked)
        upd = CTX.Process(target=updater, args=(node["name"], node["ps_url"], 1000, stop,
                                                out, acked))
        upd.start()
        assert out.get(timeout=60)[0] == "ready"
        rng = random.Random(3)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:  # the crash injector
            time.sleep(rng.uniform(0.5, 2.0))
            i = rng.randrange(len(procs))
            procs[i].kill()
            procs[i].join(10)
            kills += 1
            fresh = spawn_replicas(node, 1, stop, out, acked=acked)[0]
            procs[i] = fresh
        stop.value = 1
        results = collect(out, len(procs) + 1)
        upd.join(30)
        reports = [r for r in results if r[0] != "updater"]
        assert sum(r[1] for r in reports) > 0
        assert sum(r[3] for r in reports) == 0, "torn or foreign rows"
        assert sum(r[4] for r in reports) == 0, "stale reads after an acknowledged update"
        assert sum(r[5] for r in reports) == 0, "lookup errors"
        assert [r for r in results if r[0] == "updater"][0][1] > 10
        assert kills >= 2
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        assert svc.terminate() == 0
        assert not segment.exists(node["name"])  # no leaked segment
    finally:
        stop.value = 1
        reap_children(procs)
        svc.kill()
