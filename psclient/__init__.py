"""Parameter-server clients behind one batched interface, chosen by URL scheme.

>>> ps = connect("file:///tmp/emb", table="ctr_user", dim=128)        # doctest: +SKIP
>>> values, found = ps.lookup(torch.tensor([1, 2, 3]))                  # doctest: +SKIP
"""

from __future__ import annotations

from .base import ParameterServer
from .errors import (
    BadArgumentError,
    BadKeysError,
    BadValuesError,
    ChangeFeedGapError,
    CorruptValueError,
    DuplicateKeysError,
    HandleClosedError,
    NonFiniteValuesError,
    PSAuthError,
    PSClientError,
    PSServerError,
    PSTimeoutError,
    PSUnavailableError,
    SchemaMismatchError,
    TableNotFoundError,
    UnsupportedURLError,
)
from .feed import FeedBatch
from .registry import connect, list_tables, register_backend, schemes
from .schema import LAYOUT_VERSION, TableSchema

__all__ = [
    "LAYOUT_VERSION",
    "BadArgumentError",
    "BadKeysError",
    "BadValuesError",
    "ChangeFeedGapError",
    "CorruptValueError",
    "DuplicateKeysError",
    "FeedBatch",
    "HandleClosedError",
    "NonFiniteValuesError",
    "PSAuthError",
    "PSClientError",
    "PSServerError",
    "PSTimeoutError",
    "PSUnavailableError",
    "ParameterServer",
    "SchemaMismatchError",
    "TableNotFoundError",
    "TableSchema",
    "UnsupportedURLError",
    "connect",
    "list_tables",
    "register_backend",
    "schemes",
]
