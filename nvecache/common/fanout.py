"""A large batch's compiled loop split over a few threads.

The compiled loops that read rows by key (the ``file://`` row mirror's lookup, the host
cache's) release the GIL and cost about as much as the memory they touch: one random
read per row, most of it waiting on memory; the quantized codec's loops
(:mod:`nvecache.common.quant`) release it too. Over a few thousand keys, running disjoint
chunks of the batch on a few threads at once divides that wait (bench/RESULTS.md,
"Hierarchical layer at serving sizes"). Small batches run on the caller alone: handing a
chunk to another thread costs tens of microseconds.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

#: the fewest keys a chunk gets: smaller batches run on the caller's thread alone
MIN_CHUNK = 1024
#: at most this many threads read one batch (the caller and the pool's)
MAX_THREADS = max(1, min(4, os.cpu_count() or 1))

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _the_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(MAX_THREADS - 1, thread_name_prefix="nvecache-split")
        return _pool


def _forget_pool_in_child() -> None:
    """A forked child has none of its parent's threads: it starts a pool of its own."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_in_child)


def split_run(fn: Callable[[int, int], T], n: int, min_chunk: int = MIN_CHUNK) -> list[T]:
    """``fn(lo, hi)`` over ``[0, n)`` in contiguous chunks of at least ``min_chunk``, on up
    to ``MAX_THREADS`` threads (the caller runs the first); the results in chunk order.
    ``fn`` must touch only its chunk's part of any output. Returns only once every chunk
    is done, also when one raised (the first error is raised then)."""
    parts = min(MAX_THREADS, n // max(1, min_chunk))
    if parts <= 1:
        return [fn(0, n)]
    bounds = [n * i // parts for i in range(parts + 1)]
    pool = _the_pool()
    futures: list[Future[T]] = [pool.submit(fn, bounds[i], bounds[i + 1])
                                for i in range(1, parts)]
    try:
        first = fn(bounds[0], bounds[1])
    finally:
        # NOTE: no chunk may still write into the caller's outputs once this returns
        errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e
    return [first] + [f.result() for f in futures]
