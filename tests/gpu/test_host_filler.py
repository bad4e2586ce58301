"""gpu.host_filler: the Hierarchical layer's host-cache work off the lookup's path: run
in submission order, drained by flush/stats, failures logged; fills a Hierarchical
lookup hands it reach the host cache, and never win over a later write."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from gpu import LayerType, NVEmbedding
from gpu.host_filler import HostFiller

from .test_layers import DEVICES, DIM, ROWS, stack


def test_work_runs_in_order_and_drain_waits_for_it() -> None:
    filler = HostFiller("test-filler")
    gate, done = threading.Event(), []
    filler.submit(gate.wait)  # the worker waits here: nothing after it can run yet
    filler.submit(done.append, 1)
    filler.submit(done.append, 2)
    assert done == []
    gate.set()
    filler.drain()
    assert done == [1, 2]
    filler.close()
    filler.submit(done.append, 3)  # a new worker after close
    filler.drain()
    assert done == [1, 2, 3]
    filler.close()


def test_a_failing_fill_is_logged_and_the_next_ones_run(caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    filler = HostFiller("test-filler")
    done: list[int] = []

    def boom() -> None:
        raise RuntimeError("host cache closed")

    with caplog.at_level(logging.ERROR, logger="gpu.host_filler"):
        filler.submit(boom)
        filler.submit(done.append, 7)
        filler.drain()
    assert done == [7]
    assert "host-cache fill failed" in caplog.text and "host cache closed" in caplog.text
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
    """Fills wait behind a blocked worker while the layer writes new rows for their keys:
    once they run they are refused, and every later lookup serves the written rows."""
    weights = torch.randn(ROWS, DIM)
    with stack(LayerType.Hierarchical, weights, tmp_path, device) as kw:
        hc = kw["host_cache"]
        layer = NVEmbedding(ROWS, DIM, torch.float32, LayerType.Hierarchical, device=device,
                            **kw)
        gate = threading.Event()
        layer._tiers.filler.submit(gate.wait)  # hold the worker: the fills below queue
        keys = torch.tensor([4, 5, 6], device=device)
        assert torch.equal(layer(keys).cpu(), weights[keys.cpu()])
        new = torch.full((3, DIM), 5.0)
        layer.update(keys, new.to(device))
        gate.set()
        layer.flush()
        assert torch.equal(hc.lookup(keys.cpu())[0], new)
        assert torch.equal(layer(keys).cpu(), new)
        layer.close()
