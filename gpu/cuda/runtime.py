"""Checked calls into CUDA's runtime through cuda-python (``cuda.bindings.runtime``).

cuda-python returns ``(cudaError_t, *results)`` tuples instead of raising. :func:`call`
turns every non-success code into a typed :class:`CUDACallError` naming the call and the
error, after clearing the (non-sticky) error with ``cudaGetLastError`` so that the next,
unrelated CUDA call in the process does not report it again.

Only the host registration (:mod:`gpu.cuda.pinning`, :mod:`gpu.cuda.registration`) uses this
module; it imports cuda-python only when a call is made (:func:`runtime`), so the package imports on
machines without it. :class:`CUDACallError` lives in :mod:`gpu.errors` (importable from
here too).
"""

from __future__ import annotations

import logging
from functools import cache
from types import ModuleType
from typing import Any

from gpu.errors import CUDACallError, CUDAUnavailableError

logger = logging.getLogger(__name__)


@cache
def runtime() -> ModuleType:
    """The ``cuda.bindings.runtime`` module (older cuda-python: ``cuda.cudart``).

    Raises:
        CUDAUnavailableError: cuda-python is not installed.
    """
    try:  # NOTE: lazy: cuda-python is an optional dependency, needed only on CUDA machines
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart  # cuda-python < 12.6
        except ImportError as e:
            raise CUDAUnavailableError(
                "registering host memory with CUDA needs cuda-python: "
                "`pip install 'cuda-python>=12.6'` (match your driver's CUDA major version), "
                "or use device='cpu'"
            ) from e
    return cudart


def error_name(code: Any) -> str:
    """The name of a ``cudaError_t`` (falls back to its number)."""
    cudart = runtime()
    try:
        err, name = cudart.cudaGetErrorName(code)
        if int(err) == 0 and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - only used to format a message
        pass
    return getattr(code, "name", str(code))


def call(name: str, *args: Any, detail: str = "") -> Any:
    """Call ``cudart.<name>(*args)``; return its result(s); raise on any error code.

    Returns:
        ``None`` when the call returns only an error code, its one result, or a tuple.

    Raises:
        CUDACallError: the call returned anything but ``cudaSuccess``.
    """
    cudart = runtime()
    ret = getattr(cudart, name)(*args)
    if not isinstance(ret, tuple):
        ret = (ret,)
    code = ret[0]
    if int(code) != 0:
        # NOTE: clear the error so it is not reported again by the next CUDA call.
        cudart.cudaGetLastError()
        raise CUDACallError(name, error_name(code), int(code), detail)
    rest = ret[1:]
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest
