"""One pinned host buffer per thread for what a lookup resolved on the host (its missed
rows and the indices that place them), sent to the device in one non-blocking copy; and
one for what comes back (the hit flags of the GPU's read of the host cache).

A pageable ``.to(device)`` stages through a driver buffer and returns only once copied:
a Hierarchical lookup that resolved its misses on the CPU made several of them per
call (bench/RESULTS.md, "Hierarchical layer at serving sizes"). From pinned memory one
copy is queued and the call goes on.

Reuse: the next lookup of the same thread on the same stream first synchronizes that
stream (to learn its misses), so the copy queued from this buffer by the call before is
done; a lookup on another stream than the last copy's first waits for the device.

On the CPU :class:`HostBuffer` stands in: the rows are already where they are used.
"""

from __future__ import annotations

import numpy as np
import torch


class PinnedStaging:
    """A growable pinned buffer and the stream of the last copy out of it (CUDA only)."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._index = device.index if device.index is not None else 0
        self._buf = torch.empty(0, dtype=torch.uint8)
        self._np = self._buf.numpy()
        self._raw: int | None = None  # the stream handle of the last copy out

    def take(self, nbytes: int) -> np.ndarray:
        """The buffer's first ``nbytes`` bytes to fill, no copy out of it still running."""
        raw = torch._C._cuda_getCurrentRawStream(self._index)
        if self._raw is not None and raw != self._raw:
            torch.cuda.synchronize(self._device)  # NOTE: another stream's copy may read it
            self._raw = None
        if self._np.shape[0] < nbytes:
            # NOTE: the old buffer is the caching host allocator's until its copies finish
            size = max(nbytes, 2 * self._np.shape[0], 1 << 16)
            self._buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            self._np = self._buf.numpy()
        return self._np[:nbytes]

    def send(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` bytes on the device (a new uint8 tensor), copy queued on the
        current stream."""
        self._raw = torch._C._cuda_getCurrentRawStream(self._index)
        return self._buf[:nbytes].to(self._device, non_blocking=True)

    def receive(self, src: torch.Tensor) -> np.ndarray:
        """The bytes of ``src`` (a tensor on the device) copied into the buffer on the
        current stream: a view of them. Synchronize that stream before reading them or
        taking the buffer again (the copy writes it meanwhile); they stay valid until the
        buffer's next :meth:`take`."""
        raw = src.reshape(-1).view(torch.uint8)
        out = self.take(raw.numel())
        self._buf[: raw.numel()].copy_(raw, non_blocking=True)
        self._raw = torch._C._cuda_getCurrentRawStream(self._index)
        return out


class HostBuffer:
    """:class:`PinnedStaging`'s stand-in on the CPU: each :meth:`take` a fresh array (rows
    sent out of it may wait in an admission round), :meth:`send` that very array as a
    tensor, no copy."""

    def __init__(self) -> None:
        self._last = np.empty(0, np.uint8)

    def take(self, nbytes: int) -> np.ndarray:
        self._last = np.empty(nbytes, np.uint8)
        return self._last

    def send(self, nbytes: int) -> torch.Tensor:
        return torch.from_numpy(self._last[:nbytes])
