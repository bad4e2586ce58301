"""gpu.stacks.misses.host_filler: the Hierarchical layer's host-cache work off the lookup's path:
run
in submission order, drained by flush/stats, failures logged; fills a Hierarchical
lookup hands it reach the host cache, and never win over a later write."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading

import pytest
import torch

import psclient
from gpu import LayerType, NVEmbedding, TierConfig
from gpu.stacks.misses.host_filler import HostFiller
from hostcache import HostCache
from tests.gpu.layers.test_layers import DEVICES, DIM, ROWS, stack

#: a layer's host-cache worker that holds its work until flushed (an hour's linger)
HELD = TierConfig(host_linger_s=3600.0, host_batch_keys=1 << 40)


def test_queued_work_is_merged_per_handler_and_drain_waits_for_it() -> None:
    filler = HostFiller("test-filler")
    started, gate, calls = threading.Event(), threading.Event(), []

    def hold(items: list[object]) -> None:
        started.set()
        gate.wait()

    filler.submit(hold, None)
    started.wait()  # the worker is inside its first batch: the rest queues for the next
    for i in range(3):
        filler.submit(calls.append, i)  # calls.append(items): one call per batch
        filler.submit(lambda items: calls.append(("other", items)), i)
    assert calls == []
    gate.set()
    filler.drain()
    assert calls[0] == [0, 1, 2]  # one handler's items together, in submission order
    assert all(c[0] == "other" for c in calls[1:]) and sum(len(c[1]) for c in calls[1:]) == 3
    filler.close()
    filler.submit(calls.append, 3)  # a new worker after close
    filler.drain()
    assert calls[-1] == [3]
    filler.close()


def test_the_worker_lingers_for_a_batch_and_drain_cuts_the_linger_short() -> None:
    """Light submissions wait (the linger is an hour here) and go in as one call when
    drained; submissions reaching the batch weight run without a drain."""
    filler = HostFiller("test-filler", batch_weight=10, linger_s=3600.0)
    calls: list[list[int]] = []
    ran = threading.Event()

    def record(items: list[int]) -> None:
        calls.append(items)
        ran.set()

    for i in range(3):
        filler.submit(record, i, weight=3)  # 9 < 10: the worker keeps waiting
    assert not ran.is_set() and calls == []
    assert filler.drain(timeout=60)
    assert calls == [[0, 1, 2]]
    ran.clear()
    filler.submit(record, 3, weight=4)
    filler.submit(record, 4, weight=6)  # 10: a batch, no drain needed
    assert ran.wait(timeout=60)
    assert calls[1] == [3, 4]
    filler.close()


def test_failing_work_is_logged_and_later_work_runs(caplog: pytest.LogCaptureFixture
                                                     ) -> None:
    filler = HostFiller("test-filler")
    done: list[list[int]] = []
    gate = threading.Event()

    def boom(items: list[object]) -> None:
        raise RuntimeError("host cache closed")

    with caplog.at_level(logging.ERROR, logger="gpu.stacks.misses.host_filler"):
        filler.submit(lambda items: gate.wait(), None)
        filler.submit(boom, None)
        filler.submit(done.append, 7)  # queued in the same batch as the failure
        gate.set()
        filler.drain()
        filler.submit(done.append, 8)  # and a batch after it
        filler.drain()
    assert done == [[7], [8]]
    assert "host-cache work failed" in caplog.text and "host cache closed" in caplog.text
    filler.close()


@pytest.mark.parametrize("device", DEVICES)
def test_parameter_server_rows_reach_the_host_cache_after_flush(tmp_path, device: str
                                                                ) -> None:
    weights = torch.randn(ROWS, DIM)
    with stack(LayerType.Hierarchical, weights, tmp_path, device) as kw:
        hc = kw["host_cache"]
        layer = NVEmbedding(ROWS, DIM, torch.float32, LayerType.Hierarchical, device=device,
                            **kw)
        keys = torch.tensor([3, 9, 17], device=device)
        assert torch.equal(layer(keys).cpu(), weights[keys.cpu()])
        layer.flush()
        assert hc.contains(keys.cpu()).all()
        assert layer.stats().host.inserts == 3
        layer.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_queued_fill_never_wins_over_a_later_write(tmp_path, device: str) -> None:
    """Fills wait in a held worker while the layer writes new rows for their keys: once
    they run they are refused, and every later lookup serves the written rows."""
    weights = torch.randn(ROWS, DIM)
    with stack(LayerType.Hierarchical, weights, tmp_path, device) as kw:
        hc = kw["host_cache"]
        layer = NVEmbedding(ROWS, DIM, torch.float32, LayerType.Hierarchical, device=device,
                            tuning=HELD, **kw)
        keys = torch.tensor([4, 5, 6], device=device)
        assert torch.equal(layer(keys).cpu(), weights[keys.cpu()])
        assert not hc.contains(keys.cpu()).any()  # the fills wait in the worker
        new = torch.full((3, DIM), 5.0)
        layer.update(keys, new.to(device))
        layer.flush()
        assert torch.equal(hc.lookup(keys.cpu())[0], new)
        assert torch.equal(layer(keys).cpu(), new)
        layer.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_queued_fill_of_a_key_erased_meanwhile_is_refused(tmp_path, device: str) -> None:
    """The erase reaches the host cache before the fill (held in the worker) of a key that
    was never cached there: the erase announces it anyway, so the fill is refused and the
    erased key is served as missing."""
    weights = torch.randn(ROWS, DIM)
    with stack(LayerType.Hierarchical, weights, tmp_path, device) as kw:
        hc = kw["host_cache"]
        reader = NVEmbedding(ROWS, DIM, torch.float32, LayerType.Hierarchical,
                             device=device, default_row=-1.0, tuning=HELD, **kw)
        writer = NVEmbedding(ROWS, DIM, torch.float32, LayerType.Hierarchical,
                             device=device, **kw)
        keys = torch.tensor([7, 8], device=device)
        assert torch.equal(reader(keys).cpu(), weights[[7, 8]])  # fills queued
        assert not hc.contains(keys.cpu()).any()
        writer.erase(keys)
        reader.flush()
        assert not hc.contains(keys.cpu()).any()
        assert (reader(keys).cpu() == -1.0).all()
        reader.close()
        writer.close()


CHILD = """
import sys, torch, psclient
from gpu import LayerType, NVEmbedding, TierConfig
from hostcache import HostCache
url, table, name = sys.argv[1:4]
ps = psclient.connect(url, table=table)
hc = HostCache.attach(name)
layer = NVEmbedding(ps.size(), ps.dim, torch.float32, LayerType.Hierarchical,
                    host_cache=hc, storage=ps, device="cpu",
                    tuning=TierConfig(host_linger_s=3600.0, host_batch_keys=1 << 40))
