"""``DistMemBlock``: a linear embedding table sharded over several GPUs' memory, one range.

The seed's second use case. Physical shards live in the memory of several GPUs; every
participating process maps all of them, side by side, into ONE contiguous virtual range,
so row ``i`` sits at ``base + i * row_bytes`` and a GPU reads any row with a plain load
(over NVLink when the row lives on another GPU). The LinearUVM layer takes the block as
``storage`` and never knows: its kernels see one pointer.

Layout
------
``row_bytes = dim * element size`` (a quantized block's rows, ``dtype=torch.int8`` or
``torch.float8_e4m3fn``: their stored bytes at ``row_format.stride``, :mod:`gpu.dist.rowio`);
the table's ``num_rows * row_bytes`` bytes are cut
into ``S`` equal shards (``S`` = the number of participating devices over all processes),
each rounded up to the allocation granularity (2 MiB on CUDA, a page on the CPU twin).
Shard ``k`` covers bytes ``[k * shard_bytes, (k + 1) * shard_bytes)`` of the range and
lives on the ``k``-th device in (rank, device) order. A row may straddle two shards; the
range is contiguous, so nothing cares.

Two ways to build one
---------------------
* one process, several GPUs (``group=None``, ``devices=[0, 1, ...]``): this process
  creates every shard and grants every listed device access to the whole range;
* one process per GPU (``group="torch"`` under torchrun, or an mpi4py communicator; see
  :mod:`gpu.dist.groups`): each rank creates the shards of its ``devices`` (default: its
  current GPU), exports them as POSIX file descriptors, and the descriptors travel over a
  Unix socket to every other rank, which imports and maps them. Collective: every rank
  calls the constructor with the same geometry.

Without CUDA (``devices="cpu"``) the CPU twin (:class:`gpu.dist.vmm.HostVMM`) runs the same
protocol with memfd shards: CI tests everything but the driver calls.

Writes and invalidation
-----------------------
:meth:`DistMemBlock.write` stores rows and announces their indices in a small shared
journal (a one-row :class:`hostcache.SharedMemBlock` whose invalidation ring every
layer over this block follows), so a layer in any process of the node drops its cached
copies before its next lookup: the same read-after-write guarantee as the host tables.
:meth:`DistMemBlock.accumulate` adds to rows and announces them the same way
(:mod:`gpu.dist.accumulate`). A write straight into :meth:`view` bypasses the journal:
call :meth:`invalidate` after it.
The journal's segment has a name only while the ranks attach it (:mod:`gpu.dist.journal`):
nothing of a block stays in ``/dev/shm`` once its constructor has returned.

Destruction order (the seed's rule)
-----------------------------------
Layers, then memblocks (the reverse of their creation order), then the process group.
:meth:`DistMemBlock.close` is collective (a barrier first, so no rank still reads a shard
another rank is about to release) and raises :class:`DestructionOrderError`, changing
nothing, when a layer still uses the block, when a block created after it in this
process is still open, or when the group was torn down first. Views outlive ``close()``
safely: the range is unmapped when the last view is gone. Dropping the last reference
without ``close()`` releases this process's mappings without a barrier (the seed's
``comm.Barrier(); del memblock`` pattern).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import weakref
from typing import Any

import torch

from gpu.cuda.devices import resolve_device
from gpu.dist.accumulate import Accumulating
from gpu.dist.groups import as_group, exchange_fds
from gpu.dist.rowio import RowIO, block_format
from gpu.dist.journal import check_journal_name, new_name, open_journal
from gpu.dist.vmm import CudaVMM, HostVMM, backend
from gpu.errors import BadArgumentError, DestructionOrderError, GPUError, GroupError, VMMError
from hostcache.gate import TableGate, gate_for

logger = logging.getLogger(__name__)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _resolve_devices(devices: Any, solo: bool) -> list[torch.device]:
    """``devices`` -> a non-empty list of distinct devices of one type."""
    if devices is None:
        if not torch.cuda.is_available():
            return [torch.device("cpu")]
        if solo:
            return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        return [torch.device("cuda", torch.cuda.current_device())]
    items = list(devices) if isinstance(devices, (list, tuple)) else [devices]
    if not items:
        raise BadArgumentError("devices must name at least one device")
    out = [resolve_device(d) for d in items]
    kinds = {d.type for d in out}
    if len(kinds) != 1:
        raise BadArgumentError(f"devices must all be CUDA devices or all 'cpu'; got {out}")
    if out[0].type == "cuda" and len(set(out)) != len(out):
        raise BadArgumentError(f"devices lists a GPU twice: {out}")
    return out


def _device_id(device: torch.device) -> str:
    """A name of the device that every process agrees on (its UUID)."""
    if device.type != "cuda":
        return "cpu"
    return str(torch.cuda.get_device_properties(device).uuid)


class _Range:
    """This process's mappings of one block; released once, when nothing uses them."""

    def __init__(self, vmm: CudaVMM | HostVMM) -> None:
        self.base = 0
        self.mapped: list[tuple[int, int]] = []  # (address, size) of each mapped shard
        self.handles: list[int] = []
        self.reserved: list[tuple[int, int]] = []
        self._finalizer = weakref.finalize(self, _release, vmm, os.getpid(), self.mapped,
                                           self.handles, self.reserved)

    def release(self) -> None:
        self._finalizer()


