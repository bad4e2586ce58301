"""The tunables of the cached layer stacks, in one frozen object.

Every field has a measured default (bench/RESULTS.md, "Layers (H200)" and "Per-call
path"); a layer takes another through its ``tuning=`` argument.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from gpu.errors import BadArgumentError
from gpu.kernels.tiles import DEFAULT_TILES, Tiles

#: the GPU cache backends a layer may ask for (``gpu.cache.backend``)
CacheBackend = Literal["auto", "torch", "triton"]
CACHE_BACKENDS: tuple[CacheBackend, ...] = ("auto", "torch", "triton")


@dataclass(frozen=True)
class TierConfig:
    """How a cached stack admits rows into its GPU cache.

    Hierarchical layers gather the rows their lookups fetched from the lower tiers and
    admit them in rounds: a round starts once ``admit_keys`` keys (at most
    ``admit_fraction`` of the cache's slots) or ``admit_batches`` lookups have gathered.
    LinearUVM layers log their misses on the device and admit them in rounds too: while
    the cache fills, and for lookups of at least ``admit_fraction`` of its slots, once
    that many keys were looked up; for smaller lookups of a warm cache, once
    ``round_lookups`` lookups or ``round_capacities`` times its slots of keys have gone
    by. A warm cache (offered ``warm_capacities`` times as many keys as it has slots)
    takes at most ``warm_round_fraction`` of its slots per round.
    """

    admit_keys: int = 1 << 20
    admit_fraction: float = 1 / 4
    admit_batches: int = 32
    #: at most this many of a GPU lookup's host-cache hits are reported to the host cache's
    #: eviction policy (weighted by hits / sample), so its counters see the GPU's traffic.
    host_touch_sample: int = 4096
    #: the host-cache worker (gpu.stacks.misses.host_filler) runs once fills and hit reports of
    #: this many
    #: keys have queued, or ``host_linger_s`` seconds after the first of them: fewer,
    #: larger host-cache inserts, less of the GIL taken from the lookups.
    host_batch_keys: int = 2048
    host_linger_s: float = 0.01
    #: a CUDA Hierarchical lookup reads its GPU misses from the host cache with the GPU
    #: kernel from this many distinct keys on; fewer are read on the CPU and copied over.
    host_gpu_read_keys: int = 4096
    warm_round_fraction: float = 1 / 8
    #: a cache is warm once offered this many times its slots of keys: with repeated keys
    #: (Zipf) one capacity's worth leaves it far from full (bench/RESULTS.md, "GPU-cache
    #: admission").
    warm_capacities: float = 4.0
    round_lookups: int = 128
    round_capacities: float = 16.0
    #: the GPU cache's backend (``gpu.cache.backend``): ``"auto"`` (Triton on CUDA where it
    #: is importable, else the torch twin), ``"torch"``, or ``"triton"`` (on a CPU layer the
    #: kernels run under Triton's interpreter: tests)
    cache_backend: CacheBackend = "auto"
    #: the kernels' launch settings (``gpu.kernels.tiles``)
    tiles: Tiles = field(default=DEFAULT_TILES)

    def __post_init__(self) -> None:
        if self.cache_backend not in CACHE_BACKENDS:
            raise BadArgumentError(f"TierConfig.cache_backend must be one of "
                                   f"{', '.join(CACHE_BACKENDS)}; got {self.cache_backend!r}")
        if not isinstance(self.tiles, Tiles):
            raise BadArgumentError(f"TierConfig.tiles must be a gpu.kernels.tiles.Tiles; got "
                                   f"{self.tiles!r}")
        for f in fields(self):
            if f.name in ("cache_backend", "tiles"):
                continue
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise BadArgumentError(f"TierConfig.{f.name} must be a number > 0; got "
                                       f"{value!r}")
        for name in ("admit_fraction", "warm_round_fraction"):
            if getattr(self, name) > 1:
                raise BadArgumentError(f"TierConfig.{name} must be in (0, 1]; got "
                                       f"{getattr(self, name)!r}")


DEFAULT = TierConfig()
