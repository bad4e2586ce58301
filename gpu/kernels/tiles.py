"""Launch settings of the GPU kernels, one frozen object per cache or layer.

A :class:`Tiles` travels with whoever launches the kernels: a ``GPUCache`` holds one (its
``tiles=`` argument, a layer's ``TierConfig.tiles``), the host-tier reader and the GPULayer
gather take one per call. The defaults are the measured ones (bench/RESULTS.md, "GPU cache
kernels", "Host tier read from the GPU"); a bench compares variants by building caches with
``dataclasses.replace(DEFAULT_TILES, ...)``, a test picks small tiles the same way. The
same settings hold whether the kernels are compiled or run by Triton's interpreter.

This module imports without triton.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from gpu.errors import BadArgumentError

__all__ = ["DEFAULT_TILES", "Tiles"]

#: fields that may be 0 (a rule switched off), the others are > 0
_MAY_BE_ZERO = frozenset({"linear_page_order", "host_block_k", "host_one_sort_max"})
#: fields that are Triton block sizes or warp counts: powers of two
_POW2 = frozenset({"lookup_block_k", "lookup_warps", "pooled_block_k", "pooled_warps",
                   "pooled_max_tile",
                   "scatter_block_k", "insert_block_k", "gather_block_k", "gather_warps",
                   "host_block_k", "host_probe_block_k", "host_warps"})


@dataclass(frozen=True)
class Tiles:
    """Keys per program, warps and the batch-size rules of the GPU kernels."""

    #: keys per program of the cache lookups, and their warps
    lookup_block_k: int = 16
    lookup_warps: int = 4
    #: from this many keys a batch over a linear table in host memory is visited in row
    #: (host page) order, by the cache lookups and the GPULayer gather (0: never)
    linear_page_order: int = 1 << 17
    #: keys per program of the pooled lookups (fewer for wide rows: pooled_max_tile), and
    #: their warps
    pooled_block_k: int = 128
    pooled_warps: int = 8
    #: at most this many elements in a pooled program's [keys, row] tile: rows wider than
    #: ``pooled_max_tile // pooled_block_k`` take fewer keys per program (its fp32 sums
    #: live in registers)
    pooled_max_tile: int = 1 << 14
    #: split bags over about this many programs in all, at most this many per bag
    pooled_programs: int = 256
    pooled_max_split: int = 64
    #: keys per program of the cache's row scatter and of its insert launches
    scatter_block_k: int = 16
    insert_block_k: int = 32
    #: keys per program of the GPULayer gather, and its warps
    gather_block_k: int = 16
    gather_warps: int = 4
    #: keys per program of the host-tier row gather (0: ``2048 // BLOCK_D``, at most 32)
    host_block_k: int = 0
    #: keys per program of the host-tier probe, and the host-tier kernels' warps
    host_probe_block_k: int = 64
    host_warps: int = 4
    #: host-tier lookups of up to this many keys dedup and sort with one sort and no host
    #: sync; larger ones with ``torch.unique``, then a sort of the distinct keys by bucket
    host_one_sort_max: int = 1 << 17

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            low = 0 if f.name in _MAY_BE_ZERO else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise BadArgumentError(f"Tiles.{f.name} must be an int >= {low}; got "
                                       f"{value!r}")
            if f.name in _POW2 and value & (value - 1):
                raise BadArgumentError(f"Tiles.{f.name} must be a power of two; got {value!r}")
        # NOTE: hashed once: the object is part of every launch's constexpr key
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name)
                                                     for f in fields(self))))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]


DEFAULT_TILES = Tiles()
