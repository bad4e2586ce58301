"""The error root of the ``gpu`` package and its meaningful subclasses.

Every error a user can cause raises one of these, with a message that says what to do.
Argument errors also subclass :class:`ValueError` so generic handlers keep working.
"""

from __future__ import annotations


class GPUError(Exception):
    """Root of every error raised by the ``gpu`` package."""


class BadArgumentError(GPUError, ValueError):
    """An argument has the wrong value, shape, dtype or device."""


class CUDAUnavailableError(GPUError):
    """A CUDA device was asked for but torch.cuda is not available in this process."""


class TritonUnavailableError(GPUError):
    """The Triton backend was asked for but the ``triton`` package cannot be imported."""


class KeyNotFoundError(GPUError, KeyError):
    """Keys missing from every tier of a layer that has no default row configured."""


class StorageUnavailableError(GPUError):
    """The layer's parameter server could not be reached for keys no cache holds."""


class StorageWriteError(GPUError):
    """A write to the layer's backing storage failed; no tier of the layer was changed."""
