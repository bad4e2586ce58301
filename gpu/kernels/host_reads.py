"""Reading a registered shared host cache from the GPU.

``hostcache_lookup(reg, keys)`` probes a registered :class:`hostcache.HostCache` straight
over the host link. On CPU registrations the table's own ``lookup`` gives identical
results; ``backend="torch"`` runs the same seqlock probe in torch ops over the registered
views (any device: where Triton is missing); with ``backend="triton"`` on CPU tensors the
very same Triton kernels run under Triton's interpreter, so the kernel logic is tested on
machines without a GPU. (A registered :class:`hostcache.SharedMemBlock` is read by the
GPULayer gather, :mod:`gpu.kernels.gather`, and the GPU cache's linear lookups.) A quantized
host cache (int8, float8_e4m3fn) is read as its stored bytes and dequantized in the gather
(:mod:`gpu.kernels.stored_rows`), in the dtype a caller asks for (``out_dtype``: a layer's),
bit for bit :func:`nvecache.common.quant.decode`; the torch path decodes the stored bytes
it copied out inside the seqlock window, the CPU path is the table's own lookup.

This module checks the arguments, picks the backend and runs the batch pipelines; the
kernels, and the memory-ordering argument for why a lookup is three launches (probe ->
gather -> verify) and never returns a torn row, are in :mod:`gpu.kernels.host_tier`.

Performance: visit host pages in order
--------------------------------------
Zero-copy reads of host memory are limited by how many distinct host pages a batch
touches at once, not by load width. A
slot's row lives at ``rows_off + slot * row_stride`` and its key/version at ``slot * 8``
in their arrays, with ``slot = bucket * ways + way``: sorting the keys by *bucket*
therefore puts the probe's key/version reads and the row reads all in page order at once.
So a lookup:

1. batches up to ``Tiles.host_one_sort_max`` keys: one kernel computes a sort key per key
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

import logging
from types import ModuleType
from typing import Any, Literal

import torch

from gpu.cuda.devices import on_tensor_device
from gpu.cuda.registration import HostRegistration
from gpu.errors import BadArgumentError, TritonNotInstalledError
from gpu.kernels.tiles import DEFAULT_TILES, Tiles
from gpu.kernels.triton_access import kernel_module, triton_available
from hostcache import hashing, layout
from nvecache.common import quant
from nvecache.common.keys import key_problem
from nvecache.common.rows import LAYER_DTYPES, RowFormat, torch_dtype

__all__ = ["Backend", "TritonNotInstalledError", "hostcache_lookup", "triton_lookup"]

logger = logging.getLogger(__name__)

Backend = Literal["auto", "torch", "triton"]


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


def _check_reg(reg: Any) -> None:
    if not isinstance(reg, HostRegistration):
        raise BadArgumentError(
            f"expected a gpu.cuda.registration.HostRegistration (from register(table)); got "
            f"{type(reg).__name__}"
        )
    _ = reg.address  # NOTE: raises RegistrationClosedError / ForkedProcessError
    if not reg.is_host_cache:
        raise BadArgumentError(
            f"table {reg.name!r} is not a HostCache; a registered SharedMemBlock is read "
            "through a layer (LayerType.GPULayer or LinearUVM storage)"
        )


def _check_ids(ids: object, reg: Any, what: str) -> torch.Tensor:
    problem = key_problem(ids, device=reg.device)
    if problem is not None:
        raise BadArgumentError(f"{what} {problem} (table {reg.name!r} is registered for "
                               f"{reg.device})")
    assert isinstance(ids, torch.Tensor)
    return ids.contiguous()


def _backend(backend: object, device: torch.device) -> str:
    """The path a lookup takes: ``"triton"``, ``"torch"`` (the probe in torch ops over the
    registered views) or ``"table"`` (the CPU table's own lookup)."""
    if backend == "auto":
        if device.type != "cuda":
            return "table"
        return "triton" if triton_available() else "torch"
    if backend in ("torch", "triton"):
        return str(backend)
    raise BadArgumentError(f"backend must be 'auto', 'torch' or 'triton'; got {backend!r}")


#: the dtypes a quantized table's rows are read as (a layer's output dtypes)
_DECODED = tuple(torch_dtype(name) for name in LAYER_DTYPES)


def _out_dtype(reg: Any, out_dtype: object) -> torch.dtype:
    """The rows' dtype of a lookup: the table's (a quantized one's: float32), or
    ``out_dtype`` where the table reads as it."""
    g = reg.geometry
    quantized = g.row_format.quantized
    if out_dtype is None:
        return torch.float32 if quantized else g.dtype
    if out_dtype in _DECODED if quantized else out_dtype == g.dtype:
        return out_dtype  # type: ignore[return-value]
    can = ", ".join(str(d) for d in _DECODED) if quantized else str(g.dtype)
    raise BadArgumentError(f"out_dtype {out_dtype!r}: table {reg.name!r} ({g.dtype_name}) is "
                           f"read as {can}")


def _block_d(dim: int) -> int:
    return 1 << max(0, (dim - 1).bit_length())


def _block_k(block_d: int) -> int:
    return max(1, min(32, 2048 // block_d))


def _codec(k: ModuleType, fmt: RowFormat) -> dict[str, Any]:
    """The gather's constexprs of a table's format (``gpu.kernels.stored_rows``, through
    kernel module ``k``): ``QUANT``, ``META`` (a plain table's 0: its variant compiles to
    the code it did before quantized tables), int8's ``enable_fp_fusion=False``. Passed
    every launch: a direct launch takes every constexpr by name, defaults included."""
    cx = _CODECS.get(fmt)
    if cx is None:
        cx = _CODECS[fmt] = k.codec_constexprs(fmt)
    return cx


_CODECS: dict[RowFormat, dict[str, Any]] = {}


# -- host cache lookup ---------------------------------------------------------------------


def hostcache_lookup(
    reg: Any,
    keys: torch.Tensor,
    *,
    backend: Backend = "auto",
    dedup: bool = True,
    sort: bool = True,
    tiles: Tiles = DEFAULT_TILES,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Look ``keys`` up in a registered :class:`hostcache.HostCache`.

    Args:
        reg: a :class:`gpu.cuda.registration.HostRegistration` of a host cache.
        keys: int64 ``[N]`` on ``reg.device``.
        backend: ``"auto"`` (Triton on CUDA where it is importable, else the probe in
            torch ops; the table's own lookup on the CPU), ``"torch"`` (the same seqlock
            probe in torch ops over the registered views, any device), ``"triton"`` (on
            CPU tensors through Triton's interpreter).
        dedup: fetch each distinct key once (Triton path).
        sort: visit keys in bucket (= host page) order (Triton path).
        tiles: the kernels' launch settings (Triton path).
        out_dtype: the rows' dtype: a plain table's own (None); a quantized table's rows
            are dequantized in the gather, in float32 (None), float16 or bfloat16, bit for
            bit ``nvecache.common.quant.decode(stored, fmt, out_dtype)``.

    Returns:
        ``(values [N, dim] of out_dtype, hit bool [N])`` on ``reg.device``; rows of missing
        keys are zeros.

    Raises:
        BadArgumentError: wrong registration kind, dtype, shape or device of ``keys``, an
            ``out_dtype`` the table does not read as.
        RegistrationClosedError: ``reg`` is closed.
        TritonNotInstalledError: ``backend="triton"`` without triton.
    """
    _check_reg(reg)
    keys = _check_ids(keys, reg, "keys")
    dtype = _out_dtype(reg, out_dtype)
    path = _backend(backend, reg.device)
    if path == "triton":
        return _lookup_triton(reg, keys, dedup=dedup, sort=sort, tiles=tiles, out_dtype=dtype)
    if path == "table":
        if not reg.geometry.row_format.quantized or dtype == torch.float32:
            return reg.table.lookup(keys)
        out = torch.empty((keys.numel(), reg.geometry.dim), dtype=dtype)
        return reg.table.lookup(keys, out=out)
    return _lookup_torch(reg, keys, dtype)


def triton_lookup(
    reg: HostRegistration,
    keys: torch.Tensor,
    *,
    dedup: bool = True,
    sort: bool = True,
    versions_again: torch.Tensor | None = None,
    fence: bool = True,
    gather: bool = True,
    tiles: Tiles = DEFAULT_TILES,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton lookup (``backend="triton"``) with the variants tests and benches use.

    Args:
        reg, keys, dedup, sort, tiles, out_dtype: as for :func:`hostcache_lookup`.
        versions_again: int64 ``[slots]`` read by the check launch instead of the table's
            versions: a stand-in for a writer that changed slots while the rows were read.
        fence: ``False`` leaves out the probe's ``fence.acq_rel.sys`` (bench only: a
            lookup without it may return a torn row).
        gather: ``False`` probes and checks but reads no row (zero rows; bench only).

    Returns and raises as :func:`hostcache_lookup`.
    """
    _check_reg(reg)
    keys = _check_ids(keys, reg, "keys")
    return _lookup_triton(reg, keys, dedup=dedup, sort=sort, versions_again=versions_again,
                          fence=fence, gather=gather, tiles=tiles,
                          out_dtype=_out_dtype(reg, out_dtype))


def _lookup_torch(reg: Any, keys: torch.Tensor, out_dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The seqlock probe in torch ops over the registered views (zero-copy on CUDA); a
    quantized table's stored rows (payload and parameters) copied out in the window, then
    decoded."""
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
    if g.row_format.quantized:
        values = quant.decode(values, g.row_format, out_dtype)
    values.masked_fill_(~hit[:, None], 0)
    return values, hit


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
    tiles: Tiles = DEFAULT_TILES,
    out_dtype: torch.dtype = torch.float32,
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
    pk = tiles.host_probe_block_k
    common = dict(WAYS=g.ways, BLOCK_K=pk, FENCE=fence and not interpret,
                  num_warps=tiles.host_warps)
    n = keys.numel()
    found = torch.empty(n, dtype=torch.int64, device=dev)
    if sort and 1 < n <= tiles.host_one_sort_max:
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
        out, hit = _read_found(k, reg, found, ver2, gather, tiles, out_dtype)
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
    out, hit = _read_found(k, reg, found, ver2, gather, tiles, out_dtype)
    if inverse is not None:
        return out.index_select(0, inverse), hit.index_select(0, inverse)
    return out, hit


def _read_found(k: ModuleType, reg: Any, found: torch.Tensor, ver2: torch.Tensor,
                gather: bool, tiles: Tiles, out_dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 2 and 3 of a lookup: the rows of the probed slots (a quantized table's
    dequantized in the gather, in ``out_dtype``), then the versions again; rows of keys
    whose version changed are zeroed (``gather=False``: no rows, zeros)."""
    g = reg.geometry
    interpret = reg.device.type != "cuda"
    n = found.numel()
    rows = reg.rows()
    out = (torch.empty if gather else torch.zeros)((n, g.dim), dtype=out_dtype,
                                                   device=found.device)
    hit = torch.empty(n, dtype=torch.bool, device=found.device)
    if n == 0:
        return out, hit
    if gather:
        bd = _block_d(g.dim)
        bk = tiles.host_block_k or _block_k(bd)
        cx = _codec(k, g.row_format)
        _launch(k, interpret, "gather_found_kernel", (_cdiv(n, bk),),
                (found, rows, out, n, rows.stride(0), g.dim),
                (bk, bd, bd == g.dim, tiles.host_warps, rows.dtype, out_dtype, cx["QUANT"],
                 cx["META"]),
                BLOCK_K=bk, BLOCK_D=bd, EVEN_D=bd == g.dim, num_warps=tiles.host_warps, **cx)
    _launch(k, interpret, "verify_kernel", (_cdiv(n, 1024),), (found, ver2, hit, n), (),
            BLOCK=1024)
    if gather:
        out.masked_fill_(~hit[:, None], 0)  # read while a writer was in the slot
    return out, hit
