"""NVEmbedding / NVEmbeddingBag against torch's embedding / embedding_bag, every layer type."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import psclient
from gpu import (
    BadArgumentError,
    InsertPolicy,
    KeyNotFoundError,
    LayerType,
    NVEmbedding,
    NVEmbeddingBag,
    StorageUnavailableError,
    TierConfig,
)
from gpu.kernels.triton_access import triton_available
from hostcache import HostCache, SharedMemBlock
from tests.conftest import fresh_name

ROWS, DIM = 64, 8
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@contextlib.contextmanager
def stack(
    layer_type: LayerType, weights: torch.Tensor, tmp_path: Any, device: str, **kw: Any
) -> Iterator[dict[str, Any]]:
    """Layer arguments for ``layer_type`` over ``weights``; cleans shared tables up."""
    name = fresh_name()
    dtype = weights.dtype
    owned: list[Any] = []
    try:
        if layer_type is LayerType.GPULayer:
            yield {"weight_init": weights, **kw}
        elif layer_type is LayerType.LinearUVM:
            mb = SharedMemBlock.create(name, num_rows=ROWS, dim=DIM, dtype=dtype)
            owned.append(mb)
            mb.write(torch.arange(ROWS), weights)
            yield {"storage": mb, "gpu_cache_size": 20 * 64, **kw}
        else:
            hc = HostCache.create(name, capacity=24, dim=DIM, dtype=dtype, ways=4)
            owned.append(hc)
            ps = psclient.connect(f"file://{tmp_path}/{name}", table=name, dim=DIM, dtype=dtype)
            ps.load(weights, progress=False)
            yield {"host_cache": hc, "storage": ps, "gpu_cache_size": 16 * 64, **kw}
            ps.close()
    finally:
        for table in owned:
            table.close()
            type(table).unlink(table.name)


LAYER_TYPES = [LayerType.GPULayer, LayerType.LinearUVM, LayerType.Hierarchical]
DTYPES = [torch.float32, torch.float16]


FIXTURE_OK = [HealthCheck.function_scoped_fixture]


@settings(max_examples=8, deadline=None, suppress_health_check=FIXTURE_OK)
@given(
    data=st.data(),
    layer_type=st.sampled_from(LAYER_TYPES),
    dtype=st.sampled_from(DTYPES),
    device=st.sampled_from(DEVICES),
)
def test_embedding_equals_torch(tmp_path, data, layer_type, dtype, device) -> None:
    weights = torch.randn(ROWS, DIM).to(dtype)
    with stack(layer_type, weights, tmp_path, device) as kw:
        layer = NVEmbedding(ROWS, DIM, dtype, layer_type, device=device, **kw)
        for _ in range(4):  # repeated batches: hits, misses, evictions
            shape = data.draw(st.lists(st.integers(0, 6), min_size=1, max_size=3))
            keys = torch.randint(0, ROWS, tuple(shape)).to(device)
            out = layer(keys)
            assert torch.equal(out.cpu(), F.embedding(keys.cpu(), weights))
        layer.close()


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two or more CUDA GPUs")
@pytest.mark.parametrize("layer_type", LAYER_TYPES)
def test_a_layer_on_another_gpu_than_the_current_one(tmp_path, layer_type) -> None:
    """Layers on the last GPU while cuda:0 is current: every kernel runs on the layer's GPU
    (Triton launches on the current device and would refuse the other GPU's pointers)."""
    dev = f"cuda:{torch.cuda.device_count() - 1}"
    weights = torch.randn(ROWS, DIM)
    torch.cuda.set_device(0)
    with stack(layer_type, weights, tmp_path, dev) as kw:
        emb = NVEmbedding(ROWS, DIM, torch.float32, layer_type, device=dev, **kw)
        bag = NVEmbeddingBag(ROWS, DIM, torch.float32, layer_type, device=dev, **kw)
        keys = torch.randint(0, ROWS, (3, 40))
        for _ in range(3):  # misses, admissions, hits
            assert torch.equal(emb(keys.to(dev)).cpu(), F.embedding(keys, weights))
            torch.testing.assert_close(bag(keys.to(dev)).cpu(),
                                       F.embedding_bag(keys, weights, mode="sum"))
        assert torch.cuda.current_device() == 0
        emb.close()
        bag.close()


@settings(max_examples=10, deadline=None, suppress_health_check=FIXTURE_OK)
@given(
    data=st.data(),
    layer_type=st.sampled_from(LAYER_TYPES),
    mode=st.sampled_from(["sum", "mean", "max"]),
    dtype=st.sampled_from(DTYPES),
    include_last=st.booleans(),
    weighted=st.booleans(),
    device=st.sampled_from(DEVICES),
)
def test_embedding_bag_equals_torch(
    tmp_path, data, layer_type, mode, dtype, include_last, weighted, device
) -> None:
    weights = torch.randn(ROWS, DIM).to(dtype)
    weighted = weighted and mode == "sum"
    with stack(layer_type, weights, tmp_path, device) as kw:
        layer = NVEmbeddingBag(ROWS, DIM, dtype, layer_type, mode=mode,
                               include_last_offset=include_last, device=device, **kw)
        for _ in range(3):
            lengths = data.draw(st.lists(st.integers(0, 7), min_size=1, max_size=6))
            n = sum(lengths)
            keys = torch.randint(0, ROWS, (n,))
            starts = torch.tensor([0] + lengths).cumsum(0)
            offsets = starts if include_last else starts[:-1]
            psw = torch.rand(n).to(dtype) if weighted else None
            ref = F.embedding_bag(keys, weights.float(), offsets, mode=mode,
                                  per_sample_weights=None if psw is None else psw.float(),
                                  include_last_offset=include_last)
            out = layer(keys.to(device), offsets.to(device),
                        None if psw is None else psw.to(device))
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            assert out.dtype == dtype
            torch.testing.assert_close(out.cpu().float(), ref, atol=tol, rtol=tol)
        # 2-D input: one bag per row, no offsets
        keys2 = torch.randint(0, ROWS, (3, 4))
        torch.testing.assert_close(
            layer(keys2.to(device)).cpu().float(),
            F.embedding_bag(keys2, weights.float(), mode=mode),
            atol=1e-2, rtol=1e-2) if not include_last else None
        layer.close()


@pytest.mark.parametrize("layer_type", [LayerType.LinearUVM, LayerType.Hierarchical])
def test_update_in_one_process_is_seen_by_another_layer(tmp_path, layer_type) -> None:
    """Two layers over the same shared tables: one updates, the other never serves stale."""
    weights = torch.randn(ROWS, DIM)
    with stack(layer_type, weights, tmp_path, "cpu") as kw:
        a = NVEmbedding(ROWS, DIM, torch.float32, layer_type, device="cpu", **kw)
        b = NVEmbedding(ROWS, DIM, torch.float32, layer_type, device="cpu", **kw)
        keys = torch.arange(10)
        assert torch.equal(b(keys), weights[:10])  # b caches rows 0..9 in its GPU cache
        assert torch.equal(b(keys), weights[:10])
        new = torch.full((3, DIM), 7.0)
        found = a.update(torch.tensor([1, 2, 3]), new)
        assert found.all()
        expected = weights[:10].clone()
        expected[1:4] = 7.0
        assert torch.equal(b(keys), expected)
        assert torch.equal(a(keys), expected)
        assert b.stats().invalidated_keys >= 3


def test_hierarchical_default_row_and_key_not_found(tmp_path) -> None:
    weights = torch.randn(ROWS, DIM)
    with stack(LayerType.Hierarchical, weights, tmp_path, "cpu") as kw:
        strict = NVEmbedding(ROWS, DIM, torch.float32, LayerType.Hierarchical, device="cpu", **kw)
        with pytest.raises(KeyNotFoundError, match="default_row"):
            strict(torch.tensor([1, 1000]))
        lenient = NVEmbedding(ROWS, DIM, torch.float32, LayerType.Hierarchical, device="cpu",
                              default_row=-1.0, **kw)
        out = lenient(torch.tensor([1, 1000, 1000]))
        assert torch.equal(out[0], weights[1]) and (out[1:] == -1.0).all()
        assert lenient.stats().default_rows == 1  # distinct missing keys
        # default rows are never cached: once the key exists it is served
        lenient.insert(torch.tensor([1000]), torch.ones(1, DIM))
        assert torch.equal(lenient(torch.tensor([1000]))[0], torch.ones(DIM))


def test_hierarchical_serves_hits_while_the_ps_is_down(tmp_path) -> None:
    weights = torch.randn(ROWS, DIM)
    with stack(LayerType.Hierarchical, weights, tmp_path, "cpu") as kw:
        layer = NVEmbedding(ROWS, DIM, torch.float32, LayerType.Hierarchical, device="cpu", **kw)
        hot = torch.arange(4)
        assert torch.equal(layer(hot), weights[:4])
        kw["storage"].close()  # the parameter server goes away
        assert torch.equal(layer(hot), weights[:4])  # hits still served
        with pytest.raises(StorageUnavailableError):
            layer(torch.tensor([50]))


def test_threads_give_the_same_results_as_serial(tmp_path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    weights = torch.randn(ROWS, DIM)
    with stack(LayerType.Hierarchical, weights, tmp_path, "cpu",
               insert_policy=InsertPolicy(host=1.0, gpu=1.0)) as kw:
        layer = NVEmbedding(ROWS, DIM, torch.float32, LayerType.Hierarchical, device="cpu", **kw)
        batches = [torch.randint(0, ROWS, (256,)) for _ in range(32)]
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(layer, batches))
        for keys, out in zip(batches, outs, strict=True):
            assert torch.equal(out, weights[keys])


STREAM_DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (one stream per thread)")])]


def _on_own_stream(device: str, fn: Any) -> Any:
    """Run ``fn`` on a stream of this thread's own (CUDA); results copied to the CPU."""
    if device == "cpu":
        return fn()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = fn()
        out = out.cpu()  # synchronises this stream only
    return out


@pytest.mark.parametrize("device", STREAM_DEVICES)
@pytest.mark.parametrize("layer_type", [LayerType.LinearUVM, LayerType.Hierarchical])
def test_threads_on_their_own_streams_match_serial(tmp_path, device: str,
                                                   layer_type: LayerType) -> None:
    from concurrent.futures import ThreadPoolExecutor

    weights = torch.randn(ROWS, DIM)
    with stack(layer_type, weights, tmp_path, device) as kw:
        layer = NVEmbedding(ROWS, DIM, torch.float32, layer_type, device=device, **kw)
        gen = torch.Generator().manual_seed(3)
        batches = [torch.randint(0, ROWS, (512,), generator=gen) for _ in range(48)]

        def look(keys: torch.Tensor) -> torch.Tensor:
            return _on_own_stream(device, lambda: layer(keys.to(device)))

        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(look, batches))
        for keys, out in zip(batches, outs, strict=True):
            assert torch.equal(out.cpu(), weights[keys])
        layer.close()


