"""A replica process body for the cross-process layer tests (spawn-importable)."""

from __future__ import annotations

from typing import Any

import torch


def serve(layer_type: str, table: str, ps_url: str | None, device: str, commands: Any,
          answers: Any) -> None:
    """Build a layer over the named shared tables on ``device``; answer lookups (CPU tensors
    in and out) until told to stop."""
    from gpu import LayerType, NVEmbedding
    from hostcache import HostCache, SharedMemBlock

    torch.set_num_threads(1)
    if layer_type == "LinearUVM":
        mb = SharedMemBlock.attach(table)
        layer = NVEmbedding(mb.num_rows, mb.dim, mb.dtype, LayerType.LinearUVM,
                            gpu_cache_size=1 << 16, storage=mb, device=device)
    else:
        import psclient

        hc = HostCache.attach(table)
        ps = psclient.connect(ps_url, table=table)
        layer = NVEmbedding(1 << 20, hc.geometry.dim, hc.geometry.dtype, LayerType.Hierarchical,
                            gpu_cache_size=1 << 16, host_cache=hc, storage=ps, device=device)
    answers.put("ready")
    while True:
        cmd = commands.get()
        if cmd is None:
            break
        op, keys, values = cmd
        keys = keys.to(device)
        if op == "lookup":
            answers.put(layer(keys).cpu())
        elif op == "update":
            answers.put(layer.update(keys, values.to(device)).cpu())
    layer.close()
    answers.put("bye")
