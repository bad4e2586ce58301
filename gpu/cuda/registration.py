"""Registration of shared host tables with CUDA, and zero-copy tensor views of them.

This module and its bookkeeping, :mod:`gpu.cuda.pinning`, are the only ones of the project that
call CUDA's host-memory API (``cudaHostRegister``, ``cudaHostGetDevicePointer``,
``cudaHostUnregister``, ``cudaPointerGetAttributes``), through cuda-python
(:mod:`gpu.cuda.runtime`, which imports it only when a call is made): the module imports on a
machine without CUDA, cuda-python or triton. :mod:`gpu.cuda.pinning` owns the registrations
(steps 1-3 below, and when they are undone); this module hands out the views (step 4).

What :func:`register` does, for a :class:`hostcache.HostCache` or
:class:`hostcache.SharedMemBlock` (anything with ``.name``, ``.geometry`` and ``.buffer``):

1. checks that the process was not forked after CUDA was initialised (a forked child
   cannot use its parent's CUDA state; use the ``spawn`` start method), and that the
   device supports ``cudaHostRegister`` (``cudaDevAttrHostRegisterSupported``);
2. registers the whole mapped segment, page-aligned, in chunks of at most ``chunk_bytes``
   (one call must stay under 512 GiB), with ``cudaHostRegisterPortable |
   cudaHostRegisterMapped``; every return code is checked, and a failure part-way
   unregisters the chunks already registered before raising;
3. checks that the device addresses of the chunks are contiguous, so one device pointer
   plus a byte offset reaches any row (true under unified addressing, where the device
   pointer of registered memory is the host pointer);
4. hands out zero-copy CUDA tensor views (rows, keys, versions, counters, ring, header)
   built from ``__cuda_array_interface__`` holders. Each holder keeps the registration
   alive, so the memory stays registered (and mapped: the registration holds the table's
   buffer) while any view, or any tensor derived from one, lives.

Without CUDA (``device="cpu"``, or ``torch.cuda.is_available()`` is False) the same API
hands back CPU views of the same memory and makes no CUDA call.

Close order
-----------
views -> registration -> table. :meth:`HostRegistration.close` lets go of this handle;
``cudaHostUnregister`` runs exactly once, at the addresses registered, when the last view
made from the registration is gone (at once if none is alive). The registration holds a
reference to the table's buffer, so the mapping cannot be unmapped before it is
unregistered even if the table is closed first; closing in the documented order simply
releases everything at once.

Fork safety: a registration remembers the pid that made it. Used in another process (a
forked child) it raises :class:`ForkedProcessError` instead of touching CUDA; its cleanup
in the child is skipped (the child never registered anything).
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Literal

import torch

from gpu.cuda import pinning
from gpu.cuda import runtime as _cuda
from gpu.cuda.devices import resolve_device
from gpu.cuda.pinning import MAX_CHUNK_BYTES, PAGE, Pinned
from gpu.errors import (
    BadArgumentError,
    ForkedProcessError,
    GPUError,
    HostRegError,
    HostRegisterUnsupportedError,
    RegistrationClosedError,
    ViewNotAvailableError,
)
from hostcache.layout import KIND_HOST_CACHE
from nvecache.common import rows

__all__ = [
    "DEFAULT_CHUNK_BYTES", "MAX_CHUNK_BYTES", "PAGE", "ForkedProcessError", "HostRegError",
    "HostRegisterUnsupportedError", "HostRegistration", "RegistrationClosedError",
    "TensorRegistration", "ViewNotAvailableError", "pointer_is_registered", "register",
    "register_tensor",
]

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 256 << 30

ViewName = Literal["rows", "keys", "versions", "counters", "ring_seq", "ring_keys", "header"]


# -- zero-copy views ---------------------------------------------------------------------

#: the array interface's type of the layout's metadata words (keys, versions, counters, ring,
#: header) and of a quantized row's stored bytes; a plain row's element is typed by its
#: stored format (``nvecache.common.rows``)
_WORD_TYPESTR = {torch.int64: "<i8", torch.int32: "<i4", torch.uint8: "|u1"}


def _element(dtype: torch.dtype) -> tuple[str, int]:
    """``(typestr, bytes)`` of one element of a view: a metadata word's, or a row's (a
    bfloat16 row travels as its int16 bits, the interface speaking numpy types)."""
    word = _WORD_TYPESTR.get(dtype)
    if word is not None:
        return word, int(word[2:])
    element = rows.numpy_dtype(rows.dtype_name(dtype))
    return element.str, element.itemsize


class DeviceArray:
    """A ``__cuda_array_interface__`` holder of device-visible memory at ``ptr``; torch keeps
    it, and so ``owner`` (a registration, a pinned tensor), alive while a view lives."""

    def __init__(
        self, owner: object, ptr: int, shape: tuple[int, ...], strides: tuple[int, ...],
        typestr: str,
    ) -> None:
        self._owner = owner  # NOTE: what keeps the memory mapped while a view lives
        self.__cuda_array_interface__ = {
            "shape": shape,
            "strides": strides,
            "typestr": typestr,
            "data": (ptr, False),
            "version": 3,
        }


def _cuda_view(
    pinned: Pinned, offset: int, shape: tuple[int, ...], strides: tuple[int, ...],
    dtype: torch.dtype, device: torch.device,
) -> torch.Tensor:
    typestr, size = _element(dtype)
    ptr = pinned.device_address + offset
    byte_strides = tuple(s * size for s in strides)
    holder = DeviceArray(pinned, ptr, shape, byte_strides, typestr)
    view = torch.as_tensor(holder, device=device)
    if view.data_ptr() != ptr or view.device != device:
        raise HostRegError(
            f"table {pinned.name!r}: torch copied the registered memory instead of viewing "
            f"it (got {view.device} at {view.data_ptr():#x}, wanted {device} at "
            f"{ptr:#x}); report this together with your torch version"
        )
    return view if view.dtype == dtype else view.view(dtype)


class HostRegistration:
    """This process's CUDA registration of one shared table, and views of its memory.

    Made by :func:`register`. A context manager; see the module docstring for the close
    order. Views are torch tensors on :attr:`device` (CPU tensors when it is the CPU).
    """

    _pinned: Pinned | None = None  # class default: close() works after a failed __init__

    def __init__(self, table: Any, pinned: Pinned, device: torch.device) -> None:
        self.table = table
        self.name: str = table.name
        self.geometry = table.geometry
        self.device = device
        self._pinned = pinned
        self._pinned_ref = weakref.ref(pinned)
        self._pid = os.getpid()

    # -- state ------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._pinned is None

    @property
    def registered(self) -> bool:
        """Whether this process's CUDA registration of the segment is still in place.

        Stays True after :meth:`close` while views made from it are alive.
        """
        pinned = self._pinned_ref()
        return pinned is not None and pinned.alive and pinned.registered

    @property
    def is_host_cache(self) -> bool:
        return int(self.geometry.kind) == KIND_HOST_CACHE

    def _live(self) -> Pinned:
        if self._pinned is None:
            raise RegistrationClosedError(
                f"registration of table {self.name!r} is closed; call "
                "gpu.cuda.registration.register(table) again"
            )
        if os.getpid() != self._pid and self.device.type == "cuda":
            raise ForkedProcessError(
                f"registration of table {self.name!r} was made in process {self._pid} and "
                f"is used in process {os.getpid()} (a fork): CUDA registrations do not "
                "survive fork(). Use the 'spawn' start method and register the table in the "
                "new process."
            )
        return self._pinned

    @property
    def address(self) -> int:
        """Device address (host address on the CPU) of byte 0 of the segment."""
        return self._live().device_address

    @property
    def size(self) -> int:
        """Bytes registered (the whole mapped segment)."""
        return self._live().size

    @property
    def chunks(self) -> list[int]:
        """Host addresses at which the chunks were registered (empty on the CPU)."""
        return list(self._live().chunks)

    # -- views ------------------------------------------------------------------------

    def _view(
        self, offset: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        pinned = self._live()
        if self.device.type == "cpu":
            size = _element(dtype)[1]
            nbytes = (sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1) * size
            raw = pinned.buffer[offset : offset + nbytes]
            flat = raw.view(dtype)
            return flat.as_strided(shape, strides)
        return _cuda_view(pinned, offset, shape, strides, dtype, self.device)

    def rows(self) -> torch.Tensor:
        """``[slots, dim]`` rows in the table's dtype (row stride = the layout's, padded);
        of a quantized table, ``[slots, stored_bytes]`` uint8, each row's stored bytes (as
        its ``tensor`` on the CPU: :mod:`gpu.kernels.stored_rows` reads them)."""
        g = self.geometry
        fmt = g.row_format
        if fmt.quantized:
            return self._view(g.rows_off, (g.slots, fmt.stored_bytes), (g.row_stride, 1),
                              torch.uint8)
        return self._view(g.rows_off, (g.slots, g.dim), (fmt.stride // fmt.itemsize, 1), g.dtype)

    def _hc_only(self, what: str) -> None:
        if not self.is_host_cache:
            raise ViewNotAvailableError(
                f"table {self.name!r} is a linear table: it has no {what} (only host caches "
                "do); use rows()"
            )

    def keys(self) -> torch.Tensor:
        """int64 ``[slots]`` keys (``hostcache.layout.EMPTY_KEY`` marks a free slot)."""
        self._hc_only("keys")
        g = self.geometry
        return self._view(g.keys_off, (g.slots,), (1,), torch.int64)

    def versions(self) -> torch.Tensor:
        """int64 ``[slots]`` seqlock versions (even = stable, odd = being written)."""
        self._hc_only("versions")
        g = self.geometry
        return self._view(g.versions_off, (g.slots,), (1,), torch.int64)

    def counters(self) -> torch.Tensor:
        """int32 ``[slots]`` eviction-policy counters."""
        self._hc_only("policy counters")
        g = self.geometry
        return self._view(g.counters_off, (g.slots,), (1,), torch.int32)

    def ring_seq(self) -> torch.Tensor:
        """int64 ``[ring_capacity]`` sequence numbers of the invalidation ring."""
        g = self.geometry
        return self._view(g.ring_seq_off, (g.ring_capacity,), (1,), torch.int64)

    def ring_keys(self) -> torch.Tensor:
        """int64 ``[ring_capacity]`` keys (row indices for a linear table) of the ring."""
        g = self.geometry
        return self._view(g.ring_key_off, (g.ring_capacity,), (1,), torch.int64)

    def header(self) -> torch.Tensor:
        """int64 ``[512]`` header words (see ``hostcache.layout``)."""
        return self._view(0, (PAGE // 8,), (1,), torch.int64)

    def view(self, what: ViewName) -> torch.Tensor:
        """One of the views above by name."""
        methods = {
            "rows": self.rows, "keys": self.keys, "versions": self.versions,
            "counters": self.counters, "ring_seq": self.ring_seq,
            "ring_keys": self.ring_keys, "header": self.header,
        }
        if what not in methods:
            raise BadArgumentError(f"view must be one of {sorted(methods)}; got {what!r}")
        return methods[what]()

    # -- lifetime ---------------------------------------------------------------------

    def close(self) -> None:
        """Let go of this handle (idempotent).

        The CUDA registration is undone now if no view of it is alive, else when the last
        one is garbage collected. Close views first, then registrations, then the table.
        """
        pinned, self._pinned = self._pinned, None
        if pinned is None:
            return
        del pinned  # NOTE: the last reference held here; views keep their own

    def __enter__(self) -> HostRegistration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("registered" if self.registered else "cpu")
        return f"HostRegistration({self.name!r}, device={self.device}, {state})"


def _wants_cuda(device: object) -> bool:
    if device is None:
        return torch.cuda.is_available()
    try:
        return torch.device(device).type == "cuda"  # type: ignore[call-overload]
    except (RuntimeError, TypeError):
        return False


def register(
    table: Any, device: object = None, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> HostRegistration:
    """Register a shared table's whole segment with CUDA in this process.

    Args:
        table: a :class:`hostcache.HostCache` or :class:`hostcache.SharedMemBlock` (any
            object with ``.name``, ``.geometry`` and a uint8 CPU ``.buffer`` of the segment).
        device: ``None`` (the current CUDA device, or the CPU without CUDA), ``"cpu"``,
            ``"cuda"``, ``"cuda:N"``, an int or a ``torch.device``.
        chunk_bytes: bytes per ``cudaHostRegister`` call: a positive multiple of 4096 below
            512 GiB.

    Returns:
        A :class:`HostRegistration`; close it (or use ``with``) before closing the table.

    Raises:
        BadArgumentError: not a table, a closed table, a bad device or chunk size.
        CUDAUnavailableError: a CUDA device was asked for without CUDA or cuda-python.
        ForkedProcessError: this process was forked after CUDA was initialised.
        HostRegisterUnsupportedError: the device cannot map host memory.
        CUDACallError: a CUDA call failed (nothing stays registered).
    """
    buffer = _table_buffer(table)
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int):
        raise BadArgumentError(f"chunk_bytes must be an int; got {type(chunk_bytes).__name__}")
    if not 0 < chunk_bytes < MAX_CHUNK_BYTES or chunk_bytes % PAGE:
        raise BadArgumentError(
            f"chunk_bytes must be a positive multiple of {PAGE} below 512 GiB; got {chunk_bytes}"
        )
    if _wants_cuda(device):
        # NOTE: before anything that could initialise CUDA in a forked child
        pinning.refuse_if_forked(f"register table {table.name!r} with CUDA")
    dev = resolve_device(device)
    if dev.type == "cuda":
        if buffer.data_ptr() % PAGE or buffer.numel() % PAGE:
            raise BadArgumentError(
                f"table {table.name!r}: the segment mapping is not page aligned "
                f"({buffer.data_ptr():#x}, {buffer.numel()} bytes); map it with mmap"
            )
        torch.cuda.init()  # NOTE: torch and cuda-python then share the primary context
        pinning.note_cuda_use()
        pinning.check_device_support(int(dev.index or 0))
    pinned = pinning.shared_pinned(table.name, buffer, dev, chunk_bytes)
    logger.debug("table %s: registered %d bytes for %s", table.name, pinned.size, dev)
    return HostRegistration(table, pinned, dev)


def _table_buffer(table: Any) -> torch.Tensor:
    try:
        buffer = table.buffer
        table.name, table.geometry  # noqa: B018 - presence check
    except AttributeError as e:
        raise BadArgumentError(
            "register() takes a hostcache.HostCache or hostcache.SharedMemBlock (an object "
            f"with .name, .geometry and .buffer); got {type(table).__name__}"
        ) from e
    except GPUError:
        raise
    except Exception as e:  # e.g. hostcache.HandleClosedError from a closed table
        raise BadArgumentError(
            f"cannot register table {getattr(table, 'name', '?')!r}: {e}"
        ) from e
    if (
        not isinstance(buffer, torch.Tensor)
        or buffer.dtype != torch.uint8
        or buffer.device.type != "cpu"
        or buffer.dim() != 1
        or buffer.numel() < table.geometry.total_size
    ):
        raise BadArgumentError(
            f"table {table.name!r}: .buffer must be a 1-D uint8 CPU tensor covering the "
            "whole segment"
        )
    return buffer


def pointer_is_registered(address: int, device: object = None) -> bool:
    """Whether CUDA reports ``address`` as registered (pinned) host memory in this process.

    Uses ``cudaPointerGetAttributes``; for tests and diagnostics (no CUDA: always False).
    """
    dev = resolve_device(device)
    if dev.type != "cuda":
        return False
    return pinning.cuda_reports_registered(address)


class TensorRegistration:
    """This process's registration of a user's CPU tensor for ``device``: :meth:`rows` is a
    zero-copy view of the tensor's rows on the device (the tensor itself on the CPU).

    Private to the process. A pageable tensor is registered in place
    (``cudaHostRegister``, undone once the handle is closed and the last view is gone, as a
    :class:`HostRegistration`); a pinned one is page-locked already and only mapped
    (``cudaHostGetDevicePointer``). Made by :func:`register_tensor`.
    """

    def __init__(self, tensor: torch.Tensor, pinned: Pinned | None,
                 device: torch.device) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.device = device
        self._pinned = pinned

    @property
    def closed(self) -> bool:
        return self.tensor is None

    def rows(self) -> torch.Tensor:
        """The tensor's rows where ``device`` reads them, no copy."""
        t = self.tensor
        if t is None:
            raise RegistrationClosedError("registration of the storage tensor is closed; "
                                          "call gpu.cuda.registration.register_tensor again")
        if self._pinned is None:
            return t
        return _cuda_view(self._pinned, 0, tuple(t.shape), tuple(t.stride()), t.dtype,
                          self.device)

    def close(self) -> None:
        """Let go of this handle (idempotent); the registration goes with the last view."""
        self.tensor = self._pinned = None


