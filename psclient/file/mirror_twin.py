"""The row mirror's lookup as vectorized numpy: :mod:`psclient.file.mirror_loops`' twin.

It serves a process's mirror reads until the compiled loops are ready
(:mod:`nvecache.common.loop_gate`; :data:`GATE` hands out one or the other), with the compiled
lookup's results (tests hold them equal): the same probe (a key's home slot by the same
hash, then linear probing past tombstones to the key or the first empty slot), one probe
step for every key still probing per pass. Its loads may race a writer as the compiled
loop's may, and every index it can load is valid in the same way; the file's seqlock
(:meth:`psclient.file.mirror.RowMirror.read`) discards such a read.

The mirror's writes have no twin: they run the compiled loops, compiled (or loaded from
numba's cache) on their first call.
"""

from __future__ import annotations

import sys

import numpy as np

from nvecache.common.fmix import fmix64
from nvecache.common.loop_gate import LoopGate
from psclient.file.mirror_layout import EMPTY, TOMB


def _home(keys: np.ndarray, mask: int) -> np.ndarray:
    """Each key's first slot: murmur3's fmix64 of the key, masked."""
    return (fmix64(keys) & np.uint64(mask)).view(np.int64)


def find(skeys: np.ndarray, srows: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """The slot holding each key, or -1."""
    mask = skeys.shape[0] - 1
    slot = np.full(keys.shape[0], -1, np.int64)
    probing = np.arange(keys.shape[0])
    j = _home(keys, mask)
    for _ in range(mask + 1):
        if probing.size == 0:
            break
        r = srows[j]
        here = (r != EMPTY) & (r != TOMB) & (skeys[j] == keys[probing])
        slot[probing[here]] = j[here]
        on = ~(here | (r == EMPTY))
        probing = probing[on]
        j = (j[on] + 1) & mask
    return slot


def lookup(skeys: np.ndarray, srows: np.ndarray, rows: np.ndarray, keys: np.ndarray,
           out: np.ndarray, found: np.ndarray) -> int:
    """Each key's row into ``out`` (zeros where absent) and ``found``; returns the index
    of the first key whose stored value is corrupt (the caller asks the store instead;
    ``out`` and ``found`` then hold the keys before it only), else -1."""
    n = keys.shape[0]
    slot = find(skeys, srows, keys)
    present = slot >= 0
    r = srows[np.where(present, slot, 0)] if n else slot  # NOTE: loaded once, used once
    bad = present & (r < 0)
    first_bad = -1
    if bad.any():  # CORRUPT (or a slot a racing writer just freed: discarded anyway)
        first_bad = int(np.argmax(bad))
        n = first_bad
        present, r, out, found = present[:n], r[:n], out[:n], found[:n]
    found[:] = present
    if n and rows.shape[0]:
        np.take(rows[:, :out.shape[1]], np.where(present, r, 0), axis=0, out=out,
                mode="clip")
        out[~present] = 0
    else:  # NOTE: no rows at all: nothing is present
        out[:] = 0
    return first_bad


#: the compiled loops once ready, this twin until then
GATE = LoopGate("psclient.file.mirror_loops", sys.modules[__name__])
