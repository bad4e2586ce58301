"""What a Hierarchical stack's lookups met below its GPU cache, counted in this process.

One named record per stack, written by its miss path (:mod:`gpu.stacks.misses.resolver`) and its
host-cache filler, read by ``stats()``. Plain integers, as the counters of the GPU cache are:
a count that two threads raise at once may lose one increment, never corrupt a lookup.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu.layer_config import TierStats


@dataclass
class MissCounters:
    """Counts of the tiers below the GPU cache."""

    #: distinct missed keys the host cache held (read by the CPU or by the GPU kernel)
    host_hits: int = 0
    #: distinct missed keys the host cache did not hold
    host_misses: int = 0
    #: rows the host-cache fills placed
    host_placed: int = 0
    #: residents those fills evicted
    host_evicted: int = 0
    #: keys the parameter server held
    storage_found: int = 0
    #: keys the parameter server did not hold
    storage_missing: int = 0
    #: keys in no tier, served the default row
    default_rows: int = 0

    def count_host(self, keys: int, hits: int) -> None:
        self.host_hits += hits
        self.host_misses += keys - hits

    def count_storage(self, keys: int, found: int) -> None:
        self.storage_found += found
        self.storage_missing += keys - found

    def host(self) -> TierStats:
        return TierStats(self.host_hits, self.host_misses, self.host_placed, self.host_evicted)

    def storage(self) -> TierStats:
        return TierStats(self.storage_found, self.storage_missing)
