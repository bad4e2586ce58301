"""``layer.close()`` (and ``with NVEmbedding(...) as layer:``) releases a layer's tables at
once, on every layer type, and every call after it raises ``LayerClosedError``."""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

import psclient
from gpu import GPUError, LayerClosedError, LayerType, NVEmbedding, NVEmbeddingBag
from hostcache import HostCache
from tests.conftest import fresh_name
from tests.gpu import layer_tables
from tests.gpu.layer_tables import DEVICES

ROWS, DIM = 64, 8
CUDA = torch.cuda.is_available()
LAYER_TYPES = [LayerType.GPULayer, LayerType.LinearUVM, LayerType.Hierarchical]
CLASSES = [NVEmbedding, NVEmbeddingBag]
FILL_THREAD = "nvecache-host-fill"  # gpu.stacks.hierarchical's worker


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def weights() -> torch.Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(5))


@contextlib.contextmanager
def tables(layer_type: LayerType, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Layer arguments over tables the test owns (closed and removed at the end)."""
    with layer_tables.tables(layer_type, tmp_path, weights()) as kw:
        yield kw


def build(cls: type, layer_type: LayerType, device: str, kw: dict[str, Any]) -> Any:
    return cls(ROWS, DIM, torch.float32, layer_type, device=device, **kw)


def lookup(layer: Any, keys: torch.Tensor) -> torch.Tensor:
    return layer(keys.view(-1, 2)) if isinstance(layer, NVEmbeddingBag) else layer(keys)


def calls(layer: Any, device: str) -> dict[str, Callable[[], object]]:
    """Every public call of a layer, with valid arguments."""
    keys = torch.arange(4, device=device)
    values = torch.ones(4, DIM, device=device)
    return {
        "forward": lambda: lookup(layer, keys),
        "update": lambda: layer.update(keys, values),
        "insert": lambda: layer.insert(keys, values),
        "insert_gpu_tier": lambda: layer.insert(keys, values, tier="gpu"),
        "erase": lambda: layer.erase(keys),
        "accumulate": lambda: layer.accumulate(keys, values),
        "tiers": lambda: layer.tiers,
        "clear": layer.clear,
        "flush": layer.flush,
        "stats": layer.stats,
        "in_gpu_cache": lambda: layer.in_gpu_cache(keys),
        "synchronize": layer.synchronize,
    }


def assert_closed(layer: Any, device: str) -> None:
    for name, call in calls(layer, device).items():
        with pytest.raises(LayerClosedError, match="was closed.*build a new layer") as e:
            call()
        assert isinstance(e.value, GPUError), name
    assert "closed" in repr(layer)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("layer_type", LAYER_TYPES)
def test_every_call_after_close_raises_layer_closed(tmp_path: Path, device: str,
                                                    layer_type: LayerType, cls: type) -> None:
    with tables(layer_type, tmp_path) as kw:
        layer = build(cls, layer_type, device, kw)
        keys = torch.arange(4, 8, device=device)  # NOTE: not the keys the calls write
        want = lookup(layer, keys).clone()
        for call in calls(layer, device).values():
            call()  # every one works while the layer is open
        assert "closed" not in repr(layer)
        layer.close()
        assert_closed(layer, device)
        # NOTE: a new layer over the same tables serves again (the caller's stay open)
        again = build(cls, layer_type, device, kw)
        if layer_type is not LayerType.GPULayer:  # update/insert above wrote these rows
            torch.testing.assert_close(lookup(again, keys), want)
        again.close()


@pytest.mark.parametrize("layer_type", LAYER_TYPES)
def test_close_is_idempotent_and_releases_the_stack_at_once(tmp_path: Path, device: str,
                                                            layer_type: LayerType) -> None:
    """The second close is a no-op; the first already dropped the layer's stack (its GPU
    cache, a GPULayer's own table) without waiting for the garbage collector."""
    with tables(layer_type, tmp_path) as kw:
        layer = build(NVEmbedding, layer_type, device, kw)
        layer(torch.arange(32, device=device))
        stack = weakref.ref(layer._tiers)
        if device == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
        layer.close()
        assert stack() is None
        if device == "cuda":
            # NOTE: the GPULayer's table, or the 16-slot cache: at least the cache's rows
            assert torch.cuda.memory_allocated() <= before - 16 * DIM * 4
        layer.close()
        assert_closed(layer, device)


@pytest.mark.parametrize("layer_type", LAYER_TYPES)
def test_with_closes_the_layer_on_exit_and_on_an_exception(tmp_path: Path, device: str,
                                                           layer_type: LayerType) -> None:
    keys = torch.arange(4, device=device)
    with tables(layer_type, tmp_path) as kw:
        with build(NVEmbeddingBag, layer_type, device, kw) as layer:
            assert lookup(layer, keys).shape == (2, DIM)
        assert_closed(layer, device)
        with pytest.raises(RuntimeError, match="the caller's"):
            with build(NVEmbedding, layer_type, device, kw) as failing:
                failing(keys)
                raise RuntimeError("the caller's error")
        assert_closed(failing, device)


def test_a_host_cache_attached_by_name_is_detached_at_once(tmp_path: Path,
                                                           device: str) -> None:
    """What ``hostcache rm`` counts (the table's attached processes, one entry per handle)
    drops at close for the layer's own handle; a HostCache passed in stays open."""
    name = fresh_name()
    me = os.getpid()
    with HostCache.create(name, capacity=256, dim=DIM, ways=4) as hc:
        try:
            hc.insert(torch.arange(4), weights()[:4])
            by_name = build(NVEmbedding, LayerType.Hierarchical, device,
                            {"host_cache": name, "gpu_cache_size": 16 * 64})
            passed = build(NVEmbedding, LayerType.Hierarchical, device,
                           {"host_cache": hc, "gpu_cache_size": 16 * 64})
            keys = torch.arange(4, device=device)
            assert torch.equal(by_name(keys), passed(keys))
            assert hc.attached_pids().count(me) == 2  # the test's handle and the layer's
            by_name.close()
            assert hc.attached_pids().count(me) == 1
            passed.close()
            assert hc.attached_pids().count(me) == 1
            values, hit = hc.lookup(keys.cpu())  # the caller's handle still serves
            assert bool(hit.all()) and torch.equal(values, weights()[:4])
        finally:
            HostCache.unlink(name)


def open_fds_under(path: Path) -> int:
    """Files under ``path`` this process holds open (the LMDB environment's)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith(str(path)):
                count += 1
    return count


def test_a_parameter_server_connected_from_a_file_url_is_closed(tmp_path: Path,
                                                                device: str) -> None:
    name = fresh_name()
    store = tmp_path / name
    with psclient.connect(f"file://{store}", table=name, dim=DIM, dtype=torch.float32) as ps:
        ps.load(weights(), progress=False)
    assert open_fds_under(store) == 0
    layer = build(NVEmbedding, LayerType.Hierarchical, device,
                  {"storage": f"file://{store}", "table": name, "gpu_cache_size": 16 * 64})
    keys = torch.arange(4, device=device)
    assert torch.equal(layer(keys).cpu(), weights()[:4])
    assert open_fds_under(store) > 0
    layer.close()
    assert open_fds_under(store) == 0
    assert_closed(layer, device)


@pytest.mark.redis
def test_a_parameter_server_connected_from_a_redis_url_is_closed(redis_url: str,
                                                                 device: str) -> None:
    name = fresh_name()
    client_name = f"close-{name}"
    admin = redis.Redis.from_url(redis_url)

    def connections() -> int:
        return sum(c.get("name") == client_name for c in admin.client_list())

    with psclient.connect(redis_url, table=name, dim=DIM, dtype=torch.float32) as ps:
        ps.load(weights(), progress=False)
    try:
        url = f"{redis_url}?client_name={client_name}"
        layer = build(NVEmbedding, LayerType.Hierarchical, device,
                      {"storage": url, "table": name, "gpu_cache_size": 16 * 64})
        keys = torch.arange(4, device=device)
        assert torch.equal(layer(keys).cpu(), weights()[:4])
        assert connections() > 0
        layer.close()
        assert connections() == 0
        assert_closed(layer, device)
    finally:
        psclient.connect(redis_url, table=name).drop()
        admin.close()


def test_the_host_fill_worker_is_gone_after_close(tmp_path: Path, device: str) -> None:
    def workers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == FILL_THREAD}

    before = workers()
    with tables(LayerType.Hierarchical, tmp_path) as kw:
        layer = build(NVEmbedding, LayerType.Hierarchical, device, kw)
        layer(torch.arange(ROWS, device=device))  # misses read from the PS fill the host
        started = workers() - before
        assert len(started) == 1
        layer.close()
        assert not any(t.is_alive() for t in started)
        with pytest.raises(LayerClosedError):
            layer(torch.arange(ROWS, device=device))
        assert workers() - before == set()
        # NOTE: the fills queued before the close were made (drained, then stopped)
        _, hit = kw["host_cache"].lookup(torch.arange(ROWS), count=False)
        assert int(hit.sum()) > 0


class _Model(torch.nn.Module):
    def __init__(self, emb: NVEmbedding, bag: NVEmbeddingBag) -> None:
        super().__init__()
        self.emb, self.bag = emb, bag

    def forward(self, keys: torch.Tensor) -> torch.Tensor:
        return self.emb(keys).sum(1) + self.bag(keys)


@pytest.mark.parametrize("layer_type", [LayerType.GPULayer, LayerType.LinearUVM])
def test_a_compiled_model_raises_once_its_layer_is_closed(tmp_path: Path, device: str,
                                                          layer_type: LayerType) -> None:
    """The op path (torch.compile) raises too; on CUDA a GPULayer's lookup compiled into a
    CUDA graph is not replayed after the close."""
    torch._dynamo.reset()
    with tables(layer_type, tmp_path) as kw:
        model = _Model(build(NVEmbedding, layer_type, device, kw),
                       build(NVEmbeddingBag, layer_type, device, kw))
        if device == "cuda":
            compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
        else:  # NOTE: the whole tracing stack without a C++ toolchain for inductor's code
            compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        keys = torch.arange(6, device=device).view(3, 2)
        for _ in range(3):  # on CUDA: warm-up, capture, replays
            torch.testing.assert_close(compiled(keys), model(keys))
        model.emb.close()
        with pytest.raises(LayerClosedError):
            compiled(keys)
        model.bag.close()
        with pytest.raises(LayerClosedError):
            model.bag(keys)
    torch._dynamo.reset()