@pytest.mark.parametrize("device", STREAM_DEVICES)
def test_one_threads_misses_never_hold_up_anothers_hits(tmp_path, device: str) -> None:
    """Thread A's lookup waits inside the parameter server; thread B's hits still return."""
    import threading

    weights = torch.randn(ROWS, DIM)
    with stack(LayerType.Hierarchical, weights, tmp_path, device) as kw:
        layer = NVEmbedding(ROWS, DIM, torch.float32, LayerType.Hierarchical, device=device,
                            **kw)
        hot = torch.arange(8)
        layer(hot.to(device))  # cached now (GPU cache and host cache)
        ps = kw["storage"]
        real_lookup = ps.lookup
        entered, release = threading.Event(), threading.Event()

        def gated_lookup(keys: torch.Tensor) -> Any:
            entered.set()
            assert release.wait(60), "the test never released the parameter server"
            return real_lookup(keys)

        ps.lookup = gated_lookup  # the real PS, held at the door until released
        box: dict[str, Any] = {}

        cold = torch.tensor([ROWS - 1, ROWS - 2])

        def a() -> None:
            box["a"] = _on_own_stream(device, lambda: layer(cold.to(device)))

        def b() -> None:
            box["b"] = _on_own_stream(device, lambda: layer(hot.to(device)))

        ta = threading.Thread(target=a)
        ta.start()
        try:
            assert entered.wait(60), "thread A never reached the parameter server"
            tb = threading.Thread(target=b)  # while A waits at the parameter server
            tb.start()
            tb.join(60)  # a bound for a failure, not a synchronisation: B must not block
            b_finished_while_a_waited = not tb.is_alive()
        finally:
            release.set()
            ta.join(60)
        tb.join(60)
        assert b_finished_while_a_waited, "B's hits waited for A's misses"
        assert torch.equal(box["b"].cpu(), weights[hot])
        assert torch.equal(box["a"].cpu(), weights[cold])
        layer.close()


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda e, b: e(torch.tensor([1.0])), "int64"),
        (lambda e, b: e(torch.tensor([ROWS])), "outside"),
        (lambda e, b: e(torch.tensor([-1])), "outside"),
        (lambda e, b: b(torch.tensor([1, 2]), torch.tensor([1, 0])), "start at 0"),
        (lambda e, b: b(torch.tensor([1, 2]), torch.tensor([0, 2, 1])), "non-decreasing|past"),
        (lambda e, b: b(torch.tensor([1, 2]), torch.tensor([0, 5])), "past"),
        (lambda e, b: b(torch.tensor([1, 2])), "offsets are required"),
        (lambda e, b: b(torch.tensor([[1, 2]]), torch.tensor([0])), "None"),
        (lambda e, b: b(torch.tensor([1, 2]), torch.tensor([0]), torch.ones(3)), "shape"),
        (lambda e, b: e.update(torch.tensor([1]), torch.ones(1, DIM + 1)), "shape"),
        (lambda e, b: e.update(torch.tensor([1]), torch.ones(1, DIM, dtype=torch.float64)),
         "dtype"),
    ],
)
def test_bad_input_raises_typed_errors(call, match) -> None:
    weights = torch.randn(ROWS, DIM)
    e = NVEmbedding(ROWS, DIM, torch.float32, LayerType.GPULayer, weight_init=weights,
                    device="cpu")
    b = NVEmbeddingBag(ROWS, DIM, torch.float32, LayerType.GPULayer, weight_init=weights,
                       device="cpu")
    with pytest.raises(BadArgumentError, match=match):
        call(e, b)
    assert torch.equal(e(torch.arange(ROWS)), weights)  # nothing changed


