"""Real processes: lock-free readers against writers (no torn rows), writers SIGKILLed."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from hostcache import HostCache
from tests.hostcache import workers

CTX = mp.get_context("spawn")


def test_readers_never_see_torn_rows(table_name: str) -> None:
    """Two writer and two reader processes; the writers keep going until the readers have
    made 400 lookups while they wrote (counted, not timed: any machine speed)."""
    key_space = 20_000
    hc = HostCache.create(table_name, capacity=8192, dim=workers.DIM, dtype=torch.float64)
    try:
        keys = torch.arange(key_space)
        hc.insert(keys, workers.encoded_rows(keys, 0))
        out = CTX.Queue()
        go, writers_done = CTX.Event(), CTX.Event()
        reads = CTX.Value("q", 0)
        ready = [CTX.Event() for _ in range(4)]
        writers = [CTX.Process(target=workers.writer, args=(
            table_name, key_space, seed, 300, reads, 400, ready[seed - 1], go, out))
            for seed in (1, 2)]
        readers = [CTX.Process(target=workers.reader, args=(
            table_name, key_space, seed, writers_done, reads, ready[seed - 1], go, out))
            for seed in (3, 4)]
        for p in writers + readers:
            p.start()
        for ev in ready:
            assert ev.wait(120)
        go.set()
        results = [out.get(timeout=300) for _ in writers]
        writers_done.set()
        results += [out.get(timeout=120) for _ in readers]
        for p in writers + readers:
            p.join(timeout=30)
            assert p.exitcode == 0
        read = [r for r in results if r[0] == "reader"]
        assert sum(r[3] for r in read) == 0  # no torn or foreign row
        assert sum(r[1] for r in read) >= 400 and sum(r[2] for r in read) > 0
        assert all(r[1] >= 300 for r in results if r[0] == "writer")
        # the main process's own lookups agree: every hit row encodes its key
        values, hit = hc.lookup(keys)
        assert workers.count_torn(keys, values, hit) == 0
    finally:
        hc.close()
        HostCache.unlink(table_name)


def test_writer_killed_inside_the_lock_leaves_a_usable_table(table_name: str) -> None:
    key_space = 50_000
    hc = HostCache.create(table_name, capacity=16_384, dim=workers.DIM, dtype=torch.float64)
    try:
        kills = 0  # deaths inside a write section (the writer pid still in the header)
        for _ in range(40):
            if kills == 5:
                break
            ready = CTX.Event()
            p = CTX.Process(target=workers.busy_writer, args=(table_name, key_space, ready))
            p.start()
            # NOTE: the first child may compile the table's loops: minutes on a busy machine
            assert ready.wait(timeout=600), f"the writer never wrote (exit code {p.exitcode})"
            deadline = time.monotonic() + 60
            # wait until the child is inside a write section, then kill it there
            while hc.writer_pid != p.pid and time.monotonic() < deadline:
                time.sleep(0.001)
            assert hc.writer_pid == p.pid
            os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=30)
            assert p.exitcode == -signal.SIGKILL
            # the signal may land just after the child left its section (between two
            # sections); only a death inside one leaves its pid behind to be repaired
            kills += hc.writer_pid == p.pid
            started = time.monotonic()
            keys = torch.arange(100)
            hc.insert(keys, workers.encoded_rows(keys, 7))  # takes the lock, repairs
            assert time.monotonic() - started < 1.0
            assert hc.writer_pid == 0
            audit = hc.audit()
            assert audit.mid_write == 0  # the repair left no slot mid-write
            probe = torch.arange(key_space)
            values, hit = hc.lookup(probe)
            assert workers.count_torn(probe, values, hit) == 0
            assert hit[:100].all()
            assert hc.stats().size == audit.size == audit.occupied
        assert kills == 5
        assert hc.repairs == kills
    finally:
        hc.close()
        HostCache.unlink(table_name)


@pytest.mark.parametrize("method", ["spawn"])
def test_handle_passes_to_a_spawned_process_by_name(table_name: str, method: str) -> None:
    hc = HostCache.create(table_name, capacity=64, dim=workers.DIM, dtype=torch.float64)
    try:
        keys = torch.arange(10)
        hc.insert(keys, workers.encoded_rows(keys, 3))
        ctx = mp.get_context(method)
        with ctx.Pool(1) as pool:
            counts = pool.apply(_lookup_count, (hc,))
        assert counts == 10
    finally:
        hc.close()
        HostCache.unlink(table_name)


def _lookup_count(hc: HostCache) -> int:
    _, hit = hc.lookup(torch.arange(20))
    hc.close()
    return int(hit.sum())


def test_fork_rebuilds_lock_and_counters(table_name: str) -> None:
    hc = HostCache.create(table_name, capacity=64, dim=workers.DIM, dtype=torch.float64)
    try:
        assert hc.slot_pids() == [os.getpid()]
        pid = os.fork()
        if pid == 0:  # child: use the inherited handle, then leave without cleanup
            code = 1
            try:
                keys = torch.arange(5)
                hc.insert(keys, workers.encoded_rows(keys, 1))
                # a counter slot of its own beside the parent's
                code = 0 if sorted(hc.slot_pids()) == sorted([os.getppid(), os.getpid()]) \
                    else 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        _, hit = hc.lookup(torch.arange(5))
        assert hit.all()
        assert hc.stats().inserts == 5  # the dead child's slot still counts node-wide
    finally:
        hc.close()
        HostCache.unlink(table_name)
