"""The spawned writer of tests/gpu/host/test_quantized_host_race.py: it cycles a quantized host
cache's rows through versions until told to stop, and the rows of each version say which
version they are in their payload and in their scale and bias alike."""

from __future__ import annotations

from typing import Any

import torch

from hostcache import HostCache
from nvecache.common import quant
from nvecache.common.rows import RowFormat

DIM = 24
VERSIONS = 8


def version_rows(keys: torch.Tensor, version: int) -> torch.Tensor:
    """Rows of ``keys`` as write ``version`` writes them: each element ``size`` or
    ``-size / 2`` (``size`` naming key and version), laid out by a mask of the version's
    own. A constant row would not do: its int8 payload is all zeros (the scale 0), the same
    for every write, so a payload torn between two writes, or read with another write's
    bias, would still decode to some write's row. Here the payload holds the version's
    mask (two writes' halves make a mask of neither; the two values stay steps apart in
    both formats) and the scale and bias its size (a foreign one moves every element off
    every version's row)."""
    g = torch.Generator().manual_seed(1000 + version)
    mask = torch.rand(DIM, generator=g) < 0.5
    mask[0], mask[1] = False, True  # NOTE: both values in every row
    size = 1.0 + 0.01 * keys.float()[:, None] + 3.0 * version
    return torch.where(mask[None, :], size, -0.5 * size)


def expected(keys: torch.Tensor, fmt: RowFormat, dtype: torch.dtype) -> torch.Tensor:
    """``[VERSIONS, N, DIM]``: every version's rows as a reader of ``dtype`` reads them."""
    return torch.stack([quant.decode(quant.encode(version_rows(keys, v), fmt), fmt, dtype)
                        for v in range(VERSIONS)])


#: keys one round writes: a window moving over the keys given
WINDOW = 32


def writer(name: str, keys: torch.Tensor, started: Any, done: Any, rounds: Any) -> None:
    """Update a window of ``keys`` with the next version, round after round, the window
    moving over them all, until ``done``; sets ``started`` after the first round and
    leaves the rounds written in ``rounds``."""
    n = 0
    with HostCache.attach(name) as hc:
        versions = [version_rows(keys, v) for v in range(VERSIONS)]
        while not done.is_set():
            idx = (torch.arange(WINDOW) + n * WINDOW) % keys.numel()
            hc.update(keys[idx], versions[(n + 1) % VERSIONS][idx])
            n += 1
            if n == 1:
                started.set()
    rounds.value = n
