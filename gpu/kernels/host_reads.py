"""Reading the registered shared host tables from the GPU: lookups and gathers.

``hostcache_lookup(reg, keys)`` probes a registered :class:`hostcache.HostCache` straight
over the host link; ``linear_gather(reg, indices)`` gathers rows of a registered
:class:`hostcache.SharedMemBlock`. On CPU registrations both have a CPU twin with identical
results (the table's own ``lookup``; ``index_select`` on the CPU view). With
``backend="triton"`` on CPU tensors the very same Triton kernels run under Triton's
interpreter, so the kernel logic is tested on machines without a GPU.

This module checks the arguments, picks the backend and runs the batch pipelines; the
kernels, and the memory-ordering argument for why a lookup is three launches (probe ->
gather -> verify) and never returns a torn row, are in :mod:`gpu.kernels.host_tier`.

Performance: visit host pages in order
--------------------------------------
Zero-copy reads of host memory are limited by how many distinct host pages a batch
touches at once, not by load width (bench/RESULTS.md, "Host tier read from the GPU"). A
slot's row lives at ``rows_off + slot * row_stride`` and its key/version at ``slot * 8``
in their arrays, with ``slot = bucket * ways + way``: sorting the keys by *bucket*
therefore puts the probe's key/version reads and the row reads all in page order at once.
So a lookup:

1. batches up to ``TILES.one_sort_max`` keys: one kernel computes a sort key per key
   (``bucket << 32 | low hash bits``) and one ``torch.sort`` puts the batch in bucket order
   with equal keys next to each other (no host sync); the probe kernel visits that order
   and fetches only the first key of each run, and a second kernel copies its row to the
   rest of the run in device memory;
2. larger batches: ``torch.unique`` (each row crosses the link once), a small kernel
   hashes the distinct keys, ``torch.sort`` orders them by bucket, the probe kernel runs
   over the distinct keys only, and ``index_select`` expands the rows back to the batch.

Keys equal to ``hostcache.layout.EMPTY_KEY`` (reserved) are reported as misses on the GPU
(the CPU twin raises, as ``HostCache.lookup`` does): checking would cost a device sync.
GPU lookups do not bump the tables' LFU counters nor its hit/miss statistics.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from types import ModuleType
from typing import Any, Literal

import torch

from gpu.cuda.devices import on_tensor_device
from gpu.cuda.registration import HostRegistration
from gpu.errors import BadArgumentError, TritonNotInstalledError
from gpu.kernels.triton_access import kernel_module, triton_available
from hostcache import hashing, layout
from nvecache.common.keys import key_problem

__all__ = ["BACKEND_ENV", "TILES", "Backend", "TritonNotInstalledError", "hostcache_lookup",
           "linear_gather", "torch_lookup", "triton_lookup"]

logger = logging.getLogger(__name__)

Backend = Literal["auto", "torch", "triton"]

#: set to "triton" to run the Triton kernels (interpreter) on CPU registrations by default
BACKEND_ENV = "NVEC_HOST_KERNELS"


#: the host-tier kernels launched directly (gpu.kernels.launch), by name
_DIRECT: dict[str, Any] = {}


def _launch(k: ModuleType, interpret: bool, name: str, grid: tuple[int, ...],
            args: tuple[Any, ...], key: tuple[Any, ...], **constexprs: Any) -> None:
    """Launch kernel ``name`` of ``k``. On CUDA through :class:`gpu.kernels.launch.DirectLaunch`
    (a lookup is five or six small launches, and the JIT's per-call argument binding costs
    more than each of them runs); ``key`` names the constexprs and the element types of
    the tensors whose type varies. The interpreter takes the JIT's path."""
    fn = getattr(k, name)
    if interpret:
        fn[grid](*args, **constexprs)
        return
    launcher = _DIRECT.get(name)
    if launcher is None:
        from gpu.kernels.launch import DirectLaunch

        launcher = _DIRECT[name] = DirectLaunch(fn)
    launcher(grid, args, constexprs, (name, *key))


def _kernels(interpret: bool) -> ModuleType:
    """``gpu.kernels.host_tier`` decorated for CUDA or for the Triton interpreter."""
    if not triton_available():
        raise TritonNotInstalledError(
            "the Triton kernels need the triton package (`pip install triton`); on CPU "
            "tensors use backend='torch' (the default)"
        )
    return kernel_module("host_tier", interpret=interpret)


# NOTE: a plain integer helper: triton.cdiv is a constexpr function in Triton 3.6 and costs
# microseconds of host time per call (and this module imports without triton).
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# -- argument checks ---------------------------------------------------------------------


