"""Parameter-server clients behind one batched interface, chosen by URL scheme.

>>> ps = connect("file:///tmp/emb", table="ctr_user", dim=128)        # doctest: +SKIP
>>> values, found = ps.lookup(torch.tensor([1, 2, 3]))                  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nvecache.common.lazy import lazy_names
from psclient.errors import (
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

if TYPE_CHECKING:
    from psclient.base import ParameterServer
    from psclient.feed import FeedBatch
    from psclient.registry import (
        connect,
        drop_orphans,
        list_orphans,
        list_tables,
        register_backend,
        schemes,
    )
    from psclient.schema import LAYOUT_VERSION, TableSchema

# NOTE: the names below are imported on first use (PEP 562), so `import psclient` (and every
# command line under it) loads torch only when something needs it.
__getattr__, __dir__ = lazy_names(__name__, globals(), {
    "ParameterServer": "psclient.base",
    "FeedBatch": "psclient.feed",
    "connect": "psclient.registry",
    "list_tables": "psclient.registry",
    "list_orphans": "psclient.registry",
    "drop_orphans": "psclient.registry",
    "register_backend": "psclient.registry",
    "schemes": "psclient.registry",
    "LAYOUT_VERSION": "psclient.schema",
    "TableSchema": "psclient.schema",
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
