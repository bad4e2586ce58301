"""URL scheme -> backend factory, and :func:`connect`."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import torch

from .base import ParameterServer
from .errors import UnsupportedURLError
from .schema import check_table_name, dtype_name

#: A backend factory: ``(url, table, dim, dtype_name, options) -> ParameterServer``.
Factory = Callable[[str, str, "int | None", "str | None", dict[str, Any]], ParameterServer]

# NOTE: values are "module:function" strings so a backend's dependencies load on first use.
_REGISTRY: dict[str, Factory | str] = {
    "redis": "psclient.redis_backend:open_standalone",
    "rediss": "psclient.redis_backend:open_standalone",
    "unix": "psclient.redis_backend:open_standalone",
    "redis+cluster": "psclient.redis_backend:open_cluster",
    "rediss+cluster": "psclient.redis_backend:open_cluster",
    "file": "psclient.file_backend:open_file",
}


def register_backend(scheme: str, factory: Factory) -> None:
    """Register (or replace) the backend for a URL scheme."""
    _REGISTRY[scheme.lower()] = factory


def schemes() -> list[str]:
    """The URL schemes that have a backend."""
    return sorted(_REGISTRY)


def _factory(scheme: str) -> Factory:
    entry = _REGISTRY.get(scheme)
    if entry is None:
        raise UnsupportedURLError(
            f"no backend for URL scheme {scheme!r}: use one of {', '.join(schemes())}"
        )
    if isinstance(entry, str):
        mod, fn = entry.split(":")
        entry = getattr(importlib.import_module(mod), fn)
        _REGISTRY[scheme] = entry
    return entry


def connect(url: str, *, table: str, dim: int | None = None,
            dtype: torch.dtype | str | None = None, **options: Any) -> ParameterServer:
    """Open (or create) a parameter-server table.

    Args:
        url: ``redis://[user:pass@]host:port/db``, ``rediss://...`` (TLS),
            ``unix:///path/redis.sock``, ``redis+cluster://host:port[,host:port]``,
            or ``file:///path/to/dir`` (embedded LMDB store, no server).
        table: table name, ``[A-Za-z0-9_.-]{1,100}``.
        dim: row length; required to create a table, checked against an existing one.
        dtype: float32 (default for new tables), float16, bfloat16 or float64; checked
            against an existing table.
        **options: backend options (see docs/psclient.md), e.g. ``password``,
            ``socket_timeout``, ``partitions``, ``map_size``. Unknown options raise.

    Returns:
        The table's :class:`ParameterServer`.

    Raises:
        UnsupportedURLError: unknown scheme or unparsable URL.
        TableNotFoundError: the table does not exist and ``dim`` was not given.
        SchemaMismatchError: the table exists with another dim/dtype/partition count.
        PSUnavailableError, PSAuthError: the store cannot be reached or refuses us.
    """
    if not isinstance(url, str) or "://" not in url:
        raise UnsupportedURLError(f"bad URL {url!r}: expected scheme://..., e.g. file:///path")
    scheme = urlsplit(url).scheme.lower()
    table = check_table_name(table)
    dt = None if dtype is None else dtype_name(dtype)
    if dim is not None and (not isinstance(dim, int) or isinstance(dim, bool) or dim <= 0):
        from .errors import BadArgumentError

        raise BadArgumentError(f"dim must be a positive int, got {dim!r}")
    return _factory(scheme)(url, table, dim, dt, dict(options))
