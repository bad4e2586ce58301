"""The applications' errors: one root, :class:`AppError`, under ``HostCacheError``.

The apps run as ``hostcache`` subcommands, whose CLI prints any ``HostCacheError`` as one
``hostcache: error: ...`` line and exits 2; rooting the apps' errors there keeps that true
and lets library callers catch them as they always did.
"""

from __future__ import annotations

from hostcache.errors import HostCacheError


class AppError(HostCacheError):
    """Root of the errors of the demo and the node service."""


class MissingExtraError(AppError):
    """A dependency of the ``apps`` extra (matplotlib, prometheus-client) is not installed."""


class DemoError(AppError):
    """The demo could not run to the end (a replica failed, or it was interrupted)."""


class DemoInterruptedError(DemoError):
    """Ctrl-C or SIGTERM: the demo stopped early and cleaned up."""


class ServiceConfigError(AppError, ValueError):
    """The node config has a bad or missing field; nothing was created."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"config field {field_name}: {message}")
        #: the dotted path of the bad field, e.g. ``hostcache[0].capacity``
        self.field = field_name


class ServiceRunningError(AppError):
    """Another ``hostcache serve`` holds this state dir's lock (one service per node)."""


class PSTableMissingError(AppError, LookupError):
    """A table's parameter-server table does not exist and its config does not create it."""


__all__ = [
    "AppError",
    "DemoError",
    "DemoInterruptedError",
    "MissingExtraError",
    "PSTableMissingError",
    "ServiceConfigError",
    "ServiceRunningError",
]
