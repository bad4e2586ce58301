"""The error root of the parameter-server clients and its meaningful subclasses.

Every error a user can cause raises one of these, with a message that says what to do.
Argument errors also subclass :class:`ValueError` (and :class:`TypeError` where the
argument has the wrong type), so generic handlers keep working. Errors from redis-py and
LMDB are wrapped (``raise ... from e``), never leaked raw.
"""

from __future__ import annotations


class PSClientError(Exception):
    """Root of every error raised by the ``psclient`` package."""


class BadArgumentError(PSClientError, ValueError):
    """An argument has the wrong value, shape, dtype or device; nothing was written."""


class BadKeysError(BadArgumentError, TypeError):
    """Keys are not a 1-D int64 CPU tensor; nothing was written."""


class BadValuesError(BadArgumentError, TypeError):
    """Values are not a ``[N, dim]`` CPU tensor of the table's dtype; nothing was written."""


class NonFiniteValuesError(BadValuesError):
    """Values hold NaN or infinite elements; nothing was written. Pass
    ``allow_nonfinite=True`` to store them anyway."""


class DuplicateKeysError(BadKeysError):
    """The keys of a load repeat; nothing was written. Load with ``duplicates="last"`` to let
    the last row of each key win."""


class UnsupportedURLError(BadArgumentError):
    """The URL scheme has no registered backend, or the URL cannot be parsed."""


class TableNotFoundError(PSClientError, LookupError):
    """The table does not exist and no ``dim`` was given to create it."""


class TableDroppedError(TableNotFoundError):
    """The table was dropped (or dropped and created anew) while this client used it.

    Nothing more was written: a write refused this way never re-creates the rows of the
    dropped table. Connect again to use the table of that name now.
    """


class TableLoadingError(PSClientError):
    """The table is still being created by a bulk load (its state is ``loading``).

    It opens once that load finishes; :attr:`loads` names the loads writing it.
    """

    def __init__(self, message: str, loads: list[dict[str, object]]) -> None:
        super().__init__(message)
        #: the loads registered with the table: ``{"pid", "host", "since"}`` each
        self.loads = loads


class SchemaMismatchError(PSClientError):
    """The stored table schema (dim, dtype, layout version, partitions) differs from the one
    asked for."""


class CorruptValueError(PSClientError):
    """A stored value or schema record is malformed (wrong length, undecodable)."""


class PSUnavailableError(PSClientError, ConnectionError):
    """The server (or file store) could not be reached after the configured retries."""


class PSTimeoutError(PSUnavailableError, TimeoutError):
    """The server did not answer within the configured socket timeout."""


class PSAuthError(PSClientError, PermissionError):
    """The server refused the credentials (wrong user/password, ACL or TLS settings)."""


class PSServerError(PSClientError):
    """The server answered an error (out of memory, read-only replica, wrong type, ...)."""


class ChangeFeedGapError(PSClientError):
    """The change-feed cursor fell off the feed's bounded end, or the table was cleared.

    Keys changed since the cursor can no longer be listed: the consumer must drop every
    cached row of the table and resume from :attr:`cursor`.
    """

    def __init__(self, message: str, cursor: str) -> None:
        super().__init__(message)
        #: the cursor to resume from after clearing every cached row of the table
        self.cursor = cursor


class HandleClosedError(PSClientError):
    """The client was closed; connect again to keep using the table."""