layer(torch.tensor([11, 12, 13]))  # its fills wait in the worker (an hour's linger)
assert not hc.contains(torch.tensor([11, 12, 13])).any()
"""


def test_fills_queued_at_interpreter_exit_are_finished(tmp_path, table_name: str) -> None:
    """A process that exits without closing its layer completes its queued fills and
    exits cleanly (without the exit hook the fills were lost, or the process aborted when
    the worker ran a torch op while the interpreter tore down)."""
    url = f"file://{tmp_path}/ps"
    ps = psclient.connect(url, table="t", dim=DIM, dtype=torch.float32)
    ps.load(torch.randn(ROWS, DIM), progress=False)
    hc = HostCache.create(table_name, capacity=4 * ROWS, dim=DIM)
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, url, "t", table_name],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert hc.contains(torch.tensor([11, 12, 13])).all()
    finally:
        hc.close()
        HostCache.unlink(table_name)
        ps.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gpu_read_keys", [1, 1 << 20])
def test_host_tier_reads_are_counted_at_the_node_whichever_side_reads(
        tmp_path, device: str, gpu_read_keys: int) -> None:
    """The host cache's misses of a lookup are read by the GPU kernel (from
    ``host_gpu_read_keys`` keys on, CUDA) or on the CPU: either way the layer's host tier
    and the node's counters see the same hits and misses once flushed."""
    weights = torch.randn(ROWS, DIM)
    with stack(LayerType.Hierarchical, weights, tmp_path, device) as kw:
        hc = kw["host_cache"]
        hc.insert(torch.arange(6), weights[:6])  # 6 of the 12 keys below are in the host cache
        layer = NVEmbedding(ROWS, DIM, torch.float32, LayerType.Hierarchical, device=device,
                            tuning=TierConfig(host_gpu_read_keys=gpu_read_keys), **kw)
        before = hc.stats()
        keys = torch.arange(12, device=device)
        assert torch.equal(layer(keys).cpu(), weights[:12])
        keys2 = torch.cat([keys, keys, torch.tensor([ROWS + 5], device=device)])
        layer2 = NVEmbedding(ROWS, DIM, torch.float32, LayerType.Hierarchical, device=device,
                             default_row=0.0, **kw)
        layer.flush()
        stats, node = layer.stats(), hc.stats()
        host, ps = stats.host, stats.storage
        assert host is not None and (host.hits, host.misses) == (6, 6)
        assert (node.hits - before.hits, node.misses - before.misses) == (6, 6)
        # the tiers add up: every GPU miss (distinct) went to the host cache, every host
        # miss to the parameter server
        assert (stats.gpu.hits, stats.gpu.misses) == (0, 12)
        assert ps is not None and (ps.hits, ps.misses) == (6, 0)
        # duplicates and a key no tier has: counted once per distinct key below the GPU
        layer2(keys2)
        s2 = layer2.stats()
        assert s2.host is not None and s2.storage is not None
        assert s2.gpu.hits + s2.gpu.misses == keys2.numel()
        assert s2.host.hits + s2.host.misses == 13  # the 12 keys and the unknown one
        assert (s2.storage.hits, s2.storage.misses) == (s2.host.misses - 1, 1)
        assert s2.default_rows == 1
        got = layer2(keys2).cpu()
        assert torch.equal(got[:24], weights[:12].repeat(2, 1))
        assert torch.equal(got[24], torch.zeros(DIM))
        layer2.close()
        layer.close()


