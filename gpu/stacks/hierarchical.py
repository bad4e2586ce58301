"""The Hierarchical stack: GPU cache -> shared ``HostCache`` -> parameter server.

A lookup probes the GPU cache, and the probe lists each miss and its batch position (on
CUDA in pinned host memory, :mod:`gpu.stacks.miss_list`: after one stream sync the host knows
what missed, with no reduction, search or copy on the device); the misses, deduplicated on
the host, are read from the shared host cache (on CUDA, from
``TierConfig.host_gpu_read_keys`` distinct keys on, by a kernel over the registered table,
:mod:`gpu.kernels.host_reads`; fewer on the CPU), then the parameter server; rows from the
parameter server enter the host cache with ``overwrite=False`` and a cursor check
(``since``), so a concurrent ``update`` (PS first, then the host cache, announced to every
process) always wins; fetched rows wait for
their GPU admission round (:mod:`gpu.stacks.admission`). Fetches run outside the cache guard,
so one thread's misses never hold up another thread's hits. The host-cache fills and the
GPU's hit reports to the host cache's policy run on a worker thread
(:mod:`gpu.stacks.host_filler`): the lookup returns without waiting for them.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import torch

from gpu.errors import KeyNotFoundError, StorageUnavailableError, StorageWriteError
from gpu.layer_config import InsertPolicy, LayerStats, PoolingMode, TierStats
from gpu.stacks.admission import PendingAdmissions
from gpu.stacks.cached import CachedStack
from gpu.stacks.host_filler import HostFiller
from gpu.stacks.miss_list import MissList
from gpu.stacks.miss_twin import GATE as MISS_LOOPS
from gpu.stacks.staging import PinnedStaging
from gpu.tier_config import TierConfig
from psclient import PSClientError

logger = logging.getLogger(__name__)


def touch_sample(host: Any, keys: torch.Tensor, hit: torch.Tensor, hits: int,
                 sample: int) -> None:
    """Report ``hits`` host-cache hits read elsewhere (``keys[hit]``, CPU tensors) to its
    eviction policy: a sample of at most ``sample`` hit keys, each counted ``hits /
    sample`` times, so the policy sees the GPU's traffic at a bounded cost."""
    if hits == 0:
        return
    hk = keys[hit]
    weight = 1
    if hits > sample:
        pick = torch.randint(0, hits, (sample,))
        hk, weight = hk[pick], max(1, round(hits / sample))
    host.touch(hk, weight)


