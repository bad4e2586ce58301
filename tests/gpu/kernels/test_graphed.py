"""Work replayed from a CUDA graph (gpu.cuda.graphed), and the LinearUVM admission rounds that
use it: the same results as eager work, with new contents in the same buffers every call,
eager inside someone else's capture, eager for good when a capture fails."""

from __future__ import annotations

import logging

import pytest
import torch

from gpu import LayerType, NVEmbedding, TierConfig
from gpu.cuda.graphed import GraphedCall
from hostcache import SharedMemBlock

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU "
                                 "(torch.cuda.is_available() is False)")]

DEV = torch.device("cuda")


def sorted_doubled(src: torch.Tensor, out: torch.Tensor) -> GraphedCall:
    # NOTE: a sort allocates temporaries: the graph keeps them in its own pool
    return GraphedCall(lambda: out.copy_(torch.sort(src).values * 2), DEV)


def test_replays_follow_new_contents_of_the_same_buffers() -> None:
    gen = torch.Generator(device=DEV).manual_seed(3)
    src = torch.empty(5000, device=DEV)
    out = torch.empty_like(src)
    call = sorted_doubled(src, out)
    graphed = []
    for i in range(5):
        if i == 1:
            assert call.capture()
        src.copy_(torch.rand(5000, device=DEV, generator=gen))
        out.zero_()
        call()
        graphed.append(call.graphed)
        torch.testing.assert_close(out, torch.sort(src).values * 2, rtol=0, atol=0)
    assert graphed == [False, True, True, True, True]


def test_inside_a_callers_capture_the_work_joins_that_graph() -> None:
    src = torch.rand(3000, device=DEV)
    out = torch.empty_like(src)
    call = sorted_doubled(src, out)
    call()
    assert call.capture()
    outer = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        outer.capture_begin()
        assert call.capture()  # no capture inside a capture: the graph it has stays
        call()  # recorded into `outer`, not a replay of its own graph
        outer.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    src.copy_(torch.rand(3000, device=DEV))
    out.zero_()
    outer.replay()
    torch.testing.assert_close(out, torch.sort(src).values * 2, rtol=0, atol=0)


def test_a_capture_that_fails_leaves_the_work_eager_and_random_numbers_working(
        caplog) -> None:
    src = torch.rand(100, device=DEV)
    out = torch.empty_like(src)
    seen = []

    def syncs() -> None:  # a host sync: no graph can hold it
        seen.append(int((src > 0.5).sum()))
        out.copy_(src + 1)

    call = GraphedCall(syncs, DEV)
    call()
    with caplog.at_level(logging.WARNING, logger="gpu.cuda.graphed"):
        assert not call.capture()
    assert any("runs eagerly" in r.getMessage() for r in caplog.records)
    assert not call.graphed
    for _ in range(3):
        # NOTE: torch leaves its generator in capture mode after a failed capture; a
        # draw would raise if it had not been given back its state
        src.copy_(torch.rand(100, device=DEV))
        call()
        torch.testing.assert_close(out, src + 1, rtol=0, atol=0)
        assert seen[-1] == int((src > 0.5).sum())
    assert len(seen) == 4  # every call ran it once (the capture got no further)


ROWS, DIM = 4096, 5
SLOT = 8 + 4 + DIM * 4


def test_linear_rounds_replayed_admit_what_the_cpu_twin_admits(table_name: str) -> None:
    """Many rounds of a warm LinearUVM cache (each a replay of the graph its construction
    captured): the same keys cached as on the CPU after every round, rows equal to the
    table's."""
    mb = SharedMemBlock.create(table_name, num_rows=ROWS, dim=DIM)
    try:
        mb.write(torch.arange(ROWS), torch.randn(ROWS, DIM))
        tuning = TierConfig(admit_fraction=1.0, round_lookups=2, round_capacities=1e9,
                            warm_round_fraction=1.0, warm_capacities=1.0)
        layers = {d: NVEmbedding(ROWS, DIM, torch.float32, LayerType.LinearUVM, storage=mb,
                                 gpu_cache_size=8 * ROWS * SLOT, device=d, tuning=tuning)
                  for d in ("cpu", "cuda")}
        everything = torch.arange(ROWS)
        for layer in layers.values():  # warm: offered as many keys as it has slots
            for _ in range(8):
                layer(everything.to(layer.device))
            layer.erase(everything.to(layer.device))  # NOTE: not clear(): still warm
        gen = torch.Generator().manual_seed(5)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(6):
                keys = torch.randint(0, ROWS, (300,), generator=gen)
                for _ in range(2):
                    for d, layer in layers.items():
                        assert torch.equal(layer(keys.to(d)).cpu(), mb.tensor[keys])
                cpu, cuda = (layers[d].in_gpu_cache(everything.to(d)).cpu()
                             for d in ("cpu", "cuda"))
                assert torch.equal(cpu, cuda)
                assert cuda[keys].all()
        assert layers["cpu"].stats().gpu == layers["cuda"].stats().gpu
        launches = [e for e in prof.events() if e.name.startswith("cudaGraphLaunch")]
        assert len(launches) == 18  # three per round: its two sorts, its table writes
        for layer in layers.values():
            layer.close()
    finally:
        mb.close()
        SharedMemBlock.unlink(table_name)


def test_the_kept_log_comes_back_empty_after_the_cache_went_cold(table_name: str) -> None:
    """Keys logged by a warm cache's lookups, then a clear and a write of their rows: when
    the cache is warm again and its kept log's round runs, those old rows never go in."""
    mb = SharedMemBlock.create(table_name, num_rows=ROWS, dim=DIM)
    try:
        mb.write(torch.arange(ROWS), torch.zeros(ROWS, DIM))
        tuning = TierConfig(admit_fraction=1.0, round_lookups=1000, round_capacities=1e9,
                            warm_round_fraction=1.0, warm_capacities=1.0)
        layer = NVEmbedding(ROWS, DIM, torch.float32, LayerType.LinearUVM, storage=mb,
                            gpu_cache_size=8 * ROWS * SLOT, device="cuda", tuning=tuning)
        everything = torch.arange(ROWS, device=DEV)
        for _ in range(8):  # a cold round once as many keys as slots: warm after it
            layer(everything)
        k = torch.arange(100, 200, device=DEV)
        layer.erase(k)
        layer(k)  # logged in the warm cache's kept log (no round due)
        layer.clear()  # cold again
        mb.write(k.cpu(), torch.ones(k.numel(), DIM))  # announced: the logged rows are old
        others = everything[(everything < 100) | (everything >= 200)]
        while not bool(layer.in_gpu_cache(others).all()):
            layer(others)  # cold rounds until the cache is full (and warm) again
        layer(others)  # the warm cache's log again: the kept one
        layer.flush()  # its round
        assert not layer.in_gpu_cache(k).any()
        assert torch.equal(layer(k).cpu(), torch.ones(k.numel(), DIM))
        layer.close()
    finally:
        mb.close()
        SharedMemBlock.unlink(table_name)