def test_weights_with_mean_mode_are_refused() -> None:
    b = NVEmbeddingBag(ROWS, DIM, torch.float32, LayerType.GPULayer, mode="mean", device="cpu")
    with pytest.raises(BadArgumentError, match="per_sample_weights"):
        b(torch.tensor([1, 2]), torch.tensor([0]), torch.ones(2))


def test_mismatched_tables_are_refused(table_name, tmp_path) -> None:
    with HostCache.create(table_name, capacity=16, dim=DIM + 1) as hc:
        try:
            with pytest.raises(BadArgumentError, match="dim"):
                NVEmbedding(ROWS, DIM, torch.float32, LayerType.Hierarchical, host_cache=hc,
                            device="cpu")
        finally:
            HostCache.unlink(table_name)
    with SharedMemBlock.create(table_name, num_rows=ROWS + 1, dim=DIM) as mb:
        try:
            with pytest.raises(BadArgumentError, match="rows"):
                NVEmbedding(ROWS, DIM, torch.float32, LayerType.LinearUVM, storage=mb,
                            device="cpu")
        finally:
            SharedMemBlock.unlink(table_name)
    with pytest.raises(BadArgumentError, match="gpu_cache_size"):
        NVEmbedding(ROWS, DIM, torch.float32, LayerType.GPULayer, gpu_cache_size=-1)
    with pytest.raises(BadArgumentError, match="needs a host_cache"):
        NVEmbedding(ROWS, DIM, torch.float32, LayerType.Hierarchical, device="cpu")