def _check_reg(reg: Any, *, host_cache: bool) -> None:
    if not isinstance(reg, HostRegistration):
        raise BadArgumentError(
            f"expected a gpu.cuda.registration.HostRegistration (from register(table)); got "
            f"{type(reg).__name__}"
        )
    _ = reg.address  # NOTE: raises RegistrationClosedError / ForkedProcessError
    if reg.is_host_cache != host_cache:
        want = "a HostCache" if host_cache else "a SharedMemBlock"
        other = "linear_gather" if host_cache else "hostcache_lookup"
        raise BadArgumentError(
            f"table {reg.name!r} is not {want}; use {other}() for it"
        )


def _check_ids(ids: object, reg: Any, what: str) -> torch.Tensor:
    problem = key_problem(ids, device=reg.device)
    if problem is not None:
        raise BadArgumentError(f"{what} {problem} (table {reg.name!r} is registered for "
                               f"{reg.device})")
    assert isinstance(ids, torch.Tensor)
    return ids.contiguous()


def _backend(backend: object, device: torch.device) -> bool:
    """True for the Triton path."""
    if backend == "auto":
        if device.type == "cuda":
            return True
        return os.environ.get(BACKEND_ENV, "torch") == "triton"
    if backend in ("torch", "triton"):
        return backend == "triton"
    raise BadArgumentError(f"backend must be 'auto', 'torch' or 'triton'; got {backend!r}")


def _block_d(dim: int) -> int:
    return 1 << max(0, (dim - 1).bit_length())