class HierarchicalStack(CachedStack):
    """GPU cache -> shared HostCache -> parameter server (any of the last two optional)."""

    layer_type = "Hierarchical"

    def __init__(self, host_cache: Any, storage: Any, dim: int, dtype: torch.dtype,
                 device: torch.device, cache_bytes: int, policy: InsertPolicy,
                 default_row: torch.Tensor | None, config: TierConfig) -> None:
        super().__init__(dim, dtype, device, cache_bytes, config, host_cache)
        self.pending = PendingAdmissions(self.cache, self.guard, self.follower, self.budget,
                                         config)
        self.host = host_cache
        self.ps = storage
        self._policy = policy
        self._default = default_row
        self._reg = None
        #: host-cache fills and hit reports, off the lookups' path (gpu.stacks.host_filler)
        self.filler = HostFiller("nvecache-host-fill", config.host_batch_keys,
                                 config.host_linger_s)
        self._lists = threading.local()  # each thread's MissList
        if host_cache is not None:
            if device.type == "cuda":
                from gpu.cuda.registration import register

                self._reg = register(host_cache, device)
        self._row_bytes = dim * torch.empty(0, dtype=dtype).element_size()
        #: the default row as raw bytes (rows resolved on the CPU are moved as bytes)
        self._default_bytes = (np.empty(0, np.uint8) if default_row is None else
                               default_row.detach().to("cpu", dtype).contiguous()
                               .view(torch.uint8).numpy().reshape(-1))
        self._host = [0, 0, 0, 0]  # hits, misses, rows it placed, residents they evicted
        self._ps = [0, 0]  # found, missing

    def _miss_list(self, n: int) -> MissList:
        """This thread's list of its lookup's misses (one per thread: lookups of several
        threads may be in flight at once), grown to ``n`` keys."""
        misses = getattr(self._lists, "misses", None)
        if misses is None:
            misses = self._lists.misses = MissList(self.device)
        misses.ensure(n)
        return misses

    def rows(self, keys: torch.Tensor) -> torch.Tensor:
        misses = self._miss_list(keys.numel())
        with self.guard:
            since = self.follower.sync()
            # NOTE: the layer checked the keys; each miss and its position are listed by
            # the lookup itself, on CUDA in pinned host memory (gpu.stacks.miss_list)
            values = self.cache.serve(keys, misses)
            stream = self.guard.stream
        if stream is not None:
            # NOTE: the call's one host sync when every key hit: no reduction, no copy
            stream.synchronize()
        mkeys, mpos = misses.take()
        if mkeys.size == 0:
            return values
        return self._serve_misses(values, mkeys, mpos, since, stream)

    def _serve_misses(self, values: torch.Tensor, mkeys: np.ndarray, mpos: np.ndarray,
                      since: int, stream: Any) -> torch.Tensor:
        """Fill a lookup's missed rows (listed on the host) from the lower tiers,
        deduplicated on the host (one compiled call, :mod:`gpu.stacks.miss_loops`). From
        ``host_gpu_read_keys`` distinct misses on CUDA the GPU reads the host cache itself
        (:meth:`_serve_misses_on_device`); fewer are resolved on the CPU straight into one
        buffer (on CUDA this thread's pinned one, :mod:`gpu.stacks.staging`): each miss's key,
        position and row, sent in one copy and placed with one scatter."""
        ukeys, inverse = MISS_LOOPS.pick().dedup_first(mkeys)  # NOTE: compiled once ready
        u, m = ukeys.size, mkeys.size
        cuda = values.is_cuda
        if cuda and self._reg is not None and u >= self.config.host_gpu_read_keys:
            return self._serve_misses_on_device(values, ukeys, inverse, mpos, since, stream)
        rb = self._row_bytes
        at_rows = 3 * m * 8  # NOTE: keys, positions, the found ones' indices (at most m)
        nbytes = at_rows + m * rb
        staging = self._staging() if cuda else None
        buf = staging.take(nbytes) if staging is not None else np.empty(nbytes, np.uint8)
        ints = buf[:at_rows].view(np.int64)
        rows_at = buf[at_rows:].reshape(m, rb)
        # NOTE: no key repeated (the common case): the distinct keys are the misses in
        # order, and their rows go straight into place
        urows = rows_at if u == m else np.empty((u, rb), np.uint8)
        found = self._resolve(ukeys, urows, since)
        if u != m:
            np.take(urows, inverse, axis=0, out=rows_at)
            found = None if found is None else found[inverse]
        ints[:m] = mkeys
        ints[m:2 * m] = mpos
        hit_at = np.empty(0, np.int64) if found is None else np.flatnonzero(found)
        ints[2 * m:2 * m + hit_at.size] = hit_at
        dev = staging.send(nbytes) if staging is not None else torch.from_numpy(buf)
        dints = dev[:at_rows].view(torch.int64)
        rows = dev[at_rows:].view(self.dtype).view(m, self.dim)
        values.index_copy_(0, dints[m:2 * m], rows)
        # NOTE: offered per miss (a key repeated in the batch is offered as often as it
        # missed; an insert keeps one of equal rows)
        at = None if found is None else dints[2 * m:2 * m + hit_at.size]
        self._offer(dints[:m], rows, at, found is None, since, stream)
        return values

    def _serve_misses_on_device(self, values: torch.Tensor, ukeys: np.ndarray,
                                inverse: np.ndarray, mpos: np.ndarray, since: int,
                                stream: Any) -> torch.Tensor:
        """Many distinct misses on CUDA: their keys, positions and distinct indices go to
        the device first (one copy from the pinned buffer), the GPU kernel reads the host
        cache, the parameter server the rest; placed with a gather and a scatter."""
        u, m = ukeys.size, mpos.size
        idx = self._staging().take(8 * (u + 2 * m)).view(np.int64)
        idx[:u], idx[u:u + m], idx[u + m:] = ukeys, mpos, inverse
        dev_idx = self._staging().send(idx.nbytes).view(torch.int64)
        dkeys, pos, inv = dev_idx[:u], dev_idx[u:u + m], dev_idx[u + m:]
        urows, found, complete = self._fetch(dkeys, since, ukeys)
        values.index_copy_(0, pos, urows.index_select(0, inv))
        self._offer(dkeys, urows, found, complete, since, stream)
        return values

    def _staging(self) -> PinnedStaging:
        staging = getattr(self._lists, "staging", None)
        if staging is None:
            staging = self._lists.staging = PinnedStaging(self.device)
        return staging

    def _offer(self, ukeys: torch.Tensor, urows: torch.Tensor, found: torch.Tensor | None,
               complete: bool, since: int, stream: Any) -> None:
        """Fetched rows wait for their GPU admission (default rows never go in): unless
        ``complete``, ``found`` flags the found keys, or lists their positions (int64)."""
        if not complete:
            assert found is not None
            if found.dtype == torch.bool:
                ukeys, urows = ukeys[found], urows[found]
            else:
                ukeys, urows = ukeys.index_select(0, found), urows.index_select(0, found)
        self.pending.offer(ukeys, urows, since, self._policy.gpu, stream)

    def pooled(self, keys: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
               mode: PoolingMode) -> torch.Tensor:
        if mode == "max":
            return super().pooled(keys, offsets, weights, mode)
        with self.guard:
            since = self.follower.sync()
            # NOTE: fp32 sums out of the kernel, so that missed rows join them before the
            # one rounding to the table's dtype (as embedding_bag rounds once)
            out, hit = self.cache.lookup_pooled(keys, offsets, mode, weights, validate=False,
                                                out_dtype=torch.float32)
            stream = self.guard.stream
        if bool(hit.all()):  # NOTE: the call's one host sync when every key hit
            return out.to(self.dtype)
        miss = (~hit).nonzero().squeeze(1)
        ukeys, inverse = torch.unique(keys[miss], return_inverse=True)
        urows, found, complete = self._fetch(ukeys, since)
        contrib = urows[inverse].float()
        if weights is not None:
            contrib = contrib * weights[miss, None].float()
        bag = torch.searchsorted(offsets, miss, right=True) - 1
        if mode == "mean":
            length = (offsets[1:] - offsets[:-1]).float()
            contrib = contrib / length[bag, None]
        out.index_add_(0, bag, contrib)
        self._offer(ukeys, urows, found, complete, since, stream)
        return out.to(self.dtype)

    def _report_hits(self, reports: list[tuple[np.ndarray, np.ndarray, int]]) -> None:
        """On the filler: count GPU lookups of the host cache and report their hits to its
        eviction policy, as a CPU lookup does itself (``(keys, hit flags, hits)`` each, on
        the host)."""
        for keys, _, hits in reports:
            self.host.count_lookup(keys.size, hits)
        reports = [r for r in reports if r[2]]
        if not reports:
            return
        touch_sample(self.host, torch.from_numpy(np.concatenate([k for k, _, _ in reports])),
                     torch.from_numpy(np.concatenate([h for _, h, _ in reports])),
                     sum(n for _, _, n in reports), self.config.host_touch_sample)

    def _fetch(self, ukeys: torch.Tensor, since: int, host_keys: np.ndarray | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Rows of distinct missed keys from the lower tiers, where the keys are: ``(rows,
        found, complete)``, ``complete`` when every key was found (the counts are known on
        the host). ``host_keys``: the same keys on the host, if at hand.

        ``since`` is the ring cursor taken before anything was read: fills of keys
        announced after it are refused (their rows may predate the change).

        On CUDA, fewer than ``host_gpu_read_keys`` keys are resolved on the CPU
        (:meth:`_resolve`) and their rows copied to the device once: the GPU's seqlock
        read of the host cache costs hundreds of microseconds however few the keys, and
        its hits then need reporting to the host cache's policy (bench/RESULTS.md,
        "Hierarchical layer at serving sizes")."""
        n = ukeys.numel()
        if host_keys is None:
            host_keys = ukeys.cpu().numpy()
        if not ukeys.is_cuda or self._reg is None or n < self.config.host_gpu_read_keys:
            out = np.empty((n, self._row_bytes), np.uint8)
            found = self._resolve(host_keys, out, since)
            rows = self._as_rows(out)
            flags = (torch.from_numpy(found) if found is not None
                     else torch.ones(n, dtype=torch.bool))
            return rows.to(ukeys.device), flags.to(ukeys.device), found is None
        return self._fetch_gpu_read(ukeys, host_keys, since)

    def _fetch_gpu_read(self, ukeys: torch.Tensor, host_keys: np.ndarray, since: int
                        ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """:meth:`_fetch` of many CUDA keys: the GPU kernel reads the host cache over the
        registered table (:mod:`gpu.kernels.host_reads`); its hit flags come back in one copy and
        sync; the parameter server's rows for the rest, and their positions, go over in one
        copy from the pinned buffer. The GPU's hits are reported to the host cache's
        policy by the filler (a CPU lookup counts them itself)."""
        from gpu.kernels.host_reads import hostcache_lookup

        n = ukeys.numel()
        rows, hit = hostcache_lookup(self._reg, ukeys)
        hit_host = torch.empty(n, dtype=torch.bool, pin_memory=True)
        hit_host.copy_(hit, non_blocking=True)
        torch.cuda.current_stream(ukeys.device).synchronize()
        hit_np = hit_host.numpy()
        nh = int(np.count_nonzero(hit_np))
        self._host[0] += nh
        self._host[1] += n - nh
        self.filler.submit(self._report_hits, (host_keys, hit_np, nh), n)
        if nh == n:
            return rows, hit, True
        need = np.flatnonzero(~hit_np)
        k = need.size
        if self.ps is not None:
            part, part_found, nf = self._read_ps(host_keys[need], since)
        else:
            part = np.empty((k, self._row_bytes), np.uint8)
            part_found, nf = np.zeros(k, np.bool_), 0
        left = k - nf
        if left:
            self._missing(left, host_keys[need][~part_found], part, part_found)
        # NOTE: the pinned buffer's copy of this call's indices is done: the sync above
        at_rows = 8 * k
        at_found = at_rows + k * self._row_bytes
        buf = self._staging().take(at_found + k)
        buf[:at_rows] = need.view(np.uint8)
        buf[at_rows:at_found] = part.reshape(-1)
        buf[at_found:] = part_found.view(np.uint8)
        dev = self._staging().send(at_found + k)
        need_d = dev[:at_rows].view(torch.int64)
        rows.index_copy_(0, need_d, dev[at_rows:at_found].view(self.dtype).view(k, self.dim))
        if left == 0:
            return rows, hit, True
        flags = hit.clone()
        flags.index_copy_(0, need_d, dev[at_found:].view(torch.bool))
        return rows, flags, False

    def _resolve(self, keys: np.ndarray, out: np.ndarray, since: int) -> np.ndarray | None:
        """Rows of distinct keys read on the CPU into ``out`` (uint8 ``[N, row bytes]``):
        the host cache, then the parameter server, then the default row. Returns which
        were found (bool ``[N]``), or None when all were."""
        n = keys.size
        if self.host is not None:
            _, hit_t = self.host.lookup(torch.from_numpy(keys), out=self._as_rows(out))
            found = hit_t.numpy()
            nh = int(np.count_nonzero(found))
            self._host[0] += nh
            self._host[1] += n - nh
            if nh == n:
                return None
            need = np.flatnonzero(~found)
        else:
            found = np.zeros(n, np.bool_)
            need = np.arange(n)
        left = need.size
        if self.ps is not None:
            rows, ok, nf = self._read_ps(keys[need], since)
            if nf:
                out[need] = rows
                found[need] = ok
                left -= nf
        if left == 0:
            return None
        self._missing(left, keys[~found], out, found)
        return found

    def _as_rows(self, raw: np.ndarray) -> torch.Tensor:
        """``[N, dim]`` rows of the table's dtype over uint8 ``[N, row bytes]`` (no copy)."""
        return torch.from_numpy(raw).view(self.dtype).view(raw.shape[0], self.dim)

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
        self.default_rows += left

    def _read_ps(self, keys: np.ndarray, since: int) -> tuple[np.ndarray, np.ndarray, int]:
        """``(rows, found, how many)`` of ``keys`` from the parameter server (rows as uint8
        ``[N, row bytes]``; none found while it is down and a default row is set); what it
        found is offered to the host cache (on the filler)."""
        keys_t = torch.from_numpy(keys)
        try:
            values, ok = self.ps.lookup(keys_t)
        except PSClientError as e:
            if self._default is None:
                raise StorageUnavailableError(
                    f"the parameter server could not answer {keys.size} missed keys: {e}; "
                    "cached rows are still served. Pass default_row= to serve a default row "
                    "for misses while it is down"
                ) from e
            logger.warning("parameter server unavailable (%s); serving default rows", e)
            return np.empty((keys.size, self._row_bytes), np.uint8), np.zeros(keys.size, bool), 0
        if values.dtype != self.dtype:
            values = values.to(self.dtype)
        ok_np = ok.numpy()
        nf = int(np.count_nonzero(ok_np))
        self._ps[0] += nf
        self._ps[1] += keys.size - nf
        rows = values.contiguous().view(torch.uint8).numpy().reshape(keys.size, -1)
        if self.host is not None and nf and self._policy.host > 0.0:
            if nf == keys.size and self._policy.host >= 1.0:
                # NOTE: the common case (every key found, every row offered): no masks
                self.filler.submit(self._fill, (keys_t, values, since), nf)
            else:
                admit = ok.clone()
                if self._policy.host < 1.0:
                    admit &= torch.rand(admit.numel()) < self._policy.host
                if bool(admit.any()):
                    fill = keys_t[admit]
                    self.filler.submit(self._fill, (fill, values[admit], since), fill.numel())
        return rows, ok_np, nf

    def _fill(self, fills: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
        """On the filler: offer rows read from the parameter server to the host cache in
        one insert (refused for keys announced after the earliest fill's cursor, and for
        keys already there)."""
        keys = torch.cat([k for k, _, _ in fills])
        values = torch.cat([v for _, v, _ in fills])
        since = min(c for _, _, c in fills)
        # NOTE: the rows as the parameter server holds them: not checked again
        done = self.host.insert(keys, values, overwrite=False, since=since,
                                allow_nonfinite=True)
        self._host[2] += done.written
        self._host[3] += done.evicted

    def flush(self) -> None:
        """Finish the host-cache fills and hit reports of earlier lookups."""
        self.filler.drain()

    # -- writes -----------------------------------------------------------------------------

    def _write(self, op: str, keys: torch.Tensor, values: torch.Tensor | None) -> torch.Tensor:
        """Write the parameter server first (the source of truth), then the host cache."""
        ck = keys.cpu()
        cv = values.cpu() if values is not None else None
        found = torch.ones(ck.numel(), dtype=torch.bool)
        if self.ps is not None:
            try:
                if op == "update":
                    found = self.ps.update(ck, cv, allow_nonfinite=True)  # layer-checked
                elif op == "insert":
                    self.ps.insert(ck, cv, allow_nonfinite=True)
                else:
                    self.ps.erase(ck)
            except PSClientError as e:
                raise StorageWriteError(
                    f"{op} of {ck.numel()} keys failed at the parameter server: {e}; no tier "
                    "was changed, retry when it is reachable"
                ) from e
        if self.host is not None:
            if op == "erase":
                self.host.erase(ck)
            elif self.ps is None and op == "update":
                found = self.host.update(ck, cv, allow_nonfinite=True)
            else:  # write-through that announces every key to every process
                assert cv is not None
                self.host.update(ck[found], cv[found], insert_missing=True,
                                 allow_nonfinite=True)
        with self.guard:
            self.pending.drop()
            self.follower.sync()
            if self.host is None:  # no ring to announce through: drop our own copies
                self.cache.erase(keys.to(self.device))
        return found.to(keys.device)

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return self._write("update", keys, values)

    def insert(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self._write("insert", keys, values)

    def erase(self, keys: torch.Tensor) -> None:
        self._write("erase", keys, None)

    def clear(self) -> None:
        """Drop every cached row (GPU cache, and the shared host cache for every process)."""
        self.filler.drain()
        if self.host is not None:
            self.host.clear()
        super().clear()

    def stats(self) -> LayerStats:
        self.filler.drain()
        host = TierStats(*self._host) if self.host is not None else None
        ps = TierStats(self._ps[0], self._ps[1]) if self.ps is not None else None
        node = self.host.stats() if self.host is not None else None
        return LayerStats(self.layer_type, self.gpu_stats(), host, ps, self.default_rows, node,
                          self.follower.invalidated_keys, self.follower.full_invalidations)

    def _drop_waiting(self) -> None:
        self.pending.drop()

    def close(self) -> None:
        self.filler.close()
        self.pending.drop()
        if self._reg is not None:
            self._reg.close()
            self._reg = None

