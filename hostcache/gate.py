"""Read/write gates: in one process, a write to a linear table waits for the reads in flight.

A linear table (``SharedMemBlock``, a ``gpu.DistMemBlock``, a layer's own tensor) has no
per-row version the way a ``HostCache`` slot has: a lookup that copies a row while a write
replaces it could return half of each. So every process keeps one :class:`TableGate` per
table (found by a key, e.g. the segment's name, so every handle and every layer of the
process over the same table shares it):

* a lookup holds the read side while it reads rows (on the CPU) or enqueues the kernels
  that read them (on CUDA); readers never wait for each other;
* a write holds the write side (new readers wait, the writer waits for the readers inside),
  then runs the gate's drains (a GPU reader registers one that waits for its device's
  queued kernels, so no kernel enqueued before the write still reads the rows), then
  writes, and returns once the rows are in place.

So a lookup that overlaps a write returns each row whole, old or new, and a lookup that
starts after the write returned reads the new rows. NOTE: the gate is process-local: a
write from another process is ordered only by the application (the seed's read-after-write
rule); the invalidation ring still tells every process's GPU caches to drop the rows.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import NamedTuple


class GateState(NamedTuple):
    """A snapshot of a :class:`TableGate`'s counters (:attr:`TableGate.state`)."""

    #: threads inside the read side
    readers: int
    #: threads at the read side that wait for a writer to pass
    readers_waiting: int
    #: writers waiting or writing
    writers: int
    #: whether a writer holds the write side
    writing: bool


class TableGate:
    """Many readers or one writer (writers first: a stream of lookups cannot starve a write).

    ``with gate:`` is the read side (cheap: two short lock holds); :meth:`writing` the write
    side.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._readers = 0
        self._readers_waiting = 0
        self._writers = 0  # waiting or writing
        self._writing = False
        self._drains: dict[Hashable, Callable[[], None]] = {}

    def __enter__(self) -> TableGate:
        # NOTE: the lock's own acquire and release, not the condition's context manager:
        # every lookup passes here, and the Python-level wrappers doubled its cost
        lock = self._lock
        lock.acquire()
        try:
            if self._writers:
                self._readers_waiting += 1
                try:
                    while self._writers:
                        self._cond.wait()
                finally:
                    self._readers_waiting -= 1
            self._readers += 1
        finally:
            lock.release()
        return self

    def __exit__(self, *exc: object) -> None:
        lock = self._lock
        lock.acquire()
        try:
            self._readers -= 1
            if self._readers == 0 and self._writers:
                self._cond.notify_all()
        finally:
            lock.release()

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Hold the write side: no reader inside, every drain run, then the body."""
        with self._cond:
            self._writers += 1
            while self._readers or self._writing:
                self._cond.wait()
            self._writing = True
        try:
            for drain in list(self._drains.values()):
                drain()
            yield
        finally:
            with self._cond:
                self._writers -= 1
                self._writing = False
                self._cond.notify_all()

    @property
    def state(self) -> GateState:
        """The gate's counters now (read under its lock; stale as soon as it returns): for
        monitoring, and for a test to see that another thread reached the gate."""
        with self._cond:
            return GateState(self._readers, self._readers_waiting, self._writers,
                             self._writing)

    def add_drain(self, key: Hashable, drain: Callable[[], None]) -> None:
        """Run ``drain`` before every write (once per ``key``: e.g. one per CUDA device)."""
        with self._cond:
            self._drains.setdefault(key, drain)


_GATES: dict[Hashable, TableGate] = {}
_GATES_LOCK = threading.Lock()


def _forget_gates() -> None:
    global _GATES_LOCK
    # NOTE: a forked child must not inherit a lock or a reader count held by a parent thread
    _GATES.clear()
    _GATES_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_gates)


def gate_for(key: Hashable) -> TableGate:
    """This process's gate of the table named by ``key`` (made on first use, never freed:
    a gate is a few hundred bytes)."""
    with _GATES_LOCK:
        gate = _GATES.get(key)
        if gate is None:
            gate = _GATES[key] = TableGate()
        return gate