def test_linear_misses_are_admitted_in_rounds_with_fresh_rows(table_name) -> None:
    """A LinearUVM cache logs its misses (and the rows read for them) and admits them when
    a round is due (while it fills: every ``admit_fraction`` of its slots of keys looked
    up); a write between the lookups and the round drops what was logged, so the cache
    only ever takes rows read after it."""
    from gpu import TierConfig

    weights = torch.randn(ROWS, DIM)
    slots = 1 << 10
    with SharedMemBlock.create(table_name, num_rows=ROWS, dim=DIM) as mb:
        try:
            mb.write(torch.arange(ROWS), weights)
            layer = NVEmbedding(ROWS, DIM, torch.float32, LayerType.LinearUVM, storage=mb,
                                gpu_cache_size=slots * (DIM * 4 + 12), device="cpu",
                                tuning=TierConfig(admit_fraction=40 / slots))
            keys = torch.arange(10)
            for _ in range(3):  # 30 keys looked up: no round yet
                assert torch.equal(layer(keys), weights[:10])
            assert layer.stats().gpu.inserts == 0 and not layer.in_gpu_cache(keys).any()
            fresh = torch.full((2, DIM), 7.0)
            layer.update(keys[:2], fresh)  # the rows logged before it are dropped
            weights[:2] = fresh
            assert torch.equal(layer(keys), weights[:10])  # 40 keys, 10 since the write
            assert layer.stats().gpu.inserts == 0
            for _ in range(3):  # 40 keys logged since the write: the round runs
                assert torch.equal(layer(keys), weights[:10])
            assert layer.stats().gpu.inserts == 10 and layer.in_gpu_cache(keys).all()
            before = layer.stats().gpu.hits
            assert torch.equal(layer(keys), weights[:10])  # served by the cache
            assert layer.stats().gpu.hits == before + 10
            layer.erase(keys[:4])  # erase drops keys from the cache and from the log
            assert layer.in_gpu_cache(keys).tolist() == [False] * 4 + [True] * 6
            assert torch.equal(layer(keys), weights[:10])
            layer.flush()  # a round now: the 4 misses go back in
            assert layer.in_gpu_cache(keys).all()
            layer.close()
        finally:
            SharedMemBlock.unlink(table_name)


