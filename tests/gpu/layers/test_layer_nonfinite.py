"""A layer's ``insert`` / ``update`` refuse rows holding NaN or an infinity unless the caller
allows them, and the reserved key INT64_MIN, on every stack (its own tensor, a shared
memblock, a DistMemBlock, a host cache over a parameter server): no tier is written, and
lookups return the rows of before."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gpu import BadArgumentError, LayerType, NonFiniteValuesError
from nvecache.common.keys import RESERVED_KEY, RESERVED_KEY_RULE
from tests.gpu.layers.test_layer_writes import DEVICES, STACKS, layer_over, shared_storage

ROWS, DIM = 32, 4


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN equal to NaN."""
    return bool(torch.equal(a.isnan(), b.isnan())
                and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize(("layer_type", "kind"), STACKS)
def test_layer_writes_refuse_nonfinite_rows_unless_allowed(
        layer_type: LayerType, kind: str, bad: float, device: str) -> None:
    initial = torch.arange(ROWS * DIM, dtype=torch.float32).reshape(ROWS, DIM)
    with shared_storage(kind, ROWS, DIM, device, initial) as kw:
        layer = layer_over(layer_type, kw, ROWS, DIM, device)
        try:
            check_writes(layer, kw, initial, bad, device)
        finally:
            layer.close()


def check_writes(layer: Any, kw: dict[str, Any], initial: torch.Tensor, bad: float,
                 device: str) -> None:
    """Refused writes change no tier; allowed ones are read back."""
    keys = torch.tensor([3, 5, 7], device=device)
    assert torch.equal(layer(keys).cpu(), initial[[3, 5, 7]])  # cached where it caches
    new = torch.full((3, DIM), 0.5, device=device)
    new[1, 2] = bad
    for write in (layer.insert, layer.update):
        with pytest.raises(NonFiniteValuesError,
                           match=r"1 row\(s\) hold NaN or infinite values \(the first: "
                           r"key 5\).*allow_nonfinite=True") as err:
            write(keys, new)
        assert isinstance(err.value, BadArgumentError)
        assert torch.equal(layer(keys).cpu(), initial[[3, 5, 7]])  # no tier written
    if "host_cache" in kw:  # the parameter server, and what the host cache holds
        assert torch.equal(kw["storage"].lookup(keys.cpu())[0], initial[[3, 5, 7]])
        layer.flush()
        held, hit = kw["host_cache"].lookup(keys.cpu())
        assert torch.equal(held[hit], initial[[3, 5, 7]][hit])
    layer.update(keys, new, allow_nonfinite=True)
    assert same(layer(keys).cpu(), new.cpu())
    layer.insert(keys[:1], new[1:2], allow_nonfinite=True)
    assert same(layer(keys[:1]).cpu(), new[1:2].cpu())


@pytest.mark.parametrize(("layer_type", "kind"), STACKS)
def test_layer_writes_refuse_the_reserved_key_before_any_tier(layer_type: LayerType,
                                                               kind: str) -> None:
    initial = torch.arange(ROWS * DIM, dtype=torch.float32).reshape(ROWS, DIM)
    with shared_storage(kind, ROWS, DIM, "cpu", initial) as kw:
        layer = layer_over(layer_type, kw, ROWS, DIM, "cpu")
        try:
            keys = torch.tensor([2, RESERVED_KEY])
            for write in (layer.insert, layer.update):
                with pytest.raises(BadArgumentError) as err:
                    write(keys, torch.zeros(2, DIM))
                assert str(err.value) == RESERVED_KEY_RULE  # not a storage failure
            assert torch.equal(layer(keys[:1]), initial[2:3])
            if "host_cache" in kw:
                assert torch.equal(kw["storage"].lookup(keys[:1])[0], initial[2:3])
        finally:
            layer.close()
