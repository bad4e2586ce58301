"""Redis connection options: parse URL + keyword options, build clients, map errors.

Connection options (URL query or ``connect(**options)``; keywords win):

- ``username``, ``password``: ACL credentials (also ``redis://user:pass@host``).
- ``db``: database number (standalone only; also the URL path ``/0``).
- ``socket_timeout`` (default 2.0 s), ``socket_connect_timeout`` (default 2.0 s).
- ``retries`` (default 2), ``backoff_base`` (0.02 s), ``backoff_cap`` (0.5 s): build a
  ``redis.retry.Retry(ExponentialBackoff(cap, base), retries)``; or pass ``retry=Retry(...)``.
  Worst case before a typed error: ``(retries + 1) * socket_timeout`` plus the backoff.
- ``health_check_interval`` (default 30 s): PING an idle connection before reusing it.
- TLS (``rediss://``): ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs``,
  ``ssl_check_hostname``.
- ``max_connections``, ``client_name``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
import redis.exceptions as rex
from redis.backoff import ExponentialBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from psclient.errors import (
    BadArgumentError,
    PSAuthError,
    PSClientError,
    PSServerError,
    PSTimeoutError,
    PSUnavailableError,
    UnsupportedURLError,
)
from psclient.registry import redact

__all__ = ["TABLE_OPTIONS", "cluster_factory", "redact", "redis_errors", "split_options",
           "standalone_factory"]

#: psclient's own options (not passed to redis-py), with their types.
TABLE_OPTIONS: dict[str, type] = {
    "partitions": int, "chunk_keys": int, "pipeline_keys": int, "inline_keys": int,
    "at_once_keys": int,
    "changes_maxlen": int, "feed_entry_keys": int, "prefix": str, "max_workers": int,
    "feed_sweep_ms": int, "redirect_retries": int, "upgrade": bool,
}
_CONN_OPTIONS: dict[str, type] = {
    "username": str, "password": str, "db": int, "socket_timeout": float,
    "socket_connect_timeout": float, "retries": int, "backoff_base": float,
    "backoff_cap": float, "health_check_interval": float, "ssl_ca_certs": str,
    "ssl_certfile": str, "ssl_keyfile": str, "ssl_cert_reqs": str,
    "ssl_check_hostname": bool, "max_connections": int, "client_name": str, "retry": object,
}


def _coerce(name: str, value: Any, typ: type) -> Any:
    if typ is object or isinstance(value, typ):
        return value
    try:
        if typ is bool:
            return str(value).lower() in ("1", "true", "yes", "on")
        return typ(value)
    except (TypeError, ValueError) as e:
        raise BadArgumentError(f"option {name}={value!r} must be {typ.__name__}") from e


def split_options(url: str, options: dict[str, Any]) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Split URL query and keyword options into (url without query, table opts, conn opts).

    Raises:
        BadArgumentError: an unknown option or a value of the wrong type.
    """
    parts = urlsplit(url)
    merged: dict[str, Any] = dict(parse_qsl(parts.query))
    merged.update(options)
    table: dict[str, Any] = {}
    conn: dict[str, Any] = {}
    for name, value in merged.items():
        if name in TABLE_OPTIONS:
            table[name] = _coerce(name, value, TABLE_OPTIONS[name])
        elif name in _CONN_OPTIONS:
            conn[name] = _coerce(name, value, _CONN_OPTIONS[name])
        else:
            known = sorted(TABLE_OPTIONS) + sorted(_CONN_OPTIONS)
            raise BadArgumentError(f"unknown Redis option {name!r}: use one of {known}")
    # NOTE: not urlunsplit: it turns unix:///path into unix:/path
    return url.split("?", 1)[0], table, conn


def _redis_kwargs(conn: dict[str, Any]) -> dict[str, Any]:
    kw = dict(conn)
    retry = kw.pop("retry", None)
    retries = kw.pop("retries", 2)
    base = kw.pop("backoff_base", 0.02)
    cap = kw.pop("backoff_cap", 0.5)
    if retry is None:
        retry = Retry(ExponentialBackoff(cap=cap, base=base), retries)
    elif not isinstance(retry, Retry):
        raise BadArgumentError("retry= must be a redis.retry.Retry object")
    kw["retry"] = retry
    kw.setdefault("socket_timeout", 2.0)
    kw.setdefault("socket_connect_timeout", 2.0)
    kw.setdefault("health_check_interval", 30.0)
    return kw


