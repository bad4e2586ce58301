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

Three launches per lookup: the probe (per key, the bucket's versions, then its keys: the
matching slot and the version read, packed in one int64), the row gather of the found
slots, and the check (each found slot's version read again: a hit if unchanged); rows of
keys whose version changed are then zeroed. Measured on the H200 machine (2 GiB table, see
``bench/bench_host_tier.py``): the probe's small reads (64 + 64 + 8 bytes per key), not
the row reads, take most of the time of a large uniform batch.

Memory ordering (why a row is never torn)
-----------------------------------------
Writer (CPU, holding the writer lock, ``hostcache.cache``): version := odd, then key and
row, then version := even. x86 is TSO: stores become visible in program order, to other
cores and to PCIe reads (which snoop the CPU caches) alike.

Reader (GPU, per key): ``v1 = version`` -> ``key`` -> ``row`` -> ``v2 = version``; the key
is a hit only if it matched, ``v1`` is even and ``v2 == v1``. The four steps must be
*performed* (their values fetched from host memory) in that order, and every part of the
row must be judged by the same ``v1`` and ``v2``. Neither comes for free on a GPU:

* loads to different addresses complete out of order, and PCIe read requests may pass
  each other. Between ``v1`` and the keys the probe puts ``fence.acq_rel.sys`` (inline
  PTX; the fence's input is a reduction of the versions, its output an opaque zero added
  to the key addresses, so neither the compiler nor the hardware moves a key load before
  it), and loads versions and keys with ``volatile=True`` (``ld.volatile``: relaxed,
  system scope, never a stale cached line). The row gather and the second version read
  are separate launches on the same stream: a launch starts after every load of the one
  before it has completed, the strongest fence there is, and rows are loaded with
  ``cache_modifier=".cv"`` ("consider cached system memory lines stale, fetch again");
* a Triton program spreads one key's row over many threads (a 16 KiB row over every warp
  of the program), and each thread evaluates a per-key value such as ``v1`` with loads of
  its own. Under a concurrent write, threads of one key read different versions: a
  single-launch reader that let each thread judge its own part of the row returned rows
  half old, half zero on the H200 (dim 4096, while dims up to 128 never showed it). So
  the probe stores one packed (slot, version) word per key (whichever thread's store
  lands, it is a pair that thread read), the gather reads the row of that slot, and the
  check compares that version with a version read after the gather: one verdict per key,
  from values in device memory that every thread reads alike.

