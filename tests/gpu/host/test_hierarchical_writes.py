"""A Hierarchical layer's per-tier writes and accumulate, through the public layer API,
against a torch reference, over file:// and Redis parameter servers.

Each tier is read back through its own public API (``ParameterServer.lookup``,
``HostCache.lookup``/``contains``, ``layer.in_gpu_cache``) as well as through the layer:
a write to one tier must leave the others as they were, and a lookup after a write that
reached the host cache or the parameter server must not serve a row the GPU cache kept.
Rows and deltas are small integers, exact in every dtype, so sums compare bit for bit
whatever order a tier adds duplicates in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import psclient
from gpu import BadArgumentError, LayerType, NVEmbedding, NVEmbeddingBag, TierConfig
from hostcache import HostCache
from tests.conftest import fresh_name

ROWS, DIM, KNOWN = 96, 8, 64  # keys >= KNOWN are in no tier at first
CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA,
                                                                reason="needs a CUDA GPU"))]
STORES = ["file", pytest.param("redis", marks=pytest.mark.redis)]
#: every lookup's misses go in at once: a lookup twice puts its keys in the GPU cache
TUNING = TierConfig(admit_batches=1)
DEFAULT = -100.0


def initial(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(-8, 8, (ROWS, DIM), generator=g).to(dtype)


@contextlib.contextmanager
def tables(store: str, tmp_path: Any, request: pytest.FixtureRequest, dtype: torch.dtype,
           *, host: bool = True, ps: bool = True) -> Iterator[tuple[Any, Any]]:
    """``(host cache, parameter server)`` (either may be None), the server holding the
    first ``KNOWN`` rows of :func:`initial`; both removed after."""
    name = fresh_name()
    hc = HostCache.create(name, capacity=1024, dim=DIM, dtype=dtype, ways=8) if host else None
    server = None
    try:
        if ps:
            url = (f"file://{tmp_path}/{name}" if store == "file"
                   else request.getfixturevalue("redis_url"))
            server = psclient.connect(url, table=name, dim=DIM, dtype=dtype)
            server.load(initial(dtype)[:KNOWN], progress=False)
        elif hc is not None:
            hc.insert(torch.arange(KNOWN), initial(dtype)[:KNOWN])
        yield hc, server
    finally:
        if server is not None:
            server.drop()
            server.close()
        if hc is not None:
            hc.close()
            HostCache.unlink(name)


def layer_on(hc: Any, ps: Any, device: str, dtype: torch.dtype,
             cls: type = NVEmbedding, **kw: Any) -> Any:
    return cls(ROWS, DIM, dtype, LayerType.Hierarchical, host_cache=hc, storage=ps,
               device=device, gpu_cache_size=1024 * (DIM * 4 + 12), tuning=TUNING,
               default_row=torch.full((DIM,), DEFAULT), **kw)


def warm(layer: Any, keys: torch.Tensor, device: str) -> None:
    """Look ``keys`` up until the GPU cache holds them (the host cache is filled too)."""
    for _ in range(2):
        layer(keys.to(device))
        layer.flush()
    assert bool(layer.in_gpu_cache(keys.to(device)).all())


def ps_rows(ps: Any, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, found = ps.lookup(keys)
    return rows, found


def host_rows(hc: Any, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return hc.lookup(keys)


@pytest.mark.parametrize("device", DEVICES)
def test_tiers_name_what_the_layer_was_built_with(tmp_path, request, device: str) -> None:
    dtype = torch.float32
    for host, ps, want in [(True, True, ("gpu", "host", "storage")),
                           (True, False, ("gpu", "host")), (False, True, ("gpu", "storage"))]:
        with tables("file", tmp_path, request, dtype, host=host, ps=ps) as (hc, server):
            layer = layer_on(hc, server, device, dtype)
            assert layer.tiers == want
            missing = ({"host", "storage"} - set(want)).pop() if len(want) == 2 else None
            if missing is not None:
                with pytest.raises(BadArgumentError, match="tier"):
                    layer.insert(torch.arange(2), torch.zeros(2, DIM), tier=missing)
            with pytest.raises(BadArgumentError, match="tier"):
                layer.erase(torch.arange(2), tier="disk")
            layer.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_insert_into_one_tier_writes_only_that_tier(tmp_path, request, device: str,
                                                    store: str, dtype: torch.dtype) -> None:
    w = initial(dtype)
    cached = torch.arange(0, 16)  # in every tier
    absent = torch.arange(KNOWN, KNOWN + 8)  # in no tier
    new = (torch.arange(24 * DIM).view(24, DIM) % 16 + 20).to(dtype)
    keys = torch.cat([cached, absent])
    with tables(store, tmp_path, request, dtype) as (hc, ps):
        layer = layer_on(hc, ps, device, dtype)
        dev_keys = keys.to(device)
        default = torch.full((DIM,), DEFAULT, dtype=dtype)
        old = torch.cat([w[cached], default.expand(absent.numel(), DIM)])

        # GPU only: the layer serves the new rows from its cache; host and PS unchanged
        warm(layer, cached, device)
        layer.insert(dev_keys, new.to(device), tier="gpu")
        assert bool(layer.in_gpu_cache(dev_keys).all())
        assert torch.equal(layer(dev_keys).cpu(), new)
        rows, found = ps_rows(ps, keys)
        assert torch.equal(found, keys < KNOWN) and torch.equal(rows[:16], w[cached])
        rows, hit = host_rows(hc, keys)
        assert torch.equal(hit, keys < KNOWN) and torch.equal(rows[:16], w[cached])

        # host only: every GPU cache drops the keys, lookups read the host cache's rows
        layer.erase(dev_keys, tier="gpu")
        assert not bool(layer.in_gpu_cache(dev_keys).any())
        assert torch.equal(layer(dev_keys).cpu(), old)
        warm(layer, cached, device)
        layer.insert(dev_keys, new.to(device), tier="host")
        assert not bool(layer.in_gpu_cache(dev_keys).any())
        rows, hit = host_rows(hc, keys)
        assert bool(hit.all()) and torch.equal(rows, new)
        rows, found = ps_rows(ps, keys)
        assert torch.equal(found, keys < KNOWN) and torch.equal(rows[:16], w[cached])
        assert torch.equal(layer(dev_keys).cpu(), new)

        # storage only: the caches keep what they hold; dropped from them, the new rows
        later = (new + 1).to(dtype)
        layer.insert(dev_keys, later.to(device), tier="storage")
        rows, found = ps_rows(ps, keys)
        assert bool(found.all()) and torch.equal(rows, later)
        rows, hit = host_rows(hc, keys)
        assert bool(hit.all()) and torch.equal(rows, new)
        assert torch.equal(layer(dev_keys).cpu(), new)
        layer.erase(dev_keys, tier="host")
        assert not bool(hc.contains(keys).any())
        assert torch.equal(layer(dev_keys).cpu(), later)
        layer.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("store", STORES)
def test_erase_from_one_tier_drops_only_there(tmp_path, request, device: str,
                                              store: str) -> None:
    dtype = torch.float32
    w = initial(dtype)
    keys = torch.arange(8, 24)
    with tables(store, tmp_path, request, dtype) as (hc, ps):
        layer = layer_on(hc, ps, device, dtype)
        dev_keys = keys.to(device)
        warm(layer, keys, device)
        layer.erase(dev_keys, tier="storage")
        assert not bool(ps_rows(ps, keys)[1].any())
        assert bool(hc.contains(keys).all()) and bool(layer.in_gpu_cache(dev_keys).all())
        assert torch.equal(layer(dev_keys).cpu(), w[keys])
        layer.erase(dev_keys, tier="gpu")  # still in the host cache
        assert torch.equal(layer(dev_keys).cpu(), w[keys])
        layer.erase(dev_keys, tier="host")
        assert not bool(hc.contains(keys).any())
        assert not bool(layer.in_gpu_cache(dev_keys).any())
        assert bool((layer(dev_keys).cpu() == DEFAULT).all())
        # every tier at once (the default)
        other = torch.arange(30, 40)
        warm(layer, other, device)
        layer.erase(other.to(device))
        assert not bool(ps_rows(ps, other)[1].any()) and not bool(hc.contains(other).any())
        assert not bool(layer.in_gpu_cache(other.to(device)).any())
        layer.close()


def reference_add(w: torch.Tensor, keys: torch.Tensor, deltas: torch.Tensor,
                  exists: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows after the add, which keys existed)``: duplicates summed, missing keys not
    written."""
    found = exists[keys]
    out = w.float().clone()
    out.index_add_(0, keys[found], deltas[found].float())
    return out.to(w.dtype), found


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_accumulate_adds_in_every_tier_and_every_replica_reads_the_sums(
        tmp_path, request, device: str, store: str, dtype: torch.dtype) -> None:
    w = initial(dtype)
    exists = torch.arange(ROWS) < KNOWN
    g = torch.Generator().manual_seed(5)
    keys = torch.cat([torch.randint(0, ROWS, (40,), generator=g), torch.tensor([3, 3, 3])])
    deltas = torch.randint(-4, 5, (keys.numel(), DIM), generator=g).to(dtype)
    want, want_found = reference_add(w, keys, deltas, exists)
    look = torch.arange(ROWS)
    with tables(store, tmp_path, request, dtype) as (hc, ps):
        writer = layer_on(hc, ps, device, dtype)
        replica = layer_on(hc, ps, device, dtype)  # another layer over the same tables
        bag = layer_on(hc, ps, device, dtype, cls=NVEmbeddingBag, mode="sum")
        for layer in (writer, replica):
            warm(layer, torch.arange(KNOWN), device)
        found = writer.accumulate(keys.to(device), deltas.to(device))
        assert found.device.type == torch.device(device).type
        assert torch.equal(found.cpu(), want_found)
        expect = torch.where(exists[:, None], want, torch.tensor(DEFAULT, dtype=dtype))
        for layer in (writer, replica):
            assert torch.equal(layer(look.to(device)).cpu(), expect)
        rows, ok = ps_rows(ps, look)
        assert torch.equal(ok, exists) and torch.equal(rows[:KNOWN], want[:KNOWN])
        rows, hit = host_rows(hc, look)
        assert torch.equal(rows[hit], want[hit])
        # a pooled lookup, half of its keys missing the GPU cache, reads the same sums
        even = look[::2].to(device)
        for _ in range(2):
            bag(even, torch.tensor([0, even.numel()], device=device))
        bag.flush()
        assert torch.equal(bag.in_gpu_cache(look.to(device)).cpu(), (look % 2 == 0) & exists)
        offsets = torch.tensor([0, 5, 5, 17, look.numel()])
        pooled = bag(look.to(device), offsets.to(device)).cpu()
        ref = torch.nn.functional.embedding_bag(look, expect.float(), offsets, mode="sum")
        assert torch.equal(pooled, ref.to(dtype))
        for layer in (writer, replica, bag):
            layer.close()


