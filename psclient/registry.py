"""URL scheme -> backend factory, and :func:`connect`."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from nvecache.common import rows
from psclient.errors import BadArgumentError, UnsupportedURLError
from psclient.schema import check_table_name, dtype_name

if TYPE_CHECKING:
    import torch

    from psclient.base import ParameterServer

#: A backend factory: ``(url, table, dim, dtype_name, options) -> ParameterServer``.
Factory = Callable[[str, str, "int | None", "str | None", dict[str, Any]], "ParameterServer"]

# NOTE: values are "module:function" strings so a backend's dependencies load on first use.
_REGISTRY: dict[str, Factory | str] = {
    "redis": "psclient.redis.backend:open_standalone",
    "rediss": "psclient.redis.backend:open_standalone",
    "unix": "psclient.redis.backend:open_standalone",
    "redis+cluster": "psclient.redis.backend:open_cluster",
    "rediss+cluster": "psclient.redis.backend:open_cluster",
    "file": "psclient.file.backend:open_file",
}


#: A store's table lister: ``(url, options) -> sorted table names``.
Lister = Callable[[str, dict[str, Any]], list[str]]

_LISTERS: dict[str, Lister | str] = {
    "redis": "psclient.redis.admin:list_standalone",
    "rediss": "psclient.redis.admin:list_standalone",
    "unix": "psclient.redis.admin:list_standalone",
    "redis+cluster": "psclient.redis.admin:list_cluster",
    "rediss+cluster": "psclient.redis.admin:list_cluster",
    "file": "psclient.file.store:list_file_tables",
}

#: What a store holds that belongs to no table (left by an interrupted drop, or by an older
#: psclient): ``(url, options) -> {name: {"keys": n, "rows": n}}``, and its removal:
#: ``(url, table, options) -> {"keys": n, "rows": n}``. Backends without them have none.
_ORPHANS: dict[str, tuple[str, str]] = {
    **dict.fromkeys(("redis", "rediss", "unix"),
                    ("psclient.redis.admin:orphans_standalone",
                     "psclient.redis.admin:drop_orphans_standalone")),
    **dict.fromkeys(("redis+cluster", "rediss+cluster"),
                    ("psclient.redis.admin:orphans_cluster",
                     "psclient.redis.admin:drop_orphans_cluster")),
    "file": ("psclient.file.store:file_orphans", "psclient.file.store:drop_file_orphans"),
}


def register_backend(scheme: str, factory: Factory, lister: Lister | None = None) -> None:
    """Register (or replace) the backend for a URL scheme (and how to list its tables)."""
    _REGISTRY[scheme.lower()] = factory
    if lister is not None:
        _LISTERS[scheme.lower()] = lister
    else:
        _LISTERS.pop(scheme.lower(), None)


def schemes() -> list[str]:
    """The URL schemes that have a backend."""
    return sorted(_REGISTRY)


def _known(scheme: str) -> None:
    """Raise for a scheme without a backend, saying which schemes have one (imports none)."""
    if scheme not in _REGISTRY:
        raise UnsupportedURLError(
            f"no backend for URL scheme {scheme!r}: use one of {', '.join(schemes())}"
        )


def _factory(scheme: str) -> Factory:
    _known(scheme)
    factory: Factory = _resolve(_REGISTRY, scheme)
    return factory


def _resolve(table: dict[str, Any], scheme: str) -> Any:
    entry = table[scheme]
    if isinstance(entry, str):
        mod, fn = entry.split(":")
        entry = table[scheme] = getattr(importlib.import_module(mod), fn)
    return entry


def redact(url: str) -> str:
    """The URL without its password and query (for messages and logs)."""
    base = url.split("?", 1)[0]
    scheme, sep, rest = base.partition("://")
    netloc, slash, path = rest.partition("/")
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    return f"{scheme}{sep}{netloc}{slash}{path}"


def _scheme(url: object) -> str:
    if not isinstance(url, str) or "://" not in url:
        raise UnsupportedURLError(f"bad URL {url!r}: expected scheme://..., e.g. file:///path")
    return urlsplit(url).scheme.lower()


def list_tables(url: str, **options: Any) -> list[str]:
    """The names of the tables a store holds, sorted.

    Args:
        url: a store URL, as for :func:`connect`.
        **options: backend options, as for :func:`connect`.

    Raises:
        UnsupportedURLError: unknown scheme, unparsable URL, or a backend that cannot list.
        PSUnavailableError, PSAuthError: the store cannot be reached or refuses us.
    """
    scheme = _scheme(url)
    _known(scheme)
    if scheme not in _LISTERS:
        raise UnsupportedURLError(f"the {scheme}:// backend cannot list its tables")
    names: list[str] = _resolve(_LISTERS, scheme)(url, dict(options))
    return names


def _orphan_fn(url: str, which: int) -> Any:
    scheme = _scheme(url)
    _known(scheme)
    if scheme not in _ORPHANS:
        return None
    mod, fn = _ORPHANS[scheme][which].split(":")
    return getattr(importlib.import_module(mod), fn)


def list_orphans(url: str, **options: Any) -> dict[str, dict[str, int]]:
    """Data a store holds under a table name that has no table (no schema): left by a drop
    that was interrupted, or by an older psclient. ``psclient ls`` lists it.

    Returns:
        ``{name: {"keys": store keys or records, "rows": rows}}``, sorted by name.

    Raises:
        UnsupportedURLError, PSUnavailableError, PSAuthError: as for :func:`list_tables`.
    """
    fn = _orphan_fn(url, 0)
    found: dict[str, dict[str, int]] = {} if fn is None else fn(url, dict(options))
    return dict(sorted(found.items()))


def drop_orphans(url: str, table: str, **options: Any) -> dict[str, int]:
    """Remove the data :func:`list_orphans` lists under ``table`` (nothing when ``table``
    is a table: drop it instead).

    Returns:
        ``{"keys": n, "rows": n}`` removed (zeros: there was none).
    """
    table = check_table_name(table)
    fn = _orphan_fn(url, 1)
    gone: dict[str, int] = {"keys": 0, "rows": 0} if fn is None else \
        fn(url, table, dict(options))
    return gone


def connect(url: str, *, table: str, dim: int | None = None,
            dtype: torch.dtype | str | None = None, loading: bool = False,
            partial: bool = False, **options: Any) -> ParameterServer:
    """Open (or create) a parameter-server table.

    Args:
        url: ``redis://[user:pass@]host:port/db``, ``rediss://...`` (TLS),
            ``unix:///path/redis.sock``, ``redis+cluster://host:port[,host:port]``,
            or ``file:///path/to/dir`` (embedded LMDB store, no server).
        table: table name: 1-100 characters from ``[A-Za-z0-9_.-]``, not ``.`` or ``..``
            (:mod:`nvecache.common.names`, the rule of every tier).
        dim: row length; required to create a table, checked against an existing one.
        dtype: float32 (default for new tables), float16, bfloat16 or float64, or a
            quantized format: ``torch.int8`` / ``"int8"`` (row-wise int8 with a float32
            scale and bias) or ``torch.float8_e4m3fn`` / ``"float8_e4m3fn"`` / ``"fp8"``
            (fp8 with a float32 scale), whose writes take float rows and quantize them
            and whose lookups return them dequantized as float32 (docs/psclient.md,
            "Quantized tables"); checked against an existing table.
        loading: open for a bulk load (:meth:`ParameterServer.load`): a missing table is
            created ``loading`` (readers get :class:`TableLoadingError` until a load
            publishes it), a ``loading`` one is joined (docs/psclient.md, "Loading a new
            table").
        partial: open the table whatever its state (``loading``, or being created or
            dropped): to inspect or drop it.
        **options: backend options (see docs/psclient.md), e.g. ``password``,
            ``socket_timeout``, ``partitions``, ``map_size``. Unknown options raise.

    Returns:
        The table's :class:`ParameterServer`.

    Raises:
        UnsupportedURLError: unknown scheme or unparsable URL.
        TableNotFoundError: the table does not exist and ``dim`` was not given.
        TableLoadingError: the table is ``loading`` (without ``loading``/``partial``).
        TableDroppedError: the table was dropped while this call opened it.
        SchemaMismatchError: the table exists with another dim/dtype/partition count.
        PSUnavailableError, PSAuthError: the store cannot be reached or refuses us.
    """
    scheme = _scheme(url)
    table = check_table_name(table)
    dt = None if dtype is None else dtype_name(dtype, rows.FORMATS)
    if dim is not None and (not isinstance(dim, int) or isinstance(dim, bool) or dim <= 0):
        raise BadArgumentError(f"dim must be a positive int, got {dim!r}")
    if loading and partial:
        raise BadArgumentError("pass loading=True or partial=True, not both")
    mode = {"loading": True} if loading else {"partial": True} if partial else {}
    return _factory(scheme)(url, table, dim, dt, {**options, **mode})