With that order, ``v2 == v1`` (versions only grow) means no writer store to the version
was visible between the two reads; every row byte was read in that window, and the row
stores of a write section become visible only after its odd version store (TSO), so any
row byte of a concurrent write section would imply ``v2 != v1``. A row whose last write
section ended before ``v1`` was read is complete, because its even store, which ``v1``
saw, became visible after all its row stores. So a hit is never torn nor foreign. (The
version is compared modulo 2^24, the bits packed beside the slot: a false match needs 2^23
writes to one slot while one lookup reads it.) Under the Triton interpreter loads run one
after another in program order; the fence is compiled out there.

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

    #: a probed key's slot and the low bits of the version it had, packed in one int64
    #: (``slot << _VER_BITS | version & _VER_MASK``; -1: not found), so that every thread
    #: of a program that stores it stores a pair it read itself (see "Memory ordering")
    _VER_BITS: tl.constexpr = tl.constexpr(24)
    _VER_MASK: tl.constexpr = tl.constexpr((1 << 24) - 1)

    @triton.jit
    def _probe_kernel(
        keys_ptr,  # int64 [n] keys to look up (sorted by bucket for page order), or with
        # PERM the batch's keys in their own order
        pos_ptr,  # int64 [n] output position of each key (with PERM: the visiting order)
        head_ptr,  # int64 [n] with DEDUP: i where key i starts a run of equal keys, else 0
        tab_keys_ptr,  # int64 [slots] registered keys
        tab_ver_ptr,  # int64 [slots] registered versions
        found_ptr,  # int64 [n_out] packed (slot, version) of each found key, else -1
        n,
        num_buckets,
        WAYS: tl.constexpr,  # noqa: N803
        BLOCK_K: tl.constexpr,  # noqa: N803
        FENCE: tl.constexpr,  # noqa: N803
        PERM: tl.constexpr = False,  # noqa: N803 - visit keys_ptr[pos_ptr[i]], write there
        DEDUP: tl.constexpr = False,  # noqa: N803 - with PERM: probe only a run's first key
    ):
        """Step 1 of a lookup: the bucket's versions (v1), then its keys (after v1)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
        inside = offs < n
        m = inside
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
            pos = tl.load(pos_ptr + offs, mask=m, other=0)
        b = _bucket_of(k, num_buckets)
        w = tl.arange(0, WAYS)
        sidx = b[:, None] * WAYS + w[None, :]
        v1s = tl.load(tab_ver_ptr + sidx, mask=m[:, None], other=1, volatile=True)
        dep = _sys_fence(tl.reduce(v1s, 1, _xor), FENCE)
        ks = tl.load(tab_keys_ptr + sidx + dep[:, None], mask=m[:, None], other=_EMPTY,
                     volatile=True)
        match = (ks == k[:, None]) & (k != _EMPTY)[:, None]
        way = tl.reduce(tl.where(match, w[None, :], WAYS), 1, _min)
        v1 = tl.reduce(tl.where(w[None, :] == way[:, None], v1s, 0), 1, _add)
        ok = m & (way < WAYS) & ((v1 & 1) == 0)
        slot = b * WAYS + tl.minimum(way, WAYS - 1)
        found = tl.where(ok, (slot << _VER_BITS) | (v1 & _VER_MASK), -1)
        tl.store(found_ptr + pos, found, mask=inside)  # (DEDUP: -1 for a run's other keys)

    @triton.jit
    def _gather_found_kernel(
        found_ptr,  # int64 [n] packed (slot, version) from _probe_kernel, or -1
        rows_ptr,  # [slots, dim] registered rows, row stride `row_stride` elements
        out_ptr,  # [n, dim] output rows (contiguous); zeros where not found
        n,
        row_stride,
        dim,
        BLOCK_K: tl.constexpr,  # noqa: N803
        BLOCK_D: tl.constexpr,  # noqa: N803
        EVEN_D: tl.constexpr,  # noqa: N803 - dim == BLOCK_D: no column mask (wide loads)
    ):
        """Step 2: the rows of the found slots (a launch after every v1 was read)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
        m = offs < n
        f = tl.load(found_ptr + offs, mask=m, other=-1)
        ok = f >= 0
        slot = tl.where(ok, f >> _VER_BITS, 0)
        d = tl.arange(0, BLOCK_D)
        dmask = (d < BLOCK_D) if EVEN_D else (d < dim)
        row = tl.load(rows_ptr + slot[:, None] * row_stride + d[None, :],
                      mask=ok[:, None] & dmask[None, :], other=0, cache_modifier=".cv")
        tl.store(out_ptr + offs[:, None] * dim + d[None, :], row, mask=m[:, None] & dmask[None, :])

    @triton.jit
    def _verify_kernel(
        found_ptr,  # int64 [n] packed (slot, version) from _probe_kernel, or -1
        tab_ver_ptr,  # int64 [slots] registered versions (the second read: v2)
        hit_ptr,  # bool [n]
        n,
        BLOCK: tl.constexpr,  # noqa: N803
    ):
        """Step 3: a key is a hit if its slot still has the version step 1 read (a launch
        after every row was read)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        f = tl.load(found_ptr + offs, mask=m, other=-1)
        ok = m & (f >= 0)
        v2 = tl.load(tab_ver_ptr + tl.where(ok, f >> _VER_BITS, 0), mask=ok, other=-1,
                     volatile=True)
        tl.store(hit_ptr + offs, ok & ((v2 & _VER_MASK) == (f & _VER_MASK)), mask=m)

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
    "block_k": 0,  # keys per program of the row gather; 0: 2048 // BLOCK_D, at most 32
    "probe_block_k": 64,  # keys per program of the probe
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
    """Triton probe, gather, verify; ``versions_again`` stands in for the second version
    read (tests), ``fence=False`` / ``gather=False`` are the bench's variants."""
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
    pk = CONFIG["probe_block_k"]
    common = dict(WAYS=g.ways, BLOCK_K=pk, FENCE=fence and not interpret,
                  num_warps=CONFIG["warps"])
    n = keys.numel()
    found = torch.empty(n, dtype=torch.int64, device=dev)
    if sort and 1 < n <= CONFIG["one_sort_max"]:
        # One sort of (bucket, hash bits): bucket (= host page) order, and equal keys next
        # to each other; the probe looks up only the first key of each run of equal keys
        # and, once the rows are read and checked, a last kernel copies its row to the
        # others, in device memory.
        shift = max(0, 62 - max(1, g.num_buckets - 1).bit_length())
        skey = torch.empty_like(keys)
        k._sort_key_kernel[(triton.cdiv(n, 1024),)](
            keys, skey, n, g.num_buckets, SHIFT=min(shift, 32), BLOCK=1024)
        perm = torch.sort(skey).indices
        head = torch.empty(n, dtype=torch.int64, device=dev) if dedup else perm
        k._probe_kernel[(triton.cdiv(n, pk),)](
            keys, perm, head, tab_keys, versions, found, n, g.num_buckets, PERM=True,
            DEDUP=dedup, **common)
        out, hit = _read_found(k, reg, found, ver2, gather)
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
    found = found[:n]
    if n:
        k._probe_kernel[(triton.cdiv(n, pk),)](
            visit, pos, pos, tab_keys, versions, found, n, g.num_buckets, **common)
    out, hit = _read_found(k, reg, found, ver2, gather)
    if inverse is not None:
        return out.index_select(0, inverse), hit.index_select(0, inverse)
    return out, hit


def _read_found(k: ModuleType, reg: Any, found: torch.Tensor, ver2: torch.Tensor,
                gather: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 2 and 3 of a lookup: the rows of the probed slots, then the versions again;
    rows of keys whose version changed are zeroed (``gather=False``: no rows, zeros)."""
    g = reg.geometry
    n = found.numel()
    rows = reg.rows()
    out = (torch.empty if gather else torch.zeros)((n, g.dim), dtype=g.dtype,
                                                   device=found.device)
    hit = torch.empty(n, dtype=torch.bool, device=found.device)
    if n == 0:
        return out, hit
    if gather:
        bd = _block_d(g.dim)
        bk = CONFIG["block_k"] or _block_k(bd)
        k._gather_found_kernel[(triton.cdiv(n, bk),)](
            found, rows, out, n, rows.stride(0), g.dim, BLOCK_K=bk, BLOCK_D=bd,
            EVEN_D=bd == g.dim, num_warps=CONFIG["warps"])
    k._verify_kernel[(triton.cdiv(n, 1024),)](found, ver2, hit, n, BLOCK=1024)
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
