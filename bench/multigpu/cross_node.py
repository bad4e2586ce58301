"""Two nodes on one machine sharing one parameter server: how fast an update on node A
reaches the replicas of node B (the harness of ``bench/multigpu/bench_cross_node.py`` and of
``tests/apps/test_cross_node.py``).

Each node is a node service (``python -m nvecache.apps.cli serve``) and its processes, all
with their own ``NVEC_NODE`` (hostcache's node namespaces: each node its own shared tables,
as with its own ``/dev/shm``). On node A a writer updates rows through a Hierarchical layer at
a target
rate and records when each update of a *watched* key returned; on node B a prober looks the
watched keys up through a Hierarchical layer in a loop and records when it first served
each new version, while a replica looks random keys up (the lookup load B serves).

Propagation lag of an update = the first time B served that version (or a newer one) minus
the time the update returned on A. Rows encode ``[key, version, key, version]`` (exact in
float32), so the version served is read off the row.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import psclient
from gpu import LayerType, NVEmbedding
from hostcache import segment
from hostcache.errors import SegmentNotFoundError

CTX = mp.get_context("spawn")
DIM = 4


def rows_of(keys: torch.Tensor, version: torch.Tensor | int) -> torch.Tensor:
    """Rows ``[key, version, key, version]`` (float32; exact below 2**24)."""
    v = torch.as_tensor(version, dtype=torch.float32).expand(keys.numel())
    k = keys.to(torch.float32)
    return torch.stack([k, v, k, v], dim=1).contiguous()


@dataclass
class Node:
    """One simulated node: its namespace, its service's state dir and process."""

    name: str
    table: str
    ps_url: str
    root: Path
    capacity: int
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, segment.NODE_ENV: self.name}

    def start(self, timeout: float = 60.0) -> Node:
        """Write the node's config and start its service; wait until it is healthy."""
        state = self.root / "state"
        state.mkdir(parents=True, exist_ok=True)
        config = self.root / "node.toml"
        config.write_text(
            f'state_dir = "{state}"\nmetrics_port = 0\npoll_interval = 0.2\nsettle = 0.5\n'
            f'log_level = "WARNING"\n\n[[hostcache]]\nname = "{self.table}"\n'
            f"capacity = {self.capacity}\ndim = {DIM}\n"
            f'ps_url = "{self.ps_url}"\nps_table = "{self.table}"\n')
        with open(self.root / "service.log", "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "nvecache.apps.cli", "serve", "--config", str(config)],
                stdout=log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout
        while self.metrics() is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"node {self.name}'s service did not come up: "
                                   f"{(self.root / 'service.log').read_text()[-2000:]}")
            time.sleep(0.05)
        return self

    def metrics(self) -> str | None:
        """The service's /metrics text (None until it answers)."""
        try:
            info = json.loads((self.root / "state" / "endpoint.json").read_text())
            with urllib.request.urlopen(info["url"] + "/metrics", timeout=5) as r:
                return str(r.read().decode())
        except (OSError, ValueError, KeyError):
            return None

    def stop(self) -> None:
        """SIGTERM the service (it removes its segments) and wait for it. A service that
        had to be killed, or died, leaves its table behind: removed here, once no process
        of the node runs (the caller stops the node's other processes first)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                print(f"node {self.name}: its service did not stop within 30 s of SIGTERM; "
                      f"killed (see {self.root / 'service.log'})", file=sys.stderr)
                self.proc.kill()
                self.proc.wait(30)
        before = os.environ.get(segment.NODE_ENV)
        os.environ[segment.NODE_ENV] = self.name  # NOTE: the node's namespace, for a moment
        try:
            segment.unlink(self.table)  # NOTE: and a lock file left without its segment
        except SegmentNotFoundError:
            pass  # NOTE: the service removed it, as it should
        finally:
            if before is None:
                del os.environ[segment.NODE_ENV]
            else:
                os.environ[segment.NODE_ENV] = before


def _layer(node: str, table: str, ps_url: str, key_space: int) -> Any:
    os.environ[segment.NODE_ENV] = node  # NOTE: this process is on that node from now on
    torch.set_num_threads(1)
    return NVEmbedding(key_space, DIM, torch.float32, LayerType.Hierarchical,
                       gpu_cache_size=4096 * (12 + 4 * DIM), host_cache=table, storage=ps_url,
                       table=table, device="cpu")


def writer(node: str, table: str, ps_url: str, key_space: int, rate: float, seconds: float,
           watched: int, start: Any, out: Any) -> None:
    """Update ``rate`` rows/s for ``seconds``: random keys, and every watched key
    ``0..watched-1`` in each batch at a new version; put ``(acks, rows, elapsed, last
    version)``, acks an int64 array of (key, version, returned_ns) for the watched keys."""
    layer = _layer(node, table, ps_url, key_space)
    gen = torch.Generator().manual_seed(1)
    tick = 0.01
    per_tick = max(watched + 1, round(rate * tick))
    acks: list[np.ndarray] = []
    rows = 0
    # NOTE: warm up before the clock starts: a process's first write to a file:// store
    # loads the row mirror's compiled write loops (docs/psclient.md), which on a loaded
    # machine takes a good part of a short run; version 0 is what the table holds already
    warm = torch.arange(watched)
    layer.update(warm, rows_of(warm, 0))
    start.wait()
    t0 = time.monotonic()
    version = 0
    while time.monotonic() - t0 < seconds:
        version += 1
        keys = torch.cat([torch.arange(watched),
                          torch.randint(watched, key_space, (per_tick - watched,),
                                        generator=gen)])
        layer.update(keys, rows_of(keys, version))
        done = time.time_ns()
        rows += keys.numel()
        acks.append(np.stack([np.arange(watched), np.full(watched, version),
                              np.full(watched, done)], axis=1))
        ahead = t0 + version * per_tick / rate - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)  # pacing to the target rate (not synchronization)
    elapsed = time.monotonic() - t0
    layer.close()
    out.put((np.concatenate(acks), rows, elapsed, version))


def prober(node: str, table: str, ps_url: str, key_space: int, watched: int, ready: Any,
           stop: Any, newest: Any, out: Any) -> None:
    """Look the watched keys up in a loop (``ready`` once serving; ``newest``: the oldest
    version any watched key shows now); put an int64 array of (key, version, seen_ns) for
    every version change seen, and the lookups made."""
    layer = _layer(node, table, ps_url, key_space)
    keys = torch.arange(watched)
    last = torch.full((watched,), -1.0)
    seen: list[np.ndarray] = []
    lookups = 0
    while not stop.value:
        rows = layer(keys)
        now = time.time_ns()
        lookups += 1
        changed = rows[:, 1] != last
        if bool(changed.any()):
            idx = changed.nonzero().squeeze(1).numpy()
            seen.append(np.stack([idx, rows[idx, 1].numpy().astype(np.int64),
                                  np.full(idx.size, now)], axis=1))
            last = rows[:, 1].clone()
            newest.value = int(last.min())
        ready.set()
    layer.close()
    out.put((np.concatenate(seen) if seen else np.zeros((0, 3), np.int64), lookups))


def replica(node: str, table: str, ps_url: str, key_space: int, ready: Any, stop: Any,
            out: Any) -> None:
    """Random lookups of 1,024 keys (the load node B serves; ``ready`` once serving); put
    (keys looked up, seconds, rows whose key part is wrong)."""
    layer = _layer(node, table, ps_url, key_space)
    gen = torch.Generator().manual_seed(2)
    n = bad = 0
    t0 = time.monotonic()
    while not stop.value:
        keys = torch.randint(0, key_space, (1024,), generator=gen)
        rows = layer(keys)
        bad += int((rows[:, 0] != keys.to(torch.float32)).sum())
        n += keys.numel()
        ready.set()
    layer.close()
    out.put((n, time.monotonic() - t0, bad))


@dataclass
class Propagation:
    """What one run measured."""

    lags_s: np.ndarray  # per watched (key, version) update: first served on B - returned on A
    unseen: int  # watched updates B never served (nor a newer version) by the end
    rows_per_s: float  # the writer's achieved rate
    b_keys_per_s: float  # the replica's lookups on node B
    bad_rows: int  # rows B served whose key part was another key's

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.lags_s, q)) if self.lags_s.size else float("nan")


def lags(acks: np.ndarray, seen: np.ndarray) -> tuple[np.ndarray, int]:
    """Per acknowledged (key, version, t): the first time a version >= it was seen, minus
    t (0 if seen before t); and the number of acknowledged versions never reached."""
    out, missing = [], 0
    for key in np.unique(acks[:, 0]):  # a loop over the watched keys (a few dozen)
        a = acks[acks[:, 0] == key]
        s = seen[seen[:, 0] == key]
        s = s[np.argsort(s[:, 2], kind="stable")]
        best = np.maximum.accumulate(s[:, 1]) if s.size else np.zeros(0, np.int64)
        pos = np.searchsorted(best, a[:, 1], side="left")  # first sighting of >= version
        ok = pos < best.size
        missing += int((~ok).sum())
        # NOTE: B may serve a version before A's update() returns (the PS is written first,
        # A's host cache after): no staleness at all, a lag of 0
        out.append(np.maximum(s[pos[ok], 2] - a[ok, 2], 0) / 1e9)
    return (np.concatenate(out) if out else np.zeros(0)), missing


def run(ps_url: str, root: Path, *, table: str, rate: float, seconds: float,
        key_space: int = 20_000, watched: int = 32) -> Propagation:
    """Two nodes, a writer on A, a prober and a replica on B, for ``seconds``."""
    a = Node(f"A{os.getpid()}", table, ps_url, root / "A", capacity=key_space)
    b = Node(f"B{os.getpid()}", table, ps_url, root / "B", capacity=key_space)
    with psclient.connect(ps_url, table=table, dim=DIM) as ps:
        keys = torch.arange(key_space)
        ps.insert(keys, rows_of(keys, 0))
    procs: list[Any] = []
    start, stop = CTX.Event(), CTX.RawValue("i", 0)
    try:
        a.start()
        b.start()
        ready = [CTX.Event(), CTX.Event()]
        newest = CTX.RawValue("q", -1)
        wq, pq, rq = CTX.Queue(), CTX.Queue(), CTX.Queue()
        procs = [
            CTX.Process(target=writer, args=(a.name, table, ps_url, key_space, rate, seconds,
                                             watched, start, wq)),
            CTX.Process(target=prober, args=(b.name, table, ps_url, key_space, watched,
                                             ready[0], stop, newest, pq)),
            CTX.Process(target=replica, args=(b.name, table, ps_url, key_space, ready[1],
                                              stop, rq)),
        ]
        for p in procs:
            p.start()
        for ev in ready:
            if not ev.wait(120):
                raise RuntimeError("a reader on node B did not start serving")
        start.set()
        acks, rows, elapsed, last_version = wq.get(timeout=seconds + 120)
        deadline = time.monotonic() + 30
        while newest.value < last_version and time.monotonic() < deadline:
            time.sleep(0.01)  # a bounded wait for B to serve the last version everywhere
        stop.value = 1
        seen, _ = pq.get(timeout=60)
        b_keys, b_secs, bad = rq.get(timeout=60)
        lag, unseen = lags(acks, seen)
        return Propagation(lag, unseen, rows / elapsed, b_keys / max(b_secs, 1e-9), bad)
    finally:
        stop.value = 1
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        a.stop()
        b.stop()
        with psclient.connect(ps_url, table=table) as ps:
            ps.drop()
