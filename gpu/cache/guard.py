"""Order the operations on one GPU cache: a lock between threads, stream order on CUDA.

Every lookup, admission round and invalidation of a cache runs inside its guard. Threads
take turns through a re-entrant lock; on CUDA an operation issued on another stream than
the previous one first makes its stream wait for that one (``wait_stream``: an event
recorded now on the old stream, after everything already queued there), so kernels of
two streams never touch the cache's memory at once. The common case, one stream, costs
one stream-handle read and no event.
"""

from __future__ import annotations

import threading
from typing import Any

import torch


class CacheGuard:
    """``with guard:`` around every operation on one cache."""

    def __init__(self, device: torch.device) -> None:
        self.lock = threading.RLock()
        self._device = device
        self._cuda = device.type == "cuda"
        self._index = device.index if device.index is not None else 0
        self._stream: Any = None  # the stream of the latest operation
        self._raw: int | None = None  # its handle

    def __enter__(self) -> CacheGuard:
        self.lock.acquire()
        if self._cuda:
            raw = torch._C._cuda_getCurrentRawStream(self._index)
            if raw != self._raw:
                current = torch.cuda.current_stream(self._device)
                if self._stream is not None:
                    current.wait_stream(self._stream)
                self._stream, self._raw = current, raw
        return self

    def __exit__(self, *exc: object) -> None:
        self.lock.release()

    @property
    def stream(self) -> Any:
        """The CUDA stream of the operation inside the guard (read it while holding the
        guard; None on the CPU): the caller's current stream, without the cost of
        ``torch.cuda.current_stream()``."""
        return self._stream
