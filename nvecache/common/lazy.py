"""Modules imported on first use, so a path that never needs them does not load them.

The command lines (``psclient ls``, ``hostcache stat``, ``--help``) read a store's schema or
a segment's header and print it; torch and numba, whose imports take seconds, are only for
the rows. A module that needs such a module for its rows binds a stand-in instead::

    if TYPE_CHECKING:
        import torch
    else:
        torch = lazy_import("torch", globals())

The first attribute read through the stand-in imports the module and puts it in the
stand-in's place in that namespace, so every later read is a plain global lookup. A
function imported by name (``from .loader import open_rows``) becomes
``open_rows = deferred("psclient.loader", "open_rows")`` in the same ``else:`` branch, and a
package re-exports its heavy names on first use with :func:`lazy_names` (PEP 562).
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable
from typing import Any

__all__ = ["deferred", "lazy_import", "lazy_names"]


class _Stand(types.ModuleType):
    """Stands for a module not imported yet (see :func:`lazy_import`)."""

    def __init__(self, name: str, namespace: dict[str, Any], alias: str,
                 preset: types.ModuleType | None) -> None:
        super().__init__(name)
        if preset is not None:
            self.__dict__.update({k: v for k, v in vars(preset).items() if k[0] != "_"})
        self._lazy_namespace = namespace
        self._lazy_alias = alias

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_lazy_"):  # NOTE: not set yet (mid-construction): no import
            raise AttributeError(attr)
        module = importlib.import_module(self.__name__)
        if self._lazy_namespace.get(self._lazy_alias) is self:
            self._lazy_namespace[self._lazy_alias] = module
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<module {self.__name__!r} (not imported yet)>"


def lazy_import(name: str, namespace: dict[str, Any], alias: str | None = None,
                preset: types.ModuleType | None = None) -> Any:
    """A stand-in for module ``name`` that imports it on the first attribute read.

    Args:
        name: the module's absolute name, e.g. ``"torch"`` or ``"psclient.file.mirror_loops"``.
        namespace: the ``globals()`` of the module that binds the stand-in; the real module
            replaces the stand-in there once imported.
        alias: the global name the stand-in is bound to (default: the last part of
            ``name``).
        preset: a module cheap to import whose public names the module re-exports (its
            constants): the stand-in answers them itself, without importing the module.

    Returns:
        The stand-in (a module object; bind it to ``alias``).
    """
    return _Stand(name, namespace, alias or name.rpartition(".")[2], preset)


def deferred(module: str, name: str) -> Callable[..., Any]:
    """A function that imports ``module`` on its first call and calls its function ``name``.

    Args:
        module: the module's absolute name, e.g. ``"psclient.loader"``.
        name: the function's name in it.
    """
    target: list[Callable[..., Any]] = []

    def call(*args: Any, **kwargs: Any) -> Any:
        if not target:
            target.append(getattr(importlib.import_module(module), name))
        return target[0](*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"``{module}.{name}``, imported on the first call."
    return call


def lazy_names(package: str, namespace: dict[str, Any], names: dict[str, str]
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` (PEP 562) for names imported on first use.

    Args:
        package: the package's ``__name__``.
        namespace: its ``globals()``; a name, once imported, is put there (later reads are
            plain lookups).
        names: each name -> the module (relative to ``package``) that defines it.

    Returns:
        ``(__getattr__, __dir__)``, to bind at the package's top level.
    """

    def __getattr__(name: str) -> Any:  # noqa: N807 - the module hook's own name
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:  # noqa: N807 - the module hook's own name
        return sorted({*namespace, *names})

    return __getattr__, __dir__
