"""The row mirror's per-key loops, compiled by numba: an open-addressing hash table of
int64 keys (linear probing, tombstones) over a separate array of rows.

Arrays (views of the mirror file, :mod:`psclient.file.mirror`): ``skeys`` / ``srows``
int64 ``[slots]`` (``slots`` a power of two): a slot's key and its row's index in ``rows``
(uint8 ``[row_cap, row_bytes]``), or :data:`EMPTY` / :data:`TOMB` / :data:`CORRUPT` (the
store holds a value of the wrong length for that key: a lookup of it asks the store, which
raises); ``free`` int64 ``[row_cap]``: a stack of freed row indices; ``hdr``: the file's
header words (indices in :mod:`psclient.file.mirror_layout`).

Writers keep at least a quarter of the slots :data:`EMPTY` (the caller grows the file
before a write that would fill more), so every probe ends. A reader may run while a writer
changes the arrays: every index it can load is valid (slots hold valid row indices or
sentinels, stored as aligned 8-byte words), so a racing read returns garbage at worst,
never reads out of bounds; the file's seqlock (``file_mirror``) tells it to discard that.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# NOTE: fmix64's multipliers, module-level ints that numba compiles in as constants
from nvecache.common.fmix import M1, M2

# NOTE: the file's words live apart, so that reading a header loads no numba; re-exported
from psclient.file.mirror_layout import (
    BOOT0,
    BOOT1,
    CORRUPT,
    COUNT,
    EMPTY,
    FREE_TOP,
    GEN,
    HEADER_WORDS,
    MAGIC,
    NEXT_ROW,
    ROW_BYTES,
    ROW_CAP,
    SLOTS,
    STATE,
    TOMB,
    TXNID,
    USED,
    VERSION,
)

__all__ = [
    "BOOT0", "BOOT1", "CORRUPT", "COUNT", "EMPTY", "FREE_TOP", "GEN", "HEADER_WORDS", "MAGIC",
    "NEXT_ROW", "ROW_BYTES", "ROW_CAP", "SLOTS", "STATE", "TOMB", "TXNID", "USED", "VERSION",
    "copy_live", "erase", "lookup", "put", "warm_up",
]

_S33 = np.uint64(33)

#: compiled once and cached beside this module; the GIL released inside
_jit = njit(cache=True, nogil=True, boundscheck=False)


@_jit
def _home(key: int, mask: int) -> int:
    """A key's first slot: murmur3's fmix64 of the key, masked."""
    x = np.uint64(key)
    x ^= x >> _S33
    x *= M1
    x ^= x >> _S33
    x *= M2
    x ^= x >> _S33
    return int(np.int64(x & np.uint64(mask)))


@_jit
def _find(skeys: np.ndarray, srows: np.ndarray, key: int) -> int:
    """The slot holding ``key``, or -1."""
    mask = skeys.shape[0] - 1
    j = _home(key, mask)
    for _ in range(mask + 1):
        r = srows[j]
        if r == EMPTY:
            return -1
        if r != TOMB and skeys[j] == key:
            return j
        j = (j + 1) & mask
    return -1


@_jit
def lookup(skeys: np.ndarray, srows: np.ndarray, rows: np.ndarray, keys: np.ndarray,
           out: np.ndarray, found: np.ndarray) -> int:
    """Each key's row into ``out`` (zeros where absent) and ``found``; returns the index
    of a key whose stored value is corrupt (the caller asks the store instead), else -1."""
    row_bytes = out.shape[1]
    for i in range(keys.shape[0]):
        s = _find(skeys, srows, keys[i])
        if s < 0:
            found[i] = False
            for b in range(row_bytes):
                out[i, b] = 0
            continue
        r = srows[s]
        if r < 0:  # CORRUPT (or a slot a racing writer just freed: discarded anyway)
            return i
        found[i] = True
        for b in range(row_bytes):
            out[i, b] = rows[r, b]
    return -1


@_jit
def _take_row(hdr: np.ndarray, free: np.ndarray) -> int:
    top = hdr[FREE_TOP]
    if top > 0:
        hdr[FREE_TOP] = top - 1
        return free[top - 1]
    r = hdr[NEXT_ROW]
    hdr[NEXT_ROW] = r + 1
    return r


@_jit
def put(hdr: np.ndarray, skeys: np.ndarray, srows: np.ndarray, free: np.ndarray,
        rows: np.ndarray, keys: np.ndarray, vals: np.ndarray, corrupt: bool) -> None:
    """Write each key's row (``vals`` uint8 ``[N, row_bytes]``; a repeated key: its last),
    creating absent keys; ``corrupt``: mark the keys :data:`CORRUPT` instead (no rows).
    The caller made room: :func:`room` for ``N`` keys."""
    mask = skeys.shape[0] - 1
    row_bytes = rows.shape[1]
    for i in range(keys.shape[0]):
        k = keys[i]
        j = _home(k, mask)
        tomb = -1
        at = -1
        for _ in range(mask + 1):
            r = srows[j]
            if r == EMPTY:
                break
            if r == TOMB:
                if tomb < 0:
                    tomb = j
            elif skeys[j] == k:
                at = j
                break
            j = (j + 1) & mask
        if at < 0:  # a new key: the first tombstone on its path, else the empty slot
            hdr[COUNT] += 1
            if tomb >= 0:
                at = tomb
            else:
                at = j
                hdr[USED] += 1
            skeys[at] = k
            srows[at] = CORRUPT
        r = srows[at]
        if corrupt:
            if r >= 0:
                free[hdr[FREE_TOP]] = r
                hdr[FREE_TOP] += 1
            srows[at] = CORRUPT
            continue
        if r < 0:
            r = _take_row(hdr, free)
        for b in range(row_bytes):
            rows[r, b] = vals[i, b]
        srows[at] = r


@_jit
def erase(hdr: np.ndarray, skeys: np.ndarray, srows: np.ndarray, free: np.ndarray,
          keys: np.ndarray) -> None:
    """Drop the keys (absent ones ignored); their rows go back to the free stack."""
    for i in range(keys.shape[0]):
        s = _find(skeys, srows, keys[i])
        if s < 0:
            continue
        r = srows[s]
        srows[s] = TOMB
        hdr[COUNT] -= 1
        if r >= 0:
            free[hdr[FREE_TOP]] = r
            hdr[FREE_TOP] += 1


@_jit
def copy_live(skeys: np.ndarray, srows: np.ndarray, rows: np.ndarray, grown_hdr: np.ndarray,
              grown_skeys: np.ndarray, grown_srows: np.ndarray, grown_rows: np.ndarray) -> None:
    """Every live key of one table into an empty, larger one (its rows packed from 0)."""
    grown_mask = grown_skeys.shape[0] - 1
    row_bytes = rows.shape[1]
    for s in range(skeys.shape[0]):
        r = srows[s]
        if r == EMPTY or r == TOMB:
            continue
        k = skeys[s]
        j = _home(k, grown_mask)
        while grown_srows[j] != EMPTY:
            j = (j + 1) & grown_mask
        grown_skeys[j] = k
        if r == CORRUPT:
            grown_srows[j] = CORRUPT
        else:
            grown_row = grown_hdr[NEXT_ROW]
            grown_hdr[NEXT_ROW] = grown_row + 1
            for b in range(row_bytes):
                grown_rows[grown_row, b] = rows[r, b]
            grown_srows[j] = grown_row
        grown_hdr[COUNT] += 1
        grown_hdr[USED] += 1


def warm_up() -> None:
    """Compile every loop (or load it from numba's cache) in the argument types the row
    mirror calls them with, rows read-only too (a rebuild's rows come from LMDB's bytes);
    :mod:`nvecache.common.loop_gate` runs this in a child process, then here."""
    slots, cap, rb = 16, 4, 8
    hdr = np.zeros(HEADER_WORDS, np.int64)
    skeys = np.zeros(slots, np.int64)
    srows = np.full(slots, EMPTY, np.int64)
    free = np.zeros(cap, np.int64)
    rows = np.zeros((cap, rb), np.uint8)
    keys = np.arange(1, dtype=np.int64)
    vals = np.zeros((1, rb), np.uint8)
    frozen = vals.copy()
    frozen.flags.writeable = False
    lookup(skeys, srows, rows, keys, vals.copy(), np.zeros(1, np.bool_))
    put(hdr, skeys, srows, free, rows, keys, vals, False)
    put(hdr, skeys, srows, free, rows, keys, frozen, False)
    erase(hdr, skeys, srows, free, keys)
    copy_live(skeys, srows, rows, np.zeros(HEADER_WORDS, np.int64), skeys.copy(),
              np.full(slots, EMPTY, np.int64), rows.copy())
