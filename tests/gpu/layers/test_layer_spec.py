"""``layer.spec`` (:class:`gpu.layer_config.LayerSpec`): a layer's construction arguments as
it resolved them and its tables by identity, for every layer type; gpu.export's metadata and
a layer's checkpoint extra state are read from it, and an exported layer loads back with the
same record (tuning, insert policy, default row, tables)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import psclient
from gpu import InsertPolicy, LayerType, NVEmbedding, TierConfig
from gpu import export as gx
from gpu.layer_config import LayerSpec, TableRef
from hostcache import HostCache, SharedMemBlock
from tests.conftest import fresh_name

ROWS, DIM = 32, 4
TUNING = TierConfig(admit_batches=7, round_lookups=9)
POLICY = InsertPolicy(host=0.5, gpu=0.25)


@contextlib.contextmanager
def layer_args(layer_type: LayerType, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Arguments of a layer of ``layer_type`` with non-default tuning (and policy), over
    tables the test owns (removed at the end)."""
    name = fresh_name("spec")
    w = torch.randn(ROWS, DIM)
    if layer_type is LayerType.GPULayer:
        yield {"weight_init": w, "tuning": TUNING}
    elif layer_type is LayerType.HostLayer:
        yield {"storage": w, "tuning": TUNING}  # a user's CPU tensor: a private table
    elif layer_type is LayerType.LinearUVM:
        with SharedMemBlock.create(name, num_rows=ROWS, dim=DIM) as mb:
            try:
                mb.write(torch.arange(ROWS), w)
                yield {"storage": mb, "gpu_cache_size": 1024, "tuning": TUNING,
                       "insert_policy": POLICY}
            finally:
                SharedMemBlock.unlink(name)
    else:
        with HostCache.create(name, capacity=32, dim=DIM, ways=4) as hc:
            try:
                with psclient.connect(f"file://{tmp_path}/{name}", table=name, dim=DIM) as ps:
                    ps.load(w, progress=False)
                    yield {"host_cache": hc.name, "storage": ps.url, "table": name,
                           "gpu_cache_size": 1024, "tuning": TUNING,
                           "insert_policy": POLICY, "default_row": 0.5}
            finally:
                HostCache.unlink(name)


@pytest.mark.parametrize("layer_type", list(LayerType))
def test_spec_records_the_resolved_arguments_and_tables(tmp_path: Path,
                                                        layer_type: LayerType) -> None:
    with layer_args(layer_type, tmp_path) as kw, \
            NVEmbedding(ROWS, DIM, torch.float32, layer_type, device="cpu", **kw) as layer:
        spec = layer.spec
        assert isinstance(spec, LayerSpec)
        assert (spec.layer_type, spec.num_embeddings, spec.embedding_size, spec.data_type,
                spec.device) == (layer_type, ROWS, DIM, torch.float32, torch.device("cpu"))
        assert spec.tuning == TUNING and spec.gpu_cache_size == kw.get("gpu_cache_size", 0)
        assert spec.insert_policy == kw.get("insert_policy", InsertPolicy())
        with pytest.raises(dataclasses.FrozenInstanceError):
            spec.gpu_cache_size = 1  # type: ignore[misc]
        if layer_type in (LayerType.GPULayer, LayerType.HostLayer):
            assert spec.tables == (TableRef("own"),) and spec.default_row is None
        elif layer_type is LayerType.LinearUVM:
            assert spec.tables == (TableRef("memblock", kw["storage"].name),)
        else:
            # a host cache by name and a PS by URL appear as the tables they opened
            assert spec.tables == (TableRef("hostcache", kw["host_cache"]),
                                   TableRef("ps", kw["table"], kw["storage"]))
            assert spec.default_row == (0.5,) * DIM
            assert spec.table("ps") == spec.tables[1] and spec.table("memblock") is None
            extra = layer.state_dict()["_extra_state"]
            assert (extra["host_cache"], extra["table"], extra["url"]) == (
                kw["host_cache"], kw["table"], kw["storage"])
    assert layer.spec is spec  # NOTE: a record: it outlives close()


@pytest.mark.parametrize("layer_type", list(LayerType))
def test_export_metadata_is_the_spec_and_loads_back(tmp_path: Path,
                                                    layer_type: LayerType) -> None:
    keys = torch.tensor([1, 2, 3])
    with layer_args(layer_type, tmp_path) as kw, \
            NVEmbedding(ROWS, DIM, torch.float32, layer_type, device="cpu", **kw) as layer:
        model = torch.nn.Sequential(layer)
        want = model(keys)
        path = gx.save(model, (keys,), tmp_path / "exported")
        (entry,) = json.loads((path / "metadata.json").read_text())["layers"]
        assert entry["insert_policy"] == dataclasses.asdict(layer.spec.insert_policy)
        assert entry["tuning"]["admit_batches"] == 7 and entry["tuning"]["round_lookups"] == 9
        assert entry["gpu_cache_size"] == layer.spec.gpu_cache_size
        with gx.load(path) as loaded:
            torch.testing.assert_close(loaded(keys), want)
            back = loaded.layers["0"].spec
            assert back.tuning == TUNING and back.tables == layer.spec.tables
            assert back.default_row == layer.spec.default_row
            assert back.gpu_cache_size == layer.spec.gpu_cache_size
            if layer_type is LayerType.Hierarchical:
                assert back.insert_policy == POLICY


def test_export_round_trips_a_linear_uvm_insert_policy(tmp_path: Path) -> None:
    """metadata.json records it (above); gpu.export.load passes it on for every layer type."""
    keys = torch.tensor([1, 2, 3])
    with layer_args(LayerType.LinearUVM, tmp_path) as kw, \
            NVEmbedding(ROWS, DIM, torch.float32, LayerType.LinearUVM, device="cpu",
                        **kw) as layer:
        path = gx.save(torch.nn.Sequential(layer), (keys,), tmp_path / "exported")
        with gx.load(path) as loaded:
            assert loaded.layers["0"].spec.insert_policy == POLICY
