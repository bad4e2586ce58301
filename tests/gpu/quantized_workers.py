"""Spawned writer of tests/gpu/test_linear_quantized_races.py: a process writing versions
of a quantized SharedMemBlock's rows while the test's process looks them up."""

from __future__ import annotations

from typing import Any

import torch

from hostcache import SharedMemBlock


def constant_rows(keys: torch.Tensor, version: int, dim: int) -> torch.Tensor:
    """Row ``k`` at ``version``: every element ``k * 1000 + version`` (a row another key's
    or a torn parameter reads as no version of)."""
    return (keys[:, None] * 1000 + version).float().expand(keys.numel(), dim).contiguous()


def write_versions(name: str, versions: int, started: Any, done: Any) -> None:
    """Write versions ``1 .. versions`` of every row of the block ``name`` once the reader
    has ``started``; even versions in one span, odd ones row by row in a shuffled order
    (the block's two write paths); then set ``done``."""
    with SharedMemBlock.attach(name) as mb:
        keys = torch.arange(mb.num_rows)
        started.wait()
        for v in range(1, versions + 1):
            if v % 2 == 0:
                mb.write(keys, constant_rows(keys, v, mb.dim))
            else:
                shuffled = keys[torch.randperm(keys.numel())]
                mb.write(shuffled, constant_rows(shuffled, v, mb.dim))
        done.set()
