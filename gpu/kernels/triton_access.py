"""Lazy, guarded access to Triton: the ``gpu`` package imports without it.

Kernel modules (``gpu/kernels/cache_lookup.py``, ``gpu/kernels/cache_insert.py``,
``gpu/kernels/host_tier.py``, and their shared helpers ``gpu/kernels/key_hash.py``) import
``triton`` at their top and are only loaded through :func:`kernel_module`, which builds
one of two variants of a module:

* compiled (``interpret=False``): ``@triton.jit`` functions compiled for CUDA tensors;
* interpreted (``interpret=True``): the same source decorated while Triton's interpreter
  knob is on, so the kernels run on CPU tensors (tests compare them with the torch twin
  on machines without a GPU).

NOTE: Triton decides compiled vs interpreted when ``@triton.jit`` decorates a function,
so both variants are separate module objects executed from the same file. A kernel module
that calls ``@triton.jit`` helpers of another file takes them from
:func:`helper_module`, the other file's variant of the same kind, never from a plain
import (which would hand a compiled helper to interpreted kernels, or the reverse).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import threading
from functools import cache
from pathlib import Path
from types import ModuleType

from gpu.errors import TritonUnavailableError

logger = logging.getLogger(__name__)

# NOTE: re-entrant: a kernel module being loaded loads its helper modules
_LOCK = threading.RLock()
#: whether Triton's per-process start-up work was done (triton_start.prime), once
_PRIMED: list[bool] = []


@cache
def triton_available() -> bool:
    """True if ``import triton`` works in this process."""
    try:  # NOTE: lazy: triton is optional (the torch twins run without it)
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or a broken install raising anything else
        logger.debug("triton is not importable: %s", e)
        return False
    from gpu.kernels import triton_start

    triton_start.install()  # NOTE: a fresh process loads kernels without re-hashing Triton
    return True


def kernel_module(stem: str, *, interpret: bool) -> ModuleType:
    """Load ``gpu/kernels/<stem>.py`` as a compiled or interpreted Triton kernel module.

    Args:
        stem: File name without ``.py`` inside the ``gpu`` package, e.g. ``"cache_lookup"``.
        interpret: Decorate the kernels for Triton's CPU interpreter instead of CUDA.

    Returns:
        The loaded module (cached per ``(stem, interpret)``).

    Raises:
        TritonUnavailableError: ``triton`` cannot be imported.
    """
    if not triton_available():
        raise TritonUnavailableError(
            "the Triton backend needs the triton package: `pip install triton` "
            "(or pass backend='torch' to use the torch implementation)"
        )
    name = f"{__package__}.{stem}" + ("_interpreted" if interpret else "")
    with _LOCK:
        mod = sys.modules.get(name)
        if mod is not None:
            return mod
        from triton import knobs  # NOTE: lazy: triton is optional (checked above)

        if not interpret and not _PRIMED:
            from gpu.kernels import triton_start

            triton_start.prime()  # NOTE: with the layer's construction, not its first lookup
            _PRIMED.append(True)
        path = Path(__file__).with_name(f"{stem}.py")
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:  # pragma: no cover - file shipped with us
            raise TritonUnavailableError(f"cannot load kernel module {path}")
        mod = importlib.util.module_from_spec(spec)
        previous = knobs.runtime.interpret
        knobs.runtime.interpret = interpret
        try:
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        finally:
            knobs.runtime.interpret = previous
        logger.debug("loaded %s (interpret=%s)", name, interpret)
        return mod


def helper_module(stem: str) -> ModuleType:
    """``gpu/kernels/<stem>.py`` in the variant (compiled or interpreted) being loaded now.

    Called at the top of a kernel module, while :func:`kernel_module` executes it, to get
    the ``@triton.jit`` helpers of another file decorated the same way as its own kernels.
    """
    from triton import knobs  # NOTE: lazy: triton is optional; only kernel modules call this

    return kernel_module(stem, interpret=bool(knobs.runtime.interpret))
