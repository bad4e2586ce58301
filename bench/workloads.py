"""Key streams of the standard workload: Zipf by inverse CDF over
the table, then a random permutation so hot keys are spread over the key space.

The generator itself is the demo's (``nvecache.apps.demo.workload.ZipfKeys``); benchmarks use
one seed for both the popularity permutation and the draws.
"""

from __future__ import annotations

from nvecache.apps.demo.workload import ZipfKeys as _ZipfKeys


class ZipfKeys(_ZipfKeys):
    """Draws int64 keys in ``[0, num_keys)`` with P(rank r) ~ 1 / r**alpha (alpha 0: uniform)."""

    def __init__(self, num_keys: int, alpha: float, *, seed: int = 0) -> None:
        super().__init__(num_keys, alpha, popularity_seed=seed, seed=seed)


def compiled_loops(timeout: float = 600.0) -> int:
    """Wait (at most ``timeout`` seconds each) until the per-key loops a process has asked
    for are compiled, so that timed calls measure them and not their numpy twins (which
    serve while the loops compile in the background: ``nvecache.common.loop_gate``);
    returns how many calls the twins have answered so far. Take it before and after the
    timed calls: a difference means some timed call ran a twin."""
    from nvecache.common.loop_gate import gates

    made = gates()
    for g in made:
        if g.twin_picks:
            g.wait(timeout)
    return sum(g.twin_picks for g in made)
