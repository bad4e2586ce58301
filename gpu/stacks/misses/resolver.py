"""The tiers below a Hierarchical stack's GPU cache, read in order: the shared host cache,
the parameter server, the default row.

:class:`Resolver` reads the rows of distinct missed keys on the CPU into a buffer of raw
row bytes the caller provides (where the rows then travel to the device from:
:mod:`gpu.stacks.misses.read_paths`). Rows the parameter server gave are offered to the host
cache with ``overwrite=False`` and a cursor check (``since``), so a concurrent ``update``
(the parameter server first, then the host cache, announced to every process) always
wins; those fills, and the reports of host-cache hits the GPU read itself, run on the
stack's worker thread (:mod:`gpu.stacks.misses.host_filler`): no lookup waits for them.

A quantized host cache's rows are decoded straight into that buffer, in the layer's dtype
(``HostCache.lookup(out=)``); rows the parameter server gives are returned as the host
cache would return them, and fill it with their stored bytes (the server's own where the
two share the format: :mod:`gpu.stacks.misses.tier_formats`).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from gpu.errors import KeyNotFoundError, StorageUnavailableError
from gpu.layer_config import InsertPolicy
from gpu.stacks.misses.counters import MissCounters
from gpu.stacks.misses.host_filler import HostFiller
from gpu.stacks.misses.tier_formats import TierFormats
from nvecache.common import rows
from psclient import PSClientError

logger = logging.getLogger(__name__)


def touch_sample(host: Any, keys: torch.Tensor, hit: torch.Tensor, hits: int,
                 sample: int) -> None:
    """Report ``hits`` host-cache hits read elsewhere (``keys[hit]``, CPU tensors) to its
    eviction policy: a sample of at most ``sample`` hit keys, each counted ``hits /
    sample`` times, so the policy sees the GPU's traffic at a bounded cost. Selected in
    numpy (see :meth:`Resolver._fill`: the worker never fans out to torch's intra-op
    threads)."""
    if hits == 0:
        return
    hk = keys.numpy()[hit.numpy()]
    weight = 1
    if hits > sample:
        pick = torch.randint(0, hits, (sample,)).numpy()
        hk, weight = hk[pick], max(1, round(hits / sample))
    host.touch(torch.from_numpy(hk), weight)


def _concat_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(rows)`` of contiguous CPU row blocks of one dtype, copied by numpy as
    bytes (any dtype, bfloat16 too) on the calling thread alone."""
    if len(rows) == 1:
        return rows[0]
    first = rows[0]
    raw = np.concatenate([r.contiguous().view(torch.uint8).numpy() for r in rows])
    return torch.from_numpy(raw).view(first.dtype)


