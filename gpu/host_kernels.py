"""Reading the registered shared host tables from the GPU: probe + gather kernels (Triton).

``hostcache_lookup(reg, keys)`` probes a registered :class:`hostcache.HostCache` straight
over the host link; ``linear_gather(reg, indices)`` gathers rows of a registered
:class:`hostcache.SharedMemBlock`. On CPU registrations both have a CPU twin with identical
results (the table's own ``lookup``; ``index_select`` on the CPU view). With
``backend="triton"`` on CPU tensors the very same Triton kernels run under Triton's
interpreter, so the kernel logic is tested on machines without a GPU.

Performance: visit host pages in order
--------------------------------------
Zero-copy reads of host memory are limited by how many distinct host pages a batch
touches at once, not by load width: on the H200 machine, 512-byte rows gathered in random
order reach about a third of the pinned copy bandwidth, in page order most of it. A slot's
row lives at ``rows_off + slot * row_stride`` and its key/version at ``slot * 8`` in their
arrays, with ``slot = bucket * ways + way``: sorting the keys by *bucket* therefore puts
the probe's key/version reads and the row reads all in page order at once. So a lookup:

1. batches up to ``CONFIG["one_sort_max"]`` keys: one kernel computes a sort key per key
   (``bucket << 32 | low hash bits``) and one ``torch.sort`` puts the batch in bucket order
   with equal keys next to each other (no host sync); the probe kernel visits that order
   and fetches only the first key of each run, and a second kernel copies its row to the
   rest of the run in device memory;
2. larger batches: ``torch.unique`` (each row crosses the link once), a small kernel
   hashes the distinct keys, ``torch.sort`` orders them by bucket, the probe kernel runs
   over the distinct keys only, and ``index_select`` expands the rows back to the batch.

Per key, the probe kernel loads the bucket's versions, then its keys, picks the matching
way, gathers the row, re-loads the slot's version, and writes the row (zeros on a miss)
to the key's output position. Measured on the H200 machine (2 GiB table, see
``bench/bench_host_tier.py``): the probe's small reads (64 + 64 + 8 bytes per key), not
the row reads, take most of the time of a large uniform batch.

Memory ordering (why a row is never torn)
-----------------------------------------
Writer (CPU, holding the writer lock, ``hostcache.cache``): version := odd, then key and
row, then version := even. x86 is TSO: stores become visible in program order, to other
cores and to PCIe reads (which snoop the CPU caches) alike.

Reader (GPU, per key): ``v1 = version`` -> ``key`` -> ``row`` -> ``v2 = version``; the key
is a hit only if it matched, ``v1`` is even and ``v2 == v1``. The four steps must be
*performed* (their values fetched from host memory) in that order, which GPU hardware does
not promise by itself: loads to different addresses complete out of order, and PCIe read
requests may pass each other. The kernel therefore

* loads versions and keys with ``volatile=True`` (``ld.volatile``: never served from a
  stale cache line, treated by PTX as relaxed, system scope) and rows with
  ``cache_modifier=".cv"`` (``ld.global.cv``: "consider cached system memory lines stale,
  fetch again"), so duplicate reads inside and across launches go to host memory;
* puts ``fence.acq_rel.sys`` between ``v1`` and the key/row loads, and again between the
  row loads and ``v2`` (inline PTX; the fence's input is a reduction of the values loaded
  before it, and its output, an opaque zero, is added to the addresses loaded after it,
  so neither the compiler nor the hardware can move a load across it);
* the row's address depends on the key loads (the matching way), a true dependency.

With that order, ``v2 == v1`` (versions only grow) means no writer store to the version
was visible between the two reads; every row byte was read in that window, and the row
stores of a write section become visible only after its odd version store (TSO), so any
row byte of a concurrent write section would imply ``v2 != v1``. A row whose last write
section ended before ``v1`` was read is complete, because its even store, which ``v1``
saw, became visible after all its row stores. So a hit is never torn nor foreign.
Under the Triton interpreter loads run one after another in program order; the fence is
compiled out there.

Keys equal to ``hostcache.layout.EMPTY_KEY`` (reserved) are reported as misses on the GPU
(the CPU twin raises, as ``HostCache.lookup`` does): checking would cost a device sync.
GPU lookups do not bump the tables' LFU counters nor its hit/miss statistics.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Any, Literal

import torch

from hostcache import hashing, layout

from ._triton import kernel_module
from .devices import on_tensor_device
from .errors import BadArgumentError, TritonUnavailableError

try:  # NOTE: optional: the module imports (and its CPU twin works) without triton
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - ImportError, or a broken install raising anything
    triton = None
    tl = None

logger = logging.getLogger(__name__)

Backend = Literal["auto", "torch", "triton"]

#: set to "triton" to run the Triton kernels (interpreter) on CPU registrations by default
BACKEND_ENV = "NVEC_HOST_KERNELS"


class TritonNotInstalledError(TritonUnavailableError):
    """The Triton path was asked for but ``triton`` cannot be imported."""


# -- Triton kernels --------------------------------------------------------------------

if triton is not None:
    _M1: tl.constexpr = tl.constexpr(hashing.FMIX_M1)
    _M2: tl.constexpr = tl.constexpr(hashing.FMIX_M2)
    _MASK31: tl.constexpr = tl.constexpr(hashing.MASK31)
    _INT64_MAX: tl.constexpr = tl.constexpr(hashing.INT64_MAX)
    _EMPTY: tl.constexpr = tl.constexpr(layout.EMPTY_KEY)

    @triton.jit
    def _hash63(k):
        """The 63-bit hash of ``hostcache.hashing.bucket_of`` (int64 wrapping multiply)."""
        x = k ^ ((k >> 33) & _MASK31)
        x = x * _M1
        x = x ^ ((x >> 33) & _MASK31)
        x = x * _M2
        x = x ^ ((x >> 33) & _MASK31)
        return x & _INT64_MAX

    @triton.jit
    def _bucket_of(k, num_buckets):
        """``hostcache.hashing.bucket_of``, bit for bit."""
        return _hash63(k) % num_buckets

    # NOTE: reductions use tl.reduce with our own combine functions, not tl.sum/tl.min:
    # those are @triton.jit helpers of triton's stdlib, decorated when triton was imported,
    # so they do not run in the interpreted variant of this module (see _kernels()).
    @triton.jit
    def _xor(a, b):
        return a ^ b

    @triton.jit
    def _add(a, b):
        return a + b

    @triton.jit
    def _min(a, b):
        return tl.minimum(a, b)

    @triton.jit
    def _sys_fence(x, FENCE: tl.constexpr):  # noqa: N803
        """fence.acq_rel.sys after ``x`` is available; returns an opaque int64 zero."""
        if FENCE:
            z = tl.inline_asm_elementwise(
                "fence.acq_rel.sys;\n\tand.b32 $0, $1, 0;",
                "=r,r",
                [x.to(tl.int32)],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
            return z.to(tl.int64)
        else:
            return (x * 0).to(tl.int64)

    @triton.jit
    def _bucket_kernel(keys_ptr, out_ptr, n, num_buckets, BLOCK: tl.constexpr):  # noqa: N803
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        k = tl.load(keys_ptr + offs, mask=m, other=0)
        tl.store(out_ptr + offs, _bucket_of(k, num_buckets), mask=m)

    @triton.jit
    def _sort_key_kernel(keys_ptr, out_ptr, n, num_buckets, SHIFT: tl.constexpr,  # noqa: N803
                         BLOCK: tl.constexpr):  # noqa: N803
        """``bucket << SHIFT | low SHIFT bits of the hash``: bucket order, and equal keys
        (equal hashes) next to each other once sorted."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = _hash63(tl.load(keys_ptr + offs, mask=m, other=0))
        if SHIFT > 0:
            c = ((x % num_buckets) << SHIFT) | (x & ((1 << SHIFT) - 1))
        else:
            c = x % num_buckets
        tl.store(out_ptr + offs, c, mask=m)

    @triton.jit
    def _fill_dups_kernel(
        perm_ptr, head_ptr, out_ptr, hit_ptr, n, dim,
        BLOCK_K: tl.constexpr,  # noqa: N803
        BLOCK_D: tl.constexpr,  # noqa: N803
        EVEN_D: tl.constexpr,  # noqa: N803
    ):
        """Duplicates take the row and hit of their run's first key (device memory only)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
        m = offs < n
        h = tl.load(head_ptr + offs, mask=m, other=0)
        dup = m & (h != offs)
        dst = tl.load(perm_ptr + offs, mask=dup, other=0)
        src = tl.load(perm_ptr + h, mask=dup, other=0)
        d = tl.arange(0, BLOCK_D)
        dmask = (d < BLOCK_D) if EVEN_D else (d < dim)
        mask = dup[:, None] & dmask[None, :]
        row = tl.load(out_ptr + src[:, None] * dim + d[None, :], mask=mask, other=0)
        tl.store(out_ptr + dst[:, None] * dim + d[None, :], row, mask=mask)
        tl.store(hit_ptr + dst, tl.load(hit_ptr + src, mask=dup, other=0), mask=dup)

    @triton.jit
    def _probe_gather_kernel(
        keys_ptr,  # int64 [n] keys to look up (sorted by bucket for page order), or with
        # PERM the batch's keys in their own order
        pos_ptr,  # int64 [n] output row of each key (with PERM: the visiting order)
        head_ptr,  # int64 [n] with DEDUP: i where key i starts a run of equal keys, else 0
        tab_keys_ptr,  # int64 [slots] registered keys
        tab_ver_ptr,  # int64 [slots] registered versions (first read)
        tab_ver2_ptr,  # int64 [slots] versions for the second read (the same, but in tests)
        rows_ptr,  # [slots, dim] registered rows, row stride `row_stride` elements
        out_ptr,  # [n_out, dim] output rows (contiguous)
        hit_ptr,  # bool [n_out]
        n,
        num_buckets,
        row_stride,
        dim,
        WAYS: tl.constexpr,  # noqa: N803
        BLOCK_K: tl.constexpr,  # noqa: N803
        BLOCK_D: tl.constexpr,  # noqa: N803
        FENCE: tl.constexpr,  # noqa: N803
        EVEN_D: tl.constexpr,  # noqa: N803 - dim == BLOCK_D: no column mask (wide loads)
        PERM: tl.constexpr = False,  # noqa: N803 - visit keys_ptr[pos_ptr[i]], write there
        DEDUP: tl.constexpr = False,  # noqa: N803 - with PERM: fetch only a run's first key
        GATHER: tl.constexpr = True,  # noqa: N803 - False: probe only (for measurements)
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
        m = offs < n
        if PERM:
            pos = tl.load(pos_ptr + offs, mask=m, other=0)
            k = tl.load(keys_ptr + pos, mask=m, other=_EMPTY)
            if DEDUP:
                prev = tl.load(pos_ptr + offs - 1, mask=m & (offs > 0), other=0)
                pk = tl.load(keys_ptr + prev, mask=m & (offs > 0), other=0)
                head = (offs == 0) | (pk != k)
                tl.store(head_ptr + offs, tl.where(head, offs, 0), mask=m)
                m = m & head
        else:
            k = tl.load(keys_ptr + offs, mask=m, other=_EMPTY)
        b = _bucket_of(k, num_buckets)
        w = tl.arange(0, WAYS)
        sidx = b[:, None] * WAYS + w[None, :]
        # 1. versions of the bucket's ways (v1)
        v1s = tl.load(tab_ver_ptr + sidx, mask=m[:, None], other=1, volatile=True)
        dep = _sys_fence(tl.reduce(v1s, 1, _xor), FENCE)
        # 2. keys of the bucket, after v1
        ks = tl.load(tab_keys_ptr + sidx + dep[:, None], mask=m[:, None], other=_EMPTY,
                     volatile=True)
        match = (ks == k[:, None]) & (k != _EMPTY)[:, None]
        way = tl.reduce(tl.where(match, w[None, :], WAYS), 1, _min)
        v1 = tl.reduce(tl.where(w[None, :] == way[:, None], v1s, 0), 1, _add)
        ok = m & (way < WAYS) & ((v1 & 1) == 0)
        slot = b * WAYS + tl.minimum(way, WAYS - 1)
        # 3. the row (address depends on the matched way)
        d = tl.arange(0, BLOCK_D)
        dmask = (d < BLOCK_D) if EVEN_D else (d < dim)
        if GATHER:
            row = tl.load(
                rows_ptr + slot[:, None] * row_stride + d[None, :],
                mask=ok[:, None] & dmask[None, :],
                other=0,
                cache_modifier=".cv",
            )
            row_sum = tl.reduce(row.to(tl.float32), 1, _add)
            dep2 = _sys_fence(row_sum.to(tl.int32, bitcast=True), FENCE)
        else:
            row = tl.full([BLOCK_K, BLOCK_D], 0, out_ptr.dtype.element_ty)
            dep2 = _sys_fence(way, FENCE)
        # 4. the version again, after the row
        v2 = tl.load(tab_ver2_ptr + slot + dep2, mask=ok, other=-1, volatile=True)
        hit = ok & (v2 == v1)
        if not PERM:
            pos = tl.load(pos_ptr + offs, mask=m, other=0)
        out = tl.where(hit[:, None], row, 0)
        tl.store(out_ptr + pos[:, None] * dim + d[None, :], out, mask=m[:, None] & dmask[None, :])
        tl.store(hit_ptr + pos, hit, mask=m)

    @triton.jit
    def _gather_kernel(
        idx_ptr,  # int64 [n] row indices (sorted for page order)
        pos_ptr,  # int64 [n] output row of each index
        rows_ptr,  # [num_rows, dim] registered rows, row stride `row_stride` elements
        out_ptr,  # [n_out, dim]
        n,
        row_stride,
        dim,
        BLOCK_K: tl.constexpr,  # noqa: N803
        BLOCK_D: tl.constexpr,  # noqa: N803
        EVEN_D: tl.constexpr,  # noqa: N803
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
        m = offs < n
        idx = tl.load(idx_ptr + offs, mask=m, other=0)
        pos = tl.load(pos_ptr + offs, mask=m, other=0)
        d = tl.arange(0, BLOCK_D)
        dmask = (d < BLOCK_D) if EVEN_D else (d < dim)
        mask = m[:, None] & dmask[None, :]
        row = tl.load(rows_ptr + idx[:, None] * row_stride + d[None, :], mask=mask, other=0,
                      cache_modifier=".cv")
        tl.store(out_ptr + pos[:, None] * dim + d[None, :], row, mask=mask)


def _kernels(interpret: bool) -> ModuleType:
    """This module with its kernels decorated for CUDA or for the Triton interpreter."""
    if triton is None:
        raise TritonNotInstalledError(
            "the Triton kernels need the triton package (`pip install triton`); on CPU "
            "tensors use backend='torch' (the default)"
        )
    # NOTE: the compiled variant is this module itself (decorated at import); the
    # interpreted one is this file executed again with Triton's interpret knob on.
    return kernel_module("host_kernels", interpret=interpret)


# -- argument checks ---------------------------------------------------------------------


def _check_reg(reg: Any, *, host_cache: bool) -> None:
    from .hostreg import HostRegistration

    if not isinstance(reg, HostRegistration):
        raise BadArgumentError(
            f"expected a gpu.hostreg.HostRegistration (from register(table)); got "
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
    if not isinstance(ids, torch.Tensor):
        raise BadArgumentError(f"{what} must be a torch.Tensor of int64; got {type(ids).__name__}")
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise BadArgumentError(
            f"{what} must be a 1-D int64 tensor; got {ids.dtype} of shape {tuple(ids.shape)}"
        )
    if ids.device != reg.device:
        raise BadArgumentError(
            f"{what} are on {ids.device} but table {reg.name!r} is registered for "
            f"{reg.device}; move them with .to({str(reg.device)!r})"
        )
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
        reg: a :class:`gpu.hostreg.HostRegistration` of a host cache.
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


#: launch settings of the host-tier lookup; the bench overrides them to compare variants.
CONFIG: dict[str, int] = {
    "block_k": 0,  # keys per program; 0: 2048 // BLOCK_D, at most 32
    "warps": 4,
    # Batches up to this many keys dedup and sort with one sort and no host sync; larger
    # ones with torch.unique, then a sort of the distinct keys by bucket, so the probe runs
    # over the distinct keys only (on the H200: faster from 256k keys on, slower at 64k).
    "one_sort_max": 1 << 17,
}


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
    """Triton probe + gather; ``versions_again`` stands in for the second version read."""
    g = reg.geometry
    interpret = reg.device.type != "cuda"
    k = _kernels(interpret)
    versions, tab_keys, rows = reg.versions(), reg.keys(), reg.rows()
    ver2 = versions if versions_again is None else versions_again
    dev = keys.device
    bd = _block_d(g.dim)
    bk = CONFIG["block_k"] or _block_k(bd)
    common = dict(WAYS=g.ways, BLOCK_K=bk, BLOCK_D=bd, FENCE=fence and not interpret,
                  EVEN_D=bd == g.dim, GATHER=gather, num_warps=CONFIG["warps"])
    n = keys.numel()
    if sort and 1 < n <= CONFIG["one_sort_max"]:
        # One sort of (bucket, hash bits): bucket (= host page) order, and equal keys next
        # to each other; the kernel fetches only the first key of each run of equal keys
        # and a second kernel copies its row to the others, in device memory.
        shift = max(0, 62 - max(1, g.num_buckets - 1).bit_length())
        skey = torch.empty_like(keys)
        k._sort_key_kernel[(triton.cdiv(n, 1024),)](
            keys, skey, n, g.num_buckets, SHIFT=min(shift, 32), BLOCK=1024)
        perm = torch.sort(skey).indices
        out = torch.empty((n, g.dim), dtype=g.dtype, device=dev)
        hit = torch.empty(n, dtype=torch.bool, device=dev)
        head = torch.empty(n, dtype=torch.int64, device=dev) if dedup else perm
        k._probe_gather_kernel[(triton.cdiv(n, bk),)](
            keys, perm, head, tab_keys, versions, ver2, rows, out, hit,
            n, g.num_buckets, rows.stride(0), g.dim, PERM=True, DEDUP=dedup, **common)
        if dedup:
            head = torch.cummax(head, 0).values
            bkf = max(1, min(64, 4096 // bd))
            k._fill_dups_kernel[(triton.cdiv(n, bkf),)](
                perm, head, out, hit, n, g.dim, BLOCK_K=bkf, BLOCK_D=bd, EVEN_D=bd == g.dim)
        return out, hit
    if dedup:
        uniq, inverse = torch.unique(keys, return_inverse=True)
    else:
        uniq, inverse = keys, None
    n = uniq.numel()
    if sort and n > 1:
        buckets = torch.empty_like(uniq)
        grid = (triton.cdiv(n, 1024),)
        k._bucket_kernel[grid](uniq, buckets, n, g.num_buckets, BLOCK=1024)
        pos = torch.argsort(buckets)
        visit = uniq.index_select(0, pos)
    else:
        visit = uniq
        pos = torch.arange(n, dtype=torch.int64, device=dev)
    out = torch.empty((n, g.dim), dtype=g.dtype, device=dev)
    hit = torch.empty(n, dtype=torch.bool, device=dev)
    if n:
        k._probe_gather_kernel[(triton.cdiv(n, bk),)](
            visit, pos, pos, tab_keys, versions, ver2, rows, out, hit,
            n, g.num_buckets, rows.stride(0), g.dim, **common)
    if inverse is not None:
        return out.index_select(0, inverse), hit.index_select(0, inverse)
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
        reg: a :class:`gpu.hostreg.HostRegistration` of a linear table.
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
        k._gather_kernel[(triton.cdiv(n, bk),)](
            visit, pos, rows, out, n, rows.stride(0), g.dim, BLOCK_K=bk, BLOCK_D=bd,
            EVEN_D=bd == g.dim,
        )
    return out if inverse is None else out.index_select(0, inverse)
