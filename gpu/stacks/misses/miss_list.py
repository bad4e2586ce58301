"""The misses of a lookup, listed by the lookup kernel itself in pinned host memory.

A Hierarchical lookup must learn on the host which keys missed its GPU cache. Found on
the device, that took a ``nonzero``, a ``unique``, a gather and a copy back, each with its
own launch or sync (bench/RESULTS.md, "Hierarchical layer at serving sizes"). Here the
lookup kernel appends each missed key and its batch position to a list in pinned host
memory mapped for the device (as :mod:`gpu.cuda.host_word` does with one word): after the
lookup's one stream sync the host reads them with plain loads, no copy.

Layout: ``[key, position]`` pairs, the position slots of unused pairs holding -1 (a key
may be any int64, a position never is negative). A kernel program reserves its misses'
pairs with one atomic on a device counter that only grows (atomics on host memory are
not portable over PCIe); the caller passes the counter's value before the lookup
(``start``), which the host knows: it adds each lookup's count after reading it. The
pairs a lookup wrote are a prefix of the list, found by a binary search for the first
unused pair. A lookup whose list was never taken (its call raised, or was interrupted,
between the launch and the read) leaves it open: the next :meth:`MissList.ensure` waits
for the device, empties the list and reads the counter, so no stale pair is ever read as
another lookup's. On the CPU (the interpreter's tests, the torch twin) it is plain
memory.
"""

from __future__ import annotations

import numpy as np
import torch

from gpu.stacks.misses.miss_twin import GATE as MISS_LOOPS


class MissList:
    """One thread's list of a lookup's misses (grown, never shrunk).

    Args:
        device: Where the lookups run.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        #: what the kernels' atomics reserve pairs with (device memory; only grows)
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)
        #: the counter's value before the next lookup
        self.start = 0
        self.cap = 0
        self.view = torch.empty(0, dtype=torch.int64, device=device)
        self._pairs = np.empty((0, 2), dtype=np.int64)
        self._host: torch.Tensor | None = None
        self._open = False  # a lookup was given the list and its misses not yet taken

    def ensure(self, n: int) -> None:
        """Get the list ready for a lookup of ``n`` keys (every one may miss), whose
        misses :meth:`take` then reads."""
        if self._open:
            self._recover()
        self._open = True
        if n <= self.cap:
            return
        cap = max(n, 2 * self.cap, 1024)
        cuda = self.device.type == "cuda"
        host = torch.full((cap, 2), -1, dtype=torch.int64, pin_memory=cuda)
        if cuda:
            from gpu.cuda import runtime as _cuda
            from gpu.cuda.registration import DeviceArray

            ptr = int(_cuda.call("cudaHostGetDevicePointer", host.data_ptr(), 0,
                                 detail="mapping a lookup's miss list"))
            view = torch.as_tensor(DeviceArray(host, ptr, (2 * cap,), (8,), "<i8"),
                                   device=self.device)
        else:
            view = host.view(-1)
        self._host, self.view, self.cap = host, view, cap
        self._pairs = host.numpy()

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """After the lookup finished (its stream synchronized): ``(keys, positions)`` of
        its misses (copies, in the order listed), and the list emptied for the next."""
        self._open = False
        if self.cap == 0 or self._pairs[0, 1] < 0:  # NOTE: every key hit: no call at all
            empty = np.empty(0, dtype=np.int64)
            return empty, empty
        # NOTE: one compiled call (gpu.stacks.misses.miss_loops), or its numpy twin until that is
        # ready
        keys, where = MISS_LOOPS.pick().take_listed(self._pairs)
        hi = keys.size
        self.start += hi
        if self.start > 1 << 30:
            # NOTE: ``start`` goes to the kernel as an int32 (a larger one would compile
            # another variant): the counter starts over, in stream order
            self.counter.zero_()
            self.start = 0
        return keys, where

    def _recover(self) -> None:
        """After a lookup whose misses were never taken: wait for it, then start over."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._pairs[:, 1] = -1
        self.start = int(self.counter.item())
        self._open = False
