"""What an export directory says about each layer of the model (``metadata.json``).

One JSON object per layer: its path in the model, class, layer type, geometry, device,
the GPU cache's size, the tuning (``TierConfig``), the insert policy, a Hierarchical
layer's default row, and where its rows live: ``private`` (the layer's own table, saved in
the directory as safetensors), ``memblock`` (a SharedMemBlock attached by name) or
``tiers`` (a host cache by name and/or a parameter-server URL and table).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from gpu.dist.distmem import DistMemBlock
from gpu.errors import ExportError
from gpu.kernels.tiles import Tiles
from gpu.layer_config import InsertPolicy, LayerType
from gpu.tier_config import DEFAULT, TierConfig
from hostcache import SharedMemBlock
from nvecache.common import rows

#: the format this library writes; it reads every version up to this one
FORMAT_VERSION = 1
FORMAT = "nvecache.gpu.export"
PROGRAM = "program.pt2"
TABLES = "tables.safetensors"
METADATA = "metadata.json"
#: the id buffer every layer registers (gpu.layers, gpu.ops)
ID_BUFFER = "nvecache_id"


def _tuning(config: TierConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def tuning_of(d: dict[str, Any] | None) -> TierConfig:
    """The TierConfig a metadata entry recorded."""
    if not d:
        return DEFAULT
    d = dict(d)
    tiles = d.pop("tiles", None)
    config = TierConfig(**d)
    return dataclasses.replace(config, tiles=Tiles(**tiles)) if tiles else config


def _ps_url(ps: Any) -> str:
    """The URL a parameter server was connected from (without a password)."""
    stat = ps.stat()
    url = stat.get("url")
    if url is None and stat.get("backend") == "lmdb" and stat.get("path"):
        url = f"file://{stat['path']}"
    if url is None:
        raise ExportError(f"parameter server table {ps.table!r}: its URL is not known, so a "
                          "loaded model could not reconnect; connect it from a URL")
    return str(url)


def describe(path: str, layer: Any) -> tuple[dict[str, Any], torch.Tensor | None]:
    """The metadata entry of ``layer`` (at ``path`` in the model), and its private rows
    (None when its rows live in a shared table)."""
    stack = layer._tiers
    if getattr(layer, "_closed", False):
        raise ExportError(f"layer {path!r} is closed: export a model whose layers are open")
    entry: dict[str, Any] = {
        "path": path,
        "class": type(layer).__name__,
        "layer_type": layer.layer_type.name,
        "num_embeddings": layer.num_embeddings,
        "embedding_size": layer.embedding_size,
        "data_type": rows.dtype_name(layer.data_type),
        "device": str(layer.device),
        "validate": bool(layer.validate),
        "id_buffer": f"{path}.{ID_BUFFER}" if path else ID_BUFFER,
    }
    if hasattr(layer, "mode"):
        entry["mode"] = layer.mode
        entry["include_last_offset"] = bool(layer.include_last_offset)
    cache = getattr(stack, "cache", None)
    entry["gpu_cache_size"] = int(cache.capacity * cache.slot_bytes) if cache is not None else 0
    config = getattr(stack, "config", None)
    if config is None:  # a GPULayer keeps only its launch settings
        config = dataclasses.replace(DEFAULT, tiles=stack._tiles)
    entry["tuning"] = _tuning(config)
    private: torch.Tensor | None = None
    if layer.layer_type is LayerType.Hierarchical:
        resolver = stack.resolver
        host_share = float(getattr(resolver, "_host_share", 1.0))
        gpu_share = float(getattr(stack.reads, "_share", 1.0))
        entry["insert_policy"] = {"host": host_share, "gpu": gpu_share}
        default = getattr(resolver, "_default", None)
        entry["default_row"] = (None if default is None
                                else default.detach().cpu().float().tolist())
        hc, ps = stack.host_cache, stack.ps
        entry["table"] = {"kind": "tiers",
                          "host_cache": hc.name if hc is not None else None,
                          "ps_url": _ps_url(ps) if ps is not None else None,
                          "ps_table": ps.table if ps is not None else None}
        return entry, None
    block = stack._block
    if isinstance(block, SharedMemBlock):
        entry["table"] = {"kind": "memblock", "name": block.name}
    elif isinstance(block, DistMemBlock):
        raise ExportError(f"layer {path!r} reads a gpu.DistMemBlock: a table sharded over "
                          "GPUs cannot be exported yet")
    else:
        entry["table"] = {"kind": "private", "key": path or "layer"}
        private = stack.table.detach()
    return entry, private


def policy_of(entry: dict[str, Any]) -> InsertPolicy | None:
    p = entry.get("insert_policy")
    return None if p is None else InsertPolicy(host=p["host"], gpu=p["gpu"])


def dtype_of(entry: dict[str, Any]) -> torch.dtype:
    return rows.torch_dtype(entry["data_type"])
