"""One replica process of the demo: attach the node's tables, serve requests, report.

Runs in a spawned process (:func:`replica_main`). Messages to the parent, on one queue:

* ``("ready", rid, pid)`` once the model is built;
* ``("tick", rid, elapsed_s, counters)`` every half tick while serving;
* ``("done", rid, result)`` at the end, with latencies and ``/proc`` memory figures;
* ``("error", rid, text)`` if anything failed (then the process exits with status 1).

The replica serves until ``--seconds`` have passed since ``go`` was set, or ``stop`` is set,
or its parent is gone. It ignores SIGINT: on Ctrl-C the parent stops every replica itself.
After ``done`` it keeps its mappings until ``stop``, so all replicas measure their memory
while every one of them still maps the shared segments.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from typing import Any

import torch

from hostcache import HostCache
from nvecache.apps.demo.config import TABLES, DemoConfig
from nvecache.apps.demo.memory import process_memory
from nvecache.apps.demo.model import build_model
from nvecache.apps.demo.workload import RequestStream
from psclient import connect

logger = logging.getLogger(__name__)

#: counters sent per table: device-cache hits, misses; host hits, misses; PS found, missing
COUNTER_FIELDS = ("gpu_hits", "gpu_misses", "host_hits", "host_misses", "ps_found",
                  "ps_missing")


def replica_device(cfg: DemoConfig, rid: int) -> torch.device:
    """Replica ``rid``'s device: the CPU, or GPU ``rid % device_count``."""
    if cfg.device == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", rid % torch.cuda.device_count())


def counters(model: Any) -> dict[str, list[int]]:
    """Per-table tier counters of this process's layers (see :data:`COUNTER_FIELDS`)."""
    out: dict[str, list[int]] = {}
    for suffix, layer in model.layers().items():
        s = layer.stats()
        host = s.host
        ps = s.storage
        out[suffix] = [
            s.gpu.hits, s.gpu.misses,
            host.hits if host else 0, host.misses if host else 0,
            ps.hits if ps else 0, ps.misses if ps else 0,
        ]
    return out


def replica_main(cfg: DemoConfig, rid: int, ps_url: str, queue: Any, tables_ready: Any,
                 go: Any, stop: Any) -> None:
    """Body of replica process ``rid`` (the target of a spawned ``Process``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    status = 0
    try:
        _serve(cfg, rid, ps_url, queue, tables_ready, go, stop)
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the run
        queue.put(("error", rid, traceback.format_exc()))
        status = 1
    # NOTE: every handle is closed and the messages are flushed to the pipe; skip the
    # interpreter's teardown (slow with torch loaded: see bench/RESULTS.md, "Demo replica
    # exit"), which only delays the parent's join.
    queue.close()
    queue.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _wait(event: Any, stop: Any, parent: int) -> bool:
    """Wait for ``event``; False if ``stop`` was set or the parent died first."""
    while not event.wait(timeout=0.2):
        if stop.is_set() or os.getppid() != parent:
            return False
    return not stop.is_set()


def _serve(cfg: DemoConfig, rid: int, ps_url: str, queue: Any, tables_ready: Any, go: Any,
           stop: Any) -> None:
    torch.set_num_threads(cfg.threads)
    parent_process = mp.parent_process()
    parent = parent_process.pid if parent_process is not None else None
    if parent is None:
        parent = os.getppid()
    device = replica_device(cfg, rid)
    hosts: dict[str, Any] = {}
    stores: dict[str, Any] = {}
    model = None
    if not _wait(tables_ready, stop, parent):
        return
    try:
        for s, _ in TABLES:
            hosts[s] = HostCache.attach(cfg.table_name(s), dim=cfg.dim)
            stores[s] = connect(ps_url, table=cfg.table_name(s))
        model = build_model(cfg, device, hosts, stores)
        queue.put(("ready", rid, os.getpid()))
        if not _wait(go, stop, parent):
            return
        result = _serve_requests(cfg, rid, device, model, queue, stop, parent)
        result["memory"] = process_memory("self", cfg.table_names).as_dict()
        queue.put(("done", rid, result))
        # keep mapping the segments until every replica has measured (or the parent is gone)
        while not stop.wait(timeout=1.0) and os.getppid() == parent:
            pass
    finally:
        if model is not None:
            model.close()
        for h in hosts.values():
            h.close()
        for ps in stores.values():
            ps.close()


def _serve_requests(cfg: DemoConfig, rid: int, device: torch.device, model: Any, queue: Any,
                    stop: Any, parent: int) -> dict[str, Any]:
    """Serve until the time is up (or stop / parent gone); the replica's result."""
    stream = RequestStream(cfg.rows, cfg.rows, cfg.alpha, batch=cfg.batch,
                           history=cfg.history, popularity_seed=cfg.seed,
                           seed=cfg.seed * 7919 + 101 * (rid + 1) + 1_000_003 * cfg.stream_seed)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    latencies: list[float] = []
    requests = keys = 0
    scores = torch.zeros((), device=device)
    start = time.monotonic()
    half_tick = cfg.tick / 2
    next_tick = start + half_tick
    busy = 0.0
    while not stop.is_set():
        now = time.monotonic()
        if now - start >= cfg.seconds or os.getppid() != parent:
            break
        req = stream.next().to(device)
        t0 = time.perf_counter()
        out = model(req)
        sync()
        dt = time.perf_counter() - t0
        busy += dt
        scores += out.sum()
        latencies.append(dt)
        requests += req.size
        keys += req.num_keys
        if now >= next_tick:
            queue.put(("tick", rid, now - start, requests, keys, counters(model)))
            next_tick = now + half_tick
    elapsed = time.monotonic() - start
    final = counters(model)
    queue.put(("tick", rid, elapsed, requests, keys, final))
    return {
        "pid": os.getpid(),
        "device": str(device),
        "elapsed_s": elapsed,
        "busy_s": busy,
        "requests": requests,
        "keys": keys,
        "batches": len(latencies),
        "latencies_s": latencies,
        "counters": final,
        "score_sum": float(scores),  # NOTE: keeps the model's output observable
        "device_cache_bytes": cfg.gpu_cache_bytes * len(TABLES),
    }