def register_tensor(tensor: torch.Tensor, device: object = None, *,
                    name: str = "storage tensor") -> TensorRegistration:
    """Register a user's CPU tensor (pinned or pageable, contiguous) in place for ``device``.

    Raises:
        BadArgumentError: not a non-empty contiguous CPU tensor, or a bad device.
        CUDAUnavailableError, ForkedProcessError, HostRegisterUnsupportedError,
        CUDACallError: as :func:`register` (nothing stays registered).
    """
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        raise BadArgumentError(f"{name} must be a CPU tensor; got "
                               f"{getattr(tensor, 'device', type(tensor).__name__)}")
    if not tensor.is_contiguous() or tensor.numel() == 0:
        raise BadArgumentError(f"{name} must be a non-empty contiguous tensor (rows one after "
                               "another) to be read in place: pass tensor.contiguous() (a "
                               "copy) or a hostcache.SharedMemBlock")
    if _wants_cuda(device):
        pinning.refuse_if_forked(f"register {name} with CUDA")
    dev = resolve_device(device)
    if dev.type != "cuda":
        return TensorRegistration(tensor, None, dev)
    torch.cuda.init()
    pinning.note_cuda_use()
    pinning.check_device_support(int(dev.index or 0))
    buffer = tensor.detach().reshape(-1).view(torch.uint8)
    if tensor.is_pinned():
        # NOTE: page-locked by torch's allocator already (registering it again fails):
        # a record that registers nothing, at the device address CUDA maps it to
        pinned = Pinned(name, buffer, torch.device("cpu"), DEFAULT_CHUNK_BYTES)
        pinned.device_address = int(_cuda.call(
            "cudaHostGetDevicePointer", buffer.data_ptr(), 0, detail=name))
    else:
        pinned = pinning.shared_pinned(name, buffer, dev, DEFAULT_CHUNK_BYTES)
    return TensorRegistration(tensor, pinned, dev)
