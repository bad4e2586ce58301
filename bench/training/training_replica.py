"""The serving replica of ``bench/training/bench_training_tiers.py`` (a spawned process's body).

It builds an inference ``NVEmbedding`` (Hierarchical, ``optimize_for_training=False``)
over the trainer's shared host cache and parameter server, with ``embedding_size`` the
stored row width (a trained row's optimizer state comes along: only the first ``dim``
columns are compared), and looks a few probe keys up in a loop.

Each trainer step is an epoch here: the rows seen when the epoch began are its base; the
first lookup that returns any probe row different from the base is the epoch's first
sighting, the lookup that returns every probe row changed ends it. The replica then puts
``("seen", epoch, first_s, all_s, stale)`` (``time.monotonic()`` after the lookup and its
device sync; ``stale``: lookups that returned a row's base again after it had been seen
changed, which must be 0) and the trainer, which waits for that record, starts the next
step. ``stop`` set: the replica puts ``("done", lookups, final rows)`` (numpy) and exits; an error
is put as ``("error", traceback)``.
"""

from __future__ import annotations

import time
import traceback
from typing import Any

import torch


def serve(host_cache: str, ps_url: str, table: str, num_embeddings: int, width: int,
          dim: int, cache_bytes: int, device: str, probes: torch.Tensor, stop: Any,
          out: Any) -> None:
    """Loop lookups of ``probes`` until ``stop`` is set (see the module docstring)."""
    try:
        _serve(host_cache, ps_url, table, num_embeddings, width, dim, cache_bytes, device,
               probes, stop, out)
    except BaseException:  # noqa: BLE001 - the trainer is told, then the process exits
        out.put(("error", traceback.format_exc()))


def _serve(host_cache: str, ps_url: str, table: str, num_embeddings: int, width: int,
           dim: int, cache_bytes: int, device: str, probes: torch.Tensor, stop: Any,
           out: Any) -> None:
    from gpu import LayerType, NVEmbedding

    torch.set_num_threads(1)
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    # NOTE: the layer attaches the host cache by name and connects the URL itself: it
    # closes both (the trainer unlinks the segment and drops the table)
    layer = NVEmbedding(num_embeddings, width, torch.float32, layer_type=LayerType.Hierarchical,
                        gpu_cache_size=cache_bytes, host_cache=host_cache, storage=ps_url,
                        table=table, device=dev)
    try:
        keys = probes.to(dev)

        def look() -> torch.Tensor:
            rows = layer(keys)[:, :dim]
            sync()
            return rows

        base = look().clone()
        out.put(("ready",))
        epoch, lookups, stale = 0, 1, 0
        first: float | None = None
        seen = torch.zeros(keys.numel(), dtype=torch.bool, device=dev)
        while not stop.is_set():
            rows = look()
            now = time.monotonic()
            lookups += 1
            changed = (rows != base).any(dim=1)
            if bool((seen & ~changed).any()):
                stale += 1  # NOTE: a row seen new read old again
            seen |= changed
            if first is None and bool(changed.any()):
                first = now
            if bool(changed.all()):
                assert first is not None
                out.put(("seen", epoch, first, now, stale))
                base, first, stale = rows.clone(), None, 0
                seen.zero_()
                epoch += 1
        # NOTE: a numpy array travels by value (a tensor would go as a file descriptor the
        # trainer may only fetch while this process lives)
        out.put(("done", lookups, look().cpu().numpy()))
    finally:
        layer.close()
