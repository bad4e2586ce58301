"""Parameter-server clients behind one batched interface, chosen by URL scheme.

>>> ps = connect("file:///tmp/emb", table="ctr_user", dim=128)        # doctest: +SKIP
>>> values, found = ps.lookup(torch.tensor([1, 2, 3]))                  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
    TableDroppedError,
    TableLoadingError,
    TableNotFoundError,
    UnsupportedURLError,
)
from .lazy import lazy_names

if TYPE_CHECKING:
    from .base import ParameterServer
    from .feed import FeedBatch
    from .registry import (
        connect,
        drop_orphans,
        list_orphans,
        list_tables,
        register_backend,
        schemes,
    )
    from .schema import LAYOUT_VERSION, TableSchema

# NOTE: the names below are imported on first use (PEP 562), so `import psclient` (and every
# command line under it) loads torch only when something needs it.
__getattr__, __dir__ = lazy_names(__name__, globals(), {
    "ParameterServer": ".base",
    "FeedBatch": ".feed",
    "connect": ".registry",
    "list_tables": ".registry",
    "list_orphans": ".registry",
    "drop_orphans": ".registry",
    "register_backend": ".registry",
    "schemes": ".registry",
    "LAYOUT_VERSION": ".schema",
    "TableSchema": ".schema",
})

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
    "TableDroppedError",
    "TableLoadingError",
    "TableNotFoundError",
    "TableSchema",
    "UnsupportedURLError",
    "connect",
    "drop_orphans",
    "list_orphans",
    "list_tables",
    "register_backend",
    "schemes",
]
