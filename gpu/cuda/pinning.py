"""Registration bookkeeping: this process's CUDA registrations of mapped segments.

The part of :mod:`gpu.cuda.registration` that owns CUDA state (the views live there):

* fork detection: the pid that first called CUDA through this package; a child forked
  after that (or after torch initialised CUDA) is refused before it touches CUDA;
* :func:`register_chunks` / :func:`unregister_chunks`: ``cudaHostRegister(portable |
  mapped)`` of a mapping in chunks, every return code checked, undone on a failure
  part-way; the chunks' device addresses must be contiguous;
* :class:`Pinned`: one registration of one mapping, shared by every handle and view of
  it in this process (:func:`shared_pinned`), unregistered exactly once when the last of
  them is gone. It holds the table's buffer, so the mapping outlives the registration
  (also one CUDA refused to undo at once: it is retried on the next registration).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import weakref
from typing import Any

import torch

from gpu.cuda import runtime as _cuda
from gpu.errors import ForkedProcessError, GPUError, HostRegError, HostRegisterUnsupportedError

logger = logging.getLogger(__name__)

PAGE = 4096
#: one cudaHostRegister call must stay under 512 GiB
MAX_CHUNK_BYTES = 512 << 30

# -- fork detection ----------------------------------------------------------------------

_STATE_LOCK = threading.Lock()
_CUDA_PID: int | None = None  # pid of the process where this package first called CUDA
_FORKED_AFTER_CUDA = False


def _after_fork_in_child() -> None:
    global _FORKED_AFTER_CUDA
    if _CUDA_PID is not None:
        _FORKED_AFTER_CUDA = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def refuse_if_forked(what: str) -> None:
    """Raise :class:`ForkedProcessError` in a child forked after CUDA was initialised."""
    bad_fork = getattr(torch.cuda, "_is_in_bad_fork", None)
    if _FORKED_AFTER_CUDA or (bad_fork is not None and bad_fork()):
        raise ForkedProcessError(
            f"cannot {what}: this process was forked after CUDA was initialised in its "
            "parent, and CUDA cannot be used in such a child. Start worker processes with "
            "multiprocessing's 'spawn' (or 'forkserver') start method, attach the table "
            "there and register it again."
        )


def note_cuda_use() -> None:
    """Remember that this process called CUDA (its forked children are refused)."""
    global _CUDA_PID
    with _STATE_LOCK:
        if _CUDA_PID is None:
            _CUDA_PID = os.getpid()


# -- the CUDA side -----------------------------------------------------------------------


def _flags() -> int:
    rt = _cuda.runtime()
    return int(rt.cudaHostRegisterPortable) | int(rt.cudaHostRegisterMapped)


def check_device_support(index: int) -> None:
    """Raise unless ``cuda:index`` can map registered host memory."""
    rt = _cuda.runtime()
    attr = rt.cudaDeviceAttr.cudaDevAttrHostRegisterSupported
    supported = _cuda.call("cudaDeviceGetAttribute", attr, index)
    if not supported:
        raise HostRegisterUnsupportedError(
            f"cuda:{index} does not support cudaHostRegister (cudaDevAttrHostRegisterSupported"
            " = 0); use device='cpu' or a GPU that can map host memory"
        )


def register_chunks(base: int, size: int, chunk_bytes: int, name: str) -> tuple[list[int], int]:
    """Register ``[base, base + size)``; returns (chunk bases, device pointer of base)."""
    flags = _flags()
    done: list[int] = []
    dev_base = 0
    try:
        for off in range(0, size, chunk_bytes):
            n = min(chunk_bytes, size - off)
            addr = base + off
            _cuda.call(
                "cudaHostRegister", addr, n, flags,
                detail=f"table {name!r}, bytes [{off}, {off + n}) of {size}; is the table "
                "already registered in this process by other code?",
            )
            done.append(addr)
            dptr = int(_cuda.call("cudaHostGetDevicePointer", addr, 0, detail=f"table {name!r}"))
            if off == 0:
                dev_base = dptr
            elif dptr != dev_base + off:
                raise HostRegError(
                    f"table {name!r}: CUDA mapped the registered chunks at non-contiguous "
                    f"device addresses ({dptr:#x} != {dev_base + off:#x}); register with one "
                    "chunk (chunk_bytes >= the segment size) on this system"
                )
    except BaseException:
        unregister_chunks(done, name, raise_errors=False)
        raise
    return done, dev_base


def unregister_chunks(chunks: list[int], name: str, *, raise_errors: bool) -> None:
    """``cudaHostUnregister`` every chunk (last first); ``chunks`` keeps those CUDA refused."""
    first: BaseException | None = None
    refused = []
    for addr in reversed(chunks):
        try:
            _cuda.call("cudaHostUnregister", addr, detail=f"table {name!r}")
        except GPUError as e:
            logger.warning("table %s: unregistering %#x failed: %s", name, addr, e)
            first = first or e
            refused.append(addr)
    chunks[:] = refused[::-1]
    if first is not None and raise_errors:
        raise first


#: finalised registrations CUDA refused to undo (a CUDA graph being captured in global mode
#: refuses cudaHostUnregister on every thread, and a garbage collection can drop the last
#: handle meanwhile): their mappings are kept, never unmapped while registered (a later
#: mapping at the same address could not be registered), and retried on the next register
_UNFINISHED: list[dict[str, Any]] = []


def retry_unfinished() -> None:
    """Undo the registrations CUDA refused to undo before; let their mappings go."""
    if not _UNFINISHED or torch.cuda.is_current_stream_capturing():
        return
    for state in list(_UNFINISHED):
        unregister_chunks(state["chunks"], state["name"], raise_errors=False)
        if not state["chunks"]:
            state["buffer"] = None  # now the mapping may go
            with contextlib.suppress(ValueError):
                _UNFINISHED.remove(state)


def _finalize_pinned(state: dict[str, Any]) -> None:
    """Unregister (once) and let go of the buffer; runs when the last reference is gone.

    A registration CUDA refuses to undo now keeps its buffer (the mapping stays) and waits
    in :data:`_UNFINISHED` for the next :func:`shared_pinned`."""
    chunks: list[int] = state["chunks"]
    if chunks and os.getpid() == state["pid"]:
        # NOTE: a graph capture on this thread: the call would fail and invalidate it
        if not torch.cuda.is_current_stream_capturing():
            unregister_chunks(chunks, state["name"], raise_errors=False)
        if chunks:
            _UNFINISHED.append(state)
            return
        logger.debug("table %s: unregistered from CUDA", state["name"])
    chunks.clear()
    state["buffer"] = None  # now the mapping may go


class Pinned:
    """One registration of one mapped segment in this process (shared by handles/views).

    NOTE: the finaliser's state holds the table's buffer, so the mapping outlives the
    registration; unregistration runs exactly once (weakref.finalize guarantees it).
    """

    def __init__(
        self, name: str, buffer: torch.Tensor, device: torch.device, chunk_bytes: int
    ) -> None:
        self.name = name
        self.device = device
        self.host_address = int(buffer.data_ptr())
        self.size = int(buffer.numel())
        self.pid = os.getpid()
        self.chunks: list[int] = []
        self.device_address = self.host_address
        if device.type == "cuda":
            self.chunks, self.device_address = register_chunks(
                self.host_address, self.size, chunk_bytes, name
            )
        self._state: dict[str, Any] = {
            "chunks": self.chunks, "pid": self.pid, "name": name, "buffer": buffer,
        }
        self._finalizer = weakref.finalize(self, _finalize_pinned, self._state)

    @property
    def buffer(self) -> torch.Tensor:
        buf = self._state["buffer"]
        assert isinstance(buf, torch.Tensor)
        return buf

    @property
    def alive(self) -> bool:
        """Whether the registration was not finalised yet."""
        return self._finalizer.alive

    @property
    def registered(self) -> bool:
        return bool(self.chunks)


# NOTE: one registration per mapped address per process: CUDA refuses to register a range
# twice, so a second register() of the same mapping shares the first one's registration,
# also for another GPU (a portable registration serves every device of the process, at
# the same device address under unified addressing).
_LIVE: dict[tuple[int, int, str], weakref.ref[Pinned]] = {}


def shared_pinned(name: str, buffer: torch.Tensor, device: torch.device, chunk: int) -> Pinned:
    """The live registration of ``buffer``'s mapping in this process, or a new one."""
    key = (int(buffer.data_ptr()), int(buffer.numel()), device.type)
    if device.type == "cuda":
        retry_unfinished()
    with _STATE_LOCK:
        ref = _LIVE.get(key)
        pinned = ref() if ref is not None else None
        if pinned is not None and pinned.alive:
            return pinned
        pinned = Pinned(name, buffer, device, chunk)
        _LIVE[key] = weakref.ref(pinned, functools.partial(_forget, key))
        return pinned


def _forget(key: tuple[int, int, str], ref: weakref.ref[Pinned]) -> None:
    if _LIVE.get(key) is ref:
        del _LIVE[key]


def cuda_reports_registered(address: int) -> bool:
    """Whether ``cudaPointerGetAttributes`` reports ``address`` as registered host memory."""
    note_cuda_use()
    attrs = _cuda.call("cudaPointerGetAttributes", int(address))
    rt = _cuda.runtime()
    return int(attrs.type) == int(rt.cudaMemoryType.cudaMemoryTypeHost)