def _release(vmm: CudaVMM | HostVMM, pid: int, mapped: list[tuple[int, int]],
             handles: list[int], reserved: list[tuple[int, int]]) -> None:
    if os.getpid() != pid:
        return  # a forked child never mapped anything
    def attempt(what: str, fn: Any, *args: int) -> None:
        try:
            fn(*args)
        except (VMMError, OSError) as e:
            logger.error("distmem: %s failed: %s", what, e)

    for address, size in reversed(mapped):
        attempt("unmap", vmm.unmap, address, size)
    for handle in reversed(handles):
        attempt("release", vmm.release, handle)
    for address, size in reserved:
        attempt("free", vmm.free, address, size)
    mapped.clear()
    handles.clear()
    reserved.clear()


class _Holder:
    """``__cuda_array_interface__`` of a range; torch keeps it (and the range) alive."""

    def __init__(self, rng: _Range, shape: tuple[int, ...], strides: tuple[int, ...],
                 typestr: str) -> None:
        self._range = rng
        self.__cuda_array_interface__ = {"shape": shape, "strides": strides,
                                         "typestr": typestr, "data": (rng.base, False),
                                         "version": 3}


# blocks of groups, in creation order, per process: close() must go in reverse
_OPEN: list[weakref.ref[DistMemBlock]] = []
_OPEN_LOCK = threading.Lock()


