"""Triton kernels reading a registered shared host cache from the GPU.

Loaded only through :func:`gpu.kernels.triton_access.kernel_module`, compiled for CUDA tensors or
interpreted for CPU tensors, and launched by :mod:`gpu.kernels.host_reads` (argument checks,
the batch pipelines, the CPU twin). A slot ``bucket * ways + way`` of a registered
:class:`hostcache.HostCache` has its key and version at ``slot * 8`` in their arrays and
its row at ``rows_off + slot * row_stride`` (``hostcache.layout``); a key's bucket is
``hostcache.hashing.bucket_of`` (:mod:`gpu.kernels.key_hash`).

A lookup is three launches: the probe (:func:`probe_kernel`: per key, the bucket's
versions, then its keys: the matching slot and the version read, packed in one int64),
the row gather of the found slots (:func:`gather_found_kernel`), and the check
(:func:`verify_kernel`: each found slot's version read again, a hit if unchanged); the
launcher then zeroes the rows of keys whose version changed.

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
  PTX, compiled to ``MEMBAR.ALL.SYS``). The fence's input is a reduction of the versions,
  so it cannot run before they have arrived, and the key loads follow it in program
  order, which an SM issues in order (the fence's output, a zero added to the key
  addresses, only keeps the statement alive: ptxas folds ``and.b32 x, 0``, so the keys'
  addresses carry no dependency; the fence alone orders them, and
  ``tests/gpu/kernels/test_kernels_compile.py`` checks the compiled order). Versions and keys
  are loaded with ``volatile=True`` (``ld.volatile``: relaxed, system scope, never a
  stale cached line). The row gather and the second version read
  are separate launches on the same stream: a launch starts after every load of the one
  before it has completed, the strongest fence there is, and rows are loaded
  volatile too (``ld.volatile``: a ``.cv`` load, "fetch again", is weak, and a GPU served
  ``.cv`` loads of host memory from earlier ones: :mod:`gpu.kernels.stored_rows`);
* a Triton program spreads one key's row over many threads (a 16 KiB row over every warp
  of the program), and each thread evaluates a per-key value such as ``v1`` with loads of
  its own. Under a concurrent write, threads of one key read different versions: a
  single-launch reader that let each thread judge its own part of the row returned rows
  half old, half zero (large rows; bench/RESULTS.md, "Host tier read from the GPU"). So
  the probe stores one packed (slot, version) word per key
  (whichever thread's store lands, it is a pair that thread read), the gather reads the
  row of that slot, and the check compares that version with a version read after the
  gather: one verdict per key, from values in device memory that every thread reads
  alike.

With that order, ``v2 == v1`` (versions only grow) means no writer store to the version
was visible between the two reads; every row byte was read in that window, and the row
stores of a write section become visible only after its odd version store (TSO), so any
row byte of a concurrent write section would imply ``v2 != v1``. A row whose last write
section ended before ``v1`` was read is complete, because its even store, which ``v1``
saw, became visible after all its row stores. So a hit is never torn nor foreign. (The
version is compared modulo 2^24, the bits packed beside the slot: a false match needs 2^23
writes to one slot while one lookup reads it.) Under the Triton interpreter loads run one
after another in program order; the fence is compiled out there.

Quantized caches (int8, float8_e4m3fn): a slot's row is its stored bytes, the payload and
then its float32 scale (and bias) at ``META`` (:mod:`gpu.kernels.stored_rows`). The writer
stores them together inside its write section, as any row byte; the gather loads the
payload and the parameters in the same launch (``load_rows``, volatile), between the
probe's ``v1`` and the check's ``v2``, and dequantizes them there. So the argument above
covers the parameters as it covers the payload: a scale or bias of another write than the
payload it is applied to would have been read inside a write section, and the check then
sees ``v2 != v1`` and the key is a miss (its row zeroed by the launcher).

Keys equal to ``hostcache.layout.EMPTY_KEY`` (reserved) are misses here: checking would
cost a device sync. Nothing here bumps the tables' LFU counters or hit statistics.
"""

from __future__ import annotations

import triton
import triton.language as tl

from gpu.kernels.triton_access import helper_module
from hostcache import layout

# NOTE: the host tier's hash, decorated like this module's kernels (compiled or interpreted)
_hash = helper_module("key_hash")
hash_keys = _hash.hash_keys
bucket_of = _hash.bucket_of
# NOTE: a quantized cache's rows read dequantized, as the linear tables' kernels read them
_stored = helper_module("stored_rows")
_load_rows = _stored.load_rows
_to_dtype = _stored.to_dtype
codec_constexprs = _stored.codec_constexprs