@pytest.mark.parametrize("device", DEVICES)
def test_accumulate_without_a_parameter_server_adds_in_the_host_cache(
        tmp_path, request, device: str) -> None:
    dtype = torch.float32
    w = initial(dtype)
    keys = torch.tensor([1, 2, 2, KNOWN + 1, 5])
    deltas = torch.ones(keys.numel(), DIM)
    want, want_found = reference_add(w, keys, deltas, torch.arange(ROWS) < KNOWN)
    with tables("file", tmp_path, request, dtype, ps=False) as (hc, _):
        layer = layer_on(hc, None, device, dtype)
        warm(layer, torch.tensor([1, 2, 5]), device)
        assert torch.equal(layer.accumulate(keys.to(device), deltas.to(device)).cpu(),
                           want_found)
        assert torch.equal(layer(torch.tensor([1, 2, 5], device=device)).cpu(),
                           want[[1, 2, 5]])
        assert not bool(hc.contains(torch.tensor([KNOWN + 1])).any())
        layer.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("store", STORES)
def test_accumulate_without_a_host_cache_drops_the_gpu_copies(
        tmp_path, request, device: str, store: str) -> None:
    dtype = torch.float32
    w = initial(dtype)
    keys = torch.tensor([4, 4, 9, KNOWN + 3])
    deltas = torch.full((keys.numel(), DIM), 2.0)
    want, want_found = reference_add(w, keys, deltas, torch.arange(ROWS) < KNOWN)
    with tables(store, tmp_path, request, dtype, host=False) as (_, ps):
        layer = layer_on(None, ps, device, dtype)
        warm(layer, torch.tensor([4, 9]), device)
        assert torch.equal(layer.accumulate(keys.to(device), deltas.to(device)).cpu(),
                           want_found)
        assert torch.equal(layer(torch.tensor([4, 9], device=device)).cpu(), want[[4, 9]])
        assert torch.equal(ps_rows(ps, torch.tensor([4, 9]))[0], want[[4, 9]])
        layer.close()
