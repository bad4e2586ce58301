"""How a Hierarchical lookup's misses, listed on the host, get their rows onto its device:
one object per stack, chosen when the stack is built (:func:`read_path`).

- :class:`HostReads` (the CPU; CUDA without a host cache to register): the distinct
  misses are read on the CPU (:class:`gpu.stacks.misses.resolver.Resolver`) straight into one
  buffer (on CUDA this thread's pinned one, :mod:`gpu.stacks.misses.staging`): each miss's key,
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

from gpu.stacks.misses.admission import PendingAdmissions
from gpu.stacks.misses.miss_twin import GATE as MISS_LOOPS
from gpu.stacks.misses.resolver import Resolver
from gpu.stacks.misses.staging import HostBuffer, PinnedStaging


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
               since: int) -> None:
        """Fetched rows wait for their GPU admission (default rows never go in): ``found``
        is None (every row was found), bool flags on the device, or the found rows'
        indices (int64)."""
        if found is not None and found.dtype != torch.bool:
            keys, rows, found = keys.index_select(0, found), rows.index_select(0, found), None
        self._pending.offer(keys, rows, since, self._share, found)

    def serve(self, mkeys: np.ndarray, mpos: np.ndarray, since: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows [M, dim], positions [M])`` on the device of a lookup's misses (``mkeys``
        and their batch positions ``mpos`` on the host, keys maybe repeated), read from
        the tiers below the GPU cache after feed cursor ``since``; the rows found are
        offered to the GPU cache (on the caller's stream, on CUDA)."""
        ukeys, inverse = MISS_LOOPS.pick().dedup_first(mkeys)  # NOTE: compiled once ready
        return self._on_host(mkeys, mpos, ukeys, inverse, since)

    def _on_host(self, mkeys: np.ndarray, mpos: np.ndarray, ukeys: np.ndarray,
                 inverse: np.ndarray, since: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Distinct misses read on the CPU straight into one buffer: each miss's key,
        position and row (and the found ones' indices), sent in one copy."""
        res = self.resolver
        n_distinct, n_missed, row_bytes = ukeys.size, mkeys.size, res.row_bytes
        # NOTE: keys, positions, the found ones' indices (at most one per miss), each from
        # a 16-byte boundary, then the rows
        n2 = _even(n_missed)
        at_rows = 3 * n2 * 8
        nbytes = at_rows + n_missed * row_bytes
        staging = self.staging()
        buf = staging.take(nbytes)
        ints = buf[:at_rows].view(np.int64)
        rows_at = buf[at_rows:].reshape(n_missed, row_bytes)
        # NOTE: no key repeated (the common case): the distinct keys are the misses in
        # order, and their rows go straight into place
        repeated = n_distinct != n_missed
        distinct_rows = np.empty((n_distinct, row_bytes), np.uint8) if repeated else rows_at
        found = res.resolve(ukeys, distinct_rows, since)
        if repeated:
            np.take(distinct_rows, inverse, axis=0, out=rows_at)
            found = None if found is None else found[inverse]
        ints[:n_missed] = mkeys
        ints[n2:n2 + n_missed] = mpos
        found_at = np.empty(0, np.int64) if found is None else np.flatnonzero(found)
        ints[2 * n2:2 * n2 + found_at.size] = found_at
        dev = staging.send(nbytes)
        sent_ints = dev[:at_rows].view(torch.int64)
        rows = dev[at_rows:].view(res.dtype).view(n_missed, res.dim)
        # NOTE: offered per miss (a key repeated in the batch is offered as often as it
        # missed; an insert keeps one of equal rows)
        found_sent = (None if found is None
                      else sent_ints[2 * n2:2 * n2 + found_at.size])
        self._offer(sent_ints[:n_missed], rows, found_sent, since)
        return rows, sent_ints[n2:n2 + n_missed]


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

    def flags(self) -> PinnedStaging:
        """This thread's pinned buffer for the hit flags of the GPU's host-cache read."""
        buf = getattr(self._local, "flags", None)
        if buf is None:
            buf = self._local.flags = PinnedStaging(self.device)
        return buf

    def serve(self, mkeys: np.ndarray, mpos: np.ndarray, since: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        ukeys, inverse = MISS_LOOPS.pick().dedup_first(mkeys)
        if ukeys.size < self._gpu_read_keys:
            return self._on_host(mkeys, mpos, ukeys, inverse, since)
        return self._on_device(ukeys, inverse, mpos, since)

    def _on_device(self, ukeys: np.ndarray, inverse: np.ndarray, mpos: np.ndarray,
                   since: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The distinct keys, positions and distinct indices go to the device first (one
        copy from the pinned buffer); the GPU kernel reads the host cache, its hit flags
        come back in one copy and sync; the rows of the rest, and their indices, go over
        in one copy from the pinned buffer."""
        from gpu.kernels.host_reads import hostcache_lookup

        res = self.resolver
        staging = self.staging()
        n_distinct, n_missed, row_bytes = ukeys.size, mpos.size, res.row_bytes
        at_pos = _even(n_distinct)
        at_inverse = at_pos + _even(n_missed)
        idx = staging.take(8 * (at_inverse + n_missed)).view(np.int64)
        idx[:n_distinct], idx[at_pos:at_pos + n_missed], idx[at_inverse:] = ukeys, mpos, inverse
        sent = staging.send(idx.nbytes).view(torch.int64)
        distinct_keys, pos = sent[:n_distinct], sent[at_pos:at_pos + n_missed]
        distinct_of = sent[at_inverse:]
        # NOTE: a quantized host cache's rows dequantized in the gather, in the layer's dtype
        distinct_rows, hit = hostcache_lookup(self.registration, distinct_keys,
                                              out_dtype=res.dtype)
        # NOTE: the flags come back into this thread's pinned buffer (no allocation a
        # call); the worker's report gets a copy, the buffer serves the next call
        hit_np = self.flags().receive(hit).view(np.bool_)
        torch.cuda.current_stream(self.device).synchronize()
        n_hit = int(np.count_nonzero(hit_np))
        res.count_gpu_reads(ukeys, hit_np.copy(), n_hit)
        if n_hit == n_distinct:
            self._offer(distinct_keys, distinct_rows, None, since)
            return distinct_rows.index_select(0, distinct_of), pos
        rest = np.flatnonzero(~hit_np)
        n_rest = rest.size
        # NOTE: the pinned buffer's copy of this call's indices is done: the sync above
        at_rows = 8 * _even(n_rest)
        at_found = at_rows + n_rest * row_bytes
        buf = staging.take(at_found + n_rest)
        buf[:8 * n_rest] = rest.view(np.uint8)
        found = res.resolve(ukeys[rest], buf[at_rows:at_found].reshape(n_rest, row_bytes),
                            since, from_host=False)
        buf[at_found:] = True if found is None else found.view(np.uint8)
        dev = staging.send(at_found + n_rest)
        rest_sent = dev[:8 * n_rest].view(torch.int64)
        rest_rows = dev[at_rows:at_found].view(res.dtype).view(n_rest, res.dim)
        distinct_rows.index_copy_(0, rest_sent, rest_rows)
        if found is None:
            self._offer(distinct_keys, distinct_rows, None, since)
        else:
            flags = hit.clone()
            flags.index_copy_(0, rest_sent, dev[at_found:].view(torch.bool))
            self._offer(distinct_keys, distinct_rows, flags, since)
        return distinct_rows.index_select(0, distinct_of), pos


def _even(n: int) -> int:
    """``n`` int64s rounded up to a whole number of 16-byte steps: what each array sent
    in one buffer starts after, so that every pointer a kernel gets is 16-byte aligned
    whatever the batch (Triton compiles a variant per pointer alignment: a misaligned
    one would compile again in the middle of serving, and load narrower)."""
    return n + (n & 1)


def read_path(resolver: Resolver, device: torch.device, pending: PendingAdmissions,
              share: float, registration: Any, gpu_read_keys: int) -> HostReads:
    """The read path of a stack on ``device``: :class:`DeviceReads` where the host cache
    is registered with CUDA (``registration``), else :class:`HostReads`."""
    if device.type == "cuda" and registration is not None:
        return DeviceReads(resolver, device, pending, share, registration, gpu_read_keys)
    return HostReads(resolver, device, pending, share)
