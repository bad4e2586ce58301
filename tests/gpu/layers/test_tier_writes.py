"""Per-tier writes and ``accumulate`` through the public layer API, GPULayer and LinearUVM,
against a torch reference: every storage a layer of each type takes, every row dtype,
the CPU (and CUDA when present).

* ``insert(tier=...)`` writes that tier only: a GPULayer's one tier is its table; a
  LinearUVM layer's ``"storage"`` is the linear table (its GPU cache then drops the keys),
  ``"gpu"`` its GPU cache only (the table keeps its rows);
* ``erase(tier=...)`` drops from the GPU cache only; a linear table has every row: erasing
  from one raises ``BadArgumentError`` and changes nothing;
* ``accumulate`` adds deltas to the table, duplicate keys summed (half precision in float32,
  rounded once), and a lookup after it reads the new rows (no stale cached copy);
* a tier name the layer does not have, and bad deltas, raise typed errors and change nothing.

The Hierarchical layer's per-tier writes are tested in
``tests/gpu/host/test_hierarchical_writes.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from gpu import (
    BadArgumentError,
    DistMemBlock,
    LayerType,
    NonFiniteValuesError,
    NVEmbedding,
    TierConfig,
)
from gpu.kernels.triton_access import triton_available
from gpu.stacks.builders import BUILDERS, build_stack
from gpu.stacks.protocol import TIERS, LayerStack
from hostcache import HostCache, SharedMemBlock
from tests.conftest import fresh_name

ROWS, DIM = 64, 8
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
#: (layer type, storage) of every stack over a linear table; "own": the layer's own table
#: from weight_init, "tensor": a tensor the caller passes (a LinearUVM layer: on the CPU)
STACKS = [(LayerType.GPULayer, "own"), (LayerType.GPULayer, "tensor"),
          (LayerType.GPULayer, "memblock"), (LayerType.GPULayer, "distmem"),
          (LayerType.LinearUVM, "tensor"), (LayerType.LinearUVM, "memblock"),
          (LayerType.LinearUVM, "distmem")]
CASES = [pytest.param(device, layer_type, kind, id=f"{device}-{layer_type.name}-{kind}")
         for device in DEVICES for layer_type, kind in STACKS
         if not (layer_type is LayerType.LinearUVM and kind == "tensor" and device != "cpu")]


class Layer:
    """A layer over a table the test owns, and how to read that table without the layer."""

    def __init__(self, layer: NVEmbedding, storage: Any, device: str) -> None:
        self.layer, self.storage, self.device = layer, storage, device

    def stored(self) -> torch.Tensor:
        """Every row of the table (CPU), read from the storage itself where there is one."""
        every = torch.arange(ROWS)
        if self.storage is None:  # a GPULayer's own table: its lookups read it as it is
            return self.layer(every.to(self.device)).cpu()
        if isinstance(self.storage, torch.Tensor):
            return self.storage.cpu().clone()
        return self.storage.read(every).cpu()

    def rows(self, keys: torch.Tensor) -> torch.Tensor:
        return self.layer(keys.to(self.device)).cpu()

    def cached(self, keys: torch.Tensor) -> torch.Tensor:
        return self.layer.in_gpu_cache(keys.to(self.device)).cpu()


@contextlib.contextmanager
def layer_over(device: str, layer_type: LayerType, kind: str, dtype: torch.dtype,
               initial: torch.Tensor, **extra: Any) -> Iterator[Layer]:
    """A layer of ``layer_type`` over a ``kind`` storage holding ``initial``; closed, and its
    tables removed, at the end."""
    with contextlib.ExitStack() as stack:
        storage: Any = None
        kw: dict[str, Any] = {}
        if kind == "own":
            kw["weight_init"] = initial
        elif kind == "tensor":
            storage = initial.clone().to(device)
        elif kind == "memblock":
            storage = SharedMemBlock.create(fresh_name(), num_rows=ROWS, dim=DIM, dtype=dtype)
            stack.callback(SharedMemBlock.unlink, storage.name)
            stack.callback(storage.close)
            storage.write(torch.arange(ROWS), initial)
        else:
            storage = DistMemBlock(ROWS, DIM, dtype, devices=[device], name=fresh_name())
            stack.callback(storage.close)
            storage.write(torch.arange(ROWS), initial.to(storage.view().device))
        if storage is not None:
            kw["storage"] = storage
        # NOTE: a cache of four times the table: no key of a test is ever evicted
        cache = 0 if layer_type is LayerType.GPULayer else 4 * ROWS * (
            12 + DIM * initial.element_size())
        layer = NVEmbedding(ROWS, DIM, dtype, layer_type, gpu_cache_size=cache, device=device,
                            **kw, **extra)
        stack.callback(layer.close)  # NOTE: last in, first out: before its tables
        yield Layer(layer, storage, device)


def rows_of(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, DIM, generator=torch.Generator().manual_seed(seed)).to(dtype)


def warm(t: Layer, keys: torch.Tensor) -> None:
    """Look ``keys`` up and run the admission round: a LinearUVM layer caches them."""
    t.rows(keys)
    t.layer.flush()


def insert_per_tier(device: str, layer_type: LayerType, kind: str, dtype: torch.dtype,
                    **extra: Any) -> None:
    ref = rows_of(dtype, ROWS, 1)
    with layer_over(device, layer_type, kind, dtype, ref, **extra) as t:
        layer = t.layer
        linear_uvm = layer_type is LayerType.LinearUVM
        assert layer.tiers == (("gpu", "storage") if linear_uvm else ("gpu",))
        table_tier = "storage" if linear_uvm else "gpu"
        for n, tier in enumerate((None, table_tier)):
            keys = torch.tensor([3, 40, 7, 62, 0]) + n
            values = rows_of(dtype, keys.numel(), 10 + n)
            warm(t, keys)
            layer.insert(keys.to(device), values.to(device), tier=tier)
            ref[keys] = values
            assert torch.equal(t.stored(), ref)
            assert torch.equal(t.rows(torch.arange(ROWS)), ref)  # no stale cached copy
        if not linear_uvm:
            return
        # the GPU cache only: lookups read the inserted rows, the table keeps its own
        keys = torch.tensor([9, 21, 33, 45, 57])
        values = rows_of(dtype, keys.numel(), 20)
        layer.insert(keys.to(device), values.to(device), tier="gpu")
        assert torch.equal(t.stored(), ref)
        assert t.cached(keys).all()
        assert torch.equal(t.rows(keys), values)
        others = torch.tensor([1, 2, 50])
        assert torch.equal(t.rows(others), ref[others])
        # erase from the GPU cache: lookups read the table's rows again
        layer.erase(keys.to(device), tier="gpu")
        assert not t.cached(keys).any()
        assert torch.equal(t.rows(keys), ref[keys])
        assert torch.equal(t.stored(), ref)


def accumulate_twice(device: str, layer_type: LayerType, kind: str, dtype: torch.dtype,
                     **extra: Any) -> None:
    ref = rows_of(dtype, ROWS, 4)
    with layer_over(device, layer_type, kind, dtype, ref, **extra) as t:
        keys = torch.tensor([5, 17, 5, 63, 0, 17, 5, 30])
        deltas = rows_of(dtype, keys.numel(), 5)
        warm(t, keys)
        found = t.layer.accumulate(keys.to(device), deltas.to(device))
        assert found.dtype == torch.bool and found.device.type == torch.device(device).type
        assert found.cpu().tolist() == [True] * keys.numel()
        # the reference adds in float64 and rounds once (the layer: float32, rounded once)
        want = ref.double().index_add(0, keys, deltas.double()).to(dtype)
        stored = t.stored()
        torch.testing.assert_close(stored, want)
        untouched = torch.ones(ROWS, dtype=torch.bool)
        untouched[keys] = False
        assert torch.equal(stored[untouched], ref[untouched])
        assert not t.cached(keys).any()  # cached copies were dropped
        assert torch.equal(t.rows(torch.arange(ROWS)), stored)
        again = t.layer.accumulate(keys[:1].to(device), deltas[:1].to(device))
        assert again.cpu().tolist() == [True]
        torch.testing.assert_close(t.rows(keys[:1]),
                                   (stored[5:6].double() + deltas[:1].double()).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("device", "layer_type", "kind"), CASES)
def test_insert_per_tier_equals_the_reference(device: str, layer_type: LayerType, kind: str,
                                              dtype: torch.dtype) -> None:
    insert_per_tier(device, layer_type, kind, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("device", "layer_type", "kind"), CASES)
def test_accumulate_sums_duplicates_and_reads_back(device: str, layer_type: LayerType,
                                                   kind: str, dtype: torch.dtype) -> None:
    accumulate_twice(device, layer_type, kind, dtype)


@pytest.mark.skipif(not triton_available(), reason="needs the triton package (its CPU "
                    "interpreter runs the cache kernels on CPU tensors)")
@pytest.mark.parametrize(("layer_type", "kind"), [(LayerType.GPULayer, "memblock"),
                                                  (LayerType.LinearUVM, "memblock")])
def test_tier_writes_through_the_triton_kernels_on_the_cpu(layer_type: LayerType,
                                                           kind: str) -> None:
    """The same writes with the GPU cache's Triton backend (its interpreter on the CPU):
    what the GPU cache holds after each is what a CUDA layer's kernels read."""
    triton = TierConfig(cache_backend="triton")
    insert_per_tier("cpu", layer_type, kind, torch.float16, tuning=triton)
    accumulate_twice("cpu", layer_type, kind, torch.bfloat16, tuning=triton)


