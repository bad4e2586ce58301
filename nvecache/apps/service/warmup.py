"""Warm-up: pre-load rows from the parameter server into a new table, with a progress bar.

Which keys ("the N hottest"): the first N keys of the table's ``warmup_keys`` file (a
``.npy`` int64 ``[K]`` array, or a text file with one key per line), which lists keys
hottest first; without a file, keys ``0..N-1``, i.e. the PS's first N keys in the dense key
space that ``ps.load`` writes by default. ``"all"``: every key of the file, else
``0..ps.size()-1``. A host cache takes at most its capacity; a linear table only keys in
``[0, rows)``. Rows go in with ``insert(overwrite=False)``, so an update a replica made
meanwhile is never overwritten with an older row.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from hostcache import HostCache, SharedMemBlock
from nvecache.apps.errors import ServiceConfigError
from nvecache.apps.service.config import TableConfig
from nvecache.common.finite import nonfinite_rows

logger = logging.getLogger(__name__)

BATCH = 16_384


def _key_file(path: str, where: str) -> torch.Tensor:
    try:
        if path.endswith(".npy"):
            arr = np.load(path, allow_pickle=False)
        else:
            arr = np.loadtxt(path, dtype=np.int64, ndmin=1)
    except (OSError, ValueError) as e:
        raise ServiceConfigError(where, f"cannot read keys from {path}: {e}") from None
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ServiceConfigError(where, f"{path} must hold a 1-D integer array of keys; got "
                                 f"{arr.dtype} {arr.shape}")
    return torch.from_numpy(arr.astype(np.int64, copy=False))


def warm_keys(cfg: TableConfig, ps: Any) -> torch.Tensor:
    """The keys to pre-load for ``cfg.warmup`` (hottest first), capped to what fits."""
    if cfg.warmup == "none":
        return torch.empty(0, dtype=torch.int64)
    if cfg.warmup_keys is not None:
        keys = _key_file(cfg.warmup_keys, f"{cfg.kind} ({cfg.name}).warmup_keys")
    else:
        n = ps.size() if cfg.warmup == "all" else int(cfg.warmup)
        keys = torch.arange(n if cfg.kind == "hostcache" else min(n, cfg.capacity))
    if cfg.kind == "linear":
        keys = keys[(keys >= 0) & (keys < cfg.capacity)]
    if cfg.warmup != "all":
        keys = keys[: int(cfg.warmup)]
    if cfg.kind == "hostcache" and keys.numel() > cfg.capacity:
        logger.warning("table %s: warm-up of %d keys capped to the capacity %d", cfg.name,
                       keys.numel(), cfg.capacity)
        keys = keys[: cfg.capacity]
    return keys


def load_rows(cfg: TableConfig, table: HostCache | SharedMemBlock, ps: Any,
              keys: torch.Tensor, what: str) -> int:
    """Read ``keys`` from the PS in batches and put the rows found into ``table``."""
    loaded = 0
    with tqdm(total=int(keys.numel()), desc=f"{what} {cfg.name}", unit="row",
              disable=None, leave=False) as bar:
        for start in range(0, keys.numel(), BATCH):  # a loop over batches, not keys
            k = keys[start : start + BATCH]
            if isinstance(table, HostCache):
                if _shares_format(table, ps):
                    # NOTE: the server's stored bytes themselves, as a layer's fills take them
                    values, found = ps.lookup_stored(k)
                else:
                    values, found = _for_cache(cfg, table, *ps.lookup(k))
                # NOTE: the parameter server's rows as it holds them: not checked again
                table.insert(k[found], values[found], overwrite=False, allow_nonfinite=True)
            else:
                values, found = ps.lookup(k)
                values[~found] = 0
                table.write(k, values, allow_nonfinite=True)
            loaded += int(found.sum())
            bar.update(k.numel())
    return loaded


def _shares_format(table: HostCache, ps: Any) -> bool:
    """Whether a quantized host cache stores rows in the server's own format (it then holds
    the server's stored bytes: ``gpu.stacks.misses.tier_formats``)."""
    return table.quantized and ps.quantized and table.row_format == ps.schema.row_format


def _for_cache(cfg: TableConfig, table: HostCache, values: torch.Tensor, found: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The server's rows as a host cache takes them: a plain one's in its dtype (a server
    of another dtype, ``ps_dtype``), a quantized one's as the server returned them (it
    encodes those, as a layer's fill does) less rows holding NaN or an infinity, which it
    cannot hold (logged; the layers read them from the server)."""
    if not table.quantized:
        return values.to(table.geometry.dtype), found
    bad = nonfinite_rows(values)
    if bad is None:
        return values, found
    logger.warning("table %s: %d rows of the parameter server hold NaN or an infinity; a "
                   "quantized host cache does not hold them", cfg.name, int((bad & found).sum()))
    return values, found & ~bad


def warm(cfg: TableConfig, table: HostCache | SharedMemBlock, ps: Any) -> int:
    """Pre-load ``cfg.warmup`` rows; returns the rows the PS had."""
    keys = warm_keys(cfg, ps)
    if keys.numel() == 0:
        return 0
    loaded = load_rows(cfg, table, ps, keys, "warm-up")
    logger.info("table %s: warm-up loaded %d of %d rows", cfg.name, loaded, keys.numel())
    return loaded


def reload_linear(cfg: TableConfig, table: SharedMemBlock, ps: Any) -> int:
    """Read every row of a linear table from the PS again (after a feed gap)."""
    loaded = load_rows(cfg, table, ps, torch.arange(table.num_rows), "reload")
    logger.info("table %s: reloaded %d rows from the parameter server", cfg.name, loaded)
    return loaded
