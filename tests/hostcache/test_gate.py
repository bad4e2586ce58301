"""hostcache.gate.TableGate: many readers or one writer, writers first, drains before a write.

Threads hand over through events and the gate's own counters (its public ``state``);
where a thread must be blocked inside the gate, the test waits (bounded) until the gate's
counters say so.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from hostcache.gate import GateState, TableGate

TIMEOUT = 10.0


def _until(pred: Callable[[], bool]) -> None:
    """Wait until ``pred()`` holds (another thread reached a state), or fail."""
    deadline = time.monotonic() + TIMEOUT
    while not pred():
        assert time.monotonic() < deadline, "the other thread never got there"
        time.sleep(0.001)


def _start(fn: Callable[[], None]) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_readers_share_the_gate() -> None:
    gate = TableGate()
    inside = threading.Barrier(3, timeout=TIMEOUT)

    def reader() -> None:
        with gate:
            inside.wait()  # all three readers are inside at once, or this times out

    threads = [_start(reader) for _ in range(2)]
    with gate:
        inside.wait()
    for t in threads:
        t.join(TIMEOUT)
    assert gate.state == GateState(0, 0, 0, False)


def test_a_write_waits_for_the_readers_inside_and_runs_the_drains_first() -> None:
    gate = TableGate()
    log: list[str] = []
    gate.add_drain("dev", lambda: log.append("drain"))
    gate.add_drain("dev", lambda: log.append("second drain of the same key"))

    def writer() -> None:
        with gate.writing():
            log.append("write")

    with gate:
        w = _start(writer)
        _until(lambda: gate.state.writers == 1)  # the writer is waiting at the gate
        assert log == [] and gate.state == GateState(1, 0, 1, False)
        log.append("read done")
    w.join(TIMEOUT)
    assert log == ["read done", "drain", "write"]


def test_a_waiting_writer_goes_before_new_readers() -> None:
    gate = TableGate()
    log: list[str] = []

    def writer() -> None:
        with gate.writing():
            log.append("write")

    def late_reader() -> None:
        with gate:
            log.append("late read")

    with gate:
        w = _start(writer)
        _until(lambda: gate.state.writers == 1)
        r = _start(late_reader)
        # both wait on the gate: the writer for this reader, the late reader for the writer
        _until(lambda: gate.state.readers_waiting == 1)
        assert gate.state == GateState(1, 1, 1, False)
        log.append("first read done")
    w.join(TIMEOUT)
    r.join(TIMEOUT)
    assert log == ["first read done", "write", "late read"]
    assert gate.state == GateState(0, 0, 0, False)


def test_a_reader_that_raises_leaves_the_gate() -> None:
    gate = TableGate()
    try:
        with gate:
            raise ValueError("lookup failed")
    except ValueError:
        pass
    assert gate.state.readers == 0
    with gate.writing():  # would wait forever on a leaked reader
        assert gate.state == GateState(0, 0, 1, True)
