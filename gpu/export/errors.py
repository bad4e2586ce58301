"""Typed errors of :mod:`gpu.export`: each one line, naming the table or file at fault."""

from __future__ import annotations

from gpu.errors import BadArgumentError, GPUError


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
