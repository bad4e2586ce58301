"""Host-cache work no lookup waits for, run in order on one worker thread.

A Hierarchical lookup that read rows from the parameter server offers them to the shared
host cache, and one that hit the host cache from the GPU reports those hits to the host
cache's eviction policy. Neither changes what the lookup returns, and both cost more than
the rest of a small lookup (the host cache's insert plans on the CPU), so the lookup hands
them to this worker and returns.

The worker hands each handler its queued items in one call (handlers in the order their
first item came, each handler's items in submission order). A host-cache insert costs
about as much for a hundred rows as for a thousand, and the worker shares the GIL with
the lookups, so it gathers before it runs: once work arrives it waits until
``batch_weight`` (the submissions' summed weights: rows) have queued or ``linger_s`` has
passed, then takes everything queued. A worker that falls behind catches up by merging,
and its backlog stays one batch.

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
import queue
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
_FLUSH = object()  # queued by drain(): run what is queued now, without lingering


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
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._outstanding = 0
        self._idle = threading.Condition()
        _LIVE.add(self)

    def submit(self, handler: Handler, item: Any, weight: int = 1) -> None:
        """Have the worker call ``handler([..., item, ...])`` (merged with other queued
        items of the same handler); ``weight`` counts toward ``batch_weight``."""
        with self._idle:
            if self._thread is None or self._pid != os.getpid():
                # NOTE: a forked child has the queue but not the thread: start its own
                self._queue = queue.SimpleQueue()
                self._outstanding = 0
                self._thread = threading.Thread(target=self._run, name=self._name,
                                                daemon=True)
                self._pid = os.getpid()
                self._thread.start()
            self._outstanding += 1
        self._queue.put((handler, item, weight))

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far has run (at most ``timeout`` seconds);
        returns whether it has."""
        with self._idle:
            if self._pid != os.getpid():
                return True
            if self._outstanding:
                self._queue.put(_FLUSH)  # NOTE: cut the worker's linger short
            return self._idle.wait_for(lambda: self._outstanding == 0, timeout)

    def close(self) -> None:
        """Drain, then stop the worker (a later submission starts a new one)."""
        self.drain()
        with self._idle:
            thread = self._thread if self._pid == os.getpid() else None
            q = self._queue  # NOTE: this worker's queue (a later submission makes another)
            self._thread = None
        if thread is not None:
            q.put(None)
            thread.join()

    def _gather(self) -> list[Any]:
        """The next batch: what is queued once ``batch_weight`` has come, ``linger_s`` has
        passed since the first item, or a flush or stop came."""
        q = self._queue
        batch = [q.get()]
        deadline = time.monotonic() + self._linger_s
        while True:
            while not q.empty():
                batch.append(q.get_nowait())
            if any(job is None or job is _FLUSH for job in batch):
                return batch
            left = deadline - time.monotonic()
            if sum(job[2] for job in batch) >= self._batch_weight or left <= 0:
                return batch
            try:
                batch.append(q.get(timeout=left))
            except queue.Empty:
                return batch

    def _run(self) -> None:
        while True:
            batch = self._gather()
            stop = None in batch  # NOTE: close() drained first: nothing else comes with it
            jobs = [job for job in batch if job is not None and job is not _FLUSH]
            merged: dict[Handler, list[Any]] = {}
            for handler, item, _ in jobs:
                merged.setdefault(handler, []).append(item)
            for handler, items in merged.items():
                try:
                    handler(items)
                except Exception:  # noqa: BLE001  (best effort: log, keep serving)
                    logger.exception("%s: host-cache work failed (the rows stay in the "
                                     "parameter server)", self._name)
            with self._idle:
                self._outstanding -= len(jobs)
                if self._outstanding == 0:
                    self._idle.notify_all()
            if stop:
                return
