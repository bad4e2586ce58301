"""Virtual memory management: physical shards mapped into one contiguous address range.

Two backends with one interface, used by :mod:`gpu.dist.distmem`:

* :class:`CudaVMM` (CUDA devices): CUDA's virtual memory management through cuda-python's
  driver API (``cuda.bindings.driver``). A shard is ``cuMemCreate`` d on one GPU with the
  POSIX-file-descriptor handle type, so it can be exported (``cuMemExportToShareableHandle``)
  and imported in another process (``cuMemImportFromShareableHandle``); every shard,
  local or imported, is ``cuMemMap`` ped into one range from ``cuMemAddressReserve`` and
  ``cuMemSetAccess`` grants the participating devices read/write access to the range.
  Any of those GPUs then reads row ``i`` at ``base + i * row_bytes``, wherever it lives.
* :class:`HostVMM` (the CPU twin, no CUDA call): a shard is a ``memfd`` (a file
  descriptor, exported as itself), the range is an ``mmap(PROT_NONE)`` reservation and
  each shard is mapped over its part with ``MAP_SHARED | MAP_FIXED``. Same protocol, same
  file-descriptor exchange, same layout: CI exercises everything but the driver calls.

Handles are ints in both backends. Every call's return code is checked; a failure raises
:class:`VMMError` naming the call (:mod:`gpu.errors`; :class:`PeerAccessError` where two
devices cannot reach each other). NVLink multicast (``cuMulticast*``) is never used.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from functools import cache
from types import ModuleType
from typing import Any

import torch

from gpu.errors import CUDAUnavailableError, PeerAccessError, VMMError

# -- CUDA ---------------------------------------------------------------------------------


@cache
def _driver() -> ModuleType:
    try:  # NOTE: lazy: cuda-python is an optional dependency, needed only on CUDA machines
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # cuda-python < 12.6
        except ImportError as e:
            raise CUDAUnavailableError(
                "a DistMemBlock on CUDA devices needs cuda-python: `pip install "
                "'cuda-python>=12.6'` (match your driver's CUDA major version), or use "
                "device='cpu'"
            ) from e
    return driver


def _check(name: str, ret: Any, detail: str = "") -> Any:
    """Unpack cuda-python's ``(CUresult, *results)``; raise on any error."""
    if not isinstance(ret, tuple):
        ret = (ret,)
    code = ret[0]
    if int(code) != 0:
        drv = _driver()
        err, text = drv.cuGetErrorName(code)
        what = text.decode() if int(err) == 0 and isinstance(text, bytes) else str(code)
        msg = f"{name} failed with {what} ({int(code)})"
        raise VMMError(f"{msg}: {detail}" if detail else msg)
    rest = ret[1:]
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


class CudaVMM:
    """CUDA's virtual memory management (driver API) for shards in GPU memory."""

    kind = "cuda"

    def __init__(self) -> None:
        drv = _driver()
        torch.cuda.init()  # the primary contexts the runtime (and torch) use
        _check("cuInit", drv.cuInit(0))
        self._drv = drv
        self._fd_type = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR

    def _prop(self, device: int) -> Any:
        drv = self._drv
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        prop.requestedHandleTypes = self._fd_type
        return prop

    def check_device(self, device: int) -> None:
        drv = self._drv
        dev = _check("cuDeviceGet", drv.cuDeviceGet(device))
        attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        if not _check("cuDeviceGetAttribute", drv.cuDeviceGetAttribute(attr, dev)):
            raise VMMError(f"cuda:{device} does not support CUDA virtual memory management")
        attrs = drv.CUdevice_attribute
        attr = attrs.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
        if not _check("cuDeviceGetAttribute", drv.cuDeviceGetAttribute(attr, dev)):
            raise VMMError(f"cuda:{device} cannot export memory as POSIX file descriptors")

    def check_peer(self, device: int, owner: int) -> None:
        """Raise unless ``device`` can read memory that lives on ``owner``."""
        if device == owner:
            return
        drv = self._drv
        a = _check("cuDeviceGet", drv.cuDeviceGet(device))
        b = _check("cuDeviceGet", drv.cuDeviceGet(owner))
        if not _check("cuDeviceCanAccessPeer", drv.cuDeviceCanAccessPeer(a, b)):
            raise PeerAccessError(
                f"cuda:{device} cannot access the memory of cuda:{owner} (no peer access; "
                "are the GPUs linked by NVLink or one PCIe switch?); shard over GPUs that "
                "can reach each other"
            )

    def granularity(self, device: int) -> int:
        drv = self._drv
        flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        return int(_check("cuMemGetAllocationGranularity",
                          drv.cuMemGetAllocationGranularity(self._prop(device), flag)))

    def create(self, size: int, device: int) -> int:
        with torch.cuda.device(device):  # its primary context current; restored after
            torch.cuda.current_stream(device)
            handle = _check("cuMemCreate", self._drv.cuMemCreate(size, self._prop(device), 0),
                            f"{size} bytes on cuda:{device}; is the GPU's memory full?")
        return int(handle)

    def export(self, handle: int) -> int:
        fd = _check("cuMemExportToShareableHandle",
                    self._drv.cuMemExportToShareableHandle(handle, self._fd_type, 0))
        return int(fd)

    def import_(self, fd: int) -> int:
        return int(_check("cuMemImportFromShareableHandle",
                          self._drv.cuMemImportFromShareableHandle(fd, self._fd_type)))

    def reserve(self, size: int, alignment: int) -> int:
        return int(_check("cuMemAddressReserve",
                          self._drv.cuMemAddressReserve(size, alignment, 0, 0)))

    def map(self, address: int, size: int, handle: int) -> None:
        _check("cuMemMap", self._drv.cuMemMap(address, size, 0, handle, 0))

    def set_access(self, address: int, size: int, devices: list[int]) -> None:
        drv = self._drv
        descs = []
        for d in devices:
            desc = drv.CUmemAccessDesc()
            desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = d
            desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            descs.append(desc)
        _check("cuMemSetAccess", drv.cuMemSetAccess(address, size, descs, len(descs)),
               f"devices {devices}")

    def unmap(self, address: int, size: int) -> None:
        _check("cuMemUnmap", self._drv.cuMemUnmap(address, size))

    def release(self, handle: int) -> None:
        _check("cuMemRelease", self._drv.cuMemRelease(handle))

    def free(self, address: int, size: int) -> None:
        _check("cuMemAddressFree", self._drv.cuMemAddressFree(address, size))


