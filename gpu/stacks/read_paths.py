"""How a Hierarchical lookup's misses, listed on the host, get their rows onto its device:
one object per stack, chosen when the stack is built (:func:`read_path`).

- :class:`HostReads` (the CPU; CUDA without a host cache to register): the distinct
  misses are read on the CPU (:class:`gpu.stacks.resolver.Resolver`) straight into one
  buffer (on CUDA this thread's pinned one, :mod:`gpu.stacks.staging`): each miss's key,
  position and row, sent in one copy.
- :class:`DeviceReads` (CUDA with a registered host cache): from
  ``TierConfig.host_gpu_read_keys`` distinct misses on, the GPU reads the host cache
  itself (:mod:`gpu.kernels.host_reads`), the parameter server and the default row the
  rest; fewer are read as :class:`HostReads` does: the GPU's seqlock read of the host
  cache costs a fixed price per call however few the keys, and its hits then need
  reporting to the host cache's policy (bench/RESULTS.md, "Hierarchical layer at serving
  sizes").

Either way :meth:`HostReads.serve` returns each miss's row and batch position on the
device, and hands the rows found to the stack's admission: a row lookup
places them with one scatter, a pooled one adds them to its bags.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from gpu.stacks.admission import PendingAdmissions
from gpu.stacks.miss_twin import GATE as MISS_LOOPS
from gpu.stacks.resolver import Resolver
from gpu.stacks.staging import HostBuffer, PinnedStaging


class HostReads:
    """Misses read on the CPU, sent to the device in one copy.

    Args:
        resolver: The tiers below the GPU cache.
        device: The stack's device.
        pending: The stack's admission, where fetched rows wait for the GPU cache.
        share: The probability that a fetched row is offered to it (``InsertPolicy.gpu``).
    """

    def __init__(self, resolver: Resolver, device: torch.device, pending: PendingAdmissions,
                 share: float) -> None:
        self.resolver = resolver
        self.device = device
        self._pending, self._share = pending, share
        self._pinned = device.type == "cuda"
        self._local = threading.local()  # each thread's staging buffer

    def staging(self) -> PinnedStaging | HostBuffer:
        """This thread's buffer to send rows from."""
        buf = getattr(self._local, "staging", None)
        if buf is None:
            buf = self._local.staging = (PinnedStaging(self.device) if self._pinned
                                         else HostBuffer())
        return buf

    def _offer(self, keys: torch.Tensor, rows: torch.Tensor, found: torch.Tensor | None,
               complete: bool, since: int, stream: Any) -> None:
        """Fetched rows wait for their GPU admission (default rows never go in): unless
        ``complete``, ``found`` flags the found keys, or lists their positions (int64)."""
        if not complete:
            assert found is not None
            if found.dtype == torch.bool:
                keys, rows = keys[found], rows[found]
            else:
                keys, rows = keys.index_select(0, found), rows.index_select(0, found)
        self._pending.offer(keys, rows, since, self._share, stream)

    def serve(self, mkeys: np.ndarray, mpos: np.ndarray, since: int, stream: Any
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows [M, dim], positions [M])`` on the device of a lookup's misses (``mkeys``
        and their batch positions ``mpos`` on the host, keys maybe repeated), read from
        the tiers below the GPU cache after feed cursor ``since``; the rows found are
        offered to the GPU cache (queued on ``stream``, the caller's, on CUDA)."""
        ukeys, inverse = MISS_LOOPS.pick().dedup_first(mkeys)  # NOTE: compiled once ready
        return self._on_host(mkeys, mpos, ukeys, inverse, since, stream)

    def _on_host(self, mkeys: np.ndarray, mpos: np.ndarray, ukeys: np.ndarray,
                 inverse: np.ndarray, since: int, stream: Any
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Distinct misses read on the CPU straight into one buffer: each miss's key,
        position and row (and the found ones' indices), sent in one copy."""
        res = self.resolver
        u, m, rb = ukeys.size, mkeys.size, res.row_bytes
        at_rows = 3 * m * 8  # NOTE: keys, positions, the found ones' indices (at most m)
        nbytes = at_rows + m * rb
        staging = self.staging()
        buf = staging.take(nbytes)
        ints = buf[:at_rows].view(np.int64)
        rows_at = buf[at_rows:].reshape(m, rb)
        # NOTE: no key repeated (the common case): the distinct keys are the misses in
        # order, and their rows go straight into place
        urows = rows_at if u == m else np.empty((u, rb), np.uint8)
        found = res.resolve(ukeys, urows, since)
        if u != m:
            np.take(urows, inverse, axis=0, out=rows_at)
            found = None if found is None else found[inverse]
        ints[:m] = mkeys
        ints[m:2 * m] = mpos
        hit_at = np.empty(0, np.int64) if found is None else np.flatnonzero(found)
        ints[2 * m:2 * m + hit_at.size] = hit_at
        dev = staging.send(nbytes)
        dints = dev[:at_rows].view(torch.int64)
        rows = dev[at_rows:].view(res.dtype).view(m, res.dim)
        # NOTE: offered per miss (a key repeated in the batch is offered as often as it
        # missed; an insert keeps one of equal rows)
        at = None if found is None else dints[2 * m:2 * m + hit_at.size]
        self._offer(dints[:m], rows, at, found is None, since, stream)
        return rows, dints[m:2 * m]


class DeviceReads(HostReads):
    """:class:`HostReads`, except that from ``gpu_read_keys`` distinct misses on the GPU
    reads the registered host cache itself.

    Args:
        registration: The host cache's CUDA registration (:mod:`gpu.cuda.registration`).
        gpu_read_keys: Distinct misses from which the GPU reads the host cache.
    """

    def __init__(self, resolver: Resolver, device: torch.device, pending: PendingAdmissions,
                 share: float, registration: Any, gpu_read_keys: int) -> None:
        super().__init__(resolver, device, pending, share)
        self.registration = registration
        self._gpu_read_keys = gpu_read_keys

    def serve(self, mkeys: np.ndarray, mpos: np.ndarray, since: int, stream: Any
              ) -> tuple[torch.Tensor, torch.Tensor]:
        ukeys, inverse = MISS_LOOPS.pick().dedup_first(mkeys)
        if ukeys.size < self._gpu_read_keys:
            return self._on_host(mkeys, mpos, ukeys, inverse, since, stream)
        return self._on_device(ukeys, inverse, mpos, since, stream)

    def _on_device(self, ukeys: np.ndarray, inverse: np.ndarray, mpos: np.ndarray,
                   since: int, stream: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The distinct keys, positions and distinct indices go to the device first (one
        copy from the pinned buffer); the GPU kernel reads the host cache, its hit flags
        come back in one copy and sync; the rows of the rest, and their indices, go over
        in one copy from the pinned buffer."""
        from gpu.kernels.host_reads import hostcache_lookup

        res = self.resolver
        staging = self.staging()
        u, m, rb = ukeys.size, mpos.size, res.row_bytes
        idx = staging.take(8 * (u + 2 * m)).view(np.int64)
        idx[:u], idx[u:u + m], idx[u + m:] = ukeys, mpos, inverse
        dev_idx = staging.send(idx.nbytes).view(torch.int64)
        dkeys, pos, inv = dev_idx[:u], dev_idx[u:u + m], dev_idx[u + m:]
        urows, hit = hostcache_lookup(self.registration, dkeys)
        hit_host = torch.empty(u, dtype=torch.bool, pin_memory=True)
        hit_host.copy_(hit, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        hit_np = hit_host.numpy()
        nh = int(np.count_nonzero(hit_np))
        res.count_gpu_reads(ukeys, hit_np, nh)
        if nh == u:
            self._offer(dkeys, urows, hit, True, since, stream)
            return urows.index_select(0, inv), pos
        need = np.flatnonzero(~hit_np)
        k = need.size
        # NOTE: the pinned buffer's copy of this call's indices is done: the sync above
        at_rows = 8 * k
        at_found = at_rows + k * rb
        buf = staging.take(at_found + k)
        buf[:at_rows] = need.view(np.uint8)
        found = res.resolve(ukeys[need], buf[at_rows:at_found].reshape(k, rb), since,
                            from_host=False)
        buf[at_found:] = True if found is None else found.view(np.uint8)
        dev = staging.send(at_found + k)
        need_d = dev[:at_rows].view(torch.int64)
        urows.index_copy_(0, need_d, dev[at_rows:at_found].view(res.dtype).view(k, res.dim))
        if found is None:
            self._offer(dkeys, urows, hit, True, since, stream)
        else:
            flags = hit.clone()
            flags.index_copy_(0, need_d, dev[at_found:].view(torch.bool))
            self._offer(dkeys, urows, flags, False, since, stream)
        return urows.index_select(0, inv), pos


def read_path(resolver: Resolver, device: torch.device, pending: PendingAdmissions,
              share: float, registration: Any, gpu_read_keys: int) -> HostReads:
    """The read path of a stack on ``device``: :class:`DeviceReads` where the host cache
    is registered with CUDA (``registration``), else :class:`HostReads`."""
    if device.type == "cuda" and registration is not None:
        return DeviceReads(resolver, device, pending, share, registration, gpu_read_keys)
    return HostReads(resolver, device, pending, share)