def test_every_layer_type_has_a_builder_whose_stack_is_a_layer_stack() -> None:
    """The LayerType -> builder map covers every type, and each stack it builds has the
    whole protocol a layer calls."""
    assert set(BUILDERS) == set(LayerType)
    with contextlib.ExitStack() as stack:
        mb = SharedMemBlock.create(fresh_name(), num_rows=ROWS, dim=DIM)
        stack.callback(SharedMemBlock.unlink, mb.name)
        stack.callback(mb.close)
        hc = HostCache.create(fresh_name(), capacity=4 * ROWS, dim=DIM)
        stack.callback(HostCache.unlink, hc.name)
        stack.callback(hc.close)
        args = {LayerType.GPULayer: {}, LayerType.LinearUVM: {"storage": mb},
                LayerType.Hierarchical: {"host_cache": hc}}
        for layer_type, kw in args.items():
            built = build_stack(layer_type, ROWS, DIM, torch.float32, torch.device("cpu"),
                                gpu_cache_size=0 if layer_type is LayerType.GPULayer
                                else 1 << 14, host_cache=kw.get("host_cache"),
                                storage=kw.get("storage"), weight_init=None, table=None,
                                default_row=None, insert_policy=None, tuning=None, owned=[])
            try:
                assert isinstance(built, LayerStack), layer_type
                assert built.tiers[0] == "gpu" and set(built.tiers) <= set(TIERS)
            finally:
                built.close()
        with pytest.raises(BadArgumentError, match="layer_type must be a gpu.LayerType"):
            build_stack("gpu", ROWS, DIM, torch.float32,  # type: ignore[arg-type]
                        torch.device("cpu"), gpu_cache_size=0, host_cache=None, storage=None,
                        weight_init=None, table=None, default_row=None, insert_policy=None,
                        tuning=None, owned=[])


