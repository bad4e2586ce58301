"""The error root of the ``gpu`` package and its meaningful subclasses.

Every error a user can cause raises one of these, with a message that says what to do.
Argument errors also subclass :class:`ValueError` so generic handlers keep working. The
modules that raise them re-export their own (``gpu.cuda.registration.RegistrationClosedError``,
``gpu.dist.groups.GroupError``, ...), so either name works.
"""

from __future__ import annotations


class GPUError(Exception):
    """Root of every error raised by the ``gpu`` package."""


class BadArgumentError(GPUError, ValueError):
    """An argument has the wrong value, shape, dtype or device."""


class NonFiniteValuesError(BadArgumentError):
    """Rows to write hold NaN or infinite values; nothing was written. Pass
    ``allow_nonfinite=True`` to write them anyway."""


class StateDictError(BadArgumentError):
    """A checkpoint does not fit a layer (shape, dtype, layer type, the tables it names,
    rows that are not finite); nothing of the layer was written (``gpu.state``)."""


class CUDAUnavailableError(GPUError):
    """A CUDA device was asked for but torch.cuda is not available in this process."""


class TritonUnavailableError(GPUError):
    """The Triton backend was asked for but the ``triton`` package cannot be imported."""


class TritonNotInstalledError(TritonUnavailableError):
    """The host-tier kernels were asked for (``gpu.kernels.host_reads``, ``backend="triton"``) but
    ``triton`` cannot be imported."""


class KeyNotFoundError(GPUError, KeyError):
    """Keys missing from every tier of a layer that has no default row configured."""


class StorageUnavailableError(GPUError):
    """The layer's parameter server could not be reached for keys no cache holds."""


class StorageWriteError(GPUError):
    """A write to the layer's backing storage failed; no tier of the layer was changed."""


class LayerClosedError(GPUError):
    """A layer was used after ``close()``; build a new layer to keep serving."""


# -- CUDA runtime calls (gpu.cuda.runtime) --------------------------------------------------------


class CUDACallError(GPUError):
    """A CUDA runtime call returned an error code.

    Attributes:
        call: the runtime function, e.g. ``"cudaHostRegister"``.
        error: the error's name, e.g. ``"cudaErrorHostMemoryAlreadyRegistered"``.
        code: the numeric ``cudaError_t``.
    """

    def __init__(self, call: str, error: str, code: int, detail: str = "") -> None:
        self.call = call
        self.error = error
        self.code = code
        msg = f"{call} failed with {error} ({code})"
        super().__init__(f"{msg}: {detail}" if detail else msg)


# -- host registration (gpu.cuda.registration) ----------------------------------------


class HostRegError(GPUError):
    """Root of the registration errors."""


class RegistrationClosedError(HostRegError):
    """The registration handle was closed; register the table again to keep using it."""


class HostRegisterUnsupportedError(HostRegError):
    """The device cannot map registered host memory (``cudaDevAttrHostRegisterSupported``)."""


class ForkedProcessError(HostRegError):
    """CUDA state was inherited through ``fork()``; start workers with ``spawn`` instead."""


class ViewNotAvailableError(HostRegError, ValueError):
    """The table has no such region (e.g. ``keys`` of a linear table)."""


# -- multi-GPU tables (gpu.dist.distmem, gpu.dist.groups, gpu.dist.vmm) --------------------


class DestructionOrderError(GPUError):
    """A memblock was closed out of order (a layer, a later memblock or no group left)."""


class GroupError(GPUError):
    """The processes of a group could not agree or reach each other."""


class VMMError(GPUError):
    """A virtual-memory call failed (CUDA driver or the operating system)."""


class PeerAccessError(VMMError):
    """A device cannot reach another device's memory (no peer access between them)."""


# -- exported models (gpu.export) ---------------------------------------------------------


class ExportError(GPUError):
    """A model could not be exported, or an export directory could not be loaded."""


class MissingTableError(ExportError):
    """A shared table the exported model reads (a SharedMemBlock, a host cache, a
    parameter-server table) does not exist on this node; nothing was loaded."""


class FormatVersionError(ExportError):
    """The export directory was written by a newer version of the format than this
    library reads; nothing was loaded."""


class ShapeMismatchError(ExportError, BadArgumentError):
    """A table's geometry (rows, dim, dtype) is not the one the exported model was built
    over; nothing was loaded."""
