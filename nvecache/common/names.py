"""The one rule for table names, shared by every tier (psclient, hostcache, gpu).

A table name is 1-100 characters from ``[A-Za-z0-9_.-]`` and is neither ``.`` nor ``..``.
The same name is a Redis hash tag (``psc:{T}:schema``), an LMDB database name
(``rows:T``) and a file name in ``/dev/shm`` (``nvec.T``), so one rule keeps a table
nameable in every tier. Each package raises its own typed error from its own root
(``psclient.BadArgumentError``, ``hostcache.BadNameError``); the rule itself lives here,
in the lowest tier, and nowhere else.
"""

from __future__ import annotations

import re
from typing import TypeGuard

#: what a valid table name looks like, said the way error messages say it
TABLE_NAME_RULE = "1-100 characters from [A-Za-z0-9_.-], and not '.' or '..'"

_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,100}")


def is_table_name(name: object) -> TypeGuard[str]:
    """Whether ``name`` is a valid table name (see :data:`TABLE_NAME_RULE`)."""
    return isinstance(name, str) and bool(_NAME_RE.fullmatch(name)) and name not in (".", "..")