_EMPTY: tl.constexpr = tl.constexpr(layout.EMPTY_KEY)


# NOTE: reductions use tl.reduce with our own combine functions, not tl.sum/tl.min:
# those are @triton.jit helpers of triton's stdlib, decorated when triton was imported,
# so they do not run in the interpreted variant of this module (see gpu.kernels.triton_access).
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
    """fence.acq_rel.sys once ``x`` has arrived; returns an int64 zero (folded by ptxas:
    what follows is ordered by the fence, not by a dependency on this value)."""
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


# NOTE: batch sizes and table sizes are not specialized (as in gpu.kernels.cache_lookup):
# a replica's sizes would otherwise compile variants its node's warm-up did not
@triton.jit(do_not_specialize=["n", "num_buckets"])
def bucket_kernel(keys_ptr, out_ptr, n, num_buckets, BLOCK: tl.constexpr):  # noqa: N803
    """The bucket of every key (``hostcache.hashing.bucket_of``)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    k = tl.load(keys_ptr + offs, mask=m, other=0)
    tl.store(out_ptr + offs, bucket_of(k, num_buckets), mask=m)


@triton.jit(do_not_specialize=["n", "num_buckets"])
def sort_key_kernel(keys_ptr, out_ptr, n, num_buckets, SHIFT: tl.constexpr,  # noqa: N803
                    BLOCK: tl.constexpr):  # noqa: N803
    """``bucket << SHIFT | low SHIFT bits of the hash``: bucket order, and equal keys
    (equal hashes) next to each other once sorted."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = hash_keys(tl.load(keys_ptr + offs, mask=m, other=0))
    if SHIFT > 0:
        c = ((x % num_buckets) << SHIFT) | (x & ((1 << SHIFT) - 1))
    else:
        c = x % num_buckets
    tl.store(out_ptr + offs, c, mask=m)


@triton.jit(do_not_specialize=["n"])
def fill_dups_kernel(
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


@triton.jit(do_not_specialize=["n", "num_buckets"])
def probe_kernel(
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
    b = bucket_of(k, num_buckets)
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


@triton.jit(do_not_specialize=["n"])
def gather_found_kernel(
    found_ptr,  # int64 [n] packed (slot, version) from probe_kernel, or -1
    rows_ptr,  # [slots, dim] registered rows, row stride `row_stride` elements; QUANT:
    # uint8 [slots, stored bytes], the stored rows, row stride `row_stride` bytes
    out_ptr,  # [n, dim] output rows (contiguous); zeros where not found
    n,
    row_stride,
    dim,
    BLOCK_K: tl.constexpr,  # noqa: N803
    BLOCK_D: tl.constexpr,  # noqa: N803
    EVEN_D: tl.constexpr,  # noqa: N803 - dim == BLOCK_D: no column mask (wide loads)
    QUANT: tl.constexpr = 0,  # noqa: N803 - the rows' format (gpu.kernels.stored_rows)
    META: tl.constexpr = 0,  # noqa: N803 - byte offset of a quantized row's parameters
    SEQ: tl.constexpr = 0,  # noqa: N803 - a linear table's row versions: never here
):
    """Step 2: the rows of the found slots (a launch after every v1 was read); a quantized
    cache's dequantized (payload, scale and bias loaded together) in ``out_ptr``'s dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    m = offs < n
    f = tl.load(found_ptr + offs, mask=m, other=-1)
    ok = f >= 0
    slot = tl.where(ok, f >> _VER_BITS, 0)
    d = tl.arange(0, BLOCK_D)
    dmask = (d < BLOCK_D) if EVEN_D else (d < dim)
    if QUANT == 0:
        row = tl.load(rows_ptr + slot[:, None] * row_stride + d[None, :],
                      mask=ok[:, None] & dmask[None, :], other=0, volatile=True)
    else:
        # NOTE: the parameters are bytes of the same slot's row, loaded in this launch
        # with the payload (volatile too): inside the v1..v2 window that verify_kernel checks
        row = _to_dtype(_load_rows(rows_ptr, slot, ok, row_stride, d, dmask, QUANT, META, 1, 0),
                        out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs[:, None] * dim + d[None, :], row, mask=m[:, None] & dmask[None, :])


@triton.jit(do_not_specialize=["n"])
def verify_kernel(
    found_ptr,  # int64 [n] packed (slot, version) from probe_kernel, or -1
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
