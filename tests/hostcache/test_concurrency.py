"""Real processes: lock-free readers against writers (no torn rows), writers SIGKILLed."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from hostcache import HostCache, layout

from . import workers

CTX = mp.get_context("spawn")


def test_readers_never_see_torn_rows(table_name: str) -> None:
    key_space = 20_000
    hc = HostCache.create(table_name, capacity=8192, dim=workers.DIM, dtype=torch.float64)
    try:
        keys = torch.arange(key_space)
        hc.insert(keys, workers.encoded_rows(keys, 0))
        out = CTX.Queue()
        specs = [(workers.writer, 1), (workers.writer, 2), (workers.reader, 3), (workers.reader, 4)]
        events = [CTX.Event() for _ in specs]
        procs = [
            CTX.Process(target=fn, args=(table_name, 3.0, key_space, seed, ev, out))
            for (fn, seed), ev in zip(specs, events, strict=True)
        ]
        for p in procs:
            p.start()
        results = [out.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
        readers = [r for r in results if r[0] == "reader"]
        reads = sum(r[1] for r in readers)
        hits = sum(r[2] for r in readers)
        torn = sum(r[3] for r in readers)
        assert torn == 0
        assert reads >= 1_000_000 and hits > 0
        assert all(r[1] > 0 for r in results if r[0] == "writer")
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
        header = hc._live().header
        kills = 0  # deaths inside a write section (the writer pid still in the header)
        for _ in range(40):
            if kills == 5:
                break
            p = CTX.Process(target=workers.busy_writer, args=(table_name, key_space))
            p.start()
            deadline = time.monotonic() + 60
            # wait until the child is inside a write section, then kill it there
            while int(header[layout.W_WRITER_PID]) != p.pid and time.monotonic() < deadline:
                time.sleep(0.001)
            assert int(header[layout.W_WRITER_PID]) == p.pid
            os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=30)
            assert p.exitcode == -signal.SIGKILL
            # the signal may land just after the child left its section (between two
            # sections); only a death inside one leaves its pid behind to be repaired
            kills += int(header[layout.W_WRITER_PID]) == p.pid
            started = time.monotonic()
            keys = torch.arange(100)
            hc.insert(keys, workers.encoded_rows(keys, 7))  # takes the lock, repairs
            assert time.monotonic() - started < 1.0
            assert int(header[layout.W_WRITER_PID]) == 0
            versions = hc._versions
            assert not bool(((versions & 1) == 1).any())
            probe = torch.arange(key_space)
            values, hit = hc.lookup(probe)
            assert workers.count_torn(probe, values, hit) == 0
            assert hit[:100].all()
            assert hc.stats().size == int((hc._keys != layout.EMPTY_KEY).sum())
        assert kills == 5
        assert int(header[layout.W_REPAIRS]) == kills
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
        parent_slot = hc._slot
        pid = os.fork()
        if pid == 0:  # child: use the inherited handle, then leave without cleanup
            code = 1
            try:
                keys = torch.arange(5)
                hc.insert(keys, workers.encoded_rows(keys, 1))
                code = 0 if hc._slot != parent_slot else 3
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