def _block_k(block_d: int) -> int:
    return max(1, min(32, 2048 // block_d))


# -- host cache lookup ---------------------------------------------------------------------


def hostcache_lookup(
    reg: Any,
    keys: torch.Tensor,
    *,
    backend: Backend = "auto",
    dedup: bool = True,
    sort: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Look ``keys`` up in a registered :class:`hostcache.HostCache`.

    Args:
        reg: a :class:`gpu.cuda.registration.HostRegistration` of a host cache.
        keys: int64 ``[N]`` on ``reg.device``.
        backend: ``"auto"`` (Triton on CUDA, the table's own lookup on the CPU; the env
            var ``NVEC_HOST_KERNELS=triton`` picks the interpreter on the CPU), ``"torch"``
            (torch ops: the table's lookup on the CPU, the same seqlock probe in torch ops
            over the registered views on CUDA), ``"triton"``.
        dedup: fetch each distinct key once (Triton path).
        sort: visit keys in bucket (= host page) order (Triton path).

    Returns:
        ``(values [N, dim] in the table's dtype, hit bool [N])`` on ``reg.device``; rows of
        missing keys are zeros.

    Raises:
        BadArgumentError: wrong registration kind, dtype, shape or device of ``keys``.
        RegistrationClosedError: ``reg`` is closed.
        TritonNotInstalledError: ``backend="triton"`` without triton.
    """
    _check_reg(reg, host_cache=True)
    keys = _check_ids(keys, reg, "keys")
    if _backend(backend, reg.device):
        return _lookup_triton(reg, keys, dedup=dedup, sort=sort)
    if reg.device.type == "cpu":
        return reg.table.lookup(keys)
    return _lookup_torch(reg, keys)


def torch_lookup(reg: HostRegistration, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The seqlock probe in torch ops over the registered views, on any device.

    What ``hostcache_lookup(..., backend="torch")`` runs on CUDA (zero-copy: the baseline
    the kernels are measured against); on the CPU that backend is the table's own lookup,
    so this is how the torch probe is compared with it there. Arguments, results and
    errors as for :func:`hostcache_lookup`.
    """
    _check_reg(reg, host_cache=True)
    return _lookup_torch(reg, _check_ids(keys, reg, "keys"))


def triton_lookup(
    reg: HostRegistration,
    keys: torch.Tensor,
    *,
    dedup: bool = True,
    sort: bool = True,
    versions_again: torch.Tensor | None = None,
    fence: bool = True,
    gather: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton lookup (``backend="triton"``) with the variants tests and benches use.

    Args:
        reg, keys, dedup, sort: as for :func:`hostcache_lookup`.
        versions_again: int64 ``[slots]`` read by the check launch instead of the table's
            versions: a stand-in for a writer that changed slots while the rows were read.
        fence: ``False`` leaves out the probe's ``fence.acq_rel.sys`` (bench only: a
            lookup without it may return a torn row).
        gather: ``False`` probes and checks but reads no row (zero rows; bench only).

    Returns and raises as :func:`hostcache_lookup`.
    """
    _check_reg(reg, host_cache=True)
    keys = _check_ids(keys, reg, "keys")
    return _lookup_triton(reg, keys, dedup=dedup, sort=sort, versions_again=versions_again,
                          fence=fence, gather=gather)


def _lookup_torch(reg: Any, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The seqlock probe in torch ops over the registered views (zero-copy on CUDA)."""
    g = reg.geometry
    versions, tab_keys, rows = reg.versions(), reg.keys(), reg.rows()
    bucket = hashing.bucket_of(keys, g.num_buckets)
    sidx = bucket[:, None] * g.ways + torch.arange(g.ways, device=keys.device)
    v1s = versions[sidx]
    match = (tab_keys[sidx] == keys[:, None]) & (keys != layout.EMPTY_KEY)[:, None]
    way = match.to(torch.uint8).argmax(dim=1)
    slot = bucket * g.ways + way
    v1 = v1s.gather(1, way[:, None]).squeeze(1)
    values = rows.index_select(0, slot)
    v2 = versions.index_select(0, slot)
    hit = match.any(dim=1) & (v1 == v2) & ((v1 & 1) == 0)
    values.masked_fill_(~hit[:, None], 0)
    return values, hit


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Launch settings of the host-tier lookup (a bench or a test swaps the whole object,
    ``dataclasses.replace``, to compare variants)."""

    #: keys per program of the row gather; 0: 2048 // BLOCK_D, at most 32
    block_k: int = 0
    #: keys per program of the probe
    probe_block_k: int = 64
    warps: int = 4
    #: batches up to this many keys dedup and sort with one sort and no host sync; larger
    #: ones with torch.unique, then a sort of the distinct keys by bucket, so the probe runs
    #: over the distinct keys only (where each is faster: bench/RESULTS.md, "Host tier read
    #: from the GPU")
    one_sort_max: int = 1 << 17


TILES = Tiles()


@on_tensor_device
def _lookup_triton(
    reg: Any,
    keys: torch.Tensor,
    *,
    dedup: bool = True,
    sort: bool = True,
    versions_again: torch.Tensor | None = None,
    fence: bool = True,
    gather: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton probe, gather, verify (see :func:`triton_lookup` for the variants)."""
    g = reg.geometry
    interpret = reg.device.type != "cuda"
    k = _kernels(interpret)
    versions, tab_keys = reg.versions(), reg.keys()
    if g.slots >= 1 << 39:  # NOTE: the probe packs a slot in 39 bits beside the version
        raise BadArgumentError(f"table {reg.name!r} has {g.slots} slots; the GPU lookup "
                               "reads tables of fewer than 2**39 slots")
    ver2 = versions if versions_again is None else versions_again
    dev = keys.device
    bd = _block_d(g.dim)
    pk = TILES.probe_block_k
    common = dict(WAYS=g.ways, BLOCK_K=pk, FENCE=fence and not interpret,
                  num_warps=TILES.warps)
    n = keys.numel()
    found = torch.empty(n, dtype=torch.int64, device=dev)
    if sort and 1 < n <= TILES.one_sort_max:
        # One sort of (bucket, hash bits): bucket (= host page) order, and equal keys next
        # to each other; the probe looks up only the first key of each run of equal keys
        # and, once the rows are read and checked, a last kernel copies its row to the
        # others, in device memory.
        shift = max(0, 62 - max(1, g.num_buckets - 1).bit_length())
        skey = torch.empty_like(keys)
        _launch(k, interpret, "sort_key_kernel", (_cdiv(n, 1024),),
                (keys, skey, n, g.num_buckets), (min(shift, 32),), SHIFT=min(shift, 32),
                BLOCK=1024)
        perm = torch.sort(skey).indices
        head = torch.empty(n, dtype=torch.int64, device=dev) if dedup else perm
        _launch(k, interpret, "probe_kernel", (_cdiv(n, pk),),
                (keys, perm, head, tab_keys, versions, found, n, g.num_buckets),
                (True, dedup, *common.values()), PERM=True, DEDUP=dedup, **common)
        out, hit = _read_found(k, reg, found, ver2, gather)
        if dedup:
            head = torch.cummax(head, 0).values
            bkf = max(1, min(64, 4096 // bd))
            _launch(k, interpret, "fill_dups_kernel", (_cdiv(n, bkf),),
                    (perm, head, out, hit, n, g.dim), (bkf, bd, bd == g.dim, out.dtype),
                    BLOCK_K=bkf, BLOCK_D=bd, EVEN_D=bd == g.dim)
        return out, hit
    if dedup:
        uniq, inverse = torch.unique(keys, return_inverse=True)
    else:
        uniq, inverse = keys, None
    n = uniq.numel()
    if sort and n > 1:
        buckets = torch.empty_like(uniq)
        grid = (_cdiv(n, 1024),)
        _launch(k, interpret, "bucket_kernel", grid, (uniq, buckets, n, g.num_buckets), (),
                BLOCK=1024)
        pos = torch.argsort(buckets)
        visit = uniq.index_select(0, pos)
    else:
        visit = uniq
        pos = torch.arange(n, dtype=torch.int64, device=dev)
    found = found[:n]
    if n:
        _launch(k, interpret, "probe_kernel", (_cdiv(n, pk),),
                (visit, pos, pos, tab_keys, versions, found, n, g.num_buckets),
                (False, False, *common.values()), PERM=False, DEDUP=False, **common)
    out, hit = _read_found(k, reg, found, ver2, gather)
    if inverse is not None:
        return out.index_select(0, inverse), hit.index_select(0, inverse)
    return out, hit


def _read_found(k: ModuleType, reg: Any, found: torch.Tensor, ver2: torch.Tensor,
                gather: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 2 and 3 of a lookup: the rows of the probed slots, then the versions again;
    rows of keys whose version changed are zeroed (``gather=False``: no rows, zeros)."""
    g = reg.geometry
    interpret = reg.device.type != "cuda"
    n = found.numel()
    rows = reg.rows()
    out = (torch.empty if gather else torch.zeros)((n, g.dim), dtype=g.dtype,
                                                   device=found.device)
    hit = torch.empty(n, dtype=torch.bool, device=found.device)
    if n == 0:
        return out, hit
    if gather:
        bd = _block_d(g.dim)
        bk = TILES.block_k or _block_k(bd)
        _launch(k, interpret, "gather_found_kernel", (_cdiv(n, bk),),
                (found, rows, out, n, rows.stride(0), g.dim),
                (bk, bd, bd == g.dim, TILES.warps, g.dtype),
                BLOCK_K=bk, BLOCK_D=bd, EVEN_D=bd == g.dim, num_warps=TILES.warps)
    _launch(k, interpret, "verify_kernel", (_cdiv(n, 1024),), (found, ver2, hit, n), (),
            BLOCK=1024)
    if gather:
        out.masked_fill_(~hit[:, None], 0)  # read while a writer was in the slot
    return out, hit


# -- linear table gather -------------------------------------------------------------------


def linear_gather(
    reg: Any,
    indices: torch.Tensor,
    *,
    backend: Backend = "auto",
    dedup: bool = True,
    sort: bool = True,
) -> torch.Tensor:
    """Rows ``indices`` of a registered :class:`hostcache.SharedMemBlock`.

    Args:
        reg: a :class:`gpu.cuda.registration.HostRegistration` of a linear table.
        indices: int64 ``[N]`` on ``reg.device``, each in ``[0, num_rows)``.
        backend: as for :func:`hostcache_lookup` (``"torch"``: ``index_select`` on the
            registered view).
        dedup: fetch each distinct row once (Triton path).
        sort: visit rows in index (= host page) order (Triton path).

    Returns:
        ``[N, dim]`` rows in the table's dtype on ``reg.device``.

    Raises:
        BadArgumentError: wrong registration kind, dtype, shape, device, or an index out of
            range (checked with one device sync per call: an out-of-range read of host
            memory would kill the CUDA context).
    """
    _check_reg(reg, host_cache=False)
    idx = _check_ids(indices, reg, "indices")
    num_rows = reg.geometry.capacity
    if idx.numel():
        lo, hi = (int(v) for v in torch.aminmax(idx))
        if lo < 0 or hi >= num_rows:
            raise BadArgumentError(
                f"indices must be in [0, {num_rows}) for table {reg.name!r}; got values in "
                f"[{lo}, {hi}]"
            )
    if not _backend(backend, reg.device):
        return reg.rows().index_select(0, idx)
    return _gather_triton(reg, idx, dedup=dedup, sort=sort)


@on_tensor_device
def _gather_triton(reg: Any, idx: torch.Tensor, *, dedup: bool, sort: bool) -> torch.Tensor:
    g = reg.geometry
    k = _kernels(reg.device.type != "cuda")
    rows = reg.rows()
    dev = idx.device
    inverse = None
    if dedup:
        visit, inverse = torch.unique(idx, sorted=True, return_inverse=True)
        pos = torch.arange(visit.numel(), dtype=torch.int64, device=dev)
    elif sort:
        visit, pos = torch.sort(idx)
    else:
        visit, pos = idx, torch.arange(idx.numel(), dtype=torch.int64, device=dev)
    n = visit.numel()
    out = torch.empty((n, g.dim), dtype=g.dtype, device=dev)
    if n:
        bd = _block_d(g.dim)
        bk = _block_k(bd)
        k.gather_kernel[(_cdiv(n, bk),)](
            visit, pos, rows, out, n, rows.stride(0), g.dim, BLOCK_K=bk, BLOCK_D=bd,
            EVEN_D=bd == g.dim,
        )
    return out if inverse is None else out.index_select(0, inverse)