class Resolver:
    """Reads distinct keys through the host cache, the parameter server and the default
    row (any of the three may be absent), counting what each tier answered.

    Args:
        host_cache: The shared ``HostCache``, or None.
        ps: The ``ParameterServer``, or None.
        default_row: The row of keys in no tier (``[dim]``), or None: KeyNotFoundError.
        dtype, dim: The layer's rows.
        policy: Which rows read from the parameter server enter the host cache.
        filler: The stack's worker for host-cache work no lookup waits for.
        touch_sample: How many GPU host-cache hits one report to its policy samples.
        counts: The stack's counters.
    """

    def __init__(self, host_cache: Any, ps: Any, default_row: torch.Tensor | None,
                 dtype: torch.dtype, dim: int, policy: InsertPolicy, filler: HostFiller,
                 touch_sample: int, counts: MissCounters) -> None:
        self.host_cache, self.ps = host_cache, ps
        self.dtype, self.dim = dtype, dim
        self.filler = filler
        self.counts = counts
        self._default = default_row
        self._host_share = policy.host
        #: how the tiers below the GPU cache store rows (quantized or not)
        self.formats = TierFormats(host_cache, ps, dtype)
        self._touch_sample = touch_sample
        #: how the table's rows are stored (``nvecache.common.rows``); rows read on the CPU
        #: are moved as their ``row_bytes`` payload bytes
        self.row_format = rows.RowFormat(rows.dtype_name(dtype), dim)
        self.row_bytes = self.row_format.row_bytes
        #: the default row as raw bytes (rows read on the CPU are moved as bytes)
        self._default_bytes = (np.empty(0, np.uint8) if default_row is None else
                               default_row.detach().to("cpu", dtype).contiguous()
                               .view(torch.uint8).numpy().reshape(-1))

    def as_rows(self, raw: np.ndarray) -> torch.Tensor:
        """``[N, dim]`` rows of the table's dtype over uint8 ``[N, row bytes]`` (no copy)."""
        return torch.from_numpy(raw).view(self.dtype).view(raw.shape[0], self.dim)

    def resolve(self, keys: np.ndarray, out: np.ndarray, since: int, *,
                from_host: bool = True) -> np.ndarray | None:
        """Rows of distinct ``keys`` read on the CPU into ``out`` (uint8 ``[N, row
        bytes]``): the host cache (unless not ``from_host``: keys the GPU already missed
        there), then the parameter server, then the default row. Returns which were found
        (bool ``[N]``), or None when all were.

        ``since`` is the change-feed cursor taken before anything was read: fills of keys
        announced after it are refused (their rows may predate the change).

        Raises:
            KeyNotFoundError: a key is in no tier and there is no default row.
            StorageUnavailableError: the parameter server did not answer and there is no
                default row.
        """
        n = keys.size
        need: np.ndarray | None = None  # NOTE: None: every key
        if from_host and self.host_cache is not None:
            # NOTE: a quantized cache's rows decoded into ``out`` in the layer's dtype
            _, hit = self.host_cache.lookup(torch.from_numpy(keys), out=self.as_rows(out))
            found = hit.numpy()
            nh = int(np.count_nonzero(found))
            self.counts.count_host(n, nh)
            if nh == n:
                return None
            need = np.flatnonzero(~found)
        else:
            found = np.zeros(n, np.bool_)
        left = n if need is None else need.size
        if self.ps is not None:
            rows, ok, nf = self.read_ps(keys if need is None else keys[need], since)
            if nf:
                if need is None:
                    out[:] = rows
                    found[:] = ok
                else:
                    out[need] = rows
                    found[need] = ok
                left -= nf
        if left == 0:
            return None
        self._missing(left, keys[~found], out, found)
        return found

    def count_gpu_reads(self, keys: np.ndarray, hit: np.ndarray, hits: int) -> None:
        """Count a GPU read of the host cache (distinct ``keys`` on the host, ``hit``
        flags) and have the worker report its hits to the host cache's eviction policy
        (a CPU lookup counts them itself)."""
        self.counts.count_host(keys.size, hits)
        self.filler.submit(self._report_hits, (keys, hit, hits), keys.size)

    def _report_hits(self, reports: list[tuple[np.ndarray, np.ndarray, int]]) -> None:
        """On the worker: count GPU lookups of the host cache and report their hits to its
        eviction policy, as a CPU lookup does itself (``(keys, hit flags, hits)`` each, on
        the host)."""
        for keys, _, hits in reports:
            self.host_cache.count_lookup(keys.size, hits)
        reports = [r for r in reports if r[2]]
        if not reports:
            return
        touch_sample(self.host_cache,
                     torch.from_numpy(np.concatenate([k for k, _, _ in reports])),
                     torch.from_numpy(np.concatenate([h for _, h, _ in reports])),
                     sum(n for _, _, n in reports), self._touch_sample)

    def _missing(self, left: int, keys: np.ndarray, rows: np.ndarray, found: np.ndarray
                 ) -> None:
        """``left`` keys (``keys``: they, or some) are in no tier: their rows (where
        ``found`` is False in ``rows``) become the default row, or KeyNotFoundError."""
        if self._default is None:
            raise KeyNotFoundError(
                f"{left} keys are in no tier of this layer (e.g. {keys[:5].tolist()}); load "
                "them into the parameter server, or pass default_row= to serve a default "
                "row for missing keys"
            )
        rows[~found] = self._default_bytes
        self.counts.default_rows += left

    def read_ps(self, keys: np.ndarray, since: int) -> tuple[np.ndarray, np.ndarray, int]:
        """``(rows, found, how many)`` of ``keys`` from the parameter server (rows as uint8
        ``[N, row bytes]``; none found while it is down and a default row is set); what it
        found is offered to the host cache (on the worker)."""
        keys_t = torch.from_numpy(keys)
        try:
            # NOTE: as a lookup returns them (a quantized host cache: as it would return
            # them); ``fills``: what fills the host cache (a quantized one's: stored bytes,
            # the server's own where it shares the format), ``holds`` its rows
            values, ok, fills, holds = self.formats.fetch(self.ps, keys_t)
        except PSClientError as e:
            if self._default is None:
                raise StorageUnavailableError(
                    f"the parameter server could not answer {keys.size} missed keys: {e}; "
                    "cached rows are still served. Pass default_row= to serve a default row "
                    "for misses while it is down"
                ) from e
            logger.warning("parameter server unavailable (%s); serving default rows", e)
            return np.empty((keys.size, self.row_bytes), np.uint8), np.zeros(keys.size, bool), 0
        ok_np = ok.numpy()
        nf = int(np.count_nonzero(ok_np))
        self.counts.count_storage(keys.size, nf)
        rows = values.contiguous().view(torch.uint8).numpy().reshape(keys.size, -1)
        share = self._host_share
        if self.host_cache is not None and nf and share > 0.0:
            if nf == keys.size and share >= 1.0 and holds is None:
                # NOTE: the common case (every key found, every row offered): no masks
                self.filler.submit(self._fill, (keys_t, fills, since), nf)
            else:
                admit = ok.clone() if holds is None else ok & holds
                if share < 1.0:
                    admit &= torch.rand(admit.numel()) < share
                if bool(admit.any()):
                    fill = keys_t[admit]
                    self.filler.submit(self._fill, (fill, fills[admit], since), fill.numel())
        return rows, ok_np, nf

    def _fill(self, fills: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
        """On the worker: offer rows read from the parameter server to the host cache in
        one insert (refused for keys announced after the earliest fill's cursor, and for
        keys already there)."""
        # NOTE: joined in numpy, not torch.cat: a 64k-key call's fills (~900k elements) are
        # over torch's grain size, and torch would spread the copy over its intra-op team,
        # whose threads would compete for cores with the lookups' split reads
        # (nvecache.common.fanout) that this worker runs beside (bench/RESULTS.md,
        # "Hierarchical layer at serving sizes", eighteenth session)
        keys = torch.from_numpy(np.concatenate([k.numpy() for k, _, _ in fills]))
        values = _concat_rows([v for _, v, _ in fills])
        since = min(c for _, _, c in fills)
        # NOTE: the rows as the parameter server holds them (a quantized host cache: their
        # stored bytes, taken as they are): not checked again
        done = self.host_cache.insert(keys, values, overwrite=False, since=since,
                                      allow_nonfinite=True)
        self.counts.host_placed += done.written
        self.counts.host_evicted += done.evicted