def test_default_row_of_the_wrong_shape_is_refused(tmp_path) -> None:
    weights = torch.randn(ROWS, DIM)
    with stack(LayerType.Hierarchical, weights, tmp_path, "cpu") as kw:
        with pytest.raises(BadArgumentError, match="default_row"):
            NVEmbedding(ROWS, DIM, torch.float32, LayerType.Hierarchical, device="cpu",
                        default_row=torch.zeros(DIM + 1), **kw)


def test_gpu_host_hits_reach_the_host_policy_weighted_by_the_sample(
        table_name: str) -> None:
    """What a CUDA layer does after its kernel read the host cache (run here on the CPU):
    a sample of the hits, weighted, bumps the host cache's eviction counters."""
    from gpu.stacks.hierarchical import touch_sample
    from hostcache.hashing import bucket_of

    with HostCache.create(table_name, capacity=64, dim=4, ways=4) as hc:
        try:
            cand = torch.arange(200_000)
            b = bucket_of(cand, hc.geometry.num_buckets)
            same = cand[b == b[0]][:7]
            hc.insert(same[:4], torch.zeros(4, 4))
            # 60 hits of same[1] (a sample of 2, each counted 30 times), none of the others
            keys = torch.cat([same[1].repeat(60), same[[0, 2, 3]]])
            hit = torch.zeros(keys.numel(), dtype=torch.bool)
            hit[:60] = True
            touch_sample(hc, keys, hit, 60, sample=2)
            for k in same[4:7]:  # each newcomer evicts a cold way, never same[1]
                hc.insert(k[None], torch.zeros(1, 4))
            assert hc.contains(same).tolist() == [False, True, False, False, True, True, True]
        finally:
            HostCache.unlink(table_name)


@pytest.mark.skipif(not triton_available(), reason="needs the triton package (its CPU "
                    "interpreter runs the GPULayer kernels on CPU tensors)")
def test_gpulayer_kernels_read_contiguous_and_strided_tables() -> None:
    """GPULayer lookups through the Triton gather (its interpreter on CPU tensors, asked
    for by the layer's tuning): a table in a tensor, a view with padded rows (the kernels
    step by its row stride) and one whose row elements are not contiguous (read by torch's
    gathers instead, same rows) equal F.embedding / F.embedding_bag; the gather in batch
    and in page order."""
    from gpu.kernels.tiles import DEFAULT_TILES
    from gpu.kernels.triton_access import kernel_module

    kernels = kernel_module("gather", interpret=True)
    page_order = dataclasses.replace(DEFAULT_TILES, linear_page_order=1)  # every batch
    triton = TierConfig(cache_backend="triton", tiles=page_order)
    gen = torch.Generator().manual_seed(4)
    wide = torch.randn(ROWS, 2 * DIM, generator=gen)
    keys = torch.randint(0, ROWS, (37,), generator=gen)
    offsets = torch.tensor([0, 5, 5, 30])
    for w in (wide[:, :DIM].contiguous(), wide[:, DIM:], wide[:, ::2]):
        emb = NVEmbedding(ROWS, DIM, torch.float32, LayerType.GPULayer, storage=w,
                          device="cpu", tuning=triton)
        assert torch.equal(emb(keys), F.embedding(keys, w))
        bag = NVEmbeddingBag(ROWS, DIM, torch.float32, LayerType.GPULayer, storage=w,
                             device="cpu", tuning=triton)
        torch.testing.assert_close(bag(keys, offsets),
                                   F.embedding_bag(keys, w, offsets, mode="sum"))
    # the gather itself, in batch and in page order: out-of-range keys read zero rows and
    # one of them lands in the key-error flag
    table = wide[:, :DIM].contiguous()
    odd = torch.cat([keys, torch.tensor([-1, ROWS, 3])])
    want = F.embedding(odd.clamp(0, ROWS - 1), table)
    want[[37, 38]] = 0
    for host_table in (False, True):
        err = torch.zeros(1, dtype=torch.int64)
        assert torch.equal(kernels.gather(odd, table, err, host_table=host_table,
                                          tiles=page_order), want)
        assert int(err) in (-1, ROWS)
        assert torch.equal(kernels.gather(keys, table, err.zero_(), host_table=host_table,
                                          tiles=page_order),
                           F.embedding(keys, table)) and int(err) == 0