@pytest.mark.parametrize(("device", "layer_type", "kind"), CASES)
def test_erase_from_a_linear_table_raises_and_changes_nothing(
        device: str, layer_type: LayerType, kind: str) -> None:
    ref = rows_of(torch.float32, ROWS, 2)
    with layer_over(device, layer_type, kind, torch.float32, ref) as t:
        keys = torch.tensor([1, 5, 9, 60])
        warm(t, keys)
        cached = t.cached(keys)
        table_tier = "storage" if layer_type is LayerType.LinearUVM else "gpu"
        with pytest.raises(BadArgumentError, match="linear table has every row"):
            t.layer.erase(keys.to(device), tier=table_tier)
        assert torch.equal(t.cached(keys), cached)
        assert torch.equal(t.stored(), ref)
        assert torch.equal(t.rows(torch.arange(ROWS)), ref)
        t.layer.erase(keys.to(device))  # every tier: the table keeps its rows
        assert not t.cached(keys).any()
        assert torch.equal(t.stored(), ref)
        assert torch.equal(t.rows(keys), ref[keys])


@pytest.mark.parametrize(("device", "layer_type", "kind"), CASES)
def test_a_tier_the_layer_lacks_raises_and_changes_nothing(
        device: str, layer_type: LayerType, kind: str) -> None:
    ref = rows_of(torch.float32, ROWS, 3)
    with layer_over(device, layer_type, kind, torch.float32, ref) as t:
        layer = t.layer
        keys = torch.tensor([2, 4, 6])
        warm(t, keys)
        cached = t.cached(keys)
        values = torch.zeros(3, DIM, device=device)
        bad: list[object] = ["host", "GPU", "", "all", 0, ("gpu",)]
        if layer_type is LayerType.GPULayer:
            bad.append("storage")
        for tier in bad:
            with pytest.raises(BadArgumentError, match="tier must be None .*'gpu'"):
                layer.insert(keys.to(device), values, tier=tier)  # type: ignore[arg-type]
            with pytest.raises(BadArgumentError, match="tier must be None .*'gpu'"):
                layer.erase(keys.to(device), tier=tier)  # type: ignore[arg-type]
        assert torch.equal(t.cached(keys), cached)
        assert torch.equal(t.stored(), ref)
        assert torch.equal(t.rows(torch.arange(ROWS)), ref)


@pytest.mark.parametrize(("device", "layer_type", "kind"), CASES)
def test_accumulate_checks_its_arguments_first(device: str, layer_type: LayerType,
                                               kind: str) -> None:
    ref = rows_of(torch.float32, ROWS, 6)
    with layer_over(device, layer_type, kind, torch.float32, ref) as t:
        layer = t.layer
        keys = torch.tensor([1, 2, 3], device=device)
        deltas = torch.ones(3, DIM, device=device)
        nonfinite = deltas.clone()
        nonfinite[1, 3] = float("nan")
        with pytest.raises(NonFiniteValuesError):
            layer.accumulate(keys, nonfinite)
        with pytest.raises(BadArgumentError, match=r"outside|\[0, 64\)"):
            layer.accumulate(torch.tensor([1, ROWS], device=device), deltas[:2])
        with pytest.raises(BadArgumentError, match="dtype"):
            layer.accumulate(keys, deltas.double())
        with pytest.raises(BadArgumentError, match="shape"):
            layer.accumulate(keys, deltas[:2])
        with pytest.raises(BadArgumentError, match="1-D int64"):
            layer.accumulate(keys.int(), deltas)
        assert torch.equal(t.stored(), ref)
        # an empty batch adds nothing
        assert layer.accumulate(keys[:0], deltas[:0]).numel() == 0
        assert torch.equal(t.stored(), ref)
