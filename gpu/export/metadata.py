"""What an export directory says about each layer of the model (``metadata.json``).

One JSON object per layer, from the layer's construction record (``layer.spec``,
:class:`gpu.layer_config.LayerSpec`): its path in the model, class, layer type, geometry,
device, the GPU cache's size (as asked for), the tuning (``TierConfig``), the insert
policy (every layer type), a Hierarchical layer's default row, and where its rows live:
``private`` (the layer's own table, or a user's CPU tensor a LinearUVM layer or a
HostLayer reads in place, saved in the directory as safetensors; a loaded LinearUVM
layer or HostLayer reads the loaded rows as its storage), ``memblock``
(a SharedMemBlock attached by name) or ``tiers`` (a host cache by name and/or a
parameter-server URL and table). A GPULayer whose own table is stored quantized
(``weight_dtype=``) records its format (``weight_dtype``), and its private rows are the
table's stored bytes (uint8), loaded back bit for bit; such a directory is format version
2 (a reader of version 1 refuses it with ``FormatVersionError`` instead of misreading the
bytes), any other version 1.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from gpu.errors import ExportError
from gpu.kernels.tiles import Tiles
from gpu.layer_config import InsertPolicy, LayerType
from gpu.tier_config import DEFAULT, TierConfig
from nvecache.common import rows

#: the newest format this library writes; it reads every version up to this one (2: a
#: layer's private table may be stored quantized, ``weight_dtype``)
FORMAT_VERSION = 2
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


def _table_entry(path: str, layer: Any) -> dict[str, Any]:
    """Where the layer's rows live, from its construction record (``layer.spec``)."""
    spec = layer.spec
    if spec.layer_type is LayerType.Hierarchical:
        hc, ps = spec.table("hostcache"), spec.table("ps")
        if ps is not None and not ps.url:
            raise ExportError(f"parameter server table {ps.name!r}: its URL is not known, "
                              "so a loaded model could not reconnect; connect it from a URL")
        return {"kind": "tiers", "host_cache": hc.name if hc is not None else None,
                "ps_url": ps.url if ps is not None else None,
                "ps_table": ps.name if ps is not None else None}
    (table,) = spec.tables
    if table.kind == "memblock":
        return {"kind": "memblock", "name": table.name}
    if table.kind == "distmem":
        raise ExportError(f"layer {path!r} reads a gpu.DistMemBlock: a table sharded over "
                          "GPUs cannot be exported yet")
    return {"kind": "private", "key": path or "layer"}


def describe(path: str, layer: Any) -> tuple[dict[str, Any], torch.Tensor | None]:
    """The metadata entry of ``layer`` (at ``path`` in the model), and its private rows
    (None when its rows live in a shared table)."""
    if getattr(layer, "_closed", False):
        raise ExportError(f"layer {path!r} is closed: export a model whose layers are open")
    spec = layer.spec
    entry: dict[str, Any] = {
        "path": path,
        "class": type(layer).__name__,
        "layer_type": spec.layer_type.name,
        "num_embeddings": spec.num_embeddings,
        "embedding_size": spec.embedding_size,
        "data_type": rows.dtype_name(spec.data_type),
        "device": str(spec.device),
        "validate": bool(layer.validate),
        "id_buffer": f"{path}.{ID_BUFFER}" if path else ID_BUFFER,
    }
    if hasattr(layer, "mode"):
        entry["mode"] = layer.mode
        entry["include_last_offset"] = bool(layer.include_last_offset)
    entry["gpu_cache_size"] = spec.gpu_cache_size
    entry["tuning"] = _tuning(spec.tuning)
    entry["insert_policy"] = dataclasses.asdict(spec.insert_policy)
    entry["default_row"] = None if spec.default_row is None else list(spec.default_row)
    entry["table"] = _table_entry(path, layer)
    if spec.weight_dtype is not None:  # NOTE: its private rows are its stored bytes
        entry["weight_dtype"] = rows.dtype_name(spec.weight_dtype, rows.FORMATS)
    if entry["table"]["kind"] != "private":
        return entry, None
    # NOTE: the layer's checkpoint view of its own table (gpu.state): no copy
    return entry, layer.state_dict(keep_vars=True)["weight"].detach()


def version_of(entries: list[dict[str, Any]]) -> int:
    """The format version a directory of these layers is written in: the oldest that
    holds them (1, unless a private table is stored quantized)."""
    return 2 if any("weight_dtype" in e for e in entries) else 1


def weight_dtype_of(entry: dict[str, Any]) -> torch.dtype | None:
    """The quantized format a layer's own table was stored in (None: its data_type)."""
    name = entry.get("weight_dtype")
    return None if name is None else rows.torch_dtype(name)


def policy_of(entry: dict[str, Any]) -> InsertPolicy | None:
    p = entry.get("insert_policy")
    return None if p is None else InsertPolicy(host=p["host"], gpu=p["gpu"])


def dtype_of(entry: dict[str, Any]) -> torch.dtype:
    return rows.torch_dtype(entry["data_type"])
