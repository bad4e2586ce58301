"""A Hierarchical stack's writes: every tier, one named tier, or deltas added.

Every tier (``tier=None``): the parameter server first (the source of truth), then the
shared host cache with ``update(..., insert_missing=True)``, which announces every key to
every process (their GPU caches drop it, and fills of it still in flight are refused);
without a host cache there is no feed to announce through, and this process's GPU cache
drops the keys itself. Any write drops the rows waiting for their GPU admission round:
they may be older than the write.

One tier: ``"gpu"`` this process's GPU cache only; ``"host"`` the host cache only
(announced as above); ``"storage"`` the parameter server only (announced on its change
feed as any of its writes; the caches keep what they hold).

Where a tier below the GPU cache stores rows quantized (a quantized parameter server, a
quantized host cache, or both) every tier reads the same values
(:mod:`gpu.stacks.misses.tier_formats`): a write through every tier gives the host cache
the rows as the parameter server's lookups return them (a quantized host cache encodes
those), and a ``tier="gpu"`` insert writes this process's GPU cache the rows a write
through every tier would read back (quantized, then dequantized, by each quantized tier
below), not the float rows given: the GPU cache holds no row a tier below could not hold,
and reads the same before and after the row is dropped from it and read again.

``accumulate`` adds deltas where the rows are kept: with a parameter server there first
(atomically per row), then the host cache gets the server's new rows through ``update``
(so every GPU cache drops the keys); without one, in the host cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from gpu.errors import StorageWriteError
from psclient import PSClientError

if TYPE_CHECKING:
    from gpu.stacks.misses.admission import PendingAdmissions
    from gpu.stacks.misses.resolver import Resolver
    from gpu.stacks.protocol import Tier

T = TypeVar("T")


class TierWrites:
    """The writes of :class:`gpu.stacks.hierarchical.HierarchicalStack` (a mixin over its
    :class:`gpu.stacks.cached.CachedStack`)."""

    host_cache: Any
    ps: Any
    dtype: torch.dtype
    resolver: Resolver
    pending: PendingAdmissions
    guard: Any
    follower: Any
    cache: Any
    device: torch.device
    insert_cached: Callable[[torch.Tensor, torch.Tensor], None]
    erase_cached: Callable[[torch.Tensor], None]

    def _at_ps(self, op: str, n: int, call: Callable[[], T]) -> T:
        """``call()`` on the parameter server, its failure a StorageWriteError."""
        try:
            return call()
        except PSClientError as e:
            raise StorageWriteError(
                f"{op} of {n} keys failed at the parameter server: {e}; no tier was "
                "changed, retry when it is reachable"
            ) from e

    def _written(self, keys: torch.Tensor, own_copies: bool) -> None:
        """After a write below the GPU cache: forget waiting admissions, apply what was
        announced (``own_copies``: no feed announced it, drop this cache's copies)."""
        with self.guard:
            self.pending.drop()
            self.follower.sync()
            if own_copies:
                self.cache.erase(keys.to(self.device))

    def _write(self, op: str, keys: torch.Tensor, values: torch.Tensor | None) -> torch.Tensor:
        """Write every tier: the parameter server first, then the host cache."""
        ck = keys.cpu()
        cv = values.cpu() if values is not None else None
        n = ck.numel()
        found = torch.ones(n, dtype=torch.bool)
        ps = self.ps
        if ps is not None:
            # NOTE: rows were checked by the layer (allow_nonfinite=True: not again)
            if op == "update":
                found = self._at_ps(op, n, lambda: ps.update(ck, cv, allow_nonfinite=True))
            elif op == "insert":
                self._at_ps(op, n, lambda: ps.insert(ck, cv, allow_nonfinite=True))
            else:
                self._at_ps(op, n, lambda: ps.erase(ck))
        host = self.host_cache
        formats = self.resolver.formats
        if formats.quantized and cv is not None:
            cv = formats.for_host(cv)  # NOTE: what the server's lookups return of the rows
        if host is not None:
            if op == "erase":
                host.erase(ck)
            elif ps is None and op == "update":
                found = host.update(ck, cv, allow_nonfinite=True)
            else:  # write-through that announces every key to every process
                assert cv is not None
                host.update(ck[found], cv[found], insert_missing=True, allow_nonfinite=True)
        self._written(keys, own_copies=host is None)
        return found.to(keys.device)

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return self._write("update", keys, values)

    def insert(self, keys: torch.Tensor, values: torch.Tensor,
               tier: Tier | None = None) -> None:
        """Write rows into ``tier`` (None: the parameter server, then the host cache),
        creating those missing."""
        if tier is None:
            self._write("insert", keys, values)
        elif tier == "gpu":
            formats = self.resolver.formats
            # NOTE: over a quantized tier, the rows a write through every tier reads back
            self.insert_cached(keys, formats.read(values) if formats.quantized else values)
        elif tier == "host":
            self.host_cache.update(keys.cpu(), values.cpu(), insert_missing=True,
                                   allow_nonfinite=True)
            self._written(keys, own_copies=False)
        else:
            ck, cv = keys.cpu(), values.cpu()
            self._at_ps("insert", ck.numel(),
                        lambda: self.ps.insert(ck, cv, allow_nonfinite=True))

    def erase(self, keys: torch.Tensor, tier: Tier | None = None) -> None:
        """Drop keys from ``tier`` (None: the parameter server, the host cache and every
        GPU cache)."""
        if tier is None:
            self._write("erase", keys, None)
        elif tier == "gpu":
            self.erase_cached(keys)
        elif tier == "host":
            self.host_cache.erase(keys.cpu())
            self._written(keys, own_copies=False)
        else:
            ck = keys.cpu()
            self._at_ps("erase", ck.numel(), lambda: self.ps.erase(ck))

    def accumulate(self, keys: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        """Add ``deltas`` to the rows that exist (duplicates summed); bool ``[N]``: which
        keys the parameter server (without one: the host cache) held and added to."""
        ck, cd = keys.cpu(), deltas.cpu()
        n = ck.numel()
        ps, host = self.ps, self.host_cache
        if ps is None:
            # NOTE: a quantized host cache adds float32 deltas (decoded, added, encoded)
            found = host.accumulate(ck, cd.float() if host.quantized else cd,
                                    allow_nonfinite=True)
            self._written(keys, own_copies=False)
            return found.to(keys.device)
        pd = cd.float() if ps.quantized else cd  # NOTE: a quantized table adds float32
        found = self._at_ps("accumulate", n, lambda: ps.accumulate(ck, pd, allow_nonfinite=True))
        if host is not None and n:
            changed = torch.unique(ck[found])
            try:
                # NOTE: the server's new rows as the host cache takes them (a shared
                # format's: its stored bytes); a key erased since the add is dropped from
                # the host cache too, and so is a row a quantized host cache cannot hold
                # (NaN or infinite: read from the server)
                new_rows, held = self.resolver.formats.server_rows(ps, changed)
            except PSClientError as e:
                host.erase(changed)  # NOTE: no stale row stays cached anywhere
                self._written(keys, own_copies=False)
                raise StorageWriteError(
                    f"accumulate of {n} keys: the parameter server added the deltas but "
                    f"could not be read back: {e}; the keys were dropped from the caches "
                    "(the next lookups read them from the parameter server)") from e
            host.update(changed[held], new_rows[held], insert_missing=True,
                        allow_nonfinite=True)
            if not bool(held.all()):
                host.erase(changed[~held])
        self._written(keys, own_copies=host is None)
        return found.to(keys.device)