def test_hierarchical_host_tier_counts_what_its_fills_evicted(tmp_path) -> None:
    """A layer's host-tier stats count the rows its fills placed and the residents they
    displaced: with the layer as the host cache's only writer, the node's counters agree."""
    weights = torch.randn(ROWS, DIM)
    with stack(LayerType.Hierarchical, weights, tmp_path, "cpu") as kw:
        layer = NVEmbedding(ROWS, DIM, torch.float32, LayerType.Hierarchical, device="cpu",
                            **kw)
        for start in range(0, ROWS, 8):  # 64 distinct keys through a 24-row host cache
            keys = torch.arange(start, start + 8)
            assert torch.equal(layer(keys), weights[keys])
            layer.flush()  # one fill per lookup (queued fills would go in as one insert)
        host, node = layer.stats().host, layer.stats().host_node
        assert host is not None and node is not None
        assert host.evictions > 0
        assert (host.inserts, host.evictions) == (node.inserts, node.evictions)
        assert host.inserts - host.evictions == node.size
        layer.close()


READ_PATHS = [("cpu", 1 << 20)] + (
    [("cuda", 1), ("cuda", 1 << 20)] if torch.cuda.is_available() else [])


@pytest.mark.parametrize(("device", "gpu_read_keys"), READ_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_hierarchical_misses_equal_torch_on_either_read_path(
        tmp_path, device: str, gpu_read_keys: int, dtype: torch.dtype) -> None:
    """Misses read by the GPU from the host cache (``host_gpu_read_keys`` 1) or on the CPU
    (their rows moved as raw bytes through the pinned buffer): every dtype, an odd dim,
    repeated keys, keys in no tier (the default row, or KeyNotFoundError)."""
    rows, dim, known = 200, 7, 150
    weights = torch.randn(rows, dim).to(dtype)
    default = torch.arange(dim).to(dtype)
    ref = torch.cat([weights[:known], default.expand(rows - known, dim)])
    name = fresh_name()
    hc = HostCache.create(name, capacity=64, dim=dim, dtype=dtype, ways=4)
    ps = psclient.connect(f"file://{tmp_path}/{name}", table=name, dim=dim, dtype=dtype)
    try:
        ps.load(weights[:known], progress=False)
        kw: dict[str, Any] = {"host_cache": hc, "storage": ps, "device": device,
                              "gpu_cache_size": 32 * (dim * 4 + 12),
                              "tuning": TierConfig(host_gpu_read_keys=gpu_read_keys)}
        layer = NVEmbedding(rows, dim, dtype, LayerType.Hierarchical, default_row=default, **kw)
        g = torch.Generator().manual_seed(0)
        for _ in range(6):  # misses, host-cache hits, GPU-cache hits, admissions
            keys = torch.randint(0, rows, (300,), generator=g)
            keys[:40] = keys[40:80]  # repeated keys in one batch
            assert torch.equal(layer(keys.to(device)).cpu(), ref[keys])
        layer.flush()
        s = layer.stats()
        assert s.host is not None and s.storage is not None and s.default_rows > 0
        assert s.storage.hits + s.storage.misses == s.host.misses
        strict = NVEmbedding(rows, dim, dtype, LayerType.Hierarchical, **kw)
        with pytest.raises(KeyNotFoundError, match="default_row"):
            strict(torch.tensor([3, rows - 1, 5], device=device))
        strict.close()
        layer.close()
    finally:
        ps.drop()
        ps.close()
        hc.close()
        HostCache.unlink(name)