def standalone_factory(url: str, conn: dict[str, Any]) -> Any:
    """A zero-argument callable that builds a ``redis.Redis`` for ``url`` (reused after fork)."""
    kw = _redis_kwargs(conn)
    try:
        redis.connection.parse_url(url)
    except ValueError as e:
        raise UnsupportedURLError(f"bad Redis URL {redact(url)!r}: {e}") from e
    parts = urlsplit(url)
    if parts.scheme.lower() in ("redis", "rediss"):
        # NOTE: redis-py reads a path that is not a number as db 0, silently; refuse it.
        db = unquote(parts.path).removeprefix("/")
        if db and not (db.isascii() and db.isdigit()):
            raise UnsupportedURLError(
                f"bad Redis URL {redact(url)!r}: the path must be a database number, "
                f"like redis://host:6379/0 (got {'/' + db!r})"
            )
    return lambda: redis.Redis.from_url(url, **kw)


def cluster_factory(url: str, conn: dict[str, Any]) -> Any:
    """A zero-argument callable that builds a ``RedisCluster`` for a ``redis+cluster://`` URL."""
    parts = urlsplit(url)
    kw = _redis_kwargs(conn)
    if kw.pop("db", 0) or unquote(parts.path).strip("/") not in ("", "0"):
        raise UnsupportedURLError(
            f"bad Redis Cluster URL {redact(url)!r}: a cluster has only db 0; "
            "use redis+cluster://host:port[,host:port] (no path, no db option)"
        )
    netloc = parts.netloc
    if "@" in netloc:
        cred, netloc = netloc.rsplit("@", 1)
        user, _, pw = cred.partition(":")
        if user:
            kw.setdefault("username", unquote(user))
        if pw:
            kw.setdefault("password", unquote(pw))
    nodes = []
    for hp in filter(None, netloc.split(",")):
        host, _, port = hp.rpartition(":")
        try:
            nodes.append(ClusterNode(host or "127.0.0.1", int(port or 6379)))
        except ValueError as e:
            raise UnsupportedURLError(f"bad cluster node {hp!r} in {url!r}: use host:port") from e
    if not nodes:
        raise UnsupportedURLError(f"{url!r} names no nodes: use redis+cluster://host:port[,...]")
    if parts.scheme.startswith("rediss"):
        kw["ssl"] = True
    return lambda: RedisCluster(startup_nodes=nodes, **kw)


@contextlib.contextmanager
def redis_errors(where: str) -> Iterator[None]:
    """Translate redis-py exceptions into psclient's typed errors."""
    try:
        yield
    except PSClientError:
        raise
    except (rex.AuthenticationError, rex.AuthorizationError, rex.NoPermissionError) as e:
        raise PSAuthError(f"{where}: the server refused the credentials ({e}): check "
                          "username/password/ACL") from e
    except rex.TimeoutError as e:
        raise PSTimeoutError(f"{where}: no answer within the socket timeout ({e}); "
                             "is the server overloaded or down?") from e
    except (rex.ConnectionError, rex.ClusterDownError, rex.ClusterError) as e:
        raise PSUnavailableError(f"{where}: cannot reach Redis ({e}); check that it runs and "
                                 "the URL is right, then retry") from e
    except rex.ResponseError as e:
        if "NOAUTH" in str(e) or "WRONGPASS" in str(e):
            raise PSAuthError(f"{where}: {e}: pass password= (and username=)") from e
        raise PSServerError(f"{where}: the server answered an error: {e}") from e
    except rex.RedisError as e:
        raise PSServerError(f"{where}: {type(e).__name__}: {e}") from e
    except rex.RedisClusterException as e:  # NOTE: not a RedisError; raised by RedisCluster()
        if "not enabled" in str(e):
            raise PSUnavailableError(
                f"{where}: the server is not a Redis Cluster (cluster mode is not enabled): "
                "use redis://host:port/0 for a single server"
            ) from e
        raise PSUnavailableError(f"{where}: cannot reach the Redis Cluster ({e}); check that "
                                 "its nodes run and the URL names them, then retry") from e
    except OSError as e:  # TLS file errors, etc.
        raise PSUnavailableError(f"{where}: {e}") from e
