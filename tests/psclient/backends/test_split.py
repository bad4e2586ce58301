"""``nvecache.common.fanout``: a batch's loop over threads gives what one call over the whole
batch gives, and never returns while a chunk still runs."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from nvecache.common import fanout as split


def test_chunks_cover_the_batch_once_in_order() -> None:
    n = 10_007
    out = np.zeros(n, np.int64)
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def fn(lo: int, hi: int) -> int:
        out[lo:hi] += np.arange(lo, hi)
        with lock:
            seen.append((lo, hi))
        return hi - lo

    sizes = split.split_run(fn, n, min_chunk=1000)
    assert sum(sizes) == n and np.array_equal(out, np.arange(n))
    assert len(sizes) == min(split.MAX_THREADS, n // 1000)
    spans = sorted(seen)
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert split.split_run(fn, 999, min_chunk=1000) == [999]  # small: the caller alone


@pytest.mark.skipif(split.MAX_THREADS < 2, reason="needs two CPUs to split a batch")
def test_an_error_in_any_chunk_is_raised_after_every_chunk_finished() -> None:
    n = 4_000
    parts = min(split.MAX_THREADS, n // 1000)
    done = np.zeros(n, np.bool_)
    failed = threading.Event()

    def fn(lo: int, hi: int) -> None:
        if lo == 0:
            failed.set()
            raise ValueError("first chunk failed")
        assert failed.wait(10)  # NOTE: the others write only after the first one raised
        done[lo:hi] = True

    with pytest.raises(ValueError, match="first chunk failed"):
        split.split_run(fn, n, min_chunk=1000)
    assert done[n // parts:].all() and not done[:n // parts].any()
