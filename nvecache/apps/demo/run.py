"""Orchestration of ``hostcache demo``: tables, node, replicas, progress, report, cleanup.

:func:`run_demo` runs the whole job and returns the report (a dict, also written as JSON
and a PNG plot). Everything it starts is torn down on the way out, in reverse order:
replicas, node (service or host-cache segments), parameter-server tables, state directory,
also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from hostcache import HostCache, HostCacheError, segment
from nvecache.apps.demo.config import TABLES, DemoConfig
from nvecache.apps.demo.memory import segment_file_bytes, segment_resident_bytes
from nvecache.apps.demo.node import (
    Node,
    attach_node,
    check_names_free,
    drop_tables,
    load_tables,
    ps_url_for,
    start_node,
)
from nvecache.apps.demo.replica import COUNTER_FIELDS, replica_main
from nvecache.apps.demo.report import build_report, check_out_dir, write_outputs
from nvecache.apps.errors import DemoError, DemoInterruptedError
from nvecache.apps.extras import require

logger = logging.getLogger(__name__)

#: how long replicas may take to import torch and build their models.
READY_TIMEOUT_S = 180.0
#: how long past ``--seconds`` the replicas may take to report.
FINISH_GRACE_S = 60.0


@dataclass
class Sample:
    """Totals over all replicas and tables at one moment of the run."""

    t: float
    requests: int
    keys: int
    counters: list[int]
    host_resident: int


@dataclass
class _Replica:
    process: Any
    elapsed: float = 0.0
    requests: int = 0
    keys: int = 0
    counters: dict[str, list[int]] = field(default_factory=dict)
    result: dict[str, Any] | None = None
    bar: Any = None


class Fleet:
    """The replica processes (spawned) and the queue they report on."""

    def __init__(self, cfg: DemoConfig, ps_url: str) -> None:
        self.cfg = cfg
        ctx = mp.get_context("spawn")
        self.queue = ctx.Queue()
        #: set once the parameter-server tables and the host caches exist
        self.tables_ready = ctx.Event()
        self.go = ctx.Event()
        self.stop_event = ctx.Event()
        self.replicas = [
            _Replica(ctx.Process(
                target=replica_main, args=(cfg, rid, ps_url, self.queue, self.tables_ready,
                                           self.go, self.stop_event),
                name=f"hostcache-demo-replica-{rid}", daemon=True))
            for rid in range(cfg.replicas)
        ]

    def start(self) -> None:
        """Start the replicas with SIGINT ignored, so Ctrl-C reaches only this process.

        NOTE: an ignored SIGINT survives exec, and Python installs its KeyboardInterrupt
        handler only where SIGINT is at its default: the replicas never see Ctrl-C, even
        while importing; this process stops them.
        """
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            for r in self.replicas:
                r.process.start()
        finally:
            if main:
                signal.signal(signal.SIGINT, previous)

    def _get(self, timeout: float) -> tuple[Any, ...] | None:
        try:
            msg: tuple[Any, ...] = self.queue.get(timeout=max(0.0, timeout))
        except queue_mod.Empty:
            return None
        return msg

    def _check_alive(self) -> None:
        for rid, r in enumerate(self.replicas):
            code = r.process.exitcode
            if code is not None and r.result is None:
                msg = self._get(1.0)  # its error report may still be in the queue
                if msg is not None and msg[0] == "error":
                    raise DemoError(f"replica {msg[1]} failed:\n{msg[2]}")
                raise DemoError(f"replica {rid} exited with status {code} before it finished")

    def wait_ready(self) -> None:
        """Wait until every replica has built its model."""
        ready: set[int] = set()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len(ready) < len(self.replicas):
            if time.monotonic() > deadline:
                raise DemoError(f"replicas not ready after {READY_TIMEOUT_S:.0f} s")
            msg = self._get(0.5)
            if msg is None:
                self._check_alive()
            elif msg[0] == "ready":
                ready.add(msg[1])
            elif msg[0] == "error":
                raise DemoError(f"replica {msg[1]} failed:\n{msg[2]}")

    def serve(self) -> tuple[list[Sample], float]:
        """Start serving, draw the progress bars, sample totals; returns (samples, start)."""
        cfg = self.cfg
        self._open_bars()
        self.go.set()
        start = time.monotonic()
        samples = [Sample(0.0, 0, 0, [0] * len(COUNTER_FIELDS), self._resident())]
        next_sample = start + cfg.tick
        try:
            while any(r.result is None for r in self.replicas):
                msg = self._get(next_sample - time.monotonic())
                if msg is not None:
                    self._handle(msg)
                else:
                    self._check_alive()
                now = time.monotonic()
                if now >= next_sample:
                    samples.append(self._sample(now - start))
                    next_sample += cfg.tick
                if now - start > cfg.seconds + FINISH_GRACE_S:
                    raise DemoError(f"replicas did not finish within {FINISH_GRACE_S:.0f} s "
                                    "of --seconds")
            final = self._sample(max(r.elapsed for r in self.replicas))
            if len(samples) > 1 and final.t < samples[-1].t + cfg.tick / 2:  # too close: replace
                final.t = max(final.t, samples[-1].t)
                samples.pop()
            samples.append(final)
        finally:
            for r in self.replicas:
                if r.bar is not None:
                    r.bar.close()
        return samples, start

    def _open_bars(self) -> None:
        total = round(self.cfg.seconds, 1)
        for rid, r in enumerate(self.replicas):
            r.bar = tqdm(total=total, desc=f"replica {rid}", position=rid, unit="s",
                         disable=None if self.cfg.progress else True, leave=True,
                         bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f} s"
                                    "{postfix}")

    def _handle(self, msg: tuple[Any, ...]) -> None:
        kind, rid = msg[0], msg[1]
        r = self.replicas[rid]
        if kind == "tick":
            _, _, r.elapsed, r.requests, r.keys, r.counters = msg
            if r.bar is not None and not r.bar.disable:
                tot = _sum_tables(r.counters)
                r.bar.n = min(r.elapsed, r.bar.total)
                r.bar.set_postfix_str(
                    f"{r.requests / max(r.elapsed, 1e-9):,.0f} req/s  "
                    f"device {_rate(tot[0], tot[1]):.0%}  host {_rate(tot[2], tot[3]):.0%}",
                    refresh=True)
        elif kind == "done":
            r.result = msg[2]
        elif kind == "error":
            raise DemoError(f"replica {rid} failed:\n{msg[2]}")

    def _resident(self) -> int:
        return sum(segment_resident_bytes(n) for n in self.cfg.table_names)

    def _sample(self, t: float) -> Sample:
        counters = [0] * len(COUNTER_FIELDS)
        for r in self.replicas:
            for i, v in enumerate(_sum_tables(r.counters)):
                counters[i] += v
        return Sample(t, sum(r.requests for r in self.replicas),
                      sum(r.keys for r in self.replicas), counters, self._resident())

    def stop(self, grace: float = 10.0) -> None:
        """Stop every replica: ask, wait ``grace`` seconds, terminate, kill; joins them all."""
        self.stop_event.set()
        deadline = time.monotonic() + grace
        started = [r for r in self.replicas if r.process.pid is not None]
        while time.monotonic() < deadline and any(r.process.is_alive() for r in started):
            # NOTE: drain the queue meanwhile: a child exits only once its queued messages
            # are in the pipe, and a full pipe would hold it forever.
            while self._get(0.05) is not None:
                pass
        for r in self.replicas:
            if r.process.is_alive():
                logger.warning("replica pid %d did not stop; terminating it", r.process.pid)
                r.process.terminate()
                r.process.join(timeout=5)
            if r.process.is_alive():
                r.process.kill()
                r.process.join()
        self.queue.close()
        self.queue.join_thread()


def _sum_tables(counters: dict[str, list[int]]) -> list[int]:
    out = [0] * len(COUNTER_FIELDS)
    for values in counters.values():
        for i, v in enumerate(values):
            out[i] += v
    return out


def _rate(hits: int, misses: int) -> float:
    return hits / (hits + misses) if hits + misses else 0.0


def _host_node_stats(cfg: DemoConfig, node: Node) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in cfg.table_names:
        try:
            with HostCache.attach(name) as hc:
                st = hc.stats("node")
        except HostCacheError as e:
            logger.warning("could not read node-wide stats of %s: %s", name, e)
            continue
        out[name] = {**st.as_dict(), "segment_bytes": segment_file_bytes(name),
                     "resident_bytes": segment_resident_bytes(name)}
    return out


def _teardown(fleet: Fleet, nodes: list[Node], interrupted: Any) -> None:
    """Stop the replicas first (quickly after an interruption), then the node."""
    try:
        fleet.stop(grace=2.0 if interrupted() else 10.0)
    finally:
        for node in nodes:
            node.stop()


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """Turn SIGTERM into :class:`DemoInterruptedError` (SIGINT raises KeyboardInterrupt)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: object) -> None:
        raise DemoInterruptedError("stopped by SIGTERM; every process and segment it started "
                                   "was removed")

    previous = signal.signal(signal.SIGTERM, on_term)
    previous_int = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def _shield_cleanup() -> None:
    """Ignore further Ctrl-C / SIGTERM while cleaning up (``_signals_raise`` restores them)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def check_extras(cfg: DemoConfig) -> None:
    """Check that the packages of the ``apps`` extra this run needs are installed.

    Raises:
        MissingExtraError: one is missing (before anything was started).
    """
    if cfg.mode == "load":
        return  # loads the tables and exits: no plot, no service
    if cfg.mode == "all" and cfg.use_service:
        require("prometheus_client", "the node service the demo starts (--no-service skips it)")
    require("matplotlib", "the demo's plot (demo.png)")


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """Run the demo end to end and write ``demo.json`` and ``demo.png`` under ``out_dir``.

    Returns:
        The report (what ``demo.json`` holds).

    Raises:
        DemoError: a replica failed, a name is taken, or the run was interrupted
            (:class:`DemoInterruptedError`); everything started was cleaned up first.
        MissingExtraError: a package of the ``apps`` extra the run needs is missing.
        BadArgumentError: ``out_dir`` cannot be created or written to (checked before
            anything is started).
    """
    check_extras(cfg)
    if cfg.mode != "load":  # NOTE: --load-only writes no report
        check_out_dir(cfg.out_dir)
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    interrupted = False
    with _signals_raise(), contextlib.ExitStack() as stack:
        try:
            if cfg.state_dir is None:
                state_dir = tempfile.mkdtemp(prefix="hostcache-demo-")
                stack.callback(shutil.rmtree, state_dir, ignore_errors=True)
            else:
                state_dir = cfg.state_dir
                os.makedirs(state_dir, exist_ok=True)
            ps_url = ps_url_for(cfg, state_dir)
            if cfg.mode == "load":
                n = load_tables(cfg, ps_url, [], keep_loaded=True)
                return {"mode": "load", "ps_url": ps_url, "tables": cfg.table_names,
                        "loaded": n, "timing": {"total_s": time.monotonic() - t0}}
            if cfg.mode == "all":
                check_names_free(cfg)
            created: list[str] = []
            stack.callback(drop_tables, ps_url, created)
            # the replicas import torch while the tables load and the service starts
            fleet = Fleet(cfg, ps_url)
            nodes: list[Node] = []
            stack.callback(_teardown, fleet, nodes, lambda: interrupted)
            fleet.start()
            if cfg.mode == "attach":
                node = attach_node(cfg, ps_url)
            else:
                load_tables(cfg, ps_url, created)
            timings["load_s"] = time.monotonic() - t0
            if cfg.mode == "all":
                node = start_node(cfg, ps_url, state_dir)
            nodes.append(node)
            fleet.tables_ready.set()
            fleet.wait_ready()
            timings["start_s"] = time.monotonic() - t0 - timings["load_s"]
            samples, _ = fleet.serve()
            timings["serve_s"] = max(r.result["elapsed_s"] for r in fleet.replicas
                                     if r.result is not None)
            host_node = _host_node_stats(cfg, node)
            results = [r.result for r in fleet.replicas if r.result is not None]
            node_kind = node.kind
        except KeyboardInterrupt:
            interrupted = True
            raise DemoInterruptedError("interrupted (Ctrl-C); every process and segment it "
                                       "started was removed") from None
        except DemoInterruptedError:
            interrupted = True
            raise
        finally:
            _shield_cleanup()
    timings["total_s"] = time.monotonic() - t0
    leaked = [] if cfg.mode == "attach" else [n for n in cfg.table_names if segment.exists(n)]
    report = build_report(cfg, ps_url, node_kind, results, samples, host_node, timings,
                          leaked)
    t_write = time.monotonic()
    write_outputs(report, cfg.out_dir)
    report["timing"]["report_s"] = time.monotonic() - t_write
    return report


__all__ = ["TABLES", "Fleet", "Sample", "check_extras", "run_demo"]
