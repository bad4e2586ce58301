"""Host-cache work no lookup waits for, run in order on one worker thread.

A Hierarchical lookup that read rows from the parameter server offers them to the shared
host cache, and one that hit the host cache from the GPU reports those hits to the host
cache's eviction policy. Neither changes what the lookup returns, and both cost more than
the rest of a small lookup (the host cache's insert plans on the CPU), so the lookup hands
them to this worker and returns.

The worker hands each handler its queued items in one call (handlers in the order their
first item came, each handler's items in submission order). A host-cache insert costs
hardly more for many rows than for few, and the worker shares the GIL with the lookups,
so it gathers before it runs: once work arrives it waits until
``batch_weight`` (the submissions' summed weights: rows) have queued or ``linger_s`` has
passed, then takes everything queued. A submission wakes the worker only when it starts a
batch or completes one, so a lingering worker does not take the GIL for each one. A
worker that falls behind catches up by merging, and its backlog stays one batch.

Safety does not depend on when a fill runs: a fill carries the change-feed cursor taken
before its rows were read (``since``) and the host cache refuses it for any key announced
after that cursor, so a fill that runs late only refuses more (merged fills take the
earliest cursor). Failures are logged, never raised into a later lookup (a fill is best
effort: the row is still in the parameter server). :meth:`HostFiller.drain` waits for
everything submitted so far: the layer's ``flush()``, ``stats()``, ``clear()`` and
``close()`` call it.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

#: how long interpreter exit waits for a worker's queued fills
_EXIT_WAIT_S = 10.0
_LIVE: weakref.WeakSet[HostFiller] = weakref.WeakSet()


@atexit.register
def _finish_at_exit() -> None:
    """At interpreter exit, let every worker finish what was queued, then stop it: a
    worker still inside a torch op while the interpreter tears down aborts the process
    ("terminate called without an active exception"), and its fills are lost."""
    for filler in list(_LIVE):
        if filler.drain(_EXIT_WAIT_S):
            filler.close()


Handler = Callable[[list[Any]], None]


class _Worker:
    """One worker thread and what waits for it (a stopped worker's state stays its own:
    a submission racing a close starts another)."""

    def __init__(self, name: str, batch_weight: int, linger_s: float) -> None:
        self.cond = threading.Condition()
        self.items: list[tuple[Handler, Any]] = []
        self.weight = 0
        self.outstanding = 0  # submitted and not yet run
        self.flush = False
        self.stop = False
        self._batch_weight, self._linger_s = batch_weight, linger_s
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def add(self, handler: Handler, item: Any, weight: int) -> bool:
        """Queue an item; False if this worker was told to stop (start another)."""
        with self.cond:
            if self.stop:
                return False
            self.items.append((handler, item))
            self.weight += weight
            self.outstanding += 1
            # NOTE: wake the worker to start a batch or to end one, not for every item
            if len(self.items) == 1 or self.weight >= self._batch_weight:
                self.cond.notify_all()
            return True

    def _take(self) -> tuple[list[tuple[Handler, Any]], bool]:
        """The next batch (under the lock): what is queued once ``batch_weight`` has come,
        ``linger_s`` has passed since its first item, or a flush or stop came."""
        cond = self.cond
        while not self.items and not self.stop:
            cond.wait()
        deadline = time.monotonic() + self._linger_s
        while not (self.flush or self.stop or self.weight >= self._batch_weight):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            cond.wait(left)
        batch, self.items, self.weight, self.flush = self.items, [], 0, False
        return batch, self.stop

    def _run(self) -> None:
        while True:
            with self.cond:
                batch, stop = self._take()
            merged: dict[Handler, list[Any]] = {}
            for handler, item in batch:
                merged.setdefault(handler, []).append(item)
            for handler, items in merged.items():
                try:
                    handler(items)
                except Exception:  # noqa: BLE001  (best effort: log, keep serving)
                    logger.exception("%s: host-cache work failed (the rows stay in the "
                                     "parameter server)", self.thread.name)
            with self.cond:
                self.outstanding -= len(batch)
                if self.outstanding == 0:
                    self.cond.notify_all()
                if stop and not self.items:
                    return

    def drain(self, timeout: float | None) -> bool:
        with self.cond:
            if self.outstanding:
                self.flush = True  # NOTE: cut the worker's linger short
                self.cond.notify_all()
            return self.cond.wait_for(lambda: self.outstanding == 0, timeout)

    def finish(self) -> None:
        with self.cond:
            self.stop = True
            self.cond.notify_all()
        self.thread.join()


class HostFiller:
    """One worker thread (started at the first submission) and its queue.

    Args:
        name: The worker thread's name.
        batch_weight: Run as soon as submissions of this summed weight have queued.
        linger_s: Else run this long after the first of them came.
    """

    def __init__(self, name: str, batch_weight: int = 1, linger_s: float = 0.0) -> None:
        self._name = name
        self._batch_weight, self._linger_s = batch_weight, linger_s
        self._lock = threading.Lock()
        self._worker: _Worker | None = None
        self._pid = 0
        _LIVE.add(self)

    def submit(self, handler: Handler, item: Any, weight: int = 1) -> None:
        """Have the worker call ``handler([..., item, ...])`` (merged with other queued
        items of the same handler); ``weight`` counts toward ``batch_weight``."""
        if self._pid != os.getpid():
            # NOTE: a forked child has the parent's state but not its thread (nor, maybe,
            # a lock a parent thread held): start afresh
            self._lock = threading.Lock()
            self._worker = None
            self._pid = os.getpid()
        while True:
            with self._lock:
                worker = self._worker
                if worker is None:
                    worker = self._worker = _Worker(self._name, self._batch_weight,
                                                    self._linger_s)
            if worker.add(handler, item, weight):
                return

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far has run (at most ``timeout`` seconds);
        returns whether it has."""
        worker = self._worker if self._pid == os.getpid() else None
        return worker is None or worker.drain(timeout)

    def close(self) -> None:
        """Drain, then stop the worker (a later submission starts a new one)."""
        self.drain()
        if self._pid != os.getpid():
            return
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.finish()