# --- the worker's own CPU work: numpy, never torch's intra-op threads ---------------------


@pytest.mark.parametrize(("dtype", "width"), [(torch.float32, 7), (torch.float16, 9),
                                              (torch.bfloat16, 128), (torch.uint8, 136)])
def test_fills_are_joined_as_torch_cat_joins_them(dtype: torch.dtype, width: int) -> None:
    from gpu.stacks.misses.resolver import _concat_rows

    g = torch.Generator().manual_seed(width)
    blocks = [torch.randn(n, width, generator=g).mul(50).to(dtype) for n in (3, 0, 1, 5)]
    got = _concat_rows(blocks)
    assert got.dtype == dtype and torch.equal(got, torch.cat(blocks))
    assert _concat_rows(blocks[:1]) is blocks[0]  # one fill: no copy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_several_fills_reach_the_host_cache_as_one_insert(table_name: str,
                                                          dtype: torch.dtype) -> None:
    from gpu.layer_config import InsertPolicy
    from gpu.stacks.misses.counters import MissCounters
    from gpu.stacks.misses.resolver import Resolver

    rows = torch.randn(30, DIM).to(dtype)
    with HostCache.create(table_name, capacity=256, dim=DIM, dtype=dtype) as hc:
        try:
            res = Resolver(hc, None, None, dtype, DIM, InsertPolicy(), HostFiller("t"), 8,
                           MissCounters())
            keys = torch.arange(100, 130)
            hc.insert(keys[7:8], torch.zeros(1, DIM, dtype=dtype))  # already cached: kept
            cursor = hc.change_cursor
            hc.announce(keys[20:21])  # changed elsewhere after the earliest fill's cursor
            res._fill([(keys[:10], rows[:10], cursor + 5), (keys[10:25], rows[10:25], cursor),
                       (keys[25:], rows[25:], cursor + 9)])
            got, hit = hc.lookup(keys)
            assert hit.tolist() == [i != 20 for i in range(30)]  # the announced key refused
            want = rows.clone()
            want[7] = 0  # the row cached before stays
            assert torch.equal(got[hit], want[hit])
        finally:
            HostCache.unlink(table_name)


FAN_OUT = r"""
import os, sys
import numpy as np, torch
torch.set_num_threads(2)  # a team to fan out to, whatever the machine's cores
from gpu.layer_config import InsertPolicy
from gpu.stacks.misses.counters import MissCounters
from gpu.stacks.misses.host_filler import HostFiller
from gpu.stacks.misses.resolver import Resolver, touch_sample
from hostcache import HostCache

def tids():
    return set(os.listdir("/proc/self/task"))

name, rng = sys.argv[1], np.random.default_rng(0)
def rows(n):
    return torch.from_numpy(rng.standard_normal((n, 128), dtype=np.float32))
hc = HostCache.create(name, capacity=40000, dim=128)
try:
    res = Resolver(hc, None, None, torch.float32, 128, InsertPolicy(), HostFiller("t"),
                   1024, MissCounters())
    # small work first: whatever threads the tiers start (the compiled loops' gate) start now
    small = torch.from_numpy(rng.choice(1 << 20, 8, replace=False))
    res._fill([(small, rows(8), 0), (small + 1, rows(8), 0)])
    touch_sample(hc, small, torch.ones(8, dtype=torch.bool), 8, 4)
    before = tids()
    # a 64k-key call's work: ~7k rows filled in four parts, 64k keys' hit flags reported
    keys = rng.choice(1 << 20, 7000, replace=False)
    fills = [(torch.from_numpy(keys[i:i + 1750]), rows(1750), 0) for i in range(0, 7000, 1750)]
    res._fill(fills)
    filled = tids()
    hit = rng.random(65536) < 0.5
    touch_sample(hc, torch.from_numpy(rng.choice(1 << 20, 65536, replace=False)),
                 torch.from_numpy(hit), int(np.count_nonzero(hit)), 1024)
    after = tids()
    torch.cat([v for _, v, _ in fills])  # the control: torch's own join fans out
    print(len(filled - before), len(after - filled), len(tids() - after))
finally:
    hc.close()
    HostCache.unlink(name)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_the_worker_s_fills_and_hit_reports_never_fan_out_to_torch_s_threads(
        table_name: str) -> None:
    """The host-cache worker runs beside the lookups' split reads: its joins and selections
    at a 64k-key call's sizes run on its own thread (numpy), never on torch's intra-op team
    (whose threads appear in /proc the first time torch fans an operation out)."""
    done = subprocess.run([sys.executable, "-c", FAN_OUT, table_name], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    new_in_fill, new_in_report, new_in_control = map(int, done.stdout.split()[-3:])
    assert (new_in_fill, new_in_report) == (0, 0)
    assert new_in_control >= 1, "torch's team existed before the control: nothing was tested"
