"""The row mirror's numpy lookup (psclient.file.mirror_twin) against its compiled one
(psclient.file.mirror_loops.lookup): the same rows, flags and answer for random tables built
by the compiled writes (tombstones, corrupt values, long probe runs) and random batches
(repeated keys, absent keys, empty batches)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from psclient.file import mirror_loops, mirror_twin

RB = 12


def mirror(rng: np.random.Generator, slots: int, n: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(hdr, skeys, srows, rows, keys)``: a table written by the compiled loops with ``n``
    puts (repeated keys among them), some erases and some corrupt values; the keys put."""
    hdr = np.zeros(mirror_loops.HEADER_WORDS, np.int64)
    skeys = np.zeros(slots, np.int64)
    srows = np.full(slots, mirror_loops.EMPTY, np.int64)
    cap = slots
    free = np.zeros(cap, np.int64)
    rows = np.zeros((cap, RB), np.uint8)
    # NOTE: few distinct homes for many keys: long runs of probing past other keys
    keys = rng.choice(rng.integers(-(2**62), 2**62, max(1, n)), n).astype(np.int64)
    vals = rng.integers(0, 256, (n, RB)).astype(np.uint8)
    mirror_loops.put(hdr, skeys, srows, free, rows, keys, vals, False)
    mirror_loops.erase(hdr, skeys, srows, free, keys[rng.random(n) < 0.3])
    mirror_loops.put(hdr, skeys, srows, free, rows, keys[rng.random(n) < 0.2],
                     np.empty((0, RB), np.uint8), True)
    return hdr, skeys, srows, rows, keys


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([16, 64, 256]), st.integers(0, 120),
       st.booleans())
def test_the_lookup_reads_what_the_compiled_one_reads(seed: int, slots: int, batch: int,
                                                       no_corrupt: bool) -> None:
    rng = np.random.default_rng(seed)
    _, skeys, srows, rows, keys = mirror(rng, slots, rng.integers(0, slots * 3 // 4))
    if no_corrupt:  # NOTE: every batch then reads through to its end
        srows[srows == mirror_loops.CORRUPT] = mirror_loops.TOMB
    pool = np.concatenate([keys, rng.integers(-(2**62), 2**62, batch + 1)])
    ask = rng.choice(pool, batch).astype(np.int64) if batch else np.empty(0, np.int64)
    answers = []
    for loops in (mirror_loops, mirror_twin):
        out = np.full((batch, RB), 9, np.uint8)
        found = np.zeros(batch, np.bool_)
        bad = loops.lookup(skeys, srows, rows, ask, out, found)
        upto = batch if bad < 0 else bad  # NOTE: past a corrupt key the outputs are unset
        answers.append((bad, out[:upto].copy(), found[:upto].copy()))
    assert answers[0][0] == answers[1][0]
    np.testing.assert_array_equal(answers[0][1], answers[1][1])
    np.testing.assert_array_equal(answers[0][2], answers[1][2])


def test_an_empty_table_and_an_empty_batch() -> None:
    rng = np.random.default_rng(3)
    _, skeys, srows, rows, _ = mirror(rng, 16, 0)
    for loops in (mirror_loops, mirror_twin):
        out, found = np.empty((0, RB), np.uint8), np.empty(0, np.bool_)
        assert loops.lookup(skeys, srows, rows, np.empty(0, np.int64), out, found) == -1
        out, found = np.ones((3, RB), np.uint8), np.ones(3, np.bool_)
        assert loops.lookup(skeys, srows, rows, np.arange(3, dtype=np.int64), out,
                            found) == -1
        assert not found.any() and not out.any()