class DistMemBlock(RowIO, Accumulating):
    """A linear table sharded over several GPUs' memory, mapped as one range (see module).

    Args:
        num_rows, dim, dtype: the table's geometry (``dtype``: a layer dtype of
            ``nvecache.common.rows.LAYER_DTYPES``, or a quantized format, ``torch.int8``
            or ``torch.float8_e4m3fn``: :mod:`gpu.dist.rowio`). Every rank of a group
            passes the same: a rank with another dtype, a quantized format included, is
            a ``BadArgumentError`` on every rank.
        devices: the GPUs whose memory holds this process's shards (``int``, ``"cuda:N"``,
            ``torch.device`` or a list); ``"cpu"`` for the CPU twin. Default: every
            visible GPU for one process, the current GPU for a group, the CPU without CUDA.
        group: ``None`` (one process), ``"torch"`` / a torch.distributed process group,
            or an mpi4py communicator. Collective when a group is given.
        name: the name of the block's journal segment while the ranks attach it (it is
            unlinked before the constructor returns; default: generated by rank 0,
            ``distmem-<pid namespace>-<pid>-<random>``); a table name.
        timeout: seconds to wait for the other ranks during the exchange.

    Raises:
        BadArgumentError: bad geometry or devices, or ranks that disagree on them.
        VMMError / PeerAccessError: the driver refused (memory full, no peer access).
        GroupError: the ranks could not reach each other.
    """

    def __init__(self, num_rows: int, dim: int, dtype: torch.dtype = torch.float32, *,
                 devices: Any = None, group: Any = None, name: str | None = None,
                 timeout: float = 60.0) -> None:
        self._closed = True  # until built: close()/__del__ after a failed __init__ are no-ops
        self._users: weakref.WeakSet[Any] = weakref.WeakSet()
        if not isinstance(num_rows, int) or isinstance(num_rows, bool) or num_rows <= 0:
            raise BadArgumentError(f"num_rows must be a positive int; got {num_rows!r}")
        if not isinstance(dim, int) or isinstance(dim, bool) or dim <= 0:
            raise BadArgumentError(f"dim must be a positive int; got {dim!r}")
        fmt = block_format(dtype, dim)
        if name is not None:
            check_journal_name(name)
        g = as_group(group)
        devs = _resolve_devices(devices, solo=g.size == 1)
        kind = devs[0].type
        self.num_rows, self.dim, self.dtype = num_rows, dim, fmt.torch_dtype
        self._format = fmt  # NOTE: row_format and quantized (gpu.dist.rowio)
        #: bytes from one row to the next: a plain row's, a quantized row's stride
        self.row_bytes = fmt.stride if fmt.quantized else fmt.row_bytes
        self.devices = devs
        self.group = g
        self.rank, self.world_size = g.rank, g.size
        vmm = backend(kind)
        mine = {"geometry": [num_rows, dim, fmt.dtype, kind], "shards": len(devs),
                "granularity": max(vmm.granularity(d.index or 0) for d in devs),
                "name": name, "pid": os.getpid()}
        for d in devs:
            vmm.check_device(d.index or 0)
        everyone = g.allgather(mine)
        geos = {tuple(m["geometry"]) for m in everyone}
        if len(geos) != 1:
            raise BadArgumentError(f"the ranks of the group disagree on the block's geometry "
                                   f"(num_rows, dim, dtype, device kind): {sorted(geos)}")
        names = {m["name"] for m in everyone}
        if len(names) != 1:
            raise BadArgumentError(f"the ranks of the group disagree on the name: {names}")
        counts = [int(m["shards"]) for m in everyone]
        self.num_shards = sum(counts)
        self.granularity = max(int(m["granularity"]) for m in everyone)
        total = num_rows * self.row_bytes
        self.shard_bytes = _round_up(-(-total // self.num_shards), self.granularity)
        self.size = self.shard_bytes * self.num_shards
        self.name = g.bcast(name or new_name())
        rng = _Range(vmm)
        try:
            self._build(vmm, rng, devs, timeout)
            error = None
        except (GPUError, OSError) as e:
            rng.release()
            error = e
        errors = g.allgather(None if error is None else f"rank {g.rank}: {error}")
        if error is not None:
            raise error
        bad = [e for e in errors if e is not None]
        if bad:
            rng.release()
            raise GroupError("building the block failed on another rank: " + "; ".join(bad))
        self._range = rng
        self._vmm = vmm
        self.base = rng.base
        try:
            self._journal = open_journal(g, self.name)
        except BaseException:
            rng.release()
            raise
        self._closed = False
        if g.size > 1:
            with _OPEN_LOCK:
                _OPEN.append(weakref.ref(self))
        logger.debug("distmem %s: %d shards of %d bytes at %#x", self.name, self.num_shards,
                     self.shard_bytes, self.base)

    def _build(self, vmm: CudaVMM | HostVMM, rng: _Range, devs: list[torch.device],
               timeout: float) -> None:
        local: list[int] = []
        for d in devs:
            h = vmm.create(self.shard_bytes, d.index or 0)
            rng.handles.append(h)
            local.append(h)
        exported = [vmm.export(h) for h in local] if self.world_size > 1 else []
        meta = {"owners": [_device_id(d) for d in devs]}
        try:
            everyone = exchange_fds(self.group, meta, exported, timeout=timeout)
        finally:
            for fd in exported:
                os.close(fd)
        # (rank, handle, owner device id) for every shard in order
        shards: list[tuple[int, int, str]] = []
        for r, (m, fds) in enumerate(everyone):
            if r == self.rank:
                shards += [(r, h, b) for h, b in zip(local, meta["owners"], strict=True)]
                continue
            try:
                for fd, b in zip(fds, m["owners"], strict=True):
                    h = vmm.import_(fd)
                    rng.handles.append(h)
                    shards.append((r, h, b))
            finally:
                for fd in fds:
                    os.close(fd)
        self._check_peers(vmm, devs, [b for _, _, b in shards])
        rng.base = vmm.reserve(self.size, self.granularity)
        rng.reserved.append((rng.base, self.size))
        for k, (_r, h, _b) in enumerate(shards):
            addr = rng.base + k * self.shard_bytes
            vmm.map(addr, self.shard_bytes, h)
            rng.mapped.append((addr, self.shard_bytes))
        vmm.set_access(rng.base, self.size, [d.index or 0 for d in devs])
        self.shard_ranks = [r for r, _, _ in shards]

    def _check_peers(self, vmm: CudaVMM | HostVMM, devs: list[torch.device],
                     owners: list[str]) -> None:
        if devs[0].type != "cuda":
            return
        visible = {_device_id(torch.device("cuda", i)): i
                   for i in range(torch.cuda.device_count())}
        for d in devs:
            for b in set(owners):
                if b in visible:
                    vmm.check_peer(d.index or 0, visible[b])

    # -- views and rows -------------------------------------------------------------------

    def _live(self) -> _Range:
        if self._closed:
            raise GPUError(f"DistMemBlock {self.name!r} is closed")
        return self._range

    def view(self, device: Any = None) -> torch.Tensor:
        """The whole table ``[num_rows, dim]`` as a zero-copy tensor on ``device`` (one of
        :attr:`devices`; default the first); a quantized block's, uint8 ``[num_rows,
        row_format.stride]``: each row's stored bytes and its padding. The range stays
        mapped while it lives."""
        rng = self._live()
        dev = self.devices[0] if device is None else resolve_device(device)
        if dev not in self.devices and not (dev.type == "cpu" == self.devices[0].type):
            raise BadArgumentError(
                f"DistMemBlock {self.name!r} is mapped for {self.devices} in this process; "
                f"{dev} cannot read it. Create the block with devices including {dev}")
        q = self.quantized
        shape = (self.num_rows, self.row_bytes if q else self.dim)
        dtype = torch.uint8 if q else self.dtype
        if dev.type == "cpu":
            raw = (ctypes.c_byte * (self.num_rows * self.row_bytes)).from_address(rng.base)
            raw._range = rng  # type: ignore[attr-defined]  # NOTE: keeps the mapping alive
            return torch.frombuffer(raw, dtype=dtype).view(shape)
        # NOTE: the interface speaks numpy dtypes (bfloat16 travels as its int16 bits)
        size, typestr = (1, "|u1") if q else (self._format.itemsize,
                                              self._format.numpy_dtype.str)
        holder = _Holder(rng, shape, (self.row_bytes, size), typestr)
        with torch.cuda.device(dev):
            t = torch.as_tensor(holder, device=dev)
        if t.data_ptr() != rng.base:
            raise GPUError("torch copied the block instead of viewing it; report this with "
                           "your torch version")
        return t if t.dtype == dtype else t.view(dtype)

    @property
    def tensor(self) -> torch.Tensor:
        """:meth:`view` on the first device."""
        return self.view()

    @property
    def gate(self) -> TableGate:
        """This process's read/write gate of the block: lookups hold its read side,
        :meth:`write` its write side (no lookup of this process returns a torn row)."""
        return gate_for(("distmem", self.name))

    def invalidate(self, indices: torch.Tensor) -> None:
        """Announce rows changed by other means (e.g. written through :meth:`view`)."""
        self._live()
        self._journal.announce(self._rows(indices).cpu())

    def changes_since(self, cursor: int) -> tuple[torch.Tensor, int, bool]:
        """Rows announced after ``cursor`` (see :meth:`hostcache.SharedMemBlock.changes_since`)."""
        self._live()
        return self._journal.changes_since(cursor)

    @property
    def change_cursor(self) -> int:
        """The journal's position now: pass it to ``changes_since`` later."""
        self._live()
        return self._journal.change_cursor

    def shard_of(self, indices: torch.Tensor) -> torch.Tensor:
        """The shard holding the first byte of each row (int64 [N])."""
        return torch.as_tensor(indices, dtype=torch.int64) * self.row_bytes // self.shard_bytes

    # -- users and destruction ------------------------------------------------------------

    def add_user(self, user: Any) -> None:
        """Record a layer reading this block (close() refuses while it lives)."""
        self._live()
        self._users.add(user)

    def remove_user(self, user: Any) -> None:
        """Forget a layer recorded by ``add_user`` (it no longer reads this block)."""
        self._users.discard(user)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` (or ``release_local()``) has released this block here."""
        return self._closed

    def close(self) -> None:
        """Collective release (see the module docstring). Idempotent.

        Raises:
            DestructionOrderError: a layer still uses the block, a block created after
                this one is still open, or the group is gone; nothing was released.
        """
        if self._closed:
            return
        users = list(self._users)
        if users:
            raise DestructionOrderError(
                f"DistMemBlock {self.name!r} is still used by {len(users)} layer(s); close "
                "or delete the layers first (layers, then memblocks, then the process group)")
        if self.world_size > 1:
            with _OPEN_LOCK:
                later = [b for b in (r() for r in _OPEN) if b is not None and not b._closed]
                later = later[later.index(self) + 1:] if self in later else []
            if later:
                raise DestructionOrderError(
                    f"DistMemBlock {self.name!r} must be closed after the blocks created "
                    f"after it: close {[b.name for b in reversed(later)]} first")
            if not self.group.alive():
                raise DestructionOrderError(
                    f"the process group of DistMemBlock {self.name!r} was torn down first; "
                    "close memblocks before destroying the group (release_local() "
                    "releases this process's mappings only)")
        self._release(collective=True)

    def _release(self, collective: bool) -> None:
        self._closed = True
        for d in self.devices:
            if d.type == "cuda":
                torch.cuda.synchronize(d)  # our own reads of the shards are done
        if collective and self.world_size > 1:
            self.group.barrier()  # and everyone else's
        with _OPEN_LOCK:
            _OPEN[:] = [r for r in _OPEN if r() is not None and r() is not self]
        journal, self._journal = self._journal, None  # type: ignore[assignment]
        if journal is not None:
            journal.close()  # its name was unlinked when the block was built
        rng, self._range = self._range, None  # type: ignore[assignment]
        del rng  # unmapped now, or when the last view goes

    def release_local(self) -> None:
        """Release this process's mappings without a barrier (no order check)."""
        if not self._closed:
            self._release(collective=False)

    def __del__(self) -> None:
        try:
            if not getattr(self, "_closed", True):
                self._release(collective=False)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __enter__(self) -> DistMemBlock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> Any:
        raise BadArgumentError("a DistMemBlock cannot be pickled: every process builds it "
                               "collectively (same arguments, group= its process group)")

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.num_shards} shards at {self.base:#x}"
        return (f"DistMemBlock({self.name!r}, rows={self.num_rows}, dim={self.dim}, "
                f"{self.dtype}, rank {self.rank}/{self.world_size}, {state})")
