"""``NodeService``: owns a node's shared tables, follows their change feeds, serves metrics.

Lifecycle (``start`` then ``stop``; ``serve`` runs both around a wait loop):

* lock: an exclusive ``flock`` on ``<state_dir>/service.lock`` (the pid written inside);
  the kernel drops it when the process dies, so a crashed service never blocks a restart,
  and a second service for the same state dir is refused with :class:`ServiceRunningError`;
* parameter servers: each table with a ``ps_url`` connects to its parameter-server table
  first, before any segment is created; a table that does not exist there is an error
  (:class:`~nvecache.apps.errors.PSTableMissingError`) unless the table's ``ps_create`` is set;
* tables: each configured table is created, or, when a segment of that name exists (the
  service crashed and replicas kept serving), re-adopted if its geometry matches the
  config exactly; any difference raises ``GeometryMismatchError`` and nothing is changed;
* warm-up (created tables only), then one
  :class:`~nvecache.apps.service.feed.FeedFollower` per table with a ``ps_url``, then the
  compiled-code warm-up child (:mod:`~nvecache.apps.service.compiled`; the service does
  not wait for it), then the HTTP endpoints, then ``<state_dir>/endpoint.json``;
* while running: every ``reap_interval`` the counter slots of dead processes are freed
  (which, taking the writer lock, also repairs a write section a dead writer left);
* ``stop``: the warm-up child stopped, followers joined, endpoints closed, segments
  removed unless ``keep``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from hostcache import (
    GeometryMismatchError,
    HostCache,
    HostCacheError,
    SegmentNotFoundError,
    SharedMemBlock,
    SharedMemoryFullError,
    layout,
    segment,
)
from nvecache.apps.errors import ServiceRunningError
from nvecache.apps.service.compiled import CompiledWarmer, table_spec
from nvecache.apps.service.config import ServiceConfig, TableConfig
from nvecache.apps.service.feed import CursorStore, FeedFollower, connect_ps
from nvecache.apps.service.metrics import EndpointServer
from nvecache.apps.service.warmup import warm
from psclient import PSClientError

logger = logging.getLogger(__name__)

LOCK_FILE = "service.lock"
ENDPOINT_FILE = "endpoint.json"


def _geometry_diff(want: layout.Geometry, have: layout.Geometry) -> list[str]:
    fields = ("kind", "capacity", "ways", "dim", "dtype", "policy", "ring_capacity")
    return [f"{f}={getattr(have, f)!r} (config wants {getattr(want, f)!r})"
            for f in fields if getattr(want, f) != getattr(have, f)]


class NodeService:
    """The node service of one state dir. Use ``start()``/``stop()`` or ``serve(stop)``."""

    def __init__(self, cfg: ServiceConfig) -> None:
        self.cfg = cfg
        self.state_dir = Path(cfg.state_dir)
        self.tables: dict[str, HostCache | SharedMemBlock] = {}
        self.adopted: dict[str, bool] = {}
        self.followers: dict[str, FeedFollower] = {}
        self.reaped: dict[str, int] = {}
        self._stop = threading.Event()
        self._lock_fd: int | None = None
        self._http: EndpointServer | None = None
        self._started = 0.0
        #: the child filling the node's compiled caches (None: ``warm_compiled`` off)
        self.warmer: CompiledWarmer | None = None

    # -- start ------------------------------------------------------------------------------

    def start(self) -> None:
        """Lock, create or adopt the tables, warm up, start feeds and endpoints.

        Raises:
            ServiceRunningError: another service holds the lock.
            PSTableMissingError: a table's parameter-server table does not exist and its
                ``ps_create`` is not set (checked before any segment is created).
            GeometryMismatchError: an existing segment differs from the config.
            SharedMemoryFullError: ``/dev/shm`` has no room for a table.
        """
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._take_lock()
        clients: dict[str, Any] = {}
        try:
            for t in self.cfg.tables:
                clients[t.name] = self._connect_ps(t)
            starts: dict[str, tuple[Any, str | None]] = {}
            for t in self.cfg.tables:
                self._open_table(t)
                starts[t.name] = self._prepare_feed(t, clients[t.name])
            for t in self.cfg.tables:
                if t.ps_url is not None:
                    ps, cursor = starts[t.name]
                    f = FeedFollower(t, self.tables[t.name], CursorStore(self.state_dir, t),
                                     self._stop, poll_interval=self.cfg.poll_interval,
                                     settle=self.cfg.settle, ps=ps, start_cursor=cursor)
                    self.followers[t.name] = f
                    f.start()
            if self.cfg.warm_compiled:
                self.warmer = CompiledWarmer(table_spec(t.dim, t.dtype, t.kind)
                                             for t in self.cfg.tables)
                self.warmer.start()
            if self.cfg.metrics_port >= 0:
                self._http = EndpointServer(self.cfg.metrics_host, self.cfg.metrics_port,
                                            self.snapshot, self.health)
                self._http.start()
            self._started = time.time()
            self._write_endpoint()
        except BaseException:
            self._teardown(remove=True, only_created=True)
            for ps in clients.values():  # NOTE: a follower's own client was closed by it
                if ps is not None:
                    ps.close()
            raise
        host, port = self.address or ("-", -1)
        logger.info("serving %d tables (%s); endpoints http://%s:%d; state dir %s",
                    len(self.tables), ", ".join(self.tables), host, port, self.state_dir)

    def _take_lock(self) -> None:
        path = self.state_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ServiceRunningError(
                f"another hostcache serve (pid {holder}) runs for state dir {self.state_dir}; "
                "stop it first (SIGTERM), or give this one another --state-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _open_table(self, t: TableConfig) -> None:
        want = t.geometry()
        cls = HostCache if t.kind == "hostcache" else SharedMemBlock
        try:
            mapping, have = segment.attach(t.name)
        except SegmentNotFoundError:
            table = self._create_table(t)
            CursorStore(self.state_dir, t).remove()  # a new table has nothing stale
            self.tables[t.name], self.adopted[t.name] = table, False
            logger.info("table %s: created (%s, %.1f MiB)", t.name, t.kind,
                        want.total_size / 2**20)
            return
        mapping.close()
        diff = _geometry_diff(want, have)
        if diff:
            raise GeometryMismatchError(
                f"table {t.name!r} exists on this node with another geometry: "
                f"{'; '.join(diff)}. Nothing was changed: fix the config, or stop its "
                f"replicas and remove it (`hostcache rm {t.name}`)"
            )
        self.tables[t.name], self.adopted[t.name] = cls.attach(t.name), True
        logger.info("table %s: re-adopted the existing segment (%d live processes attached)",
                    t.name, len(self._replicas(self.tables[t.name])))

    @staticmethod
    def _create_table(t: TableConfig) -> HostCache | SharedMemBlock:
        """Create the table's segment; a /dev/shm too small says what to change in the config."""
        try:
            if t.kind == "hostcache":
                return HostCache.create(
                    t.name, capacity=t.capacity, dim=t.dim, dtype=t.torch_dtype, ways=t.ways,
                    ring_capacity=t.ring_capacity, mode=t.mode)
            return SharedMemBlock.create(t.name, num_rows=t.capacity, dim=t.dim,
                                         dtype=t.torch_dtype, ring_capacity=t.ring_capacity,
                                         mode=t.mode)
        except SharedMemoryFullError as e:
            if e.needed <= e.free:
                raise  # NOTE: the kernel refused it with room to spare (e.g. ENOMEM): say so
            size_field = "capacity" if t.kind == "hostcache" else "rows"
            raise SharedMemoryFullError(
                f"table {t.name!r} needs {e.needed / 2**30:,.2f} GiB of shared memory but "
                f"{segment.SHM_DIR} has {e.free / 2**30:,.2f} GiB free: lower its {size_field} "
                f"in the config, remove tables you no longer need (`hostcache rm`), or give "
                f"the node more shared memory (a larger {segment.SHM_DIR}; shm_size in "
                "docker-compose.yml)", needed=e.needed, free=e.free) from e

    @staticmethod
    def _connect_ps(t: TableConfig) -> Any:
        """The table's parameter-server client; None without ``ps_url`` or when it fails.

        A parameter server that fails here (down, refusing us, another schema) is logged:
        the table is served without warm-up and its feed keeps trying to connect.

        Raises:
            PSTableMissingError: the PS table does not exist and ``ps_create`` is not set.
        """
        if t.ps_url is None:
            return None
        try:
            return connect_ps(t)
        except PSClientError as e:
            logger.warning("table %s: parameter server not usable at start (%s); no warm-up, "
                           "the feed keeps trying to connect", t.name, e)
            return None

    def _prepare_feed(self, t: TableConfig, ps: Any) -> tuple[Any, str | None]:
        """Take the feed cursor, then warm up (a created table only)."""
        if ps is None or self.adopted[t.name]:
            return ps, None
        try:
            cursor = ps.changes(None)[1]  # NOTE: before warm-up, so no change falls between
        except PSClientError as e:
            logger.warning("table %s: parameter server unavailable at start (%s); no warm-up, "
                           "the feed connects when it returns", t.name, e)
            ps.close()
            return None, None
        warm(t, self.tables[t.name], ps)
        return ps, cursor

    def _write_endpoint(self) -> None:
        host, port = self.address or (None, None)
        info = {"pid": os.getpid(), "host": host, "port": port,
                "url": None if port is None else f"http://{host}:{port}",
                "tables": sorted(self.tables), "started": self._started}
        path = self.state_dir / ENDPOINT_FILE
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(info))
        os.replace(tmp, path)

    @property
    def address(self) -> tuple[str, int] | None:
        """``(host, port)`` of the endpoints, None when disabled."""
        return None if self._http is None else self._http.address

    # -- running ---------------------------------------------------------------------------

    def reap(self) -> dict[str, list[int]]:
        """Free the counter slots of dead processes on every table; pids per table."""
        out: dict[str, list[int]] = {}
        for name, table in self.tables.items():
            pids = table.reap_dead_processes()
            if pids:
                self.reaped[name] = self.reaped.get(name, 0) + len(pids)
                logger.info("table %s: reaped the slots of dead processes %s", name, pids)
                out[name] = pids
        return out

    def serve(self, stop: threading.Event) -> None:
        """Run until ``stop`` is set: reap every ``reap_interval``; then ``stop()``."""
        try:
            while not stop.wait(self.cfg.reap_interval):
                try:
                    self.reap()
                except HostCacheError:
                    logger.exception("reaping dead processes failed")
        finally:
            self.stop()

    @staticmethod
    def _replicas(table: HostCache | SharedMemBlock) -> set[int]:
        return set(table.attached_pids()) - {os.getpid()}

    def snapshot(self) -> list[dict[str, Any]]:
        """Per-table figures for the metrics (node-wide counters, feed state)."""
        out = []
        now = time.monotonic()
        for name, table in list(self.tables.items()):
            try:
                st = table.stats("node")
            except HostCacheError:  # closed by stop() while a scrape ran
                continue
            s: dict[str, Any] = {
                "table": name, "kind": st.kind, "capacity": st.capacity, "size": st.size,
                "lookups": st.lookups, "lookup_keys": st.hits + st.misses, "hits": st.hits,
                "misses": st.misses, "inserts": st.inserts, "evictions": st.evictions,
                "updates": st.updates, "erases": st.erases,
                "replicas": len(self._replicas(table)), "reaped": self.reaped.get(name, 0),
                "hit_rate": st.measured_hit_rate,
            }
            f = self.followers.get(name)
            if f is not None:
                fs = f.state
                s.update(feed_up=int(fs.up), feed_keys=fs.keys_applied, feed_gaps=fs.gaps,
                         feed_errors=fs.errors, feed_polls=fs.polls,
                         feed_poll_seconds=fs.poll_seconds,
                         feed_lag=now - fs.last_ok if fs.last_ok else None,
                         feed_propagation=(list(fs.lag_buckets), fs.lag_count, fs.lag_sum))
            out.append(s)
        return out

    def health(self) -> tuple[bool, dict[str, Any]]:
        """``(ok, body)``: ok when every table is attached and every feed thread alive."""
        tables = {}
        ok = True
        for t in self.cfg.tables:
            table = self.tables.get(t.name)
            attached = table is not None and not table.closed and segment.exists(t.name)
            entry: dict[str, Any] = {"kind": t.kind, "attached": attached,
                                     "adopted": self.adopted.get(t.name, False)}
            ok &= attached
            f = self.followers.get(t.name)
            if f is not None:
                entry.update(feed_alive=f.is_alive(), feed_up=f.state.up,
                             cursor=f.state.cursor)
                ok &= f.is_alive()
            if attached:
                entry["replicas"] = len(self._replicas(table))  # type: ignore[arg-type]
            tables[t.name] = entry
        body: dict[str, Any] = {"status": "ok" if ok else "unhealthy", "pid": os.getpid(),
                                "tables": tables}
        if self.warmer is not None:
            # NOTE: not part of ok: replicas serve either way, compiling what is not warm
            body["compiled"] = self.warmer.state
        return ok, body

    # -- stop ------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop the feeds and endpoints; remove the segments unless ``keep``. Idempotent."""
        self._teardown(remove=not self.cfg.keep, only_created=False)

    def _teardown(self, *, remove: bool, only_created: bool) -> None:
        self._stop.set()
        if self.warmer is not None:
            self.warmer.stop()
        for f in self.followers.values():
            f.join(timeout=10)
        self.followers.clear()
        if self._http is not None:
            self._http.close()
            self._http = None
        for name, table in list(self.tables.items()):
            table.close()
            if remove and not (only_created and self.adopted.get(name)):
                try:
                    segment.unlink(name)
                    logger.info("table %s: removed", name)
                except SegmentNotFoundError:
                    pass
            elif not remove:
                logger.info("table %s: kept on the node", name)
        self.tables.clear()
        (self.state_dir / ENDPOINT_FILE).unlink(missing_ok=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