# -- the CPU twin -------------------------------------------------------------------------

_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
_MAP_SHARED, _MAP_PRIVATE = mmap.MAP_SHARED, mmap.MAP_PRIVATE
_MAP_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", 0x20)
_MAP_FIXED = 0x10  # Linux
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_MAP_FAILED = ctypes.c_void_p(-1).value


@cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _os_error(call: str) -> VMMError:
    err = ctypes.get_errno()
    return VMMError(f"{call} failed: {os.strerror(err)} (errno {err})")


class HostVMM:
    """The CPU twin: memfd shards mapped side by side into one reserved range."""

    kind = "cpu"

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}  # handle -> fd (the handle is the fd itself)

    def check_device(self, device: int) -> None:
        return None

    def check_peer(self, device: int, owner: int) -> None:
        return None

    def granularity(self, device: int) -> int:
        return mmap.PAGESIZE

    def create(self, size: int, device: int) -> int:
        fd = os.memfd_create("nvec-distmem", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
        except OSError as e:
            os.close(fd)
            raise VMMError(f"ftruncate of a {size}-byte shard failed: {e}") from e
        return fd

    def export(self, handle: int) -> int:
        return os.dup(handle)

    def import_(self, fd: int) -> int:
        return os.dup(fd)

    def reserve(self, size: int, alignment: int) -> int:
        addr = _libc().mmap(None, size, _PROT_NONE,
                            _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if addr is None or addr == _MAP_FAILED:
            raise _os_error("mmap (reserve)")
        return int(addr)

    def map(self, address: int, size: int, handle: int) -> None:
        addr = _libc().mmap(address, size, _PROT_RW, _MAP_SHARED | _MAP_FIXED, handle, 0)
        if addr is None or addr == _MAP_FAILED or int(addr) != address:
            raise _os_error("mmap (map a shard)")

    def set_access(self, address: int, size: int, devices: list[int]) -> None:
        return None  # mapped read/write already

    def unmap(self, address: int, size: int) -> None:
        # NOTE: put the reservation back rather than leaving a hole another mmap could take.
        addr = _libc().mmap(address, size, _PROT_NONE,
                            _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED, -1, 0)
        if addr is None or addr == _MAP_FAILED:
            raise _os_error("mmap (unmap a shard)")

    def release(self, handle: int) -> None:
        os.close(handle)

    def free(self, address: int, size: int) -> None:
        if _libc().munmap(address, size) != 0:
            raise _os_error("munmap")


def backend(kind: str) -> CudaVMM | HostVMM:
    """The backend for ``"cuda"`` or ``"cpu"``."""
    return CudaVMM() if kind == "cuda" else HostVMM()


__all__ = ["CudaVMM", "HostVMM", "PeerAccessError", "VMMError", "backend"]
